"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, and the
error types its API names by status."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error shape: the body of every answer but a success on these routes."""

    type: str
    error: AnthropicErrorDetail


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error(status, message), status_code=status)


def reshaped(response: Response) -> Response:
    """An error answered in OpenAI's shape by the flow every endpoint shares, in
    Anthropic's; anything else as it is."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    body = json.loads(bytes(response.body))
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or body.get("type") == "error":
        return response
    reshaped_response = anthropic_error_response(response.status_code, str(error.get("message")))
    for name in ("retry-after",):
        if name in response.headers:
            reshaped_response.headers[name] = response.headers[name]
    return reshaped_response
