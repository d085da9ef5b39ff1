"""The OpenAI request models: every field is either implemented, accepted and ignored
(and said so), or rejected by name; messages are typed, as the OpenAPI schema shows."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from plugserve.frontend.protocol import IGNORED_FIELDS, AssistantMessage, ToolMessage
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.completions.protocol import CompletionRequest

USER = {"role": "user", "content": "Hi"}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


def rejected_locs(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple]:
    return [e["loc"] for e in exc.value.errors() if e["type"] == "extra_forbidden"]


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"best_of": 2}, ("best_of",)),
        ({"functions": []}, ("functions",)),
        ({"messages": [{**USER, "audio": {}}]}, ("messages", 0, "user", "audio")),
        ({"response_format": {"type": "json_object", "extra": 1}}, ("response_format", "extra")),
        ({"structured_outputs": {"json": {}, "backend": "x"}}, ("structured_outputs", "backend")),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, ("stream_options", "continuous_usage_stats")),
        ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, ("tools", 0, "function", "x")),
    ],
)  # fmt: skip
def test_an_unknown_field_anywhere_is_rejected_by_its_path(fields, loc):
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    assert loc in rejected_locs(exc)


def test_completions_reject_unknown_fields_too():
    with pytest.raises(ValidationError) as exc:
        completion(best_of=3)
    assert rejected_locs(exc) == [("best_of",)]


def test_sdk_metadata_is_accepted_and_reported_as_ignored():
    body = chat(
        user="u-1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        prompt_cache_key="p",
        safety_identifier="s",
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": True},
    )
    assert body.ignored_fields() == [*IGNORED_FIELDS, "stream_options.include_obfuscation"]
    assert chat().ignored_fields() == []
    assert completion(user="u").ignored_fields() == ["user"]


def test_messages_are_typed_by_role():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]
    )
    assert isinstance(body.messages[2], AssistantMessage)
    assert isinstance(body.messages[3], ToolMessage)
    # What the renderer gets: OpenAI's JSON shape, nulls left out.
    assert body.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"role": "assistant", "content": None}, "content or tool_calls"),
        ({"role": "tool", "content": "42"}, "tool_call_id"),
        ({"role": "wizard", "content": "x"}, "wizard"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            "only 'text' parts",
        ),
    ],
)
def test_malformed_messages_are_rejected(message, fragment):
    with pytest.raises(ValidationError, match=fragment):
        chat(messages=[USER, message])


def test_continue_final_message_excludes_the_generation_prompt():
    with pytest.raises(ValidationError, match="add_generation_prompt"):
        chat(continue_final_message=True)
    assert chat(continue_final_message=True, add_generation_prompt=False).continue_final_message


def test_tool_choice_defaults_as_openai():
    tool = {"type": "function", "function": {"name": "f"}}
    assert chat().effective_tool_choice == "none"
    assert chat(tools=[tool]).effective_tool_choice == "auto"
    assert chat(tools=[tool], tool_choice="none").effective_tool_choice == "none"


def test_response_format_json_schema_needs_its_schema_block():
    with pytest.raises(ValidationError, match="json_schema"):
        chat(response_format={"type": "json_schema"})
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}})
    assert body.response_format.json_schema.schema_ == {}


def test_responses_stream_options_take_only_what_the_responses_api_has():
    from plugserve.frontend.routes.responses.protocol import ResponsesRequest

    body = {"model": "m", "input": "hi", "stream": True}
    ResponsesRequest.model_validate({**body, "stream_options": {"include_obfuscation": False}})
    # Usage is always in the last event: chat's include_usage would be accepted and dropped.
    with pytest.raises(ValidationError) as exc:
        ResponsesRequest.model_validate({**body, "stream_options": {"include_usage": True}})
    assert exc.value.errors()[0]["loc"] == ("stream_options", "include_usage")


def test_responses_include_is_implemented_or_refused_by_name():
    from plugserve.frontend.errors import InvalidRequest
    from plugserve.frontend.routes.responses.protocol import ResponsesRequest

    body = {"model": "m", "input": "hi"}
    for nothing in ([], None):
        request = ResponsesRequest.model_validate({**body, "include": nothing})
        request.check()
        assert "logprobs" not in request.chat_body()
    asked = ResponsesRequest.model_validate(
        {**body, "include": ["message.output_text.logprobs"], "top_logprobs": 3}
    )
    asked.check()
    assert (asked.chat_body()["logprobs"], asked.chat_body()["top_logprobs"]) == (True, 3)
    refused = [
        ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
        ({"top_logprobs": 2}, "top_logprobs", "message.output_text.logprobs"),
    ]
    for fields, param, named in refused:
        with pytest.raises(InvalidRequest, match=named) as exc:
            ResponsesRequest.model_validate({**body, **fields}).check()
        assert exc.value.param == param
