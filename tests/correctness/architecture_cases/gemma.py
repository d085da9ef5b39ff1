"""Gemma2ForCausalLM and Gemma3ForCausalLM (text): Gemma's norms, scaled embeddings and
GELU MLP, with the structural options that change attention switched on so they bite at
the tiny size. The window (8 and 12 tokens) is far shorter than the longer prompts (33-100
tokens) and than every continuation, so sliding layers really drop keys, in prefill
chunks and decodes; query_pre_attn_scalar is not head_dim (32); soft-caps sit near the
scores' and logits' spread (~3 and ~2), where tanh bends them; Gemma 3's sliding and
global layers rotate by different bases, the global one linearly scaled (factor 8, as
the 4B-27B releases)."""

from transformers import Gemma2Config, Gemma3TextConfig

from correctness.tiny_checkpoints import TinyCase, tiny

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}

CASES = [
    TinyCase(
        "gemma2-window-softcaps-tied",
        Gemma2Config(
            **tiny(
                head_dim=32,
                query_pre_attn_scalar=24,
                sliding_window=8,
                attn_logit_softcapping=4.0,
                final_logit_softcapping=3.0,
                tie_word_embeddings=True,
            )
        ),
    ),
    # Three layers (sliding, full, sliding), biases on q/k/v/o, untied head.
    TinyCase(
        "gemma2-bias-untied-3-layers",
        Gemma2Config(
            **tiny(
                num_hidden_layers=3,
                head_dim=16,
                query_pre_attn_scalar=64,
                sliding_window=12,
                attn_logit_softcapping=4.0,
                final_logit_softcapping=3.0,
                attention_bias=True,
                tie_word_embeddings=False,
            )
        ),
    ),
    # As released: no soft-capping, tied; the full layer in the middle.
    TinyCase(
        "gemma3-qk-norm-two-ropes-tied",
        Gemma3TextConfig(
            **tiny(
                num_hidden_layers=3,
                layer_types=[SLIDING, FULL, SLIDING],
                head_dim=32,
                query_pre_attn_scalar=20,
                sliding_window=12,
                rope_parameters=GEMMA3_ROPE,
                tie_word_embeddings=True,
            )
        ),
    ),
    TinyCase(
        "gemma3-final-softcap-untied",
        Gemma3TextConfig(
            **tiny(
                layer_types=[SLIDING, FULL],
                head_dim=32,
                query_pre_attn_scalar=24,
                sliding_window=8,
                rope_parameters=GEMMA3_ROPE,
                final_logit_softcapping=3.0,
                tie_word_embeddings=False,
            )
        ),
    ),
]
