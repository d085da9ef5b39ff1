"""SamplingParams judge a value the same in every process: a subnormal float is zero, as
in an engine process whose -ffast-math kernels set FTZ/DAZ (found by the fuzz:
tests/integration/test_fuzz.py)."""

from __future__ import annotations

import sys

import pytest

from plugserve.sampling_params import SamplingParams

SUBNORMAL = sys.float_info.min / 2**20


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
def test_a_subnormal_lower_bound_is_refused_as_zero(field: str):
    with pytest.raises(ValueError, match=f"{field} must be in \\(0, .*got 0.0"):
        SamplingParams(**{field: SUBNORMAL})


@pytest.mark.parametrize("field", ["temperature", "min_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [SUBNORMAL, -SUBNORMAL])
def test_a_subnormal_value_is_zero(field: str, value: float):
    assert getattr(SamplingParams(**{field: value}), field) == 0.0


def test_the_smallest_normal_values_stay():
    params = SamplingParams(top_p=sys.float_info.min, temperature=sys.float_info.min)
    assert (params.top_p, params.temperature) == (sys.float_info.min, sys.float_info.min)
