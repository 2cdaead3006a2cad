"""`bench train --compute-copy`: the params' bf16 copy kept in the state, written by the update.

The step must be the same computation as casting the f32 params at the step's start,
only reordered: the same losses and params (bit-equal on CPU at XLA's default emitters), on
one device and with per-leaf ZeRO-1 on 2 of the 8 emulated devices, over a scan of 2 steps
per dispatch.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.bench import train, train_ablation, train_steps

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

WORKLOAD = train_steps.Workload("gpt-tiny", 8, 1, seq_len=16, n_layers=1)


def _run(devices, **changes):
    run = train_steps.RunConfig("x", policy="bf16", accumulation="scan", donate=True,
                                grad_dtype="compute", opt_state="bf16", steps_per_dispatch=2,
                                **changes)
    runner = train_steps.build_runner(WORKLOAD, run, train_steps.data_mesh(devices))
    state, losses = runner.state, []
    for _ in range(2):
        state, loss = runner.step(state)
        losses.append(np.asarray(loss))
    copy_shards = [x.addressable_shards[0].data.size / x.size for x in jax.tree.leaves(state[3:])]
    return jax.tree.map(np.asarray, state), np.concatenate(losses), copy_shards


@pytest.mark.parametrize("num_devices, zero", [(1, 0), (2, 1)], ids=["1 device", "2 devices zero=1"])
def test_the_kept_copy_gives_the_step_that_casts_at_its_start(num_devices, zero):
    devices = jax.devices()[:num_devices]
    plain_state, plain_losses, _ = _run(devices, zero=zero)
    state, losses, copy_shards = _run(devices, zero=zero, compute_copy=True)
    assert len(plain_state) == 3 and len(state) == 4
    np.testing.assert_array_equal(losses, plain_losses)
    # Bit-equal under XLA CPU's default emitters; the suite's older ones (tests/conftest.py)
    # round the two programs' updates up to 4 ulps apart (7e-9 on params of ~1e-2).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8),
                 state[0], plain_state[0])
    # The copy is the cast of the params the update wrote, leaf by leaf, in bf16.
    jax.tree.map(lambda c, p: np.testing.assert_array_equal(c, p.astype(jnp.bfloat16)),
                 state[3], state[0])
    assert {x.dtype for x in jax.tree.leaves(state[3])} == {np.dtype(jnp.bfloat16)}
    assert set(copy_shards) == {1 / num_devices}  # with zero=1 sharded like the master params


def test_the_step_reads_the_copy_not_the_master_weights():
    """A copy that disagrees with the f32 params changes the loss: the forward uses the copy
    (were it only carried along, the step would still cast the params and ignore it)."""
    run = train_steps.RunConfig("x", policy="bf16", accumulation="scan", grad_dtype="compute",
                                compute_copy=True)
    runner = train_steps.build_runner(WORKLOAD, run, train_steps.data_mesh(jax.devices()[:1]))
    params, model_state, opt_state, copy = runner.state
    _, honest = runner.step((params, model_state, opt_state, copy))
    _, zeroed = runner.step((params, model_state, opt_state, jax.tree.map(jnp.zeros_like, copy)))
    assert np.isfinite(np.asarray(honest)).all() and np.isfinite(np.asarray(zeroed)).all()
    assert not np.allclose(np.asarray(honest), np.asarray(zeroed))


def test_compute_copy_is_validated(capsys):
    with pytest.raises(ValueError, match="needs grad_dtype='compute' and accumulation='scan'"):
        train_steps.RunConfig("x", policy="bf16", accumulation="scan", compute_copy=True)
    with pytest.raises(ValueError, match="policy 'fp32' computes in float32"):
        train_steps.RunConfig("x", accumulation="scan", grad_dtype="compute", compute_copy=True)
    with pytest.raises(SystemExit) as exc:  # a usage error: status 2, the reason on stderr
        train._parse(["--quick", "--compute-copy", "--grad-dtype", "param"])
    assert exc.value.code == 2
    assert re.search("--compute-copy .* needs --grad-dtype compute", capsys.readouterr().err)


def test_compute_copy_defaults_on_with_compute_gradients():
    assert train._parse(["--quick"]).compute_copy is True
    assert train._parse(["--quick", "--no-compute-copy"]).compute_copy is False
    assert train._parse(["--quick", "--grad-dtype", "param"]).compute_copy is False


def test_ablation_row_runs_with_the_flag():
    baseline = train_steps.RunConfig("baseline")
    optimised = train_steps.RunConfig("optimised", policy="bf16", accumulation="scan",
                                      grad_dtype="compute", compute_copy=True)
    runs, skipped = train_ablation.ablation_runs(baseline, optimised, WORKLOAD, 1)
    row = next(r for r in runs if r.compute_copy)
    assert row.name.startswith("+bf16 weight copy") and row.grad_dtype == "compute"
    runs, skipped = train_ablation.ablation_runs(baseline, train_steps.RunConfig("o", policy="bf16"),
                                         WORKLOAD, 1)
    assert not any(r.compute_copy for r in runs)
    assert any(s["name"].startswith("+bf16 weight copy") for s in skipped)
