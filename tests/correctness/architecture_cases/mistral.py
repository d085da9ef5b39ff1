"""MistralForCausalLM: head_dim from the config (32, not hidden_size / num_heads = 16, as
Mistral-Nemo's 128), tied and untied, without a sliding window (Mistral 7B v0.2 on)."""

from transformers import MistralConfig

from correctness.tiny_checkpoints import TinyCase, tiny

CASES = [
    TinyCase(
        "mistral-head-dim-32-untied",
        MistralConfig(**tiny(head_dim=32, sliding_window=None, tie_word_embeddings=False)),
    ),
]
