"""Shared-memory transport: two single-producer/single-consumer byte rings, no sockets.

One ring per direction: `input` carries requests from the API server to the engine core,
`output` carries the engine's outputs back. Each ring lives in its own POSIX shared
memory segment; a named FIFO per ring is its doorbell, so an idle reader sleeps in the
kernel (poll in the engine, the event loop's reader callback in the API server) instead
of spinning.

Who owns what. `addresses()` only picks names: two segment names and a folder path, all
carrying one random token; it creates nothing, so an address that is never opened leaks
nothing. The client (the API server's end, opened before the engine is spawned) creates
the folder (mode 0700), the two FIFOs in it and both segments, and its `close()` unlinks
them all. The engine attaches, waiting up to `_ATTACH_TIMEOUT` seconds for the client to
create them, and its `close()` only unmaps. The client registers its segments with
multiprocessing's resource tracker, as SharedMemory does, so they are still unlinked if
the API server is killed; the engine attaches without registering (SharedMemory would
register on Python < 3.13, and a spawned child shares its parent's tracker, so the child
would drop the parent's registration or, in a process with its own tracker, unlink the
segment under the client's feet when it exits). Segments are reserved with
posix_fallocate where available (2 x ring_bytes of /dev/shm taken up front), so a
/dev/shm too small for the rings fails when the client opens, not later with SIGBUS. An
API server killed with SIGKILL leaves its FIFO folder in the temp dir (the tracker only
knows segments); it is empty but for two FIFOs.

Segment layout (native byte order): u64 slots at the front, the writer's and the
reader's index each on its own cache line, then `ring_bytes` of data.

    slot 0  magic (written last by the creator: the segment is initialised)
    slot 1  capacity in bytes
    slot 8  head: bytes ever written (only the writer stores it)
    slot 16 tail: bytes ever consumed (only the reader stores it)

Head and tail grow without bound (u64) and are taken modulo the capacity, so a full ring
(head - tail == capacity) and an empty one (head == tail) are told apart without a
wasted byte. A message is one record, written as a byte stream that wraps around the end
of the data area wherever it falls:

    u64 record length (header included) | u64 frame count | u64 length of each frame
    | the frames' bytes, back to back

A record larger than the ring's capacity raises ValueError before anything is written
(the channel stays usable); raise `plugins: {shm: {ring_bytes: ...}}` in stack.yaml for
bigger messages. A full ring makes the writer wait, never drop: the engine's output
thread sleeps with an exponential backoff (50 µs up to 5 ms); the API server awaits
asyncio.sleep with the same backoff, behind a FIFO lock so held-back messages keep their
order. A full ring is the exception (16 MiB by default), so polling for space costs
nothing measurable and needs no second doorbell.

Publication and memory ordering. The writer copies the record into the ring, then stores
the new head with one aligned 8-byte store (a memoryview cast to "Q" copies the value
with a single memcpy of its size), then writes one byte to the reader's FIFO. The reader
loads the head, copies the record out (recv returns bytes, the slot is reused at once),
then stores the new tail. On x86-64 (TSO: stores are not reordered with older stores,
loads not with older loads) this is all the ordering needed. Weakly ordered CPUs (ARM)
get no explicit fence from Python; there the interpreter's own atomics and the FIFO
syscalls act as barriers in practice, which is not a formal guarantee.

Lost wake-ups. The writer publishes the head before it rings; a reader that finds the
ring empty drains its FIFO, checks the ring again, and only then waits for the FIFO to
become readable. A message published after that second check rings after the drain, so
the wait returns. A ring that finds the FIFO full (64 KiB of unread rings) is dropped:
the reader has wake-ups pending already. The writer rings once per message (one write
syscall); the reader touches its FIFO only when it is about to sleep.

Limits. One client per engine (the rings are single-producer, single-consumer: several
API servers need one address set each). The transport does not notice a dead peer; the
frontend watches the engine's process sentinel, as with zmq. POSIX only (FIFOs, shm_open).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import mmap
import os
import secrets
import select
import shutil
import struct
import tempfile
import threading
import time

import pydantic

from plugserve import hookimpl
from plugserve.interfaces import Frames

MIN_RING_BYTES = 4096
MAX_RING_BYTES = 1 << 40

_NAME_PREFIX = "plugserve_"  # short: macOS allows 31 characters for a shm name
_MAGIC = 0x316D6873_67756C70  # b"plugshm1" read as a little-endian u64
_MAGIC_SLOT, _CAPACITY_SLOT, _HEAD_SLOT, _TAIL_SLOT = 0, 1, 8, 16
_HEADER_BYTES = 192  # 24 u64 slots: three cache lines
_RECORD_HEAD = struct.Struct("=QQ")  # record length, frame count
_ATTACH_TIMEOUT = 30.0  # how long the engine waits for the client to create the rings
_MIN_BACKOFF = 50e-6
_MAX_BACKOFF = 5e-3
_YIELD_EVERY = 64  # messages the async side takes in a row before yielding to the loop


class ShmTransport:
    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        # Capacity of each of the two rings; the largest message (its frames plus a
        # header of 16 + 8 * frames bytes) must fit in it.
        ring_bytes: int = pydantic.Field(default=16 << 20, ge=MIN_RING_BYTES, le=MAX_RING_BYTES)

    def __init__(self, *, options: Options | None = None) -> None:
        self.options = options or self.Options()

    def addresses(self) -> dict[str, str]:
        token = secrets.token_hex(6)
        return {
            "input": f"{_NAME_PREFIX}{token}_in",
            "output": f"{_NAME_PREFIX}{token}_out",
            "folder": os.path.join(tempfile.gettempdir(), f"plugserve-shm-{token}"),
        }

    def client(self, addresses: dict[str, str]) -> ShmClientChannel:
        return ShmClientChannel(addresses, self.options.ring_bytes)

    def engine(self, addresses: dict[str, str]) -> ShmEngineChannel:
        return ShmEngineChannel(addresses)


# --------------------------------------------------------------------------- segments


class _Segment:
    """A mapped POSIX shared-memory segment (multiprocessing.shared_memory, minus the
    resource-tracker registration on attach and plus a space reservation on create)."""

    def __init__(self, name: str, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.buf: memoryview | None = memoryview(mapping)
        self._mmap = mapping
        self._owner = owner

    @classmethod
    def create(cls, name: str, size: int) -> _Segment:
        import _posixshmem
        from multiprocessing import resource_tracker

        path = "/" + name
        fd = _posixshmem.shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            _reserve(fd, size, name)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(path)
            raise
        finally:
            os.close(fd)
        resource_tracker.register(path, "shared_memory")
        return cls(name, mapping, owner=True)

    @classmethod
    def attach(cls, name: str) -> _Segment | None:
        """The segment once its creator has initialised it; None before that."""
        import _posixshmem

        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER_BYTES:  # created, not sized yet
                return None
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        segment = cls(name, mapping, owner=False)
        if _slot(mapping, _MAGIC_SLOT) != _MAGIC:
            segment.close()
            return None
        return segment

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf.release()
        self.buf = None
        with contextlib.suppress(BufferError):  # a view still alive somewhere: unmapped at exit
            self._mmap.close()

    def unlink(self) -> None:
        if not self._owner:
            return
        import _posixshmem
        from multiprocessing import resource_tracker

        self._owner = False
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + self.name)
        resource_tracker.unregister("/" + self.name, "shared_memory")


def _reserve(fd: int, size: int, name: str) -> None:
    """Size the segment, reserving its pages where the file system can (tmpfs can)."""
    fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise OSError(
                    exc.errno,
                    f"no room for shared memory segment {name!r} of {size} bytes: lower "
                    "plugins.shm.ring_bytes or enlarge /dev/shm (docker: --shm-size)",
                ) from exc
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENODEV):
                raise
    os.ftruncate(fd, size)


def _slot(buffer, index: int) -> int:
    return struct.unpack_from("=Q", buffer, index * 8)[0]


# --------------------------------------------------------------------------- the ring


def _byte_view(frame) -> memoryview:
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class _Record:
    __slots__ = ("header", "size", "views")

    def __init__(self, frames: Frames, capacity: int) -> None:
        self.views = [_byte_view(frame) for frame in frames]
        lengths = [view.nbytes for view in self.views]
        self.size = _RECORD_HEAD.size + 8 * len(lengths) + sum(lengths)
        if self.size > capacity:
            raise ValueError(
                f"a message of {sum(lengths)} bytes in {len(lengths)} frames "
                f"({self.size} bytes with its header) does not fit in the shm transport's "
                f"ring of {capacity} bytes; raise plugins.shm.ring_bytes in stack.yaml"
            )
        self.header = struct.pack(f"=QQ{len(lengths)}Q", self.size, len(lengths), *lengths)


class _Ring:
    """One direction of the channel over a segment. Each process uses a ring either as
    its writer or as its reader, from one thread at a time."""

    def __init__(self, segment: _Segment) -> None:
        assert segment.buf is not None
        self._slots = segment.buf[:_HEADER_BYTES].cast("Q")
        self.capacity = self._slots[_CAPACITY_SLOT]
        if _HEADER_BYTES + self.capacity > segment.buf.nbytes:
            raise RuntimeError(f"shm segment {segment.name!r} is smaller than its header says")
        self._data = segment.buf[_HEADER_BYTES : _HEADER_BYTES + self.capacity]
        self._head = self._slots[_HEAD_SLOT]  # this side's copy, when it is the writer
        self._tail = self._slots[_TAIL_SLOT]  # this side's copy, when it is the reader

    @staticmethod
    def initialise(segment: _Segment, capacity: int) -> None:
        assert segment.buf is not None
        slots = segment.buf[:_HEADER_BYTES].cast("Q")
        slots[_CAPACITY_SLOT] = capacity
        slots[_MAGIC_SLOT] = _MAGIC  # last: the engine attaches once it sees this
        slots.release()

    def release(self) -> None:
        self._slots.release()
        self._data.release()

    # writer

    def try_write(self, record: _Record) -> bool:
        """Write the record if there is room for it now; False (nothing written) if not."""
        head = self._head
        if record.size > self.capacity - (head - self._slots[_TAIL_SLOT]):
            return False
        pos = self._copy_in(head, memoryview(record.header))
        for view in record.views:
            pos = self._copy_in(pos, view)
        self._head = pos
        self._slots[_HEAD_SLOT] = pos  # publish: after the payload, one 8-byte store
        return True

    def _copy_in(self, pos: int, data: memoryview) -> int:
        n = data.nbytes
        if n:
            start = pos % self.capacity
            first = min(n, self.capacity - start)
            self._data[start : start + first] = data[:first]
            if first < n:
                self._data[: n - first] = data[first:]
        return pos + n

    # reader

    def try_read(self) -> list[bytes] | None:
        """The next message, copied out, or None if the ring is empty."""
        tail = self._tail
        available = self._slots[_HEAD_SLOT] - tail
        if available == 0:
            return None
        size, count = _RECORD_HEAD.unpack(self._copy_out(tail, _RECORD_HEAD.size))
        header_size = _RECORD_HEAD.size + 8 * count
        if not header_size <= size <= available:
            raise RuntimeError(
                f"shm ring corrupted: record of {size} bytes, {count} frames, "
                f"{available} bytes published"
            )
        lengths = struct.unpack(f"={count}Q", self._copy_out(tail + _RECORD_HEAD.size, 8 * count))
        pos = tail + header_size
        frames = []
        for n in lengths:
            frames.append(self._copy_out(pos, n))
            pos += n
        if pos != tail + size:
            raise RuntimeError("shm ring corrupted: frame lengths disagree with the record")
        self._tail = pos
        self._slots[_TAIL_SLOT] = pos  # the slot may be reused from here on
        return frames

    def _copy_out(self, pos: int, n: int) -> bytes:
        start = pos % self.capacity
        end = start + n
        if end <= self.capacity:
            return self._data[start:end].tobytes()
        return self._data[start:].tobytes() + self._data[: end - self.capacity].tobytes()


# --------------------------------------------------------------------------- doorbells


class _Doorbell:
    """A named FIFO opened read-write and non-blocking by both sides: the writer writes a
    byte after publishing, the reader waits for it to become readable. Opening it
    read-write never blocks and never fails for want of a peer (Linux and macOS)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._poll: select.poll | None = None
        self._waiter: asyncio.Future[None] | None = None

    def ring(self) -> None:
        try:  # noqa: SIM105 (the hot path: no context manager)
            os.write(self.fd, b"\0")
        except BlockingIOError:  # full of unread rings: the reader will wake anyway
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None) -> None:
        """Block until rung (or timeout seconds); the caller re-checks its ring."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)
        self._poll.poll(None if timeout is None else math.ceil(timeout * 1000))

    async def wait_async(self) -> None:
        loop = asyncio.get_running_loop()
        fd = self.fd
        self._waiter = rung = loop.create_future()
        loop.add_reader(fd, _set_done, rung)
        try:
            await rung
        finally:
            self._waiter = None
            loop.remove_reader(fd)

    def close(self) -> None:
        if self.fd < 0:
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            # A recv is waiting: take the fd out of its loop before closing it (a closed
            # fd left registered confuses the loop once the number is reused), and wake
            # the recv, which then finds the channel closed.
            loop = waiter.get_loop()
            try:
                same_thread = asyncio.get_running_loop() is loop
            except RuntimeError:
                same_thread = False
            if same_thread:
                loop.remove_reader(self.fd)
                waiter.set_result(None)
            else:
                loop.call_soon_threadsafe(_set_done, waiter)
        os.close(self.fd)
        self.fd = -1


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _bell_paths(addresses: dict[str, str]) -> tuple[str, str]:
    folder = addresses["folder"]
    return os.path.join(folder, "input.bell"), os.path.join(folder, "output.bell")


# --------------------------------------------------------------------------- the ends


class ShmClientChannel:
    """The API server's end: creates everything, writes `input`, reads `output`."""

    def __init__(self, addresses: dict[str, str], ring_bytes: int) -> None:
        self._folder: str | None = None
        self._segments: list[_Segment] = []
        self._bells: list[_Doorbell] = []
        self._rings: list[_Ring] = []
        self._closed = False
        self._send_waiters = 0
        self._send_lock: asyncio.Lock | None = None
        self._send_lock_loop: asyncio.AbstractEventLoop | None = None
        self._taken_in_a_row = 0
        try:
            os.mkdir(addresses["folder"], 0o700)  # fails if it exists: fresh addresses only
            self._folder = addresses["folder"]
            input_bell, output_bell = _bell_paths(addresses)
            os.mkfifo(input_bell, 0o600)
            os.mkfifo(output_bell, 0o600)
            self._input_bell = _Doorbell(input_bell)
            self._output_bell = _Doorbell(output_bell)
            self._bells += [self._input_bell, self._output_bell]
            for name in (addresses["input"], addresses["output"]):
                segment = _Segment.create(name, _HEADER_BYTES + ring_bytes)
                self._segments.append(segment)
                _Ring.initialise(segment, ring_bytes)
            self._input = _Ring(self._segments[0])
            self._output = _Ring(self._segments[1])
            self._rings += [self._input, self._output]
        except BaseException:
            self.close()
            raise

    async def wait_ready(self, timeout: float) -> Frames:
        try:
            return await asyncio.wait_for(self.recv(), timeout)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            raise TimeoutError(f"no handshake from the engine within {timeout} s") from None

    async def send(self, frames: Frames) -> None:
        self._check_open()
        record = _Record(frames, self._input.capacity)
        if self._send_waiters == 0 and self._input.try_write(record):
            self._input_bell.ring()
            return
        # The ring is full: wait for room without blocking the loop, in arrival order.
        self._send_waiters += 1
        try:
            async with self._lock():
                delay = _MIN_BACKOFF
                while not self._input.try_write(record):
                    await asyncio.sleep(delay)
                    self._check_open()
                    delay = min(delay * 2, _MAX_BACKOFF)
        finally:
            self._send_waiters -= 1
        self._input_bell.ring()

    async def recv(self) -> Frames:
        self._check_open()
        if self._taken_in_a_row >= _YIELD_EVERY:
            # A flood of ready messages must not starve the loop; yield before taking one,
            # so a cancellation here loses nothing.
            self._taken_in_a_row = 0
            await asyncio.sleep(0)
        while True:
            frames = self._output.try_read()
            if frames is None:
                self._output_bell.drain()
                frames = self._output.try_read()  # after the drain: no lost wake-up
            if frames is not None:
                self._taken_in_a_row += 1
                return frames
            self._taken_in_a_row = 0
            await self._output_bell.wait_async()
            self._check_open()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ring in self._rings:
            ring.release()
        for bell in self._bells:
            bell.close()
        for segment in self._segments:
            segment.close()
            segment.unlink()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._send_lock is None or self._send_lock_loop is not loop:
            self._send_lock, self._send_lock_loop = asyncio.Lock(), loop
        return self._send_lock

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the shm client channel is closed")


class ShmEngineChannel:
    """The engine core's end: attaches, reads `input` (one thread), writes `output`."""

    def __init__(self, addresses: dict[str, str], attach_timeout: float = _ATTACH_TIMEOUT) -> None:
        self._segments: list[_Segment] = []
        self._bells: list[_Doorbell] = []
        self._rings: list[_Ring] = []
        self._closed = False
        self._send_lock = threading.Lock()
        try:
            deadline = time.monotonic() + attach_timeout
            for name in (addresses["input"], addresses["output"]):
                while (segment := _Segment.attach(name)) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"shared memory {name!r} was not created within {attach_timeout} s "
                            "(the API server opens the client end first)"
                        )
                    time.sleep(0.01)
                self._segments.append(segment)
            # The client made the FIFOs before the segments: they exist by now.
            input_bell, output_bell = _bell_paths(addresses)
            self._input_bell = _Doorbell(input_bell)
            self._output_bell = _Doorbell(output_bell)
            self._bells += [self._input_bell, self._output_bell]
            self._input = _Ring(self._segments[0])
            self._output = _Ring(self._segments[1])
            self._rings += [self._input, self._output]
        except BaseException:
            self.close()
            raise

    def send_ready(self, frames: Frames) -> None:
        self.send(frames)

    def recv(self, timeout: float | None = None) -> Frames | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frames = self._input.try_read()
            if frames is not None:
                return frames
            self._input_bell.drain()
            frames = self._input.try_read()  # after the drain: no lost wake-up
            if frames is not None:
                return frames
            remaining = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
            self._input_bell.wait(remaining)

    def send(self, frames: Frames) -> None:
        record = _Record(frames, self._output.capacity)
        with self._send_lock:
            delay = _MIN_BACKOFF
            while not self._output.try_write(record):  # full: the API server is behind
                time.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF)
        self._output_bell.ring()

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
