"""CLS pooling: the first token's hidden state (BERT's [CLS], XLM-R's <s>), what
encoders and cross-encoders classify from."""

from __future__ import annotations

from typing import ClassVar

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.pooling import PoolerTokens


class ClsPooler:
    tokens: ClassVar[PoolerTokens] = "first"

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[0]


@hookimpl
def register_poolers(register: Register) -> None:
    register("cls", ClsPooler)
