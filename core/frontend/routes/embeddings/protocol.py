"""The body of OpenAI's /v1/embeddings, with vLLM's pooling extras."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from plugserve.frontend.protocol import StrictModel


class EmbeddingRequest(StrictModel):
    model: str | None = None
    # A string, a list of strings, token ids, or a list of token-id lists.
    input: str | list[str] | list[int] | list[list[int]]
    # base64: each vector as the base64 of its little-endian float32 bytes.
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation (renormalised where the model normalises).
    dimensions: int | None = None
    # vLLM's extras: cut each prompt to N tokens as its tokenizer truncates (special
    # tokens kept); normalise or not (default: as the checkpoint says).
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    normalize: bool | None = None
