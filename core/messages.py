"""msgspec Structs that cross the process boundary between API server and engine core.

array_like and omit_defaults keep the hot messages (one EngineCoreOutputs per step) small.
"""

from __future__ import annotations

import time

import msgspec
import msgspec.msgpack
import msgspec.structs

from plugserve.datatypes import Logprobs, PooledTensor
from plugserve.pooling_params import PoolingParams
from plugserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = msgspec.field(default_factory=time.time)
    priority: int = 0
    # Set for a pooling request (sampling_params then goes unused).
    pooling_params: PoolingParams | None = None


# How an engine request can end: EngineCoreOutput.finish_reason, SchedulerStats.num_finished.
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # one of FINISH_REASONS
    stop_reason: int | str | None = None  # the stop token id that ended it
    new_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # With the first generated token of a request that asked for prompt_logprobs: one
    # entry per prompt token, None for the first (nothing comes before it).
    prompt_logprobs: list[Logprobs | None] | None = None
    # With a request's first output: the seconds it waited in the engine between being
    # queued and first scheduled (vllm:request_queue_time_seconds).
    queue_seconds: float | None = None
    # The error lies in the request itself (a constraint this model's tokenizer cannot
    # compile or continue): the API answers 400, not 500.
    error_in_request: bool = False
    # Output tokens so far that belong to the reasoning (SamplingParams.reasoning), its
    # end marker included.
    num_reasoning_tokens: int = 0
    # A pooling request's output, with its finish.
    pooled: PooledTensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """An engine's figures. The engine keeps them since its start (EngineCore.stats());
    on the wire (with outputs, PONG, or alone) the counters are what changed since that
    engine's previous stats message to any API server (`stats_since`), so that each
    increment reaches exactly one API server and the sum over API servers is the
    engine's total; the gauges (GAUGE_FIELDS) are the engine's state when it sent them."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Engine-step counters since start: steps, their wall time, and the part spent in the
    # executor (forward pass and sampling); the rest is engine overhead.
    num_steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    # Pipeline stages: each stage's seconds of work since start (empty: one stage).
    pipeline_stage_busy_seconds: list[float] = msgspec.field(default_factory=list)
    # Request counters since start: output tokens generated (kept after the stop checks),
    # and finished requests by finish reason (one of FINISH_REASONS).
    num_generated_tokens: int = 0
    num_finished: dict[str, int] = msgspec.field(default_factory=dict)
    # Structured output since start: steps that built a grammar bitmask, the seconds spent
    # building them (between execute_model and sample_tokens), the seconds then still
    # waited for the forward pass, and the steps where that wait shows the forward pass
    # was still running when the bitmask was done (it hid the bitmask entirely).
    grammar_bitmask_steps: int = 0
    grammar_bitmask_seconds: float = 0.0
    grammar_forward_wait_seconds: float = 0.0
    grammar_bitmask_hidden_steps: int = 0
    # Prompt tokens computed (prefix-cache hits are not), and PINGs answered.
    num_prompt_tokens: int = 0
    num_pings: int = 0
    # Speculative decoding since start (vLLM's spec_decode counters): drafts verified,
    # their tokens, the tokens accepted, and per draft position the drafts accepted there.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


# The fields of SchedulerStats that describe the engine's state now (the stages' busy
# seconds travel whole, as the latest batch brought them back); every other field counts
# since the engine started (and, on the wire, since its previous stats message).
GAUGE_FIELDS = (
    "num_running",
    "num_waiting",
    "kv_usage",
    "num_kv_blocks",
    "num_free_kv_blocks",
    "pipeline_stage_busy_seconds",
)
COUNTER_FIELDS = tuple(
    name
    for name in SchedulerStats.__struct_fields__
    if name not in GAUGE_FIELDS and name not in ("num_finished", "spec_num_accepted_tokens_per_pos")
)


def stats_since(now: SchedulerStats, before: SchedulerStats) -> SchedulerStats:
    """`now`'s gauges, and its counters minus `before`'s."""
    delta = msgspec.structs.replace(now)
    for name in COUNTER_FIELDS:
        setattr(delta, name, getattr(now, name) - getattr(before, name))
    delta.num_finished = {
        reason: n - before.num_finished.get(reason, 0)
        for reason, n in now.num_finished.items()
        if n != before.num_finished.get(reason, 0)
    }
    delta.spec_num_accepted_tokens_per_pos = _minus(
        now.spec_num_accepted_tokens_per_pos, before.spec_num_accepted_tokens_per_pos
    )
    return delta


def _minus(now: list[int], before: list[int]) -> list[int]:
    """Per-position counts of `now` less `before`'s (which may be shorter)."""
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]


def add_stats(total: SchedulerStats, delta: SchedulerStats) -> None:
    """Fold a stats message into `total` (in place): its gauges replace, its counters add."""
    for name in GAUGE_FIELDS:
        setattr(total, name, getattr(delta, name))
    for name in COUNTER_FIELDS:
        setattr(total, name, getattr(total, name) + getattr(delta, name))
    for reason, n in delta.num_finished.items():
        total.num_finished[reason] = total.num_finished.get(reason, 0) + n
    per_pos = total.spec_num_accepted_tokens_per_pos
    for i, n in enumerate(delta.spec_num_accepted_tokens_per_pos):
        if i < len(per_pos):
            per_pos[i] += n
        else:
            per_pos.append(n)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    engine_index: int = 0
    timestamp: float = 0.0


# ----------------------------------------------------------------- framing
# Every message is [type frame, payload frame]; the type frame tells the receiver which
# typed decoder to use, so hot messages decode straight into their Structs.


class RequestType:
    """API server → engine."""

    ADD = b"A"  # EngineCoreRequest
    ABORT = b"X"  # list[str] of request ids
    PING = b"P"  # int nonce; answered by PONG from the busy loop
    READ_WEIGHTS = b"W"  # ReadWeights; answered by WEIGHT_READ between two steps
    SHUTDOWN = b"S"


class OutputType:
    """Engine → API server."""

    READY = b"r"  # EngineReady, the handshake
    OUTPUTS = b"o"  # EngineCoreOutputs
    PONG = b"p"  # Pong: the nonce, with fresh scheduler stats
    WEIGHT_READ = b"w"  # WeightRead
    DEAD = b"d"  # EngineDead, then the process exits


class EngineReady(msgspec.Struct, kw_only=True):
    engine_index: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    max_model_len: int
    version: str
    pid: int


class Pong(msgspec.Struct, array_like=True):
    nonce: int
    engine_index: int
    stats: SchedulerStats


class ReadWeights(msgspec.Struct, array_like=True):
    """Ask the engine how fast it reads its own weights now (the bandwidth floor of a
    batch-1 step, measured on the very memory the step reads)."""

    nonce: int
    seconds: float


class WeightRead(msgspec.Struct, kw_only=True):
    nonce: int
    engine_index: int
    weight_bytes: int = 0
    bytes_per_second: float = 0.0
    error: str | None = None  # why this engine cannot measure it


class EngineDead(msgspec.Struct, kw_only=True):
    engine_index: int
    error: str


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
abort_decoder = msgspec.msgpack.Decoder(list[str])
int_decoder = msgspec.msgpack.Decoder(int)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
ready_decoder = msgspec.msgpack.Decoder(EngineReady)
pong_decoder = msgspec.msgpack.Decoder(Pong)
dead_decoder = msgspec.msgpack.Decoder(EngineDead)
read_weights_decoder = msgspec.msgpack.Decoder(ReadWeights)
weight_read_decoder = msgspec.msgpack.Decoder(WeightRead)
