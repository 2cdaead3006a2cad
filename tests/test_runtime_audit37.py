"""Audit of the runtime modules: memory, doctor, profiling, kernel_time, xla_flags."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from test_runtime_kernel_time import STREAM, write_xspace

from jaxopt_train.cli import main as cli_main
from jaxopt_train.runtime import StepProfiler, doctor, kernel_time, parse_bytes
from jaxopt_train.runtime.kernel_time import find_xplane, kernel_times
from jaxopt_train.runtime.memory import memory_env
from jaxopt_train.runtime.xla_flags import xla_flags


# --- memory ---------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (np.float32(16e9), 16 * 10**9),  # prints "1.6e+10": was "cannot read a byte count"
    (np.float16(2048), 2048),        # prints "2.048e+03"
    (10**400, 10**400),              # was OverflowError from float()
])
def test_parse_bytes_reads_numbers_numerically(value, expected):
    assert parse_bytes(value) == expected


def test_parse_bytes_says_why_a_numpy_number_is_refused():
    with pytest.raises(ValueError, match=r"byte count must be >= 0, got value=np.int64\(-3\)"):
        parse_bytes(np.int64(-3))  # was "cannot read a byte count"
    with pytest.raises(ValueError, match="byte count must be a finite number"):
        parse_bytes(np.float32("nan"))
    with pytest.raises(TypeError, match="expected a byte count"):
        parse_bytes(np.True_)  # a bool, as True is


@pytest.mark.parametrize("fraction, written", [(np.float32(0.9), "0.9000"), (np.float32(0.7), "0.7000"),
                                               (np.float16(0.9), "0.9000")])
def test_memory_env_numpy_fraction_keeps_the_share_asked_for(fraction, written):
    # Through float(), np.float32(0.9) is 0.89999997 and was written 0.8999.
    assert memory_env(fraction=fraction) == {"XLA_CLIENT_MEM_FRACTION": written}


# --- doctor ---------------------------------------------------------------------------

def test_doctor_empty_preallocate_is_unset_as_jaxlib_reads_it(monkeypatch):
    # jaxlib: `if preallocate:`; an empty value leaves XLA's default. It warned "means preallocate".
    for var in [v for v in os.environ if v.startswith("XLA")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "")
    checks, safe = doctor.check_xla_env()
    assert safe and all(c.status == "pass" for c in checks), checks
    assert "PREALLOCATE" not in " ".join(c.detail for c in checks)


# --- profiling ------------------------------------------------------------------------

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


# --- kernel_time ----------------------------------------------------------------------

def test_kernels_cli_with_all_zero_durations_does_not_divide_by_zero(tmp_path, capsys):
    trace = write_xspace(tmp_path / "t.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 0.0)]}})
    assert cli_main(["kernels", trace]) == 0  # was ZeroDivisionError
    assert "0.0%" in capsys.readouterr().out


def test_a_file_that_is_not_a_trace_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "t.trace.json.gz"
    bad.write_bytes(os.urandom(200))
    # Was RuntimeError "Failed to parse XSpace from array", naming no file; a traceback in the CLI.
    with pytest.raises(ValueError, match=r"cannot read .*t.trace.json.gz.* as a jax.profiler trace"):
        kernel_times(bad)
    with pytest.raises(SystemExit) as exc:
        cli_main(["kernels", str(bad)])
    assert exc.value.code == 2 and "expected an XSpace file" in capsys.readouterr().err


def test_a_broken_symlink_beside_a_trace_is_skipped(tmp_path):
    trace = write_xspace(tmp_path / "p/good.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    os.symlink(tmp_path / "gone", tmp_path / "p/bad.xplane.pb")
    assert find_xplane(tmp_path) == trace  # was FileNotFoundError from getmtime


def test_kernels_json_never_replaces_a_trace_it_reads(tmp_path, capsys):
    trace = write_xspace(tmp_path / "t.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    before = open(trace, "rb").read()
    for argv in (["kernels", trace], ["kernels", trace, "--against", trace]):
        with pytest.raises(SystemExit) as exc:
            cli_main([*argv, "--json", trace, "--overwrite"])
        assert exc.value.code == 2 and "is the trace" in capsys.readouterr().err
    assert open(trace, "rb").read() == before  # was replaced by the JSON table


def test_kernels_json_failed_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    trace = write_xspace(tmp_path / "t.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    out = tmp_path / "table.json"
    out.write_text("earlier table")

    def fail(*args, **kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(kernel_time.json, "dump", fail)
    monkeypatch.setattr(kernel_time.json, "dumps", fail)
    with pytest.raises(OSError, match="No space left"):
        cli_main(["kernels", trace, "--json", str(out), "--overwrite"])
    assert out.read_text() == "earlier table"  # was truncated to nothing
    monkeypatch.undo()
    assert cli_main(["kernels", trace, "--json", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text())[0]["name"] == "k"


# --- xla_flags ------------------------------------------------------------------------

def test_xla_flags_extra_takes_numpy_scalars(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    report = xla_flags("none", extra={"xla_gpu_all_reduce_combine_threshold_bytes": np.int64(2**28),
                                      "xla_gpu_enable_latency_hiding_scheduler": np.True_,
                                      "xla_gpu_deterministic_ops": np.False_},
                       apply=False)
    assert report.added == {"xla_gpu_all_reduce_combine_threshold_bytes": str(2**28),
                            "xla_gpu_enable_latency_hiding_scheduler": "true",
                            "xla_gpu_deterministic_ops": "false"}
    with pytest.raises(TypeError, match="values must be str, bool, int or float"):
        xla_flags("none", extra={"xla_foo": np.array([1, 2])}, apply=False)
