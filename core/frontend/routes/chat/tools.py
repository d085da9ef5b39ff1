"""A chat request's tools: `tool_choice` checked against the tools offered, and the JSON
schema a forced call is generated under (the request's output constraint,
frontend/constraints.py)."""

from __future__ import annotations

from typing import Any

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.protocol import NamedToolChoice, Tool
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest

# A function without a parameters schema takes any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_tools(body: ChatCompletionRequest) -> None:
    """tool_choice names an offered tool, and needs tools unless it is "none"."""
    choice = body.effective_tool_choice
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: two tools have the same name", "tools")
    if choice in ("required", "auto") and body.tool_choice is not None and not names:
        raise InvalidRequest(f'tool_choice "{choice}" needs tools', "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        offered = ", ".join(names) or "none"
        raise InvalidRequest(
            f"tool_choice names the function {choice.function.name!r}, which is not among "
            f"the tools (offered: {offered})",
            "tool_choice",
        )


def forced_tool_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced tool call is generated under: for a named function, its
    parameters; for "required", an array of calls `{"name": …, "parameters": {…}}`, at
    least one (exactly one without parallel_tool_calls). None unless a call is forced."""
    choice = body.effective_tool_choice
    tools = body.tools or []
    if isinstance(choice, NamedToolChoice):
        [tool] = [t for t in tools if t.function.name == choice.function.name]
        return _parameters(tool)
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT
