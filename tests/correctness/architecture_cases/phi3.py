"""Phi3ForCausalLM: q/k/v and gate/up stored fused, longrope-scaled RoPE with factors
far from 1, partial rotary (Phi-4-mini's 0.75), a 16-token sliding window (Phi-3-mini-4k's
2047, scaled to the tiny prompts), tied and untied.

Which longrope factors rotate is decided once per model (rotary.longrope_uses_long_factors:
long where max_position_embeddings exceeds original_max_position_embeddings); transformers
decides per sequence length, so each case puts every prompt on the same side as plugserve:
- long factors: original_max_position_embeddings 2, below the shortest prompt (3 tokens),
  so transformers rotates every sequence by the long factors too; the attention factor
  is the default one, sqrt(1 + ln(512 / 2) / ln(2)) = 3;
- short factors: original_max_position_embeddings = max_position_embeddings (512), above
  the longest sequence (100 + 24 tokens); the attention factor from `factor`.
"""

from transformers import Phi3Config

from correctness.tiny_checkpoints import TinyCase, tiny

# One factor per rotated pair of dimensions: head_dim 16, 12 of them rotated at 0.75.
SHORT_FACTORS = [1.0, 1.05, 1.2, 1.4, 1.7, 2.1, 2.6, 3.2]
LONG_FACTORS = [1.0, 1.6, 2.8, 4.5, 7.0, 11.0, 17.0, 26.0]

CASES = [
    TinyCase(
        "phi3-longrope-long-partial-rotary-tied",
        Phi3Config(
            **tiny(
                tie_word_embeddings=True,
                original_max_position_embeddings=2,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.75,
                    "short_factor": SHORT_FACTORS[:6],
                    "long_factor": LONG_FACTORS[:6],
                },
            )
        ),
    ),
    TinyCase(
        "phi3-longrope-short-sliding-window-16-untied",
        Phi3Config(
            **tiny(
                tie_word_embeddings=False,
                sliding_window=16,
                original_max_position_embeddings=512,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "short_factor": SHORT_FACTORS,
                    "long_factor": LONG_FACTORS,
                },
            )
        ),
    ),
]
