"""LlamaForCausalLM: tied and untied head, biases everywhere, llama3-scaled RoPE."""

from transformers import LlamaConfig

from correctness.tiny_checkpoints import TinyCase, tiny

CASES = [
    TinyCase("llama-tied", LlamaConfig(**tiny(tie_word_embeddings=True))),
    TinyCase(
        "llama-untied-biases-llama3-rope",
        LlamaConfig(
            **tiny(
                tie_word_embeddings=False,
                attention_bias=True,
                mlp_bias=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 50000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            )
        ),
    ),
]
