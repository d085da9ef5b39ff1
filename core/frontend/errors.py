"""The errors the serving layer answers with a 4xx in OpenAI's error shape, and what a
client is told of an error the server did not expect."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input: answered with a 400 in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(InvalidRequest):
    """An unknown model name: a 404, as OpenAI answers."""


def internal_error_message(exc: BaseException) -> str:
    """The message of the 500 for an exception the server did not expect: named, so that
    a client's report says what failed."""
    return f"internal server error: {type(exc).__name__}: {exc}"
