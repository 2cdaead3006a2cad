"""`bench train`'s report (jaxopt_train.bench.train_report) when comparison rows fail: a
--compare-dispatch or --compare-matmul row that raises costs only its own row, listed
under rows_failed, and a comparison whose rows all failed gets no table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxopt_train.bench import _timing, train, train_report, train_steps


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


def test_comparison_ratios_are_in_the_json_and_memory_is_labelled_per_device(tmp_path, monkeypatch):
    """Was: the --compare-dispatch and --compare-matmul tables printed ratios the JSON lacked,
    and nothing said peak memory is one device's while throughput is all devices'."""
    def measure(self, run, workload=None, devices=None, runner=None, peak_window=None):
        row = _fake_measure(self, dataclasses.replace(run, name="ok"), workload, devices)
        # k=4 dispatches 1.6x the steps per second of k=1; the pallas step takes 1.25x xla's
        if run.name == "optimised k=4":
            row["steps_per_s"] *= 1.6
        if run.name == "optimised, matmul=pallas":
            row["step_ms"] *= 1.25
        return {**row, "name": run.name}

    monkeypatch.setattr(train.Bench, "measure", measure)
    out = tmp_path / "out"
    assert train.main(["--quick", "--devices", "2", "--xla-preset", "none", "--out", str(out),
                       "--no-scaling", "--compare-dispatch", "1,4", "--compare-matmul", "pallas"]) == 0
    result = json.loads((out / "train_bench.json").read_text())
    assert [r["steps_per_s_vs_first_k"] for r in result["dispatch"]] == pytest.approx([1.0, 1.6])
    assert [r["step_ms_vs_xla"] for r in result["matmul"]] == pytest.approx([1.0, 1.25])
    text = (out / "train_bench.md").read_text()
    assert "| 1.60x |" in text and "| 1.250x |" in text
    assert "peak mem and swing are one device's (the first of 2)" in text
    assert "TFLOP/s are all 2 devices' together" in text


def test_a_baseline_out_of_memory_in_a_grown_pool_says_to_preallocate(tmp_path, monkeypatch):
    """gpt-1b's f32 baseline on an 80 GB H100 ran out of memory on one 28.7 GiB buffer with
    XLA_PYTHON_CLIENT_PREALLOCATE=false: a pool grown in regions, none of which holds it. The
    hint named only the pool's size, and that by the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION
    (jaxlib refuses to start with both spellings set). A failure of another kind got the same
    memory advice; it now gets none."""
    def measure(self, run, workload=None, devices=None, runner=None, peak_window=None):
        if run.name == "baseline":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.70GiB")
        return _fake_measure(self, run, workload, devices)

    monkeypatch.setattr(train.Bench, "measure", measure)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    out = tmp_path / "out"
    assert train.main(["--quick", "--devices", "1", "--xla-preset", "none", "--out", str(out)]) == 0
    result = json.loads((out / "train_bench.json").read_text())
    assert result["allocator_env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    grown = ("this run grew its pool on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false), in regions "
             "no buffer spans two of: unset it (or set true) to reserve the pool as one")
    text = (out / "train_bench.md").read_text()
    assert "a larger allocator pool (XLA_CLIENT_MEM_FRACTION, 0.75 of the GPU unless set)" in text
    assert grown in text
    # Preallocated, or a JSON written before allocator_env: the size hint alone.
    for env in ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, None):
        old = {k: v for k, v in result.items() if k != "allocator_env"}
        rendered = train_report.render(old if env is None else {**result, "allocator_env": env})
        assert "may let it fit" in rendered and "grew its pool" not in rendered
    # A baseline that failed for another reason gets no memory advice.
    failed = [{"name": "baseline", "reason": "ValueError: no kernel for this shape"}]
    rendered = train_report.render({**result, "rows_failed": failed})
    assert ("baseline: no row, the run failed (ValueError: no kernel for this shape); speed-up "
            "and mem ratio need it\n") in rendered + "\n"
    assert "may let it fit" not in rendered and "grew its pool" not in rendered
