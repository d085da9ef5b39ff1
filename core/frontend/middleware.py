"""What every HTTP request of an API server passes first (one plain ASGI middleware:
starlette's BaseHTTPMiddleware would relay every streamed chunk through an extra task
and queue):

- while the server drains for shutdown, a new request is answered 503 at once;
- on /v1/ routes, the API key (`Authorization: Bearer <key>`, or `x-api-key: <key>` as
  Anthropic's clients send it), compared in constant time;
- the request id: the client's `X-Request-Id` (vLLM's header) or a fresh one, given to the
  routes (`request.state.request_id`) and echoed in the response's `X-Request-Id`;
- every response names the API-server process that answered (x-plugserve-api-server);
- an exception raised before the response started (a bug in a route, or in a plugin it
  calls) is logged with its traceback and answered 500 in OpenAI's error shape, never
  as starlette's plain-text page, which clients cannot parse.

The gate's own errors are in OpenAI's shape, except under a path prefix an endpoint
family registered another API's shape for in ERROR_SHAPES (Anthropic's, /v1/messages).

It also counts the requests in flight, which graceful shutdown waits for.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugserve.frontend.routes.endpoint_flow import error_response, internal_error_response

logger = logging.getLogger(__name__)

API_SERVER_HEADER = "x-plugserve-api-server"
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_LENGTH = 256


@dataclass
class Traffic:
    """What graceful shutdown reads and sets (app.state.traffic)."""

    in_flight: int = 0  # HTTP requests being answered, streams until their last event
    draining: bool = False  # set on shutdown: new requests are answered 503


# Path prefix -> how the gate answers an error there, (status, message) -> response, for
# endpoint families that speak another API than OpenAI's.
ERROR_SHAPES: dict[str, Callable[[int, str], Any]] = {}


def _error(path: str, status: int, message: str, kind: str, param: str | None = None) -> Any:
    for prefix, shape in ERROR_SHAPES.items():
        if path.startswith(prefix):
            return shape(status, message)
    return error_response(status, message, kind, param)


class ServerGate:
    def __init__(self, app: Any, *, api_key: str | None, identity: str, traffic: Traffic) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.expected_key = api_key.encode() if api_key else None
        self.header = (API_SERVER_HEADER.encode(), identity.encode())
        self.traffic = traffic

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = _request_id(headers.get(REQUEST_ID_HEADER.encode()))
        echoed = [self.header]
        if request_id is not None:
            echoed.append((REQUEST_ID_HEADER.encode(), request_id.encode()))

        started = False

        async def send_identified(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), *echoed]
            await send(message)

        path = scope["path"]
        if self.traffic.draining:
            response = _error(path, 503, "the server is shutting down", "server_error")
            response.headers["connection"] = "close"
            await response(scope, receive, send_identified)
            return
        if request_id is None:
            response = _error(
                path,
                400,
                f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LENGTH} printable ASCII characters",
                "invalid_request_error",
                "X-Request-Id",
            )
            await response(scope, receive, send)
            return
        if self.expected is not None and path.startswith("/v1/"):
            bearer = headers.get(b"authorization", b"")
            key = headers.get(b"x-api-key", b"")
            assert self.expected_key is not None
            # Both compared, whichever was sent: the time taken says nothing of either.
            bearer_ok = hmac.compare_digest(bearer, self.expected)
            key_ok = hmac.compare_digest(key, self.expected_key)
            if not (bearer_ok or key_ok):
                response = _error(path, 401, "invalid or missing API key", "authentication_error")
                await response(scope, receive, send_identified)
                return
        scope.setdefault("state", {})["request_id"] = request_id
        self.traffic.in_flight += 1
        try:
            await self.app(scope, receive, send_identified)
        except Exception as exc:
            if started:  # too late for a status: the server closes the connection
                raise
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            response = internal_error_response(exc)
            await response(scope, receive, send_identified)
        finally:
            self.traffic.in_flight -= 1


def _request_id(given: bytes | None) -> str | None:
    """The client's id if it is a usable one, a fresh one if none was given; None for
    an unusable one (a 400)."""
    if given is None:
        return uuid.uuid4().hex
    text = given.decode("latin-1")
    if 0 < len(text) <= MAX_REQUEST_ID_LENGTH and text.isprintable() and text.isascii():
        return text
    return None
