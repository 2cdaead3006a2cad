"""ZeRO stages 1 and 3 in the trainer: same training as replicated, less memory, resumable.

Tiny MLP (leaf sizes that do not divide 8, so the chunk padding is exercised)
on 8 emulated devices; the resume test reuses tests/test_train.py's tiny GPT
run shape.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.train import TrainConfig, Trainer, train
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


@pytest.mark.parametrize("zero", [1, 3])
def test_one_reduce_scatter_per_optimizer_step_after_the_accumulation_scan(zero):
    trainer = _trainer(zero, grad_sync="psum")  # microbatches=2: a scan over micro-batches
    jaxpr = jax.make_jaxpr(trainer._train_step)(trainer.state, trainer._stage(_batches(1)[0]))
    prims = _primitives(jaxpr.jaxpr)
    assert ("scan", False) in prims
    assert [p for p in prims if p[0] == "reduce_scatter"] == [("reduce_scatter", False)]
    # Stage 1 gathers the updated params once; stage 3 gathers them once for the forward.
    assert [p for p in prims if p[0] == "all_gather"] == [("all_gather", False)]
    assert not any(name in ("psum", "all_gather") and inside for name, inside in prims)
