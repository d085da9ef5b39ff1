"""Qwen3's thinking: `<think>…</think>` before the answer, the start marker written by
the model. Its template turns thinking off (`chat_template_kwargs: {"enable_thinking":
false}`) by writing an empty `<think>\n\n</think>` block into the prompt: then the
output is all answer."""

from __future__ import annotations

from plugserve import hookimpl
from plugserve.interfaces.reasoning import ThinkingMarkersParser


class Qwen3ReasoningParser(ThinkingMarkersParser):
    start_marker = "<think>"
    end_marker = "</think>"


@hookimpl
def register_reasoning_parsers(register):
    register("qwen3", Qwen3ReasoningParser)
