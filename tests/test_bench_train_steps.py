"""`bench train`'s run configs (jaxopt_train.bench.train_steps.RunConfig): counts given as
bools or floats are refused naming the field."""

from __future__ import annotations

import pytest

from jaxopt_train.bench import train_steps


@pytest.mark.parametrize("changes, message", [
    (dict(steps_per_dispatch=True), "steps_per_dispatch=True must be an int >= 1"),
    (dict(steps_per_dispatch=2.0), "steps_per_dispatch=2.0 must be an int >= 1"),
    (dict(zero=True), "zero=True; legal values"),
    (dict(zero=1.0), "zero=1.0; legal values"),
])
def test_run_config_refuses_bools_and_floats_for_counts(changes, message):
    """Was: steps_per_dispatch=True ran (and was reported) as one step, 2.0 failed deep in
    the batch staging, zero=True was kept as True in the report's config."""
    with pytest.raises(ValueError, match=message):
        train_steps.RunConfig("x", accumulation="scan", **changes)
