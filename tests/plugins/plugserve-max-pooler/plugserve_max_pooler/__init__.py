"""Max pooling as a third party writes it: the element-wise maximum over every prompt
token's final hidden state (sentence-transformers' pooling_mode_max_tokens). Selected
with `stack.pooler: max`, or by a checkpoint whose 1_Pooling config asks for max."""

from __future__ import annotations

from typing import ClassVar

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.pooling import PoolerTokens


class MaxPooler:
    tokens: ClassVar[PoolerTokens] = "all"

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float().amax(dim=0)


@hookimpl
def register_poolers(register: Register) -> None:
    register("max", MaxPooler)
