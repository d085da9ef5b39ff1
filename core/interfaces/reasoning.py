"""API-server side: the reasoning-parser slot. A reasoning model writes its thinking
between two markers before the answer; the parser splits a choice's output into the two,
tells the engine which ids end the thinking (so that a grammar applies to the answer
only, and a thinking budget can force the end), and says whether the output starts
inside the thinking at all (a template may have closed it in the prompt).

`ThinkingMarkersParser` implements the slot for any pair of text markers; a parser for
a model family usually only names its markers and, where the template decides, whether
the prompt leaves the thinking open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

# How many of the prompt's last tokens are decoded to see whether the template closed
# the thinking already: enough for an empty thinking block and a turn header.
_PROMPT_TAIL_TOKENS = 32


@runtime_checkable
class ReasoningParser(Protocol):
    """Splits one choice's output into reasoning and answer. Built once per choice with
    the served tokenizer and the prompt's token ids, so it may keep streaming state."""

    def __init__(self, *, tokenizer: Any, prompt_token_ids: Sequence[int]) -> None: ...

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether the output opens with reasoning; False where the prompt already
        closed it (Qwen3's template with `enable_thinking: false`): then all of the
        output is the answer and the engine is told nothing."""
        ...

    @property
    def end_token_ids(self) -> list[int]:
        """The ids the engine recognizes as the end of the reasoning, and forces when a
        thinking budget runs out: the end marker's own id where it is one token,
        else its tokenization."""
        ...

    @property
    def end_text(self) -> str | None:
        """Where the end marker is not one token: its text, which the engine then finds
        in the output's text, as the parser does (whatever tokens spell it); None where
        the engine finds `end_token_ids`."""
        ...

    def extract_reasoning(
        self, text: str, token_ids: Sequence[int]
    ) -> tuple[str | None, str | None]:
        """The whole output at once: (reasoning, answer). The reasoning is None when the
        output does not start in it; the answer None when the reasoning never ended
        (the output was cut short inside it)."""
        ...

    def extract_reasoning_streaming(
        self, delta_text: str, delta_token_ids: Sequence[int]
    ) -> tuple[str, str]:
        """Streamed: feed the new text and the ids that brought it; returns (reasoning
        text, answer text) to show now. Text that may be part of a marker is held back
        until it is known."""
        ...

    def finish_streaming(self) -> tuple[str, str]:
        """Streamed: the output ended. Returns what was held back, as (reasoning, answer)."""
        ...


class ThinkingMarkersParser:
    """The reasoning is the text between `start_marker` (which the model may write or
    the template may already have written) and `end_marker`; the answer follows, its
    leading whitespace dropped. Where a marker is a token of its own in the vocabulary
    its id is found among the output ids, even when the detokenized text leaves it out
    (a special token with `skip_special_tokens`); otherwise the marker is found in the
    text. Subclasses set the markers and may override `opens_reasoning`."""

    start_marker = "<think>"
    end_marker = "</think>"

    def __init__(self, *, tokenizer: Any, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.start_id = _single_token_id(tokenizer, self.start_marker)
        self.end_id = _single_token_id(tokenizer, self.end_marker)
        tail = tokenizer.decode(
            list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False
        )
        self._starts = self.opens_reasoning(tail)
        # "start": the output may still begin with the start marker, to be dropped;
        # "reasoning", "answer_start" (leading whitespace dropped), "answer".
        self._state = "start" if self._starts else "answer"
        self._held = ""

    def opens_reasoning(self, prompt_tail: str) -> bool:
        """Whether the output starts in reasoning, given the prompt's last text (special
        tokens written out). Default: yes, unless the prompt ends with the end marker
        (an empty thinking block the template wrote to turn thinking off)."""
        return not prompt_tail.rstrip().endswith(self.end_marker)

    @property
    def starts_in_reasoning(self) -> bool:
        return self._starts

    @property
    def end_token_ids(self) -> list[int]:
        if self.end_id is not None:
            return [self.end_id]
        return list(self.tokenizer.encode(self.end_marker, add_special_tokens=False))

    @property
    def end_text(self) -> str | None:
        return None if self.end_id is not None else self.end_marker

    # ------------------------------------------------------------------ parsing

    def extract_reasoning(
        self, text: str, token_ids: Sequence[int]
    ) -> tuple[str | None, str | None]:
        if not self._starts:
            return None, text
        reasoning, answer = self.extract_reasoning_streaming(text, token_ids)
        more_reasoning, more_answer = self.finish_streaming()
        if self._state in ("start", "reasoning"):
            return reasoning + more_reasoning, None
        return reasoning + more_reasoning, answer + more_answer

    def extract_reasoning_streaming(
        self, delta_text: str, delta_token_ids: Sequence[int]
    ) -> tuple[str, str]:
        if self._state == "answer":
            return "", delta_text
        if self._state == "answer_start":
            return "", self._answer(delta_text)
        text = self._held + delta_text
        self._held = ""
        if self._state == "start":
            text = self._drop_start_marker(text, delta_token_ids)
            if self._state == "start":  # still undecided: all of it may be the marker
                self._held = text
                return "", ""
        cut = self._end_marker_cut(text, delta_token_ids)
        if cut is not None:
            before, after = cut
            self._state = "answer_start"
            return before, self._answer(after)
        if self.end_id is not None:  # the marker comes as its id, never in pieces
            return text, ""
        keep = _partial_suffix(text, self.end_marker)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish_streaming(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state in ("start", "reasoning"):
            return held, ""
        return "", held

    # ------------------------------------------------------------------ helpers

    def _drop_start_marker(self, text: str, token_ids: Sequence[int]) -> str:
        """At the very start of the output: drop the start marker (and the whitespace
        before it) if the model writes it; decide once the text shows either way."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_marker):
            self._state = "reasoning"
            return stripped[len(self.start_marker) :]
        if self.start_id is not None and self.start_id in token_ids:
            # A start token the text left out (special): drop what came before it.
            self._state = "reasoning"
            index = list(token_ids).index(self.start_id)
            before = self.tokenizer.decode(list(token_ids[:index]), skip_special_tokens=True)
            return text[len(before) :] if not before.strip() else text
        if not stripped or (self.start_id is None and self.start_marker.startswith(stripped)):
            return text
        self._state = "reasoning"
        return text

    def _end_marker_cut(self, text: str, token_ids: Sequence[int]) -> tuple[str, str] | None:
        """(reasoning, after) if the end marker is in this text."""
        if self.end_id is not None:
            if self.end_id not in token_ids:
                return None
            at = text.find(self.end_marker)
            if at >= 0:
                return text[:at], text[at + len(self.end_marker) :]
            # The marker's text was left out (a special token): split where its id falls.
            index = list(token_ids).index(self.end_id)
            before = self.tokenizer.decode(list(token_ids[:index]), skip_special_tokens=True)
            at = min(len(before), len(text))
            return text[:at], text[at:]
        at = text.find(self.end_marker)
        if at < 0:
            return None
        return text[:at], text[at + len(self.end_marker) :]

    def _answer(self, text: str) -> str:
        if self._state == "answer_start":
            text = text.lstrip()
            if text:
                self._state = "answer"
        return text


def _single_token_id(tokenizer: Any, marker: str) -> int | None:
    """The marker's id where the vocabulary holds it as one token, else None."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (a marker that may
    still be arriving)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
