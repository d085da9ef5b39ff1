"""One chat choice's output as its reasoning and its answer: with the stack's reasoning
parser, the text before the end of the thinking is the message's `reasoning_content`
(and `reasoning`, the name current vLLM uses), and only the answer after it reaches the
tool-call shaping of tool_calls.py, so a tool parser or a forced call reads the answer
alone, from the same boundary the engine's grammar starts at."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plugserve.frontend.routes.chat.tool_calls import ChoiceOutput, Delta
from plugserve.interfaces.reasoning import ReasoningParser


def reasoning_fields(text: str) -> dict[str, str]:
    """The message (or delta) fields that carry reasoning text, under both names."""
    return {"reasoning_content": text, "reasoning": text}


class ReasoningThenAnswer:
    """Splits the output with `parser` (None: all of it is the answer) and shapes the
    answer with `answer`. Non-streamed, `final`; streamed, `feed` and `finish` give the
    chunks' `delta` objects in order, reasoning deltas first."""

    def __init__(self, answer: ChoiceOutput, parser: ReasoningParser | None) -> None:
        self.answer = answer
        self.parser = parser
        self.reasoning: str | None = None  # of a finished non-streamed output
        self._answer_started = parser is None or not parser.starts_in_reasoning

    @property
    def num_calls(self) -> int:
        return self.answer.num_calls

    def final(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, list[dict[str, Any]]]:
        if self.parser is None:
            return self.answer.final(text)
        self.reasoning, content = self.parser.extract_reasoning(text, token_ids)
        if content is None:  # cut short while thinking: no answer, no calls
            return None, []
        return self.answer.final(content)

    def feed(self, text: str, token_ids: Sequence[int]) -> list[Delta]:
        if self.parser is None:
            return self.answer.feed(text)
        reasoning, content = self.parser.extract_reasoning_streaming(text, token_ids)
        return self._deltas(reasoning, content)

    def finish(self) -> list[Delta]:
        if self.parser is None:
            return self.answer.finish()
        deltas = self._deltas(*self.parser.finish_streaming())
        if self._answer_started:
            deltas += self.answer.finish()
        return deltas

    def _deltas(self, reasoning: str, content: str) -> list[Delta]:
        deltas: list[Delta] = [reasoning_fields(reasoning)] if reasoning else []
        if content:
            self._answer_started = True
            deltas += self.answer.feed(content)
        return deltas
