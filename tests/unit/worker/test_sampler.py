"""Specification of the sampler (phase 8): penalties, greedy, temperature, min_p, top_k,
top_p, seeded sampling and logprobs.

Also the grammar bitmask the model runner applies before sampling, and the token edits
(allowed_token_ids, bad words, logit_bias). Sampling many times is done by repeating one
row of logits across a large batch, which is a single vectorized call.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from plugserve.datatypes import Logprobs, NewRequestData
from plugserve.sampling_params import SamplingParams
from plugserve.worker.input_batch import InputBatch
from plugserve.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_grammar_bitmask,
    apply_penalties,
    make_padded_token_tensor,
)

VOCAB = 1000

sampler = Sampler()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def random_logits(num_rows: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab) * 3.0


def logits_from_probs(probs: list[float], num_rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().repeat(num_rows, 1)


def metadata(
    params: list[SamplingParams],
    vocab: int = VOCAB,
    generators: dict[int, torch.Generator] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """The sampler's inputs as the model runner builds them: from a persistent batch that
    holds one request per row. `generators` replaces a seeded row's generator, so a test
    can carry one generator across steps as the engine does."""
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    batch = InputBatch(
        max_num_reqs=len(params),
        max_model_len=max(len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)) + 1,
        max_blocks_per_req=1,
        device=torch.device(device),
    )
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        batch.add_request(
            NewRequestData(
                req_id=str(row),
                prompt_token_ids=list(prompt),
                output_token_ids=list(output),
                sampling_params=p,
                block_ids=[],
                num_computed_tokens=0,
            )
        )
    for row, gen in (generators or {}).items():
        batch.generators[str(row)] = gen
    return batch.sampling_metadata(np.arange(len(params)), vocab)


def sample(
    logits: torch.Tensor, params: SamplingParams | list[SamplingParams], **kw
) -> torch.Tensor:
    if isinstance(params, SamplingParams):
        params = [params] * logits.shape[0]
    md = metadata(params, vocab=logits.shape[-1], **kw)
    return sampler(logits, md).sampled_token_ids


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- metadata --------------------------------------------------------------------------


def test_metadata_turns_on_only_what_some_row_uses() -> None:
    md = metadata([SamplingParams(temperature=0.0), SamplingParams()])
    assert not md.all_greedy and not md.all_random
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert not md.uses_penalties and md.output_token_ids is None
    assert md.max_num_logprobs is None

    md = metadata(
        [
            SamplingParams(top_k=5, logprobs=3),
            SamplingParams(top_p=0.9, min_p=0.1, logprobs=0, repetition_penalty=1.2),
        ],
        prompts=[[1, 2, 3], [4]],
        outputs=[[5], []],
    )
    assert md.all_random
    assert md.top_k is not None and md.top_k.tolist() == [5, 0]
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert md.min_p is not None and md.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert md.repetition_penalties is not None
    assert md.prompt_token_ids is not None
    assert md.prompt_token_ids.tolist() == [[1, 2, 3], [4, VOCAB, VOCAB]]
    assert md.output_token_ids is not None
    assert md.output_token_ids.tolist() == [[5], [VOCAB]]
    assert md.max_num_logprobs == 3


def test_metadata_knows_the_largest_top_k_on_the_host() -> None:
    """The sampler sizes its topk from it: no device-to-host read of the k tensor."""
    md = metadata(
        [
            SamplingParams(top_k=7),
            SamplingParams(top_k=3),
            SamplingParams(top_k=VOCAB + 5),  # beyond the vocabulary: disabled
            SamplingParams(temperature=0.0, top_k=50),  # greedy: its k does not count
            SamplingParams(),
        ]
    )
    assert md.max_top_k == 7
    assert metadata([SamplingParams(top_p=0.5)]).max_top_k == 1


def test_filters_of_greedy_rows_are_ignored() -> None:
    md = metadata([SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)])
    assert md.all_greedy
    assert md.top_k is None and md.top_p is None and md.min_p is None


def test_make_padded_token_tensor() -> None:
    rows = [[3, 1], np.array([7, 8, 9]), []]
    padded = make_padded_token_tensor(rows, pad=99)
    assert padded.dtype == torch.int64
    assert padded.tolist() == [[3, 1, 99], [7, 8, 9], [99, 99, 99]]
    assert make_padded_token_tensor([[], []], pad=99).shape == (2, 0)


# --- greedy ----------------------------------------------------------------------------


def test_greedy_picks_argmax() -> None:
    logits = random_logits(8)
    sampled = sample(logits, SamplingParams(temperature=0.0))
    assert sampled.dtype == torch.int64
    assert torch.equal(sampled, logits.argmax(dim=-1))


def test_temperature_below_epsilon_is_greedy() -> None:
    logits = random_logits(8)
    sampled = sample(logits, SamplingParams(temperature=1e-6))
    assert torch.equal(sampled, logits.argmax(dim=-1))


def test_low_temperature_concentrates_on_argmax() -> None:
    logits = random_logits(64)
    # A clear gap to the runner-up, so at T = 1e-3 it has odds of about e^-1000.
    logits[torch.arange(64), logits.argmax(dim=-1)] += 1.0
    sampled = sample(logits, SamplingParams(temperature=1e-3))
    assert torch.equal(sampled, logits.argmax(dim=-1))


def test_zero_temperature_flagged_random_stays_finite() -> None:
    # A caller that flags every row random (say, comparing with == 0.0) while one row
    # has temperature 0 still gets that row's argmax rather than NaN noise.
    logits = random_logits(4)
    logits[torch.arange(4), logits.argmax(dim=-1)] += 1.0
    md = SamplingMetadata(temperature=torch.zeros(4), all_greedy=False, all_random=True)
    assert torch.equal(sampler(logits, md).sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(64)
    sampled = sample(logits, SamplingParams(temperature=1.0, top_k=1))
    assert torch.equal(sampled, logits.argmax(dim=-1))


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(4)
    before = logits.clone()
    sample(
        logits,
        SamplingParams(top_k=5, top_p=0.8, min_p=0.1, temperature=0.7, repetition_penalty=1.5),
        outputs=[[1, 2]] * 4,
        prompts=[[3]] * 4,
    )
    assert torch.equal(logits, before)


def test_bfloat16_logits() -> None:
    logits = random_logits(8).to(torch.bfloat16)
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0)), logits.argmax(dim=-1))
    nucleus = logits_from_probs([0.06, 0.4, 0.04, 0.3, 0.2], 1000).to(torch.bfloat16)
    assert set(sample(nucleus, SamplingParams(top_p=0.75)).tolist()) == {1, 3, 4}


# --- random sampling: distribution and filters -----------------------------------------


def chi_square(sampled: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(sampled, minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.float64) * sampled.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 3 degrees of freedom.
CHI2_3DOF_999 = 16.27


def test_frequencies_match_softmax() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    sampled = sample(logits_from_probs(probs, 20_000), SamplingParams(temperature=1.0))
    assert chi_square(sampled, probs) < CHI2_3DOF_999


def test_temperature_scales_logits() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    temperature = 2.0
    tempered = [p ** (1 / temperature) for p in probs]
    expected = [t / sum(tempered) for t in tempered]
    sampled = sample(logits_from_probs(probs, 20_000), SamplingParams(temperature=temperature))
    assert chi_square(sampled, expected) < CHI2_3DOF_999


def test_top_k_keeps_only_the_k_best() -> None:
    row = random_logits(1)
    sampled = sample(row.repeat(4000, 1), SamplingParams(top_k=5))
    assert set(sampled.tolist()) == set(row[0].topk(5).indices.tolist())


def test_top_k_beyond_vocab_is_disabled() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    sampled = sample(logits_from_probs(probs, 20_000), SamplingParams(top_k=10))
    assert chi_square(sampled, probs) < CHI2_3DOF_999


def test_top_k_rows_are_independent() -> None:
    row = random_logits(1)
    logits = row.repeat(2000, 1)
    params = [SamplingParams(top_k=2), SamplingParams()] * 1000
    sampled = sample(logits, params)
    assert set(sampled[0::2].tolist()) == set(row[0].topk(2).indices.tolist())
    assert len(set(sampled[1::2].tolist())) > 10


def test_top_p_keeps_the_nucleus() -> None:
    probs = [0.06, 0.4, 0.04, 0.3, 0.2]
    logits = logits_from_probs(probs, 4000)
    # 0.4 + 0.3 = 0.7 < 0.75, so the nucleus needs the 0.2 token too.
    sampled = sample(logits, SamplingParams(top_p=0.75))
    assert set(sampled.tolist()) == {1, 3, 4}
    # The kept tokens are renormalized: 0.4/0.9, 0.3/0.9, 0.2/0.9.
    counts = torch.bincount(sampled, minlength=5).double() / sampled.numel()
    assert counts[[1, 3, 4]].tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9], abs=0.03)


def test_top_p_always_keeps_the_top_token() -> None:
    logits = logits_from_probs([0.06, 0.4, 0.04, 0.3, 0.2], 500)
    assert set(sample(logits, SamplingParams(top_p=0.01)).tolist()) == {1}


def test_top_p_after_top_k() -> None:
    logits = logits_from_probs([0.06, 0.4, 0.04, 0.3, 0.2], 4000)
    # top_k=3 leaves {0.4, 0.3, 0.2}; renormalized 0.44 + 0.33 >= 0.7 is the nucleus.
    sampled = sample(logits, SamplingParams(top_k=3, top_p=0.7))
    assert set(sampled.tolist()) == {1, 3}


def test_top_p_disabled_rows_sample_everything() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = logits_from_probs(probs, 8000)
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)] * 4000
    sampled = sample(logits, params)
    assert set(sampled[0::2].tolist()) == {2, 3}
    assert chi_square(sampled[1::2], probs) < CHI2_3DOF_999


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    probs = [0.08, 0.5, 0.3, 0.12]
    logits = logits_from_probs(probs, 4000)
    # min_p × max prob = 0.2 × 0.5 = 0.1: only the 0.08 token goes.
    assert set(sample(logits, SamplingParams(min_p=0.2)).tolist()) == {1, 2, 3}
    # 0.5 × 0.5 = 0.25: the 0.12 token goes too.
    assert set(sample(logits, SamplingParams(min_p=0.5)).tolist()) == {1, 2}


def test_min_p_applies_after_temperature() -> None:
    probs = [0.08, 0.5, 0.3, 0.12]
    logits = logits_from_probs(probs, 4000)
    # At temperature 2 the probabilities go as sqrt(p): 0.08 → 0.283, 0.5 → 0.707, so
    # 0.08 survives min_p = 0.35 (0.283 / 0.707 = 0.4) although it would not at T = 1.
    sampled = sample(logits, SamplingParams(min_p=0.35, temperature=2.0))
    assert set(sampled.tolist()) == {0, 1, 2, 3}


# --- seeds -----------------------------------------------------------------------------


def run_steps(
    rows: torch.Tensor, seeded_row: int, seed: int, steps: int = 5, temperature: float = 1.0
) -> list[int]:
    """Sample `steps` times and return the seeded row's tokens."""
    gen = generator(seed)
    params = [SamplingParams(temperature=temperature)] * rows.shape[0]
    params[seeded_row] = SamplingParams(temperature=temperature, seed=seed)
    tokens = []
    for _ in range(steps):
        md = metadata(params, generators={seeded_row: gen})
        tokens.append(int(sampler(rows, md).sampled_token_ids[seeded_row]))
    return tokens


def test_seeded_row_is_reproducible() -> None:
    row = random_logits(1)
    batch = torch.cat([random_logits(1), row, random_logits(1)])
    first = run_steps(batch, seeded_row=1, seed=1234)
    torch.manual_seed(99)  # the global RNG state must not matter
    assert run_steps(batch, seeded_row=1, seed=1234) == first
    assert run_steps(batch, seeded_row=1, seed=4321) != first


def test_seeded_row_ignores_its_batch_mates() -> None:
    row = random_logits(1)
    alone = run_steps(row, seeded_row=0, seed=7)
    small = run_steps(torch.cat([row, random_logits(2)]), seeded_row=0, seed=7)
    large = run_steps(torch.cat([random_logits(3), row, random_logits(2)]), seeded_row=3, seed=7)
    assert alone == small == large


def test_seeded_rows_in_mixed_greedy_batch() -> None:
    row = random_logits(1)
    alone = run_steps(row, seeded_row=0, seed=7)
    batch = torch.cat([random_logits(2), row])
    gen = generator(7)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=7)]
    tokens = []
    for _ in range(len(alone)):
        sampled = sampler(batch, metadata(params, generators={2: gen})).sampled_token_ids
        assert int(sampled[0]) == int(batch[0].argmax())
        tokens.append(int(sampled[2]))
    assert tokens == alone


def test_unseeded_rows_follow_the_global_rng() -> None:
    logits = random_logits(64)
    params = SamplingParams()
    torch.manual_seed(1)
    a = sample(logits, params)
    torch.manual_seed(2)
    b = sample(logits, params)
    torch.manual_seed(1)
    c = sample(logits, params)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


# --- penalties -------------------------------------------------------------------------


def penalized(
    logits: list[float],
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
) -> list[float]:
    md = metadata([params], vocab=len(logits), prompts=[prompt], outputs=[output])
    return apply_penalties(torch.tensor([logits]), md)[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = [2.0, -1.0, 0.5, 1.5]
    out = penalized(logits, SamplingParams(repetition_penalty=2.0), prompt=[1], output=[0, 0])
    # Token 0 (output) 2.0 / 2, token 1 (prompt) -1.0 × 2; unseen tokens unchanged and
    # repeats count once.
    assert out == [1.0, -2.0, 0.5, 1.5]


def test_frequency_penalty_scales_with_count() -> None:
    logits = [2.0, -1.0, 0.5, 1.5]
    out = penalized(logits, SamplingParams(frequency_penalty=0.5), prompt=[3], output=[0, 0, 2])
    # The prompt is not penalized; 0 appeared twice, 2 once.
    assert out == [1.0, -1.0, 0.0, 1.5]


def test_presence_penalty_applies_once() -> None:
    logits = [2.0, -1.0, 0.5, 1.5]
    out = penalized(logits, SamplingParams(presence_penalty=0.5), prompt=[3], output=[0, 0, 2])
    assert out == [1.5, -1.0, 0.0, 1.5]


def test_penalties_combine_repetition_first() -> None:
    logits = [2.0, -1.0, 0.5, 1.5]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    out = penalized(logits, params, prompt=[1, 3], output=[0, 0, 2])
    expected = [
        2.0 / 2 - 0.25 * 2 - 0.5,
        -1.0 * 2,
        0.5 / 2 - 0.25 - 0.5,
        1.5 / 2,
    ]
    assert out == pytest.approx(expected)


def test_penalties_are_per_row_and_padding_is_ignored() -> None:
    vocab = 4
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5]] * 3)
    params = [
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(),  # no penalty: unchanged despite its history
        SamplingParams(repetition_penalty=2.0),
    ]
    md = metadata(
        params, vocab=vocab, prompts=[[], [0, 1, 2, 3], [3]], outputs=[[0, 0, 0], [1], []]
    )
    assert md.output_token_ids is not None and md.output_token_ids.shape == (3, 3)
    out = apply_penalties(logits.clone(), md)
    assert out.tolist() == [
        [-1.0, -1.0, 0.5, 1.5],
        [2.0, -1.0, 0.5, 1.5],
        [2.0, -1.0, 0.5, 0.75],
    ]


def test_penalties_flip_the_greedy_pick() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5]] * 3)
    greedy = SamplingParams(temperature=0.0)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 2.0 → 1.0 < 1.5
        SamplingParams(temperature=0.0, presence_penalty=0.6),  # 2.0 → 1.4 < 1.5
        greedy,
    ]
    sampled = sample(logits, params, prompts=[[0]] * 3, outputs=[[0], [0], [0]])
    assert sampled.tolist() == [3, 3, 0]


def test_penalties_apply_before_sampling_random_rows() -> None:
    # Token 0 would take nearly all the mass without the penalties.
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]] * 500)
    sampled = sample(
        logits,
        SamplingParams(repetition_penalty=2.0, frequency_penalty=2.0),
        prompts=[[0]] * 500,
        outputs=[[0, 0]] * 500,
    )
    # 10 / 2 - 2 × 2 = 1: token 0 keeps e / (e + 3) ≈ 0.48 of the mass.
    share = (sampled == 0).double().mean().item()
    assert share == pytest.approx(math.e / (math.e + 3), abs=0.08)


# --- logprobs --------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(6)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, top_k=50, logprobs=2),
        SamplingParams(temperature=1.3, repetition_penalty=1.5, logprobs=None),
    ] * 2
    md = metadata(params, prompts=[[1, 2]] * 6, outputs=[[3]] * 6)
    out = sampler(logits, md)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    expected_top = torch.topk(raw, 5, dim=-1)
    torch.testing.assert_close(out.logprobs.top_logprobs, expected_top.values)
    assert torch.equal(out.logprobs.top_token_ids, expected_top.indices)

    sampled = out.sampled_token_ids
    expected_sampled = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs.sampled_logprobs, expected_sampled)
    # Rank: 1 + the number of tokens strictly more likely than the sampled one.
    order = raw.argsort(dim=-1, descending=True)
    expected_rank = (order == sampled.unsqueeze(1)).int().argmax(dim=-1) + 1
    assert torch.equal(out.logprobs.sampled_ranks, expected_rank)
    assert out.logprobs.sampled_ranks[0].item() == 1  # greedy, no penalty

    per_row = out.logprobs.to_logprobs([p.logprobs for p in params])
    first = per_row[0]
    assert isinstance(first, Logprobs)
    assert first.sampled_rank == 1 and first.top_token_ids[0] == sampled[0].item()
    assert len(first.top_token_ids) == len(first.top_logprobs) == 5
    assert per_row[1] is not None and len(per_row[1].top_token_ids) == 2
    assert per_row[2] is None


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = random_logits(3)
    out = sampler(logits, metadata([SamplingParams(logprobs=0)] * 3))
    assert out.logprobs is not None
    assert out.logprobs.top_token_ids.shape == (3, 0)
    assert out.logprobs.top_logprobs.shape == (3, 0)
    assert out.logprobs.sampled_logprobs.shape == (3,)
    expected = torch.log_softmax(logits, dim=-1).gather(1, out.sampled_token_ids.unsqueeze(1))
    torch.testing.assert_close(out.logprobs.sampled_logprobs, expected.squeeze(1))
    entry = out.logprobs.to_logprobs([0, 0, 0])[0]
    assert entry is not None and entry.top_token_ids == [] and entry.top_logprobs == []


def test_no_logprobs_requested() -> None:
    assert sampler(random_logits(2), metadata([SamplingParams()] * 2)).logprobs is None


# --- mixed batches ---------------------------------------------------------------------


def test_mixed_greedy_and_random_batch() -> None:
    # Flat logits: random rows almost never hit the argmax, greedy rows always do.
    logits = torch.randn(200, VOCAB) * 0.1
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 100
    sampled = sample(logits, params)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sampled[0::2], argmax[0::2])
    assert (sampled[1::2] != argmax[1::2]).sum() > 90


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_semantics() -> None:
    device = torch.device("cuda")
    probs = [0.06, 0.4, 0.04, 0.3, 0.2]
    logits = logits_from_probs(probs, 4000).to(device)
    params = [SamplingParams(top_p=0.75, seed=5 if i == 0 else None) for i in range(4000)]
    gens = {0: torch.Generator(device=device).manual_seed(5)}
    md = metadata(params, vocab=5, device=device, generators=gens)
    out = sampler(logits, md).sampled_token_ids
    assert out.device.type == "cuda"
    assert set(out.tolist()) == {1, 3, 4}

    penalty_params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2)] * 2
    md = metadata(penalty_params, vocab=5, device=device, prompts=[[1], [3]], outputs=[[], []])
    # Logits are log-probs, all negative: the penalty multiplies. Row 0 loses token 1
    # (0.4 → 0.16 < 0.3); row 1 only penalizes token 3 and keeps token 1.
    out = sampler(logits[:2], md)
    assert out.sampled_token_ids.tolist() == [3, 1]
    assert out.logprobs is not None
    assert out.logprobs.top_token_ids.tolist() == [[1, 3], [1, 3]]


# --- grammar bitmask -------------------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"
))]  # fmt: skip


def bitmask(allowed: list[set[int]], vocab: int = VOCAB) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)]: bit j of word w set = token 32 * w + j allowed."""
    bools = np.zeros((len(allowed), -(-vocab // 32) * 32), dtype=np.bool_)
    for row, tokens in enumerate(allowed):
        bools[row, sorted(tokens)] = True
    return np.packbits(bools, axis=1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_grammar_bitmask_masks_exactly_its_rows(device: str) -> None:
    logits = random_logits(4).to(device)
    before = logits.clone()
    allowed = [{3, 31, 32, 999}, {0, 500}]
    apply_grammar_bitmask(logits, [3, 1], bitmask(allowed))
    # Rows without a grammar: untouched, bit for bit.
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, tokens in zip([3, 1], allowed, strict=True):
        kept = logits[row].isfinite().nonzero().flatten().tolist()
        assert kept == sorted(tokens)
        assert torch.equal(logits[row, kept], before[row, kept])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_sampled_rows_pick_only_allowed_tokens(device: str) -> None:
    logits = torch.zeros(400, VOCAB, device=device)  # flat: every token equally likely
    allowed = [{7, 8, 9}] * 400
    apply_grammar_bitmask(logits, list(range(400)), bitmask(allowed))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 200
    sampled = sample(logits, params, device=device).tolist()
    assert set(sampled) == {7, 8, 9}


def test_grammar_bitmask_over_every_row_in_order() -> None:
    logits = random_logits(2)
    before = logits.clone()
    allowed = [{1, 33, 998}, set(range(40, 80))]
    apply_grammar_bitmask(logits, [0, 1], bitmask(allowed))
    for row, tokens in enumerate(allowed):
        kept = logits[row].isfinite().nonzero().flatten().tolist()
        assert kept == sorted(tokens)
        assert torch.equal(logits[row, kept], before[row, kept])


def test_tokens_past_the_bitmask_width_are_never_allowed() -> None:
    logits = random_logits(1, vocab=70)
    allowed = bitmask([set(range(64))], vocab=64)  # two words for a 70-wide vocabulary
    apply_grammar_bitmask(logits, [0], allowed)
    assert logits[0, 64:].isneginf().all() and logits[0, :64].isfinite().all()


# --- allowed_token_ids, bad words, logit_bias ------------------------------------------


def test_metadata_builds_token_edits_only_for_rows_that_use_them() -> None:
    md = metadata([SamplingParams(), SamplingParams(temperature=0.0)])
    assert md.disallowed is None and md.bad_words is None and md.logit_bias is None
    assert not md.edits_logits and not md.reads_output

    md = metadata(
        [SamplingParams(allowed_token_ids=[4, 5]), SamplingParams(logit_bias={9: 2.5})],
    )
    assert md.disallowed is not None and md.logit_bias is not None and md.bad_words is None
    assert md.disallowed[0].logical_not().nonzero().flatten().tolist() == [4, 5]
    assert not md.disallowed[1].any()
    assert md.logit_bias.rows.tolist() == [1] and md.logit_bias.token_ids.tolist() == [9]
    assert not md.reads_output  # reusable while the batch stays the same


def test_logit_bias_of_minus_100_on_the_greedy_token_changes_it() -> None:
    logits = random_logits(2)
    top = int(logits[0].argmax())
    runner_up = int(logits[0].topk(2).indices[1])
    params = [
        SamplingParams(temperature=0.0, logit_bias={top: -100.0}),
        SamplingParams(temperature=0.0),
    ]
    sampled = sample(logits, params).tolist()
    assert sampled == [runner_up, int(logits[1].argmax())]
    # A large positive bias makes a token the greedy pick.
    boosted = sample(logits[:1], SamplingParams(temperature=0.0, logit_bias={17: 100.0}))
    assert boosted.tolist() == [17]


def test_allowed_token_ids_restrict_greedy_and_sampled_rows() -> None:
    logits = random_logits(1).repeat(300, 1)
    allowed = [11, 222, 333]
    best_allowed = max(allowed, key=lambda t: float(logits[0, t]))
    params = (
        [SamplingParams(temperature=0.0, allowed_token_ids=allowed)]
        + [SamplingParams(temperature=5.0, allowed_token_ids=allowed)] * 298
        + [SamplingParams(temperature=0.0)]
    )
    sampled = sample(logits, params).tolist()
    assert sampled[0] == best_allowed
    assert set(sampled[1:-1]) == set(allowed)
    assert sampled[-1] == int(logits[0].argmax())  # the unrestricted row


def test_bad_words_ban_the_token_that_would_complete_one() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 40] = 5.0  # the greedy pick, unless banned
    logits[:, 41] = 4.0
    bad = [[40]]  # one token: always banned
    assert sample(
        logits[:1], SamplingParams(temperature=0.0, bad_words_token_ids=bad)
    ).tolist() == [41]
    # [7, 40]: 40 is banned only right after a 7 in the output.
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[7, 40]])
    sampled = sample(logits, [params] * 3, prompts=[[7], [1], [1]], outputs=[[], [7], [7, 8]])
    assert sampled.tolist() == [40, 41, 40]
    md = metadata([params], outputs=[[1]])
    assert md.bad_words is not None and md.reads_output  # rebuilt every step
