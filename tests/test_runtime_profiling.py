"""StepProfiler: range parsing and a real jax.profiler trace of the chosen steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxopt_train.runtime import StepProfiler, parse_step_range


@pytest.mark.parametrize("text, expected", [("10:12", (10, 12)), ("3", (3, 4)), (" 0 : 1 ", (0, 1))])
def test_parse_step_range(text, expected):
    assert parse_step_range(text) == expected


@pytest.mark.parametrize("bad, match", [
    ("12:10", "is empty"), ("5:5", "is empty"), ("a:b", "START:STOP"), ("-1:3", "START:STOP"),
    ("1:2:3", "START:STOP"), ("", "START:STOP"),
])
def test_parse_step_range_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_step_range(bad)


@pytest.mark.parametrize("steps, expected", [
    (5, (5, 6)), ("5", (5, 6)), ("2:4", (2, 4)), ((2, 4), (2, 4)), ([2, 4], (2, 4)),
])
def test_step_profiler_accepts_what_parse_step_range_accepts(tmp_path, steps, expected):
    profiler = StepProfiler(steps, tmp_path)
    assert (profiler.start_step, profiler.stop_step) == expected


@pytest.mark.parametrize("steps, kwargs, error, match", [
    ((1.5, 3), {}, TypeError, r"a step range pair holds two ints, got steps=\(1.5, 3\)"),
    ((1, 2, 3), {}, ValueError, r"a step range pair is \(start, stop\), got steps=\(1, 2, 3\)"),
    ((4, 2), {}, ValueError, "is empty"),
    (2.5, {}, ValueError, "START:STOP"),
    ("2:4", {"perfetto": "no"}, TypeError, "perfetto must be True or False, got perfetto='no'"),
])
def test_step_profiler_rejects(tmp_path, steps, kwargs, error, match):
    with pytest.raises(error, match=match):
        StepProfiler(steps, tmp_path, **kwargs)


def _trace_files(logdir):
    return sorted(p.name for p in logdir.rglob("*") if p.is_file())


def test_traces_exactly_the_range(tmp_path):
    profiler = StepProfiler("2:4", tmp_path / "trace")
    step_fn = jax.jit(lambda x: x @ x)
    x = jnp.ones((32, 32))
    y = None
    for step in range(6):
        profiler.step(step, outputs=y)
        assert profiler.active == (2 <= step < 4), step
        y = step_fn(x)
    profiler.close()
    assert profiler.done and not profiler.active
    files = _trace_files(tmp_path / "trace")
    assert any(name.endswith(".xplane.pb") for name in files), files
    assert (tmp_path / "trace" / "plugins" / "profile").is_dir()


def test_jumping_steps_and_close_stop_a_running_trace(tmp_path):
    # With 4 steps per dispatch the loop reports steps 0, 4, 8: the range 5:7 is
    # skipped over, 3:9 starts at 4 and is stopped by close() at the end.
    skipped = StepProfiler((5, 7), tmp_path / "skipped")
    for step in (0, 4, 8):
        skipped.step(step)
        assert not skipped.active
    assert skipped.done and not (tmp_path / "skipped").exists()

    running = StepProfiler("3:9", tmp_path / "running")
    for step in (0, 4):
        running.step(step)
    assert running.active
    running.close(outputs=jnp.ones(3))
    assert not running.active and any(n.endswith(".xplane.pb") for n in _trace_files(tmp_path / "running"))
