"""Pipeline parallelism's data: what every rank of every stage receives per batch
(`StageCommand`, msgpack on the wire), where a rank sits (`RankLayout`: global rank =
stage * tensor_parallel_size + tp_rank, stage-major, so a stage's tensor-parallel ranks
are consecutive and stages may sit on different nodes), and the executor's relay of
sampled tokens into the next command. The executors (in the engine process, loaded with
the registry in every process) and the workers share it; what a worker does with a
command is worker/pipeline.py's, how the stages connect worker/parallel.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from plugserve.datatypes.grammar_output import GrammarOutput
from plugserve.datatypes.runner_output import ModelRunnerOutput
from plugserve.datatypes.scheduler_output import SchedulerOutput


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

    def command(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> StageCommand:
        """The next batch's command, carrying what was sampled since the previous one."""
        return StageCommand(
            scheduler_output=scheduler_output,
            grammar_output=grammar_output,
            sampled_since=self.take(),
        )
