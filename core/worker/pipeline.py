"""Pipeline parallelism: where a rank sits, the one command every rank runs per batch,
and the executor's relay of sampled tokens. Torch-free, so that an executor plugin
loaded in the API server can import it; the stage's groups and its link to the next
stage are in worker/parallel.py.

Ranks are laid out stage-major: global rank = stage * tensor_parallel_size + tp_rank,
so a stage's tensor-parallel ranks are consecutive (one node, for a fast all-reduce)
and stages may sit on different nodes. Rank j of stage k sends its activations to rank
j of stage k + 1 point to point (gloo on CPU, nccl on CUDA); the hidden states are
whole on every rank of a stage after its all-reduces, so each pair carries the same.

Each batch reaches every rank as one `StageCommand`: the SchedulerOutput, the grammar
bitmask of its constrained rows (built by the engine when it scheduled the batch: a
request in flight is never scheduled again, so its grammar cannot move meanwhile), and
the tokens sampled since the previous command. Only the last stage samples; the
earlier stages learn the tokens from that relay, in time, because the scheduler never
schedules a request again before the batch that sampled its last token has returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from plugserve.datatypes import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class StageCommand(msgspec.Struct, kw_only=True):
    """One batch for every rank of every stage."""

    scheduler_output: SchedulerOutput
    grammar_output: GrammarOutput | None = None
    # Tokens the last stage sampled since the previous command, by request: the earlier
    # stages append them to their persistent batches before this batch runs.
    sampled_since: dict[str, list[int]] = msgspec.field(default_factory=dict)


@dataclass(frozen=True)
class RankLayout:
    """Where global rank `rank` sits among tensor_parallel_size x pipeline_parallel_size."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def is_output_rank(self) -> bool:
        """The rank that samples and answers for the group: the last stage's first."""
        return self.rank == output_rank(self.tensor_parallel_size, self.pipeline_parallel_size)

    def stage_ranks(self, stage: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(stage * tp, (stage + 1) * tp))

    @property
    def name(self) -> str:
        if self.pipeline_parallel_size == 1:
            return f"TP{self.tp_rank}"
        return f"PP{self.stage}_TP{self.tp_rank}"


def output_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    return (pipeline_parallel_size - 1) * tensor_parallel_size


class SampledTokenRelay:
    """The executor's side of the token relay: what the last stage sampled, collected
    from its outputs until the next command carries it to the earlier stages."""

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}

    def record(self, output: ModelRunnerOutput) -> None:
        for req_id, tokens in output.sampled_token_ids.items():
            self._tokens.setdefault(req_id, []).extend(tokens)

    def take(self) -> dict[str, list[int]]:
        tokens, self._tokens = self._tokens, {}
        return tokens


def run_stage_command(runner: Any, command: StageCommand) -> ModelRunnerOutput | None:
    """A rank's part of one batch (`runner`: a ModelRunner built with its placement):
    the earlier stages take the relayed tokens and run their layers; the last stage
    also samples, and returns the output (None elsewhere)."""
    if not runner.samples:
        runner.append_tokens(command.sampled_since)
    output = runner.execute_model(command.scheduler_output)
    if not runner.samples:
        return None
    if output is None:
        output = runner.sample_tokens(command.grammar_output)
    return output
