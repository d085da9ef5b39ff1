"""The in-process executor: the model runs inside the engine-core process.

At tensor-parallel size 1 a forward pass is a function call, not an IPC round trip.
"""

from __future__ import annotations

from concurrent.futures import Future

from plugserve import hookimpl
from plugserve.config import StackConfig
from plugserve.datatypes import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from plugserve.interfaces.executor import KVCacheInfo


class UniProcExecutor:
    max_tensor_parallel_size = 1

    def __init__(self, *, config: StackConfig) -> None:
        if config.engine.tensor_parallel_size != 1:
            raise ValueError(
                f"executor 'uni' runs one rank; tensor_parallel_size="
                f"{config.engine.tensor_parallel_size} needs a multi-process executor"
            )
        if config.engine.pipeline_parallel_size != 1:
            raise ValueError(
                f"executor 'uni' runs one rank; pipeline_parallel_size="
                f"{config.engine.pipeline_parallel_size} needs executor 'mp' or 'ray'"
            )
        # Imported where the executor is built (the engine process): the registry loads
        # this module in every process, the API server's too, which must not import the
        # model runner.
        from plugserve.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)

    def initialize(self) -> KVCacheInfo:
        return self.runner.initialize()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None] | ModelRunnerOutput | None:
        output = self.runner.execute_model(scheduler_output)
        if not non_block:
            return output
        # The forward pass already ran in this thread; the Future only keeps the
        # executor contract uniform with executors that run it elsewhere.
        future: Future[ModelRunnerOutput | None] = Future()
        future.set_result(output)
        return future

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def measure_weight_read(self, seconds: float) -> tuple[int, float]:
        return self.runner.measure_weight_read(seconds)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


@hookimpl
def register_executors(register):
    register("uni", UniProcExecutor)
