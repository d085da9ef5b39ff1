"""A third-party executor, the smallest real one that is not the bundled `uni`: the model
runs in the engine's process but on a thread of its own, so execute_model(non_block=True)
returns while the forward pass runs, as a multi-process executor's does, and the engine
builds a step's grammar bitmask meanwhile.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.executor;
tests/plugins/test_minimal_plugins.py selects it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from plugserve import hookimpl
from plugserve.config import StackConfig
from plugserve.datatypes import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from plugserve.hookspecs import Register
from plugserve.interfaces.executor import KVCacheInfo


class ForwardThreadExecutor:
    """interfaces.executor.Executor: one rank, its forward pass on a worker thread."""

    max_tensor_parallel_size = 1

    def __init__(self, *, config: StackConfig) -> None:
        if config.engine.tensor_parallel_size != 1:
            raise ValueError("executor 'forward_thread' runs one rank")
        # Where the executor is built, in the engine process only: the API server loads
        # every plugin module and must not import the model runner.
        from plugserve.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self._forward = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def initialize(self) -> KVCacheInfo:
        return self.runner.initialize()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None] | ModelRunnerOutput | None:
        future = self._forward.submit(self.runner.execute_model, scheduler_output)
        return future if non_block else future.result()

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._forward.shutdown(wait=True)


@hookimpl
def register_executors(register: Register) -> None:
    register("forward_thread", ForwardThreadExecutor)
