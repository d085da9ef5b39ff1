"""truncate_prompt_tokens as a tokenizer truncates: the special tokens around a prompt
stay, the text between them is cut on the tokenizer's truncation side; a tokenizer that
adds none (a decoder's) cuts the prompt itself."""

from __future__ import annotations

import pytest

from plugserve.prompt_truncation import PromptTruncation

CLS, SEP = 101, 102
BERT_LIKE = PromptTruncation(prefix=(CLS,), suffix=(SEP,), num_pair_special_tokens=3)


def test_the_special_tokens_stay_and_the_text_is_cut_on_the_truncation_side():
    prompt = [CLS, 5, 6, 7, 8, SEP]
    assert BERT_LIKE.truncate(prompt, 4) == [CLS, 5, 6, SEP]
    left = PromptTruncation(prefix=(CLS,), suffix=(SEP,), side="left")
    assert left.truncate(prompt, 4) == [CLS, 7, 8, SEP]
    assert BERT_LIKE.truncate(prompt, 6) == prompt  # short enough: untouched


def test_ids_without_the_special_tokens_are_cut_as_they_are():
    assert BERT_LIKE.truncate([5, 6, 7, 8], 2) == [5, 6]
    assert BERT_LIKE.truncate([CLS, 5, 6, 7], 3) == [CLS, 5, 6]  # no [SEP] at the end
    assert PromptTruncation().truncate([5, 6, 7, 8], 3) == [5, 6, 7]


def test_no_room_besides_the_special_tokens_is_refused():
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(2\) .* at least 3"):
        BERT_LIKE.truncate([CLS, 5, 6, SEP], 2)
    with pytest.raises(ValueError, match=r"both texts of a pair .* at least 5"):
        BERT_LIKE.check_pair(4)
    BERT_LIKE.check_pair(5)


def test_read_from_the_tokenizers_of_the_embedded_models(smollm2_path):
    from transformers import AutoTokenizer

    from plugserve.model_files import resolve_model_path

    minilm = AutoTokenizer.from_pretrained(str(resolve_model_path("all-minilm-l6-v2")))
    assert PromptTruncation.of_tokenizer(minilm) == PromptTruncation(
        prefix=(minilm.cls_token_id,), suffix=(minilm.sep_token_id,), num_pair_special_tokens=3
    )
    smollm2 = AutoTokenizer.from_pretrained(str(smollm2_path))
    assert PromptTruncation.of_tokenizer(smollm2) == PromptTruncation()
