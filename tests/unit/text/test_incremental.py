"""The `incremental` detokenizer against the real SmolLM2 tokenizer (byte-level BPE).

Streaming a request must give exactly the text of one full decode, never half a
character, and stop strings must cut the text where the params say, whatever way the
text was split into tokens and updates.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from plugserve.interfaces.frontend import Detokenizer
from plugserve.sampling_params import SamplingParams
from plugserve_plugins.text.incremental import IncrementalDetokenizer, register_detokenizers

REPLACEMENT = "\ufffd"

SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3.14, isn't it?",
    "accented": "Ça coûte 5€ à Zürich — déjà vu, naïve façade, señor.",
    "cjk": "北京是中国的首都。你好，世界！这是一个测试。",
    "emoji": "So 😀😀 fun 🎉 — family: 👨‍👩‍👧, flags 🇫🇷🇯🇵.",
    "code": "def f(x):\n    if x:\n        return  x  +  1\n\treturn None  # done\n",
    "mixed": "naïve 日本語 🦀 code:\n    pass\n",
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Say something."}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def make(tokenizer: Any, prompt: list[int] | None = None, **params: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tokenizer=tokenizer, prompt_token_ids=prompt or [], params=SamplingParams(**params)
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ids `chunk` at a time, then flush; check the deltas/output_text invariant."""
    deltas: list[str] = []
    for start in range(0, len(ids), chunk):
        deltas.append(detok.update(ids[start : start + chunk]))
        assert "".join(deltas) == detok.output_text
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text
    return deltas


# --------------------------------------------------------------------------- contract


def test_is_a_detokenizer_and_registers_as_incremental(tokenizer: Any) -> None:
    assert isinstance(make(tokenizer), Detokenizer)
    registered: dict[str, type] = {}
    register_detokenizers(register=registered.__setitem__)
    assert registered == {"incremental": IncrementalDetokenizer}


def test_the_samples_split_characters_across_tokens(tokenizer: Any) -> None:
    # Guards the tests below: they only prove something if characters really are split.
    for name in ("accented", "cjk", "emoji"):
        pieces = [tokenizer.decode([i]) for i in encode(tokenizer, SAMPLES[name])]
        assert any(REPLACEMENT in piece for piece in pieces), name


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", list(SAMPLES))
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("with_prompt", [True, False])
def test_streamed_text_equals_a_full_decode(
    tokenizer: Any, chat_prompt: list[int], name: str, chunk: int, with_prompt: bool
) -> None:
    ids = encode(tokenizer, SAMPLES[name])
    detok = make(tokenizer, chat_prompt if with_prompt else None)
    deltas = stream(detok, ids, chunk)

    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.output_text == SAMPLES[name]
    assert not any(REPLACEMENT in delta for delta in deltas)
    # Valid text with no stop strings holds nothing back at the end.
    assert deltas[-1] == ""
    assert detok.stop_reason is None


class DecodeOnly:
    """A tokenizer seen only through `decode`, as a slow (pure-Python) one is: the
    detokenizer then cannot take the fast tokenizer's Rust decode directly."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip", [True, False])
def test_a_tokenizer_without_a_rust_backend_streams_the_same_text(
    tokenizer: Any, chat_prompt: list[int], skip: bool
) -> None:
    ids = [*encode(tokenizer, SAMPLES["mixed"]), tokenizer.eos_token_id]
    fast = make(tokenizer, chat_prompt, skip_special_tokens=skip)
    slow = make(DecodeOnly(tokenizer), chat_prompt, skip_special_tokens=skip)
    assert fast._backend_decode is not None and slow._backend_decode is None
    assert stream(slow, ids) == stream(fast, ids)
    assert slow.output_text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_characters_are_released_as_soon_as_they_are_complete(tokenizer: Any) -> None:
    ids = encode(tokenizer, SAMPLES["emoji"])
    detok = make(tokenizer)
    for k, token_id in enumerate(ids, start=1):
        delta = detok.update([token_id])
        assert REPLACEMENT not in delta
        so_far = tokenizer.decode(ids[:k])
        assert so_far.startswith(detok.output_text)
        if not so_far.endswith(REPLACEMENT):
            assert detok.output_text == so_far


def test_the_first_token_keeps_its_leading_space(tokenizer: Any, chat_prompt: list[int]) -> None:
    ids = encode(tokenizer, " leading space, then more")
    detok = make(tokenizer, chat_prompt)
    assert detok.update(ids[:1]) == " leading"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept_per_param(
    tokenizer: Any, chat_prompt: list[int], skip: bool
) -> None:
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    ids = [*encode(tokenizer, "Hi there"), eos, *encode(tokenizer, "\nnext 🎉"), bos, eos]
    detok = make(tokenizer, chat_prompt, skip_special_tokens=skip)
    stream(detok, ids)

    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    if skip:
        assert detok.output_text == "Hi there\nnext 🎉"
    else:
        assert detok.output_text == "Hi there<|im_end|>\nnext 🎉<|im_start|><|im_end|>"


def test_an_incomplete_character_at_the_end_is_flushed_like_a_full_decode(
    tokenizer: Any,
) -> None:
    partial = encode(tokenizer, "北京")[0]
    assert tokenizer.decode([partial]).endswith(REPLACEMENT)
    ids = [*encode(tokenizer, "Hello"), partial]
    detok = make(tokenizer)

    assert detok.update(ids[:1]) == "Hello"
    assert detok.update(ids[1:]) == ""
    assert detok.flush() == tokenizer.decode([partial])
    assert detok.output_text == tokenizer.decode(ids)
    assert detok.finished


def test_random_byte_soup_streams_to_the_full_decode(tokenizer: Any) -> None:
    # Byte tokens in random order make invalid UTF-8 too; replacement characters must
    # still land exactly where a full decode puts them.
    byte_tokens = [
        i for i in range(1, 2000) if REPLACEMENT in tokenizer.decode([i])
    ] or pytest.fail("no byte tokens in the vocabulary")
    word_tokens = encode(tokenizer, SAMPLES["english"] + SAMPLES["cjk"])
    rng = random.Random(1234)
    for _ in range(100):
        ids = [rng.choice(byte_tokens if rng.random() < 0.6 else word_tokens) for _ in range(25)]
        detok = make(tokenizer)
        stream(detok, ids, chunk=rng.choice([1, 2, 5]))
        assert detok.output_text == tokenizer.decode(ids), ids


def test_invalid_utf8_streams_before_the_request_ends(tokenizer: Any) -> None:
    # A model can emit byte tokens that never form characters (a stray continuation byte
    # after another). Such text must stream as it comes, minus the last few U+FFFD that
    # might still complete a character, not all at once at the end.
    stray_byte = next(i for i in range(1, 2000) if tokenizer.decode([i] * 20) == REPLACEMENT * 20)
    ids = [stray_byte] * 20
    detok = make(tokenizer)
    deltas = [detok.update([i]) for i in ids]
    assert "".join(deltas) == REPLACEMENT * 17  # all but three released while streaming
    assert deltas[10] == REPLACEMENT
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids)


def test_ids_after_flush_are_ignored(tokenizer: Any) -> None:
    detok = make(tokenizer)
    stream(detok, encode(tokenizer, "Done."))
    assert detok.update(encode(tokenizer, " More")) == ""
    assert detok.flush() == ""
    assert detok.output_text == "Done."


def test_empty_updates_are_harmless(tokenizer: Any) -> None:
    detok = make(tokenizer)
    assert detok.update([]) == ""
    assert detok.update(encode(tokenizer, "Hi")) == "Hi"
    assert detok.update([]) == ""
    assert detok.num_output_tokens == 1


# --------------------------------------------------------------------------- stop strings


ANSWER = "The answer is 42. Done."  # tokens: The| answer| is| |4|2|.| Done|.


@pytest.mark.parametrize(
    ("include", "expected"), [(False, "The answer is "), (True, "The answer is 42.")]
)
def test_a_stop_string_split_across_tokens_cuts_the_text(
    tokenizer: Any, include: bool, expected: str
) -> None:
    ids = encode(tokenizer, ANSWER)
    assert not any("42." in tokenizer.decode([i]) for i in ids), "stop must span tokens"
    detok = make(tokenizer, stop=["42."], include_stop_str_in_output=include)

    deltas: list[str] = []
    for k, token_id in enumerate(ids):
        deltas.append(detok.update([token_id]))
        # It fires on the token that completes it ('.'), not before.
        assert detok.finished == (tokenizer.decode(ids[: k + 1]).count("42.") > 0)
    assert detok.stop_reason == "42."
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.flush() == ""
    assert detok.update(encode(tokenizer, " again 42.")) == ""
    assert detok.output_text == expected


@pytest.mark.parametrize("chunk", [1, 2, 100])
@pytest.mark.parametrize(
    ("stops", "expected", "reason"),
    [
        (["Done", "answer", "is 42"], "The ", "answer"),
        (["is 42", "Done", "answer"], "The ", "answer"),
        # Earliest is by where a match completes: "is" completes before "answer is 42".
        (["answer is 42", "is"], "The answer ", "is"),
        # Completing together, the longer (earlier starting) match wins.
        (["42.", "2."], "The answer is ", "42."),
    ],
)
def test_with_several_stop_strings_the_earliest_wins(
    tokenizer: Any, chunk: int, stops: list[str], expected: str, reason: str
) -> None:
    detok = make(tokenizer, stop=stops)
    deltas = stream(detok, encode(tokenizer, ANSWER), chunk)
    assert detok.output_text == expected
    assert detok.stop_reason == reason
    assert "".join(deltas) == expected


def test_a_stop_string_inside_multibyte_text(tokenizer: Any) -> None:
    detok = make(tokenizer, stop=["首都"])
    deltas = stream(detok, encode(tokenizer, SAMPLES["cjk"]))
    assert detok.output_text == "北京是中国的"
    assert detok.stop_reason == "首都"
    assert not any(REPLACEMENT in delta for delta in deltas)


def test_a_possible_stop_string_is_held_back_and_flushed_at_the_end(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello STOP")  # Hello| ST|OP
    detok = make(tokenizer, stop=["STOP!"])
    assert detok.update(ids[:1]) == "Hello"
    assert detok.update(ids[1:2]) == " "
    assert detok.output_text == "Hello "
    assert detok.update(ids[2:]) == ""
    assert detok.flush() == "STOP"
    assert detok.output_text == "Hello STOP"
    assert detok.stop_reason is None


def test_held_back_text_is_released_once_it_cannot_become_a_stop_string(
    tokenizer: Any,
) -> None:
    ids = encode(tokenizer, "Hello STOP")  # Hello| ST|OP
    detok = make(tokenizer, stop=["ST!"])
    assert detok.update(ids[:2]) == "Hello "
    assert detok.update(ids[2:]) == "STOP"
    assert detok.flush() == ""


def test_a_multi_token_stop_string_streams_the_text_before_it(tokenizer: Any) -> None:
    ids = encode(tokenizer, "The sky is blue.\n\nUser: hi")  # ... blue|.|\n|\n|User|:| hi
    detok = make(tokenizer, stop=["\n\nUser:"])
    text_after = [(detok.update([i]), detok.output_text)[1] for i in ids]
    assert text_after[4] == "The sky is blue."
    assert text_after[5] == "The sky is blue."  # "\n" held back
    assert detok.output_text == "The sky is blue."
    assert detok.stop_reason == "\n\nUser:"


def test_include_stop_str_in_output_holds_nothing_back(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello STOP")
    detok = make(tokenizer, stop=["STOP!"], include_stop_str_in_output=True)
    assert detok.update(ids[:2]) == "Hello ST"
    assert detok.update(ids[2:]) == "OP"
    assert detok.flush() == ""


def test_stop_strings_wait_for_min_tokens(tokenizer: Any) -> None:
    ids = encode(tokenizer, ANSWER)  # the first '.' is token 7, the second token 9
    detok = make(tokenizer, stop=["."], min_tokens=8)
    stream(detok, ids)
    assert detok.output_text == "The answer is 42. Done"
    assert detok.stop_reason == "."


def test_a_stop_string_completed_before_min_tokens_does_not_fire_later(tokenizer: Any) -> None:
    # "is" completes on token 3, inside min_tokens; only the later "is 4" may stop.
    detok = make(tokenizer, stop=["is", "is 4"], min_tokens=3)
    stream(detok, encode(tokenizer, ANSWER))
    assert detok.output_text == "The answer "
    assert detok.stop_reason == "is 4"


def test_empty_stop_strings_are_ignored(tokenizer: Any) -> None:
    detok = make(tokenizer, stop=[""])
    stream(detok, encode(tokenizer, ANSWER))
    assert detok.output_text == ANSWER
    assert detok.stop_reason is None


def test_a_stop_string_found_at_flush_still_cuts(tokenizer: Any) -> None:
    # This token is a space plus the first bytes of the emoji: held as incomplete until
    # flush forces it out, and the space in it must still be checked against the stops.
    space_and_partial = encode(tokenizer, " 😀")[0]
    piece = tokenizer.decode([space_and_partial])
    assert piece.startswith(" ") and piece.endswith(REPLACEMENT)
    ids = [*encode(tokenizer, "So"), space_and_partial]
    detok = make(tokenizer, stop=[" "])
    assert detok.update(ids[:1]) == "So"
    assert detok.update(ids[1:]) == ""
    assert detok.flush() == ""
    assert detok.output_text == "So"
    assert detok.stop_reason == " "
