"""Heartbeats from an executor's remote peers, so that a peer's death ends the requests
in flight at once instead of after the collective timeout. Shared by the executors of
this package: the mp executor's peers are its other nodes, the Ray executor's its actors.

The executor listens (the mp executor on master_addr:(master_port + 1)); every peer
dials it, says its id in one line, then sends a byte every `interval_s`. The executor
watches these sockets beside whatever else it waits on: a closed connection (the peer's
process died, or quit after one of its workers died) fails at once; silence past
`timeout_s` (a host that froze or dropped off the network, which closes nothing) fails
when the timeout passes. Without this, a surviving rank would wait in its collective
with the dead ones until gloo gives up.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

BEAT = b"."


def heartbeat_port(master_port: int) -> int:
    return master_port + 1


class PeerHeartbeats:
    """The executor's side: accepts each peer's heartbeat connection and says which peer
    went quiet or away (`check`). `names`: each peer's id and how errors name it. Port 0:
    any free port (`port` says which)."""

    def __init__(self, host: str, port: int, names: dict[int, str], timeout_s: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(len(names) + 1)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self.names = names
        self.expected = len(names)
        self.timeout_s = timeout_s
        self._pending: dict[socket.socket, bytes] = {}  # connected, node rank not yet read
        self._nodes: dict[socket.socket, int] = {}
        self._last_seen: dict[int, float] = {}
        # Silence counts once the peers are up (`watch_silence`): a peer loading a model
        # may hold the GIL, and its heartbeat thread with it, for seconds at a time.
        self._silence_counts = False

    @property
    def all_joined(self) -> bool:
        return len(self._last_seen) >= self.expected

    def waitables(self) -> list[Any]:
        return [self._listener, *self._pending, *self._nodes]

    def watch_silence(self) -> None:
        """From now on a peer silent past the timeout is gone (a closed connection
        always is)."""
        now = time.monotonic()
        self._last_seen = dict.fromkeys(self._last_seen, now)
        self._silence_counts = True

    def next_deadline(self) -> float | None:
        """When the quietest joined node will be overdue (time.monotonic), or None."""
        if not self._last_seen or not self._silence_counts:
            return None
        return min(self._last_seen.values()) + self.timeout_s

    def check(self, ready: list[Any]) -> str | None:
        """Read what `ready` holds of ours; the failure to report, if a node is gone."""
        now = time.monotonic()
        if self._listener in ready:
            with contextlib.suppress(BlockingIOError):
                conn, _ = self._listener.accept()
                conn.setblocking(False)
                self._pending[conn] = b""
        for conn in [c for c in self._pending if c in ready]:
            data = _read(conn)
            if data is None:
                continue
            if not data:
                self._pending.pop(conn)
                conn.close()
                continue
            line = self._pending[conn] + data
            if b"\n" not in line:
                self._pending[conn] = line
                continue
            del self._pending[conn]
            node = int(line.split(b"\n", 1)[0])
            self._nodes[conn] = node
            self._last_seen[node] = now
            logger.info("%s joined: its heartbeats are watched", self.names.get(node, node))
        for conn in [c for c in self._nodes if c in ready]:
            node = self._nodes[conn]
            data = _read(conn)
            if data == b"":
                return f"{self.names.get(node, node)} is gone: its heartbeat connection closed"
            if data is not None:
                self._last_seen[node] = now
        for node, seen in self._last_seen.items() if self._silence_counts else ():
            if now - seen > self.timeout_s:
                return f"{self.names.get(node, node)} is gone: no heartbeat for {now - seen:.1f} s"
        return None

    def close(self) -> None:
        for conn in [*self._pending, *self._nodes]:
            conn.close()
        self._listener.close()


def _read(conn: socket.socket) -> bytes | None:
    """What the socket holds now: b"" when its peer closed it, None when nothing came."""
    try:
        return conn.recv(4096)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def send_heartbeats(
    host: str, port: int, peer_id: int, interval_s: float, stop: threading.Event
) -> threading.Thread:
    """A peer's side: a daemon thread that dials the executor (retrying while it is not
    yet listening) and beats every `interval_s` until `stop` is set."""

    def beat() -> None:
        conn = None
        while conn is None and not stop.is_set():
            try:
                conn = socket.create_connection((host, port), timeout=interval_s * 10)
            except OSError:
                stop.wait(interval_s)
        if conn is None:
            return
        with conn:
            try:
                conn.sendall(f"{peer_id}\n".encode())
                while not stop.wait(interval_s):
                    conn.sendall(BEAT)
            except OSError:
                logger.warning("the executor closed the heartbeat connection")

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread
