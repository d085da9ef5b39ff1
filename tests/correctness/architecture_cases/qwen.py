"""Qwen2ForCausalLM (q/k/v biases) and Qwen3ForCausalLM (q/k norm), tied and untied."""

from transformers import Qwen2Config, Qwen3Config

from correctness.tiny_checkpoints import TinyCase, tiny

CASES = [
    TinyCase("qwen2-qkv-bias-untied", Qwen2Config(**tiny(tie_word_embeddings=False))),
    TinyCase("qwen2-qkv-bias-tied", Qwen2Config(**tiny(tie_word_embeddings=True))),
    # q/k norm; head_dim 32 from the config, not hidden_size / num_heads (16), as
    # Qwen3's 128 is not; tied as the small Qwen3s, untied as the large ones.
    TinyCase("qwen3-qk-norm-tied", Qwen3Config(**tiny(head_dim=32, tie_word_embeddings=True))),
    TinyCase("qwen3-qk-norm-untied", Qwen3Config(**tiny(head_dim=32, tie_word_embeddings=False))),
]
