"""The bundled tool parsers (`tool_choice: "auto"`) on model text in each family's
format: what a non-streamed response gets, and that streaming the same text in pieces of
any size yields the same content and the same calls, with no call text leaking into the
content."""

from __future__ import annotations

import json

import pytest

from plugserve.interfaces.frontend import ExtractedToolCalls, ToolCall, ToolParser
from plugserve.plugins import get_registry

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# Outputs as Qwen2.5-Instruct (Hermes format) writes them.
HERMES_ONE_CALL = (
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"city": "Dallas", "unit": "fahrenheit"}}\n'
    "</tool_call>"
)
HERMES_TEXT_AND_TWO_CALLS = (
    "I'll check both cities.\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n'
    "</tool_call>"
)
# Outputs as Llama 3.1 / 3.2 Instruct write them (the tag only with special tokens kept).
LLAMA_ONE_CALL = (
    '{"name": "get_current_weather", "parameters": {"city": "Dallas", "unit": "fahrenheit"}}'
)
LLAMA_TAGGED_TWO_CALLS = (
    '<|python_tag|>{"name": "get_current_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_current_weather", "parameters": {"city": "Rome"}}'
)
PLAIN = "The weather in Paris is usually mild in spring. {not a call}"


def parser(name: str) -> ToolParser:
    cls = get_registry().get("tool_parser", name)
    obj = cls(tokenizer=None, tools=TOOLS)
    assert isinstance(obj, ToolParser)
    return obj


def streamed(name: str, text: str, piece: int) -> tuple[str, list[ToolCall]]:
    p = parser(name)
    content, calls = [], []
    for i in range(0, len(text), piece):
        shown, new = p.extract_tool_calls_streaming(text[i : i + piece])
        content.append(shown)
        calls += new
    shown, new = p.finish_streaming()
    return "".join(content) + shown, calls + new


def call(city: str, unit: str | None = None) -> ToolCall:
    arguments = {"city": city} if unit is None else {"city": city, "unit": unit}
    return ToolCall("get_current_weather", json.dumps(arguments, ensure_ascii=False))


CASES = [
    ("hermes", HERMES_ONE_CALL, ExtractedToolCalls(None, [call("Dallas", "fahrenheit")])),
    (
        "hermes",
        HERMES_TEXT_AND_TWO_CALLS,
        ExtractedToolCalls(
            "I'll check both cities.", [call("Paris"), call("Zürich", "celsius")]
        ),
    ),
    ("hermes", PLAIN, ExtractedToolCalls(PLAIN, [])),
    # A call that does not parse stays in the content as written.
    ("hermes", "<tool_call>{oops</tool_call> done", ExtractedToolCalls("<tool_call>{oops</tool_call> done", [])),
    # The model stopped before closing the tag: the JSON is complete, so it is a call.
    ("hermes", HERMES_ONE_CALL.removesuffix("</tool_call>"), ExtractedToolCalls(None, [call("Dallas", "fahrenheit")])),
    ("llama3_json", LLAMA_ONE_CALL, ExtractedToolCalls(None, [call("Dallas", "fahrenheit")])),
    ("llama3_json", LLAMA_TAGGED_TWO_CALLS, ExtractedToolCalls(None, [call("Paris"), call("Rome")])),
    ("llama3_json", PLAIN, ExtractedToolCalls(PLAIN, [])),
    ("llama3_json", '{"city": "Paris"}', ExtractedToolCalls('{"city": "Paris"}', [])),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_a_whole_output_splits_into_content_and_calls(name, text, expected):
    assert parser(name).extract_tool_calls(text) == expected


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_streaming_in_pieces_finds_the_same_calls(name, text, expected, piece):
    content, calls = streamed(name, text, piece)
    assert calls == expected.tool_calls
    # Streamed content is what the model wrote outside the calls, unstripped.
    assert content.strip() == (expected.content or "")


def test_streaming_shows_plain_text_before_the_output_ends():
    p = parser("hermes")
    shown, calls = p.extract_tool_calls_streaming("Hello there, <tool")
    assert (shown, calls) == ("Hello there, ", [])  # "<tool" may open a call: held back
    shown, calls = p.extract_tool_calls_streaming("box> is a word")
    assert (shown, calls) == ("<toolbox> is a word", [])
    q = parser("llama3_json")
    assert q.extract_tool_calls_streaming("Sunny") == ("Sunny", [])


def test_a_streamed_call_is_returned_as_soon_as_it_closes():
    p = parser("hermes")
    first = HERMES_TEXT_AND_TWO_CALLS.split("</tool_call>", 1)[0]
    _, calls = p.extract_tool_calls_streaming(first)
    assert calls == []
    _, calls = p.extract_tool_calls_streaming("</tool_call>")
    assert calls == [call("Paris")]
    q = parser("llama3_json")
    one, two = LLAMA_TAGGED_TWO_CALLS.split("; ")
    assert q.extract_tool_calls_streaming(one) == ("", [call("Paris")])
    assert q.extract_tool_calls_streaming("; " + two[:-2]) == ("", [])
    assert q.extract_tool_calls_streaming(two[-2:]) == ("", [call("Rome")])
