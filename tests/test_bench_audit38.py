"""Audit of the benchmark commands: output paths that collide, comparison rows that fail,
and counts the timing loops and run configs took without a word."""

from __future__ import annotations

import json
import math

import pytest

from jaxopt_train.bench import _timing, collectives, train, train_report, train_steps
from test_bench_train import _checked, _exit_2


def test_json_naming_the_out_folder_or_its_report_is_refused(tmp_path, capsys):
    """Was: --json OUT made OUT a folder, and writing the JSON there failed after the whole
    run; --json OUT/train_bench.md was silently replaced by the Markdown report."""
    out = tmp_path / "out"
    err = _exit_2(capsys, _checked, ["--quick", "--out", str(out), "--json", str(out)])
    assert "is the --out folder; expected a file path" in err
    for name in ("train_bench.md", "train_bench.png"):
        err = _exit_2(capsys, _checked, ["--quick", "--out", str(out), "--json", str(out / name)])
        assert f"is --out's {name}, which the report writes" in err
    assert list(tmp_path.iterdir()) == []  # refused before any folder was made
    # --out's own JSON holds the same text: still fine.
    _checked(["--quick", "--out", str(out), "--json", str(out / "train_bench.json")])


def _fake_measure(self, run, workload=None, devices=None, runner=None, peak_window=None):
    if run.name in ("optimised k=4", "optimised, matmul=pallas"):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory\nmore")
    timing = _timing.BurstTiming([0.01, 0.012], [0.001, 0.001], 2, [0.002, 0.002])
    trace = _timing.Trace([0.01], [100], [50, 60])
    workload = workload or self.workload
    row = train_report.row_figures(
        name=run.name, timing=timing, trace=trace, compile_s=1.0,
        items_per_step=workload.items_per_step, flops_per_step=workload.flops_per_step,
        unit=workload.unit, num_devices=1, peak_tflops=self.peak, peak_memory=(1000, "xla-estimate"),
        dataset_items=self.dataset_items, gpu_hour_usd=1.0, steps_per_call=run.steps_per_dispatch)
    row.update(config=run.describe(), clocks={}, global_batch=workload.global_batch,
               attention_resolved=train_steps.resolved_attention(workload, run))
    return row


def test_a_failed_compare_dispatch_or_matmul_row_costs_only_its_row(tmp_path, monkeypatch):
    """Was: one --compare-dispatch or --compare-matmul row that raised (a large k stages k
    batches and can run out of memory) ended the bench with a traceback: no report at all."""
    monkeypatch.setattr(train.Bench, "measure", _fake_measure)
    out = tmp_path / "out"
    assert train.main(["--quick", "--devices", "1", "--xla-preset", "none", "--out", str(out),
                       "--compare-dispatch", "1,4", "--compare-matmul", "pallas"]) == 0
    result = json.loads((out / "train_bench.json").read_text())
    assert [r["name"] for r in result["dispatch"]] == ["optimised k=1"]
    assert [r["name"] for r in result["matmul"]] == ["optimised"]
    assert [f["name"] for f in result["rows_failed"]] == ["optimised k=4", "optimised, matmul=pallas"]
    text = (out / "train_bench.md").read_text()
    assert "optimised k=4: no row, the run failed (RuntimeError: RESOURCE_EXHAUSTED" in text
    # Every dispatch row failed: no table of nothing.
    assert "steps_per_dispatch (optimised config)" not in train_report.render({**result, "dispatch": []})


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


def test_collectives_json_as_the_gpt_trace_folder_is_refused(tmp_path, capsys):
    """Was: --gpt-trace DIR made DIR a folder, and the JSON written after the first row
    failed there with a raw IsADirectoryError, ending the sweep."""
    folder = tmp_path / "trace"
    err = _exit_2(capsys, collectives.main, ["--quick", "--gpt", "--gpt-trace", str(folder),
                                             "--json", str(folder)])
    assert "--json" in err and "is also the --gpt-trace folder" in err
    assert list(tmp_path.iterdir()) == []
