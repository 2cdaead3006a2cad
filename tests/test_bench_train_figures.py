"""`bench train`'s figures: each row names what it measured, and its ratios are taken
against the baseline row, also when another row fails."""

from __future__ import annotations

import json

import pytest

from jaxopt_train.bench import _timing, train, train_ablation, train_report, train_steps


@pytest.mark.parametrize("microbatches", [1, 2])
def test_every_ablation_row_that_adds_scan_accumulation_says_so(microbatches):
    """Was: "+grad_sync=ring" also switched the host loop to scan accumulation (the host
    loop reduces with psum only), so with micro-batches its speed-up was mostly scan's
    (gpt-tiny --quick, 4 CPU devices, --microbatches 4: 2.62x, against 2.66x for
    "+scan accumulation" alone), under a name that claimed it for the reduction."""
    workload = train_steps.Workload("gpt-tiny", 8, microbatches)
    baseline = train_steps.RunConfig("baseline")
    optimised = train_steps.RunConfig("optimised", policy="bf16", accumulation="scan",
                                      donate=True, grad_sync="ring", steps_per_dispatch=2,
                                      grad_dtype="compute", zero=1, compute_copy=True)
    runs, _ = train_ablation.ablation_runs(baseline, optimised, workload, num_devices=2)
    names = [r.name for r in runs]
    assert any(name.startswith("+grad_sync=ring") for name in names)
    for run in runs:
        if run.accumulation != baseline.accumulation and microbatches > 1:
            assert "scan accumulation" in run.name, run.name
    if microbatches == 1:  # no micro-batches: the host loop and the scan run the same step
        assert "+grad_sync=ring" in names


_STEP_S = {"baseline": 0.02, "optimised": 0.01, "+donate": 0.016}


def _fake_measure(self, run, workload=None, devices=None, runner=None, peak_window=None):
    """Figures from row_figures with a step time per row, no compiling; +bf16 fails."""
    if run.name == "+bf16":
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory\nmore")
    workload, devices = workload or self.workload, devices or self.devices
    step_s = _STEP_S.get(run.name, 0.0125)
    timing = _timing.BurstTiming([step_s, step_s * 1.1], [0.001, 0.001], 2, [0.002, 0.002])
    row = train_report.row_figures(
        name=run.name, timing=timing, trace=_timing.Trace([step_s], [100], [50, 60]),
        compile_s=1.0, items_per_step=workload.items_per_step,
        flops_per_step=workload.flops_per_step, unit=workload.unit, num_devices=len(devices),
        peak_tflops=self.peak, peak_memory=(int(step_s * 1e8), "xla-estimate"),
        dataset_items=self.dataset_items, gpu_hour_usd=self.args.gpu_hour_usd,
        steps_per_call=getattr(run, "steps_per_dispatch", 1))
    row.update(config=run.describe(), clocks={}, global_batch=workload.global_batch,
               attention_resolved=train_steps.resolved_attention(workload, run))
    return row


def test_ratios_are_against_the_baseline_when_another_row_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(train.Bench, "measure", _fake_measure)
    out = tmp_path / "out"
    assert train.main(["--quick", "--devices", "2", "--xla-preset", "none", "--ablate",
                       "--no-scaling", "--peak-tflops", "0.5", "--dataset-tokens", "1e6",
                       "--gpu-hour-usd", "3", "--out", str(out)]) == 0
    result = json.loads((out / "train_bench.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert "+bf16" not in rows and [f["name"] for f in result["rows_failed"]] == ["+bf16"]
    base = rows["baseline"]
    for row in rows.values():
        step_s = row["step_ms"] / 1e3
        assert row["speedup_vs_baseline"] == pytest.approx(base["step_ms"] / row["step_ms"])
        assert row["memory_ratio_vs_baseline"] == pytest.approx(
            row["peak_memory_bytes"] / base["peak_memory_bytes"])
        assert row["mfu"] == pytest.approx(result["flops_per_step"] / step_s / 1e12 / (0.5 * 2))
        assert row["epoch_cost_usd"] == pytest.approx(1e6 / row["throughput"] / 3600 * 2 * 3)
    assert rows["+donate"]["speedup_vs_baseline"] == pytest.approx(0.021 / 0.0168)
    table = (out / "train_bench.md").read_text()
    assert "| +donate | 16.80 |" in table and table.count("| 1.25x |") == 1  # 21 / 16.8 ms
