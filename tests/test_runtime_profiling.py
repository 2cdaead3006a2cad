"""StepProfiler: range parsing and a real jax.profiler trace of the chosen steps."""

from __future__ import annotations

import os

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
    # With 4 steps per dispatch the loop reports steps 0, 4, 8: the dispatch at 4 runs
    # steps 4..7, so 5:7 is traced there; 3:9 starts at 4 and is stopped by close().
    inside = StepProfiler((5, 7), tmp_path / "inside")
    for step, active in ((0, False), (4, True), (8, False)):
        inside.step(step)
        assert inside.active == active, step
    assert inside.done and any(n.endswith(".xplane.pb") for n in _trace_files(tmp_path / "inside"))

    running = StepProfiler("3:9", tmp_path / "running")
    for step in (0, 4):
        running.step(step)
    assert running.active
    running.close(outputs=jnp.ones(3))
    assert not running.active and any(n.endswith(".xplane.pb") for n in _trace_files(tmp_path / "running"))


class _FakeTrace:
    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: self.calls.append("start"))
        monkeypatch.setattr(jax.profiler, "stop_trace", lambda: self.calls.append("stop"))


@pytest.mark.parametrize("steps_per_dispatch", [None, 4])
@pytest.mark.parametrize("spec, started_at", [("10:12", 8), ("8:9", 8), ("11", 8), ("7:13", 4),
                                              ("12:13", 12)])
def test_range_inside_a_dispatch_group_is_traced(tmp_path, monkeypatch, caplog, spec, started_at,
                                                 steps_per_dispatch):
    # Was: "10:12" with steps 0, 4, 8, 12 started no trace and set done, silently.
    trace = _FakeTrace(monkeypatch)
    profiler = StepProfiler(spec, tmp_path, steps_per_dispatch=steps_per_dispatch)
    start, stop = parse_step_range(spec)
    for step in range(0, 20, 4):
        profiler.step(step)
        assert profiler.active == (started_at <= step < stop), step
    profiler.close()
    assert trace.calls == ["start", "stop"] and profiler.done
    assert not caplog.records


def test_explicit_steps_per_dispatch_covers_the_first_dispatch(tmp_path, monkeypatch):
    trace = _FakeTrace(monkeypatch)
    profiler = StepProfiler("1:3", tmp_path, steps_per_dispatch=4)
    profiler.step(0)  # runs steps 0..3 (inference could not know that at the first call)
    assert profiler.active
    profiler.step(4)
    assert trace.calls == ["start", "stop"]


@pytest.mark.parametrize("steps, end", [((0, 4, 8), "jumped from step 4 to step 8"),
                                        ((20, 24), "training started to step 20")])
def test_skipped_range_warns(tmp_path, monkeypatch, caplog, steps, end):
    trace = _FakeTrace(monkeypatch)
    profiler = StepProfiler("5:7", tmp_path, steps_per_dispatch=1)
    for step in steps:
        profiler.step(step)
    profiler.close()
    assert profiler.done and trace.calls == []
    [record] = caplog.records
    assert record.levelname == "WARNING" and "profile steps 5:7 were never traced" in record.message
    assert end in record.message


def test_range_never_reached_warns_at_close(tmp_path, monkeypatch, caplog):
    trace = _FakeTrace(monkeypatch)
    profiler = StepProfiler("100:110", tmp_path)
    for step in range(8):
        profiler.step(step)
    profiler.close()
    assert trace.calls == [] and profiler.done
    [record] = caplog.records
    assert "profile steps 100:110 were never traced: training ended at step 7" in record.message


@pytest.mark.parametrize("step, error, match", [
    ("10", TypeError, "step must be an int >= 0, got step='10'"),
    (10.0, TypeError, "got step=10.0"),
    (True, TypeError, "got step=True"),
    (-1, ValueError, "step must be an int >= 0, got step=-1"),
])
def test_step_rejects_non_int_steps(tmp_path, step, error, match):
    with pytest.raises(error, match=match):
        StepProfiler("10:12", tmp_path).step(step)


@pytest.mark.parametrize("value, error", [(0, ValueError), (2.0, TypeError), ("4", TypeError),
                                          (True, TypeError)])
def test_bad_steps_per_dispatch(tmp_path, value, error):
    with pytest.raises(error, match="steps_per_dispatch must be an int >= 1"):
        StepProfiler("10:12", tmp_path, steps_per_dispatch=value)


def test_close_stops_the_trace_even_if_waiting_for_outputs_fails(tmp_path, caplog):
    # Was: block_until_ready raised, stop_trace never ran, and every later trace failed.
    profiler = StepProfiler("0:2", tmp_path / "trace")
    x = jnp.ones(4)
    profiler.step(0, x)
    x.delete()  # e.g. a donated state buffer at the time training failed
    profiler.close(x)
    assert profiler.done and not profiler.active
    [record] = caplog.records
    assert record.levelname == "WARNING" and "could not wait for the traced steps' outputs" in record.message
    jax.profiler.start_trace(str(tmp_path / "next"))  # no trace is left running
    jax.profiler.stop_trace()


def test_stop_on_a_later_step_also_survives_a_failed_wait(tmp_path, monkeypatch, caplog):
    trace = _FakeTrace(monkeypatch)

    def fail(outputs):
        raise RuntimeError("step failed on the device")

    monkeypatch.setattr(jax, "block_until_ready", fail)
    profiler = StepProfiler("0:1", tmp_path)
    profiler.step(0)
    profiler.step(1, outputs=object())
    assert trace.calls == ["start", "stop"] and profiler.done
    assert "RuntimeError: step failed on the device" in caplog.text


def test_train_loop_releases_monitor_and_logger_when_profiler_close_raises(tmp_path, monkeypatch):
    # Was: an exception from profiler.close() skipped monitor.stop() and logger.close().
    import types

    from jaxopt_train.train import TrainConfig
    from jaxopt_train.train import loop as loop_lib

    released = []

    class Profiler:
        def close(self, outputs):
            raise RuntimeError("profiler close failed")

    class Monitor:
        def stop(self):
            released.append("monitor")

    class Logger:
        def __init__(self, *args, **kwargs):
            pass

        def message(self, text):
            pass

        def close(self):
            released.append("logger")

    monkeypatch.setattr(loop_lib, "MetricsLogger", Logger)
    monkeypatch.setattr(loop_lib, "_start_monitor", Monitor)
    monkeypatch.setattr(loop_lib, "param_count", lambda params: 0)
    trainer = types.SimpleNamespace(
        state=types.SimpleNamespace(step=0, params=None), compiled=True, compile_seconds=0.0,
        memory_report="", num_devices=1,
        policy=types.SimpleNamespace(compute_dtype=jnp.float32, matmul_precision="highest"))
    task = types.SimpleNamespace(description="fake", data_size=None, classes=None)
    with pytest.raises(RuntimeError, match="profiler close failed"):
        # The profiler is made before the run dir is touched (train's _open_flag_outputs).
        loop_lib._run(TrainConfig(peak_tflops=100.0), task, trainer, ckpt=None, run_dir=str(tmp_path), target=0,
                      stream=None, outputs=loop_lib._FlagOutputs(profiler=Profiler()))  # target 0: the clean-up
    assert released == ["monitor", "logger"]


def test_a_logdir_that_is_a_file_is_refused_when_made(tmp_path, monkeypatch):
    # It was found at step START, by os.makedirs, hours into a run; the file is left alone.
    started = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: started.append(a))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"logdir=.*notes.txt.* is a file, not a directory"):
        StepProfiler("1000:1002", notes)
    assert notes.read_text() == "mine" and not started


@pytest.mark.parametrize("steps, error, match", [
    ((True, 3), TypeError, r"a step range pair holds two ints, got steps=\(True, 3\)"),
    ((-1, 3), ValueError, r"start >= 0, got steps=\(-1, 3\)"),
])
def test_step_profiler_pair_rejects_bools_and_negatives(tmp_path, steps, error, match):
    with pytest.raises(error, match=match):
        StepProfiler(steps, tmp_path)


def test_step_profiler_refuses_logdirs_makedirs_would_fail_on_at_start(tmp_path, monkeypatch):
    # Each was accepted and failed at step START, in os.makedirs, hours into a run.
    started = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: started.append(a))
    notes = tmp_path / "run.log"
    notes.write_text("mine")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(NotADirectoryError, match=r"run.log' is not a directory"):
        StepProfiler("5:6", notes / "trace")
    with pytest.raises(NotADirectoryError, match="is a broken symlink, not a directory"):
        StepProfiler("5:6", tmp_path / "dangling")
    with pytest.raises(ValueError, match="needs a logdir for the trace, got logdir=''"):
        StepProfiler("5:6", "")
    with pytest.raises(TypeError, match="logdir must be a path .* got NoneType: None"):
        StepProfiler("5:6", None)
    assert notes.read_text() == "mine" and not started
    profiler = StepProfiler("5:6", tmp_path / "a" / "b")  # missing folders are fine, made at START
    assert not (tmp_path / "a").exists()
    profiler.close()
