"""Trainer inputs and results: snapshots that survive later steps, clear errors for bad batches and losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from jaxopt_train.train import Trainer

pytestmark = pytest.mark.usefixtures("jax_compile_cache")


class _MLP(nnx.Module):
    def __init__(self, rngs):  # hidden 16: sharded over 8 devices at zero=3
        self.l1, self.l2 = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(size=16):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(size, 5)).astype(np.float32),
            "y": rng.normal(size=(size, 3)).astype(np.float32)}


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_model_and_params_survive_later_steps(zero):
    trainer, batch = Trainer(_MLP(nnx.Rngs(0)), _mse, zero=zero, lr=0.1), _batch()
    trainer.step(batch)
    model, params = trainer.model, trainer.params
    expected = np.asarray(model(batch["x"]))
    saved = jax.tree.map(np.asarray, params)
    trainer.step(batch)  # donates the train state
    # Checked directly: np.asarray of a deleted array can still answer from its numpy cache.
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(np.asarray(model(batch["x"])), expected)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), saved)
    moved = jax.tree.map(lambda a, b: np.max(np.abs(np.asarray(a) - b)), trainer.params, saved)
    assert max(jax.tree.leaves(moved)) > 0, "the snapshot must not follow later steps"


@pytest.mark.parametrize("zero", [0, 3])
def test_a_step_larger_than_the_memory_pool_is_refused_before_it_runs(zero, monkeypatch):
    from jaxopt_train.train import trainer as trainer_module

    trainer, batch = Trainer(_MLP(nnx.Rngs(0)), _mse, zero=zero, lr=0.1), _batch()
    state = jax.tree.map(np.asarray, trainer.params)
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: 1024)  # a 1 KiB pool
    with pytest.raises(trainer_module.StepTooLargeError,
                       match=r"the compiled train step does not fit the smallest device memory pool of its mesh: it "
                             r"needs .* GiB of 0.000 GiB budget: does NOT fit \(args .*\), so its "
                             r"first run would fail. To fit: rematerialise blocks"):
        trainer.step(batch)
    assert trainer._compiled is None  # nothing ran: the state is untouched
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.params), state)
    # A pool that holds the step (or a backend that reports none, like the CPU) runs it.
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: 2**40)
    assert np.isfinite(float(trainer.step(batch)["loss"][0]))
    assert issubclass(trainer_module.StepTooLargeError, ValueError)  # the CLI exits 2 on it


def test_the_fit_check_refuses_on_every_process_when_any_needs_more(monkeypatch):
    """Each process compiles its own step; on GPUs the analyses may differ. A step that fit
    here but not on another host ran here and waited forever for that host's collectives.
    Here the other process needs 2 MiB more than this one, and the pool is 1 MiB."""
    from jax.experimental import multihost_utils

    from jaxopt_train.train import trainer as trainer_module

    trainer, batch = Trainer(_MLP(nnx.Rngs(0)), _mse, lr=0.1), _batch()
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: 1 << 20)
    trainer.compile(batch)  # one process: fits
    trainer, batch = Trainer(_MLP(nnx.Rngs(0)), _mse, lr=0.1), _batch()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: np.stack([np.asarray(x), np.asarray(x) + (2 << 20)]))
    with pytest.raises(trainer_module.StepTooLargeError,
                       match=r"does not fit the smallest device memory pool of its mesh: it needs "
                             r".* GiB of 0.001 GiB budget: fits \(.*\); another process's compile "
                             r"needs 0.00\d GiB, so its first run would fail"):
        trainer.compile(batch)


@pytest.mark.parametrize("mine, others, want", [(100, [5], 5), (None, [7], 7), (None, [None], None),
                                                (3, [9], 3)])
def test_every_process_sees_the_smallest_pool_of_all(mine, others, want, monkeypatch):
    # Several hosts must decide alike (the fit check, remat="auto"): a refusal on one host
    # alone would leave the others waiting in the step's collectives.
    from jax.experimental import multihost_utils

    from jaxopt_train.train import step

    gathered = []

    def allgather(x):
        gathered.append(int(x))
        return np.array([x] + [-1 if o is None else o for o in others], np.int64)

    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: mine)
    monkeypatch.setattr(jax, "process_count", lambda: 1 + len(others))
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    assert step.smallest_pool(jax.devices()) == want
    assert gathered == [-1 if mine is None else mine]  # one collective, all processes alike


def test_cpu_reports_no_pool_limit():
    from jaxopt_train.train.step import device_pool_limit

    assert device_pool_limit(jax.devices()[0]) is None  # so the check is skipped on CPU


@pytest.mark.parametrize("extra", [{"z": np.float32(2.0)}, {"a": np.float32(2.0)}])
def test_scalar_batch_leaf_is_named(extra):
    trainer = Trainer(_MLP(nnx.Rngs(0)), _mse)
    name = next(iter(extra))
    with pytest.raises(ValueError, match=f"every batch leaf needs a batch axis; leaf '{name}' has shape"):
        trainer.step({**extra, **_batch()})  # dicts flatten by sorted key: 'a' first, 'z' last


def test_evaluate_checks_the_batch_divides_over_the_devices():
    trainer = Trainer(_MLP(nnx.Rngs(0)), _mse)
    with pytest.raises(ValueError, match=r"global_batch=12 .*not divisible by num_devices=8"):
        trainer.evaluate(_batch(12))
    with pytest.raises(ValueError, match="every batch leaf needs a batch axis; leaf 'w'"):
        trainer.evaluate({**_batch(), "w": np.float32(1.0)})


def _masked_mse(model, batch):
    err = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["m"]) / jnp.sum(batch["m"])


@pytest.mark.parametrize("weighted", [False, True])
def test_evaluate_runs_in_the_train_steps_micro_batches_and_keeps_the_batch_mean(weighted):
    """The whole batch in one eval forward needed 2.5x the temporaries of a train step fitted
    with 8 micro-batches (GPT, vocab 16k): evaluate chunks it like the step, and combines the
    chunks by their weight, so the result is still the whole batch's mean."""
    batch = _batch(64)
    kw = {}
    if weighted:  # chunks of unequal weight, one of weight 0 (its own mean is NaN)
        batch["m"] = np.concatenate([np.ones(10), np.zeros(6), np.zeros(16), np.ones(32)]).astype(np.float32)
        kw = {"weight_fn": lambda b: b["m"].sum()}
    loss_fn = _masked_mse if weighted else _mse
    trainer = Trainer(_MLP(nnx.Rngs(0)), loss_fn, microbatches=4, **kw)
    sizes = []
    eval_step = trainer._eval_step
    trainer._eval_step = lambda p, s, b: sizes.append(b["x"].shape[0]) or eval_step(p, s, b)
    chunked = trainer.evaluate(batch)
    assert sizes == [16] * 4
    model = trainer.model
    want = float(loss_fn(model, jax.tree.map(jnp.asarray, batch)))
    assert chunked == pytest.approx(want, rel=1e-5)
    assert trainer.evaluate(batch, microbatches=1) == pytest.approx(want, rel=1e-5)
    assert sizes[4:] == [64]
    with pytest.raises(ValueError, match=r"global_batch=64 is not divisible by num_microbatches=3"):
        trainer.evaluate(batch, microbatches=3)
    with pytest.raises(ValueError, match=r"num_microbatches=0 must be a positive int"):
        trainer.evaluate(batch, microbatches=0)


def test_evaluate_of_a_batch_with_no_weight_is_nan():
    batch = {**_batch(16), "m": np.zeros(16, np.float32)}
    trainer = Trainer(_MLP(nnx.Rngs(0)), _masked_mse, microbatches=2, weight_fn=lambda b: b["m"].sum())
    assert np.isnan(trainer.evaluate(batch)) and np.isnan(trainer.evaluate(batch, microbatches=1))


@pytest.mark.parametrize("loss_fn, needle", [
    ("mse", r"loss_fn='mse' is not callable; expected loss_fn\(model, batch\)"),
    (lambda batch: 0.0, r"loss_fn\(batch\) cannot be called as loss_fn\(model, batch\)"),
    (lambda model, batch, scale: 0.0, r"cannot be called as loss_fn\(model, batch\).*expected loss_fn"),
])
def test_loss_fn_signature_is_checked_at_construction(loss_fn, needle):
    with pytest.raises(TypeError, match=needle):
        Trainer(_MLP(nnx.Rngs(0)), loss_fn)


def test_loss_fn_with_a_train_parameter_is_accepted():
    trainer = Trainer(_MLP(nnx.Rngs(0)), lambda model, batch, train: _mse(model, batch))
    assert np.isfinite(trainer.evaluate(_batch()))


def test_loss_returning_loss_and_aux_is_named():
    trainer = Trainer(_MLP(nnx.Rngs(0)), lambda model, batch: (_mse(model, batch), {"acc": 1.0}))
    with pytest.raises(ValueError, match=r"scalar loss alone; it returned a tuple of 2 items \(a \(loss, aux\)"):
        trainer.step(_batch())


def test_type_error_inside_the_loss_is_not_reported_as_a_signature_error():
    def loss_fn(model, batch):
        raise TypeError("inside the loss")

    trainer = Trainer(_MLP(nnx.Rngs(0)), loss_fn)
    with pytest.raises(TypeError, match="^inside the loss") as info:
        trainer.step(_batch())
    assert "expected loss_fn" not in str(info.value)


def _device_bytes():
    """Bytes of the distinct device buffers behind every live array (aliases counted once).
    Earlier tests in this process may have left arrays alive: compare differences."""
    import gc

    gc.collect()
    seen = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            seen[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return sum(seen.values())


def _tree_bytes(tree):
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards)


def test_trainer_keeps_no_copy_of_the_initial_weights():
    """The state has its own copy of the user's weights; the trainer must not also hold the
    originals (gpt-1b: 3.4 GiB for the whole run). Dropping the model frees them."""
    before = _device_bytes()
    model = _MLP(nnx.Rngs(0))
    trainer = Trainer(model, _mse, devices=jax.devices()[:1])
    trainer.step(_batch())
    del model
    assert _device_bytes() - before == _tree_bytes(trainer.state)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(trainer.fns.params))


def test_train_run_holds_one_copy_of_the_state(tmp_path):
    """`train(config)` builds its model for the run: the state takes its arrays instead of
    copies, so the device holds the state and nothing else once the run returns."""
    import io

    from jaxopt_train.train import TrainConfig, train

    cfg = TrainConfig(model_overrides=dict(d_model=32, n_layers=1, n_heads=2), seq_len=16,
                      batch_size=8, steps=2, progress="lines", eval_every=0, checkpoint_every=0,
                      run_dir=str(tmp_path / "run"))
    before = _device_bytes()
    result = train(cfg, stream=io.StringIO(), devices=jax.devices()[:1])
    assert _device_bytes() - before == _tree_bytes(result.trainer.state)


class _Linear(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(1)(x)


@pytest.mark.parametrize("seed", [True, 1.5, "3", 2**64])
def test_a_trainer_seed_that_is_not_an_int64_is_refused_naming_it(seed):
    """seed=True initialised with key 1; 1.5, "3" and 2**64 failed inside the Linen init
    with a tracer's TypeError or an OverflowError."""
    with pytest.raises(ValueError, match=f"seed={seed!r} must be an int"):
        Trainer(_Linear(), _mse, init_args=(jnp.ones((1, 4)),), seed=seed,
                devices=jax.devices()[:1])


@pytest.mark.parametrize("zero", [0, 1])
def test_clip_norm_before_a_micro_step_optimizer_is_refused(zero):
    """Was: Trainer(optimizer=multi_steps(opt, k), clip_norm=c) chained the clip before
    MultiSteps, so it clipped each micro-batch's gradient (the docs said so) where a user of
    PyTorch's clip_grad_norm_ after accumulation expects the accumulated one clipped."""
    import optax

    from jaxopt_train.accumulation import multi_steps

    with pytest.raises(ValueError, match=r"clip_norm=1\.0 with an optimizer that accumulates "
                                         r"micro-steps.*put the clip inside it"):
        Trainer(_MLP(nnx.Rngs(0)), _mse, optimizer=multi_steps(optax.sgd(0.1), 2), clip_norm=1.0,
                zero=zero)
    # The clip inside clips the accumulated gradient: two micro-steps, then one clipped step.
    inner = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
    trainer = Trainer(_MLP(nnx.Rngs(0)), _mse, optimizer=multi_steps(inner, 2))
    before = jax.tree.map(np.asarray, trainer.params)
    for _ in range(2):
        trainer.step(_batch())
    moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, trainer.params, before)
    norm = np.sqrt(sum(float(np.sum(d ** 2)) for d in jax.tree.leaves(moved)))
    assert norm == pytest.approx(1e-3, rel=1e-3)
