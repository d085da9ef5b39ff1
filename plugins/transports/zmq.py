"""ZeroMQ transport: ROUTER/DEALER for requests, PUSH/PULL for outputs.

Every client (API server) binds a ROUTER and a PULL socket of its own; every engine
connects a DEALER and a PUSH socket to each client. An engine's DEALERs carry its
routing identity and speak first (the ready handshake, sent to every client), which is
how each ROUTER learns whom to address, and what lets several engines share one client
socket. The engine tells its clients apart by the DEALER a request came in on, and
answers on the PUSH socket of that client. Receives are zero-copy: frames come back as
memoryviews over ZeroMQ's buffers.

The client reads its outputs off the PULL socket's file descriptor with the event loop's
own reader, not through pyzmq's asyncio futures, whose bookkeeping cost the API server
more CPU per streamed token than receiving and decoding the message itself.

With ipc, each client's two sockets live in a private folder (mode 0700) that the client
creates when it opens and removes when it closes; `addresses()` only picks its path.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import tempfile
from typing import Literal

import pydantic
import zmq
import zmq.asyncio

from plugserve import hookimpl
from plugserve.interfaces.transport import Frames


def _identity(engine: int) -> bytes:
    return b"engine-%d" % engine


class ZmqTransport:
    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        # ipc (unix sockets in a private temporary folder) is faster on one host; tcp on
        # loopback is there for hosts without unix sockets.
        protocol: Literal["ipc", "tcp"] = "ipc"

    def __init__(self, *, options: Options | None = None) -> None:
        self.options = options or self.Options()

    def addresses(self, num_engines: int = 1, num_clients: int = 1) -> dict[str, str]:
        # Per client one ROUTER and one PULL serve every engine: identities route the
        # requests, so the number of engines needs no addresses of its own.
        if num_engines < 1 or num_clients < 1:
            raise ValueError(
                f"need at least one engine and one client, not {num_engines}, {num_clients}"
            )
        addresses = {"clients": str(num_clients)}
        token = secrets.token_hex(6)
        for client in range(num_clients):
            if self.options.protocol == "tcp":
                addresses[f"input_{client}"] = f"tcp://127.0.0.1:{_free_port()}"
                addresses[f"output_{client}"] = f"tcp://127.0.0.1:{_free_port()}"
            else:
                folder = os.path.join(tempfile.gettempdir(), f"plugserve-zmq-{token}-{client}")
                addresses[f"folder_{client}"] = folder
                addresses[f"input_{client}"] = f"ipc://{folder}/input"
                addresses[f"output_{client}"] = f"ipc://{folder}/output"
        return addresses

    def client(self, addresses: dict[str, str], client: int = 0) -> ZmqClientChannel:
        return ZmqClientChannel(addresses, client)

    def engine(self, addresses: dict[str, str], engine: int = 0) -> ZmqEngineChannel:
        return ZmqEngineChannel(addresses, engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _num_clients(addresses: dict[str, str]) -> int:
    return int(addresses["clients"])


class ZmqClientChannel:
    def __init__(self, addresses: dict[str, str], client: int = 0) -> None:
        if not 0 <= client < _num_clients(addresses):
            raise IndexError(
                f"no client {client}: these addresses are for {_num_clients(addresses)}"
            )
        self._folder = addresses.get(f"folder_{client}")
        if self._folder is not None:
            os.mkdir(self._folder, 0o700)  # fails if it exists: fresh addresses only
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        # A request for an engine that is gone must fail loudly, not vanish.
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._output = zmq.Context.shadow(self._ctx).socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        try:
            self._input.bind(addresses[f"input_{client}"])
            self._output.bind(addresses[f"output_{client}"])
        except BaseException:
            self.close()
            raise
        self._ready: set[bytes] = set()
        self._output_fd: int = self._output.getsockopt(zmq.FD)
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def wait_ready(self, timeout: float) -> Frames:
        try:
            identity, *frames = await asyncio.wait_for(self._input.recv_multipart(), timeout)
        except asyncio.TimeoutError as exc:  # not the builtin TimeoutError before 3.11
            raise TimeoutError(f"no engine handshake within {timeout} s") from exc
        self._ready.add(identity)
        return frames

    async def send(self, frames: Frames, engine: int = 0) -> None:
        identity = _identity(engine)
        if identity not in self._ready:
            raise RuntimeError(f"engine {engine} has not completed its handshake")
        await self._input.send_multipart([identity, *frames], copy=False)

    async def recv(self) -> Frames:
        """The next output message. One receiver at a time (the output handler): a second
        would take over the descriptor's reader."""
        while True:
            # EVENTS first: a receive that finds nothing raises zmq.Again, and building that
            # exception is a measurable share of the API server's CPU at one request
            # (docs/benchmarks-history.md, "Figures from code comments").
            await self._output_readable()
            try:
                frames = self._output.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            return [frame.buffer for frame in frames]

    async def _output_readable(self) -> None:
        # ZeroMQ's descriptor signals that the socket's events changed, not that a message
        # waits, and reading EVENTS rearms it: wait on it until EVENTS says POLLIN. The
        # reader stays registered: adding and removing it around every wait cost the API
        # server a measurable share of its CPU at one streamed request (the same section).
        while not self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if self._reader_loop is None:
                self._reader_loop = asyncio.get_running_loop()
                self._reader_loop.add_reader(self._output_fd, self._on_output_fd)
            self._waiter = self._reader_loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _on_output_fd(self) -> None:
        # Read EVENTS even with nobody waiting: until it is read the descriptor stays
        # readable and the loop would call back every turn. The waiter, once woken,
        # reads EVENTS again before receiving, so a message signalled here is not lost.
        if self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        if self._reader_loop is not None and not self._reader_loop.is_closed():
            self._reader_loop.remove_reader(self._output_fd)
        self._input.close()
        self._output.close()
        self._ctx.term()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


class ZmqEngineChannel:
    """One DEALER (requests in) and one PUSH socket (outputs out) per client."""

    def __init__(self, addresses: dict[str, str], engine: int) -> None:
        self._ctx = zmq.Context()
        self._inputs: list[zmq.Socket] = []
        self._outputs: list[zmq.Socket] = []
        self._poller = zmq.Poller()
        for client in range(_num_clients(addresses)):
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IDENTITY, _identity(engine))
            dealer.connect(addresses[f"input_{client}"])
            self._inputs.append(dealer)
            self._poller.register(dealer, zmq.POLLIN)
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)  # let the last outputs (DEAD) leave
            push.connect(addresses[f"output_{client}"])
            self._outputs.append(push)
        self._next = 0  # the client looked at first: round robin

    def send_ready(self, frames: Frames) -> None:
        for dealer in self._inputs:
            dealer.send_multipart(frames)

    def recv(self, timeout: float | None = None) -> tuple[int, Frames] | None:
        wait_ms = None if timeout is None else int(timeout * 1000)
        readable = dict(self._poller.poll(wait_ms))
        count = len(self._inputs)
        for step in range(count):
            client = (self._next + step) % count
            if self._inputs[client] in readable:
                self._next = (client + 1) % count
                frames = self._inputs[client].recv_multipart(copy=False)
                return client, [frame.buffer for frame in frames]
        return None

    def send(self, frames: Frames, client: int = 0) -> None:
        self._outputs[client].send_multipart(frames, copy=False)

    def close(self) -> None:
        for sock in (*self._inputs, *self._outputs):
            sock.close()
        self._ctx.term()


@hookimpl
def register_transports(register):
    register("zmq", ZmqTransport)
