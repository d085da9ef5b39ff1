"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): Llama's layer with its projections stored fused.

- The checkpoint holds q, k and v stacked in one `qkv_proj` tensor and gate and up in one
  `gate_up_proj`, under the names of our own fused layers: the loading splits each into
  its shards (layers/checkpoint.py), so under tensor parallelism every rank takes its
  heads' rows of q, of k and of v, and its slice of gate and of up.
- RoPE: "longrope" scaling (per-pair short and long factors, cos and sin scaled by the
  attention factor; which factors: rotary.longrope_uses_long_factors), and a partial
  rotary factor (Phi-4-mini: 0.75, the rest of each head passes unrotated).
- No biases; the MLP's activation is the config's hidden_act (SiLU in every release).
- Where the config sets `sliding_window`, every layer attends over that many positions.
"""

from __future__ import annotations

from typing import Any

from plugserve.worker.layers.rotary import RotaryEmbedding, rope_parameters
from plugserve.worker.models.decoder import head_dim_of
from plugserve.worker.models.mistral import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    """interfaces.model.CausalLM for Phi-3 checkpoints (HF names), tied or untied head: Mistral's
    layer (no biases, the config's sliding_window on every layer: Phi-3-mini-4k 2047) with
    longrope and partial rotary, and q/k/v and gate/up stored fused in the checkpoint."""

    def build_rotary(self, hf_config: Any) -> RotaryEmbedding:
        theta, scaling = rope_parameters(hf_config)
        # transformers prefers the config's own original_max_position_embeddings to the
        # one in the RoPE parameters (Phi-3 keeps it at the top level).
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if scaling["rope_type"] == "longrope" and original:
            scaling["original_max_position_embeddings"] = original
        partial = scaling.get(
            "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0
        )
        head_dim = head_dim_of(hf_config)
        return RotaryEmbedding(
            head_dim,
            hf_config.max_position_embeddings,
            theta,
            scaling,
            rotary_dim=int(head_dim * partial),
        )
