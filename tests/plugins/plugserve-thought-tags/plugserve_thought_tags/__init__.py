"""A reasoning parser for models that think between `<thought>` and `</thought>` and
whose template leaves the thinking for the model to open: the output starts in reasoning
unless the prompt's generation prompt already closed a thought (an empty
`<thought></thought>` written to turn thinking off)."""

from __future__ import annotations

from plugserve import hookimpl
from plugserve.interfaces.reasoning import ThinkingMarkersParser


class ThoughtTagsParser(ThinkingMarkersParser):
    start_marker = "<thought>"
    end_marker = "</thought>"


@hookimpl
def register_reasoning_parsers(register):
    register("thought_tags", ThoughtTagsParser)
