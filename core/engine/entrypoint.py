"""The engine-core process's entry point, light enough for the process that spawns it.

A spawned child finds its target by module and name, so the target must live at module
level; the API server (or the launcher) that names it must not pay for what the engine
runs. This module imports nothing heavy: the engine process imports engine_proc (the
engine, the executor, the model runner, torch) itself, once it starts.
"""

from __future__ import annotations


def engine_process_name(engine_index: int, data_parallel_size: int) -> str:
    """The engine core's process and log name: EngineCore, or EngineCore_DP<i> with data
    parallelism."""
    return "EngineCore" if data_parallel_size == 1 else f"EngineCore_DP{engine_index}"


def run_engine_core(config_json: str, addresses: dict[str, str], engine_index: int = 0) -> None:
    """Spawn target of an engine-core process (one per data-parallel rank): runs
    engine_proc.run_engine_core in the child."""
    from plugserve.engine import engine_proc
    from plugserve.process_exit import exit_now

    try:
        engine_proc.run_engine_core(config_json, addresses, engine_index)
    except SystemExit as stop:  # the engine's own exit code, once it has shut down
        exit_now(stop.code if isinstance(stop.code, int) else 1)
    exit_now(0)
