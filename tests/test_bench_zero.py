"""`jaxopt-train bench train --zero 1`: the per-leaf ZeRO-1 in-graph step against the replicated one.

gpt-tiny (1 layer, 16 tokens) on 2 of the 8 emulated devices: every leaf of
its parameters has a dimension divisible by 2, so every leaf is sharded here;
the replicated-leaf path is tested on a toy tree in tests/test_zero.py.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxopt_train.bench import train, train_steps

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

N = 2
STEPS = 2
WORKLOAD = train_steps.Workload("gpt-tiny", 8, 2, seq_len=16, n_layers=1)
# XLA's HLO spelling: "%x = f32[64,128]{1,0} reduce-scatter(...)", tuples "(f32[..], ...)",
# "-start" on backends that make collectives async (GPU; not CPU).
_COLLECTIVE = re.compile(r"=\s+(\([^()]*\)|\S+)\s+(all-reduce|reduce-scatter|all-gather)(?:-start)?\(")


def _collectives(hlo: str) -> Counter:
    """(op, result shape) -> count in a compiled module's text."""
    return Counter((op, shape) for shape, op in _COLLECTIVE.findall(hlo))


def _train(run: train_steps.RunConfig, devices):
    """Builds `run`, takes STEPS donated steps; returns what the tests look at."""
    runner = train_steps.build_runner(WORKLOAD, run, train_steps.data_mesh(devices))
    state = runner.state
    shardings = jax.tree.map(lambda x: x.sharding, state)
    mu_shard = jax.tree.leaves(state[2][0].mu)[0].addressable_shards[0].data.size
    mu_size = jax.tree.leaves(state[2][0].mu)[0].size
    first, losses = state, []
    for _ in range(STEPS):
        state, loss = runner.step(state)
        losses.append(np.asarray(loss))
    return {"params": jax.tree.map(np.asarray, state[0]), "losses": np.concatenate(losses),
            "donated": all(x.is_deleted() for x in jax.tree.leaves(first)),
            "same_shardings": jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, state, shardings)),
            "mu_fraction": mu_shard / mu_size, "compiled": runner.compiled[0]}


@pytest.fixture(scope="module")
def f32_runs():
    devices = jax.devices()[:N]
    return {zero: _train(train_steps.RunConfig(f"zero={zero}", accumulation="scan", donate=True,
                                               zero=zero), devices) for zero in (0, 1)}


def test_zero1_step_equals_replicated_step_in_f32(f32_runs):
    zero0, zero1 = f32_runs[0], f32_runs[1]
    np.testing.assert_allclose(zero1["losses"], zero0["losses"], rtol=1e-6)
    # Same gathered params, same per-device gradients, reduce-scatter = the all-reduce's slice.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 zero1["params"], zero0["params"])


def test_zero1_state_is_sharded_kept_and_donated(f32_runs):
    zero0, zero1 = f32_runs[0], f32_runs[1]
    assert zero0["mu_fraction"] == 1 and zero1["mu_fraction"] == 1 / N
    for run in (zero0, zero1):
        assert all(run["same_shardings"]) and run["donated"]
    args = {zero: run["compiled"].memory_analysis().argument_size_in_bytes for zero, run in f32_runs.items()}
    # f32 params + AdamW mu + nu dominate the arguments (the batch is 2 KiB): about halved on 2 devices.
    assert args[1] < 0.55 * args[0], args


def test_zero1_hlo_reduce_scatters_and_gathers_each_leaf(f32_runs):
    num_leaves = len(jax.tree.leaves(f32_runs[1]["params"]))
    ops = {zero: _collectives(run["compiled"].as_text()) for zero, run in f32_runs.items()}
    count = {zero: Counter({op: 0 for op in ("all-reduce", "reduce-scatter", "all-gather")})
             for zero in ops}
    for zero, found in ops.items():
        for (op, _), n in found.items():
            count[zero][op] += n
    # XLA:CPU keeps psum_scatter / all_gather as real reduce-scatter / all-gather ops, one per leaf.
    assert count[1]["reduce-scatter"] == count[1]["all-gather"] == num_leaves, ops[1]
    # Its only all-reduce is the scalar loss pmean: no gradient is all-reduced.
    assert {shape for (op, shape) in ops[1] if op == "all-reduce"} == {"f32[]"}, ops[1]
    assert count[0]["reduce-scatter"] == count[0]["all-gather"] == 0
    assert any(shape != "f32[]" for (op, shape) in ops[0] if op == "all-reduce"), ops[0]


def test_zero1_step_equals_replicated_step_in_bf16():
    devices = jax.devices()[:N]
    runs = {zero: _train(train_steps.RunConfig(
        f"zero={zero}", policy="bf16", accumulation="scan", donate=True, grad_dtype="compute",
        opt_state="bf16", zero=zero), devices) for zero in (0, 1)}
    np.testing.assert_allclose(runs[1]["losses"], runs[0]["losses"], rtol=1e-3)
    # Both gradients are bf16 sums of the same two bf16 per-device gradients (measured: bit-equal
    # on CPU). The tolerance allows a different rounding of that sum or of the bf16 moments:
    # a flipped Adam direction moves a param by at most ~2 lr = 2e-4 per step.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=STEPS * 2e-4),
                 runs[1]["params"], runs[0]["params"])


def test_zero1_on_one_device_is_the_replicated_step():
    runner = train_steps.build_runner(
        WORKLOAD, train_steps.RunConfig("zero=1", accumulation="scan", zero=1),
        train_steps.data_mesh(jax.devices()[:1]))
    assert {x.sharding.spec for x in jax.tree.leaves(runner.state)} == {P()}
    assert not _collectives(runner.compiled[0].as_text())


def test_zero_is_validated():
    with pytest.raises(ValueError, match=r"zero=2; legal values: \(0, 1\)"):
        train_steps.RunConfig("x", accumulation="scan", zero=2)
    with pytest.raises(ValueError, match="needs accumulation='scan', got accumulation='host'"):
        train_steps.RunConfig("x", zero=1)
    with pytest.raises(SystemExit):
        train._parse(["--quick", "--zero", "2"])


def test_quick_bench_with_zero1_reports_the_zero_row(tmp_path, capsys):
    # Flags that skip the other ablations and the plot, to keep the run short.
    argv = ["--quick", "--devices", str(N), "--zero", "1", "--ablate", "--xla-preset", "none",
            "--grad-sync", "psum", "--remat", "none", "--opt-state-dtype", "f32",
            "--grad-dtype", "param", "--steps-per-dispatch", "1", "--microbatches", "1",
            "--steps", "2", "--bursts", "1", "--warmup", "0", "--trace-steps", "1",
            "--seq-len", "16", "--no-scaling", "--json", str(tmp_path / "raw.json")]
    assert train.main(argv) == 0
    result = json.loads((tmp_path / "raw.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["optimised"]["config"]["zero"] == 1
    assert rows["+zero=1"]["config"] == {**rows["baseline"]["config"], "name": "+zero=1",
                                         "zero": 1, "accumulation": "scan"}
    assert rows["+zero=1"]["step_ms"] > 0
    report = capsys.readouterr().out
    assert "| +zero=1 |" in report
    assert "zero=1 (master params and optimizer state sharded per leaf)" in report
