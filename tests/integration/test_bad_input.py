"""Bad input gets a 4xx in OpenAI's error shape, never reaches the engine, and does not
disturb a good request running beside it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import PlugserveServer

from .conftest import (
    COMPLETION_PROMPTS,
    MAX_MODEL_LEN,
    MODEL,
    assert_openai_error,
)

# Transport-agnostic: the shared zmq server serves every test here once.

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (id, path, JSON body or raw bytes, expected status, expected `param` or None to skip)
BAD_REQUESTS: list[tuple[str, str, dict[str, Any] | bytes, int, str | None]] = [
    ("malformed-json", CHAT, b'{"model": "x", "messages": [', 400, None),
    ("body-not-an-object", CHAT, b"[1, 2, 3]", 400, None),
    ("missing-model", CHAT, without(chat(), "model"), 400, "model"),
    ("missing-messages", CHAT, without(chat(), "messages"), 400, "messages"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("message-without-role", CHAT, chat(messages=[{"content": "Hi"}]), 400, "messages"),
    ("message-without-content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages"),
    ("messages-not-a-list", CHAT, chat(messages="Hello"), 400, "messages"),
    ("unknown-model", CHAT, chat(model="gpt-17"), 404, "model"),
    ("unknown-model-completions", COMPLETIONS, completion(model="gpt-17"), 404, "model"),
    ("temperature-5", CHAT, chat(temperature=5), 400, "temperature"),
    ("temperature-not-a-number", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top-p-0", CHAT, chat(top_p=0), 400, "top_p"),
    ("n-0", COMPLETIONS, completion(n=0), 400, "n"),
    ("max-tokens-0", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, completion(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-beyond-context", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("prompt-longer-than-context", COMPLETIONS, completion(prompt="hello " * MAX_MODEL_LEN), 400, "prompt"),
    ("chat-longer-than-context", CHAT, chat(messages=[{"role": "user", "content": "hi " * MAX_MODEL_LEN}]), 400, "messages"),
    ("empty-prompt-list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, None),
    ("logprobs-21", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    ("stop-20-strings", CHAT, chat(stop=[f"s{i}" for i in range(20)]), 400, None),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, None),
    ("token-ids-out-of-vocab", COMPLETIONS, completion(prompt=[1, 2, 10**6]), 400, "prompt"),
    ("token-ids-negative", COMPLETIONS, completion(prompt=[1, -2, 3]), 400, "prompt"),
    ("stop-token-ids-out-of-vocab", COMPLETIONS, completion(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("echo-unsupported", COMPLETIONS, completion(echo=True), 400, "echo"),
]  # fmt: skip


def send(http: httpx.Client, server: PlugserveServer, path: str, body: dict | bytes):
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return http.post(server.url(path), content=body, headers=headers)
    return http.post(server.url(path), json=body)


def engine_counters(metrics: dict[str, float]) -> tuple[float, float]:
    # Every request the engine admits queries the prefix cache for its prompt tokens.
    return metrics["prefix_cache_queries_total"], metrics["num_requests_waiting"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_an_openai_error_and_never_reaches_the_engine(
    server: PlugserveServer, path: str, body: dict | bytes, status: int, param: str | None
):
    before = server.metrics()
    with httpx.Client(timeout=30) as http:
        error = assert_openai_error(send(http, server, path, body), status)
    assert error["code"] == status
    if param is not None:
        assert error["param"] is not None and error["param"].split(".")[0] == param, error
    after = server.metrics()
    assert engine_counters(after) == engine_counters(before)
    assert after["num_requests_running"] == before["num_requests_running"] == 0


def test_the_openai_client_raises_its_own_error_types(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-17", prompt="Hello")
    assert "gpt-17" in missing.value.message


def test_bad_requests_leave_a_concurrent_good_request_unaffected(
    server: PlugserveServer, reference
):
    prompt = COMPLETION_PROMPTS[1]
    max_tokens = 96
    expected = reference.completion(prompt, max_tokens=max_tokens, ignore_eos=True).outputs[0]

    async def main() -> tuple[str, dict[str, float], dict[str, float]]:
        async with server.async_openai_client() as aclient, httpx.AsyncClient(timeout=30) as http:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=prompt,
                temperature=0,
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = aiter(stream)
            text = [(await anext(chunks)).choices[0].text]  # the good request is running
            before = await asyncio.to_thread(server.metrics)

            async def bad(path: str, body: dict | bytes, status: int) -> None:
                if isinstance(body, bytes):
                    headers = {"content-type": "application/json"}
                    response = await http.post(server.url(path), content=body, headers=headers)
                else:
                    response = await http.post(server.url(path), json=body)
                assert_openai_error(response, status)

            await asyncio.gather(*(bad(*case[1:4]) for case in BAD_REQUESTS))
            during = await asyncio.to_thread(server.metrics)
            text += [chunk.choices[0].text async for chunk in chunks]
            return "".join(text), before, during

    text, before, during = asyncio.run(asyncio.wait_for(main(), 120))
    # The good request was running when the bad ones came; nothing new was admitted
    # while they came and went, and the good one ran on to the end, undisturbed.
    assert before["num_requests_running"] == 1
    assert engine_counters(during) == engine_counters(before)
    assert during["num_requests_waiting"] == 0
    assert text == expected.text
