"""The data that crosses a boundary between parts: a leaf of the import graph. The
phases the modules name are docs/request-path.md's.

- `Request`, `RequestStatus`: a request as the scheduler, its policy and the KV
  allocator see it (datatypes/request.py).
- `SchedulerOutput` with `NewRequestData` and `CachedRequestData`: what the scheduler
  hands the executor each step (datatypes/scheduler_output.py).
- `GrammarOutput`: the allowed-token bitmask the engine hands the executor between
  `execute_model` and `sample_tokens` (datatypes/grammar_output.py).
- `ModelRunnerOutput`, `Logprobs`: what the executor hands back; `Logprobs` also
  travels on to the API server inside EngineCoreOutput (datatypes/runner_output.py).
- `PooledTensor`: a pooling request's output as raw bytes, from the worker to the API
  server (datatypes/pooled_tensor.py).
- `RequestDelta`: what the API server's engine client yields for one request, to the
  endpoints and to an endpoint plugin (datatypes/request_delta.py).
- `MessageCounts`: the messages and bytes an executor and its ranks exchanged, by
  route (datatypes/message_counts.py).
- `StageCommand`, `RankLayout`, `SampledTokenRelay`, `output_rank`: a batch as every
  rank of every pipeline stage receives it, where a rank sits, and the relay of sampled
  tokens to the earlier stages (datatypes/pipeline_stage.py).

The Protocols in plugserve.interfaces, the plugins, the wire messages, the engine, the
frontend and the worker import these from here. This package imports only the standard
library, msgspec, numpy, plugserve.sampling_params and plugserve.pooling_params, so a third-party plugin can be typed
without reaching into the engine or the worker (tests/unit/test_import_rules.py keeps it
so).
"""

from __future__ import annotations

from plugserve.datatypes.grammar_output import GrammarOutput
from plugserve.datatypes.message_counts import MessageCounts
from plugserve.datatypes.pipeline_stage import (
    RankLayout,
    SampledTokenRelay,
    StageCommand,
    output_rank,
)
from plugserve.datatypes.pooled_tensor import PooledTensor
from plugserve.datatypes.request import Request, RequestStatus
from plugserve.datatypes.request_delta import RequestDelta
from plugserve.datatypes.runner_output import Logprobs, ModelRunnerOutput
from plugserve.datatypes.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "CachedRequestData",
    "GrammarOutput",
    "Logprobs",
    "MessageCounts",
    "ModelRunnerOutput",
    "NewRequestData",
    "PooledTensor",
    "RankLayout",
    "Request",
    "RequestDelta",
    "RequestStatus",
    "SampledTokenRelay",
    "SchedulerOutput",
    "StageCommand",
    "output_rank",
]
