"""The errors the serving layer answers with a 4xx in OpenAI's error shape."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input: answered with a 400 in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(InvalidRequest):
    """An unknown model name: a 404, as OpenAI answers."""
