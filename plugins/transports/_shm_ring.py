"""The shm transport's primitives: a shared-memory segment, the single-producer/single-
consumer byte ring laid over it, and the FIFO doorbell that wakes the ring's reader.
The transport itself (names, who creates what, the channels) is in shm.py.

Segment layout (native byte order): u64 slots at the front, the writer's and the
reader's index each on its own cache line, then `capacity` bytes of data.

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

A record larger than the ring's capacity raises ValueError before anything is written.

Publication and memory ordering. The writer copies the record into the ring, then stores
the new head with one aligned 8-byte store (a memoryview cast to "Q" copies the value
with a single memcpy of its size), then rings the reader's doorbell. The reader loads
the head, copies the record out (the slot is reused at once), then stores the new tail.
On x86-64 (TSO: stores are not reordered with older stores, loads not with older loads)
this is all the ordering needed. Weakly ordered CPUs (ARM) get no explicit fence from
Python; there the interpreter's own atomics and the FIFO syscalls act as barriers in
practice, which is not a formal guarantee.

Lost wake-ups. The writer publishes the head before it rings; a reader that finds its
rings empty drains their FIFOs, checks the rings again, and only then waits for a FIFO
to become readable. A message published after that second check rings after the drain,
so the wait returns. A ring that finds the FIFO full (64 KiB of unread rings) is
dropped: the reader has wake-ups pending already. The writer rings once per message (one
write syscall); the reader touches its FIFOs only when it is about to sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import mmap
import os
import select
import struct

from plugserve.interfaces.transport import Frames

HEADER_BYTES = 192  # 24 u64 slots: three cache lines
_MAGIC = 0x316D6873_67756C70  # b"plugshm1" read as a little-endian u64
_MAGIC_SLOT, _CAPACITY_SLOT, _HEAD_SLOT, _TAIL_SLOT = 0, 1, 8, 16
_RECORD_HEAD = struct.Struct("=QQ")  # record length, frame count


# --------------------------------------------------------------------------- segments


class Segment:
    """A mapped POSIX shared-memory segment (multiprocessing.shared_memory, minus the
    resource-tracker registration on attach and plus a space reservation on create)."""

    def __init__(self, name: str, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.buf: memoryview | None = memoryview(mapping)
        self._mmap = mapping
        self._owner = owner

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
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
    def attach(cls, name: str) -> Segment | None:
        """The segment once its creator has initialised it; None before that."""
        import _posixshmem

        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:  # created, not sized yet
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


class Record:
    """A message laid out for a ring of `capacity` bytes; ValueError if it cannot fit."""

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


class Ring:
    """One direction between two processes, over a segment. Each process uses a ring
    either as its writer or as its reader, from one thread at a time."""

    def __init__(self, segment: Segment) -> None:
        assert segment.buf is not None
        self._slots = segment.buf[:HEADER_BYTES].cast("Q")
        self.capacity = self._slots[_CAPACITY_SLOT]
        if HEADER_BYTES + self.capacity > segment.buf.nbytes:
            raise RuntimeError(f"shm segment {segment.name!r} is smaller than its header says")
        self._data = segment.buf[HEADER_BYTES : HEADER_BYTES + self.capacity]
        self._head = self._slots[_HEAD_SLOT]  # this side's copy, when it is the writer
        self._tail = self._slots[_TAIL_SLOT]  # this side's copy, when it is the reader

    @staticmethod
    def create(name: str, capacity: int) -> Segment:
        """A new segment, initialised for a ring of `capacity` bytes."""
        segment = Segment.create(name, HEADER_BYTES + capacity)
        assert segment.buf is not None
        slots = segment.buf[:HEADER_BYTES].cast("Q")
        slots[_CAPACITY_SLOT] = capacity
        slots[_MAGIC_SLOT] = _MAGIC  # last: the engine attaches once it sees this
        slots.release()
        return segment

    def release(self) -> None:
        self._slots.release()
        self._data.release()

    # writer

    def try_write(self, record: Record) -> bool:
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


class Doorbell:
    """A named FIFO opened read-write and non-blocking by both sides: the writer writes a
    byte after publishing, the reader waits for it to become readable. Opening it
    read-write never blocks and never fails for want of a peer (Linux and macOS).

    A blocking reader waits for any of its bells with a BellWaiter; asyncio readers
    `watch` it with a future, which is completed when the FIFO becomes readable. Several
    futures may watch one bell (it is registered with their loop once), and one future
    may watch several bells."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._watchers: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched_fd = -1  # the fd registered with _loop, while it is

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

    def watch(self, waiter: asyncio.Future[None]) -> None:
        """Complete `waiter` once the FIFO is readable (call `unwatch` when done)."""
        if self._watched_fd < 0:
            self._loop = waiter.get_loop()
            self._loop.add_reader(self.fd, self._rung)
            self._watched_fd = self.fd
        self._watchers.add(waiter)

    def unwatch(self, waiter: asyncio.Future[None]) -> None:
        self._watchers.discard(waiter)
        if not self._watchers and self._watched_fd >= 0:
            assert self._loop is not None
            self._loop.remove_reader(self._watched_fd)
            self._watched_fd = -1
            self._loop = None

    def _rung(self) -> None:
        for waiter in self._watchers:
            set_done(waiter)

    def close(self) -> None:
        """Close the FIFO. Whoever watches it must be woken by the caller: they unwatch
        it. Closed in their loop's thread, the fd leaves the loop here, before it is
        closed (a closed fd left registered confuses the loop once the number is
        reused); from another thread that is left to their unwatch."""
        if self.fd < 0:
            return
        if self._watched_fd >= 0 and running_loop() is self._loop:
            assert self._loop is not None
            self._loop.remove_reader(self._watched_fd)
            self._watched_fd = -1
        os.close(self.fd)
        self.fd = -1


class BellWaiter:
    """Blocks one thread until any of several doorbells rings (or a timeout); the caller
    then re-checks its rings."""

    def __init__(self, bells: list[Doorbell]) -> None:
        self._poll = select.poll()
        for bell in bells:
            self._poll.register(bell.fd, select.POLLIN)

    def wait(self, timeout: float | None) -> None:
        self._poll.poll(None if timeout is None else math.ceil(timeout * 1000))


def set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
