"""Failures: the engine killed (in-flight requests fail with its death in OpenAI's error
shape, the server exits non-zero), the API server killed (its engine goes too), the
engine stopped (/health turns 503, then recovers), and an engine-side error and an
exception while the API server renders an answer, each confined to one request by a
faulty plugin. All but the stopped engine get a server of their own."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import PlugserveServer, is_engine
from plugserve.bench.processes import descendants_of, process_cmdline
from plugserve.bench.server_process import wait_until
from plugserve.frontend.routes.endpoint_flow import HEALTH_TIMEOUT_S

from .conftest import (
    CHAT_CONVERSATIONS,
    COMPLETION_PROMPTS,
    LONG_MAX_TOKENS,
    MAX_TOKENS,
    MODEL,
    REPO_ROOT,
    SERVER_SETTINGS,
    TRANSPORTS,
    assert_openai_error,
    running_server,
)
from .faulty_plugin import TOOL_PARSER_ERROR

LONG = {
    "model": MODEL,
    "prompt": "Once upon a time",
    "temperature": 0,
    "max_tokens": LONG_MAX_TOKENS,
    "extra_body": {"ignore_eos": True},
}


def health(server: PlugserveServer, timeout: float = 30) -> int | None:
    """/health's status code, or None if the server no longer answers."""
    try:
        return httpx.get(server.url("/health"), timeout=timeout).status_code
    except httpx.TransportError:
        return None


def engine_dead(message: str) -> dict[str, Any]:
    """The error, in OpenAI's shape, of a request the engine's death failed."""
    return {"message": message, "type": "server_error", "param": None, "code": 503}


def dead_health(server: PlugserveServer, message: str) -> bool:
    """/health answers 503 with the engine's death, unless the server (which exits once
    its requests have failed) no longer answers at all."""
    try:
        response = httpx.get(server.url("/health"), timeout=10)
    except httpx.TransportError:
        return True
    return response.status_code == 503 and response.json() == {"error": engine_dead(message)}


@pytest.mark.transports(*TRANSPORTS)
@pytest.mark.starts_server()
def test_killed_engine_fails_in_flight_requests_and_the_server_exits(transport, tmp_path):
    with (
        running_server(transport, tmp_path, check_exit=False) as server,
        server.openai_client(timeout=60) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        engine = server.engine_pid()
        streaming = threading.Event()

        def streamed() -> None:
            for _ in client.completions.create(**LONG, stream=True):
                streaming.set()

        stream_future = pool.submit(streamed)
        plain_future = pool.submit(client.completions.create, **LONG)
        assert streaming.wait(60), "the streamed request never started"
        assert wait_until(lambda: server.metrics()["num_requests_running"] == 2, 30)

        os.kill(engine, signal.SIGKILL)
        died = "the engine core EngineCore exited unexpectedly (exit code -9)"
        # A non-streamed request in flight gets a 503 with OpenAI's error body ...
        with pytest.raises(openai.APIStatusError) as plain:
            plain_future.result(timeout=60)
        assert plain.value.status_code == 503
        assert plain.value.response.json() == {"error": engine_dead(died)}
        # ... a streamed one an error event in the same shape, not a cut connection.
        with pytest.raises(openai.APIError) as streamed_error:
            stream_future.result(timeout=60)
        assert type(streamed_error.value) is openai.APIError, streamed_error.value
        assert streamed_error.value.body == engine_dead(died)

        assert dead_health(server, died)
        code = server.popen.wait(30)
        assert code != 0, server.log_tail()
        assert "exited unexpectedly" in server.log_text()


@pytest.mark.transports(*TRANSPORTS)
def test_stopped_engine_turns_health_503_and_it_recovers(server: PlugserveServer, client):
    # On the shared server: SIGCONT follows whatever happens, and nothing is lost.
    engine = server.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    try:
        # Within its own time limit: a /health that hangs fails here after 30 s.
        response = httpx.get(server.url("/health"), timeout=30)
    finally:
        os.kill(engine, signal.SIGCONT)
    error = assert_openai_error(response, 503)
    assert error == {
        "message": f"the engine did not answer within {HEALTH_TIMEOUT_S:.0f} s",
        "type": "server_error",
        "param": None,
        "code": 503,
    }
    assert wait_until(lambda: health(server) == 200, 15), server.log_tail()
    result = client.completions.create(
        model=MODEL, prompt=COMPLETION_PROMPTS[0], temperature=0, max_tokens=4
    )
    assert result.choices[0].text


@pytest.mark.transports(*TRANSPORTS)
@pytest.mark.starts_server()
def test_killed_api_server_takes_its_engine_along(transport, tmp_path):
    """An engine orphaned by its API server would hold its memory forever."""
    with running_server(transport, tmp_path, check_exit=False) as server:
        engine = server.engine_pid()
        server.popen.kill()
        server.popen.wait(10)
        assert wait_until(lambda: not is_engine(engine), 10), "the engine outlived its server"


# --------------------------------------------------------------------------- faulty plugin

UNLUCKY = {"priority": 13}  # what tests/integration/faulty_plugin.py refuses
# Offered with tool_choice "auto": the faulty tool parser raises while the answer is rendered.
FAULTY_TOOLS = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
}


FAULTY_ENV = {
    "PLUGSERVE_PLUGIN_MODULES": "tests.integration.faulty_plugin",
    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
}
FAULTY_SETTINGS = (*SERVER_SETTINGS, "--stack.scheduler", "faulty", "--stack.tool_parser", "faulty")


def faulty_server(transport: str, log_dir) -> Any:
    return running_server(transport, log_dir, settings=FAULTY_SETTINGS, env=FAULTY_ENV)


async def _requests(server: PlugserveServer) -> list[Any]:
    """Two refused requests and three whose answers fail to render (streamed and not)
    among good ones, all at once."""
    async with server.async_openai_client() as aclient:

        async def completion(prompt: str, **extra: Any) -> str:
            result = await aclient.completions.create(
                model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, **extra
            )
            return result.choices[0].text

        async def chat_stream(conversation: list[dict[str, str]], **extra: Any) -> str:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=conversation,
                temperature=0,
                max_tokens=MAX_TOKENS,
                stream=True,
                **extra,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def chat(conversation: list[dict[str, str]], **extra: Any) -> str | None:
            result = await aclient.chat.completions.create(
                model=MODEL, messages=conversation, temperature=0, max_tokens=MAX_TOKENS, **extra
            )
            return result.choices[0].message.content

        async def response_events(text: str) -> list[Any]:
            tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
            stream = await aclient.responses.create(
                model=MODEL, input=text, tools=tools, max_output_tokens=MAX_TOKENS, stream=True
            )
            return [event async for event in stream]

        return await asyncio.wait_for(
            asyncio.gather(
                completion(COMPLETION_PROMPTS[0]),
                completion(COMPLETION_PROMPTS[1], extra_body=UNLUCKY),
                chat_stream(CHAT_CONVERSATIONS[0]),
                chat_stream(CHAT_CONVERSATIONS[1], extra_body=UNLUCKY),
                completion(COMPLETION_PROMPTS[2]),
                chat_stream(CHAT_CONVERSATIONS[2]),
                chat(CHAT_CONVERSATIONS[3], **FAULTY_TOOLS),
                chat_stream(CHAT_CONVERSATIONS[3], **FAULTY_TOOLS),
                response_events(COMPLETION_PROMPTS[3]),
                return_exceptions=True,
            ),
            120,
        )


@pytest.mark.starts_server(settings=FAULTY_SETTINGS, env=FAULTY_ENV)
def test_an_engine_error_in_one_request_leaves_the_others_alone(transport, tmp_path, reference):
    with faulty_server(transport, tmp_path) as server:
        results = asyncio.run(_requests(server))
        good_text, refused, good_chat, refused_stream, good_text_2, good_chat_2 = results[:6]
        unrendered, unrendered_stream, failed_response = results[6:]

        # The refused requests fail with a 5xx that says why ...
        assert isinstance(refused, openai.InternalServerError), refused
        assert refused.status_code == 500
        assert "faulty policy refuses priority 13" in refused.message
        assert refused.body["type"] == "server_error"
        assert isinstance(refused_stream, openai.APIError), refused_stream
        assert "faulty policy refuses priority 13" in refused_stream.message
        # An exception while an answer is rendered is a 500 in OpenAI's shape that names
        # it, not starlette's plain-text page; streamed, an error event ends the stream
        # (chat's; the Responses API's is response.failed).
        assert isinstance(unrendered, openai.InternalServerError), unrendered
        assert unrendered.status_code == 500, unrendered
        assert isinstance(unrendered.body, dict), unrendered.body
        assert unrendered.body["type"] == "server_error", unrendered.body
        assert TOOL_PARSER_ERROR in unrendered.body["message"]
        assert isinstance(unrendered_stream, openai.APIError), unrendered_stream
        assert TOOL_PARSER_ERROR in unrendered_stream.message
        assert not isinstance(failed_response, BaseException), failed_response
        assert failed_response[-1].type == "response.failed", failed_response[-1]
        assert TOOL_PARSER_ERROR in failed_response[-1].response.error.message
        assert TOOL_PARSER_ERROR in server.log_text()  # with its traceback, for the operator
        # ... and the others complete as if nothing happened.
        assert good_text == reference.completion(COMPLETION_PROMPTS[0]).outputs[0].text
        assert good_text_2 == reference.completion(COMPLETION_PROMPTS[2]).outputs[0].text
        assert good_chat == reference.chat(CHAT_CONVERSATIONS[0]).outputs[0].text
        assert good_chat_2 == reference.chat(CHAT_CONVERSATIONS[2]).outputs[0].text

        assert health(server) == 200
        idle = server.wait_idle()
        assert (idle["num_requests_running"], idle["num_requests_waiting"]) == (0, 0)
        assert idle["kv_cache_usage"] == 0
        # Nothing of the refused requests lingers in the engine: its busy loop stops
        # stepping (a request left in the scheduler would be stepped on every turn).
        engine = server.engine_pid()
        steps = server.metrics()["engine_steps_total"]
        assert not wait_until(lambda: server.metrics()["engine_steps_total"] != steps, 1.0)
        with server.openai_client() as client:
            again = client.completions.create(
                model=MODEL, prompt=COMPLETION_PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS
            )
        assert again.choices[0].text == good_text

        # Ctrl-C stops it in order: exit 0, no traceback, no engine left behind.
        logged = len(server.log_text())
        server.popen.send_signal(signal.SIGINT)
        assert server.popen.wait(30) == 0, server.log_tail()
        assert "Traceback" not in server.log_text()[logged:]
        assert wait_until(lambda: not is_engine(engine), 10)


# A collective timeout past the test's own waits: only the executor watching its workers
# can end the request in time.
TENSOR_PARALLEL_SETTINGS = (
    *SERVER_SETTINGS,
    "--stack.executor", "mp",
    "--tensor-parallel-size", "2",
    "--plugins.mp.collective_timeout_s", "3600",
)  # fmt: skip


@pytest.mark.starts_server(transport="zmq", settings=TENSOR_PARALLEL_SETTINGS)
def test_killed_tensor_parallel_worker_fails_the_request_naming_it(tmp_path):
    """A worker of the mp executor dies mid-request: the client hears which one, and how,
    from the engine's own last words (not a bare "the engine exited")."""
    with (
        running_server(
            "zmq", tmp_path, check_exit=False, settings=TENSOR_PARALLEL_SETTINGS
        ) as server,
        server.openai_client(timeout=60) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        workers = [
            pid
            for pid in descendants_of(server.engine_pid())
            if "plugserve::Worker_TP" in process_cmdline(pid)
        ]
        assert len(workers) == 2, workers
        streaming = threading.Event()

        def streamed() -> None:
            for _ in client.completions.create(**LONG, stream=True):
                streaming.set()

        future = pool.submit(streamed)
        assert streaming.wait(60), "the streamed request never started"
        victim = next(p for p in workers if "Worker_TP1" in process_cmdline(p))
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(openai.APIError) as error:
            future.result(timeout=60)
        assert type(error.value) is openai.APIError, error.value  # an error event
        body = error.value.body
        assert isinstance(body, dict) and body.keys() == {"message", "type", "param", "code"}
        assert body["message"].startswith(
            f"the engine core failed: RuntimeError: Worker_TP1 (pid {victim}) died "
            "unexpectedly: it was killed by SIGKILL"
        ), body
        assert (body["type"], body["param"], body["code"]) == ("server_error", None, 503)
        assert dead_health(server, body["message"])
        assert server.popen.wait(30) != 0
