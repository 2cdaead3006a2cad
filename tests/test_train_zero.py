"""ZeRO stages 1 and 3 in the trainer: same training as replicated, less memory, resumable.

Tiny MLP: hidden=30 on 8 emulated devices (no leaf divides 8: both stages with
every leaf replicated), hidden=32 on 2 and 4 devices for the per-leaf layout
(the (3,) output bias has no divisible dimension and stays replicated, the
other leaves are sharded); the resume test reuses tests/test_train.py's tiny
GPT run shape.
"""

import dataclasses
import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxopt_train.train import TrainConfig, Trainer, train
from jaxopt_train.train.checkpoint import Checkpointer, RunDirError
from jaxopt_train.train.cli import config_from_args

from test_train import TINY_RUN, _assert_trees_close

pytestmark = pytest.mark.usefixtures("jax_compile_cache")


class _MLP(nnx.Module):
    def __init__(self, rngs, hidden=30):
        self.l1, self.l2 = nnx.Linear(5, hidden, rngs=rngs), nnx.Linear(hidden, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.tanh(self.l1(x)))


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches(steps=3, batch=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, batch, 5)).astype(np.float32)
    y = np.stack([np.sin(x).sum(-1), x[..., 0], -x[..., 1]], -1).astype(np.float32) * 3
    return [{"x": a, "y": b} for a, b in zip(x, y)]


def _trainer(zero, **kw):
    # AdamW with weight decay on matrices (a per-leaf mask) and a clip well below the grad norm.
    return Trainer(_MLP(nnx.Rngs(0)), _mse, zero=zero, lr=0.05, total_steps=10, warmup=0,
                   weight_decay=0.1, clip_norm=0.1, microbatches=2, **kw)


@pytest.fixture(scope="module")
def replicated_run():
    trainer = _trainer(0)
    norms = [float(trainer.step(b)["grad_norm"][0]) for b in _batches()]
    return trainer, norms


@pytest.mark.parametrize("zero, grad_sync", [(1, "psum"), (3, "ring")])
def test_zero_matches_replicated_adamw_with_clipping(replicated_run, zero, grad_sync):
    reference, norms = replicated_run
    assert min(norms) > 0.1  # clipping is active on every step
    trainer = _trainer(zero, grad_sync=grad_sync)
    got_norms = [float(trainer.step(b)["grad_norm"][0]) for b in _batches()]
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    _assert_trees_close(nnx.split(trainer.model, nnx.Param)[1],
                        nnx.split(reference.model, nnx.Param)[1], rtol=1e-5, atol=1e-6)
    assert int(trainer.state.step) == 3


def test_argument_bytes_per_device_fall_with_the_stage():
    sizes = {}
    for zero in (0, 1, 3):
        trainer = Trainer(_MLP(nnx.Rngs(0), hidden=256), _mse, zero=zero, total_steps=10)
        trainer.compile(_batches(1, 8)[0])
        sizes[zero] = trainer._compiled.memory_analysis().argument_size_in_bytes
    params = 5 * 256 + 256 + 256 * 3 + 3
    # Adam's two moments leave (7/8 of them) at stage 1, the params too at stage 3.
    assert sizes[0] - sizes[1] >= 2 * params * 4 * 7 / 8 * 0.95, sizes
    assert sizes[1] - sizes[3] >= params * 4 * 7 / 8 * 0.95, sizes


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_resume_matches_uninterrupted_run(tmp_path, zero):
    run = dict(TINY_RUN, steps=4, zero=zero, eval_every=2)
    full = train(TrainConfig(run_dir=str(tmp_path / "full"), **run))
    split = TrainConfig(run_dir=str(tmp_path / "split"), **run)
    train(split, until_step=2)
    second = train(dataclasses.replace(split, resume=True))
    assert second.step == 4
    _assert_trees_close(full.trainer.params, second.trainer.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second.eval_loss, full.eval_loss, rtol=1e-5)
    # The sharded state came back sharded (at zero=3 the params too), equal to the
    # uninterrupted run's.
    state = second.trainer.state
    trees = (state.opt_state, state.params) if zero == 3 else (state.opt_state,)
    sharded = [x for x in jax.tree.leaves(trees) if x.ndim >= 1]
    assert sharded and all(not x.sharding.is_fully_replicated for x in sharded)
    _assert_trees_close(full.trainer.state.opt_state, second.trainer.state.opt_state,
                        rtol=1e-5, atol=1e-7)
    # zero=0 chains the clip into the optimizer (zero=1|3 clip in the step): another tree of
    # optimizer state, which the checkpoint's tree check refuses (no longer the model shape).
    with pytest.raises(RunDirError, match="another tree of arrays than this run's state"):
        train(dataclasses.replace(split, resume=True, zero=0))


def test_model_shape_does_not_record_the_zero_stage():
    """Before: zero=1 and zero=3 were recorded, so a resume at another stage was refused as
    "a model of another shape", though per-leaf checkpoints restore into any stage's layout."""
    shapes = [TrainConfig(zero=zero).model_shape() for zero in (0, 1, 3)]
    assert shapes[0] == shapes[1] == shapes[2] and "zero" not in shapes[0]


@pytest.mark.parametrize("first, then", [(1, 3), (3, 1)])
def test_zero_resume_at_another_stage_matches_uninterrupted_run(tmp_path, first, then):
    """Before: refused ("zero: saved 1, now 3")."""
    run = dict(TINY_RUN, steps=4, eval_every=2)
    full = train(TrainConfig(run_dir=str(tmp_path / "full"), zero=first, **run))
    split = TrainConfig(run_dir=str(tmp_path / "split"), zero=first, **run)
    train(split, until_step=2)
    second = train(dataclasses.replace(split, resume=True, zero=then))
    assert second.step == 4
    _assert_trees_close(full.trainer.params, second.trainer.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second.eval_loss, full.eval_loss, rtol=1e-5)
    params = [x for x in jax.tree.leaves(second.trainer.state.params) if x.ndim >= 1]
    # Restored into the resumed stage's layout: zero=3 keeps the params sharded.
    assert any(not x.sharding.is_fully_replicated for x in params) == (then == 3)


def test_cli_rejects_zero_2(capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--zero", "2"])
    assert exc.value.code == 2
    assert "--zero" in capsys.readouterr().err
    assert config_from_args(["--zero", "3"]).zero == 3


@pytest.mark.parametrize("kwargs, needle", [
    (dict(zero=2), "zero=2"),
    (dict(zero=3, grad_compression="int8"), "grad_compression"),
    (dict(zero=1, grad_sync="hierarchical"), "grad_sync"),
])
def test_config_rejects_unsupported_zero_combinations(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**kwargs)


# Per-leaf stages 1 and 3 ----------------------------------------------------
# hidden=32 MLP: l1.kernel (5, 32), l1.bias (32,), l2.kernel (32, 3) are sharded
# on 2 and 4 devices; l2.bias (3,) is sharded on neither (3 % 2 != 0).

SHARDED = {"l1/kernel": (5, 32), "l1/bias": (32,), "l2/kernel": (32, 3)}


@functools.cache
def _leaf_run(zero, num_devices, clip_norm, **kw):
    """A hidden=32 trainer on the first `num_devices` devices after 3 steps, its grad norms
    and its initial params (cached: each config compiles once for the module)."""
    trainer = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=zero, lr=0.05, total_steps=10,
                      weight_decay=0.1, clip_norm=clip_norm, microbatches=2,
                      devices=jax.devices()[:num_devices], **kw)
    first = jax.tree.map(np.asarray, trainer.params)
    metrics = [trainer.step(b) for b in _batches()]
    return trainer, [float(m["grad_norm"][0]) for m in metrics], first


def _param(tree, name):
    layer, leaf = name.split("/")
    return np.asarray(tree[layer][leaf][...])


def _assert_sharded_per_leaf(tree, num_devices):
    for name, shape in SHARDED.items():
        layer, leaf = name.split("/")
        leaf = tree[layer][leaf][...]
        assert leaf.shape == shape and not leaf.sharding.is_fully_replicated
        # Memory per device: 1/n of the leaf.
        assert {s.data.size for s in leaf.addressable_shards} == {leaf.size // num_devices}


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("num_devices, clip_norm", [(2, 0.1), (4, 0.1), (4, 0.0)])
def test_zero_per_leaf_matches_replicated(zero, num_devices, clip_norm):
    reference, norms, _ = _leaf_run(0, num_devices, clip_norm)
    trainer, got_norms, _ = _leaf_run(zero, num_devices, clip_norm)
    if clip_norm:
        assert min(norms) > clip_norm  # clipping is active on every step
    # f32 throughout: the reduce-scatter's shard is the all-reduce's slice, and the
    # gathered params are the replicated ones; only the norm's summation order differs.
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    _assert_trees_close(trainer.params, reference.params, rtol=1e-5, atol=1e-6)
    _assert_sharded_per_leaf(trainer.state.opt_state[0].mu, num_devices)
    if zero == 3:
        _assert_sharded_per_leaf(trainer.state.params, num_devices)
    else:
        assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(trainer.state.params))
    # `params` (evaluation, export) is the full replicated tree at every stage.
    assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(trainer.params))


@pytest.mark.parametrize("kw, dtype", [({}, "f32"), (dict(precision="bf16", grad_dtype="compute"), "bf16")])
def test_zero3_evaluate_matches_replicated_and_gathers_inside_its_step(kw, dtype):
    reference, _, _ = _leaf_run(0, 4, 0.1, **kw)
    trainer, _, _ = _leaf_run(3, 4, 0.1, **kw)
    batch = _batches(1, 8)[0]
    np.testing.assert_allclose(trainer.evaluate(batch), reference.evaluate(batch),
                               rtol=1e-2 if kw else 1e-5)
    # The eval step takes the per-device shards and gathers them itself, in the train step's
    # dtype: no replicated f32 copy of the model is made for evaluation.
    lowered = trainer._eval_step.lower(trainer.state.params, trainer.state.model_state,
                                       batch).as_text()
    gathered = sorted(re.findall(r'"stablehlo.all_gather"\(.*?[)>] : \(([^)]*)\) ->', lowered, re.S))
    assert gathered == sorted([f"tensor<8x3x{dtype}>", f"tensor<8x{dtype}>", f"tensor<5x8x{dtype}>"])  # 1/4 each


def test_zero3_params_snapshot_survives_later_steps():
    # Its own trainer: _leaf_run's are shared by the module's tests, and this one steps it.
    trainer = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=3, lr=0.05, total_steps=10,
                      devices=jax.devices()[:4])
    snapshot = trainer.params
    kept = jax.tree.map(lambda x: np.array(x.copy()), snapshot)  # x's own numpy cache stays empty
    trainer.step(_batches(1)[0])  # donates the state's arrays, the replicated bias's included
    assert not any(x.is_deleted() for x in jax.tree.leaves(snapshot))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), snapshot, kept)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_leaf_with_no_divisible_dimension_stays_replicated_and_is_updated(zero):
    trainer, _, first = _leaf_run(zero, 4, 0.1)
    reference, _, _ = _leaf_run(0, 4, 0.1)
    bias_mu = trainer.state.opt_state[0].mu["l2"]["bias"][...]
    bias = trainer.state.params["l2"]["bias"][...]
    for leaf in (bias_mu, bias):
        assert leaf.sharding.spec == P() and leaf.sharding.is_fully_replicated
    assert float(np.abs(bias_mu).max()) > 0  # its moment was updated
    got = _param(trainer.params, "l2/bias")
    assert np.abs(got - _param(first, "l2/bias")).max() > 1e-3
    np.testing.assert_allclose(got, _param(reference.params, "l2/bias"), rtol=1e-5, atol=1e-6)


def _lowered_collectives(trainer, op):
    """Operand types of `op` ("reduce_scatter", "all_gather") in the traced (lowered) step."""
    lowered = trainer._train_step.lower(trainer.state, trainer._stage(_batches(1)[0])).as_text()
    # `"stablehlo.all_gather"(%3) <{...}> : (tensor<16xbf16>) -> ...`; a reduce-scatter
    # has its reduction region `({ ... })` before the ` : (operand types)`.
    return sorted(re.findall(rf'"stablehlo.{op}"\(.*?[)>] : \(([^)]*)\) ->', lowered, re.S))


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_bf16_compute_gradients_match_replicated_compute_gradients(zero):
    reference, norms, _ = _leaf_run(0, 2, 0.1, precision="bf16", grad_dtype="compute")
    trainer, got_norms, _ = _leaf_run(zero, 2, 0.1, precision="bf16", grad_dtype="compute")
    # Both sum the same two bf16 per-device gradients once (a bf16 all-reduce vs bf16
    # reduce-scatters), then widen to f32; zero=3 casts each f32 shard to bf16 before
    # gathering it, the same elementwise rounding as casting the full params. Measured
    # bit-equal on XLA:CPU. The loose tolerance allows a backend that rounds the two
    # bf16 reductions differently (one bf16 ulp, ~4e-3 relative, per gradient entry;
    # Adam passes about that on to each step of lr=0.05: ~2e-4 per param per step)
    # without failing on it.
    np.testing.assert_allclose(got_norms, norms, rtol=1e-2)
    _assert_trees_close(trainer.params, reference.params, rtol=1e-2, atol=1e-2)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(trainer.state.params))
    # The traced program reduce-scatters bf16 (XLA:CPU widens bf16 collectives to f32
    # when it compiles, so check before that).
    assert _lowered_collectives(trainer, "reduce_scatter") == [
        "tensor<32x3xbf16>", "tensor<32xbf16>", "tensor<5x32xbf16>"]
    # Stage 1 gathers the updated f32 shards; stage 3 gathers bf16 shards for the forward.
    gathered = ["tensor<16x3xf32>", "tensor<16xf32>", "tensor<5x16xf32>"]
    if zero == 3:
        gathered = [t.replace("f32", "bf16") for t in gathered]
    assert _lowered_collectives(trainer, "all_gather") == gathered


# XLA's HLO spelling: "%x = f32[5,8]{0,1} reduce-scatter(...)", tuples "(f32[], f32[3]{0})".
_COLLECTIVE = re.compile(r"=\s+(\([^()]*\)|\S+)\s+(all-reduce|reduce-scatter|all-gather)(?:-start)?\(")


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_hlo_one_collective_per_sharded_leaf_and_no_gradient_all_reduce(zero,
                                                                             jaxpr_primitives):
    trainer, _, _ = _leaf_run(zero, 4, 0.1)
    found = Counter((op, shape.split("{")[0])
                    for shape, op in _COLLECTIVE.findall(trainer._compiled.as_text()))
    scattered = sorted(shape for (op, shape), n in found.items() for _ in range(n)
                       if op == "reduce-scatter")
    gathered = sorted(shape for (op, shape), n in found.items() for _ in range(n)
                      if op == "all-gather")
    # XLA:CPU keeps psum_scatter / all_gather as real ops: one per sharded leaf, at shard size.
    assert scattered == ["f32[5,8]", "f32[8,3]", "f32[8]"], found
    assert gathered == ["f32[32,3]", "f32[32]", "f32[5,32]"], found
    # All-reduces (XLA combines them into tuples): scalars (loss, squared norm, finite flag)
    # and the one replicated leaf's (3,) gradient; no sharded leaf's gradient.
    reduced = [part.strip() for (op, shape), n in found.items() if op == "all-reduce"
               for part in shape.strip("()").split(",") if part.strip()]
    assert set(reduced) <= {"f32[]", "s32[]", "f32[3]"} and "f32[3]" in reduced, found
    # The collectives run outside the micro-batch scan, once per optimizer step (stage 3
    # gathers before it, for the forward; both reduce-scatter after it).
    jaxpr = jax.make_jaxpr(trainer._train_step)(trainer.state, trainer._stage(_batches(1)[0]))
    prims = jaxpr_primitives(jaxpr)
    assert ("scan", False) in prims
    for name in ("reduce_scatter", "all_gather"):
        assert [p for p in prims if p[0] == name] == [(name, False)] * 3


def _pre_per_leaf(state, num_devices, *, flat_params):
    """`state` in the layout before per-leaf ZeRO: each moment leaf as per-device chunks
    (raveled, zero-padded to a multiple of n, shape (1, ..., 1, chunk) per device, so
    [n, ..., chunk] globally) and, for stage 3, the params as one flat vector holding
    every leaf's chunk i in slice i."""
    def chunked(x):
        if x.ndim == 0:
            return x
        chunk = -(-x.size // num_devices)
        return jnp.zeros((num_devices,) + (1,) * (x.ndim - 2) + (chunk,) if x.ndim > 1
                         else (num_devices * chunk,), x.dtype)

    opt_state = jax.tree.map(chunked, state.opt_state)
    if not flat_params:
        return state._replace(opt_state=opt_state)
    size = sum(-(-x.size // num_devices) for x in jax.tree.leaves(state.params))
    return state._replace(params=jnp.zeros(num_devices * size, jnp.float32), opt_state=opt_state)


@pytest.mark.parametrize("zero, needle", [
    # Old zero=1: moments in chunks where they now have their parameter's shape.
    (1, "opt_state/0/mu/l1/kernel/value: expected (5, 32), found (4, 40)"),
    # Old zero=3: the params one flat vector (40 + 8 + 24 + 1 per device) where they are
    # now a tree of per-leaf shards.
    (3, "params: expected a tree of arrays, found one array of shape (292,)"),
])
def test_restoring_a_pre_per_leaf_checkpoint_names_the_mismatch(tmp_path, zero, needle):
    new = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=zero, total_steps=10,
                  devices=jax.devices()[:4])
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    try:
        ckpt.save(1, _pre_per_leaf(new.state, 4, flat_params=zero == 3), {})
        ckpt.wait()
        with pytest.raises(RunDirError, match=re.escape(needle)) as err:
            ckpt.restore(new.state)
        assert "per-leaf" in str(err.value) and "new --run-dir" in str(err.value)
        ckpt.save(2, new.state, {})  # the per-leaf layout itself round-trips, sharded
        ckpt.wait()
        restored, _ = ckpt.restore(new.state, step=2)
        _assert_trees_close(restored, new.state, rtol=0, atol=0)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(new.state)):
            assert got.sharding == want.sharding
    finally:
        ckpt.close()


@pytest.mark.parametrize("make", [
    lambda: TrainConfig(zero=3, grad_dtype="compute", precision="bf16"),
    lambda: Trainer(_MLP(nnx.Rngs(0)), _mse, zero=3, grad_dtype="compute", precision="bf16",
                    devices=jax.devices()[:2]),
])
def test_zero3_accepts_compute_dtype_gradients(make):
    make()


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("make, needle", [
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), "clip_by_global_norm"),
    (lambda: optax.lamb(0.1), "lamb"),
    # Before: accepted (a warmup from lr 0 made the differences smaller than the check's
    # absolute floor), and zero=1 trained differently from zero=0.
    (lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 3e-4, 2000, 100_000), weight_decay=0.1)),
     "clip_by_global_norm"),
])
def test_zero_refuses_an_optimizer_that_is_not_elementwise(zero, make, needle):
    # Before: zero=1 silently trained differently from zero=0 (0.08 for clip + sgd, 0.015 for lamb).
    with pytest.raises(ValueError, match=rf"zero={zero} updates each device's shard.*must be "
                                         rf"elementwise.*{needle}.*Use zero=0, or the default optimizer"):
        Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, optimizer=make(), zero=zero,
                devices=jax.devices()[:4])


_WARMUP = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 2000, 100_000)


@pytest.mark.parametrize("optimizer", [
    optax.adamw(0.1, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    # Warmups from lr 0, whose first updates are tiny: still accepted.
    optax.adamw(_WARMUP, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    optax.sgd(_WARMUP, momentum=0.9),
    # Updates that are differences of params, rounded apart by an ulp of the params.
    optax.contrib.schedule_free_adamw(1e-3),
], ids=["masked adamw", "masked adamw warmup", "sgd momentum warmup", "schedule-free adamw"])
def test_zero_accepts_an_elementwise_user_optimizer_with_a_per_leaf_mask(optimizer):
    Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=1, devices=jax.devices()[:4],
            optimizer=optimizer)


@functools.cache
def _user_optimizer_run(zero):
    """A user optimizer (SGD with momentum) with a user clip on 2 devices, over 3 steps of
    which the second has a NaN input (cached: the reference serves both stages)."""
    trainer = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=zero, clip_norm=0.1,
                      optimizer=optax.sgd(0.1, momentum=0.9), microbatches=2,
                      devices=jax.devices()[:2])
    batches = _batches()
    batches[1] = {**batches[1], "x": batches[1]["x"].copy()}
    batches[1]["x"][0, 0] = np.nan
    return trainer, [bool(trainer.step(b)["finite"][0]) for b in batches]


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_user_optimizer_with_a_skipped_step_matches_replicated(zero):
    reference, want = _user_optimizer_run(0)
    trainer, got = _user_optimizer_run(zero)
    assert got == want == [True, False, True]  # the NaN step skipped, the others taken
    assert int(trainer.state.step) == 3 and int(trainer.state.nonfinite_streak) == 0
    # The clip (by the step, over the whole gradient) and the momentum match zero=0's chain.
    _assert_trees_close(trainer.params, reference.params, rtol=1e-5, atol=1e-6)
    trace = trainer.state.opt_state[0].trace
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trace))
    _assert_trees_close(trace, reference.state.opt_state[1][0].trace, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_bf16_params_without_a_master_copy_follow_f32_in_expectation(zero):
    """precision="bf16-pure": Adam steps of ~1e-3 on weights whose half bf16 step is 1-2e-3.
    Rounded to nearest, most of them were dropped and the weights barely moved; rounded
    stochastically (replicated or ZeRO-sharded) they move as the f32 run's do, on average."""
    def moved(precision, zero):
        trainer = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, precision=precision, zero=zero,
                          lr=1e-3, total_steps=1000, warmup=0, weight_decay=0.0, clip_norm=0.0,
                          devices=jax.devices()[:4])
        start = nnx.split(trainer.model, nnx.Param)[1]
        for b in _batches(steps=30):
            trainer.step(b)
        end = nnx.split(trainer.model, nnx.Param)[1]
        return np.concatenate([(np.asarray(e, np.float32) - np.asarray(s, np.float32)).ravel()
                               for s, e in zip(jax.tree.leaves(start), jax.tree.leaves(end))])

    want, got = moved("fp32", 0), moved("bf16-pure", zero)
    np.testing.assert_allclose(np.abs(got).mean(), np.abs(want).mean(), rtol=0.15)
    assert np.corrcoef(got, want)[0, 1] > 0.9


@pytest.mark.parametrize("zero", [1, 3])
def test_bf16_pure_clip_matches_replicated(zero):
    """optax.clip_by_global_norm summed bf16 gradients' squares in bf16 (11.0625 for 11.0715):
    the replicated step clipped by another norm than the ZeRO step's f32 one, and the bf16
    params parted. The trainer's clip now takes the norm in f32 (train.state.global_norm_f32)."""
    reference, norms, _ = _leaf_run(0, 4, 0.1, precision="bf16-pure")
    trainer, got_norms, _ = _leaf_run(zero, 4, 0.1, precision="bf16-pure")
    assert min(norms) > 0.1  # clipping is active on every step
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(reference.params)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@functools.cache
def _masked_optimizer_run(zero):
    """Adam on the kernels only (`optax.masked`: its moments hold MaskedNode() at the biases),
    3 steps on 4 devices (cached: the reference serves both stages)."""
    tx = optax.masked(optax.adam(0.05), lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    trainer = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=zero, optimizer=tx, clip_norm=0.0,
                      devices=jax.devices()[:4])
    first = jax.tree.map(np.asarray, trainer.params)
    for b in _batches():
        jax.block_until_ready(trainer.step(b))
    return trainer, first


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_trains_a_masked_user_optimizer_like_replicated(zero):
    """Before: refused ('per-leaf ZeRO could not match the optimizer state to the parameters':
    the MaskedNode in place of each bias is an empty pytree where the params have an array)."""
    reference, first = _masked_optimizer_run(0)
    trainer, _ = _masked_optimizer_run(zero)
    _assert_trees_close(trainer.params, reference.params, rtol=1e-5, atol=1e-6)
    assert np.abs(_param(trainer.params, "l1/kernel") - _param(first, "l1/kernel")).max() > 1e-3
    # Its moment is sharded per leaf (1/4 per device), as an unmasked Adam's is.
    kernel_mu = trainer.state.opt_state.inner_state[0].mu["l1"]["kernel"][...]
    assert not kernel_mu.sharding.is_fully_replicated
    assert {s.data.size for s in kernel_mu.addressable_shards} == {kernel_mu.size // 4}
