"""The executor: runs the model for the engine core, in process or over workers."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from plugserve.config import StackConfig
    from plugserve.datatypes import (
        GrammarOutput,
        ModelRunnerOutput,
        SchedulerOutput,
    )


@dataclass(frozen=True)
class KVCacheInfo:
    """What the executor reports once the model is loaded and the KV cache allocated."""

    num_blocks: int
    block_size: int
    dtype: str
    max_model_len: int


@runtime_checkable
class Executor(Protocol):
    """Runs the model for the engine core: in-process, or over worker processes.

    Optional: HasTensorParallelLimit, SupportsWeightReadProbe."""

    def __init__(self, *, config: StackConfig) -> None: ...

    def initialize(self) -> KVCacheInfo:
        """Load the model, size and allocate the KV cache."""
        ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None] | ModelRunnerOutput | None:
        """Phase 7: run the forward pass over the scheduled tokens and park the logits.
        Returns None (or a Future of None with non_block) when there is something to
        sample; a ModelRunnerOutput directly when there is not."""
        ...

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Phase 8: mask the parked logits of constrained rows with the grammar bitmask,
        apply the logits processors and sample."""
        ...

    def check_health(self) -> None:
        """Raise if a worker is gone."""
        ...

    def shutdown(self) -> None: ...
