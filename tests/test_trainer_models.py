"""The Trainer with models and optimizers beyond the plain MLP + AdamW: Dropout's RNG stream,
counters under micro-batching, sown intermediates, optimizers whose state holds scalars or
the params themselves, and the default optimizer's settings next to a user optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopt_train.train import Trainer

pytestmark = pytest.mark.usefixtures("jax_compile_cache")


class MLP(nnx.Module):
    def __init__(self, rngs, dropout: float = 0.0, sow: bool = False):
        self.l1, self.l2 = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 1, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.sow_it = sow

    def __call__(self, x):
        h = jax.nn.relu(self.l1(x))
        if self.sow_it:
            self.sow(nnx.Intermediate, "hidden", h)
        return self.l2(self.drop(h) if self.drop is not None else h)


class Counter(nnx.Variable):
    pass


class CountingMLP(MLP):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.calls = Counter(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return super().__call__(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(n=64, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)
    return {"x": x, "y": x.sum(1, keepdims=True)}


def test_dropout_draws_a_new_mask_every_step():
    batch = _batch()
    trainer = Trainer(MLP(nnx.Rngs(0), dropout=0.5), loss_fn, optimizer=optax.sgd(0.0))
    losses = [float(trainer.step(batch)["loss"][0]) for _ in range(3)]
    assert len(set(losses)) == 3, losses  # same params (lr 0), same batch: only the masks differ
    plain = Trainer(MLP(nnx.Rngs(0)), loss_fn, optimizer=optax.sgd(0.0))
    assert len({float(plain.step(batch)["loss"][0]) for _ in range(2)}) == 1
    assert np.isfinite(trainer.evaluate(batch))  # eval mode: no mask, no draw


class DropoutProbe(nnx.Module):
    """loss = mean(dropout(w) * x) on x of ones: d loss / d w[j] counts the rows that kept unit j."""

    def __init__(self, rngs, width: int):
        self.w = nnx.Param(jnp.ones((width,), jnp.float32))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.broadcast_to(self.w[...], x.shape)) * x


@pytest.mark.parametrize("devices, options", [(8, {}), (8, {"microbatches": 2}), (1, {"microbatches": 8}),
                                              (8, {"zero": 1, "microbatches": 2})])
def test_dropout_masks_differ_across_devices_and_micro_batches(devices, options):
    width = 64
    rows = 8 * options.get("microbatches", 1) if devices == 8 else 8  # one row per device and micro-batch
    trainer = Trainer(DropoutProbe(nnx.Rngs(0), width), lambda model, batch: jnp.mean(model(batch["x"])),
                      optimizer=optax.sgd(1.0), devices=jax.devices()[:devices], **options)
    trainer.step({"x": np.ones((rows, width), np.float32)})
    grad = 1.0 - np.asarray(nnx.state(trainer.model, nnx.Param)["w"][...])
    kept = grad * rows * width * 0.5  # rows keeping unit j (Dropout scales kept units by 2)
    np.testing.assert_allclose(kept, np.round(kept), atol=1e-4)
    # One mask shared by every device and micro-batch makes each unit kept by all rows or
    # by none; independent masks keep most units in some rows only (P(0 or all) = 2 / 2**8
    # per unit with one row per device or micro-batch).
    partly = np.mean((kept > 0.5) & (kept < rows - 0.5))
    assert partly > 0.8, kept


class DropoutBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin, self.drop = nnx.Linear(8, 8, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(jax.nn.relu(self.lin(x))) + x


class StackedDropout(nnx.Module):
    """Three blocks stacked with nnx.vmap and run with nnx.scan: a key per layer."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return DropoutBlock(rngs)
        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return body(x, self.blocks)


@pytest.mark.parametrize("options", [{}, {"microbatches": 2, "zero": 1}])
def test_stacked_dropout_layers_train_with_a_key_per_layer(options):
    # The salt was folded into the stream's key with fold_in, which takes one key, not
    # the (3,) keys of stacked layers: "fold_in accepts a single key".
    trainer = Trainer(StackedDropout(nnx.Rngs(0)), lambda m, b: jnp.mean((m(b["x"]) - b["x"]) ** 2),
                      optimizer=optax.sgd(0.0), devices=jax.devices()[:4], **options)
    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    losses = [float(trainer.step({"x": x})["loss"][0]) for _ in range(2)]
    assert all(np.isfinite(losses)) and losses[0] != losses[1]  # lr 0: only the masks differ


@pytest.mark.parametrize("options", [{}, {"microbatches": 4}, {"zero": 1, "microbatches": 4}])
def test_integer_model_state_counts_every_micro_batch_once(options):
    trainer = Trainer(CountingMLP(nnx.Rngs(0)), loss_fn, optimizer=optax.sgd(1e-2), **options)
    calls = []
    for _ in range(3):
        trainer.step(_batch())
        calls.append(int(trainer.model.calls[...]))
    per_step = options.get("microbatches", 1)
    assert calls == [per_step, 2 * per_step, 3 * per_step]  # was 4, 20, 84 with 4 micro-batches


def test_a_model_that_sows_trains_like_one_that_does_not():
    batch = _batch()
    runs = [Trainer(MLP(nnx.Rngs(0), sow=sow), loss_fn, optimizer=optax.sgd(1e-2)) for sow in (False, True)]
    for trainer in runs:
        for _ in range(2):
            trainer.step(batch)
    jax.tree.map(np.testing.assert_array_equal, *(nnx.to_pure_dict(nnx.state(t.model, nnx.Param))
                                                  for t in runs))


def test_bf16_optimizer_state_keeps_scalar_hyperparameters_wide():
    # optax.inject_hyperparams stores b2=0.999 in the state; in bf16 it is 1.0 and Adam's
    # bias correction divides by zero.
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=0.999)
    trainer = Trainer(MLP(nnx.Rngs(0)), loss_fn, optimizer=optimizer, opt_state_dtype="bf16")
    for _ in range(3):
        assert bool(trainer.step(_batch())["finite"][0])
    hyper = trainer.state.opt_state.hyperparams
    assert hyper["b2"].dtype == jnp.float32 and float(hyper["b2"]) == pytest.approx(0.999)
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if jnp.ndim(x) >= 1]
    assert moments and all(x.dtype == jnp.bfloat16 for x in moments)
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))


def test_an_optimizer_holding_the_params_in_its_state_steps():
    # prodigy keeps params0=params: an eager init put the params' buffers in the state twice.
    trainer = Trainer(MLP(nnx.Rngs(0)), loss_fn, optimizer=optax.contrib.prodigy(1.0),
                      devices=jax.devices()[:1])
    assert np.isfinite(trainer.step(_batch())["loss"][0])


def test_default_optimizer_settings_next_to_a_user_optimizer():
    with pytest.raises(ValueError, match=r"lr=0.5, warmup=3 configure the default optimizer, but "
                                         r"optimizer= was given"):
        Trainer(MLP(nnx.Rngs(0)), loss_fn, optimizer=optax.sgd(1e-2), lr=0.5, warmup=3)


@pytest.mark.parametrize("zero", [0, 1])
def test_clip_norm_with_a_user_optimizer_clips(zero):
    batch = _batch()

    def params_after(clip_norm):
        trainer = Trainer(MLP(nnx.Rngs(0)), loss_fn, optimizer=optax.sgd(1e-2), zero=zero,
                          clip_norm=clip_norm)
        trainer.step(batch)
        return nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))

    start = nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(0)), nnx.Param))
    free, clipped = params_after(None), params_after(1e-3)
    moved = lambda params: float(optax.global_norm(jax.tree.map(jnp.subtract, params, start)))  # noqa: E731
    assert moved(clipped) == pytest.approx(1e-2 * 1e-3, rel=1e-3)  # lr x the clipped norm
    assert moved(free) > 100 * moved(clipped)


@pytest.mark.parametrize("clip_norm", [-1.0, float("nan"), float("inf"), "1", True, np.float32(-2)])
@pytest.mark.parametrize("optimizer, zero", [(optax.sgd(1e-2), 0), (optax.sgd(1e-2), 1),
                                             (None, 0), (None, 1)])
def test_a_bad_clip_norm_is_refused_with_any_optimizer(clip_norm, optimizer, zero):
    """With optimizer= it was taken unchecked: -1 did gradient ascent, NaN passed the
    non-finite guard, '1' failed inside the traced step; at zero=1 the default optimizer's
    clip (the step's) went unchecked too."""
    with pytest.raises(ValueError, match=r"clip_norm=.* must be a finite real number >= 0 \(0 "
                                         r"disables clipping\)"):
        Trainer(MLP(nnx.Rngs(0)), loss_fn, optimizer=optimizer, zero=zero, clip_norm=clip_norm)


def test_a_dropout_models_state_checkpoints_and_restores(tmp_path):
    from jaxopt_train.train.checkpoint import Checkpointer, as_abstract

    trainer = Trainer(MLP(nnx.Rngs(0), dropout=0.5), loss_fn, optimizer=optax.sgd(1e-2),
                      devices=jax.devices()[:1])
    trainer.step(_batch())
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    assert ckpt.save(1, trainer.state, {})
    restored, _ = ckpt.restore(jax.tree.map(as_abstract, trainer.state))
    ckpt.close()
    def plain(state):  # keys as their data, so numpy can compare them
        return [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                else x for x in jax.tree.leaves(state.model_state)]

    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
               for x in jax.tree.leaves(trainer.state.model_state))  # the stream is in the state
    for got, want in zip(plain(restored), plain(trainer.state), strict=True):
        np.testing.assert_array_equal(got, want)


def _masked_loss(model, batch):
    err = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def _masked_batch(rows=32, tokens=6):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, tokens + 1, rows)
    lengths[8:12] = 0  # device 2 of 8 has no tokens at all
    x = rng.standard_normal((rows, tokens, 8)).astype(np.float32)
    return {"x": x, "y": x.sum(-1, keepdims=True),
            "mask": (np.arange(tokens)[None] < lengths[:, None]).astype(np.float32)}


@pytest.mark.parametrize("options", [{"microbatches": 2}, {"zero": 1, "microbatches": 2}, {"zero": 3}])
def test_token_weighted_steps_match_the_whole_batch_token_mean(options, cpu_devices):
    # On the 8 CPU devices also on a GPU machine: device 2's empty rows, and a reference in
    # full f32 (a GPU's default TF32 dots missed rtol 2e-4).
    batch = _masked_batch()
    with jax.default_device(cpu_devices[0]):
        graphdef, params, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)
        want_loss, want_grads = jax.value_and_grad(
            lambda p: _masked_loss(nnx.merge(graphdef, p, rest), batch))(params)
    trainer = Trainer(MLP(nnx.Rngs(0)), _masked_loss, optimizer=optax.sgd(1.0),
                      weight_fn=lambda b: b["mask"].sum(), devices=cpu_devices, **options)
    assert trainer.evaluate(batch) == pytest.approx(float(want_loss), rel=1e-5)
    metrics = trainer.step(batch)
    assert float(metrics["loss"][0]) == pytest.approx(float(want_loss), rel=1e-5)
    moved = jax.tree.map(jnp.subtract, nnx.to_pure_dict(params),
                         nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6),
                 moved, nnx.to_pure_dict(want_grads))
    unweighted = Trainer(MLP(nnx.Rngs(0)), _masked_loss, optimizer=optax.sgd(1.0),
                         devices=cpu_devices, **options)
    assert not np.isfinite(unweighted.step(batch)["loss"][0])  # device 2's mean over no tokens


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_batch_with_nothing_to_count_is_skipped_without_touching_the_loss_scale(zero):
    """Total weight 0: the gradients are NaN (a mean over no tokens), so the step is
    skipped, but nothing overflowed: the fp16 scale used to back off (halve) and the
    non-finite streak to grow, so a run of padding-only batches stopped the run."""
    trainer = Trainer(MLP(nnx.Rngs(0)), _masked_loss, precision="fp16", optimizer=optax.sgd(1e-2),
                      zero=zero, weight_fn=lambda b: b["mask"].sum())
    batch = {k: v * 0.1 if k != "mask" else v for k, v in _masked_batch().items()}  # loss x 2**15 < 65504
    assert bool(trainer.step(batch)["finite"][0])  # one real step: the growth counter is 1
    before = jax.tree.map(np.asarray, (trainer.state.params, trainer.state.loss_scale))
    empty = dict(batch, mask=np.zeros_like(batch["mask"]))
    for _ in range(3):
        metrics = trainer.step(empty)
        assert not bool(metrics["finite"][0])  # skipped: params and optimizer state kept
    after = trainer.state
    jax.tree.map(np.testing.assert_array_equal, before[0], jax.tree.map(np.asarray, after.params))
    assert float(after.loss_scale.loss_scale) == float(before[1].loss_scale)
    assert int(after.loss_scale.growth_counter) == int(before[1].growth_counter) == 1
    assert int(after.loss_scale.skipped_steps) == 3  # counted as skipped: the logged lr counts skips
    assert int(after.nonfinite_streak) == 0
    # Real overflows still back off (the default hysteresis of 2: at the second) and grow the streak.
    for _ in range(2):
        trainer.step(dict(batch, x=np.full_like(batch["x"], np.inf)))
    assert float(trainer.state.loss_scale.loss_scale) == float(before[1].loss_scale) / 2
    assert int(trainer.state.nonfinite_streak) == 2


def test_weight_fn_must_be_callable_and_return_a_scalar():
    with pytest.raises(TypeError, match=r"weight_fn='mask' is not callable; expected weight_fn\(batch\)"):
        Trainer(MLP(nnx.Rngs(0)), _masked_loss, weight_fn="mask")
    trainer = Trainer(MLP(nnx.Rngs(0)), _masked_loss, weight_fn=lambda b: b["mask"].sum(-1))
    with pytest.raises(ValueError, match=r"weight_fn\(batch\) must return a real scalar"):
        trainer.step(_masked_batch())


@pytest.mark.parametrize("cast_outputs", [True, False])
def test_nnx_outputs_reach_the_loss_in_the_output_dtype(cast_outputs):
    """fp16 computes in float16 but hands the loss float32 outputs and targets, as
    `linen_apply` does: a float16 loss turned the scaled loss's cotangent into inf from a
    scale of 2**16 on, so the dynamic scale never grew past 2**15. `cast_outputs=False` (the
    GPT presets, whose loss widens the logits itself) keeps the compute dtype."""
    from jaxopt_train.precision import get_policy
    from jaxopt_train.train.model import nnx_model_fns

    model = MLP(nnx.Rngs(0))
    seen = []

    def regression_loss(model, batch):
        out = model(batch["x"])
        seen.append((out.dtype, batch["y"].dtype, isinstance(model, MLP)))
        if not cast_outputs:  # a loss that widens the outputs itself
            out, batch = out.astype(jnp.float32), jax.tree.map(lambda y: y.astype(jnp.float32), batch)
        # Unwidened: the loss runs in whatever dtype the outputs come in.
        return jnp.mean((out - batch["y"]) ** 2)

    fns = nnx_model_fns(model, regression_loss, get_policy("fp16"), cast_outputs=cast_outputs)
    batch = {"x": _batch()["x"] * 0.01, "y": np.zeros((64, 1), np.float32)}  # small gradients
    grads = jax.grad(lambda p: fns.loss(p, fns.model_state, batch, True)[0] * 2.0**16)(fns.params)
    # The targets come in the outputs' dtype: f32 keeps them whole under fp16.
    want = jnp.dtype(jnp.float32 if cast_outputs else jnp.float16)
    assert seen == [(want, want, True)]
    assert type(model) is MLP  # the class swap is undone after the call
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("precision", ["p=f16,c=f16,o=f16", "p=f16,c=f32,o=f32"])
def test_float16_master_weights_are_refused(precision):
    """float16 weights round an update below 2**-11 of the weight away: the loss stopped
    falling with no error. Training refuses them and names the policy to use instead."""
    with pytest.raises(ValueError, match="param_dtype=float16 cannot hold.*use 'fp16'"):
        Trainer(MLP(nnx.Rngs(0)), loss_fn, precision=precision, optimizer=optax.sgd(1e-3))
