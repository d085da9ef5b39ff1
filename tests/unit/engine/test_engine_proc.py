"""EngineCoreProc shared by several API servers: every output, PONG and refusal goes to
the client that sent the request, and a client cannot touch another's requests.

A real engine (the embedded model, small KV cache) runs its busy loop and IO threads in
a thread of this process, joined by a real transport to two client channels in this
test's event loop, exactly as two API-server processes would talk to it. The engine runs
on the CPU, so its outputs leave from the busy loop unless a test asks for the output
thread (a GPU engine's sender).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from plugserve.config import load_config
from plugserve.engine.core import EngineCore
from plugserve.engine.engine_proc import EngineCoreProc
from plugserve.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    OutputType,
    RequestType,
    SchedulerStats,
    encoder,
    outputs_decoder,
    pong_decoder,
)
from plugserve.plugins import get_registry
from plugserve.sampling_params import SamplingParams

PROMPT = [1, 504, 3458, 282, 4649, 314]  # a few ids of the embedded model's vocabulary
QUIET_S = 0.3  # how long a client listens to be sure nothing more comes


@pytest.fixture(scope="module")
def config():
    return load_config(
        overrides={
            "dtype": "float32",
            "kv_cache_memory": "16MiB",
            "max_model_len": 256,
            "max_num_seqs": 8,
            "num_threads": 1,
            "api_server_count": 2,
        }
    )


@contextlib.asynccontextmanager
async def engine_with_two_clients(
    config, transport_name: str, send_from_busy_loop: bool | None = None, wrap_channel=None
) -> AsyncIterator[list[Any]]:
    """Two client channels to one running EngineCoreProc; stopped with SHUTDOWN."""
    transport = get_registry().build("transport", transport_name, None)
    addresses = transport.addresses(1, 2)
    clients = [transport.client(addresses, index) for index in range(2)]
    channel = transport.engine(addresses, 0)
    if wrap_channel is not None:
        channel = wrap_channel(channel)
    proc = EngineCoreProc(
        EngineCore(config), channel, 0, num_clients=2, send_from_busy_loop=send_from_busy_loop
    )
    channel.send_ready([OutputType.READY, b""])
    for client in clients:
        assert bytes((await client.wait_ready(10))[0]) == OutputType.READY
    thread = threading.Thread(target=proc.run, name="engine", daemon=True)
    thread.start()
    try:
        yield clients
    finally:
        await clients[0].send([RequestType.SHUTDOWN, b""])
        await asyncio.to_thread(thread.join, 30)
        for client in clients:
            client.close()
    assert not thread.is_alive()


async def add(client, request_id: str, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = EngineCoreRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling_params=params
    )
    await client.send([RequestType.ADD, encoder.encode(request)])


async def outputs_until_finished(client, request_id: str) -> list[EngineCoreOutput]:
    """Every output this client receives until `request_id` finishes."""
    received = []
    while True:
        kind, payload = await asyncio.wait_for(client.recv(), 30)
        assert bytes(kind) == OutputType.OUTPUTS
        received += outputs_decoder.decode(payload).outputs
        if any(o.request_id == request_id and o.finished for o in received):
            return received


async def first_tokens(client, request_id: str) -> list[EngineCoreOutput]:
    """The outputs this client receives until `request_id` has at least one token."""
    received = []
    while not any(o.request_id == request_id and o.new_token_ids for o in received):
        kind, payload = await asyncio.wait_for(client.recv(), 30)
        assert bytes(kind) == OutputType.OUTPUTS
        received += outputs_decoder.decode(payload).outputs
    return received


async def nothing_more(client) -> bool:
    """True if no output arrives for QUIET_S (the engine's figures may, alone: a stats
    message with no outputs); False after taking the message that did."""
    with contextlib.suppress(asyncio.TimeoutError):
        while True:
            kind, payload = await asyncio.wait_for(client.recv(), QUIET_S)
            if bytes(kind) != OutputType.OUTPUTS or outputs_decoder.decode(payload).outputs:
                return False
    return True


@pytest.mark.parametrize("sender", ["busy loop", "output thread"])
@pytest.mark.parametrize("transport_name", ["zmq", "shm"])
def test_each_client_gets_the_outputs_of_its_own_requests_only(config, transport_name, sender):
    async def main():
        async with engine_with_two_clients(
            config, transport_name, send_from_busy_loop=None if sender == "busy loop" else False
        ) as clients:
            for index, client in enumerate(clients):
                await add(client, f"request-{index}", max_tokens=8)
            for index, client in enumerate(clients):
                outputs = await outputs_until_finished(client, f"request-{index}")
                assert {o.request_id for o in outputs} == {f"request-{index}"}
                assert sum(len(o.new_token_ids) for o in outputs) == 8
            assert await nothing_more(clients[0]) and await nothing_more(clients[1])

    asyncio.run(main())


def test_a_request_id_in_use_is_refused_to_its_sender_and_the_first_goes_on(config):
    async def main():
        async with engine_with_two_clients(config, "zmq") as (first, second):
            await add(first, "same", max_tokens=24)
            # The two clients' messages reach the engine on different sockets, in either
            # order: the second is sent once the first has produced a token.
            outputs = await first_tokens(first, "same")
            await add(second, "same", max_tokens=4)
            (refusal,) = await outputs_until_finished(second, "same")
            assert refusal.finish_reason == "error" and "already in use" in refusal.error
            if not any(o.finished for o in outputs):
                outputs += await outputs_until_finished(first, "same")
            assert all(o.error is None for o in outputs)
            assert sum(len(o.new_token_ids) for o in outputs) == 24

    asyncio.run(main())


def test_pings_are_answered_to_their_sender_and_aborts_touch_only_the_senders_requests(config):
    async def main():
        async with engine_with_two_clients(config, "shm") as (owner, other):
            await add(owner, "long", max_tokens=200)
            await owner.recv()  # it is running
            await other.send([RequestType.ABORT, encoder.encode(["long"])])
            await other.send([RequestType.PING, encoder.encode(7)])
            kind, payload = await asyncio.wait_for(other.recv(), 10)
            assert bytes(kind) == OutputType.PONG
            pong = pong_decoder.decode(payload)
            assert pong.nonce == 7 and pong.stats.num_running == 1  # not aborted
            await owner.send([RequestType.ABORT, encoder.encode(["long"])])
            while not await nothing_more(owner):  # outputs stepped before the abort
                pass
            await other.send([RequestType.PING, encoder.encode(8)])
            kind, payload = await asyncio.wait_for(other.recv(), 10)
            pong = pong_decoder.decode(payload)
            assert pong.nonce == 8 and pong.stats.num_running == 0

    asyncio.run(main())


SEND_S = 0.02


class SlowSends:
    """The engine's end of a real channel, each of whose sends takes SEND_S longer."""

    def __init__(self, channel) -> None:
        self._channel = channel

    def send(self, frames, client: int = 0) -> None:
        time.sleep(SEND_S)
        self._channel.send(frames, client)

    def __getattr__(self, name: str):
        return getattr(self._channel, name)


def test_a_cpu_engine_sends_from_its_busy_loop_and_counts_that_time_as_overhead(config):
    async def main():
        async with engine_with_two_clients(config, "zmq", wrap_channel=SlowSends) as clients:
            client = clients[0]
            await ping(client, 1)
            await add(client, "timed", max_tokens=6)
            # The counters in a stats message count since the engine's previous one: the
            # sum over every message after the first PONG is what the request cost.
            stats: list[SchedulerStats] = []
            messages, finished = 0, False
            while not finished:
                kind, payload = await asyncio.wait_for(client.recv(), 30)
                assert bytes(kind) == OutputType.OUTPUTS
                batch = outputs_decoder.decode(payload)
                stats += [batch.scheduler_stats] if batch.scheduler_stats else []
                messages += bool(batch.outputs)
                finished = any(o.finished for o in batch.outputs)
            after = await ping(client, 2, stats)
            stats.append(after.stats)
            step_s = sum(s.step_seconds for s in stats)
            forward_s = sum(s.forward_seconds for s in stats)
            assert messages >= 2
            assert step_s - forward_s >= messages * SEND_S

    asyncio.run(main())


async def ping(client, nonce: int, stats: list[SchedulerStats] | None = None):
    """The PONG; the stats of messages that came first (the engine's figures sent alone)
    are added to `stats`."""
    await client.send([RequestType.PING, encoder.encode(nonce)])
    while True:
        kind, payload = await asyncio.wait_for(client.recv(), 10)
        if bytes(kind) != OutputType.OUTPUTS:
            break
        batch = outputs_decoder.decode(payload)
        assert not batch.outputs
        if stats is not None and batch.scheduler_stats is not None:
            stats.append(batch.scheduler_stats)
    assert bytes(kind) == OutputType.PONG
    return pong_decoder.decode(payload)


def _stats_of(kind, payload) -> SchedulerStats | None:
    if bytes(kind) == OutputType.OUTPUTS:
        return outputs_decoder.decode(payload).scheduler_stats
    return pong_decoder.decode(payload).stats


async def stats_until(
    clients, done: Callable[[list[SchedulerStats]], bool]
) -> list[SchedulerStats]:
    """The stats of every message the clients receive (in arrival order per client) until
    `done` holds for all of them, then until QUIET_S pass without another: a late extra
    message is taken in, never cut off by a slow machine (the deadline is liveness only)."""
    received: list[SchedulerStats] = []
    deadline = time.monotonic() + 60
    while not done(received):
        assert time.monotonic() < deadline, f"never done: {received}"
        for client in clients:
            with contextlib.suppress(asyncio.TimeoutError):
                stats = _stats_of(*await asyncio.wait_for(client.recv(), 0.05))
                received += [stats] if stats is not None else []
    for client in clients:
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                stats = _stats_of(*await asyncio.wait_for(client.recv(), QUIET_S))
                received += [stats] if stats is not None else []
    return received


def test_each_counter_increment_reaches_one_client_and_the_gauges_come_unasked(config):
    """Summed over both clients, the counters of every stats message are the engine's
    totals (nothing counted twice, nothing lost); and after the last request ends, its
    figures arrive without anyone asking (no PING): running 0, the KV cache free."""

    async def main():
        async with engine_with_two_clients(config, "zmq") as clients:
            for index, client in enumerate(clients):
                await add(client, f"request-{index}", max_tokens=5 + index)
            everything = await stats_until(
                clients,
                lambda got: (
                    sum(s.num_generated_tokens for s in got) >= 5 + 6
                    and sum(n for s in got for n in s.num_finished.values()) >= 2
                ),
            )
            assert sum(s.num_generated_tokens for s in everything) == 5 + 6
            assert sum(s.num_prompt_tokens for s in everything) == 2 * len(PROMPT)
            finished: dict[str, int] = {}
            for s in everything:
                for reason, n in s.num_finished.items():
                    finished[reason] = finished.get(reason, 0) + n
            assert finished == {"length": 2}
            assert sum(s.num_pings for s in everything) == 0
            # A long request aborted while nothing else runs: the figures of the idle
            # engine come unasked (alone, to client 0, whose request it was).
            await add(clients[0], "long", max_tokens=200)
            await clients[0].recv()  # it is running
            await clients[0].send([RequestType.ABORT, encoder.encode(["long"])])
            after = await stats_until(
                [clients[0]],
                lambda got: (
                    sum(s.num_finished.get("abort", 0) for s in got) >= 1
                    and got[-1].num_running == 0
                    and got[-1].num_waiting == 0
                ),
            )
            assert sum(s.num_finished.get("abort", 0) for s in after) == 1
            assert after[-1].num_running == 0 and after[-1].num_waiting == 0
            assert after[-1].num_free_kv_blocks == after[-1].num_kv_blocks
            assert await nothing_more(clients[1])

    asyncio.run(main())


def test_a_busy_engine_logs_its_throughput_every_interval(config, caplog):
    """vLLM's periodic line, from the busy loop: every log_stats_interval seconds while
    busy, and once more after the engine goes idle; none while it stays idle."""
    config = config.model_copy(deep=True)
    config.engine.log_stats_interval = 0.2

    async def main():
        async with engine_with_two_clients(config, "zmq") as clients:
            await add(clients[0], "long", max_tokens=48)
            await outputs_until_finished(clients[0], "long")
            await asyncio.sleep(0.5)  # the line that ends the busy spell
            lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
            assert lines, "no periodic line"
            assert "Avg generation throughput" in lines[0] and "Running:" in lines[0]
            assert "Running: 0 reqs" in lines[-1]
            count = len(lines)
            await asyncio.sleep(0.5)  # idle: no more lines
            assert len([r for r in caplog.records if "throughput" in r.getMessage()]) == count

    with caplog.at_level("INFO", logger="plugserve.engine.engine_proc"):
        asyncio.run(main())
