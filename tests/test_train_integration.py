"""Features combined: precision x micro-batches x ZeRO x steps_per_dispatch, and resume.

Each combination is checked against the plain reference (one device, the whole batch
in one pass, one step per dispatch), as a PyTorch DDP or MaxText user would compare.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopt_train.loss_scale import DynamicLossScale
from jaxopt_train.runtime import read_jsonl
from jaxopt_train.train import TrainConfig, Trainer, train

from test_train import TINY_RUN, _assert_trees_close

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

# d loss / d output of one example is C * sign / (examples in the pass), times the loss
# scale: 40,000 in fp16 for a pass over 4 examples, but 80,000 (inf) over 2.
_C = 160_000 / float(DynamicLossScale().loss_scale)


def _signed_mean_loss(model, batch):
    return jnp.mean(model(batch["x"])[:, 0].astype(jnp.float32) * batch["s"]) * _C


def _signed_batch():
    # Per device (4 rows of 16 on 4 devices) signs +1, +1, -1, -1: every pass, the whole
    # device batch or either micro-batch of 2 (rows k::2), sums to 0, so the gradients
    # stay small while each example's cotangent is large.
    x = 0.5 + 0.01 * np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    return {"x": x, "s": np.tile(np.array([1, 1, -1, -1], np.float32), 4)}


@pytest.mark.parametrize("zero, steps_per_dispatch, grad_dtype", [
    (0, 1, "param"), (3, 2, "compute")])
def test_fp16_micro_batches_keep_the_loss_scale_headroom_of_the_whole_batch(
        zero, steps_per_dispatch, grad_dtype):
    """Each micro-batch's loss is a mean over 1/K of the examples, so its fp16 backward
    carried K times the per-example cotangents of the whole batch's: microbatches=2
    overflowed and skipped the step (and halved the scale) where microbatches=1 and the
    one-device reference did not. The loss is now divided by K, as PyTorch's
    `loss / accumulation_steps`."""
    batch = _signed_batch()
    kw = dict(precision="fp16", optimizer=optax.sgd(0.5), grad_dtype=grad_dtype)
    reference = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), _signed_mean_loss,
                        devices=jax.devices()[:1], **kw)
    assert bool(reference.step(batch)["finite"][0])
    k = steps_per_dispatch
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), _signed_mean_loss, microbatches=2,
                      zero=zero, steps_per_dispatch=k, devices=jax.devices()[:4], **kw)
    if k > 1:  # the same batch k times against k reference steps
        for _ in range(k - 1):
            assert bool(reference.step(batch)["finite"][0])
        batch = jax.tree.map(lambda x: np.stack([x] * k), batch)
    metrics = trainer.step(batch)
    assert np.asarray(metrics["finite"]).all(), metrics["finite"]
    assert int(trainer.state.loss_scale.skipped_steps) == 0
    assert float(trainer.state.loss_scale.loss_scale) == float(reference.state.loss_scale.loss_scale)
    _assert_trees_close(trainer.params, reference.params, rtol=2e-3, atol=1e-4)


def test_resume_on_half_the_devices_with_other_layout_settings_continues_the_run(tmp_path):
    """A run checkpointed on 8 devices at zero=1, one step per dispatch, resumed on 4 at
    zero=3 with 2 micro-batches and 2 steps per dispatch (the same global batch, so the
    same data order), trains as the uninterrupted run and logs each step once."""
    run = dict(TINY_RUN, steps=8, zero=1)
    full = train(TrainConfig(run_dir=str(tmp_path / "full"), **run))
    split = TrainConfig(run_dir=str(tmp_path / "split"), **run)
    train(split, until_step=4)
    second = train(dataclasses.replace(split, resume=True, zero=3, microbatches=2,
                                       steps_per_dispatch=2), devices=jax.devices()[:4])
    assert second.step == 8 and second.trainer.num_devices == 4
    _assert_trees_close(full.trainer.params, second.trainer.params, rtol=1e-5, atol=2e-6)
    records = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    np.testing.assert_allclose([r["loss"] for r in records],
                               [r["loss"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")],
                               rtol=1e-5)
