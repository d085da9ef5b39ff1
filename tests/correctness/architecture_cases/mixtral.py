"""MixtralForCausalLM: every layer's MLP a mixture of experts (top-2 of 4, and of 8)."""

from transformers import MixtralConfig

from correctness.tiny_checkpoints import TinyCase, tiny

CASES = [
    TinyCase(
        "mixtral-4-experts-top-2",
        MixtralConfig(**tiny(num_local_experts=4, num_experts_per_tok=2)),
    ),
    # Top-3 of 8, a smaller expert than the hidden size, tied head.
    TinyCase(
        "mixtral-8-experts-top-3-tied",
        MixtralConfig(
            **tiny(
                num_local_experts=8,
                num_experts_per_tok=3,
                intermediate_size=48,
                tie_word_embeddings=True,
            )
        ),
    ),
]
