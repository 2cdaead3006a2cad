"""The benchmarks' timing loops (jaxopt_train.bench._timing) refuse counts and seconds they
cannot time before running a step, and take numpy integers as counts."""

from __future__ import annotations

import math

import pytest

from jaxopt_train.bench import _timing


@pytest.mark.parametrize("call, message", [
    (lambda step: _timing.warm_up(step, 0, 1, seconds=math.nan), "seconds=nan must be a finite"),
    (lambda step: _timing.warm_up(step, 0, 1, seconds=math.inf), "seconds=inf must be a finite"),
    (lambda step: _timing.warm_up(step, 0, 1.5), "calls=1.5 must be an int >= 0"),
    (lambda step: _timing.time_bursts(step, 0, bursts=0, calls_per_burst=1, steps_per_call=1),
     "bursts=0 must be an int >= 1"),
    (lambda step: _timing.time_bursts(step, 0, bursts=1, calls_per_burst=0, steps_per_call=1),
     "calls_per_burst=0 must be an int >= 1"),
    (lambda step: _timing.time_bursts(step, 0, bursts=1, calls_per_burst=1, steps_per_call=True),
     "steps_per_call=True must be an int >= 1"),
    (lambda step: _timing.trace_steps(step, 0, calls=-1, steps_per_call=1, device=None),
     "calls=-1 must be an int >= 0"),
])
def test_timing_refuses_counts_and_seconds_it_cannot_time(call, message):
    """Was: NaN or inf seconds warmed up forever; zero bursts or calls gave a raw
    StatisticsError or ZeroDivisionError after the steps had run."""
    with pytest.raises(ValueError, match=message):
        call(lambda s: (s + 1, s))


def test_timing_still_takes_numpy_counts():
    import numpy as np  # noqa: PLC0415

    _, timing = _timing.time_bursts(lambda s: (s + 1, s), 0, bursts=np.int64(2),
                                    calls_per_burst=2, steps_per_call=1)
    assert len(timing.wall_s) == 2
