"""All-token pooling: every prompt token's hidden state, one vector per token (for
late-interaction retrieval such as ColBERT, and the token_embed task)."""

from __future__ import annotations

from typing import ClassVar

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.pooling import PoolerTokens


class AllTokensPooler:
    tokens: ClassVar[PoolerTokens] = "all"

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@hookimpl
def register_poolers(register: Register) -> None:
    register("all", AllTokensPooler)
