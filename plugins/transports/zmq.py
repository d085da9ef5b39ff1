"""ZeroMQ transport: ROUTER/DEALER for requests, PUSH/PULL for outputs.

The API server binds both sockets; each engine connects. The engine's DEALER carries a
routing identity and speaks first (the ready handshake), which is how the ROUTER learns
whom to address, and what lets several engines share one client socket. Receives are
zero-copy: frames come back as memoryviews over ZeroMQ's buffers.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from typing import Literal

import pydantic
import zmq
import zmq.asyncio

from plugserve import hookimpl
from plugserve.interfaces import Frames


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

    def addresses(self, num_engines: int = 1) -> dict[str, str]:
        # One ROUTER and one PULL serve every engine: identities route the requests.
        if self.options.protocol == "tcp":
            return {
                "input": f"tcp://127.0.0.1:{_free_port()}",
                "output": f"tcp://127.0.0.1:{_free_port()}",
            }
        folder = tempfile.mkdtemp(prefix="plugserve-zmq-")
        return {
            "input": f"ipc://{folder}/input",
            "output": f"ipc://{folder}/output",
            "folder": folder,
        }

    def client(self, addresses: dict[str, str]) -> ZmqClientChannel:
        return ZmqClientChannel(addresses)

    def engine(self, addresses: dict[str, str], engine: int = 0) -> ZmqEngineChannel:
        return ZmqEngineChannel(addresses, engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ZmqClientChannel:
    def __init__(self, addresses: dict[str, str]) -> None:
        self._folder = addresses.get("folder")
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        # A request for an engine that is gone must fail loudly, not vanish.
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.bind(addresses["input"])
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(addresses["output"])
        self._ready: set[bytes] = set()

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
        frames = await self._output.recv_multipart(copy=False)
        return [frame.buffer for frame in frames]

    def close(self) -> None:
        self._input.close()
        self._output.close()
        self._ctx.term()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


class ZmqEngineChannel:
    def __init__(self, addresses: dict[str, str], engine: int) -> None:
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.DEALER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.IDENTITY, _identity(engine))
        self._input.connect(addresses["input"])
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.setsockopt(zmq.LINGER, 2000)  # let the last outputs (DEAD) leave
        self._output.connect(addresses["output"])
        self._poller = zmq.Poller()
        self._poller.register(self._input, zmq.POLLIN)

    def send_ready(self, frames: Frames) -> None:
        self._input.send_multipart(frames)

    def recv(self, timeout: float | None = None) -> Frames | None:
        wait_ms = None if timeout is None else int(timeout * 1000)
        if not self._poller.poll(wait_ms):
            return None
        frames = self._input.recv_multipart(copy=False)
        return [frame.buffer for frame in frames]

    def send(self, frames: Frames) -> None:
        self._output.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._input.close()
        self._output.close()
        self._ctx.term()


@hookimpl
def register_transports(register):
    register("zmq", ZmqTransport)
