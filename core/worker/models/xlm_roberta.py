"""XLM-RoBERTa encoders (multilingual E5, BGE-M3, bge-reranker): BERT's layers, with
position ids counted from padding_idx + 1 and a single token type. The classifier is
RoBERTa's head: out_proj(tanh(dense(the <s> state)))."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from plugserve.worker.layers.linear import Linear
from plugserve.worker.models.bert import BertModel


class XLMRobertaModel(BertModel):
    checkpoint_prefix: ClassVar[str] = "roberta."

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        # transformers numbers the positions of an unpadded prompt padding_idx + 1, ...
        return hf_config.pad_token_id + 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    def __init__(self, *, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config=hf_config, **kwargs)
        hidden = hf_config.hidden_size
        self.classifier = nn.Module()
        self.classifier.dense = Linear(hidden, hidden, True)
        self.classifier.out_proj = Linear(hidden, hf_config.num_labels, True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """capabilities.HasClassifier: pooled [N, hidden] → fp32 logits [N, num_labels]."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(pooled))).float()

    def ignored_weight(self, name: str) -> bool:
        return name.endswith("position_ids") or name.startswith(("pooler.", "lm_head."))
