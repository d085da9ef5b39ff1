"""Pipeline parallelism end to end, against the in-process engine on the same tiny
checkpoint: on the mp executor, two stages of two tensor-parallel ranks each (four worker
processes), the layers split by pp_layer_partition, in fp32 (the same tokens, logprobs
within the single-process tolerance; constrained requests valid), and two stages in
bf16, held to the project's bf16 agreement criterion (tests/correctness/agreement.py);
on the Ray executor, over the session's two-node local cluster, two stages of two ranks,
one stage per node, in fp32. Every family's split is proven in
test_architectures_match_hf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from correctness.agreement import NEAR_TIE
from correctness.tiny_checkpoints import (
    FP32_TP_LOGPROB_TOLERANCE,
    TinyRun,
    tiny,
    write_tiny_checkpoint,
)
from plugserve import SamplingParams
from plugserve.sampling_params import StructuredOutputsParams

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory, tiny_tokenizer, tiny_prompts) -> TinyRun:
    """An untied 3-layer Llama: stages of one and two layers by pp_layer_partition."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama-3-layers")
    config = LlamaConfig(**tiny(num_hidden_layers=3, tie_word_embeddings=False))
    write_tiny_checkpoint(config, Path(folder), tiny_tokenizer)
    return TinyRun(str(folder), tiny_prompts, references=[])


@pytest.fixture(scope="module")
def uni_fp32(three_layers) -> list:
    return generate(three_layers, 0, executor="uni")


def assert_same(staged: list, alone: list) -> None:
    for mine, theirs in zip(staged, alone, strict=True):
        assert mine.token_ids == theirs.token_ids
        for token, lp, reference in zip(
            mine.token_ids, mine.logprobs, theirs.logprobs, strict=True
        ):
            assert abs(lp[token].logprob - reference[token].logprob) <= FP32_TP_LOGPROB_TOLERANCE


# A constraint the tiny model ends within a few tokens: its bitmask travels with the
# batch (StageCommand) to the last stage, which alone samples.
ANSWER = SamplingParams(
    temperature=0.0,
    max_tokens=NEW_TOKENS,
    structured_outputs=StructuredOutputsParams(json=json.dumps({"enum": ["yes", "no"]})),
)


def generate(
    run: TinyRun,
    logprobs: int,
    constrained: list | None = None,
    counts: list | None = None,
    **engine,
) -> list:
    """Every prompt's greedy continuation; with `constrained`, also each prompt under
    ANSWER, appended to it; with `counts`, the executor's MessageCounts at the end."""
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs
    )
    requests = [{"prompt_token_ids": p} for p in run.prompts]
    with run.llm(**engine) as llm:
        outputs = llm.generate(requests, params)
        if constrained is not None:
            constrained += [o.outputs[0] for o in llm.generate(requests, ANSWER)]
        if counts is not None:
            counts.append(llm.engine.executor.message_counts())
        return [o.outputs[0] for o in outputs]


def test_two_stages_of_two_tensor_parallel_ranks_match_one_process(three_layers, uni_fp32) -> None:
    """Each batch, prefill chunks included, is one command to each of the four ranks and
    one reply from the last stage's first, and in each batch that computes, each of
    stage 0's two ranks sends its activations and its busy seconds to its peer of
    stage 1."""
    answers: list = []
    counted: list = []
    tp_pp = generate(
        three_layers,
        0,
        answers,
        counted,
        executor="mp",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pp_layer_partition=[1, 2],
        num_threads=1,
    )
    assert_same(tp_pp, uni_fp32)
    [counts] = counted
    assert counts.batches > 0
    assert (counts.commands, counts.replies) == (4 * counts.batches, counts.batches)
    # A batch that schedules no token (it only frees finished requests) sends nothing.
    assert counts.stage_sends % 4 == 0
    assert 0 < counts.stage_sends <= 4 * counts.batches
    for answer in answers:
        assert json.loads(answer.text) in ("yes", "no") and answer.finish_reason == "stop"


def test_two_stages_in_bf16_follow_one_process(three_layers) -> None:
    """bf16: a stage runs its layers one by one where one process may run the whole
    stack fused, so sums may round apart; greedy tokens may then part only where the
    one process's two best tokens are a near-tie by the bf16 criterion."""
    uni = generate(three_layers, 2, executor="uni", dtype="bfloat16")
    staged = generate(
        three_layers, 2, executor="mp", pipeline_parallel_size=2, num_threads=1, dtype="bfloat16"
    )
    for alone, pp in zip(uni, staged, strict=True):
        parted = next(
            (
                i
                for i, (a, b) in enumerate(zip(alone.token_ids, pp.token_ids, strict=False))
                if a != b
            ),
            None,
        )
        if parted is None:
            continue
        best, runner_up = sorted(alone.logprobs[parted].values(), key=lambda lp: -lp.logprob)[:2]
        assert pp.token_ids[parted] in alone.logprobs[parted], (alone.token_ids, pp.token_ids)
        assert best.logprob - runner_up.logprob <= NEAR_TIE, (parted, best, runner_up)


@pytest.mark.ray
def test_on_ray_two_stages_of_two_ranks_one_stage_per_node_match_one_process(
    three_layers, uni_fp32, ray_cluster
) -> None:
    """The Ray executor's actors on the two-node cluster, TP=2 x PP=2: a stage's two
    ranks on one node (its bundle), the stages on the two nodes (SPREAD), the
    activations crossing between nodes. (PP=2 alone on Ray serves a plugin-matrix cell.)"""
    import ray

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    engine = dict(tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition=[2, 1])
    with three_layers.llm(executor="ray", num_threads=1, **engine) as llm:
        actors = llm.engine.executor._actors
        nodes = ray.get([actor.node_id.remote() for actor in actors])
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3], "a stage's ranks span nodes"
        assert nodes[0] != nodes[2], "the two stages share a node"
        outputs = llm.generate([{"prompt_token_ids": p} for p in three_layers.prompts], params)
    assert_same([o.outputs[0] for o in outputs], uni_fp32)
