"""The transport contract, proven the same way for every bundled transport.

Each test builds the transport through the plugin registry, opens the client end here
(asyncio, as the API server does) and the engine end in a spawned child process running
`echo_engine`, which plays the engine core: it speaks first, then answers every message.
test_shm.py reuses `echo_engine` and `echo_pair` for the shm-specific behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from plugserve.plugins import get_registry

TRANSPORTS = ["zmq", "shm"]
IDLE_SECONDS = 1.0
IDLE_CPU_LIMIT = 0.1  # CPU seconds over IDLE_SECONDS of waiting: well under, or it spins


# --------------------------------------------------------------------------- the engine


def echo_engine(
    transport_cls: type, options: Any, addresses: dict[str, str], start_delay: float = 0.0
) -> None:
    """A stand-in engine core, run in a spawned child.

    Speaks first (`[b"ready", pid]`), then, for every message:
      [b"stop"]            → close and exit 0
      [b"idle", seconds]   → recv(timeout=seconds), answer [b"idle", result-is-None,
                             CPU seconds, wall seconds] of that wait
      anything else        → send it back with b"echo:" before the first frame; a send
                             the transport refuses with ValueError is answered
                             [b"error", message]
    `start_delay` keeps it from reading at first, so the request side fills up.
    """
    channel = transport_cls(options=options).engine(addresses)
    channel.send_ready([b"ready", str(os.getpid()).encode()])
    time.sleep(start_delay)
    while True:
        frames = channel.recv(timeout=None)
        assert frames is not None
        first = bytes(frames[0])
        if first == b"stop":
            break
        if first == b"idle":
            cpu, wall = time.process_time(), time.monotonic()
            result = channel.recv(timeout=float(bytes(frames[1])))
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            channel.send([b"idle", b"%d" % (result is None), b"%f" % cpu, b"%f" % wall])
            continue
        try:
            channel.send([b"echo:" + first, *frames[1:]])
        except ValueError as exc:
            channel.send([b"error", str(exc).encode()])
    channel.close()


def build(name: str, **options: Any):
    return get_registry().build("transport", name, options)


@contextlib.asynccontextmanager
async def echo_pair(
    transport, start_delay: float = 0.0, addresses: dict[str, str] | None = None
) -> AsyncIterator[tuple[Any, Any]]:
    """(client channel, engine process) after the handshake; on exit the engine is told
    to stop and must exit 0, and the client end is closed."""
    addresses = addresses or transport.addresses()
    client = transport.client(addresses)
    process = multiprocessing.get_context("spawn").Process(
        target=echo_engine,
        args=(type(transport), transport.options, addresses, start_delay),
        daemon=True,
    )
    try:
        process.start()
        ready = await client.wait_ready(60)
        assert [bytes(f) for f in ready] == [b"ready", str(process.pid).encode()]
        yield client, process
        await client.send([b"stop"])
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(5)
        client.close()


async def round_trip(client, frames: list) -> list[bytes]:
    await client.send(frames)
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
            assert await round_trip(client, [b"hello", b"world"]) == [b"echo:hello", b"world"]

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_messages_arrive_intact_and_in_order_both_ways(name):
    messages = varied_messages(max_size=64 * 1024, count=300)

    async def main():
        async with echo_pair(build(name)) as (client, _):
            # Frames may be any bytes-like object.
            assert await round_trip(client, [bytearray(b"ab"), memoryview(b"cd")]) == [
                b"echo:ab",
                b"cd",
            ]

            async def send_all():
                for frames in messages:
                    await client.send(frames)

            sender = asyncio.create_task(send_all())  # pipelined: not one at a time
            for frames in messages:
                got = [bytes(f) for f in await client.recv()]
                assert got == [b"echo:" + frames[0], *frames[1:]]
            await sender

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_idle_engine_recv_times_out_with_none_without_spinning(name):
    async def main():
        async with echo_pair(build(name)) as (client, _):
            kind, is_none, cpu, wall = await round_trip(client, [b"idle", b"%f" % IDLE_SECONDS])
            assert kind == b"idle" and is_none == b"1"
            assert float(wall) >= IDLE_SECONDS * 0.95
            assert float(cpu) < IDLE_CPU_LIMIT

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_idle_client_recv_waits_without_spinning(name):
    async def main():
        async with echo_pair(build(name)) as (client, _):
            cpu = time.process_time()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.recv(), IDLE_SECONDS)
            assert time.process_time() - cpu < IDLE_CPU_LIMIT
            # The cancelled wait lost nothing and left the channel usable.
            assert await round_trip(client, [b"after"]) == [b"echo:after"]

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
