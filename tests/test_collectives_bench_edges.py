"""`jaxopt-train bench collectives`: strict JSON, kept files, compile-free timing, clamped overlap.

The sweep's smoke tests are in test_collectives_bench.py; these cover its edges.
"""

import json
import time

import jax
import jax.numpy as jnp
import pytest
from test_bench_train import _exit_2

from jaxopt_train.bench import collectives as bench
from jaxopt_train.bench import collectives_gpt as bench_gpt


def _quick(*argv):
    return ["--quick", "--sizes", "4K", "--dtypes", "f32", "--chunks", "1", *argv]


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as strict parsers (jq, JavaScript) do."""
    def refuse(name):
        raise ValueError(f"non-finite {name} in the JSON")
    return json.loads(text, parse_constant=refuse)


def _no_sweep(*_args, **_kwargs):
    raise AssertionError("the benchmark ran; the flags should have been refused first")


@pytest.mark.parametrize("argv, message", [
    (["--peak", "inf"], "--peak=inf must be > 0 and finite"),
    (["--bucket-mb", "inf"], "--bucket-mb=inf must be > 0 and finite"),
])
def test_non_finite_flags_exit_2(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    assert bench.main(_quick(*argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("size", ["infK", "1e400K", "9" * 400 + "M"])
def test_an_infinite_size_is_an_argparse_error_not_a_traceback(size, capsys):
    # float("inf") * 1024 reached int() and raised OverflowError, which argparse does not catch.
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sizes", size])
    assert exc.value.code == 2
    assert "cannot read a size from" in capsys.readouterr().err


def test_a_gpt_trace_folder_that_cannot_be_written_is_refused_before_the_sweep(monkeypatch, tmp_path,
                                                                              capsys):
    # It was first used after the whole all-reduce sweep and the GPT step's first timings.
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    not_a_folder = tmp_path / "trace"
    not_a_folder.write_text("a file")
    with pytest.raises(SystemExit) as exc:
        bench.main(_quick("--gpt", "--gpt-trace", str(not_a_folder)))
    assert exc.value.code == 2
    assert f"argument --gpt-trace: expected a writable folder; '{not_a_folder}' exists" in capsys.readouterr().err


def test_a_variant_with_non_finite_output_is_wrong_and_the_json_stays_strict(monkeypatch, tmp_path,
                                                                              capsys):
    real = bench.variants
    monkeypatch.setattr(bench, "variants", lambda n, dtype, chunks: {
        **real(n, dtype, chunks), "ring/c1": lambda v: v * jnp.inf})
    out = tmp_path / "coll.json"
    assert bench.main(_quick("--methods", "ring", "--json", str(out))) == 1
    psum, ring = _strict_json(out.read_text())["allreduce"]
    assert psum["max_abs_diff_vs_psum"] == 0 and "non_finite_output" not in psum
    assert ring["max_abs_diff_vs_psum"] is None and ring["non_finite_output"] is True
    captured = capsys.readouterr()
    assert "WRONG RESULT" in captured.out and "['ring/c1 f32'] differ from lax.psum" in captured.err


def test_an_existing_json_is_kept_unless_overwrite(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "bench_collectives", lambda args, record: [{"fake": "row"}])
    monkeypatch.setattr(bench, "print_table", lambda rows, note: None)
    path = tmp_path / "coll.json"
    path.write_text("KEEP")
    with pytest.raises(SystemExit) as exc:
        bench.main(_quick("--json", str(path)))
    assert exc.value.code == 2
    assert "already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert path.read_text() == "KEEP"
    assert bench.main(_quick("--json", str(path), "--overwrite")) == 0
    assert _strict_json(path.read_text())["allreduce"] == []  # the fake sweep recorded nothing


def test_a_refused_run_leaves_no_json_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(_quick("--methods", "peer", "--json", str(tmp_path / "nodir" / "c.json")))
    assert "cannot run here" in capsys.readouterr().err
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("warmup", [0, 2])
def test_time_burst_never_times_the_compiling_call(warmup):
    calls = []

    def fn(x):  # the first call stands in for compilation: slow, once
        calls.append(x)
        if len(calls) == 1:
            time.sleep(0.5)
        return x + 1

    seconds = bench.time_burst(fn, (jnp.ones(3),), warmup=warmup, iters=2, bursts=3)
    assert seconds < 0.1 and len(calls) == 1 + warmup + 2 * 3


@pytest.mark.parametrize("step, want", [
    (1.5, (0.5, None)),     # half the 1.0 s of comm hidden
    (0.9, (1.0, 1.1)),      # faster than compute alone: noise, clamped
    (3.5, (0.0, -1.5)),     # slower than compute + comm: clamped
    (1.0, (1.0, None)), (2.0, (0.0, None)),
])
def test_hidden_fraction_is_clamped_and_says_from_what(step, want):
    hidden, clamped_from = bench_gpt.hidden_fraction(step, compute_only=1.0, comm=1.0)
    assert hidden == pytest.approx(want[0])
    assert clamped_from == (None if want[1] is None else pytest.approx(want[1]))


def test_gpt_table_marks_clamped_hidden_fractions(capsys):
    row = {"config": "gpt-tiny", "overrides": {}, "devices": 2, "per_device_batch": 1, "seq_len": 8,
           "grad_dtype": "float32", "step_s": 1e-3, "step_vs_psum": 1.0, "compute_only_s": 1e-3,
           "comm_only_s": 1e-4, "one_device_step_s": 1e-3, "throughput_vs_one_device": 2.0}
    bench_gpt.print_gpt([{**row, "method": "psum", "hidden_comm_fraction": 1.0,
                          "hidden_comm_fraction_clamped_from": 3.03},
                         {**row, "method": "ring", "hidden_comm_fraction": 0.4,
                          "hidden_comm_fraction_clamped_from": None}])
    out = capsys.readouterr().out
    assert "1.00*" in out and "0.40*" not in out
    assert "* clamped to [0, 1] from psum 3.03" in out


def _raise(message):
    def body(_x):
        raise RuntimeError(message)
    return body


def test_a_failed_variant_is_a_row_and_fails_the_run_after_the_table(monkeypatch, tmp_path, capsys):
    """It was only printed to stderr, and the run exited 0 with the other rows."""
    real = bench.variants
    monkeypatch.setattr(bench, "variants", lambda n, dtype, chunks: {
        **real(n, dtype, chunks), "ring_bidir/c1": _raise("link down")})
    out = tmp_path / "coll.json"
    assert bench.main(_quick("--methods", "ring,ring_bidir", "--json", str(out))) == 1
    psum, ring, bidir = _strict_json(out.read_text())["allreduce"]
    assert "error" not in psum and ring["max_abs_diff_vs_psum"] == 0 and ring["ratio_to_psum"]
    assert bidir["variant"] == "ring_bidir/c1" and bidir["error"] == "RuntimeError: link down"
    assert "time_s" not in bidir
    captured = capsys.readouterr()
    assert "ring/c1" in captured.out and "ring_bidir/c1          FAILED RuntimeError: link down" in captured.out
    assert "bench collectives: failed: ['ring_bidir/c1 f32 4K'] (see the errors above)" in captured.err


def test_a_failed_psum_baseline_fails_the_run_and_says_its_size_is_unchecked(monkeypatch, tmp_path,
                                                                             capsys):
    real = bench.variants

    def psum_fails_at_8k(v):  # per device 8K of f32 is 2048 elements
        if v.shape[0] == 2048:
            raise RuntimeError("psum broke")
        return jax.lax.psum(v, "data")
    monkeypatch.setattr(bench, "variants", lambda n, dtype, chunks: {
        **real(n, dtype, chunks), "psum": psum_fails_at_8k})
    out = tmp_path / "coll.json"
    assert bench.main(["--quick", "--sizes", "4K,8K", "--dtypes", "f32", "--chunks", "1",
                       "--methods", "ring", "--json", str(out)]) == 1
    rows = {(r["variant"], r["size_bytes"]): r for r in _strict_json(out.read_text())["allreduce"]}
    assert rows["psum", 8192]["error"] == "RuntimeError: psum broke"
    assert rows["ring/c1", 8192]["max_abs_diff_vs_psum"] is None  # nothing to check it against
    assert rows["ring/c1", 8192]["ratio_to_psum"] is None
    assert rows["ring/c1", 4096]["max_abs_diff_vs_psum"] == 0
    err = capsys.readouterr().err
    assert "failed: ['psum f32 8K'] (see the errors above); where psum failed the other variants " \
           "have no check and no ratio" in err


def test_a_variant_this_machine_cannot_run_is_skipped_not_failed(monkeypatch, capsys):
    """On 2 devices without Hopper GPUs the peer variants are not built: a note, exit 0."""
    real = bench.variants
    monkeypatch.setattr(bench, "variants", lambda n, dtype, chunks: real(2, dtype, chunks))
    assert bench.main(_quick("--methods", "ring")) == 0
    err = capsys.readouterr().err
    assert "peer variants skipped" in err and "failed" not in err


def test_collectives_json_as_the_gpt_trace_folder_is_refused(tmp_path, capsys):
    """Was: --gpt-trace DIR made DIR a folder, and the JSON written after the first row
    failed there with a raw IsADirectoryError, ending the sweep."""
    folder = tmp_path / "trace"
    err = _exit_2(capsys, bench.main, ["--quick", "--gpt", "--gpt-trace", str(folder),
                                       "--json", str(folder)])
    assert "--json" in err and "is also the --gpt-trace folder" in err
    assert list(tmp_path.iterdir()) == []
