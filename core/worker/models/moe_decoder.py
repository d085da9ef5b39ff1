"""What the mixture-of-experts families (Mixtral, Qwen3-MoE) add to the decoder frame:
loading each expert's checkpoint tensors into the stacked weights of FusedMoE
(layers/moe.py).

The router and the attention linears run their linear method like any Linear; the
experts' stacked weights are not Linears and stay as loaded, for ATen's matmuls.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from plugserve.worker.layers.checkpoint import load_checkpoint
from plugserve.worker.layers.moe import ExpertCheckpointNames
from plugserve.worker.models.decoder import DecoderForCausalLM, with_model_prefix


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """A decoder whose layers' MLPs are (some or all) FusedMoE, named in checkpoints as
    `expert_names` says."""

    expert_names: ClassVar[ExpertCheckpointNames]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(
            self,
            self.expert_names.unstack(with_model_prefix(weights)),
            self.packed_modules_mapping,
            self.ignored_weight,
            route=self.expert_names.route,
        )
