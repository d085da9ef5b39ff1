"""Specification of the bundled reasoning parsers (the `reasoning_parser` slot), on the
embedded model's tokenizer with the thinking markers added as special tokens (each one
id, left out of the text by `skip_special_tokens`) and without them (each marker several
ordinary tokens, found in the text).

A parser gives the same split whether it sees the output at once or streamed in pieces
of any size; a reasoning the output never closes stays reasoning; a prompt whose template
closed the thinking (`enable_thinking: false`) makes the whole output the answer, except
for DeepSeek-R1, which always thinks.
"""

from __future__ import annotations

from typing import Any

import pytest
from reasoning_checkpoint import reasoning_tokenizer

from plugserve.interfaces.reasoning import ReasoningParser
from plugserve.plugins import get_registry

REASONING = "\nThe user wants JSON, so {not json yet: 6 * 7 < 50\n"
ANSWER = '{"answer": 42}'
OUTPUT = f"<think>{REASONING}</think>\n\n{ANSWER}"
PIECE_SIZES = (1, 2, 3, 5, 8, 13, 100, 1000)


@pytest.fixture(scope="module", params=["special", "text"])
def tokenizer(request: pytest.FixtureRequest, smollm2_path: Any) -> Any:
    return reasoning_tokenizer(smollm2_path, markers=request.param)


def prompt(tokenizer: Any, **template_kwargs: Any) -> list[int]:
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def parser(tokenizer: Any, name: str = "qwen3", **template_kwargs: Any) -> ReasoningParser:
    cls = get_registry().get("reasoning_parser", name)
    built = cls(tokenizer=tokenizer, prompt_token_ids=prompt(tokenizer, **template_kwargs))
    assert isinstance(built, ReasoningParser)
    return built


def streamed(tokenizer: Any, p: ReasoningParser, token_ids: list[int], size: int) -> tuple:
    """Feed the output as a server streams it: ids in groups, each group's text as the
    detokenizer gives it (special tokens skipped), regrouped into pieces of `size`
    characters where the markers are text (ids then do not matter)."""
    reasoning, answer = [], []
    if (
        p.end_token_ids == tokenizer.encode("</think>", add_special_tokens=False)
        and len(p.end_token_ids) > 1
    ):
        text = tokenizer.decode(token_ids)
        pieces = [(text[i : i + size], []) for i in range(0, len(text), size)]
    else:
        pieces = [
            (tokenizer.decode(token_ids[i : i + size], skip_special_tokens=True),
             token_ids[i : i + size])
            for i in range(0, len(token_ids), size)
        ]  # fmt: skip
    for text, ids in pieces:
        r, a = p.extract_reasoning_streaming(text, ids)
        reasoning.append(r)
        answer.append(a)
    r, a = p.finish_streaming()
    return "".join(reasoning) + r, "".join(answer) + a


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_the_output_splits_into_reasoning_and_answer_at_once_and_streamed(
    tokenizer: Any, name: str
) -> None:
    token_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert parser(tokenizer, name).extract_reasoning(text, token_ids) == (REASONING, ANSWER)
    for size in PIECE_SIZES:
        got = streamed(tokenizer, parser(tokenizer, name), token_ids, size)
        assert got == (REASONING, ANSWER), f"pieces of {size}"


def test_the_end_marker_is_one_id_where_it_is_a_token_else_its_tokenization(
    tokenizer: Any,
) -> None:
    ids = tokenizer.encode("</think>", add_special_tokens=False)
    assert parser(tokenizer).end_token_ids == ids
    is_special = "</think>" in tokenizer.all_special_tokens
    assert len(ids) == 1 if is_special else len(ids) > 1
    # A marker that is text the engine finds by its text, as the parser does.
    assert parser(tokenizer).end_text == (None if is_special else "</think>")


def test_a_reasoning_that_never_closes_stays_reasoning(tokenizer: Any) -> None:
    cut = "<think>" + REASONING + "and so</thi"  # max_tokens came first
    token_ids = tokenizer.encode(cut, add_special_tokens=False)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    expected = REASONING + "and so</thi"
    assert parser(tokenizer).extract_reasoning(text, token_ids) == (expected, None)
    for size in PIECE_SIZES:
        assert streamed(tokenizer, parser(tokenizer), token_ids, size) == (expected, "")


def test_without_the_start_marker_the_output_still_starts_in_reasoning(tokenizer: Any) -> None:
    token_ids = tokenizer.encode(REASONING + "</think>" + ANSWER, add_special_tokens=False)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert parser(tokenizer).extract_reasoning(text, token_ids) == (REASONING, ANSWER)


def test_thinking_turned_off_by_the_template_makes_it_all_answer(tokenizer: Any) -> None:
    off = parser(tokenizer, enable_thinking=False)
    assert not off.starts_in_reasoning
    token_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert off.extract_reasoning(ANSWER, token_ids) == (None, ANSWER)
    assert off.extract_reasoning_streaming(ANSWER, token_ids) == ("", ANSWER)
    assert parser(tokenizer, enable_thinking=True).starts_in_reasoning
    # DeepSeek-R1 always thinks, whatever the prompt holds.
    assert parser(tokenizer, "deepseek_r1", enable_thinking=False).starts_in_reasoning
