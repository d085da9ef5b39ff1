"""The transport between the API-server and engine-core processes."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

Frames = list[bytes | memoryview]


@runtime_checkable
class ClientChannel(Protocol):
    """An API server's end: asyncio, one per API-server process. With several API
    servers (`server.api_server_count`), each has a channel of its own to every engine,
    opened with its client index."""

    async def wait_ready(self, timeout: float) -> Frames:
        """The next handshake from an engine that has not sent one yet (called once per
        engine). Raises TimeoutError."""
        ...

    async def send(self, frames: Frames, engine: int = 0) -> None:
        """A request-side message to engine number `engine`; never blocks the event loop
        for long."""
        ...

    async def recv(self) -> Frames:
        """The next message from any engine to this client (the messages say which
        engine sent them)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class EngineChannel(Protocol):
    """An engine core's end, joined to every client: blocking calls, each used by one
    thread only (the input IO thread receives, the output IO thread sends). Clients are
    numbered 0 <= client < num_clients; the engine answers each on the client it heard
    the request from."""

    def send_ready(self, frames: Frames) -> None:
        """The handshake, to every client; the engine speaks first."""
        ...

    def recv(self, timeout: float | None = None) -> tuple[int, Frames] | None:
        """The next request-side message from any client, as (client, frames), or None
        after `timeout` seconds. No client can starve the others."""
        ...

    def send(self, frames: Frames, client: int = 0) -> None:
        """A message to client number `client` only."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Moves frames (lists of bytes-like objects) between the API-server and engine-core
    processes. The core encodes messages; a transport only moves frames. Built in the
    launching process, which calls `addresses()` and passes them, with the transport's
    name and options, to each side; each side builds the transport again and opens its
    end: every client (API server) and every engine once."""

    def __init__(self, *, options: Any = None) -> None: ...

    def addresses(self, num_engines: int = 1, num_clients: int = 1) -> dict[str, str]:
        """Fresh, opaque addresses (ports picked free, temporary paths or names) for
        `num_engines` engines (data parallelism) each serving `num_clients` clients (API
        servers); picklable strings."""
        ...

    def client(self, addresses: dict[str, str], client: int = 0) -> ClientChannel:
        """Open client number `client`'s end (in its event loop's thread)."""
        ...

    def engine(self, addresses: dict[str, str], engine: int = 0) -> EngineChannel:
        """Open engine number `engine`'s end (0 <= engine < num_engines), to every
        client."""
        ...
