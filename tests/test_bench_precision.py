"""`bench train --precision`: the optimised row in bf16, or in fp16 with a dynamic loss scale.

An fp16 step scales the loss, unscales the reduced gradients and skips a step whose
gradients are not all finite, as the trainer's step does. The references: the same step
in float32 (plain SGD, so a gradient left scaled shows as a 32768-times update: AdamW
would normalise it away), and for the skip, the state before the step, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxopt_train.bench import train, train_ablation, train_steps
from jaxopt_train.loss_scale import DynamicLossScale

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

WORKLOAD = train_steps.Workload("gpt-tiny", 8, 2, seq_len=16, n_layers=1)
LR = 0.5


@pytest.fixture
def sgd(monkeypatch):
    """The bench's optimizer as plain SGD: its update is the gradient times -LR."""
    monkeypatch.setattr(train_steps, "default_optimizer", lambda opt_state="f32": optax.sgd(LR))


def _one_step(run, devices, scale=None):
    """(params before, params after, loss, state after) of one optimizer step of `run`;
    `scale` replaces the state's initial loss scale (same settings, another value)."""
    runner = train_steps.build_runner(WORKLOAD, run, train_steps.data_mesh(devices))
    state = runner.state
    if scale is not None:
        params, model_state, opt_state, copy, old = train_steps.split_state(state, run)
        placed = jax.device_put(DynamicLossScale(initial_scale=scale),
                                jax.tree.leaves(old)[0].sharding)
        state = train_steps.join_state(params, model_state, opt_state, copy, placed)
    before = jax.tree.map(np.array, state[0])  # copied: the step may donate its input
    state, loss = runner.step(state)
    state = jax.tree.map(np.asarray, state)
    return before, state[0], float(np.asarray(loss).reshape(-1)[-1]), state


def _relative_l1(got, want) -> float:
    diff = sum(np.abs(np.asarray(g, np.float64) - w).sum()
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return diff / sum(np.abs(np.asarray(w, np.float64)).sum() for w in jax.tree.leaves(want))


def _update(before, after):
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, after, before)


FP16_RUNS = {
    "host loop": dict(accumulation="host"),
    "scan": dict(accumulation="scan", grad_dtype="compute", donate=True),
    "scan, weight copy, 2 per dispatch": dict(accumulation="scan", grad_dtype="compute",
                                              compute_copy=True, steps_per_dispatch=2),
}


@pytest.mark.parametrize("changes", FP16_RUNS.values(), ids=FP16_RUNS.keys())
def test_an_fp16_step_is_the_float32_step_with_the_scale_taken_out(sgd, changes):
    devices = jax.devices()[:1]
    run = train_steps.RunConfig("fp16", policy="fp16", **changes)
    assert run.loss_scaled
    before, after, loss, state = _one_step(run, devices)
    ref_changes = {k: v for k, v in changes.items() if k not in ("grad_dtype", "compute_copy")}
    ref_before, ref_after, ref_loss, _ = _one_step(train_steps.RunConfig("f32", **ref_changes),
                                                   devices)
    # The same init. Bit for bit under XLA CPU's default emitters; the suite's older ones
    # (tests/conftest.py) round the normal draw an ulp apart in the two runners' programs.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), before, ref_before)
    want = _update(ref_before, ref_after)
    assert sum(np.abs(u).sum() for u in jax.tree.leaves(want)) > 0
    steps = run.steps_per_dispatch
    if steps == 1:
        # f16 rounding of activations and gradients: measured 0.0008-0.0009 on CPU; a
        # gradient left scaled would make the update 32768 times the reference's.
        assert _relative_l1(_update(before, after), want) < 0.005
    assert loss == pytest.approx(ref_loss, rel=1e-4)  # unscaled (measured within 4e-6)
    scale = state[-1]
    assert isinstance(scale, DynamicLossScale)
    assert float(scale.loss_scale) == 2.0**15 and int(scale.skipped_steps) == 0
    # Counted per update call: the host loop updates (and checks) once per micro-batch.
    calls = steps * (WORKLOAD.microbatches if run.accumulation == "host" else 1)
    assert int(scale.growth_counter) == calls


def test_an_fp16_step_under_zero1_takes_the_one_device_step(sgd):
    run = train_steps.RunConfig("fp16", policy="fp16", accumulation="scan", grad_dtype="compute",
                                zero=1)
    before, one, loss_one, _ = _one_step(run, jax.devices()[:1])
    _, two, loss_two, state = _one_step(run, jax.devices()[:2])
    # The same gradients, summed in another order over two devices: f16 rounding only
    # (measured 0.0004, and the losses within 2e-7).
    assert _relative_l1(_update(before, two), _update(before, one)) < 0.002
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    assert float(state[-1].loss_scale) == 2.0**15


@pytest.mark.parametrize("accumulation, devices, zero", [
    ("host", 1, 0), ("scan", 1, 0), ("scan", 2, 1)], ids=["host loop", "scan", "scan zero=1"])
def test_an_overflowing_fp16_step_changes_nothing_but_the_scale(accumulation, devices, zero):
    run = train_steps.RunConfig("fp16", policy="fp16", accumulation=accumulation, zero=zero,
                                grad_dtype="compute" if accumulation == "scan" else "param")
    mesh_devices = jax.devices()[:devices]
    runner = train_steps.build_runner(WORKLOAD, run, train_steps.data_mesh(mesh_devices))
    params, model_state, opt_state, copy, old = train_steps.split_state(runner.state, run)
    # 2**100 times any gradient overflows float16 (max 65504).
    huge = jax.device_put(DynamicLossScale(initial_scale=2.0**100), jax.tree.leaves(old)[0].sharding)
    state = train_steps.join_state(params, model_state, opt_state, copy, huge)
    start = jax.tree.map(np.array, state[:3])
    # The host loop updates, checks and adjusts the scale once per micro-batch.
    calls = WORKLOAD.microbatches if accumulation == "host" else 1
    for step in (1, 2):
        state, _ = runner.step(state)
        # params, optimizer state (AdamW moments and count) and model state: bit for bit
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state[:3]), start)
        scale = state[-1]
        skipped = step * calls
        assert int(scale.skipped_steps) == skipped
        # hysteresis 2: the first overflow spends the budget, each one after it backs off
        assert float(scale.loss_scale) == 2.0 ** (100 - max(skipped - 1, 0))


def test_zero1_devices_skip_together_when_one_shard_overflows():
    """Under ZeRO-1 each device checks only its gradient shards: the verdict is shared,
    or the devices whose shards are finite step while the others do not."""
    num = 8
    mesh = train_steps.data_mesh(jax.devices()[:num])
    axis = train_steps.AXIS
    params = {"w": jnp.arange(num * 2, dtype=jnp.float32).reshape(num, 2)}
    grads = {"w": jnp.ones((num, 2), jnp.float32).at[0, 0].set(jnp.inf)}  # device 0's shard
    optimizer = optax.sgd(1.0)
    scale = DynamicLossScale(initial_scale=1.0)

    def run(sharded):
        def per_device(p, g, s):
            new_params, _, _, new_scale = train_steps._apply_update(
                optimizer, g, optimizer.init(p), p, {}, {}, s, sharded=sharded)
            return new_params, new_scale.skipped_steps[None]

        spec = jax.sharding.PartitionSpec(axis)
        fn = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, jax.sharding.PartitionSpec()),
                           out_specs=(spec, spec), check_vma=False)
        new_params, skipped = jax.jit(fn)(params, grads, scale)
        return np.asarray(new_params["w"]), np.asarray(skipped)

    new_w, skipped = run(sharded=True)
    np.testing.assert_array_equal(new_w, np.asarray(params["w"]))
    np.testing.assert_array_equal(skipped, np.ones(num))
    # Without the shared verdict the other seven would step: the check above can fail.
    new_w, skipped = run(sharded=False)
    assert list(skipped) == [1] + [0] * (num - 1)
    np.testing.assert_array_equal(new_w[1:], np.asarray(params["w"])[1:] - 1.0)


def _gpu(capability: str):
    return SimpleNamespace(platform="gpu", device_kind="GPU", compute_capability=capability)


@pytest.mark.parametrize("devices, want", [
    ([_gpu("7.5")], "fp16"),                 # T4: no bf16 tensor cores
    ([_gpu("7.0"), _gpu("7.0")], "fp16"),    # V100
    ([_gpu("8.0")], "bf16"),                 # A100
    ([_gpu("9.0")], "bf16"),                 # H100/H200
    ([_gpu("9.0"), _gpu("7.5")], "fp16"),    # a mixed host runs at its oldest GPU's pace
    ([_gpu("")], "bf16"),                    # unreadable: the safe default
    ([SimpleNamespace(platform="cpu", device_kind="cpu")], "bf16"),
    ([SimpleNamespace(platform="tpu", device_kind="TPU v5e")], "bf16"),
], ids=["T4", "V100", "A100", "H200", "mixed", "unknown", "cpu", "tpu"])
def test_auto_precision_is_fp16_only_without_bf16_tensor_cores(devices, want):
    assert train_steps.optimised_policy("auto", devices) == want


def test_an_explicit_precision_is_kept_and_others_are_refused(capsys):
    t4, h200 = [_gpu("7.5")], [_gpu("9.0")]
    assert train_steps.optimised_policy("bf16", t4) == "bf16"
    assert train_steps.optimised_policy("fp16", h200) == "fp16"
    with pytest.raises(ValueError, match=r"precision='fp32'; legal values: \('auto', 'bf16', 'fp16'\)"):
        train_steps.optimised_policy("fp32", h200)
    with pytest.raises(SystemExit) as exc:
        train._parse(["--quick", "--precision", "tf32"])
    assert exc.value.code == 2 and "invalid choice: 'tf32'" in capsys.readouterr().err
    assert train._parse(["--quick"]).precision == "auto"
    with pytest.raises(ValueError, match="policy"):
        train_steps.RunConfig("x", policy="fp8")


def test_compare_plain_refuses_a_non_bf16_optimised_row(capsys):
    args = train._parse(["--quick", "--compare-plain", "--precision", "fp16"])
    with pytest.raises(SystemExit) as exc:
        train.run_devices(args)
    assert exc.value.code == 2
    assert "this one runs in fp16: add --precision bf16 or drop --compare-plain" in (
        capsys.readouterr().err)


def test_a_state_of_another_config_is_refused():
    fp16 = train_steps.RunConfig("fp16", policy="fp16")
    with pytest.raises(ValueError, match=r"expects a state of 4 parts .* got 3"):
        train_steps.split_state(({}, {}, {}), fp16)
    parts = ({"p": 1}, {"m": 2}, {"o": 3}, {"c": 4}, "scale")
    run = train_steps.RunConfig("x", policy="fp16", accumulation="scan", grad_dtype="compute",
                                compute_copy=True)
    assert train_steps.split_state(parts, run) == parts
    assert train_steps.join_state(*parts) == parts
    assert train_steps.split_state(parts[:3], train_steps.RunConfig("f32")) == parts[:3] + (None, None)


def test_fp16_names_the_ablation_rows_and_the_report():
    optimised = train_steps.RunConfig("optimised", policy="fp16", accumulation="scan",
                                      grad_dtype="compute", compute_copy=True, opt_state="bf16")
    runs, _ = train_ablation.ablation_runs(train_steps.RunConfig("baseline"), optimised, WORKLOAD, 1)
    by_name = {r.name: r for r in runs}
    assert by_name["+fp16"].policy == "fp16"
    assert by_name["+fp16 gradients (+scan accumulation)"].grad_dtype == "compute"
    assert by_name["+fp16 weight copy in the state (+fp16 gradients, +scan accumulation)"].compute_copy
    assert by_name["+bf16 optimizer state"].policy == "fp32"  # the moments' dtype, its own flag
    assert not any("bf16" in name for name in by_name if name != "+bf16 optimizer state")


def test_the_report_says_fp16_and_its_loss_scale(quick_run_fp16):
    text = quick_run_fp16
    assert "optimised: precision fp16 with a dynamic loss scale" in text
    assert "fp16 weight copy kept in the state" in text
    assert "n/a (no dense fp16 peak known for this device; pass --peak-tflops)" in text
    # gpt-tiny's gradients stay far below float16's max at the initial 2**15: nothing skipped
    assert "optimised: loss scale 32768 after its last step; 0 update(s) skipped" in text
    assert "baseline: loss scale" not in text  # f32: no loss scale


@pytest.fixture(scope="module")
def quick_run_fp16(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    assert train.main(["--quick", "--precision", "fp16", "--devices", "1", "--xla-preset", "none", "--out", str(out)]) == 0
    return (out / "train_bench.md").read_text()



@pytest.mark.gpu
def test_gpu_fp16_row_trains_finite_and_reports_its_fp16_mfu(tmp_path):
    argv = ["--model", "gpt-tiny", "--steps", "8", "--bursts", "2", "--trace-steps", "2",
            "--warmup-s", "0", "--devices", "1", "--precision", "fp16", "--ablate",
            "--json", str(tmp_path / "r.json")]
    assert train.main(argv) == 0
    import json  # noqa: PLC0415

    result = json.loads((tmp_path / "r.json").read_text())
    assert result["matmul_dtype"] == "fp16"
    opt = next(r for r in result["rows"] if r["name"] == "optimised")
    assert opt["config"]["policy"] == "fp16" and opt["attention_resolved"] == "cudnn"
    assert opt["skipped_updates"] == 0 and opt["loss_scale"] == 2.0**15
    if result["peak_tflops_per_device"] is not None:
        assert "dense fp16 peak" in result["mfu_denominator"] and 0 < opt["mfu"] < 1
    assert any(r["name"] == "+fp16" for r in result["rows"])
