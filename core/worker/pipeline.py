"""Pipeline parallelism on a worker: the one command every rank runs per batch
(`run_stage_command`). The command, the rank layout and the executor's relay of sampled
tokens are data the executors share (datatypes/pipeline_stage.py); the stage's groups
and its link to the next stage are in worker/parallel.py.

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

from typing import Any

from plugserve.datatypes import ModelRunnerOutput, StageCommand


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
