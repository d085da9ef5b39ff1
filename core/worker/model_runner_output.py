"""Kept importable for one release: ModelRunnerOutput and Logprobs now live in
plugserve.datatypes.runner_output, so that the engine, the wire messages and the
frontend need not import the worker. Import them from plugserve.datatypes."""

from __future__ import annotations

from plugserve.datatypes.runner_output import Logprobs, ModelRunnerOutput

__all__ = ["Logprobs", "ModelRunnerOutput"]
