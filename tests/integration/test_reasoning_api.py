"""Reasoning through the OpenAI API (the openai SDK), on a server of a tiny random Qwen3
checkpoint with the qwen3 reasoning parser: its markers special tokens, and plain text.

The random model never ends its thinking by itself: `thinking_token_budget` ends it (the
engine forces `</think>`), and a grammar (response_format, structured_outputs, a forced
tool call) then generates the answer. So every answer here is a thinking block the model
wrote freely followed by an answer the grammar made: the split is known token for token.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from .conftest import REASONING_API_KEY

BUDGET = 6
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Is 6 times 7 more than 40?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=["special", "text"])
def server(request: pytest.FixtureRequest, reasoning_server: Any) -> Any:
    return reasoning_server(request.param)


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return server.openai_client(api_key=REASONING_API_KEY)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def marker_length(server: Any, model: str) -> int:
    response = httpx.post(
        server.url("/tokenize"),
        json={"model": model, "prompt": "</think>", "add_special_tokens": False},
    )
    return response.json()["count"]


def chat(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    body = {"thinking_token_budget": BUDGET, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=60, extra_body=body, **kwargs
    )


def streamed(client: openai.OpenAI, model: str, **kwargs: Any) -> tuple[str, str, list, Any]:
    """(reasoning, content, tool-call deltas, usage) of the same request streamed."""
    chunks = chat(client, model, stream=True, stream_options={"include_usage": True}, **kwargs)
    reasoning, content, calls, usage = [], [], [], None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning_content") == delta.get("reasoning")
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            calls += delta.get("tool_calls") or []
    return "".join(reasoning), "".join(content), calls, usage


def test_reasoning_then_a_json_answer_at_once_and_streamed(
    client: openai.OpenAI, model: str, server: Any
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    answer = chat(client, model, response_format=fmt)
    message = answer.choices[0].message.model_dump()
    reasoning = message["reasoning_content"]
    assert reasoning and message["reasoning"] == reasoning
    with pytest.raises(json.JSONDecodeError):
        json.loads(reasoning)  # the thinking was free: the schema constrained the answer only
    unconstrained = chat(client, model).choices[0].message.model_dump()
    assert unconstrained["reasoning_content"] == reasoning  # the grammar never touched it
    assert json.loads(message["content"])["answer"] in ("yes", "no")
    assert answer.choices[0].finish_reason == "stop"
    details = answer.usage.completion_tokens_details
    assert details.reasoning_tokens == BUDGET + marker_length(server, model)
    reasoning_streamed, content_streamed, _, usage = streamed(client, model, response_format=fmt)
    assert (reasoning_streamed, content_streamed) == (reasoning, message["content"])
    assert usage.completion_tokens == answer.usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_structured_outputs_regex_applies_to_the_answer(client: openai.OpenAI, model: str) -> None:
    regex = {"regex": "The answer is (yes|no)\\."}
    answer = chat(client, model, extra_body={"structured_outputs": regex})
    message = answer.choices[0].message.model_dump()
    assert message["content"] in ("The answer is yes.", "The answer is no.")
    assert message["reasoning_content"]
    assert streamed(client, model, extra_body={"structured_outputs": regex})[:2] == (
        message["reasoning_content"],
        message["content"],
    )


def test_a_forced_tool_call_follows_the_reasoning(client: openai.OpenAI, model: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = chat(client, model, tools=[WEATHER_TOOL], tool_choice=choice)
    message = answer.choices[0].message
    assert message.model_dump()["reasoning_content"]
    assert message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert answer.choices[0].finish_reason == "tool_calls"
    reasoning, _, calls, _ = streamed(client, model, tools=[WEATHER_TOOL], tool_choice=choice)
    assert reasoning == message.model_dump()["reasoning_content"]
    assert "".join(c["function"]["arguments"] or "" for c in calls) == call.function.arguments


def test_enable_thinking_false_makes_the_output_all_answer(
    client: openai.OpenAI, model: str
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = chat(client, model, response_format=fmt, extra_body=off)
    message = answer.choices[0].message.model_dump()
    assert message.get("reasoning_content") is None
    assert json.loads(message["content"])["answer"] in ("yes", "no")
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content, _, _ = streamed(client, model, response_format=fmt, extra_body=off)
    assert (reasoning, content) == ("", message["content"])


def test_a_reasoning_cut_short_stays_reasoning(client: openai.OpenAI, model: str) -> None:
    answer = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=5
    )
    message = answer.choices[0].message.model_dump()
    assert message["reasoning_content"] and message["content"] is None
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5


def test_responses_return_a_reasoning_item(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "name": "verdict", "schema": SCHEMA}
    response = client.responses.create(
        model=model,
        input="Is 6 times 7 more than 40?",
        temperature=0,
        max_output_tokens=60,
        text={"format": fmt},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    thinking = response.output[0].content[0].text
    assert thinking
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    # Not asked to stop thinking, the random model thinks until max_output_tokens.
    assert response.status == "incomplete"
    events = list(
        client.responses.create(
            model=model,
            input="Is 6 times 7 more than 40?",
            temperature=0,
            max_output_tokens=60,
            text={"format": fmt},
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thinking
    assert events[-1].response.output[0].type == "reasoning"


def test_tokenize_renders_chat_template_kwargs(server: Any, model: str) -> None:
    def count(**extra: Any) -> int:
        body = {"model": model, "messages": QUESTION, **extra}
        return httpx.post(server.url("/tokenize"), json=body).json()["count"]

    thinking_off = count(chat_template_kwargs={"enable_thinking": False})
    assert thinking_off > count()  # the template wrote the empty thinking block
