"""MixtralForCausalLM: every layer's MLP a mixture of experts (top-2 of 4, top-3 of 8),
over the whole context (the released models) and over a 12-token window."""

from transformers import MixtralConfig

from correctness.tiny_checkpoints import TinyCase, tiny

CASES = [
    TinyCase(
        "mixtral-4-experts-top-2",
        MixtralConfig(**tiny(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    ),
    # Top-3 of 8, a smaller expert than the hidden size, a window the longer prompts
    # slide past, tied head.
    TinyCase(
        "mixtral-8-experts-top-3-window-tied",
        MixtralConfig(
            **tiny(
                num_local_experts=8,
                num_experts_per_tok=3,
                intermediate_size=48,
                sliding_window=12,
                tie_word_embeddings=True,
            )
        ),
    ),
]
