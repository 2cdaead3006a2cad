"""ZeRO stages 1 and 3 in the trainer: same training as replicated, less memory, resumable.

Tiny MLP: hidden=30 on 8 emulated devices (no leaf divides 8: stage 3's chunk
padding, and stage 1 with every leaf replicated), hidden=32 on 2 and 4 devices
for per-leaf stage 1 (on 4 the (3,) output bias has no divisible dimension and
stays replicated, the other leaves are sharded); the resume test reuses
tests/test_train.py's tiny GPT run shape.
"""

import dataclasses
import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxopt_train.train import TrainConfig, Trainer, train
from jaxopt_train.train.checkpoint import Checkpointer, RunDirError
from jaxopt_train.train.cli import config_from_args
from jaxopt_train.train.zero_step import make_chunked_layout

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


def test_zero1_resume_matches_uninterrupted_run(tmp_path):
    run = dict(TINY_RUN, steps=4, zero=1)
    full = train(TrainConfig(run_dir=str(tmp_path / "full"), **run))
    split = TrainConfig(run_dir=str(tmp_path / "split"), **run)
    train(split, until_step=2)
    second = train(dataclasses.replace(split, resume=True))
    assert second.step == 4
    _assert_trees_close(full.trainer.params, second.trainer.params, rtol=1e-5, atol=1e-6)
    # The sharded optimizer state came back sharded, equal to the uninterrupted run's.
    mu = [x for x in jax.tree.leaves(second.trainer.state.opt_state) if x.ndim >= 1]
    assert mu and all(not x.sharding.is_fully_replicated for x in mu)
    _assert_trees_close(full.trainer.state.opt_state, second.trainer.state.opt_state,
                        rtol=1e-5, atol=1e-7)
    with pytest.raises(Exception, match="zero"):  # another stage is refused by name
        train(dataclasses.replace(split, resume=True, zero=0))


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


def test_chunked_layout_round_trip_and_slices():
    tree = {"a": jnp.arange(15.0).reshape(3, 5), "b": jnp.arange(3.0), "c": jnp.float32(7.0)}
    layout = make_chunked_layout(tree, 4)
    flat = layout.flatten(tree)
    assert flat.shape == (4 * layout.shard_size,) and layout.chunks == (4, 1, 1)
    _assert_trees_close(layout.unflatten(flat), tree, rtol=0, atol=0)
    piece = layout.slice_tree(flat.reshape(4, -1)[1])  # device 1: chunk 1 of every leaf
    np.testing.assert_array_equal(piece["a"], [[4.0, 5.0, 6.0, 7.0]])
    np.testing.assert_array_equal(piece["b"], [1.0])
    with pytest.raises(ValueError, match="one floating dtype"):
        make_chunked_layout({"a": jnp.zeros(3), "b": jnp.zeros(3, jnp.int32)}, 2)


def _primitives(jaxpr, in_scan=False, out=None):
    """(primitive name, inside a scan?) of every equation, nested jaxprs included."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, in_scan))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    _primitives(inner, in_scan or eqn.primitive.name == "scan", out)
    return out


def test_zero3_one_reduce_scatter_per_optimizer_step_after_the_accumulation_scan():
    trainer = _trainer(3, grad_sync="psum")  # microbatches=2: a scan over micro-batches
    jaxpr = jax.make_jaxpr(trainer._train_step)(trainer.state, trainer._stage(_batches(1)[0]))
    prims = _primitives(jaxpr.jaxpr)
    assert ("scan", False) in prims
    assert [p for p in prims if p[0] == "reduce_scatter"] == [("reduce_scatter", False)]
    # Stage 3 gathers the flat params once, for the forward.
    assert [p for p in prims if p[0] == "all_gather"] == [("all_gather", False)]
    assert not any(name in ("psum", "all_gather") and inside for name, inside in prims)


# Per-leaf stage 1 ------------------------------------------------------------
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


@pytest.mark.parametrize("num_devices, clip_norm", [(2, 0.1), (4, 0.1), (4, 0.0)])
def test_zero1_per_leaf_matches_replicated(num_devices, clip_norm):
    reference, norms, _ = _leaf_run(0, num_devices, clip_norm)
    trainer, got_norms, _ = _leaf_run(1, num_devices, clip_norm)
    if clip_norm:
        assert min(norms) > clip_norm  # clipping is active on every step
    # f32 throughout: the reduce-scatter's shard is the all-reduce's slice; only the
    # norm's summation order differs.
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    _assert_trees_close(trainer.params, reference.params, rtol=1e-5, atol=1e-6)
    mu = trainer.state.opt_state[0].mu
    for name, shape in SHARDED.items():
        leaf = mu[name.split("/")[0]][name.split("/")[1]][...]
        assert leaf.shape == shape and not leaf.sharding.is_fully_replicated
        # Optimizer state memory per device: 1/n of the leaf.
        assert {s.data.size for s in leaf.addressable_shards} == {leaf.size // num_devices}
    assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(trainer.params))


def test_zero1_leaf_with_no_divisible_dimension_stays_replicated_and_is_updated():
    trainer, _, first = _leaf_run(1, 4, 0.1)
    reference, _, _ = _leaf_run(0, 4, 0.1)
    bias_mu = trainer.state.opt_state[0].mu["l2"]["bias"][...]
    assert bias_mu.sharding.spec == P() and bias_mu.sharding.is_fully_replicated
    assert float(np.abs(bias_mu).max()) > 0  # its moment was updated
    got = _param(trainer.params, "l2/bias")
    assert np.abs(got - _param(first, "l2/bias")).max() > 1e-3
    np.testing.assert_allclose(got, _param(reference.params, "l2/bias"), rtol=1e-5, atol=1e-6)


def test_zero1_bf16_compute_gradients_match_replicated_compute_gradients():
    reference, norms, _ = _leaf_run(0, 2, 0.1, precision="bf16", grad_dtype="compute")
    trainer, got_norms, _ = _leaf_run(1, 2, 0.1, precision="bf16", grad_dtype="compute")
    # Both sum the same two bf16 per-device gradients once (a bf16 all-reduce vs bf16
    # reduce-scatters), then widen to f32: measured bit-equal on XLA:CPU. The loose
    # tolerance allows a backend that rounds the two bf16 reductions differently (one
    # bf16 ulp, ~4e-3 relative, per gradient entry; Adam passes about that on to each
    # step of lr=0.05: ~2e-4 per param per step) without failing on it.
    np.testing.assert_allclose(got_norms, norms, rtol=1e-2)
    _assert_trees_close(trainer.params, reference.params, rtol=1e-2, atol=1e-2)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(trainer.params))
    # The traced program reduce-scatters bf16 (XLA:CPU widens bf16 collectives to f32
    # when it compiles, so check before that).
    lowered = trainer._train_step.lower(trainer.state, trainer._stage(_batches(1)[0])).as_text()
    scattered = re.findall(r'"stablehlo.reduce_scatter"\(.*?\}\) : \(([^)]*)\)', lowered, re.S)
    assert sorted(scattered) == ["tensor<32x3xbf16>", "tensor<32xbf16>", "tensor<5x32xbf16>"]


# XLA's HLO spelling: "%x = f32[5,8]{0,1} reduce-scatter(...)", tuples "(f32[], f32[3]{0})".
_COLLECTIVE = re.compile(r"=\s+(\([^()]*\)|\S+)\s+(all-reduce|reduce-scatter|all-gather)(?:-start)?\(")


def test_zero1_hlo_reduce_scatters_each_sharded_leaf_and_all_reduces_no_gradient():
    trainer, _, _ = _leaf_run(1, 4, 0.1)
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
    # The reduce-scatters come after the micro-batch scan, once per optimizer step.
    jaxpr = jax.make_jaxpr(trainer._train_step)(trainer.state, trainer._stage(_batches(1)[0]))
    prims = _primitives(jaxpr.jaxpr)
    assert ("scan", False) in prims
    assert [p for p in prims if p[0] == "reduce_scatter"] == [("reduce_scatter", False)] * 3


def test_restoring_a_chunked_zero1_checkpoint_names_the_mismatch(tmp_path):
    """A zero=1 checkpoint from before the per-leaf layout held stage 3's chunked optimizer
    state ([n, chunk] per leaf); loading it into per-leaf moments must fail, by name."""
    new = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=1, total_steps=10,
                  devices=jax.devices()[:4])
    chunked = Trainer(_MLP(nnx.Rngs(0), hidden=32), _mse, zero=3, total_steps=10,
                      devices=jax.devices()[:4]).state.opt_state
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    try:
        ckpt.save(1, new.state._replace(opt_state=chunked), {})
        ckpt.wait()
        with pytest.raises(RunDirError, match=re.escape(
                "opt_state/0/mu/l1/kernel/value: expected (5, 32), found (4, 40)")) as err:
            ckpt.restore(new.state)
        assert "per-leaf" in str(err.value) and "new --run-dir" in str(err.value)
        ckpt.save(2, new.state, {})  # the per-leaf layout itself round-trips
        ckpt.wait()
        restored, _ = ckpt.restore(new.state, step=2)
        _assert_trees_close(restored.opt_state, new.state.opt_state, rtol=0, atol=0)
    finally:
        ckpt.close()


@pytest.mark.parametrize("make", [
    lambda: TrainConfig(zero=3, grad_dtype="compute", precision="bf16"),
    lambda: Trainer(_MLP(nnx.Rngs(0)), _mse, zero=3, grad_dtype="compute", precision="bf16",
                    devices=jax.devices()[:2]),
])
def test_zero3_refuses_compute_dtype_gradients_naming_the_fix(make):
    with pytest.raises(ValueError, match=r"zero=3.*use zero=1 .* or grad_dtype='param'"):
        make()
