"""Last-token pooling: a causal decoder's last hidden state has seen the whole prompt
(Qwen3-Embedding, E5-Mistral)."""

from __future__ import annotations

from typing import ClassVar

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.pooling import PoolerTokens


class LastTokenPooler:
    tokens: ClassVar[PoolerTokens] = "last"

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[-1]


@hookimpl
def register_poolers(register: Register) -> None:
    register("last", LastTokenPooler)
