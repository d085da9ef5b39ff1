"""PoolingParams: what a pooling request asks of its pooled output.

It travels beside SamplingParams on the request (a msgspec Struct, since it crosses the
process boundary). A pooling model runs the prompt once and returns one vector (or one
per token) instead of sampling: the task says which, the rest shape the vector.
Validation raises ValueError with a message a user can act on (a 400 over HTTP).
"""

from __future__ import annotations

from typing import Literal

import msgspec

# embed: one vector per prompt; classify: the classification head's probabilities;
# score: a cross-encoder's relevance of a (query, document) pair, one number;
# token_embed: one vector per prompt token.
PoolingTask = Literal["embed", "classify", "score", "token_embed"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "token_embed")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    task: PoolingTask = "embed"
    # Matryoshka truncation: keep the first `dimensions` values (renormalised where the
    # vector is normalised). None: the model's whole hidden size.
    dimensions: int | None = None
    # L2-normalise the vector; None: as the checkpoint says (its Normalize module).
    normalize: bool | None = None
    # Cut the prompt to at most this many tokens as its tokenizer truncates, its special
    # tokens kept (prompt_truncation.py; the frontend cuts it before sending).
    truncate_prompt_tokens: int | None = None
    # classify/score: softmax (several labels) or sigmoid (one label) over the head's
    # logits; False: the raw logits.
    activation: bool = True
    # Segment ids of the prompt's tokens (a BERT cross-encoder's pair); None: all zero.
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens}"
            )
        if self.dimensions is not None and self.task not in ("embed", "token_embed"):
            raise ValueError(f"dimensions applies to embeddings, not to task {self.task!r}")
