"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the
official `anthropic` SDK, on the tiny reasoning server (tests/reasoning_checkpoint.py,
markers as special tokens, the qwen3 reasoning parser, an API key the SDK sends as
x-api-key).

The random model never ends its thinking alone: `thinking.budget_tokens` ends it, and a
forced tool (`tool_choice` `tool` or `any`) makes the answer a call, so a response's
blocks are known: thinking, then tool_use.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from .conftest import REASONING_API_KEY

BUDGET = 6
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING = {"type": "enabled", "budget_tokens": BUDGET}
# Fields of the Messages API this SDK's signatures no longer carry, sent as the body's own.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(reasoning_server: Any) -> Any:
    return reasoning_server("special")


@pytest.fixture(scope="module")
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key=REASONING_API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(server: Any) -> str:
    headers = {"x-api-key": REASONING_API_KEY}
    return httpx.get(server.url("/v1/models"), headers=headers).json()["data"][0]["id"]


def forced_call(client: anthropic.Anthropic, model: str, **kwargs: Any) -> Any:
    return client.messages.create(
        model=model,
        max_tokens=60,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        thinking=THINKING,
        extra_body=GREEDY,
        **kwargs,
    )


def test_create_thinks_then_calls_the_forced_tool(client: anthropic.Anthropic, model: str) -> None:
    message = forced_call(client, model, tool_choice={"type": "tool", "name": "get_weather"})
    thinking, call = message.content
    assert thinking.type == "thinking" and thinking.thinking
    assert thinking.signature  # documented: the SHA-256 of the thinking, not verified
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input["city"] in ("Paris", "Oslo")
    assert call.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens > BUDGET
    counted = client.messages.count_tokens(
        model=model, messages=QUESTION, tools=[WEATHER_TOOL], thinking=THINKING
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_stream_sends_anthropics_event_sequence(client: anthropic.Anthropic, model: str) -> None:
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    expected = forced_call(client, model, tool_choice=any_one)
    with client.messages.stream(
        model=model,
        max_tokens=60,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=any_one,
        thinking=THINKING,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    assert "input_json_delta" in deltas
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert kinds.count("content_block_stop") == 2
    assert final.stop_reason == "tool_use" == expected.stop_reason
    assert [b.type for b in final.content] == [b.type for b in expected.content]
    assert final.content[0].thinking == expected.content[0].thinking
    assert final.content[0].signature == expected.content[0].signature
    assert final.content[1].input == expected.content[1].input
    assert final.usage.output_tokens == expected.usage.output_tokens


def test_a_tool_result_turn_and_text_answers(
    client: anthropic.Anthropic, model: str, server: Any
) -> None:
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should look it up.", "signature": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}],
        },
    ]  # fmt: skip
    request: dict[str, Any] = dict(
        model=model,
        max_tokens=5,
        system="Answer briefly.",
        messages=history,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
        thinking={"type": "disabled"},
        stop_sequences=["\n\n\n"],
        metadata={"user_id": "u-1"},
        extra_body={**GREEDY, "top_p": 0.9, "top_k": 20},
    )
    message = client.messages.create(**request)
    [text] = message.content
    assert text.type == "text" and text.text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    with client.messages.stream(**request) as stream:
        assert stream.get_final_text() == text.text
    # A stop sequence from the greedy text itself ends the same request where it first
    # appears.
    stop = text.text[len(text.text) // 2 :]
    before = text.text[: text.text.index(stop)]
    stopped = client.messages.create(**{**request, "stop_sequences": [stop]})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in stopped.content) == before
    with client.messages.stream(**{**request, "stop_sequences": [stop]}) as stream:
        assert stream.get_final_text() == before
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    counted = client.messages.count_tokens(
        model=model,
        system="Answer briefly.",
        messages=history,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
        thinking={"type": "disabled"},
    )
    assert counted.input_tokens == message.usage.input_tokens
    # The turns render as the chat messages they are: the call an assistant's tool call,
    # the result a tool message.
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    chat_history = [
        {"role": "system", "content": "Answer briefly."},
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": call}
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    ]  # fmt: skip
    chat_tool = {"type": "function", "function": {"name": "get_weather", **WEATHER_TOOL}}
    chat_tool["function"]["parameters"] = chat_tool["function"].pop("input_schema")
    tokenized = httpx.post(
        server.url("/tokenize"),
        json={
            "model": model,
            "messages": chat_history,
            "tools": [chat_tool],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ).json()
    assert tokenized["count"] == counted.input_tokens


def test_errors_are_in_anthropics_shape(
    client: anthropic.Anthropic, model: str, server: Any
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=model, max_tokens=5, messages=QUESTION, extra_body={"container": "c-1"}
        )
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "container" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nonexistent", max_tokens=5, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    stranger = anthropic.Anthropic(base_url=server.url(""), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        stranger.messages.create(model=model, max_tokens=5, messages=QUESTION)
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    raw = httpx.post(
        server.url("/v1/messages"),
        headers={"x-api-key": REASONING_API_KEY},
        json={"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": [image]}]},
    )
    assert raw.status_code == 400 and raw.json()["type"] == "error", raw.text
    assert json.loads(raw.text)["error"]["type"] == "invalid_request_error"
