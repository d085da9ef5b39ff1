"""The `mp` executor: worker processes per tensor-parallel rank over gloo, on SmolLM2.

Greedy tokens at TP=2 (uneven head shards: 6+3 query heads, 2+1 KV heads) and through
one worker at TP=1 equal the in-process executor's, with the messages of each TP=2 step
counted (two commands per rank and two replies over the pipes; per rank, an all-reduce
after the embedding and after each layer's two row-parallel projections, a logits
gather and a token broadcast), and so does a structured-output
request at TP=2 (its grammar bitmask sent to the workers with sample_tokens, applied on
the driver rank); a worker that raises or is killed
surfaces as a clear error naming it and how it ended; shutdown stops every worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from correctness.agreement import NEAR_TIE

from plugserve import LLM, SamplingParams
from plugserve.config import load_config
from plugserve.datatypes import CachedRequestData, MessageCounts, SchedulerOutput
from plugserve.sampling_params import StructuredOutputsParams
from plugserve_plugins.executors.mp import MultiprocExecutor

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press",
    "def merge_sorted(left, right):\n    result = []",
    "Mount Everest is",
]
ENGINE = dict(dtype="float32", kv_cache_memory="32MiB", max_num_seqs=8)
# A structured-output request: its grammar bitmask travels to the workers with
# sample_tokens and is applied on the driver rank, which alone holds the logits.
CONSTRAINED = SamplingParams(
    temperature=0.0,
    max_tokens=24,
    structured_outputs=StructuredOutputsParams(
        json=json.dumps(
            {
                "type": "object",
                "properties": {"height_m": {"type": "integer"}},
                "required": ["height_m"],
            }
        )
    ),
)
_UNI_CONSTRAINED: list[list[int]] = []


def generate(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def workers(llm: LLM) -> list[Any]:
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor._procs


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.fixture(scope="module")
def uni_tokens() -> list[list[int]]:
    llm = LLM(executor="uni", **ENGINE)
    try:
        tokens = generate(llm)
        _UNI_CONSTRAINED.append(llm.generate(PROMPTS[2], CONSTRAINED)[0].outputs[0].token_ids)
    finally:
        llm.engine.shutdown()
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    return tokens


def test_tp2_matches_uni_and_shuts_down(uni_tokens: list[list[int]]) -> None:
    started = time.perf_counter()
    llm = LLM(executor="mp", tensor_parallel_size=2, **ENGINE)
    print(f"TP=2 engine start: {time.perf_counter() - started:.1f} s")
    try:
        procs = workers(llm)
        for rank, proc in enumerate(procs):
            assert proc.is_alive()
            assert cmdline(proc.pid).startswith(f"plugserve::Worker_TP{rank}")
            # Forked by the engine core's fork server (the engine: here the test
            # process, offline).
            fork_server = parent_pid(proc.pid)
            assert "multiprocessing.forkserver" in cmdline(fork_server)
            assert parent_pid(fork_server) == os.getpid()
        # KV blocks are sized per rank; rank 0 holds 2 of the 3 KV heads, so the fewest
        # blocks: 32 MiB / (2 K/V × 30 layers × 16 tokens × 2 heads × 64 dims × 4 bytes).
        assert llm.engine.kv_cache_info.num_blocks == (32 << 20) // (2 * 30 * 16 * 2 * 64 * 4)
        executor = llm.engine.executor
        before = executor.message_counts()
        started = time.perf_counter()
        assert generate(llm) == uni_tokens
        print(f"TP=2 generate: {time.perf_counter() - started:.1f} s")
        counts = executor.message_counts() - before
        # The prompts prefill in one step, then decode together to MAX_TOKENS.
        assert counts.batches == MAX_TOKENS
        layers = 30
        assert counts == MessageCounts(
            batches=MAX_TOKENS,
            commands=2 * 2 * MAX_TOKENS,
            command_bytes=counts.command_bytes,
            replies=2 * MAX_TOKENS,
            reply_bytes=counts.reply_bytes,
            collectives=2 * (1 + 2 * layers + 2) * MAX_TOKENS,
            collective_bytes=counts.collective_bytes,
        )
        [constrained] = llm.generate(PROMPTS[2], CONSTRAINED)
        json.loads(constrained.outputs[0].text)
        assert constrained.outputs[0].finish_reason == "stop"
        assert [constrained.outputs[0].token_ids] == _UNI_CONSTRAINED
    finally:
        llm.engine.shutdown()
    assert [proc.exitcode for proc in procs] == [0, 0]
    with pytest.raises(RuntimeError, match="shut down"):
        generate(llm)


def test_tp2_in_bf16_runs_the_fused_cpu_layers_and_follows_uni() -> None:
    """bf16 on CPU: each rank runs FusedCpuDecoderLayer over its shard, its row-parallel
    projections summed over ranks. The sums' order differs from one rank's, so greedy
    tokens may part where uni's two best tokens are a near-tie by the bf16 criterion
    (tests/correctness/agreement.py: within a few units of a bf16 logit); there TP picks
    uni's runner-up. A broken shard or all-reduce parts where uni's choice is clear."""
    engine = {**ENGINE, "dtype": "bfloat16"}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = {}
    for name, executor in (
        ("uni", dict(executor="uni")),
        ("tp2", dict(executor="mp", tensor_parallel_size=2)),
    ):
        llm = LLM(**executor, **engine)
        try:
            outputs[name] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        finally:
            llm.engine.shutdown()
    for uni, tp2 in zip(outputs["uni"], outputs["tp2"], strict=True):
        parted = next(
            (
                i
                for i, (a, b) in enumerate(zip(uni.token_ids, tp2.token_ids, strict=True))
                if a != b
            ),
            None,
        )
        if parted is None:
            continue
        best, runner_up = sorted(uni.logprobs[parted].values(), key=lambda lp: -lp.logprob)[:2]
        assert tp2.token_ids[parted] in uni.logprobs[parted], (uni.token_ids, tp2.token_ids)
        assert best.logprob - runner_up.logprob <= NEAR_TIE, (parted, best, runner_up)


def ghost_step() -> SchedulerOutput:
    """A step naming a request the workers never saw: each rank's ModelRunner raises
    KeyError('ghost')."""
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["ghost"], new_block_ids=[[]], num_computed_tokens=[0]
        ),
        num_scheduled_tokens={"ghost": 1},
        total_num_scheduled_tokens=1,
        finished_req_ids=set(),
    )


def test_tp1_matches_uni_and_a_worker_exception_surfaces(uni_tokens: list[list[int]]) -> None:
    llm = LLM(executor="mp", tensor_parallel_size=1, **ENGINE)
    try:
        (proc,) = workers(llm)
        assert generate(llm) == uni_tokens
        executor = llm.engine.executor
        future = executor.execute_model(ghost_step(), non_block=True)
        with pytest.raises(RuntimeError, match=r"Worker_TP0 failed: KeyError: 'ghost'"):
            future.result()
        proc.join(timeout=5)
        assert proc.exitcode is not None  # it exits after reporting; the executor stops it too
        with pytest.raises(RuntimeError, match="KeyError"):
            executor.check_health()
    finally:
        llm.engine.shutdown()


def test_a_step_both_ranks_refuse_fails_with_the_error_not_with_deaths() -> None:
    """Every rank raises on the same bad step and exits after reporting: the failure is
    that error, and no rank is named as having died."""
    llm = LLM(executor="mp", tensor_parallel_size=2, **ENGINE)
    try:
        procs = workers(llm)
        executor = llm.engine.executor
        future = executor.execute_model(ghost_step(), non_block=True)
        with pytest.raises(RuntimeError, match=r"Worker_TP[01] failed: KeyError: 'ghost'") as info:
            future.result()
        assert "died" not in str(info.value)
        for proc in procs:
            proc.join(timeout=5)
            assert proc.exitcode is not None
    finally:
        llm.engine.shutdown()


def test_killed_worker_fails_the_engine_naming_it() -> None:
    # A collective timeout past this test's own waits: only the executor watching its
    # workers can end the request before the join below gives up.
    llm = LLM(
        executor="mp", tensor_parallel_size=2, **ENGINE, **{"plugins.mp.collective_timeout_s": 3600}
    )
    procs = workers(llm)
    errors: list[BaseException] = []

    def long_generate() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=long_generate, daemon=True)  # a hang must not block exit
    thread.start()
    try:
        # Kill it mid-request: once decoding is under way.
        deadline = time.monotonic() + 60
        while not any(r.num_output_tokens > 2 for r in list(llm.engine.scheduler.running)):
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the generate call outlived its killed worker"
    finally:
        llm.engine.shutdown()
    (error,) = errors  # the 1500 tokens were never finished
    assert isinstance(error, RuntimeError)
    assert "Worker_TP1" in str(error) and "SIGKILL" in str(error)
    for proc in procs:  # the survivor, stuck in a collective, was stopped too
        proc.join(timeout=5)
        assert proc.exitcode is not None
    with pytest.raises(RuntimeError, match="Worker_TP1"):
        llm.engine.executor.check_health()


def test_worker_failing_at_start_names_its_error() -> None:
    config = load_config(
        overrides=dict(model="/nonexistent/model", executor="mp", tensor_parallel_size=2)
    )
    executor = MultiprocExecutor(config=config)
    errors: list[BaseException] = []

    def initialize() -> None:
        try:
            executor.initialize()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=initialize, daemon=True)  # a hang must not block exit
    thread.start()
    try:
        thread.join(timeout=120)
        assert not thread.is_alive(), "initialize() never heard of its failing workers"
    finally:
        executor.shutdown()
    (error,) = errors  # the worker's own error, naming it
    assert isinstance(error, RuntimeError)
    assert re.search(r"Worker_TP[01] failed: ValueError: cannot resolve", str(error)), error
    assert all(proc.exitcode is not None for proc in executor._procs)


def test_two_nodes_on_one_host(uni_tokens: list[list[int]]) -> None:
    """nnodes=2: this process is node 0 (engine + rank 0), a second command runs rank 1,
    which takes its commands from rank 0 over the process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # One thread per rank: the two "nodes" share this host's cores.
    shared = dict(ENGINE, tensor_parallel_size=2, nnodes=2, master_port=port, num_threads=1)
    overrides = [arg for key, value in shared.items() for arg in ("-o", f"{key}={value}")]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "plugserve_plugins.executors.mp", "--node-rank", "1", *overrides]
    )
    try:
        llm = LLM(executor="mp", **shared)
        try:
            assert generate(llm) == uni_tokens
        finally:
            llm.engine.shutdown()
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
