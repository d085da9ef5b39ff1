"""The transport contract, proven the same way for every bundled transport.

Each test builds the transport through the plugin registry, opens the client end here
(asyncio, as the API server does) and each engine's end in a spawned child process
running `echo_engine`, which plays an engine core: it speaks first, then answers every
message, naming itself in the answer, to the client it came from. Most tests run one
engine and one client; those with two engines check data parallelism (several engines
behind one client channel, each addressed by its index, their answers merged by
`recv`), those with two clients several API servers sharing the engines (each client
hears only the answers to its own messages). test_shm.py reuses these helpers for the
shm-specific behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from plugserve.plugins import get_registry

TRANSPORTS = ["zmq", "shm"]
IDLE_SECONDS = 1.0
# Times the waiting thread may fall asleep over IDLE_SECONDS of waiting: a wait in the
# kernel sleeps once or a few times; polling every millisecond would sleep ~1000 times.
IDLE_WAKEUP_LIMIT = 20


# --------------------------------------------------------------------------- idle waits


class ThreadWatch:
    """How one thread of this process spends a wait, as the kernel counts it: how many
    times it fell asleep (its voluntary context switches, `wakeups`), and its scheduling
    state sampled every 10 ms by a watcher thread (`states`: "S" asleep, "R" running or
    ready to). A thread that waits in the kernel is asleep in (nearly) every sample and
    wakes a few times; one that spins is running in every sample."""

    def __init__(self, tid: int | None = None) -> None:
        self.task = Path(f"/proc/self/task/{tid or threading.get_native_id()}")
        self.states: list[str] = []
        self.wakeups = 0
        self._stop = threading.Event()

    def __enter__(self) -> ThreadWatch:
        self._before = self._switches()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._sampler.join()
        self.wakeups = self._switches() - self._before

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.states.append((self.task / "stat").read_text().rpartition(")")[2].split()[0])

    def _switches(self) -> int:
        for line in (self.task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
        raise AssertionError(f"no voluntary_ctxt_switches in {self.task}/status")


def assert_slept(wakeups: int, states: list[str]) -> None:
    """A ThreadWatch's thread waited in the kernel: few wakeups, (nearly) never running."""
    assert wakeups <= IDLE_WAKEUP_LIMIT, f"it fell asleep {wakeups} times: it polls"
    assert states.count("R") <= len(states) // 10, f"it was running: {''.join(states)}"


# --------------------------------------------------------------------------- the engine


def echo_engine(
    transport_cls: type,
    options: Any,
    addresses: dict[str, str],
    engine: int = 0,
    hold: Any = None,
) -> None:
    """A stand-in engine core number `engine`, run in a spawned child.

    Speaks first (`[b"ready", engine, pid]`, to every client), then, for every message,
    answering the client that sent it:
      [b"stop"]            → close and exit 0
      [b"idle", seconds]   → recv(timeout=seconds), answer [b"idle", result-is-None,
                             wall seconds, wakeups, states] of that wait (ThreadWatch)
      anything else        → send it back with b"echo<engine>:" before the first frame
                             (see `echoed`); a send the transport refuses with
                             ValueError is answered [b"error", message]
    `hold`, an Event, keeps it from reading until it is set (60 s at most), so the
    request side fills up.
    """
    channel = transport_cls(options=options).engine(addresses, engine)
    channel.send_ready([b"ready", b"%d" % engine, str(os.getpid()).encode()])
    if hold is not None:
        hold.wait(60)
    while True:
        received = channel.recv(timeout=None)
        assert received is not None
        client, frames = received
        first = bytes(frames[0])
        if first == b"stop":
            break
        if first == b"idle":
            wall = time.monotonic()
            with ThreadWatch() as watch:
                result = channel.recv(timeout=float(bytes(frames[1])))
            wall = time.monotonic() - wall
            states = "".join(watch.states).encode()
            answer = [b"idle", b"%d" % (result is None), b"%f" % wall, b"%d" % watch.wakeups]
            channel.send([*answer, states], client)
            continue
        try:
            channel.send([b"echo%d:" % engine + first, *frames[1:]], client)
        except ValueError as exc:
            channel.send([b"error", str(exc).encode()], client)
    channel.close()


def echoed(frames: list, engine: int = 0) -> list[bytes]:
    """What `echo_engine` number `engine` answers to `frames`."""
    return [b"echo%d:" % engine + bytes(frames[0]), *(bytes(f) for f in frames[1:])]


def answered_by(frames: list) -> int:
    """Which engine sent this echo."""
    prefix = bytes(frames[0]).split(b":", 1)[0]
    assert prefix.startswith(b"echo"), frames
    return int(prefix[len(b"echo") :])


def build(name: str, **options: Any):
    return get_registry().build("transport", name, options)


def spawn_engine(transport, addresses: dict[str, str], engine: int = 0, hold: Any = None):
    process = multiprocessing.get_context("spawn").Process(
        target=echo_engine,
        args=(type(transport), transport.options, addresses, engine, hold),
        daemon=True,
    )
    process.start()
    return process


@contextlib.asynccontextmanager
async def echo_servers(
    transport,
    num_engines: int = 1,
    num_clients: int = 1,
    hold: Any = None,
    addresses: dict[str, str] | None = None,
) -> AsyncIterator[tuple[list[Any], list[Any]]]:
    """(client channels, engine processes) by index, after every client has every
    engine's handshake; on exit each engine is told to stop and must exit 0, and the
    client ends are closed."""
    addresses = addresses or transport.addresses(num_engines, num_clients)
    clients = []
    processes = []
    try:
        for index in range(num_clients):
            clients.append(transport.client(addresses, index))
        for engine in range(num_engines):
            processes.append(spawn_engine(transport, addresses, engine, hold))
        expected = sorted(
            [b"ready", b"%d" % engine, str(process.pid).encode()]
            for engine, process in enumerate(processes)
        )
        for client in clients:
            handshakes = [[bytes(f) for f in await client.wait_ready(60)] for _ in processes]
            assert sorted(handshakes) == expected
        yield clients, processes
        for engine in range(num_engines):
            await clients[0].send([b"stop"], engine)
        for process in processes:
            process.join(30)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        for client in clients:
            client.close()


@contextlib.asynccontextmanager
async def echo_engines(
    transport,
    num_engines: int = 1,
    hold: Any = None,
    addresses: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Any, list[Any]]]:
    """One client: (client channel, engine processes), as `echo_servers`."""
    async with echo_servers(transport, num_engines, 1, hold, addresses) as (
        (client,),
        processes,
    ):
        yield client, processes


@contextlib.asynccontextmanager
async def echo_pair(
    transport, hold: Any = None, addresses: dict[str, str] | None = None
) -> AsyncIterator[tuple[Any, Any]]:
    """One engine: (client channel, engine process), as `echo_engines`."""
    async with echo_engines(transport, 1, hold, addresses) as (client, (process,)):
        yield client, process


async def round_trip(client, frames: list, engine: int = 0) -> list[bytes]:
    await client.send(frames, engine)
    return [bytes(f) for f in await client.recv()]


def varied_messages(max_size: int, count: int, seed: int = 0) -> list[list[bytes]]:
    """Empty frames, single and multi-frame messages, sizes from 0 to max_size bytes."""
    rng = random.Random(seed)
    messages = [[b""], [b"", b""], [b"a", b"", b"c"], [b"x" * max_size]]
    while len(messages) < count:
        sizes = [rng.randrange(0, max_size // 3 + 1) for _ in range(rng.randrange(1, 4))]
        messages.append([rng.randbytes(n) for n in sizes])
    return messages


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("name", TRANSPORTS)
def test_the_engine_speaks_first_and_then_answers(name):
    async def main():
        async with echo_pair(build(name)) as (client, _):
            assert await round_trip(client, [b"hello", b"world"]) == [b"echo0:hello", b"world"]

    asyncio.run(main())


@pytest.mark.parametrize("num_engines", [1, 2])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_messages_arrive_intact_and_in_order_both_ways(name, num_engines):
    messages = varied_messages(max_size=64 * 1024, count=300)
    rng = random.Random(3)
    targets = [rng.randrange(num_engines) for _ in messages]  # interleaved, unevenly

    async def main():
        async with echo_engines(build(name), num_engines) as (client, _):
            # Frames may be any bytes-like object.
            assert await round_trip(client, [bytearray(b"ab"), memoryview(b"cd")]) == [
                b"echo0:ab",
                b"cd",
            ]

            async def send_all():
                for frames, engine in zip(messages, targets, strict=True):
                    await client.send(frames, engine)

            sender = asyncio.create_task(send_all())  # pipelined: not one at a time
            received: list[list[list[bytes]]] = [[] for _ in range(num_engines)]
            for _ in messages:
                got = [bytes(f) for f in await client.recv()]
                received[answered_by(got)].append(got)
            await sender
            # Each engine answered exactly what was sent to it, in order; the order
            # between engines is not specified.
            for engine in range(num_engines):
                expected = [
                    echoed(frames, engine)
                    for frames, target in zip(messages, targets, strict=True)
                    if target == engine
                ]
                assert received[engine] == expected

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_each_engine_answers_only_what_is_sent_to_it(name):
    async def main():
        async with echo_engines(build(name), 2) as (client, _):
            for engine in (1, 0, 0, 1):
                assert await round_trip(client, [b"to", b"%d" % engine], engine) == echoed(
                    [b"to", b"%d" % engine], engine
                )
            # Both engines busy at once: everything comes back, each from its engine.
            for i in range(20):
                await client.send([b"%d" % i], i % 2)
            got = sorted([[bytes(f) for f in await client.recv()] for _ in range(20)])
            assert got == sorted(echoed([b"%d" % i], i % 2) for i in range(20))

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_recv_never_returns_a_handshake(name):
    transport = build(name)
    addresses = transport.addresses(2)
    client = transport.client(addresses)

    async def main():
        processes = [spawn_engine(transport, addresses, engine) for engine in (0, 1)]
        try:
            first = int(bytes((await client.wait_ready(60))[1]))
            await asyncio.sleep(0.5)  # most likely the other engine's handshake is in by now
            for i in range(5):
                assert await round_trip(client, [b"%d" % i], first) == echoed([b"%d" % i], first)
            kind, second, _ = (bytes(f) for f in await client.wait_ready(60))
            assert kind == b"ready" and int(second) == 1 - first
            assert await round_trip(client, [b"x"], 1 - first) == echoed([b"x"], 1 - first)
            for engine in (0, 1):
                await client.send([b"stop"], engine)
            for process in processes:
                process.join(30)
                assert process.exitcode == 0
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)

    try:
        asyncio.run(main())
    finally:
        client.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_idle_engine_recv_times_out_with_none_without_spinning(name):
    async def main():
        async with echo_pair(build(name)) as (client, _):
            answer = await round_trip(client, [b"idle", b"%f" % IDLE_SECONDS])
            kind, is_none, wall, wakeups, states = answer
            assert kind == b"idle" and is_none == b"1"
            assert float(wall) >= IDLE_SECONDS * 0.95  # not before its timeout
            assert_slept(int(wakeups), list(states.decode()))

    asyncio.run(main())


@pytest.mark.parametrize("num_engines", [1, 2])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_idle_client_recv_waits_without_spinning(name, num_engines):
    async def main():
        async with echo_engines(build(name), num_engines) as (client, _):
            with ThreadWatch() as watch, pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.recv(), IDLE_SECONDS)
            assert_slept(watch.wakeups, watch.states)  # the event loop's thread
            # The cancelled wait lost nothing and left the channel usable.
            for engine in range(num_engines):
                assert await round_trip(client, [b"after"], engine) == echoed([b"after"], engine)

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_wait_ready_raises_timeout_error_when_no_engine_answers(name):
    transport = build(name)
    client = transport.client(transport.addresses())

    async def main():
        with pytest.raises(TimeoutError):
            await client.wait_ready(0.2)

    try:
        asyncio.run(main())
    finally:
        client.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_wait_ready_raises_timeout_error_for_an_engine_that_never_answers(name):
    transport = build(name)
    addresses = transport.addresses(2)
    client = transport.client(addresses)

    async def main():
        process = spawn_engine(transport, addresses, 1)  # engine 0 never starts
        try:
            handshake = [bytes(f) for f in await client.wait_ready(60)]
            assert handshake == [b"ready", b"1", str(process.pid).encode()]
            with pytest.raises(TimeoutError):
                await client.wait_ready(0.2)
            assert await round_trip(client, [b"on"], 1) == echoed([b"on"], 1)
            await client.send([b"stop"], 1)
            process.join(30)
            assert process.exitcode == 0
        finally:
            if process.is_alive():
                process.kill()
                process.join(5)

    try:
        asyncio.run(main())
    finally:
        client.close()


# --------------------------------------------------------------------------- several clients


@pytest.mark.parametrize("num_engines", [1, 2])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_each_client_hears_only_the_answers_to_its_own_messages(name, num_engines):
    """Several API servers share the engines: each engine answers every message on the
    client it came from, in order, while all clients send at once."""
    num_clients = 3
    rng = random.Random(5)
    plans = [
        [(frames, rng.randrange(num_engines)) for frames in varied_messages(8 * 1024, 120, seed)]
        for seed in range(num_clients)
    ]

    async def main():
        async with echo_servers(build(name), num_engines, num_clients) as (clients, _):

            async def converse(client, plan) -> list[list[list[bytes]]]:
                async def send_all():
                    for frames, engine in plan:
                        await client.send(frames, engine)

                sender = asyncio.create_task(send_all())
                received: list[list[list[bytes]]] = [[] for _ in range(num_engines)]
                for _ in plan:
                    got = [bytes(f) for f in await client.recv()]
                    received[answered_by(got)].append(got)
                await sender
                return received

            results = await asyncio.gather(
                *(converse(client, plan) for client, plan in zip(clients, plans, strict=True))
            )
            for plan, received in zip(plans, results, strict=True):
                for engine in range(num_engines):
                    expected = [echoed(frames, e) for frames, e in plan if e == engine]
                    assert received[engine] == expected
            # Nothing else is waiting for anyone.
            for client in clients:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(client.recv(), 0.2)

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_client_index_out_of_range_is_refused(name):
    transport = build(name)
    addresses = transport.addresses(1, 2)
    with pytest.raises(IndexError):
        transport.client(addresses, 2)
