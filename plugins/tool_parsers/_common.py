"""What the bundled tool parsers share: a call from a parsed JSON object, and how much
of a streamed text may still turn out to be the start of a marker."""

from __future__ import annotations

import json
from typing import Any

from plugserve.interfaces.frontend import ToolCall


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": ..., <argument key>: {...}} → a ToolCall (arguments as JSON text); None
    for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def partial_marker_len(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `marker`: text a
    streaming parser must hold back until the next delta says whether it is the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
