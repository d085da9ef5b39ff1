"""Mean pooling: the average of every prompt token's hidden state, in fp32 (as
sentence-transformers' pooling_mode_mean_tokens over an unpadded sequence)."""

from __future__ import annotations

from typing import ClassVar

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.pooling import PoolerTokens


class MeanPooler:
    tokens: ClassVar[PoolerTokens] = "all"

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float().mean(dim=0)


@hookimpl
def register_poolers(register: Register) -> None:
    register("mean", MeanPooler)
