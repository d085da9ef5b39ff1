"""Qwen3MoeForCausalLM: experts on every layer or every other one, a dense layer through
mlp_only_layers, top-k weights renormalized (norm_topk_prob) and not, and every layer
over a 12-token window (use_sliding_window, off in the released models)."""

from transformers import Qwen3MoeConfig

from correctness.tiny_checkpoints import TinyCase, tiny

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32)

CASES = [
    # Layer 0 dense (intermediate_size 128), layer 1 the experts; renormalized as the
    # released Qwen3-MoE models are; tied head.
    TinyCase(
        "qwen3-moe-renormalized-dense-layer-tied",
        Qwen3MoeConfig(
            **tiny(**MOE, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True)
        ),
    ),
    # Three layers, experts on every other one (decoder_sparse_step 2: layer 1 only),
    # the top-k probabilities used as they are, a window the longer prompts slide past;
    # untied head.
    TinyCase(
        "qwen3-moe-unnormalized-sparse-step-window-untied",
        Qwen3MoeConfig(
            **tiny(
                **MOE,
                num_hidden_layers=3,
                norm_topk_prob=False,
                decoder_sparse_step=2,
                use_sliding_window=True,
                sliding_window=12,
                tie_word_embeddings=False,
            )
        ),
    ),
]
