"""The one output constraint of a request, from whichever field asked for it.

OpenAI's `response_format`, vLLM's `structured_outputs` extra, its older `guided_*`
fields and a forced tool call (`tool_choice` "required" or a named function) all become
one StructuredOutputsParams, which the engine compiles with the stack's structured-output
backend. A request may ask for one constraint at most. The backend's `validate` runs
here, so a bad schema, regex or grammar is a 400 before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    StructuredOutputsRequest,
    Tool,
)
from plugserve.interfaces import StructuredOutputBackend
from plugserve.sampling_params import StructuredOutputsParams

# A function without a parameters schema takes any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def request_constraint(
    body: ChatCompletionRequest | CompletionRequest,
    backend: type[StructuredOutputBackend] | None,
) -> StructuredOutputsParams | None:
    """The request's constraint, validated by `backend` (None: no backend to ask, the
    engine reports what it cannot compile); None when the output is free."""
    found = _constraints(body)
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequest(
            f"a request takes at most one output constraint; this one sets {names}",
            found[1][0],
        )
    if not found:
        return None
    field, build = found[0]
    try:
        spec = build()
        if backend is not None:
            backend.validate(spec)
    except ValueError as exc:
        raise InvalidRequest(f"{field}: {exc}", field) from exc
    return spec


def _constraints(body: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, Any]]:
    """(field, builder) for every field of the request that constrains the output."""
    found: list[tuple[str, Any]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", lambda: StructuredOutputsParams(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_

        def from_schema() -> StructuredOutputsParams:
            if schema is None:
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=_schema_text(schema))

        found.append(("response_format", from_schema))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        found.append(("structured_outputs", lambda: _from_structured_outputs(so)))
    guided = {
        "guided_json": lambda v: StructuredOutputsParams(json=_schema_text(v)),
        "guided_regex": lambda v: StructuredOutputsParams(regex=v),
        "guided_choice": lambda v: StructuredOutputsParams(choice=list(v)),
        "guided_grammar": lambda v: StructuredOutputsParams(grammar=v),
    }
    for name, make in guided.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, lambda make=make, value=value: make(value)))
    if isinstance(body, ChatCompletionRequest):
        tool_schema = forced_tool_schema(body)
        if tool_schema is not None:
            spec = StructuredOutputsParams(json=json.dumps(tool_schema))
            found.append(("tool_choice", lambda: spec))
    return found


def _from_structured_outputs(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=None if so.json_ is None else _schema_text(so.json_),
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
    )


def _schema_text(schema: dict[str, Any] | str) -> str:
    """A JSON schema as the engine takes it (serialized); a string must be JSON."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict | bool):
            raise ValueError("a JSON schema is an object (or true / false)")
        return schema
    return json.dumps(schema)


# ------------------------------------------------------------------ tools


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
