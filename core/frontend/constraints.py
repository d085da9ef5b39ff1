"""The one output constraint of a request, from whichever field asked for it.

OpenAI's `response_format`, vLLM's `structured_outputs` extra, its older `guided_*`
fields and a forced tool call (chat's `tool_choice` "required" or a named function,
routes/chat/tools.py) all become one StructuredOutputsParams, which the engine compiles
with the stack's structured-output backend. A request may ask for one constraint at most. The backend's `validate` runs
here, so a bad schema, regex or grammar is a 400 before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.protocol import SamplingRequest, StructuredOutputsRequest
from plugserve.interfaces.structured_output import StructuredOutputBackend
from plugserve.sampling_params import StructuredOutputsParams


def request_constraint(
    body: SamplingRequest,
    backend: type[StructuredOutputBackend] | None,
    *,
    tool_schema: dict[str, Any] | None = None,
) -> StructuredOutputsParams | None:
    """The request's constraint, validated by `backend` (None: no backend to ask, the
    engine reports what it cannot compile); None when the output is free. `tool_schema`:
    the schema a forced tool call is generated under (chat's `tool_choice`), one more
    field that constrains the output."""
    found = _constraints(body)
    if tool_schema is not None:
        forced = StructuredOutputsParams(json=json.dumps(tool_schema))
        found.append(("tool_choice", lambda: forced))
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


def _constraints(body: SamplingRequest) -> list[tuple[str, Any]]:
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
