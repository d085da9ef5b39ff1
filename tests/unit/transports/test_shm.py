"""The shm transport: shared-memory rings with FIFO doorbells, two per client and engine.

The contract every transport honours (handshake, order, timeouts, idle waits that do not
spin, several engines behind one client) is in test_transport_contract.py, shm
included; this file specifies what is the shm transport's own: options, ring
wrap-around, the size limit, back-pressure, how the engines' outputs are merged and
their handshakes told apart, who creates and who removes the shared memory.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pydantic
import pytest
from test_transport_contract import (
    answered_by,
    build,
    echo_engines,
    echo_pair,
    echoed,
    round_trip,
    varied_messages,
)

from plugserve_plugins.transports.shm import (
    MIN_RING_BYTES,
    ShmEngineChannel,
    ShmTransport,
    _Names,
    client_folder,
)

SMALL_RING = 4096
HEADER = 16  # u64 record length + u64 frame count, then u64 per frame


def left_behind(addresses: dict[str, str]) -> list[str]:
    """What the transport created for these addresses and still exists: segments, whose
    names all start with the address's name, and the clients' FIFO folders."""
    prefix = addresses["name"] + "_"
    paths = [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    for client in range(int(addresses["clients"])):
        if os.path.exists(client_folder(addresses, client)):
            paths.append(client_folder(addresses, client))
    return sorted(paths)


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
    first, second = transport.addresses(), transport.addresses(4)
    assert first["name"] != second["name"] and first["folder"] != second["folder"]
    assert first["engines"] == "1" and second["engines"] == "4"
    assert first["clients"] == "1" and transport.addresses(1, 3)["clients"] == "3"
    names = _Names(transport.addresses(1000, 100), 999, 99)
    assert len("/" + names.input) <= 31 and len("/" + names.output) <= 31  # macOS's limit
    assert left_behind(first) == [] and left_behind(second) == []
    with pytest.raises(ValueError):
        transport.addresses(0)
    with pytest.raises(ValueError):
        transport.addresses(1, 0)


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
                assert await client.recv() == echoed(frames)
            await sender

    asyncio.run(main())


def test_messages_up_to_half_the_ring_arrive_intact():
    ring = 1 << 20
    transport = build("shm", ring_bytes=ring)
    messages = varied_messages(max_size=ring // 2 - 64, count=40, seed=2)

    async def main():
        async with echo_pair(transport) as (client, _):
            for frames in messages:
                assert await round_trip(client, frames) == echoed(frames)

    asyncio.run(main())


def test_a_message_larger_than_the_ring_raises_value_error_and_the_channel_goes_on():
    transport = build("shm", ring_bytes=SMALL_RING)
    exact_fit = b"x" * (SMALL_RING - HEADER - 8)  # one frame: its record fills the ring

    async def main():
        async with echo_pair(transport) as (client, _):
            with pytest.raises(ValueError, match="does not fit in the shm transport's ring"):
                await client.send([exact_fit + b"x"])
            # Exactly the capacity is allowed; its echo, 6 bytes longer, is refused on
            # the engine's side with the same error, and the engine goes on.
            kind, message = await round_trip(client, [exact_fit])
            assert kind == b"error" and b"ring_bytes" in message
            assert await round_trip(client, [b"still", b"working"]) == [
                b"echo0:still",
                b"working",
            ]

    asyncio.run(main())


# --------------------------------------------------------------------------- back-pressure


def test_a_full_request_ring_makes_senders_wait_in_order_without_blocking_the_loop():
    transport = build("shm", ring_bytes=SMALL_RING)
    count, payload = 60, b"p" * 1000  # ~15 rings' worth; the engine reads nothing at first
    hold = multiprocessing.get_context("spawn").Event()

    async def main():
        async with echo_pair(transport, hold=hold) as (client, _):
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticking = asyncio.create_task(ticker())
            # Concurrent senders, all held back by the full ring, keep their order.
            sends = asyncio.gather(*(client.send([b"%d" % i, payload]) for i in range(count)))
            while ticks < 20:  # the event loop runs while they wait ...
                await asyncio.sleep(0.01)
            assert not sends.done()  # ... and they do wait: nobody reads the full ring
            hold.set()
            for i in range(count):
                assert await client.recv() == [b"echo0:%d" % i, payload]
            await sends
            ticking.cancel()

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
                assert await client.recv() == echoed(frames)
            await sender

    asyncio.run(main())


# --------------------------------------------------------------------------- several engines


def open_in_process(num_engines: int, ring_bytes: int = SMALL_RING):
    """A client and its engines' ends, all in this process (the engine ends are
    blocking but never block here: their rings have room)."""
    transport = build("shm", ring_bytes=ring_bytes)
    addresses = transport.addresses(num_engines)
    client = transport.client(addresses)
    engines = [transport.engine(addresses, engine) for engine in range(num_engines)]
    return client, engines


def close_all(client, engines) -> None:
    for engine in engines:
        engine.close()
    client.close()


def test_output_from_every_engine_is_merged_fairly():
    # Both engines' output rings are full before the client reads: a client that kept
    # reading the ring it read last (or always the first) would take all of one
    # engine's backlog first; round robin takes one from each in turn.
    transport = build("shm", ring_bytes=64 * 1024)
    per_engine, payload = 150, b"o" * 1000  # ~63 messages fill an output ring

    async def main():
        async with echo_engines(transport, 2) as (client, _):

            async def send_all():
                for i in range(per_engine):
                    for engine in (0, 1):
                        await client.send([b"%d" % i, payload], engine)

            sender = asyncio.create_task(send_all())
            await asyncio.sleep(1.0)  # not reading: both output rings fill
            order = []
            received: list[list[list[bytes]]] = [[], []]
            for _ in range(2 * per_engine):
                frames = await client.recv()
                order.append(answered_by(frames))
                received[order[-1]].append(frames)
            await sender
            assert all(a != b for a, b in itertools.pairwise(order[:100])), order[:100]
            for engine in (0, 1):
                assert received[engine] == [
                    echoed([b"%d" % i, payload], engine) for i in range(per_engine)
                ]

    asyncio.run(main())


def test_a_full_request_ring_holds_back_only_its_own_engine():
    client, (engine0, engine1) = open_in_process(2)

    async def main():
        payload = b"p" * 1000
        sent = 0
        while True:  # fill engine 0's request ring until a send has to wait
            held_back = asyncio.create_task(client.send([b"%d" % sent, payload], 0))
            await asyncio.sleep(0.01)
            if not held_back.done():
                break
            sent += 1
        await asyncio.wait_for(client.send([b"to 1"], 1), 1)  # engine 1's ring has room
        assert engine1.recv(timeout=1) == (0, [b"to 1"])
        assert not held_back.done()
        for i in range(sent):  # engine 0 reads: the held-back send goes through
            assert engine0.recv(timeout=1) == (0, [b"%d" % i, payload])
        await asyncio.wait_for(held_back, 1)
        assert engine0.recv(timeout=1) == (0, [b"%d" % sent, payload])

    try:
        asyncio.run(main())
    finally:
        close_all(client, [engine0, engine1])


def test_a_recv_waiting_before_the_handshakes_wakes_when_they_are_taken():
    # The engine's handshake and its first output are both in its ring before the
    # handshake is taken; recv skips that ring until then, and must not sleep through
    # the output after (wait_ready's drain may have taken the doorbell's ring).
    client, engines = open_in_process(2)

    async def main():
        waiting = asyncio.create_task(client.recv())
        await asyncio.sleep(0.05)
        for engine, channel in enumerate(engines):
            channel.send_ready([b"ready", b"%d" % engine])
            channel.send([b"output", b"%d" % engine])
            await asyncio.sleep(0.05)
            assert not waiting.done()  # a handshake is not an output
            assert await client.wait_ready(1) == [b"ready", b"%d" % engine]
            assert await asyncio.wait_for(waiting, 1) == [b"output", b"%d" % engine]
            waiting = asyncio.create_task(client.recv())
            await asyncio.sleep(0.05)
        waiting.cancel()

    try:
        asyncio.run(main())
    finally:
        close_all(client, engines)


def test_concurrent_wait_ready_calls_take_one_handshake_each():
    client, engines = open_in_process(3)

    async def main():
        waits = asyncio.gather(*(client.wait_ready(5) for _ in engines))
        await asyncio.sleep(0.05)
        for engine in (2, 0, 1):
            engines[engine].send_ready([b"ready", b"%d" % engine])
            await asyncio.sleep(0.01)
        assert sorted(await waits) == [[b"ready", b"%d" % i] for i in range(3)]
        with pytest.raises(RuntimeError, match="every engine"):
            await client.wait_ready(1)

    try:
        asyncio.run(main())
    finally:
        close_all(client, engines)


def test_engine_indices_out_of_range_are_refused():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(2)
    with pytest.raises(IndexError):
        transport.engine(addresses, 2)
    client = transport.client(addresses)

    async def main():
        for engine in (2, -1):
            with pytest.raises(IndexError):
                await client.send([b"x"], engine)

    try:
        asyncio.run(main())
    finally:
        client.close()
    assert left_behind(addresses) == []


# --------------------------------------------------------------------------- several clients


def open_clients_in_process(num_clients: int, num_engines: int):
    """Several clients (API servers) and the engines' ends, all in this process."""
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(num_engines, num_clients)
    clients = [transport.client(addresses, index) for index in range(num_clients)]
    engines = [transport.engine(addresses, engine) for engine in range(num_engines)]
    return addresses, clients, engines


def test_each_client_has_its_own_rings_to_every_engine_and_removes_only_those():
    addresses, clients, engines = open_clients_in_process(2, 2)
    try:
        # Two segments per (client, engine) pair, and a FIFO folder per client.
        assert len(left_behind(addresses)) == 2 * 2 * 2 + 2
        for engine in engines:
            engine.send_ready([b"ready"])

        async def main():
            for client in clients:
                assert [await client.wait_ready(1) for _ in engines] == [[b"ready"]] * 2
            await clients[1].send([b"from 1"], 0)
            await clients[0].send([b"from 0"], 1)
            assert engines[0].recv(timeout=1) == (1, [b"from 1"])
            assert engines[1].recv(timeout=1) == (0, [b"from 0"])
            assert engines[0].recv(timeout=0.05) is None
            engines[1].send([b"to 1"], 1)
            assert await asyncio.wait_for(clients[1].recv(), 1) == [b"to 1"]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(clients[0].recv(), 0.1)

        asyncio.run(main())
        clients[0].close()
        assert len(left_behind(addresses)) == 2 * 2 + 1  # client 1's are untouched
    finally:
        close_all(clients[1], engines)
        clients[0].close()
    assert left_behind(addresses) == []


def test_an_engine_takes_requests_from_every_client_in_turn():
    # Both clients' request rings hold a backlog before the engine reads: round robin
    # takes one from each in turn, so a busy API server cannot starve another.
    addresses, clients, (engine,) = open_clients_in_process(2, 1)
    try:
        engine.send_ready([b"ready"])

        async def main():
            for index, client in enumerate(clients):
                await client.wait_ready(1)
                for i in range(10):
                    await client.send([b"%d:%d" % (index, i)])

        asyncio.run(main())
        received = [engine.recv(timeout=1) for _ in range(20)]
        assert [client for client, _ in received] == [0, 1] * 10
        for index in (0, 1):
            mine = [frames for client, frames in received if client == index]
            assert mine == [[b"%d:%d" % (index, i)] for i in range(10)]
    finally:
        close_all(clients[1], [engine])
        clients[0].close()
    assert left_behind(addresses) == []


# --------------------------------------------------------------------------- ownership


@pytest.mark.parametrize("num_engines", [1, 3])
def test_the_client_removes_every_segment_and_fifo_when_it_closes(num_engines):
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(num_engines)
    client = transport.client(addresses)
    created = left_behind(addresses)
    assert len(created) == 2 * num_engines + 1  # two segments per engine and the folder
    folder = client_folder(addresses, 0)
    assert len(os.listdir(folder)) == 2 * num_engines  # two FIFOs per engine
    engines = [transport.engine(addresses, engine) for engine in range(num_engines)]
    for engine in engines:
        engine.close()  # an engine only unmaps
    assert left_behind(addresses) == created
    client.close()
    client.close()  # idempotent
    assert left_behind(addresses) == []


def test_nothing_is_left_behind_after_a_served_session():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(2)

    async def main():
        async with echo_engines(transport, 2, addresses=addresses) as (client, _):
            assert len(left_behind(addresses)) == 5
            await round_trip(client, [b"x"], 1)

    asyncio.run(main())
    assert left_behind(addresses) == []


def test_a_client_that_fails_to_open_leaves_nothing_behind():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(2)
    folder = client_folder(addresses, 0)
    os.mkdir(folder)  # someone else's folder: never reused
    try:
        with pytest.raises(FileExistsError):
            transport.client(addresses)
        assert left_behind(addresses) == [folder]
    finally:
        os.rmdir(folder)


def test_an_engine_in_an_unrelated_process_leaves_the_segments_alone_when_it_exits():
    # Attaching must not register the segments with the engine process's resource
    # tracker: a tracker of its own would unlink them (and warn) when that process exits.
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(2)
    client = transport.client(addresses)
    code = (
        "import json, sys; from plugserve_plugins.transports.shm import ShmTransport\n"
        "engine = ShmTransport().engine(json.loads(sys.argv[1]), 1)\n"
        "engine.send_ready([b'ready']); engine.close()\n"
    )
    try:
        child = subprocess.run(
            [sys.executable, "-c", code, json.dumps(addresses)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        assert "resource_tracker" not in child.stderr
        assert len(left_behind(addresses)) == 5
        assert asyncio.run(client.wait_ready(5)) == [b"ready"]
    finally:
        client.close()
    assert left_behind(addresses) == []


def test_the_engine_may_open_first_and_waits_for_the_client():
    transport = build("shm", ring_bytes=SMALL_RING)
    addresses = transport.addresses(2)
    opened = []
    thread = threading.Thread(target=lambda: opened.append(transport.engine(addresses, 1)))
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
        with pytest.raises(RuntimeError, match="closed"):
            await client.wait_ready(1)

    asyncio.run(main())


@pytest.mark.parametrize("from_another_thread", [False, True])
@pytest.mark.parametrize("handshakes", [0, 2])
def test_closing_the_client_wakes_a_waiting_recv_with_an_error(handshakes, from_another_thread):
    # With no handshake taken, recv watches no doorbell; with both, it watches both.
    client, engines = open_in_process(2)
    for engine in engines:
        engine.send_ready([b"ready"])

    async def main():
        for _ in range(handshakes):
            await client.wait_ready(1)
        waiting = asyncio.create_task(client.recv())
        await asyncio.sleep(0.05)
        if from_another_thread:
            closer = threading.Thread(target=client.close)
            closer.start()
            closer.join()
        else:
            client.close()
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(waiting, 5)

    try:
        asyncio.run(main())
    finally:
        close_all(client, engines)
