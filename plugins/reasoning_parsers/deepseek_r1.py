"""DeepSeek-R1's thinking (and its distillations', QwQ's): `<think>…</think>` before
the answer. Its template ends the prompt with `<think>\n`, so the model may not write
the start marker; it always thinks, so the output starts in reasoning whatever the
prompt holds, and an output without `</think>` is all reasoning."""

from __future__ import annotations

from plugserve import hookimpl
from plugserve.interfaces.reasoning import ThinkingMarkersParser


class DeepSeekR1ReasoningParser(ThinkingMarkersParser):
    start_marker = "<think>"
    end_marker = "</think>"

    def opens_reasoning(self, prompt_tail: str) -> bool:
        return True


@hookimpl
def register_reasoning_parsers(register):
    register("deepseek_r1", DeepSeekR1ReasoningParser)
