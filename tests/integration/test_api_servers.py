"""Several API servers (`--api-server-count 2`) on one port, sharing the engine core(s).

The launcher (plugserve::Launcher) supervises ApiServer_0 and ApiServer_1; every
response names the API-server process that answered it (x-plugserve-api-server), which
is how these tests know that both served. Their outputs must be those of a single API
server, a dead engine must fail every API server's requests and take the whole server
down, and so must a dead API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import (
    LAUNCHER_TITLE,
    PlugserveServer,
    is_api_server_child,
    is_engine,
    plugserve_command,
)
from plugserve.bench.processes import process_cmdline
from plugserve.bench.server_process import free_port, wait_until

from .conftest import (
    API_SERVER_HEADER,
    CHAT_CONVERSATIONS,
    COMPLETION_PROMPTS,
    LONG_MAX_TOKENS,
    MAX_TOKENS,
    MODEL,
    REPO_ROOT,
    SERVER_SETTINGS,
    TRANSPORTS,
    running_server,
)

TWO_API_SERVERS = (*SERVER_SETTINGS, "--api-server-count", "2")
TWO_API_SERVERS_TWO_ENGINES = (*TWO_API_SERVERS, "--data-parallel-size", "2")
REPEATS = 1  # every prompt and conversation this many times, streamed and not: 16 requests
LONG = {
    "model": MODEL,
    "prompt": "Once upon a time",
    "temperature": 0,
    "max_tokens": LONG_MAX_TOKENS,
    "extra_body": {"ignore_eos": True},
}


def identities(server: PlugserveServer) -> dict[str, str]:
    """x-plugserve-api-server value → process title, for each API-server child."""
    pids = server.api_server_pids()
    return {
        f"{process_cmdline(pid).split()[0].removeprefix('plugserve::')} pid={pid}": (
            process_cmdline(pid).split()[0]
        )
        for pid in pids
    }


# --------------------------------------------------------------------------- the workload


async def _completion(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> tuple[str, str]:
    """(text, the API server that answered)."""
    options = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    raw = await client.completions.with_raw_response.create(**options, stream=stream)
    result = raw.parse()
    if stream:
        text = "".join([chunk.choices[0].text async for chunk in result if chunk.choices])
    else:
        text = result.choices[0].text
    return text, raw.headers[API_SERVER_HEADER]


async def _chat(
    client: openai.AsyncOpenAI, conversation: list[dict[str, str]], stream: bool
) -> tuple[str, str]:
    options = {
        "model": MODEL,
        "messages": conversation,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    raw = await client.chat.completions.with_raw_response.create(**options, stream=stream)
    result = raw.parse()
    if stream:
        text = "".join(
            [chunk.choices[0].delta.content or "" async for chunk in result if chunk.choices]
        )
    else:
        text = result.choices[0].message.content
    return text, raw.headers[API_SERVER_HEADER]


async def _workload(server: PlugserveServer) -> tuple[list[str], list[str]]:
    """Every request at once, each on a connection of its own: (texts in request order,
    the API server that answered each)."""
    async with server.async_openai_client() as client:
        calls = [
            call
            for _ in range(REPEATS)
            for stream in (False, True)
            for call in (
                *(_completion(client, prompt, stream) for prompt in COMPLETION_PROMPTS),
                *(_chat(client, conversation, stream) for conversation in CHAT_CONVERSATIONS),
            )
        ]
        results = await asyncio.wait_for(asyncio.gather(*calls), 300)
    return [text for text, _ in results], [answered_by for _, answered_by in results]


def _expected_texts(reference: Any) -> list[str]:
    """The workload's greedy texts as one API server answers them (the offline reference,
    which tests/integration/test_openai_api.py holds a single API server to), in its order."""
    return [
        out.outputs[0].text
        for _ in range(REPEATS)
        for _stream in (False, True)
        for out in (
            *reference.completions(COMPLETION_PROMPTS),
            *reference.chats(CHAT_CONVERSATIONS),
        )
    ]


@pytest.mark.transports(*TRANSPORTS)
@pytest.mark.starts_server(settings=TWO_API_SERVERS)
def test_two_api_servers_answer_as_one_and_share_the_requests(
    transport, server, reference, tmp_path
):
    """Greedy outputs equal a single API server's, both API servers answer some of them,
    the engine ends idle, and Ctrl-C stops everything."""
    expected = _expected_texts(reference)
    single = httpx.get(server.url("/v1/models"), timeout=30)  # the shared `server`: one
    assert single.headers[API_SERVER_HEADER] == f"ApiServer pid={server.pid}"
    with running_server(transport, tmp_path, settings=TWO_API_SERVERS) as multi:
        assert process_cmdline(multi.pid).startswith(LAUNCHER_TITLE)
        named = identities(multi)
        assert sorted(named.values()) == ["plugserve::ApiServer_0", "plugserve::ApiServer_1"]
        engine = multi.engine_pid()
        texts, answered_by = asyncio.run(_workload(multi))
        idle = multi.wait_idle()

        assert texts == expected
        assert set(answered_by) == set(named), answered_by  # both, and nobody else
        assert (idle["num_requests_running"], idle["num_requests_waiting"]) == (0, 0)
        assert idle["kv_cache_usage"] == 0

        multi.popen.send_signal(signal.SIGINT)
        assert multi.popen.wait(30) == 0, multi.log_tail()
        children = [engine, *multi.api_server_pids()]
        assert wait_until(lambda: not any(map(is_engine, children)), 10)
        assert wait_until(lambda: not any(map(is_api_server_child, children)), 10)
        log = multi.log_text()
    assert "Traceback" not in log
    for line in log.splitlines():  # every log line names its process
        if re.match(r"^\d\d:\d\d:\d\d ", line):
            assert re.match(r"^\S+ (Launcher|ApiServer_[01]|EngineCore) pid=\d+ [A-Z]+ ", line)


@pytest.mark.starts_server(transport="zmq", settings=TWO_API_SERVERS_TWO_ENGINES)
def test_two_api_servers_share_two_engines(tmp_path, reference):
    """Data parallelism behind several API servers: each API server balances its own
    requests over both engines."""
    with running_server("zmq", tmp_path, settings=TWO_API_SERVERS_TWO_ENGINES) as multi:
        engines = sorted(process_cmdline(pid) for pid in multi.engine_pids())
        assert engines == ["plugserve::EngineCore_DP0", "plugserve::EngineCore_DP1"]
        texts, answered_by = asyncio.run(_workload(multi))
        assert set(answered_by) == set(identities(multi))
        idle = multi.wait_idle()
    assert texts == _expected_texts(reference)
    assert (idle["num_requests_running"], idle["kv_cache_usage"]) == (0, 0)


# --------------------------------------------------------------------------- failures


async def _streams_on_both_api_servers(
    server: PlugserveServer, connections: contextlib.AsyncExitStack
) -> list[AsyncIterator[Any]]:
    """Long streamed completions, each on a new connection, until each API server has
    one generating (the kernel picks the API server of each new connection)."""
    streams: dict[str, AsyncIterator[Any]] = {}
    for _ in range(30):
        client = await connections.enter_async_context(server.async_openai_client(timeout=60))
        raw = await client.completions.with_raw_response.create(**LONG, stream=True)
        stream = raw.parse()
        await stream.__anext__()  # it is generating
        answered_by = raw.headers[API_SERVER_HEADER]
        if answered_by in streams:
            await stream.close()  # the server aborts it
        else:
            streams[answered_by] = stream
        if len(streams) == 2:
            return list(streams.values())
    raise AssertionError(f"30 connections all went to {list(streams)}")


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


@pytest.mark.transports("shm")
@pytest.mark.starts_server(settings=TWO_API_SERVERS)
def test_a_killed_engine_fails_requests_on_every_api_server_and_the_server_exits(
    transport, tmp_path
):
    async def main(server: PlugserveServer) -> None:
        async with (
            contextlib.AsyncExitStack() as connections,
            server.async_openai_client(timeout=60) as client,
        ):
            streams = await _streams_on_both_api_servers(server, connections)
            plain = asyncio.create_task(client.completions.create(**LONG))
            assert await asyncio.to_thread(
                wait_until, lambda: server.metrics()["num_requests_running"] == 3, 30
            )
            os.kill(server.engine_pid(), signal.SIGKILL)
            error = {
                "message": "the engine core EngineCore exited unexpectedly (exit code -9)",
                "type": "server_error",
                "param": None,
                "code": 503,
            }
            with pytest.raises(openai.APIStatusError) as refused:
                await asyncio.wait_for(plain, 60)
            assert refused.value.status_code == 503
            assert refused.value.response.json() == {"error": error}
            for stream in streams:  # an error event in the same shape, not a cut connection
                with pytest.raises(openai.APIError) as failed:
                    await asyncio.wait_for(_drain(stream), 60)
                assert type(failed.value) is openai.APIError, failed.value
                assert failed.value.body == error

    with running_server(transport, tmp_path, check_exit=False, settings=TWO_API_SERVERS) as server:
        api_servers = server.api_server_pids()
        asyncio.run(main(server))
        assert server.popen.wait(30) != 0, server.log_tail()
        assert "exited unexpectedly" in server.log_text()
        assert wait_until(lambda: not any(map(is_api_server_child, api_servers)), 10)


@pytest.mark.starts_server(transport="zmq", settings=TWO_API_SERVERS)
def test_a_killed_api_server_takes_the_server_down(tmp_path):
    """No half-working server: the launcher stops the other API server and the engine."""
    with running_server("zmq", tmp_path, check_exit=False, settings=TWO_API_SERVERS) as server:
        first, second = server.api_server_pids()
        engine = server.engine_pid()
        os.kill(second, signal.SIGKILL)
        assert server.popen.wait(30) != 0, server.log_tail()
        assert re.search(r"ApiServer_1 exited unexpectedly \(exit code -9\)", server.log_text())
        assert wait_until(lambda: not is_api_server_child(first) and not is_engine(engine), 10)


def test_an_api_server_count_below_one_fails_with_one_line():
    command = [*plugserve_command(), "serve", "--port", str(free_port()), "--api-server-count", "0"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plugserve: error: "), done.stderr
    assert "api_server_count" in lines[0]


@pytest.mark.starts_server(transport="shm", settings=TWO_API_SERVERS)
def test_a_killed_launcher_takes_its_children_along(tmp_path):
    """Orphans would hold the port and the engine's memory with nobody to stop them."""
    with running_server("shm", tmp_path, check_exit=False, settings=TWO_API_SERVERS) as server:
        children = [*server.api_server_pids(), server.engine_pid()]
        said = re.search(r"metrics are summed through (\S+)", server.log_text())
        assert said, server.log_tail()
        metrics_dir = Path(said.group(1))
        assert metrics_dir.is_dir()
        server.popen.kill()
        server.popen.wait(10)
        assert wait_until(
            lambda: not any(is_api_server_child(pid) or is_engine(pid) for pid in children), 10
        ), server.log_tail()
    # The launcher could not remove the API servers' metrics directory; they did.
    assert not metrics_dir.exists()
