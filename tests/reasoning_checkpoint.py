"""A tiny reasoning model for the reasoning-parser tests: a random-weights Qwen3
checkpoint (tiny_checkpoints' sizes) with a Qwen3-style chat template, whose tokenizer is
a copy of the embedded model's with the thinking markers `<think>` and `</think>`
added, as special tokens (`markers="special"`, one id each, as Qwen3's own tokenizer
has them) or not at all (`markers="text"`: each marker is several ordinary tokens).

The template writes Qwen3's turns (`<|im_start|>role\\n…<|im_end|>`), an assistant's tool
calls as Qwen3's `<tool_call>` blocks, and, with `enable_thinking` false, the empty
thinking block Qwen3's template writes to turn thinking off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from correctness.tiny_checkpoints import tiny, write_tiny_checkpoint

MARKERS = ("<think>", "</think>")

QWEN3_STYLE_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>\n{{ call.function | tojson }}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n"
    "{% endif %}"
    "{% endif %}"
)


Markers = Literal["special", "text"]


def reasoning_tokenizer(smollm2_path: Path, *, markers: Markers) -> Any:
    """The embedded model's tokenizer with the markers added (`special`) or not, and the
    Qwen3-style template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    if markers == "special":
        tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    return tokenizer


def write_reasoning_checkpoint(smollm2_path: Path, folder: Path, *, markers: Markers) -> Path:
    """The checkpoint in `folder` (made), with its tokenizer and template."""
    from transformers import Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = reasoning_tokenizer(smollm2_path, markers=markers)
    # Rows for the added ids, rounded up as checkpoints round their vocabulary.
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    write_tiny_checkpoint(Qwen3Config(**tiny(vocab_size=vocab_size)), folder, smollm2_path)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config.get("chat_template") or (folder / "chat_template.jinja").is_file()
    return folder
