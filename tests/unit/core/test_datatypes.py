"""The types that cross boundaries live in plugserve.datatypes; the names a third-party
plugin could have imported from their old homes stay importable for one release."""

from __future__ import annotations

import plugserve.datatypes as datatypes


def test_the_old_homes_re_export_the_same_classes() -> None:
    from plugserve.engine.request import Request, RequestStatus
    from plugserve.engine.scheduler_output import (
        CachedRequestData,
        NewRequestData,
        SchedulerOutput,
    )
    from plugserve.worker.model_runner_output import Logprobs, ModelRunnerOutput

    assert (Request, RequestStatus) == (datatypes.Request, datatypes.RequestStatus)
    assert (CachedRequestData, NewRequestData, SchedulerOutput) == (
        datatypes.CachedRequestData,
        datatypes.NewRequestData,
        datatypes.SchedulerOutput,
    )
    assert (Logprobs, ModelRunnerOutput) == (datatypes.Logprobs, datatypes.ModelRunnerOutput)
