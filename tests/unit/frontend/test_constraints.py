"""Which field constrains a request's output, and how a forced tool call becomes a JSON
schema: one constraint per request, each checked by the stack's backend before it is
queued, so a bad schema, regex or grammar is a 400 that names the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plugserve.frontend.constraints import request_constraint
from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.chat.tools import check_tools, forced_tool_schema
from plugserve.frontend.routes.completions.protocol import CompletionRequest
from plugserve.sampling_params import StructuredOutputsParams as SOP

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
]


def chat(**fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "Hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def chat_constraint(body: ChatCompletionRequest, backend: Any = None) -> SOP | None:
    """A chat request's constraint as chat asks for it: a forced tool call is one."""
    return request_constraint(body, backend, tool_schema=forced_tool_schema(body))


class RejectsEverything:
    """A backend whose validate finds fault with any constraint."""

    @classmethod
    def validate(cls, spec: SOP) -> None:
        raise ValueError(f"cannot compile {spec.key[0]}")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, SOP(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
            SOP(json=json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, SOP(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, SOP(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[0-9]+"}}, SOP(regex="[0-9]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, SOP(choice=["yes", "no"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, SOP(grammar='root ::= "a"')),
        ({"guided_json": SCHEMA}, SOP(json=json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]+"}, SOP(regex="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, SOP(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"'}, SOP(grammar='root ::= "a"')),
        # Tools that are only offered do not constrain the output.
        ({"tools": TOOLS}, None),
        ({"tools": TOOLS, "tool_choice": "none"}, None),
    ],
)  # fmt: skip
def test_each_field_becomes_one_constraint(fields, expected):
    assert chat_constraint(chat(**fields)) == expected
    if "tools" not in fields:
        body = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
        assert request_constraint(body, None) == expected


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_json": {}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_two_constraints_are_a_400_naming_both(fields, named):
    with pytest.raises(InvalidRequest, match="at most one output constraint") as exc:
        chat_constraint(chat(**fields))
    assert named in str(exc.value)


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
    ],
)  # fmt: skip
def test_a_malformed_constraint_is_a_400_naming_its_field(fields, param, fragment):
    with pytest.raises(InvalidRequest, match=fragment) as exc:
        chat_constraint(chat(**fields))
    assert exc.value.param == param


def test_the_backends_validate_decides_and_its_reason_is_passed_on():
    with pytest.raises(InvalidRequest, match="guided_regex: cannot compile regex") as exc:
        chat_constraint(chat(guided_regex="(a"), RejectsEverything)
    assert exc.value.param == "guided_regex"
    assert chat_constraint(chat(), RejectsEverything) is None  # nothing to validate


def test_required_is_an_array_of_calls_to_the_offered_functions():
    schema = forced_tool_schema(chat(tools=TOOLS, tool_choice="required"))
    assert schema is not None
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    weather, now = schema["items"]["anyOf"]
    assert weather["properties"] == {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": WEATHER,
    }
    assert now["properties"]["parameters"] == {"type": "object"}
    assert weather["required"] == ["name", "parameters"]
    single = forced_tool_schema(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    )
    assert single is not None and single["maxItems"] == 1


def test_a_named_function_is_generated_as_its_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(tools=TOOLS, tool_choice=named)
    assert forced_tool_schema(body) == WEATHER
    assert chat_constraint(body) == SOP(json=json.dumps(WEATHER))
    assert forced_tool_schema(chat(tools=TOOLS, tool_choice="auto")) is None


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "same name"),
    ],
)  # fmt: skip
def test_tool_choice_must_fit_the_tools(fields, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        check_tools(chat(**fields))
