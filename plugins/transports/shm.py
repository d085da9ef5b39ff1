"""Shared-memory transport: single-producer/single-consumer byte rings, no sockets.

Every (client, engine) pair has two rings of its own: `input` carries requests from that
client (API server) to that engine, `output` carries the engine's outputs back to that
client. With C clients and N engines (several API servers, data parallelism) that makes
2CN rings. A client's `send(frames, engine)` writes its input ring to that engine, and
its `recv()` reads its N output rings, round robin over those that hold a message, so a
busy engine cannot starve the others; an engine reads its C input rings the same way
and `send(frames, client)` writes that client's output ring. Each ring lives in its own
POSIX shared-memory segment; a named FIFO per ring is its doorbell, so an idle reader
sleeps in the kernel (poll in the engine, event-loop reader callbacks on the output
FIFOs in the API server) instead of spinning. The ring itself (layout, memory ordering,
why no wake-up is lost) is in _shm_ring.py.

Handshakes. An engine's first message on each of its output rings is its handshake.
`wait_ready` takes the next one from the engines that have not been heard from; `recv`
reads only the rings of engines whose handshake has been taken, so, as with zmq, it
never returns a handshake and `wait_ready` never returns an output.

Who owns what. `addresses(num_engines, num_clients)` only picks names: one random token,
from which every segment and FIFO name is derived with the client's and the engine's
index, the numbers of each and one folder path per client. It creates nothing, so an
address that is never opened leaks nothing. Each client (an API server's end, opened
before or while the engines start) creates its folder (mode 0700), two FIFOs in it and
two segments per engine, and its `close()` unlinks them all. An engine attaches its two
rings of every client, waiting up to `_ATTACH_TIMEOUT` seconds for the clients to create
them, and its `close()` only unmaps. A client registers its segments with
multiprocessing's resource tracker, as SharedMemory does, so they are still unlinked if
the API server is killed; an engine attaches without registering (SharedMemory would
register on Python < 3.13, and a spawned child shares its parent's tracker, so the child
would drop the parent's registration or, in a process with its own tracker, unlink the
segment under the client's feet when it exits). Segments are reserved with
posix_fallocate where available (2 x N x ring_bytes of /dev/shm per client taken up
front), so a /dev/shm too small for the rings fails when the client opens, not later
with SIGBUS. An API server killed with SIGKILL leaves its FIFO folder in the temp dir
(the tracker only knows segments); it is empty but for the FIFOs.

Sizes and back-pressure. A message larger than a ring raises ValueError before anything
is written (the channel stays usable); raise `plugins: {shm: {ring_bytes: ...}}` in
stack.yaml for bigger messages. A full ring makes the writer wait, never drop: an
engine's output thread sleeps with an exponential backoff (50 µs up to 5 ms); the API
server awaits asyncio.sleep with the same backoff, behind a FIFO lock per engine, so
held-back messages keep their order and a full ring holds back only its own engine. A
full ring is the exception (16 MiB by default), so polling for space costs nothing
measurable and needs no second doorbell.

Limits. Each ring is single-producer, single-consumer: one channel per client index and
per engine index. The transport does not notice a dead peer; the frontend watches the
engines' process sentinels, as with zmq. POSIX only (FIFOs, shm_open).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import threading
import time

import pydantic

from plugserve import hookimpl
from plugserve.interfaces.transport import Frames

from ._shm_ring import BellWaiter, Doorbell, Record, Ring, Segment, running_loop, set_done

MIN_RING_BYTES = 4096
MAX_RING_BYTES = 1 << 40

_NAME_PREFIX = "plugserve_"  # short: macOS allows 31 characters for a shm name
_ATTACH_TIMEOUT = 30.0  # how long an engine waits for the client to create its rings
_MIN_BACKOFF = 50e-6
_MAX_BACKOFF = 5e-3
_YIELD_EVERY = 64  # messages the async side takes in a row before yielding to the loop


class ShmTransport:
    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        # Capacity of each ring (two per engine); the largest message (its frames plus a
        # header of 16 + 8 * frames bytes) must fit in it.
        ring_bytes: int = pydantic.Field(default=16 << 20, ge=MIN_RING_BYTES, le=MAX_RING_BYTES)

    def __init__(self, *, options: Options | None = None) -> None:
        self.options = options or self.Options()

    def addresses(self, num_engines: int = 1, num_clients: int = 1) -> dict[str, str]:
        if num_engines < 1 or num_clients < 1:
            raise ValueError(
                f"need at least one engine and one client, not {num_engines} and {num_clients}"
            )
        token = secrets.token_hex(6)
        return {
            "name": f"{_NAME_PREFIX}{token}",
            "engines": str(num_engines),
            "clients": str(num_clients),
            "folder": os.path.join(tempfile.gettempdir(), f"plugserve-shm-{token}"),
        }

    def client(self, addresses: dict[str, str], client: int = 0) -> ShmClientChannel:
        return ShmClientChannel(addresses, self.options.ring_bytes, client)

    def engine(self, addresses: dict[str, str], engine: int = 0) -> ShmEngineChannel:
        return ShmEngineChannel(addresses, engine)


def client_folder(addresses: dict[str, str], client: int) -> str:
    """Where client number `client` keeps its FIFOs."""
    return f"{addresses['folder']}-{client}"


class _Names:
    """The two segments between client number `client` and engine number `engine`, and
    their FIFOs."""

    def __init__(self, addresses: dict[str, str], engine: int, client: int = 0) -> None:
        num_engines, num_clients = int(addresses["engines"]), int(addresses["clients"])
        if not 0 <= engine < num_engines:
            raise IndexError(f"no engine {engine}: these addresses are for {num_engines}")
        if not 0 <= client < num_clients:
            raise IndexError(f"no client {client}: these addresses are for {num_clients}")
        name, folder = addresses["name"], client_folder(addresses, client)
        self.input, self.output = f"{name}_{client}_{engine}i", f"{name}_{client}_{engine}o"
        self.input_bell = os.path.join(folder, f"input-{engine}.bell")
        self.output_bell = os.path.join(folder, f"output-{engine}.bell")


# --------------------------------------------------------------------------- the client


class _EngineLink:
    """The client's side of one engine: the input ring it writes, the output ring it
    reads, their doorbells, and the state of each direction."""

    def __init__(self, input: Ring, output: Ring, input_bell: Doorbell, output_bell: Doorbell):
        self.input, self.output = input, output
        self.input_bell, self.output_bell = input_bell, output_bell
        self.ready = False  # its handshake, the first message on `output`, was taken
        self.send_waiters = 0
        self._send_lock: asyncio.Lock | None = None
        self._send_lock_loop: asyncio.AbstractEventLoop | None = None

    def send_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._send_lock is None or self._send_lock_loop is not loop:
            self._send_lock, self._send_lock_loop = asyncio.Lock(), loop
        return self._send_lock


class ShmClientChannel:
    """The API server's end: creates everything, writes the engines' `input` rings and
    reads their `output` rings."""

    def __init__(self, addresses: dict[str, str], ring_bytes: int, client: int = 0) -> None:
        self._folder: str | None = None
        self._segments: list[Segment] = []
        self._bells: list[Doorbell] = []
        self._rings: list[Ring] = []
        self._links: list[_EngineLink] = []
        self._closed = False
        self._waiters: set[asyncio.Future[None]] = set()  # receivers asleep, on any bells
        self._next = 0  # the engine whose output ring is looked at first: round robin
        self._taken_in_a_row = 0
        try:
            names = [_Names(addresses, e, client) for e in range(int(addresses["engines"]))]
            folder = client_folder(addresses, client)
            os.mkdir(folder, 0o700)  # fails if it exists: fresh addresses only
            self._folder = folder
            for engine_names in names:
                # The FIFOs first: an engine attaches once its segments are initialised.
                for path in (engine_names.input_bell, engine_names.output_bell):
                    os.mkfifo(path, 0o600)
                    self._bells.append(Doorbell(path))
                for name in (engine_names.input, engine_names.output):
                    self._segments.append(Ring.create(name, ring_bytes))
                    self._rings.append(Ring(self._segments[-1]))
                self._links.append(_EngineLink(*self._rings[-2:], *self._bells[-2:]))
        except BaseException:
            self.close()
            raise

    async def wait_ready(self, timeout: float) -> Frames:
        self._check_open()
        if all(link.ready for link in self._links):
            raise RuntimeError("every engine's handshake has been taken already")
        try:
            return await asyncio.wait_for(self._take(handshakes=True), timeout)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            waiting = [i for i, link in enumerate(self._links) if not link.ready]
            raise TimeoutError(
                f"no handshake from engine(s) {waiting} within {timeout} s"
            ) from None

    async def send(self, frames: Frames, engine: int = 0) -> None:
        self._check_open()
        if not 0 <= engine < len(self._links):
            raise IndexError(f"no engine {engine}: this channel has {len(self._links)}")
        link = self._links[engine]
        record = Record(frames, link.input.capacity)
        if link.send_waiters == 0 and link.input.try_write(record):
            link.input_bell.ring()
            return
        # The ring is full: wait for room without blocking the loop, in arrival order.
        link.send_waiters += 1
        try:
            async with link.send_lock():
                delay = _MIN_BACKOFF
                while not link.input.try_write(record):
                    await asyncio.sleep(delay)
                    self._check_open()
                    delay = min(delay * 2, _MAX_BACKOFF)
        finally:
            link.send_waiters -= 1
        link.input_bell.ring()

    async def recv(self) -> Frames:
        self._check_open()
        if self._taken_in_a_row >= _YIELD_EVERY:
            # A flood of ready messages must not starve the loop; yield before taking one,
            # so a cancellation here loses nothing.
            self._taken_in_a_row = 0
            await asyncio.sleep(0)
            self._check_open()
        frames = self._poll(handshakes=False)
        if frames is not None:
            self._taken_in_a_row += 1
            return frames
        self._taken_in_a_row = 0
        return await self._take(handshakes=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Wake the sleeping receivers: they find the channel closed.
        loop = running_loop()
        for waiter in self._waiters:
            if waiter.get_loop() is loop:
                set_done(waiter)
            else:
                with contextlib.suppress(RuntimeError):  # its loop is closed already
                    waiter.get_loop().call_soon_threadsafe(set_done, waiter)
        for ring in self._rings:
            ring.release()
        for bell in self._bells:
            bell.close()
        for segment in self._segments:
            segment.close()
            segment.unlink()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # receiving

    def _poll(self, handshakes: bool) -> Frames | None:
        """The next message on an output ring, or None if they are all empty: from the
        engines not yet heard from (their handshakes) or from the others. Round robin:
        the search starts after the engine that was served last."""
        links = self._links
        for step in range(len(links)):
            index = (self._next + step) % len(links)
            link = links[index]
            if link.ready is handshakes:
                continue
            frames = link.output.try_read()
            if frames is None:
                continue
            link.ready = True
            self._next = (index + 1) % len(links)
            if self._waiters:
                # Any other receiver re-checks: a drain of ours may have taken the ring
                # meant for it, and a handshake just taken opens that ring to `recv`.
                for waiter in self._waiters:
                    set_done(waiter)
            return frames
        return None

    async def _take(self, handshakes: bool) -> Frames:
        """_poll, waiting on the doorbells of the rings it reads until one has a message."""
        while True:
            self._check_open()
            frames = self._poll(handshakes)
            if frames is not None:
                return frames
            bells = [link.output_bell for link in self._links if link.ready is not handshakes]
            for bell in bells:
                bell.drain()
            frames = self._poll(handshakes)  # after the drain: no lost wake-up
            if frames is not None:
                return frames
            await self._wait(bells)

    async def _wait(self, bells: list[Doorbell]) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            for bell in bells:
                bell.watch(waiter)
            await waiter
        finally:
            self._waiters.discard(waiter)
            for bell in bells:
                bell.unwatch(waiter)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the shm client channel is closed")


# --------------------------------------------------------------------------- an engine


class _ClientLink:
    """An engine's side of one client: the input ring it reads, the output ring it
    writes, and their doorbells."""

    def __init__(self, input: Ring, output: Ring, input_bell: Doorbell, output_bell: Doorbell):
        self.input, self.output = input, output
        self.input_bell, self.output_bell = input_bell, output_bell


class ShmEngineChannel:
    """An engine core's end: attaches its two rings of every client, reads the `input`
    rings (one thread), writes the `output` rings."""

    def __init__(
        self,
        addresses: dict[str, str],
        engine: int = 0,
        *,
        attach_timeout: float = _ATTACH_TIMEOUT,
    ) -> None:
        self._segments: list[Segment] = []
        self._bells: list[Doorbell] = []
        self._rings: list[Ring] = []
        self._links: list[_ClientLink] = []
        self._closed = False
        self._send_lock = threading.Lock()
        self._next = 0  # the client whose input ring is looked at first: round robin
        try:
            deadline = time.monotonic() + attach_timeout
            for client in range(int(addresses["clients"])):
                self._attach(_Names(addresses, engine, client), deadline, attach_timeout)
            self._input_bells = BellWaiter([link.input_bell for link in self._links])
        except BaseException:
            self.close()
            raise

    def _attach(self, names: _Names, deadline: float, attach_timeout: float) -> None:
        for name in (names.input, names.output):
            while (segment := Segment.attach(name)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"shared memory {name!r} was not created within {attach_timeout} s "
                        "(each API server opens its client end when it starts)"
                    )
                time.sleep(0.01)
            self._segments.append(segment)
        # The client made the FIFOs before the segments: they exist by now.
        bells = [Doorbell(names.input_bell), Doorbell(names.output_bell)]
        self._bells += bells
        rings = [Ring(segment) for segment in self._segments[-2:]]
        self._rings += rings
        self._links.append(_ClientLink(*rings, *bells))

    def send_ready(self, frames: Frames) -> None:
        # The first message on each output ring is the handshake.
        for client in range(len(self._links)):
            self.send(frames, client)

    def recv(self, timeout: float | None = None) -> tuple[int, Frames] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            received = self._poll()
            if received is not None:
                return received
            for link in self._links:
                link.input_bell.drain()
            received = self._poll()  # after the drain: no lost wake-up
            if received is not None:
                return received
            remaining = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
            self._input_bells.wait(remaining)

    def _poll(self) -> tuple[int, Frames] | None:
        """The next message on an input ring, round robin over the clients."""
        count = len(self._links)
        for step in range(count):
            client = (self._next + step) % count
            frames = self._links[client].input.try_read()
            if frames is not None:
                self._next = (client + 1) % count
                return client, frames
        return None

    def send(self, frames: Frames, client: int = 0) -> None:
        link = self._links[client]
        record = Record(frames, link.output.capacity)
        with self._send_lock:
            delay = _MIN_BACKOFF
            while not link.output.try_write(record):  # full: the API server is behind
                time.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF)
        link.output_bell.ring()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ring in self._rings:
            ring.release()
        for bell in self._bells:
            bell.close()
        for segment in self._segments:
            segment.close()  # the client unlinks


@hookimpl
def register_transports(register):
    register("shm", ShmTransport)
