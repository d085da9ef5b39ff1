"""MistralForCausalLM: head_dim from the config (32, not hidden_size / num_heads = 16, as
Mistral-Nemo's 128) without a sliding window (Mistral 7B v0.2 on), and every layer over a
12-token window (v0.1's 4096, scaled to the tiny prompts so that they slide: all but the
3-token one are longer), tied and untied."""

from transformers import MistralConfig

from correctness.tiny_checkpoints import TinyCase, tiny

CASES = [
    TinyCase(
        "mistral-head-dim-32-untied",
        MistralConfig(**tiny(head_dim=32, sliding_window=None, tie_word_embeddings=False)),
    ),
    TinyCase(
        "mistral-sliding-window-12-tied",
        MistralConfig(**tiny(sliding_window=12, tie_word_embeddings=True)),
    ),
]
