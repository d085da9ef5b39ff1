"""BERT encoders: `BertModel` (sentence embedders such as all-MiniLM-L6-v2) and
`BertForSequenceClassification` (cross-encoders): learned absolute positions, token type
ids, post-LayerNorm layers with GELU, bidirectional attention. A pooling model: the
runner pools its final hidden states; a classifier's head (pooler dense + tanh over the
CLS state, then the classifier) runs in `classify`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from plugserve.interfaces.model import AttentionBackend, LayerAttention, WholeEncoderStack
from plugserve.worker.layers.checkpoint import PackedModulesMapping, load_checkpoint
from plugserve.worker.layers.encoder_layer import ENCODER_QKV, EncoderEmbeddings, EncoderLayer
from plugserve.worker.layers.linear import Linear
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

BIDIRECTIONAL = LayerAttention(bidirectional=True)


class Encoder(nn.Module):
    """transformers' `encoder.layer.N` naming."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layers)


class BertModel(nn.Module):
    """interfaces.model.CausalLM's shape for an encoder without an LM head: forward gives
    the final hidden states a pooler reads. A model pass sees it as an
    interfaces.model.EncoderFrame and may install a whole-stack replacement."""

    packed_modules_mapping: ClassVar[PackedModulesMapping] = ENCODER_QKV
    # The prefix a task model's checkpoint puts before the encoder's names.
    checkpoint_prefix: ClassVar[str] = "bert."
    # capabilities.TakesTokenTypeIds
    takes_token_type_ids: ClassVar[bool] = True

    def __init__(
        self,
        *,
        hf_config: Any,
        attention: AttentionBackend,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.parallel = parallel or NO_PARALLEL
        self.embeddings = EncoderEmbeddings(
            hf_config, self.position_offset(hf_config), self.parallel
        )
        self.encoder = Encoder(
            EncoderLayer(hf_config, i, attention, self.parallel)
            for i in range(hf_config.num_hidden_layers)
        )
        self.whole_stack: WholeEncoderStack | None = None

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        """What a token's position in its prompt adds to its position id."""
        return 0

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        return [BIDIRECTIONAL] * hf_config.num_hidden_layers

    @classmethod
    def context_limit(cls, hf_config: Any) -> int:
        """capabilities.HasContextLimit: the position ids the embedding table holds."""
        return hf_config.max_position_embeddings - cls.position_offset(hf_config)

    # ------------------------------------------------------------------ interfaces.model.EncoderFrame

    @property
    def layers(self) -> Sequence[nn.Module]:
        return self.encoder.layer

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def install_stack(self, stack: WholeEncoderStack | None) -> None:
        self.whole_stack = stack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        stack = self.whole_stack
        if stack is not None and stack.runs(x.shape[0]):
            return stack(x)
        for layer in self.encoder.layer:
            x = layer(x)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"{type(self).__name__} has no language-model head: it only pools")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        prefix = self.checkpoint_prefix
        load_checkpoint(
            self,
            ((name.removeprefix(prefix), tensor) for name, tensor in weights),
            self.packed_modules_mapping,
            self.ignored_weight,
        )

    def ignored_weight(self, name: str) -> bool:
        # position_ids is a buffer some checkpoints saved; an embedder does not use the
        # pretraining pooler (a classifier's own head takes it: see subclasses).
        return name.endswith("position_ids") or name.startswith(("pooler.", "cls.", "lm_head."))


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder: classify(the CLS hidden state) = classifier(tanh(pooler(x)))."""

    def __init__(self, *, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config=hf_config, **kwargs)
        hidden = hf_config.hidden_size
        self.pooler = nn.Module()
        self.pooler.dense = Linear(hidden, hidden, True)
        self.classifier = Linear(hidden, hf_config.num_labels, True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """capabilities.HasClassifier: pooled [N, hidden] → fp32 logits [N, num_labels]."""
        return self.classifier(torch.tanh(self.pooler.dense(pooled))).float()

    def ignored_weight(self, name: str) -> bool:
        return name.endswith("position_ids") or name.startswith(("cls.", "lm_head."))
