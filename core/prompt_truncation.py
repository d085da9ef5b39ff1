"""truncate_prompt_tokens: a pooling prompt cut to at most k tokens the way its tokenizer
truncates (`tokenizer(text, truncation=True, max_length=k)`), as vLLM does for pooling
models and sentence-transformers does at its max_seq_length.

The special tokens the tokenizer puts around a text stay ([CLS] ... [SEP] for BERT,
whose CLS pooling reads the first; <s> ... </s> for XLM-R; a decoder embedder's end
token where its tokenizer appends one) and the text between them is cut on the
tokenizer's truncation side: "right", keeping the start (transformers' default, and
vLLM's for pooling models), unless the checkpoint's tokenizer_config.json says "left".
A prompt given as token ids is cut the same way, its special tokens kept where it starts
and ends with them. A (query, document) pair is truncated by the tokenizer itself
(longest first), as sentence-transformers' CrossEncoder does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

_PROBE = "a"


@dataclass(frozen=True)
class PromptTruncation:
    # The special tokens the tokenizer puts before and after a text.
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    side: Literal["left", "right"] = "right"
    # The special tokens it puts around a pair ([CLS] q [SEP] d [SEP]: 3).
    num_pair_special_tokens: int = 0

    @classmethod
    def of_tokenizer(cls, tokenizer: Any) -> PromptTruncation:
        """Read from a transformers tokenizer: what it adds around a probe text."""
        marked = list(tokenizer(_PROBE)["input_ids"])
        bare = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
        side: Literal["left", "right"] = "left" if tokenizer.truncation_side == "left" else "right"
        pair = int(tokenizer.num_special_tokens_to_add(pair=True))
        start = _find(marked, bare)
        if start is None:  # the specials merge with the text: nothing to keep apart
            return cls(side=side, num_pair_special_tokens=pair)
        return cls(tuple(marked[:start]), tuple(marked[start + len(bare) :]), side, pair)

    def truncate(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """`ids` cut to at most `max_tokens`; ValueError where the special tokens it keeps
        leave no room for one more."""
        if len(ids) <= max_tokens:
            return list(ids)
        head = len(self.prefix) if tuple(ids[: len(self.prefix)]) == self.prefix else 0
        tail = (
            len(self.suffix)
            if self.suffix and tuple(ids[-len(self.suffix) :]) == self.suffix
            else 0
        )
        room = max_tokens - head - tail
        if room < 1:
            raise ValueError(
                f"truncate_prompt_tokens ({max_tokens}) leaves no room besides the prompt's "
                f"{head + tail} special tokens: it must be at least {head + tail + 1}"
            )
        body = ids[head : len(ids) - tail]
        kept = body[:room] if self.side == "right" else body[len(body) - room :]
        return [*ids[:head], *kept, *ids[len(ids) - tail :]]

    def check_pair(self, max_tokens: int) -> None:
        """ValueError where a pair truncated to `max_tokens` would keep no token of one
        of its two texts."""
        least = self.num_pair_special_tokens + 2
        if max_tokens < least:
            raise ValueError(
                f"truncate_prompt_tokens ({max_tokens}) leaves no room for both texts of a "
                f"pair besides its {self.num_pair_special_tokens} special tokens: it must be "
                f"at least {least}"
            )


def _find(haystack: list[int], needle: list[int]) -> int | None:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start : start + len(needle)] == needle:
            return start
    return None
