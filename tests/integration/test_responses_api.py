"""/v1/responses' `include` on the shared zmq server, through the official openai SDK and
through openai-agents' OpenAIResponsesModel, which sends `include` with every request
(empty unless it wants more). The rest of the Responses API is tested in
test_operations.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import PlugserveServer

from .conftest import MODEL, assert_openai_error

OUTPUT_LOGPROBS = "message.output_text.logprobs"
QUESTION = "Write one sentence about the sea."
ASKED: dict[str, Any] = dict(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0)
# What the agent asks: answered in a few tokens, so the response completes (the agents SDK
# raises on an incomplete one).
AGENT_ASKS: dict[str, Any] = dict(instructions="Be brief.", input="Name a colour.")


@pytest.fixture(scope="module")
def client(zmq_server: PlugserveServer) -> Iterator[openai.OpenAI]:
    with zmq_server.openai_client() as client:
        yield client


def _tokens(logprobs: list[Any]) -> list[tuple[str, list[str]]]:
    """Each token and its alternatives (a Responses logprob or a chat one)."""
    return [(t.token, [a.token for a in t.top_logprobs]) for t in logprobs]


def _values(logprobs: list[Any]) -> list[float]:
    return [v for t in logprobs for v in (t.logprob, *(a.logprob for a in t.top_logprobs))]


def test_a_response_includes_what_include_asks_for(
    client: openai.OpenAI, zmq_server: PlugserveServer
):
    """`include` empty or null asks for nothing more; message.output_text.logprobs puts the
    tokens' logprobs on the output_text part (chat's, with top_logprobs alternatives),
    streamed and not; a value the server does not implement is refused by name."""
    plain = client.responses.create(**ASKED, include=[])
    nulled = client.responses.create(**ASKED, extra_body={"include": None})
    assert plain.output_text == nulled.output_text
    assert plain.output[0].content[0].logprobs == []

    whole = client.responses.create(**ASKED, include=[OUTPUT_LOGPROBS], top_logprobs=2)
    [part] = whole.output[0].content
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    expected = chat.choices[0].logprobs.content
    assert part.text == plain.output_text == chat.choices[0].message.content
    assert _tokens(part.logprobs) == _tokens(expected) and len(part.logprobs) == 6
    assert _values(part.logprobs) == pytest.approx(_values(expected), abs=1e-4)

    events = list(
        client.responses.create(**ASKED, include=[OUTPUT_LOGPROBS], top_logprobs=2, stream=True)
    )
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert _tokens(deltas) == _tokens(done.logprobs) == _tokens(part.logprobs)
    assert _tokens(events[-1].response.output[0].content[0].logprobs) == _tokens(part.logprobs)

    with httpx.Client(base_url=zmq_server.base_url, timeout=120) as http:
        body = {"model": MODEL, "input": "hi"}
        unknown = http.post(
            "/v1/responses",
            json={**body, "include": [OUTPUT_LOGPROBS, "reasoning.encrypted_content"]},
        )
        alone = http.post("/v1/responses", json={**body, "top_logprobs": 2})
    error = assert_openai_error(unknown, 400)
    assert error["param"] == "include" and "reasoning.encrypted_content" in error["message"]
    assert assert_openai_error(alone, 400)["param"] == "top_logprobs"


def test_the_openai_agents_sdk_gets_its_responses(
    client: openai.OpenAI, zmq_server: PlugserveServer
):
    """openai-agents' OpenAIResponsesModel always sends `include` (empty unless it wants
    more) and asks for message.output_text.logprobs with ModelSettings.top_logprobs;
    what it gets is what the openai SDK gets."""
    from agents import ModelSettings, ModelTracing, OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI

    async def ask() -> tuple[Any, Any, list[Any]]:
        async with zmq_server.async_openai_client() as aclient:
            model = OpenAIResponsesModel(model=MODEL, openai_client=aclient)
            call: dict[str, Any] = dict(
                system_instructions=AGENT_ASKS["instructions"], input=AGENT_ASKS["input"], tools=[],
                output_schema=None, handoffs=[], tracing=ModelTracing.DISABLED,
            )  # fmt: skip
            plain = await model.get_response(
                model_settings=ModelSettings(max_tokens=32, temperature=0), **call
            )
            settings = ModelSettings(max_tokens=32, temperature=0, top_logprobs=2)
            with_logprobs = await model.get_response(model_settings=settings, **call)
            events = [e async for e in model.stream_response(model_settings=settings, **call)]
            return plain, with_logprobs, events

    plain, with_logprobs, events = asyncio.run(ask())
    reference = client.responses.create(
        model=MODEL, **AGENT_ASKS, max_output_tokens=32, temperature=0,
        include=[OUTPUT_LOGPROBS], top_logprobs=2,
    )  # fmt: skip
    assert reference.status == "completed", reference
    expected = reference.output[0].content[0]
    assert expected.text and expected.logprobs
    for response in (plain, with_logprobs):
        [message] = response.output
        assert message.content[0].text == expected.text
    [part] = with_logprobs.output[0].content
    assert _tokens(part.logprobs) == _tokens(expected.logprobs)
    assert plain.output[0].content[0].logprobs == []
    assert events[-1].type == "response.completed"
    [streamed] = events[-1].response.output
    assert streamed.content[0].text == expected.text
    assert _tokens(streamed.content[0].logprobs) == _tokens(expected.logprobs)
