"""Sampled tokens' logprobs in OpenAI's two shapes: chat's `content` list and
completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset).

Every logprob passes through `json_logprob`: a token that a grammar or a bias ruled out
has logprob -inf, which JSON cannot carry (a JSONResponse refuses it, msgspec writes null);
vLLM answers -9999.0 for it, and so does this server."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from plugserve.datatypes import Logprobs

# vLLM's floor: what a logprob of -inf (or any value JSON cannot carry) is rendered as.
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """`value` as vLLM renders it: at least MIN_LOGPROB, and finite."""
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


class LogprobsFormatter:
    """Per API server: token texts are decoded once and cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def _text_of(self, tokens_as_ids: bool) -> Callable[[int], str]:
        return _token_id_text if tokens_as_ids else self.text_of

    def chat(self, entries: list[tuple[int, Logprobs]], tokens_as_ids: bool) -> dict[str, Any]:
        """Chat's shape (also the Responses API's): one `content` entry per token."""
        text_of = self._text_of(tokens_as_ids)
        content = []
        for token_id, lp in entries:
            text = text_of(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": json_logprob(lp.sampled_logprob),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": text_of(t),
                            "logprob": json_logprob(v),
                            "bytes": list(text_of(t).encode()),
                        }
                        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                }
            )
        return {"content": content}

    def completion(
        self, entries: list[tuple[int, Logprobs]], tokens_as_ids: bool
    ) -> dict[str, Any]:
        """Completions' shape: parallel lists, each token's text offset among them."""
        text_of = self._text_of(tokens_as_ids)
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for token_id, lp in entries:
            text = text_of(token_id)
            tokens.append(text)
            token_logprobs.append(json_logprob(lp.sampled_logprob))
            top.append(
                {
                    text_of(t): json_logprob(v)
                    for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                }
            )
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def prompt_logprobs_entries(
    formatter: LogprobsFormatter,
    prompt: list[int],
    entries: list[Logprobs | None],
    tokens_as_ids: bool,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token, None for the
    first, else {token id: {logprob, rank, decoded_token}} for the prompt's token and then
    the top alternatives (ranked 1, 2, …)."""
    text_of = formatter._text_of(tokens_as_ids)
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp in zip(prompt, entries, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(token_id): {
                "logprob": json_logprob(lp.sampled_logprob),
                "rank": lp.sampled_rank,
                "decoded_token": text_of(token_id),
            }
        }
        for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(
                str(t), {"logprob": json_logprob(v), "rank": rank, "decoded_token": text_of(t)}
            )
        out.append(entry)
    return out
