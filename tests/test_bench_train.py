"""`jaxopt-train bench train` in CPU small mode, plus its helpers against references."""

from __future__ import annotations

import argparse
import json
import math
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.bench import _timing, train, train_ablation, train_report, train_steps
from jaxopt_train.models.flops import gpt_flops_per_token, resnet_flops_per_image


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_train")
    argv = ["--quick", "--devices", "2", "--xla-preset", "none", "--peak-tflops", "0.5",
            "--memory-budget", "1GiB", "--compare-matmul", "pallas", "--compute-copy",
            "--split-qkv", "--fuse-mlp-activation", "--compare-plain",
            "--out", str(out), "--json", str(out / "raw.json")]
    assert train.main(argv) == 0
    return out, json.loads((out / "train_bench.json").read_text())


def test_quick_bench_rows_are_consistent(quick_run):
    _, result = quick_run
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows)[:2] == ["baseline", "optimised"]
    workload = train_steps.Workload("gpt-tiny", 8, 2, seq_len=32, n_layers=1)
    assert result["items_per_step"] == 8 * 32
    assert result["flops_per_step"] == gpt_flops_per_token(workload.gpt_config()) * 8 * 32
    for row in rows.values():
        step_s = row["step_ms"] / 1e3
        assert 0 < step_s < 60
        assert row["step_ms"] == pytest.approx(float(np.median(row["step_ms_bursts"])))
        assert row["throughput"] == pytest.approx(result["items_per_step"] / step_s)
        assert row["tflops"] == pytest.approx(result["flops_per_step"] / step_s / 1e12)
        assert row["mfu"] == pytest.approx(row["tflops"] / (0.5 * 2))  # --peak-tflops x 2 devices
        assert row["peak_memory_bytes"] > 0 and row["peak_memory_source"] in ("allocator", "xla-estimate")
        assert row["memory_swing_bytes"] >= 0
        assert row["compile_s"] > 0 and row["host_dispatch_ms_per_step"] > 0
        assert row["epoch_hours"] == pytest.approx(10e9 / row["throughput"] / 3600)
        assert row["epoch_cost_usd"] == pytest.approx(row["epoch_hours"] * 2 * 2.5)
        assert len(row["trace_step_ms"]) == 3
    assert rows["baseline"]["speedup_vs_baseline"] == 1.0
    opt = rows["optimised"]
    assert opt["config"]["policy"] == "bf16" and opt["config"]["donate"]
    assert opt["config"]["accumulation"] == "scan" and opt["steps_per_dispatch"] == 2
    assert opt["config"]["compute_copy"] and not rows["baseline"]["config"]["compute_copy"]
    assert opt["config"]["split_qkv"] and not rows["baseline"]["config"]["split_qkv"]
    assert opt["speedup_vs_baseline"] == pytest.approx(rows["baseline"]["step_ms"] / opt["step_ms"])
    # The bench holds no state of its own while timing: on CPU (live arrays) neither the
    # donated nor the non-donated step shows a second copy of the state at rest.
    assert rows["baseline"]["memory_swing_bytes"] < 0.05 * rows["baseline"]["trace_bytes_at_rest"][0]
    # A 1 GiB budget fits the tiny model without remat, checked by AOT memory analysis.
    assert result["remat_trials"][0]["remat"] == "none" and result["remat_trials"][0]["fits"]
    # --zero 1 (the default) on 2 devices reduce-scatters per leaf: no all-reduce is timed or named.
    assert result["grad_sync_ms"] == {} and opt["config"]["grad_sync"] == "psum"
    assert result["grad_sync_collective"].startswith("reduce-scatter per leaf")
    assert result["mfu_denominator"] == "0.5 TFLOP/s x 2 device(s) (--peak-tflops)"
    assert result["xla_flags"]["preset"] == "none"


def test_quick_bench_scaling_and_outputs(quick_run):
    out, result = quick_run
    scaling = result["scaling"]
    assert scaling["num_devices"] == 2 and scaling["one_device_global_batch"] == 4
    assert scaling["efficiency"] == pytest.approx(
        scaling["throughput"] / (2 * scaling["one_device_throughput"]))
    assert scaling["one_device_row"]["num_devices"] == 1
    table = (out / "train_bench.md").read_text()
    assert "| config | step ms | tokens/s | TFLOP/s | MFU |" in table
    assert "| baseline |" in table and "| optimised |" in table and "scaling efficiency" in table
    assert "bf16 weight copy kept in the state" in table
    assert "model gpt-tiny (quick: layers=1, seq_len=32; uniform random ids)," in table
    assert "grad_sync=reduce-scatter per leaf" in table and "MFU denominator: 0.5 TFLOP/s" in table
    assert json.loads((out / "raw.json").read_text())["rows"][0]["name"] == "baseline"
    png = (out / "train_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    import matplotlib.image  # noqa: PLC0415

    height, width, _ = matplotlib.image.imread(out / "train_bench.png").shape
    assert height > 300 and width > 300


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as strict parsers (jq, JavaScript) do."""
    def refuse(name):
        raise ValueError(f"non-finite {name} in the JSON")
    return json.loads(text, parse_constant=refuse)


def test_quick_bench_json_is_strict_and_lists_the_defaulted_flags(quick_run):
    """`args.defaulted` was a set, written by default=str as "{'steps', ...}" in set order."""
    out, result = quick_run
    for name in ("train_bench.json", "raw.json"):
        assert _strict_json((out / name).read_text())["args"]["defaulted"] == sorted(train.QUICK)


def test_report_json_refuses_non_finite_figures_before_writing(tmp_path):
    args = argparse.Namespace(json=str(tmp_path / "raw.json"), out=None)
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        train_report.write_outputs(args, {"epoch_hours": math.inf}, "table")
    assert not (tmp_path / "raw.json").exists()  # not a half-written report


def _report_files(tmp_path):
    """args, result and text for write_outputs, with one row save_plot can draw."""
    row = {"name": "optimised", "config": {}, "trace_bytes_at_rest": [2**30, 2**30],
           "trace_bytes_in_flight": [2**31], "throughput": 100.0, "step_ms": 10.0,
           "trace_step_ms": [10.0, 11.0], "memory_source": "allocator"}
    args = argparse.Namespace(json=str(tmp_path / "raw.json"), out=str(tmp_path / "out"))
    return args, {"unit": "tokens", "rows": [row]}, "table"


def test_report_files_land_together(tmp_path):
    args, result, text = _report_files(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train_bench.md").write_text("an earlier report")
    train_report.write_outputs(args, result, text)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(train_report.REPORT_FILES)
    assert (tmp_path / "out" / "train_bench.md").read_text() == "table\n"
    assert (tmp_path / "out" / "train_bench.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((tmp_path / "raw.json").read_text()) == result


def test_a_failing_plot_leaves_the_earlier_report_whole(tmp_path, monkeypatch):
    # Was: the new .md and .json were written, then the plot raised, leaving them beside
    # the previous run's .png.
    args, result, text = _report_files(tmp_path)
    (tmp_path / "out").mkdir()
    earlier = {"train_bench.md": b"old md", "train_bench.json": b"{}", "train_bench.png": b"old png"}
    for name, data in earlier.items():
        (tmp_path / "out" / name).write_bytes(data)

    def failing_plot(rows, path, unit):
        with open(path, "wb") as f:
            f.write(b"half a png")
        raise RuntimeError("matplotlib failed")

    monkeypatch.setattr(train_report, "save_plot", failing_plot)
    with pytest.raises(RuntimeError, match="matplotlib failed"):
        train_report.write_outputs(args, result, text)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == earlier  # no temporaries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nor --json


@pytest.mark.parametrize("argv, message", [
    (["--dataset-tokens", "inf"], "--dataset-tokens=inf must be > 0 and finite"),
    (["--dataset-tokens", "nan"], "--dataset-tokens=nan must be > 0 and finite"),
    (["--peak-tflops", "inf"], "--peak-tflops=inf must be > 0 and finite"),
    (["--gpu-hour-usd", "inf"], "--gpu-hour-usd=inf must be >= 0 and finite"),
])
def test_non_finite_figures_are_refused(argv, message, capsys):
    assert message in _refused(["--quick", *argv], capsys)


def test_quick_bench_compares_the_pallas_matmul(quick_run):
    out, result = quick_run
    xla, pallas = result["matmul"]
    assert xla["name"] == "optimised" and xla["config"]["matmul"] == "xla"
    assert pallas["config"] == {**xla["config"], "name": "optimised, matmul=pallas", "matmul": "pallas"}
    assert pallas["config"]["fuse_mlp_activation"]  # --fuse-mlp-activation: its MLP is fused
    assert "fc + bias + GELU in one launch" in (out / "train_bench.md").read_text()
    assert pallas["step_ms"] > 0 and pallas["compile_s"] > 0
    table = (out / "train_bench.md").read_text()
    assert "| matmul | step ms |" in table and "| pallas |" in table and "| xla |" in table
    assert f"| {pallas['step_ms'] / xla['step_ms']:.3f}x |" in table


def test_quick_bench_adds_the_plain_flax_rows(quick_run):
    out, result = quick_run
    rows = {r["name"]: r for r in result["rows"]}
    mixed, pure = rows["plain Flax+optax, f32 master"], rows["plain Flax+optax, bf16 params"]
    assert mixed["config"]["param_dtype"] == "float32" and pure["config"]["param_dtype"] == "bfloat16"
    assert mixed["attention_resolved"] == rows["optimised"]["attention_resolved"] == "xla"
    for row in (mixed, pure):  # data parallel over the same 2 devices, ratios against the baseline
        assert row["num_devices"] == 2 and row["memory_swing_bytes"] < 1024  # donated (a loss scalar)
        assert row["speedup_vs_baseline"] == pytest.approx(rows["baseline"]["step_ms"] / row["step_ms"])
    text = (out / "train_bench.md").read_text()
    ratio = mixed["step_ms"] / rows["optimised"]["step_ms"]
    assert f"optimised vs plain Flax+optax, f32 master: {ratio:.3f}x the throughput" in text


def test_a_failing_plain_loop_costs_only_its_row(quick_run, monkeypatch):
    # e.g. the plain loop (no remat, no accumulation) out of memory on a big model:
    # the rows already measured and the other plain row stay, the table says why.
    from jaxopt_train.bench import plain  # noqa: PLC0415

    def build(cfg, global_batch, run, mesh, text=False):
        if run.variant == "pure":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate\nmore")
        return "runner"

    class FakeBench:
        workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=16, n_layers=1)
        devices = jax.devices()[:1]

        def measure(self, run, runner, peak_window):
            assert runner == "runner"
            return {"name": run.name}

    monkeypatch.setattr(plain, "build_plain_runner", build)
    rows, failed = train._plain_rows(FakeBench(), "xla")
    assert rows == [{"name": "plain Flax+optax, f32 master"}]
    assert failed == [{"name": "plain Flax+optax, bf16 params",
                       "reason": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate"}]
    _, result = quick_run
    text = train_report.render({**result, "plain_failed": failed})
    assert ("plain Flax+optax, bf16 params: no row, the run failed (RuntimeError: RESOURCE_EXHAUSTED"
            in text)


def _refused(argv, capsys) -> str:
    """The usage error `bench train` exits with (status 2, as argparse's own errors)."""
    with pytest.raises(SystemExit) as exc:
        train._parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_compare_plain_is_for_gpt_models_only(capsys):
    assert "--compare-plain applies to GPT models, not --model resnet50" in _refused(
        ["--model", "resnet50", "--compare-plain"], capsys)


def test_pallas_matmul_step_matches_xla_step():
    # The bench's optimised step with our kernel (interpret mode on CPU) against
    # the same step with XLA's dot: same losses, same parameter updates.
    workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=16, n_layers=1)
    mesh = train_steps.data_mesh(jax.devices()[:1])
    results = {}
    for matmul in ("xla", "pallas"):
        run = train_steps.RunConfig(matmul, policy="bf16", accumulation="scan", donate=True,
                                    grad_dtype="compute", matmul=matmul)
        runner = train_steps.build_runner(workload, run, mesh)
        state = runner.state
        first = jax.tree.map(np.array, state[0])  # copied: the step donates its input
        losses = []
        for _ in range(2):
            state, loss = runner.step(state)
            losses.append(float(np.asarray(loss).reshape(-1)[-1]))
        update = jax.tree.map(lambda new, old: np.asarray(new, np.float64) - old, state[0], first)
        results[matmul] = (losses, jax.tree.leaves(update))
    (xla_losses, xla_update), (pallas_losses, pallas_update) = results["xla"], results["pallas"]
    assert pallas_losses == pytest.approx(xla_losses, rel=1e-3)
    total = sum(np.abs(u).sum() for u in xla_update)
    assert total > 0
    # bf16 operands: the two kernels round differently, so a few tiny gradients'
    # Adam directions differ; a wrong backward would differ everywhere.
    # (measured: 0.0007; scaling dA by 1.1 gives 0.024.)
    assert sum(np.abs(p - x).sum() for p, x in zip(pallas_update, xla_update)) / total < 0.01


def test_matmul_choice_is_validated(capsys):
    with pytest.raises(ValueError, match="legal values"):
        train_steps.RunConfig("x", matmul="cutlass")
    mesh = train_steps.data_mesh(jax.devices()[:1])
    with pytest.raises(ValueError, match="bf16/fp16 compute dtype"):
        train_steps.build_runner(train_steps.Workload("gpt-tiny", 4, seq_len=8, n_layers=1),
                                 train_steps.RunConfig("x", matmul="pallas"), mesh)
    with pytest.raises(ValueError, match="applies to GPT models"):
        train_steps.build_runner(train_steps.Workload("resnet18", 4, image_size=16),
                                 train_steps.RunConfig("x", policy="bf16", matmul="pallas"), mesh)
    assert "expected a comma list" in _refused(["--quick", "--compare-matmul", "xla"], capsys)
    assert "applies to GPT models" in _refused(["--model", "resnet50", "--compare-matmul", "pallas"],
                                               capsys)


def test_host_loop_and_scan_accumulation_take_the_same_step():
    # The baseline (one jit call per micro-batch + optax.MultiSteps) and the
    # in-graph scan accumulation must train identically in f32: 2 optimizer steps.
    workload = train_steps.Workload("gpt-tiny", 4, 2, seq_len=8, n_layers=1)
    mesh = train_steps.data_mesh(jax.devices()[:1])
    host = train_steps.build_runner(workload, train_steps.RunConfig("host"), mesh)
    scan = train_steps.build_runner(
        workload, train_steps.RunConfig("scan", accumulation="scan", donate=True), mesh)
    host_state, scan_state = host.state, scan.state
    first = jax.tree.map(np.asarray, host_state[0])
    for _ in range(2):
        host_state, _ = host.step(host_state)
        scan_state, _ = scan.step(scan_state)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), host_state[0], first))
    assert max(moved) > 1e-5  # the optimizer really stepped (twice)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 host_state[0], scan_state[0])


def test_workload_flops_match_the_model_formulas():
    gpt = train_steps.Workload("gpt-124m", 8, seq_len=256)
    assert gpt.items_per_step == 8 * 256
    assert gpt.flops_per_step == gpt_flops_per_token(gpt.gpt_config()) * 8 * 256
    assert gpt.gpt_config().seq_len == 256
    vision = train_steps.Workload("resnet50", 16)
    assert vision.unit == "images" and vision.items_per_step == 16
    assert vision.flops_per_step == resnet_flops_per_image("resnet50", image_size=224) * 16
    with pytest.raises(ValueError, match="legal values"):
        train_steps.Workload("gpt-huge", 8)
    with pytest.raises(ValueError, match="accumulation='scan'"):
        train_steps.RunConfig("x", accumulation="host", steps_per_dispatch=4)


def test_time_bursts_syncs_once_per_burst_and_counts_steps():
    calls = []

    def step(state):
        calls.append(state)
        return state + 1, jnp.zeros(())

    state, timing = _timing.time_bursts(step, 0, bursts=3, calls_per_burst=4, steps_per_call=2)
    assert state == 12 and len(calls) == 12 and timing.steps_per_burst == 8
    assert len(timing.wall_s) == 3 and all(w >= d > 0 for w, d in zip(timing.wall_s, timing.dispatch_s))


def test_dispatch_time_is_the_fastest_call_not_the_waiting():
    # A call that waits for the device's queue (here: sleeps) must not count as launch cost.
    waits = iter([0.0, 0.05, 0.05, 0.0, 0.05, 0.05])

    def step(state):
        time.sleep(next(waits))
        return state + 1, jnp.zeros(())

    _, timing = _timing.time_bursts(step, 0, bursts=2, calls_per_burst=3, steps_per_call=2)
    assert all(d < 0.01 for d in timing.dispatch_s)  # 2 steps per call: < 5 ms per step
    assert all(0.1 / 6 <= c < 0.1 / 6 + 0.01 for c in timing.in_calls_s)
    assert all(w >= c for w, c in zip(timing.wall_s, timing.in_calls_s))


def test_live_array_bytes_counts_a_new_array_exactly():
    device = jax.devices()[0]
    before = _timing.live_array_bytes(device)
    x = jax.device_put(np.ones((256, 64), np.float32), device)
    assert _timing.live_array_bytes(device) - before == x.nbytes
    del x


def test_row_without_peak_has_no_mfu_and_table_says_na():
    timing = _timing.BurstTiming([0.5, 0.25, 0.75], [0.1, 0.1, 0.1], 4)
    trace = _timing.Trace([0.5], [100], [50, 150])
    row = train_report.row_figures(
        name="baseline", timing=timing, trace=trace, compile_s=1.0, items_per_step=1000,
        flops_per_step=2e12, unit="tokens", num_devices=1, peak_tflops=None,
        peak_memory=(None, "unavailable"), dataset_items=1e6, gpu_hour_usd=3.0, steps_per_call=1)
    assert row["step_ms"] == 500 and row["throughput"] == 2000 and row["tflops"] == 4.0
    assert row["mfu"] is None and row["memory_swing_bytes"] == 100
    assert math.isclose(row["epoch_cost_usd"], 500 / 3600 * 3.0)
    train_report.add_ratios([row], row)
    line = train_report.markdown_table([row], "tokens").splitlines()[2]
    assert "| n/a |" in line and "1.00x" in line


@pytest.mark.parametrize("flops, wall_s, devices, peak", [
    (2e12, [0.5, 0.25, 0.75], 1, 989.0), (6.3e15, [0.087, 0.09, 0.088], 8, 989.0),
    (1.234e9, [1e-3], 2, 312.0), (2e12, [0.5], 4, None),
])
def test_row_mfu_is_the_tested_mfu_formula(monkeypatch, flops, wall_s, devices, peak):
    """row_figures had its own inline MFU; the figures stay what that formula gave."""
    from jaxopt_train.train.mfu import mfu

    def row(peak_tflops):
        timing = _timing.BurstTiming(wall_s, [0.1] * len(wall_s), 4)
        return train_report.row_figures(
            name="r", timing=timing, trace=_timing.Trace([0.5], [100], [50]), compile_s=1.0,
            items_per_step=1000, flops_per_step=flops, unit="tokens", num_devices=devices,
            peak_tflops=peak_tflops, peak_memory=(None, "unavailable"), dataset_items=1e6,
            gpu_hour_usd=3.0, steps_per_call=1)

    step_s = float(np.median(wall_s))
    got = row(peak)["mfu"]
    assert got == mfu(flops, step_s, peak, devices)
    if peak is None:
        assert got is None
    else:  # the inline formula it replaced, up to rounding
        assert got == pytest.approx(flops / step_s / 1e12 / (peak * devices), rel=1e-12)
    monkeypatch.setattr(train_report, "mfu", lambda *args: ("the one formula", args))
    assert row(peak)["mfu"] == ("the one formula", (flops, step_s, peak, devices))


def test_ablations_switch_one_technique_each(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where cuDNN attention runs:
    gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu])  # Ampere or newer
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: [gpu])
    workload = train_steps.Workload("gpt-tiny", 8, 2)
    baseline = train_steps.RunConfig("baseline")
    optimised = train_steps.RunConfig("optimised", policy="bf16", attention="cudnn",
                                      accumulation="scan", donate=True, remat="dots",
                                      grad_sync="ring", steps_per_dispatch=4, opt_state="bf16",
                                      grad_dtype="compute", zero=1, compute_copy=True,
                                      split_qkv=True)
    runs, skipped = train_ablation.ablation_runs(baseline, optimised, workload, num_devices=2)
    changed = {r.name: {k for k, v in r.describe().items() if k != "name" and v != getattr(baseline, k)}
               for r in runs}
    assert changed["+bf16"] == {"policy"}
    assert changed["+donate"] == {"donate"}
    assert changed["+remat=dots"] == {"remat"}
    assert changed["+scan accumulation"] == {"accumulation"}
    assert changed["+bf16+cudnn attention"] == {"policy", "attention"}
    assert changed["+bf16 optimizer state"] == {"opt_state"}
    assert changed["+bf16 gradients (+scan accumulation)"] == {"policy", "grad_dtype", "accumulation"}
    assert changed["+zero=1 (+scan accumulation)"] == {"zero", "accumulation"}
    assert changed["+bf16 weight copy in the state (+bf16 gradients, +scan accumulation)"] == {
        "policy", "grad_dtype", "accumulation", "compute_copy"}
    assert changed["+q, k, v from three products (+bf16+cudnn attention)"] == {
        "policy", "attention", "split_qkv"}
    assert [s["name"] for s in skipped] == ["+xla flags"]
    _, skipped = train_ablation.ablation_runs(baseline, optimised, workload, num_devices=1)
    assert "+zero=1 (+scan accumulation)" in [s["name"] for s in skipped]
    with pytest.raises(ValueError, match="accumulation='scan'"):
        train_steps.RunConfig("bad", policy="bf16", grad_dtype="compute")
    with pytest.raises(ValueError, match="legal values"):
        train_steps.RunConfig("bad", opt_state="fp8")


@pytest.mark.parametrize("argv", [["--quick", "--steps", "0"], ["--model", "gpt-huge"],
                                  ["--quick", "--remat", "sometimes"]])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        train.main(argv)


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0"], "--devices=0 must be >= 1"),
    (["--devices", "99"], "--devices=99, but only 8 cpu device(s) are visible"),
    (["--memory-budget", "12XB"], "cannot read a byte count from --memory-budget='12XB'"),
    (["--memory-budget", "0GiB"], "--memory-budget '0GiB' must be more than 0 bytes"),
    # Read only to pick a GPT remat policy under --remat auto: elsewhere silently ignored.
    (["--memory-budget", "1GiB", "--remat", "dots"], "--remat dots is fixed, so it would be ignored"),
    (["--memory-budget", "1GiB", "--model", "cnn-small"], "--model cnn-small has no remat policies"),
    (["--compare-dispatch", "1,x"], "expected a comma list of steps per dispatch, e.g. 1,4,16"),
    (["--compare-dispatch", "4,0"], "every k must be >= 1"),
    (["--peak-tflops", "-1"], "--peak-tflops=-1.0 must be > 0"),
    (["--dataset-tokens", "0"], "--dataset-tokens=0.0 must be > 0"),
    (["--global-batch", "3", "--microbatches", "2"],
     "global_batch=3 is not divisible by num_microbatches=2"),
    (["--global-batch", "4", "--microbatches", "2"],  # 2 per micro-batch over 8 devices
     "micro-batch size 2 (global_batch=4 / num_microbatches=2) is not divisible by num_devices=8"),
    (["--gpu-hour-usd", "-1"], "--gpu-hour-usd=-1.0 must be >= 0"),
])
def test_bad_values_exit_with_the_reason(argv, message, capsys):
    # Refused before anything is compiled or timed, as usage errors (status 2): the flag
    # values at once, the device count and batch split once the backend has started.
    with pytest.raises(SystemExit) as exc:
        train.main(["--quick", "--xla-preset", "none", *argv])
    assert message in capsys.readouterr().err
    assert exc.value.code == 2


@pytest.mark.gpu
def test_gpu_optimised_uses_cudnn_and_reports_mfu(tmp_path):
    argv = ["--model", "gpt-tiny", "--steps", "8", "--bursts", "2", "--trace-steps", "2",
            "--warmup-s", "0", "--devices", "1", "--compare-plain", "--json", str(tmp_path / "r.json")]
    assert train.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    opt = next(r for r in result["rows"] if r["name"] == "optimised")
    assert opt["attention_resolved"] == "cudnn"
    plain_rows = [r for r in result["rows"] if r["config"].get("plain")]
    assert [r["attention_resolved"] for r in plain_rows] == ["cudnn", "cudnn"]
    assert opt["peak_memory_source"] in ("allocator", "xla-estimate") and opt["memory_source"] == "allocator"
    assert 100 < opt["clocks"].get("sm_clock_mhz", 0) < 3000, opt["clocks"]  # NVML sampled the GPU
    if result["peak_tflops_per_device"] is not None:
        assert 0 < opt["mfu"] < 1


@pytest.mark.parametrize("flag", ["split_qkv", "fuse_mlp_activation"])
def test_gpt_layout_flags_are_for_gpt_models_only(flag, capsys):
    option = "--" + flag.replace("_", "-")
    assert f"{option} applies to GPT models, not --model resnet50" in _refused(
        ["--model", "resnet50", option], capsys)
    workload = train_steps.Workload("cnn-small", 8, 1)
    with pytest.raises(ValueError, match=f"{flag}=True applies to GPT models"):
        train_steps.build_model(workload, train_steps.RunConfig("x", **{flag: True}), None)


@pytest.mark.parametrize("argv, want", [
    (["--model", "gpt-124m"], None), (["--model", "resnet50"], None),
    (["--model", "gpt-124m", "--compare-matmul", "pallas", "--no-fuse-mlp-activation"], False),
    (["--model", "gpt-124m", "--compare-matmul", "pallas", "--fuse-mlp-activation"], True)])
def test_fuse_mlp_activation_flag_is_three_way(argv, want):
    """Default None: GPT fuses where the kernel applies the GELU itself (Mosaic GPU, Triton)."""
    assert train._parse(argv).fuse_mlp_activation is want


@pytest.mark.parametrize("model, flag", [  # (--fuse-mlp-activation on resnet50: not GPT, above)
    ("gpt-124m", "--fuse-mlp-activation"), ("gpt-124m", "--no-fuse-mlp-activation"),
    ("resnet50", "--no-fuse-mlp-activation")])
def test_fuse_mlp_activation_needs_compare_matmul(model, flag, capsys):
    """It sets only the --compare-matmul rows: alone it did nothing, yet the JSON said it was on."""
    err = _refused(["--model", model, flag], capsys)
    assert f"{flag} sets the GPT rows of --compare-matmul pallas|triton" in err
    assert f"add --compare-matmul or drop {flag}" in err


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--warmup", "-1"], "--warmup=-1 must be >= 0"),
    (["--quick", "--bursts", "0"], "--bursts=0 must be >= 1"),
    (["--quick", "--warmup-s", "-1"], "--warmup-s=-1.0 must be a finite number of seconds >= 0"),
    (["--quick", "--warmup-s", "inf"], "--warmup-s=inf must be"),
    (["--quick", "--warmup-s", "nan"], "--warmup-s=nan must be"),
])
def test_warmup_and_burst_flags_are_validated(argv, message, capsys):
    assert message in _refused(argv, capsys)


def test_warm_up_runs_the_count_then_whole_bursts_until_the_seconds_pass(monkeypatch):
    out = jax.block_until_ready(jnp.zeros(()))  # made before the clock is faked: no jax inside
    clock = iter(range(100))  # each perf_counter() read advances one "second"
    monkeypatch.setattr(_timing.time, "perf_counter", lambda: float(next(clock)))
    calls = []

    def step(state):
        calls.append(state)
        return state + 1, out

    assert _timing.warm_up(step, 0, 3) == 3  # no seconds: the count alone
    calls.clear()
    # start at t, the checks read t+1, t+2, t+3: three bursts of 3 reach 2.5 s
    assert _timing.warm_up(step, 0, 3, seconds=2.5) == 9
    assert calls == list(range(9))


class _FakeDevice:
    def __init__(self, platform, id_, local=None):
        self.platform, self.id, self.local_hardware_id = platform, id_, local


@pytest.mark.parametrize("visible, devices, want", [
    (None, [("gpu", 0), ("gpu", 1)], [0, 1]),
    ("1", [("gpu", 0)], [1]),
    ("3,2", [("gpu", 0), ("gpu", 1)], [3, 2]),
    ("GPU-0f3c", [("gpu", 0)], None),
    ("0", [("gpu", 0), ("gpu", 1)], None),
    (None, [("cpu", 0)], None),
])
def test_nvml_indices_follow_cuda_visible_devices(monkeypatch, visible, devices, want):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    indices, reason = _timing.nvml_indices([_FakeDevice(p, i) for p, i in devices])
    assert indices == want
    assert bool(reason) == (want is None)


def test_gpu_clocks_reports_clock_power_and_cap_of_the_devices_gpus(monkeypatch):
    from test_runtime_nvml import FakeGPU, install_fake_nvml, make_fake_nvml

    gpus = [FakeGPU(sm_clock=1980, power_mw=120_000),  # the idle GPU: not watched
            FakeGPU(sm_clock=1575, power_mw=692_000, clock_reasons=_timing.SW_POWER_CAP)]
    install_fake_nvml(monkeypatch, make_fake_nvml(gpus))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with _timing.gpu_clocks([_FakeDevice("gpu", 0)], interval_s=0.01) as clocks:
        assert clocks == {}  # filled when the block ends
        time.sleep(0.05)
    assert clocks["nvml_gpus"] == [1] and clocks["samples"] >= 2
    assert clocks["sm_clock_mhz"] == 1575 and clocks["sm_clock_mhz_range"] == [1575, 1575]
    assert clocks["power_w"] == 692.0 and clocks["power_capped"] == 1.0
    note = train_report.clock_notes([{"name": "optimised", "clocks": clocks},
                                     {"name": "baseline", "clocks": {"reason": "x"}}])
    assert note == ["SM clock while timed (median over GPUs and samples; the MFU denominator "
                    "assumes the datasheet clock): optimised 1575 MHz (1575-1575), 692 W, "
                    "power-capped in 100% of samples"]


def test_gpu_clocks_says_why_not_on_cpu():
    with _timing.gpu_clocks(jax.devices()[:1]) as clocks:
        pass
    assert clocks == {"reason": "not running on GPUs"}
    assert train_report.clock_notes([{"name": "optimised", "clocks": clocks}]) == []


def _bench_args(**changes):
    import argparse  # noqa: PLC0415

    values = dict(bursts=1, steps=2, warmup=1, warmup_s=0.0, trace_steps=3, gpu_hour_usd=1.0,
                  dataset_tokens=None)
    return argparse.Namespace(**{**values, **changes})


def test_a_non_donated_row_keeps_one_state_at_rest():
    # The bench's own reference to the state entering the trace was a second copy of a
    # non-donated state in every sample after the first (swing = one state).
    devices = jax.devices()[:1]
    workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=16, n_layers=1)
    runner = train_steps.build_runner(workload, train_steps.RunConfig("baseline"),
                                      train_steps.data_mesh(devices))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.state))
    bench = train.Bench(_bench_args(), workload, devices, None)
    row = bench.measure(train_steps.RunConfig("baseline"), runner=runner)
    assert row["memory_source"] == "live-arrays" and not row["config"]["donate"]
    assert row["memory_swing_bytes"] < 0.05 * state_bytes, (row["trace_bytes_at_rest"], state_bytes)
    assert runner.state is None


def test_timed_steps_run_with_the_collector_frozen_and_it_is_unfrozen_after(monkeypatch):
    # A generation-2 pass over the compiled step's objects took a gpt-1b step from 0.09 to
    # 0.28-0.40 s on the H200: a burst it lands in is skewed. The trainer's loop freezes them
    # after compiling; the bench's warm-up, bursts and trace must too, and undo it per row.
    import gc  # noqa: PLC0415

    devices = jax.devices()[:1]
    workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=16, n_layers=1)
    runner = train_steps.build_runner(workload, train_steps.RunConfig("baseline"),
                                      train_steps.data_mesh(devices))
    seen, step = [], runner.step

    def counting_step(state):
        seen.append(gc.get_freeze_count())
        return step(state)

    runner.step = counting_step
    train.Bench(_bench_args(), workload, devices, None).measure(
        train_steps.RunConfig("baseline"), runner=runner)
    # warm-up 1 + 2 bursted + 3 traced calls, each with the compiled step's objects frozen
    assert len(seen) == 6 and min(seen) > 1000, seen
    assert gc.get_freeze_count() == 0


def test_handoff_leaves_the_caller_no_reference():
    seen = []

    def step(state):
        seen.append(state)
        return state + 1, jnp.zeros(())

    handoff = _timing.Handoff(0)
    assert _timing.warm_up(step, handoff, 2) is handoff and handoff.state == 2
    handoff, _ = _timing.time_bursts(step, handoff, bursts=1, calls_per_burst=2, steps_per_call=1)
    handoff, trace = _timing.trace_steps(step, handoff, calls=1, steps_per_call=1,
                                         device=jax.devices()[0])
    assert handoff.state == 5 and seen == [0, 1, 2, 3, 4] and len(trace.bytes_at_rest) == 2


def test_plain_rows_open_the_memory_window_before_the_runner_holds_its_state(monkeypatch):
    # The XLA estimate counts the step's arguments: a window taken after the runner built
    # its state counted that state twice.
    from jaxopt_train.bench import plain  # noqa: PLC0415

    device = jax.devices()[0]
    held = []

    def build(cfg, global_batch, run, mesh, text=False):
        held.append(jax.device_put(np.ones((1024, 256), np.float32), device))
        return "runner"

    class FakeBench:
        workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=16, n_layers=1)
        devices = [device]
        windows = []

        def measure(self, run, runner, peak_window=None):
            assert peak_window is not None, "the plain row's window was left to measure()"
            self.windows.append((peak_window[1], _timing.bytes_in_use(device)))
            return {"name": run.name}

    monkeypatch.setattr(plain, "build_plain_runner", build)
    bench = FakeBench()
    rows, failed = train._plain_rows(bench, "xla")
    assert failed == [] and len(rows) == len(bench.windows) == 2
    for in_use_before, in_use_now in bench.windows:
        assert in_use_now - in_use_before >= 1024 * 256 * 4  # the runner's state is not in it


def _exit_2(capsys, call, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        call(*args)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    return err


def _checked(argv) -> list:
    """Every check `bench train` makes before its first row, the output paths last."""
    return train.run_devices(train._parse(argv))


def test_output_paths_are_checked_before_the_run(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _exit_2(capsys, _checked, ["--quick", "--out", str(afile)])
    assert "--out" in err and "exists and is not a folder" in err
    err = _exit_2(capsys, _checked, ["--quick", "--json", str(tmp_path)])
    assert "--json" in err and "is a folder" in err
    _checked(["--quick", "--json", str(tmp_path / "new" / "deeper" / "x.json")])
    assert (tmp_path / "new" / "deeper").is_dir()


def test_existing_reports_are_replaced_only_with_overwrite(tmp_path, capsys):
    (tmp_path / "train_bench.md").write_text("an earlier report")
    (tmp_path / "raw.json").write_text("{}")
    err = _exit_2(capsys, _checked, ["--quick", "--out", str(tmp_path)])
    assert "already holds train_bench.md" in err and "--overwrite" in err
    err = _exit_2(capsys, _checked, ["--quick", "--json", str(tmp_path / "raw.json")])
    assert "already exists" in err and "--overwrite" in err
    _checked(["--quick", "--out", str(tmp_path), "--json", str(tmp_path / "raw.json"), "--overwrite"])


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--compare-matmul", "triton"],
                                  ["--devices", "99"], ["--global-batch", "3", "--microbatches", "2"]])
def test_a_refused_run_leaves_no_output_folder(argv, tmp_path, monkeypatch):
    """The folders were made while the flags were read, before the checks that then refused."""
    monkeypatch.setattr(train.Bench, "measure", lambda *a, **k: pytest.fail("measured a row"))
    with pytest.raises(SystemExit):
        train.main(["--quick", "--xla-preset", "none", "--out", str(tmp_path / "out" / "deep"),
                    "--json", str(tmp_path / "raw" / "r.json"), *argv])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_out_folder_holding_a_report_refuses_before_the_json_folder_is_made(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train_bench.md").write_text("KEEP")
    err = _exit_2(capsys, _checked, ["--quick", "--out", str(tmp_path / "out"),
                                     "--json", str(tmp_path / "new" / "r.json")])
    assert "already holds train_bench.md" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "train_bench.md").read_text() == "KEEP"


@pytest.mark.parametrize("argv, message", [
    (["--compare-matmul", "triton"], "--compare-matmul triton: matmul='triton' is unavailable here"),
    (["--zero", "0", "--grad-sync", "peer", "--devices", "2"], "--grad-sync peer: the peer all-reduce"),
])
def test_backends_the_machine_lacks_are_refused_before_the_first_row(argv, message, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(train.Bench, "measure", lambda *a, **k: pytest.fail("measured a row"))
    monkeypatch.setattr(train, "choose_grad_sync", lambda *a: pytest.fail("timed grad sync"))
    err = _exit_2(capsys, train.main, ["--quick", "--xla-preset", "none", *argv])
    assert message in err


def test_grad_sync_is_refused_under_zero_1_and_reported_as_reduce_scatter(capsys):
    err = _exit_2(capsys, train._parse, ["--quick", "--grad-sync", "ring"])
    assert "--grad-sync ring does nothing with --zero 1" in err and "use --zero 0" in err
    assert train._parse(["--quick", "--zero", "0", "--grad-sync", "ring"]).grad_sync == "ring"
    run = train_steps.RunConfig("optimised", zero=1, accumulation="scan")
    args = train._parse(["--quick"])
    workload = train_steps.Workload("gpt-tiny", 8, 1, seq_len=16, n_layers=1)
    assert train.choose_grad_sync(args, workload, run, jax.devices()[:2]) == ("psum", {})
    assert train._grad_sync_collective(run, 2).startswith("reduce-scatter per leaf")
    assert train._grad_sync_collective(train_steps.RunConfig("o", grad_sync="ring"), 2) == "ring"


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "--seq-len=0 must be >= 1"),
    (["--layers", "0"], "--layers=0 must be >= 1"),
    (["--model", "cnn-small", "--image-size", "0"], "--image-size=0 must be >= 1"),
    (["--xla-extra", "garbage"], "--xla-extra 'garbage': expected XLA flags"),
    (["--model", "cnn-small", "--seq-len", "4096", "--layers", "48"],
     "--layers, --seq-len applies to GPT models, not --model cnn-small"),
    (["--model", "cnn-small", "--attention", "cudnn"], "--attention applies to GPT models"),
    (["--model", "gpt-124m", "--image-size", "32"], "--image-size applies to vision models"),
])
def test_shape_flags_are_validated_and_must_apply(argv, message, capsys):
    assert message in _exit_2(capsys, train._parse, ["--quick", *argv])


def test_model_label_names_the_shape_that_ran():
    result = {"model": "gpt-124m", "gpt": {"n_layers": 1, "seq_len": 32}, "args": {"quick": True}}
    assert train_report.model_label(result) == "gpt-124m (quick: layers=1, seq_len=32)"
    result["gpt"]["data"] = "embedded text corpus (byte ids)"
    assert train_report.model_label(result) == (
        "gpt-124m (quick: layers=1, seq_len=32; embedded text corpus (byte ids))")
    result = {"model": "cnn-small", "vision": {"image_size": 64}, "args": {"quick": False}}
    assert train_report.model_label(result) == "cnn-small (image_size=64)"


@pytest.mark.parametrize("grad_dtype, want", [("compute", jnp.bfloat16), ("param", jnp.float32)])
def test_grad_sync_choice_times_the_dtype_the_step_reduces(monkeypatch, grad_dtype, want):
    """Under --grad-dtype compute the step all-reduces bf16 gradients; the methods were
    timed on f32 ones (twice the bytes), so the choice was made on other work."""
    import jaxopt_train.collectives as collectives  # noqa: PLC0415

    seen, real = set(), collectives.all_reduce_tree

    def spy(tree, *args, **kwargs):
        seen.update(np.dtype(leaf.dtype) for leaf in jax.tree.leaves(tree))
        return real(tree, *args, **kwargs)
    monkeypatch.setattr(collectives, "all_reduce_tree", spy)
    workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=8, n_layers=1)
    run = train_steps.RunConfig("optimised", policy="bf16", accumulation="scan", donate=True,
                                grad_dtype=grad_dtype)
    args = argparse.Namespace(grad_sync="auto")
    method, times = train.choose_grad_sync(args, workload, run, jax.devices()[:2])
    assert set(times) == {"psum", "ring", "ring_bidir"} and method in times
    assert seen == {np.dtype(want)}


@pytest.mark.parametrize("argv, message", [
    (["--compare-dispatch", "1,4,01"], "--compare-dispatch '1,4,01' repeats 1: give each item once"),
    (["--compare-matmul", "pallas, pallas"], "--compare-matmul 'pallas, pallas' repeats pallas"),
])
def test_compare_lists_that_repeat_an_item_are_refused(argv, message, capsys):
    """A repeat measured the same config again (minutes each on a GPU) as one more row."""
    assert message in _refused(["--quick", *argv], capsys)


def test_a_fused_attention_that_falls_back_to_xla_is_not_an_ablation_row():
    """--attention cudnn off a GPU runs XLA's attention: its "+bf16+cudnn attention" row was
    the +bf16 row again under another name."""
    workload = train_steps.Workload("gpt-tiny", 8, 2)
    optimised = train_steps.RunConfig("optimised", policy="bf16", attention="cudnn",
                                      accumulation="scan")
    runs, skipped = train_ablation.ablation_runs(train_steps.RunConfig("baseline"), optimised,
                                                 workload, num_devices=1)
    assert jax.default_backend() == "cpu"
    assert "+bf16+cudnn attention" not in [r.name for r in runs]
    assert "+bf16+cudnn attention" in [s["name"] for s in skipped]


def test_auto_attention_is_xla_before_ampere(monkeypatch):
    """--attention auto was cudnn on any GPU: on a T4 (7.5), Colab's default GPU, the
    optimised row then failed inside XLA, as cuDNN's fused attention needs sm_80."""
    gpu = SimpleNamespace(platform="gpu", device_kind="Tesla T4", compute_capability="7.5")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu])
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: [gpu])
    workload = train_steps.Workload("gpt-tiny", 8, 2)
    optimised = train_steps.RunConfig("optimised", policy="bf16", attention="cudnn")
    assert train_steps.resolved_attention(workload, optimised) == "xla"  # the model falls back
    _, skipped = train_ablation.ablation_runs(train_steps.RunConfig("baseline"), optimised,
                                              workload, num_devices=1)
    assert "+bf16+cudnn attention" in [s["name"] for s in skipped]
    assert train_steps.optimised_attention("auto") == "xla"
    assert train_steps.optimised_attention("cudnn") == "cudnn"  # asked for: kept, then falls back
    gpu.compute_capability = "8.0"  # an A100 (and an L4's 8.9, Hopper's 9.0) keeps cuDNN
    assert train_steps.optimised_attention("auto") == "cudnn"
    assert train_steps.resolved_attention(workload, optimised) == "cudnn"


def test_a_failed_scaling_run_costs_its_table_only(tmp_path, monkeypatch, capsys):
    """The 1-device rerun holds what n devices shared (ZeRO) and can run out of memory: the
    rows already measured are still reported and written, with the reason."""
    def oom(bench, optimised, row_n):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate\nmore")

    monkeypatch.setattr(train, "_scaling", oom)
    out = tmp_path / "out"
    assert train.main(["--quick", "--devices", "2", "--xla-preset", "none", "--steps", "2",
                       "--out", str(out)]) == 0
    result = json.loads((out / "train_bench.json").read_text())
    assert "scaling" not in result and [r["name"] for r in result["rows"]][:2] == ["baseline", "optimised"]
    assert result["scaling_failed"].startswith("RuntimeError: RESOURCE_EXHAUSTED")
    assert ("data parallel scaling: no table, the 1-device run failed (RuntimeError: "
            "RESOURCE_EXHAUSTED" in capsys.readouterr().out)


# ---------------------------------------------------------------- --text: real id frequencies


def test_text_workload_feeds_corpus_windows():
    from jaxopt_train.data import load_text_corpus

    run = train_steps.RunConfig("baseline")
    text = train_steps.host_batches(train_steps.Workload("gpt-tiny", 4, seq_len=32, text=True), 2, run)
    assert text["inputs"].shape == (2, 4, 32) and text["inputs"].max() < 256
    raw = load_text_corpus().tobytes()
    assert all(raw.find(row.astype(np.uint8).tobytes()) >= 0 for row in text["inputs"].reshape(-1, 32))
    uniform = train_steps.host_batches(train_steps.Workload("gpt-tiny", 4, seq_len=32), 2, run)

    def top_share(ids):
        return np.bincount(ids.ravel(), minlength=256).max() / ids.size

    # Text has a byte (the space) in ~30% of positions; uniform ids have none that frequent.
    assert top_share(text["inputs"]) > 0.15 and top_share(uniform["inputs"]) < 0.05
    with pytest.raises(ValueError, match="text=True feeds GPT token ids; model='cnn-small' takes images"):
        train_steps.Workload("cnn-small", 4, text=True)


def test_text_flag_is_gpt_only(capsys):
    assert "--text applies to GPT models (token ids), not --model cnn-small" in _exit_2(
        capsys, train._parse, ["--quick", "--model", "cnn-small", "--text"])
    assert train._parse(["--quick", "--text"]).text is True


def test_quick_bench_on_text(tmp_path, capsys):
    argv = ["--quick", "--devices", "1", "--xla-preset", "none", "--peak-tflops", "0.5", "--text",
            "--memory-budget", "1GiB", "--out", str(tmp_path)]
    assert train.main(argv) == 0
    result = json.loads((tmp_path / "train_bench.json").read_text())
    assert result["gpt"]["data"] == "embedded text corpus (byte ids)"
    assert [r["name"] for r in result["rows"]] == ["baseline", "optimised"]
    assert "seq_len=32; embedded text corpus (byte ids))" in (tmp_path / "train_bench.md").read_text()


def test_auto_grad_sync_does_not_time_hierarchical_in_one_process():
    """hierarchical groups devices by host: in one process it is one group, the plain ring,
    which auto timed a second time and could report under the other name."""
    import jax

    from jaxopt_train.bench import train_steps

    args = train._parse(["--quick", "--devices", "4", "--zero", "0"])
    workload = train_steps.Workload(args.model, args.global_batch, args.microbatches,
                                    seq_len=args.seq_len, n_layers=args.layers)
    run = train_steps.RunConfig("optimised", policy="bf16", accumulation="scan", zero=0)
    method, times = train.choose_grad_sync(args, workload, run, jax.devices()[:4])
    assert sorted(times) == ["psum", "ring", "ring_bidir"] and method in times


def test_help_states_every_default_including_the_quick_ones(capsys):
    """The optimised config's bf16 moments and compute-dtype gradients are the opposite of
    `jaxopt-train train`'s defaults: --help did not say them, nor the sizes it would run."""
    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for said in ("(default: gpt-124m; with --quick: gpt-tiny)", "(default: 40; with --quick: 4)",
                 "moments (default: bf16)", "(default: compute)", "(default: auto)",
                 "(default: gpu-throughput)", "(default: the model's own; with --quick: 32)"):
        assert said in text, said


def test_train_table_prints_tflops_without_an_exponent():
    """Two H200s reach ~1,059 TFLOP/s: the table printed 1.06e+03."""
    row = {"name": "optimised", "step_ms": 90.6, "throughput": 180843.0, "tflops": 1058.9, "mfu": 0.535,
           "peak_memory_bytes": 2**34, "peak_memory_source": "allocator", "memory_swing_bytes": 0,
           "compile_s": 9.0, "host_dispatch_ms_per_step": 0.1, "epoch_hours": 2.0, "epoch_cost_usd": 10.0}
    table = train_report.markdown_table([row, dict(row, tflops=53.44), dict(row, tflops=0.01234)], "tokens")
    assert "| 1,059 |" in table and "e+" not in table
    assert "| 53.4 |" in table and "| 0.0123 |" in table


def test_a_baseline_out_of_memory_costs_its_row_and_the_ratios_only(tmp_path, monkeypatch, capsys):
    """Was: gpt-1b at batch 8 on an 80 GB H100 fits optimised but not as the baseline (f32,
    no remat), and the baseline's RESOURCE_EXHAUSTED ended the bench with a traceback,
    losing the optimised row measured minutes before. Ablation rows (baseline + one
    technique) can fail the same way and cost only their own rows."""
    real_measure = train.Bench.measure

    def measure(self, run, *args, **kwargs):
        if run.name in ("baseline", "+donate"):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.70GiB\nmore")
        return real_measure(self, run, *args, **kwargs)

    monkeypatch.setattr(train.Bench, "measure", measure)
    real_ablation_runs = train.ablation_runs

    def two_ablations(*args, **kwargs):
        # One ablation row that fails and one that runs show what every other row does;
        # the whole set compiled ~8 more steps (53 s of the CPU suite).
        runs, skipped = real_ablation_runs(*args, **kwargs)
        return [r for r in runs if r.name in ("+donate", "+bf16")], skipped

    monkeypatch.setattr(train, "ablation_runs", two_ablations)
    out = tmp_path / "out"
    assert train.main(["--quick", "--devices", "2", "--xla-preset", "none", "--steps", "2",
                       "--no-scaling", "--ablate", "--out", str(out)]) == 0
    result = json.loads((out / "train_bench.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert names == ["optimised", "+bf16"]
    assert names[0] == "optimised" and "baseline" not in names and "+donate" not in names
    assert len(names) > 1  # the other ablation rows ran
    assert all(r["speedup_vs_baseline"] is None and r["memory_ratio_vs_baseline"] is None
               for r in result["rows"])
    assert result["rows_failed"] == [
        {"name": n, "reason": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.70GiB"}
        for n in ("baseline", "+donate")]
    captured = capsys.readouterr()
    assert "[bench train] baseline failed: RuntimeError: RESOURCE_EXHAUSTED" in captured.err
    text = (out / "train_bench.md").read_text()
    assert ("baseline: no row, the run failed (RuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
            "trying to allocate 28.70GiB); speed-up and mem ratio need it: a smaller --global-batch, "
            "or a larger allocator pool (XLA_CLIENT_MEM_FRACTION, 0.75 of the GPU unless set), "
            "may let it fit") in text
    assert "+donate: no row, the run failed (RuntimeError" in text
    optimised_line = next(line for line in text.splitlines() if line.startswith("| optimised |"))
    assert optimised_line.endswith("| n/a | n/a |")
    assert (out / "train_bench.png").stat().st_size > 0
