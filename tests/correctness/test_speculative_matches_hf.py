"""Speculative decoding changes how many tokens a pass lands, never which: greedy
continuations with each bundled proposer equal transformers' token for token (fp32, a
tiny Llama checkpoint), batched and one request at a time, with chunked prefill (the
step's budget is CHUNK_TOKENS) and preemptions forced; with `ngram` and `draft_model`,
also over TP_SIZE tensor-parallel workers, and the logprobs of the accepted tokens equal those of the same
engine without speculation.

`draft_model` drafts with the checkpoint itself (every draft accepted, several tokens a
pass) and with a different model of its vocabulary (the checkpoint with one layer fewer
and its weights disturbed: some drafts accepted, some not), which keeps a KV cache of
another shape beside the target's.

The tiny checkpoint's random weights make its greedy continuations fall into repeating
runs, which the n-gram proposer predicts: drafts are accepted in full, in part and not
at all, so every path of the verification runs (the tests check the counters say so).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import LlamaConfig

from correctness.tiny_checkpoints import (
    FP32_TP_LOGPROB_TOLERANCE,
    NEW_TOKENS,
    TinyRun,
    hf_references,
    tiny,
    write_tiny_checkpoint,
)
from plugserve import LLM, SamplingParams
from plugserve.sampling_params import StructuredOutputsParams

PROPOSER_OPTIONS = {
    # Single-token matches too: the random model's runs are short.
    "ngram": {"min_n": 1, "max_n": 3},
    "suffix": {"max_depth": 4, "min_confidence": 0.3},
}


def speculating(proposer: str) -> dict:
    return {
        "speculative": {"proposer": proposer, "num_tokens": 3},
        f"plugins.{proposer}": PROPOSER_OPTIONS[proposer],
    }


SPECULATIVE = speculating("ngram")
# The logprob of a token verified among 1 + drafts query rows against the same token
# decoded alone: the same fp32 arithmetic but for the matmuls' and attention's summation
# order over more rows (measured: at most 2e-6 nats on this checkpoint).
SAME_ENGINE_LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, tiny_tokenizer, tiny_prompts) -> TinyRun:
    folder = write_tiny_checkpoint(
        LlamaConfig(**tiny(tie_word_embeddings=True)),
        tmp_path_factory.mktemp("llama"),
        tiny_tokenizer,
    )
    return TinyRun(str(folder), tiny_prompts, hf_references(folder, tiny_prompts))


def assert_every_kind_of_verdict(llm: LLM) -> None:
    """Drafts of several tokens were proposed; some were accepted whole, some not."""
    assert llm.engine.speculation is not None
    stats = llm.engine.speculation.stats
    assert stats.num_draft_tokens > stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[-1] > 0  # whole drafts accepted
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


def check_batched_under_preemption_then_alone(
    run: TinyRun, speculation: dict, check_verdicts: Callable[[LLM], None]
) -> int:
    """Every prompt in one batch that the KV cache cannot hold at once, then one at a time
    with the prefix cache emptied: transformers' tokens both ways, every block free
    between. `check_verdicts` holds the batch's draft counters; returns the steps the
    one-at-a-time pass took."""
    # 12 blocks of 16 tokens hold the longest request (100 + 24 tokens) but not all seven
    # at once: the batched run preempts.
    with run.llm(num_kv_blocks=12, **speculation) as llm:
        run.check(llm, batched=True)
        assert llm.engine.scheduler.num_preemptions > 0
        check_verdicts(llm)
        kv = llm.engine.scheduler.kv
        assert kv.stats().num_free_blocks == kv.stats().num_blocks
        assert kv.reset_prefix_cache()
        before = llm.engine.timer.num_steps
        run.check(llm, batched=False)
        return llm.engine.timer.num_steps - before


@pytest.mark.parametrize("proposer", sorted(PROPOSER_OPTIONS))
def test_batched_under_preemption_and_alone_match_transformers(
    llama_run: TinyRun, proposer: str
) -> None:
    check_batched_under_preemption_then_alone(
        llama_run, speculating(proposer), assert_every_kind_of_verdict
    )


def test_tensor_parallel_workers_match_transformers(llama_run: TinyRun) -> None:
    with llama_run.tensor_parallel_llm(**SPECULATIVE) as llm:
        llama_run.check(llm, batched=True, tolerance=FP32_TP_LOGPROB_TOLERANCE)
        assert_every_kind_of_verdict(llm)


# ---------------------------------------------------------------- draft_model


def drafting_with(model: str) -> dict:
    return {
        "speculative": {"proposer": "draft_model", "num_tokens": 3},
        "plugins.draft_model": {"model": model},
    }


# The disturbance added to the draft's weights: the target's own weights are drawn with a
# standard deviation of 0.1.
DRAFT_NOISE_STD = 0.03


@pytest.fixture(scope="module")
def other_draft(llama_run: TinyRun, tmp_path_factory) -> str:
    """The checkpoint with its last layer dropped and noise added to every weight: a
    different model of the same vocabulary, which often guesses the target's tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        llama_run.model, dtype=torch.float32, num_hidden_layers=1
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * DRAFT_NOISE_STD)
    folder = tmp_path_factory.mktemp("draft")
    model.save_pretrained(str(folder))
    return str(folder)


def assert_every_draft_accepted(llm: LLM) -> None:
    stats = llm.engine.speculation.stats
    assert 0 < stats.num_drafts < stats.num_draft_tokens == stats.num_accepted_tokens


def test_the_target_drafting_for_itself_has_every_draft_accepted(llama_run: TinyRun) -> None:
    steps = check_batched_under_preemption_then_alone(
        llama_run, drafting_with(llama_run.model), assert_every_draft_accepted
    )
    # One request at a time, a pass without speculation lands one token: NEW_TOKENS
    # passes a request at least. Here a decoding pass lands its token and three drafts.
    assert steps < len(llama_run.prompts) * NEW_TOKENS / 2


def test_every_tensor_parallel_rank_runs_the_draft(llama_run: TinyRun) -> None:
    """Each rank holds its shard of the draft and of its KV cache; the driver's guesses
    are shared, so every rank feeds the draft's next pass the same tokens."""
    with llama_run.tensor_parallel_llm(**drafting_with(llama_run.model)) as llm:
        llama_run.check(llm, batched=True, tolerance=FP32_TP_LOGPROB_TOLERANCE)
        assert_every_draft_accepted(llm)


def test_another_draft_model_changes_no_token(llama_run: TinyRun, other_draft: str) -> None:
    check_batched_under_preemption_then_alone(
        llama_run, drafting_with(other_draft), assert_every_kind_of_verdict
    )


def test_a_draft_of_another_vocabulary_is_refused(llama_run: TinyRun, tmp_path_factory) -> None:
    # Refused by its config alone, before any weight is read.
    folder = tmp_path_factory.mktemp("vocab")
    LlamaConfig(**tiny(vocab_size=1000)).save_pretrained(str(folder))
    refusal = "vocabulary of 1000 tokens, the served model 49152"
    with pytest.raises(ValueError, match=refusal), llama_run.llm(**drafting_with(str(folder))):
        pass


def continuations(llm: LLM, run: TinyRun) -> Iterator[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    for output in llm.generate([{"prompt_token_ids": p} for p in run.prompts], params):
        completion = output.outputs[0]
        assert completion.logprobs is not None
        yield (
            completion.token_ids,
            [
                lp[t].logprob
                for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
            ],
        )


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(llama_run: TinyRun) -> None:
    with llama_run.llm() as llm:
        plain = list(continuations(llm, llama_run))
    with llama_run.llm(**SPECULATIVE) as llm:
        speculated = list(continuations(llm, llama_run))
    largest = 0.0
    for (tokens, logprobs), (spec_tokens, spec_logprobs) in zip(plain, speculated, strict=True):
        assert spec_tokens == tokens
        largest = max(largest, *(abs(a - b) for a, b in zip(logprobs, spec_logprobs, strict=True)))
    assert largest <= SAME_ENGINE_LOGPROB_TOLERANCE
    print(f"largest logprob difference, speculated vs not: {largest:.1e}")


# ---------------------------------------------------------------- request options


PROMPT = {"prompt_token_ids": list(range(1000, 1012))}
DIGITS = r"(\d\d, ){5}\d\d"
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def plain_and_speculative(llama_run: TinyRun) -> Iterator[tuple[LLM, LLM]]:
    """The checkpoint without and with speculation, both with a small token budget."""
    with llama_run.llm() as plain, llama_run.llm(**SPECULATIVE) as speculative:
        yield plain, speculative


def texts_and_reasons(llm: LLM, params: SamplingParams) -> list[tuple[list[int], str, str | None]]:
    return [
        (c.token_ids, c.text, c.finish_reason)
        for output in llm.generate([PROMPT], params)
        for c in output.outputs
    ]


def test_stops_inside_a_draft_end_where_they_end_without_speculation(plain_and_speculative):
    plain, speculative = plain_and_speculative
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    [(tokens, text, _)] = texts_and_reasons(plain, greedy)
    # A token of the repeating run the drafts predict: with min_tokens the stop falls in
    # the middle of an accepted draft.
    run_token = max(set(tokens), key=tokens.count)
    first_in_run = tokens.index(run_token)
    cases = [
        SamplingParams(
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            stop_token_ids=[run_token],
            min_tokens=first_in_run + 2,
        ),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[text[len(text) // 2 :][:3]]),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2),
    ]
    before = speculative.engine.speculation.stats.num_accepted_tokens
    for params in cases:
        expected = texts_and_reasons(plain, params)
        assert texts_and_reasons(speculative, params) == expected
        assert all(reason == ("length" if params.n > 1 else "stop") for *_, reason in expected)
    assert speculative.engine.speculation.stats.num_accepted_tokens > before


def test_structured_output_validates_and_stops(plain_and_speculative):
    """(The backends' rollback itself: tests/unit/structured_output/test_backends.py.)"""
    plain, speculative = plain_and_speculative
    stats = speculative.engine.speculation.stats
    before = stats.num_draft_tokens
    for constraint in (
        StructuredOutputsParams(regex=DIGITS),
        StructuredOutputsParams(choice=CHOICES),
    ):
        params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
        [(tokens, text, reason)] = texts_and_reasons(speculative, params)
        assert reason == "stop"
        assert re.fullmatch(DIGITS, text) or text in CHOICES, text
        # Each position's bitmask was built with the drafts before it accepted.
        assert [(tokens, text, reason)] == texts_and_reasons(plain, params)
    assert stats.num_draft_tokens > before
