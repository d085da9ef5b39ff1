"""The OpenAI API of a live server, through the official client: chat and completions,
streamed and not, equal to the offline LLM's greedy text; many streams at once;
disconnects and stop strings aborting their engine requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

import httpx
import pytest

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.messages import FINISH_REASONS

from .conftest import (
    CHAT_CONVERSATIONS,
    COMPLETION_PROMPTS,
    LONG_MAX_TOKENS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    MODEL,
    TRANSPORTS,
    running_thread_samples,
)


def assert_usage(usage, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completions_equal_the_offline_greedy_text(client, reference):
    for prompt in COMPLETION_PROMPTS:
        ref = reference.completion(prompt)
        expected = ref.outputs[0]
        result = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
        )
        [choice] = result.choices
        assert choice.text == expected.text
        assert choice.finish_reason == expected.finish_reason
        assert result.object == "text_completion"
        assert_usage(result.usage, len(ref.prompt_token_ids), len(expected.token_ids))


@pytest.mark.transports(*TRANSPORTS)
def test_completion_stream_equals_the_non_streamed_text(client, reference):
    for prompt in COMPLETION_PROMPTS:
        ref = reference.completion(prompt)
        expected = ref.outputs[0]
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        *deltas, last = chunks
        whole = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
        )
        assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
        assert whole.choices[0].text == expected.text
        assert [c.choices[0].finish_reason for c in deltas][-1] == expected.finish_reason
        assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
        assert all(c.usage is None for c in deltas)
        # include_usage: a final chunk with no choices carries the usage.
        assert last.choices == []
        assert_usage(last.usage, len(ref.prompt_token_ids), len(expected.token_ids))


def test_chat_equals_the_offline_greedy_text(client, reference):
    for conversation in CHAT_CONVERSATIONS:
        ref = reference.chat(conversation)
        expected = ref.outputs[0]
        result = client.chat.completions.create(
            model=MODEL, messages=conversation, temperature=0, max_tokens=MAX_TOKENS
        )
        [choice] = result.choices
        assert choice.message.role == "assistant"
        assert choice.message.content == expected.text
        assert choice.finish_reason == expected.finish_reason
        assert result.object == "chat.completion"
        assert_usage(result.usage, len(ref.prompt_token_ids), len(expected.token_ids))


def test_chat_stream_equals_the_non_streamed_text(client, reference):
    for conversation in CHAT_CONVERSATIONS:
        ref = reference.chat(conversation)
        expected = ref.outputs[0]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=conversation,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        *deltas, last = chunks
        whole = client.chat.completions.create(
            model=MODEL, messages=conversation, temperature=0, max_tokens=MAX_TOKENS
        )
        assert deltas[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in deltas)
        assert streamed == whole.choices[0].message.content
        assert streamed == expected.text
        assert deltas[-1].choices[0].finish_reason == expected.finish_reason
        assert last.choices == []
        assert_usage(last.usage, len(ref.prompt_token_ids), len(expected.token_ids))


def test_stream_without_include_usage_sends_no_usage(client, reference):
    prompt = COMPLETION_PROMPTS[0]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
    )
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert (
        "".join(c.choices[0].text for c in chunks) == reference.completion(prompt).outputs[0].text
    )


# --------------------------------------------------------------------------- concurrency


async def _stream_text(aclient, index: int) -> str:
    if index % 2:
        conversation = CHAT_CONVERSATIONS[(index // 2) % len(CHAT_CONVERSATIONS)]
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=conversation, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    prompt = COMPLETION_PROMPTS[(index // 2) % len(COMPLETION_PROMPTS)]
    stream = await aclient.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    return "".join([c.choices[0].text async for c in stream if c.choices])


@pytest.mark.transports(*TRANSPORTS)
def test_32_concurrent_streams_all_complete_correctly(server: PlugserveServer, reference):
    num_requests = 32

    async def main() -> list[str]:
        async with server.async_openai_client() as aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(_stream_text(aclient, i) for i in range(num_requests))), 300
            )

    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        if i % 2:
            conversation = CHAT_CONVERSATIONS[(i // 2) % len(CHAT_CONVERSATIONS)]
            expected = reference.chat(conversation).outputs[0].text
        else:
            prompt = COMPLETION_PROMPTS[(i // 2) % len(COMPLETION_PROMPTS)]
            expected = reference.completion(prompt).outputs[0].text
        assert text == expected, f"request {i}"
    metrics = server.wait_idle()
    assert metrics["num_requests_running"] == 0
    assert metrics["num_requests_waiting"] == 0
    assert metrics["kv_cache_usage"] == 0
    # An idle engine blocks on its input queue: it takes no steps, and its threads sleep
    # (a spinning loop would be found running in most of the samples).
    steps = metrics["engine_steps_total"]
    assert running_thread_samples(server.engine_pid()) <= 10
    assert server.metrics()["engine_steps_total"] == steps


# --------------------------------------------------------------------------- aborts
# A request is proven aborted by the engine's own counters, whatever the machine's speed:
# it is counted as finished by "abort" (a request that ran to the end would count as
# "length"), it generated fewer tokens than it asked for, and once the engine is idle
# its step and token counters stand still. LONG_MAX_TOKENS leaves only the prompt's room
# in MAX_MODEL_LEN: the most a request on this server can ask for.


def _long_request(chat: bool = False, **extra) -> dict:
    # Long enough (hundreds of tokens) that it is still running when we act.
    body = {"model": MODEL, "temperature": 0, "max_tokens": LONG_MAX_TOKENS, **extra}
    body["ignore_eos"] = True
    if chat:
        return {**body, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    return {**body, "prompt": "Once upon a time"}


def _finished(metrics: dict[str, float], reason: str) -> float:
    return metrics[f'engine_requests_finished_total{{reason="{reason}"}}']


def _idle_metrics(server: PlugserveServer) -> dict[str, float]:
    idle = server.wait_idle(timeout=30)
    assert idle["num_requests_running"] == 0, idle
    assert idle["num_requests_waiting"] == 0, idle
    assert idle["kv_cache_usage"] == 0, idle
    return idle


def _assert_aborted_in_the_engine(
    server: PlugserveServer, before: dict[str, float], after: dict[str, float]
) -> float:
    """One request ran between `before` and `after` (both idle) and the engine aborted it
    before its end; returns the tokens it generated."""
    generated = after["engine_generated_tokens_total"] - before["engine_generated_tokens_total"]
    finished = {r: _finished(after, r) - _finished(before, r) for r in FINISH_REASONS}
    assert finished == {**dict.fromkeys(FINISH_REASONS, 0), "abort": 1}, (
        f"the request was not aborted in the engine: finished {finished}, "
        f"{generated:.0f} of {LONG_MAX_TOKENS} tokens generated"
    )
    assert 0 < generated < LONG_MAX_TOKENS
    # The engine stopped computing it: the next request's tokens are all the engine
    # generates from here, to the token, however long it takes to come.
    probe = httpx.post(
        server.url("/v1/completions"),
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert probe.status_code == 200, probe.text
    later = _idle_metrics(server)
    probe_tokens = probe.json()["usage"]["completion_tokens"]
    assert probe_tokens == 3
    assert (
        later["engine_generated_tokens_total"] - after["engine_generated_tokens_total"]
        == probe_tokens
    )
    return generated


@pytest.mark.transports(*TRANSPORTS)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_client_disconnect_mid_stream_aborts_the_request(server: PlugserveServer, chat: bool):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    before = _idle_metrics(server)
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", server.url(path), json=_long_request(chat, stream=True)) as response,
    ):
        assert response.status_code == 200
        # Keep the iterator: a generator dropped mid-way closes the connection early.
        lines = response.iter_lines()
        events = (line for line in lines if line.startswith("data: {"))
        for _ in range(4):
            next(events)
        during = server.metrics()
        assert during["num_requests_running"] == 1
        assert during["kv_cache_usage"] > 0
    # The connection is closed: the server must notice and abort the engine request.
    after = _idle_metrics(server)
    generated = _assert_aborted_in_the_engine(server, before, after)
    assert generated >= 3  # the client read the first three (chat: a role chunk first)


def test_client_disconnect_while_waiting_for_a_non_streamed_answer(server: PlugserveServer):
    before = _idle_metrics(server)

    async def leave_once_generating() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            post = asyncio.create_task(
                http.post(server.url("/v1/completions"), json=_long_request())
            )
            # Leave as soon as the engine is generating for it (not after a fixed time, which
            # a fast machine could outrun): cancelling the request closes its connection.
            deadline = time.monotonic() + 60
            while True:
                metrics = await asyncio.to_thread(server.metrics)
                generated = metrics["engine_generated_tokens_total"]
                if generated > before["engine_generated_tokens_total"]:
                    break
                assert not post.done(), "the request ended before it generated a token"
                assert time.monotonic() < deadline, "the request generated no token in 60 s"
                await asyncio.sleep(0.02)
            assert not post.done(), f"the request was answered before we left: {post.result()}"
            post.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await post

    asyncio.run(leave_once_generating())
    after = _idle_metrics(server)
    _assert_aborted_in_the_engine(server, before, after)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_stop_string_finishes_the_request_and_aborts_it_in_the_engine(
    server: PlugserveServer, client, reference, stream: bool
):
    prompt = COMPLETION_PROMPTS[2]
    greedy = reference.completion(prompt, max_tokens=24, ignore_eos=True).outputs[0].text
    # A word in the middle of the greedy text: generation must end just before it.
    words = [w for w in greedy.split() if len(w) >= 3 and w.isalpha()]
    assert len(words) >= 3, greedy
    stop = words[len(words) // 2]
    expected = greedy[: greedy.index(stop)]
    before = _idle_metrics(server)
    # Without the abort the engine would go on for hundreds of tokens (ignore_eos).
    kwargs = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": LONG_MAX_TOKENS}
    kwargs.update(stop=[stop], extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
        stop_reason = chunks[-1].choices[0].model_extra.get("stop_reason")
    else:
        result = client.completions.create(**kwargs)
        text, finish_reason = result.choices[0].text, result.choices[0].finish_reason
        stop_reason = result.choices[0].model_extra.get("stop_reason")
        assert result.usage.completion_tokens < 40
    assert finish_reason == "stop"
    assert stop_reason == stop
    assert text == expected
    # The client's "stop" is the engine's "abort", a few tokens after the stop string.
    generated = _assert_aborted_in_the_engine(server, before, _idle_metrics(server))
    assert generated < 40


def test_raw_sse_format(server: PlugserveServer):
    """What the stream looks like on the wire: `data: {json}` events, `data: [DONE]` last."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        response = http.post(server.url("/v1/completions"), json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ")
        assert json.loads(event.removeprefix("data: "))["object"] == "text_completion"


# --------------------------------------------------------------------------- masked logprobs

ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}
MASKED_LOGPROB = -9999.0  # vLLM's rendering of a token the grammar ruled out (-inf)


def _assert_rendered_as_vllm_does(values: list[float]) -> None:
    """Every logprob is a JSON number, the ruled-out ones -9999.0; and some were ruled out
    (else the request tested nothing)."""
    assert all(isinstance(v, float) and math.isfinite(v) for v in values), values
    assert min(values) == MASKED_LOGPROB, values


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_a_grammar_ruled_out_are_rendered_as_vllm_renders_them(
    zmq_server: PlugserveServer, stream: bool
):
    """Under a json_schema most of a step's top alternatives are masked to -inf, which
    JSON cannot carry: chat and completions render them -9999.0, as vLLM does. Any
    transport serves the same answer, so one server is enough."""
    chat_kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        temperature=0, max_tokens=32, logprobs=True, top_logprobs=5,
        response_format=ANSWER_FORMAT,
    )  # fmt: skip
    completion_kwargs = dict(
        model=MODEL, prompt="Is the sky blue? Answer in JSON:", temperature=0, max_tokens=32,
        logprobs=5, extra_body={"response_format": ANSWER_FORMAT},
    )  # fmt: skip
    with zmq_server.openai_client() as client:
        if stream:
            chunks = [
                c.choices[0]
                for c in client.chat.completions.create(**chat_kwargs, stream=True)
                if c.choices
            ]
            chat_text = "".join(c.delta.content or "" for c in chunks)
            chat_tokens = [t for c in chunks if c.logprobs for t in c.logprobs.content]
            pieces = [
                c.choices[0] for c in client.completions.create(**completion_kwargs, stream=True)
            ]
            text = "".join(c.text for c in pieces)
            completion_logprobs = [c.logprobs for c in pieces if c.logprobs]
        else:
            chat = client.chat.completions.create(**chat_kwargs).choices[0]
            chat_text, chat_tokens = chat.message.content, chat.logprobs.content
            choice = client.completions.create(**completion_kwargs).choices[0]
            text, completion_logprobs = choice.text, [choice.logprobs]
    for answer in (chat_text, text):
        assert json.loads(answer)["answer"] in ("yes", "no"), answer
    assert all(len(t.top_logprobs) == 5 for t in chat_tokens), chat_tokens
    _assert_rendered_as_vllm_does(
        [t.logprob for t in chat_tokens] + [a.logprob for t in chat_tokens for a in t.top_logprobs]
    )
    _assert_rendered_as_vllm_does(
        [v for lp in completion_logprobs for v in lp.token_logprobs]
        + [v for lp in completion_logprobs for top in lp.top_logprobs for v in top.values()]
    )
