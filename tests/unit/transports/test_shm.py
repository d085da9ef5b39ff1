"""The shm transport: shared-memory rings with FIFO doorbells between two processes.

The contract every transport honours (handshake, order, timeouts, idle waits that do not
spin) is in test_transport_contract.py, shm included; this file specifies what is the
shm transport's own: options, ring wrap-around, the size limit, back-pressure, who
creates and who removes the shared memory.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pydantic
import pytest
from test_transport_contract import build, echo_pair, round_trip, varied_messages

from plugserve_plugins.transports.shm import MIN_RING_BYTES, ShmEngineChannel, ShmTransport

SMALL_RING = 4096
HEADER = 16  # u64 record length + u64 frame count, then u64 per frame


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def left_behind(addresses: dict[str, str]) -> list[str]:
    """What the transport created for these addresses and still exists."""
    paths = [os.path.join("/dev/shm", addresses[k]) for k in ("input", "output")]
    paths.append(addresses["folder"])
    return [p for p in paths if os.path.exists(p)]


# --------------------------------------------------------------------------- options


def test_options_default_to_16_mib_rings_and_are_validated():
    assert ShmTransport().options.ring_bytes == 16 << 20
    assert build("shm", ring_bytes=SMALL_RING).options.ring_bytes == SMALL_RING
    with pytest.raises(pydantic.ValidationError):
        build("shm", ring_bytes=MIN_RING_BYTES - 1)
    with pytest.raises(pydantic.ValidationError):
        build("shm", ring_size=SMALL_RING)  # unknown keys are refused


def test_addresses_are_fresh_names_and_create_nothing():
    transport = ShmTransport()
    first, second = transport.addresses(), transport.addresses()
    assert first != second
    assert all(len(first[k]) < 31 for k in ("input", "output"))  # macOS's shm name limit
    assert left_behind(first) == []


# --------------------------------------------------------------------------- the ring


def test_small_ring_wraps_around_many_times_without_corrupting_messages():
    transport = build("shm", ring_bytes=SMALL_RING)
    messages = varied_messages(max_size=SMALL_RING // 2 - 64, count=2000, seed=1)
    assert sum(len(b"".join(m)) for m in messages) > 100 * SMALL_RING

    async def main():
        async with echo_pair(transport) as (client, _):

            async def send_all():
                for frames in messages:
                    await client.send(frames)

            sender = asyncio.create_task(send_all())
            for frames in messages:
                assert await client.recv() == [b"echo:" + frames[0], *frames[1:]]
            await sender

    asyncio.run(main())


def test_messages_up_to_half_the_ring_arrive_intact():
    ring = 1 << 20
    transport = build("shm", ring_bytes=ring)
    messages = varied_messages(max_size=ring // 2 - 64, count=40, seed=2)

    async def main():
        async with echo_pair(transport) as (client, _):
            for frames in messages:
                assert await round_trip(client, frames) == [b"echo:" + frames[0], *frames[1:]]

    asyncio.run(main())


def test_a_message_larger_than_the_ring_raises_value_error_and_the_channel_goes_on():
    transport = build("shm", ring_bytes=SMALL_RING)
    exact_fit = b"x" * (SMALL_RING - HEADER - 8)  # one frame: its record fills the ring

    async def main():
        async with echo_pair(transport) as (client, _):
            with pytest.raises(ValueError, match="does not fit in the shm transport's ring"):
                await client.send([exact_fit + b"x"])
            # Exactly the capacity is allowed; its echo, 5 bytes longer, is refused on
            # the engine's side with the same error, and the engine goes on.
            kind, message = await round_trip(client, [exact_fit])
            assert kind == b"error" and b"ring_bytes" in message
            assert await round_trip(client, [b"still", b"working"]) == [
                b"echo:still",
                b"working",
            ]

    asyncio.run(main())


# --------------------------------------------------------------------------- back-pressure


def test_a_full_request_ring_makes_senders_wait_in_order_without_blocking_the_loop():
    transport = build("shm", ring_bytes=SMALL_RING)
    count, payload = 60, b"p" * 1000  # ~15 rings' worth; the engine reads nothing for 0.5 s

    async def main():
        async with echo_pair(transport, start_delay=0.5) as (client, _):
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticking = asyncio.create_task(ticker())
            started = time.monotonic()
            # Concurrent senders, all held back by the full ring, keep their order.
            sends = asyncio.gather(*(client.send([b"%d" % i, payload]) for i in range(count)))
            for i in range(count):
                assert await client.recv() == [b"echo:%d" % i, payload]
            await sends
            ticking.cancel()
            assert time.monotonic() - started >= 0.4  # the senders did have to wait
            assert ticks >= 20  # and the event loop ran meanwhile

    asyncio.run(main())


def test_a_full_output_ring_makes_the_engine_wait_and_loses_nothing():
    transport = build("shm", ring_bytes=SMALL_RING)
    messages = [[b"%d" % i, b"o" * 900] for i in range(100)]

    async def main():
        async with echo_pair(transport) as (client, _):

            async def send_all():
                for frames in messages:
                    await client.send(frames)

            sender = asyncio.create_task(send_all())
            await asyncio.sleep(0.5)  # not reading: both rings fill, both sides wait
            assert not sender.done()
            for frames in messages:
                assert await client.recv() == [b"echo:" + frames[0], frames[1]]
            await sender

    asyncio.run(main())


# --------------------------------------------------------------------------- ownership


def test_the_client_removes_every_segment_and_fifo_when_it_closes():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses()
    client = transport.client(addresses)
    assert len(left_behind(addresses)) == 3  # two segments and the FIFO folder
    engine = transport.engine(addresses)
    engine.close()  # the engine only unmaps
    assert len(left_behind(addresses)) == 3
    client.close()
    client.close()  # idempotent
    assert left_behind(addresses) == []


def test_nothing_is_left_behind_after_a_served_session():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses()

    async def main():
        async with echo_pair(transport, addresses=addresses) as (client, _):
            assert len(left_behind(addresses)) == 3
            await round_trip(client, [b"x"])

    asyncio.run(main())
    assert left_behind(addresses) == []


def test_a_client_that_fails_to_open_leaves_nothing_behind():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses()
    os.mkdir(addresses["folder"])  # someone else's folder: never reused
    try:
        with pytest.raises(FileExistsError):
            transport.client(addresses)
        assert not shm_exists(addresses["input"]) and not shm_exists(addresses["output"])
    finally:
        os.rmdir(addresses["folder"])


def test_an_engine_in_an_unrelated_process_leaves_the_segments_alone_when_it_exits():
    # Attaching must not register the segments with the engine process's resource
    # tracker: a tracker of its own would unlink them (and warn) when that process exits.
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses()
    client = transport.client(addresses)
    code = (
        "import sys; from plugserve_plugins.transports.shm import ShmTransport\n"
        "engine = ShmTransport().engine(dict(zip(('input', 'output', 'folder'), sys.argv[1:])))\n"
        "engine.send_ready([b'ready']); engine.close()\n"
    )
    try:
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                addresses["input"],
                addresses["output"],
                addresses["folder"],
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        assert "resource_tracker" not in child.stderr
        assert len(left_behind(addresses)) == 3
        assert asyncio.run(client.wait_ready(5)) == [b"ready"]
    finally:
        client.close()
    assert left_behind(addresses) == []


def test_the_engine_may_open_first_and_waits_for_the_client():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses()
    opened = []
    thread = threading.Thread(target=lambda: opened.append(transport.engine(addresses)))
    thread.start()
    time.sleep(0.2)
    client = transport.client(addresses)
    try:
        thread.join(10)
        (engine,) = opened
        engine.send_ready([b"ready"])
        assert asyncio.run(client.wait_ready(5)) == [b"ready"]
        engine.close()
    finally:
        client.close()


def test_an_engine_whose_client_never_opens_gives_up_with_a_clear_error():
    addresses = ShmTransport().addresses()
    with pytest.raises(TimeoutError, match="was not created within"):
        ShmEngineChannel(addresses, attach_timeout=0.1)
    assert left_behind(addresses) == []


def test_a_closed_client_refuses_to_send_or_receive():
    transport = build("shm", ring_bytes=SMALL_RING)
    client = transport.client(transport.addresses())
    client.close()

    async def main():
        with pytest.raises(RuntimeError, match="closed"):
            await client.send([b"x"])
        with pytest.raises(RuntimeError, match="closed"):
            await client.recv()

    asyncio.run(main())


def test_closing_the_client_wakes_a_waiting_recv_with_an_error():
    transport = build("shm", ring_bytes=SMALL_RING)
    client = transport.client(transport.addresses())

    async def main():
        waiting = asyncio.create_task(client.recv())
        await asyncio.sleep(0.05)
        client.close()
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(main())
