"""The trainer end to end on CPU: learning, resume, data parallelism, guards, signals."""

import dataclasses
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopt_train.data.text import load_text_corpus
from jaxopt_train.models import GPT, get_gpt_config
from jaxopt_train.train import NonFiniteError, RunDirError, TrainConfig, Trainer, train
from jaxopt_train.train.metrics import read_jsonl
from jaxopt_train.train.model import gpt_loss_fn

TINY = dict(d_model=32, n_layers=1, n_heads=2)
# One model/run shape shared by the loop tests, so that with the compilation
# cache below they compile the train and eval steps once between them.
LEARN = dict(model_overrides=dict(d_model=64, n_layers=2, n_heads=4), seq_len=64, batch_size=16,
             steps=300, warmup=20, lr=1e-2, log_every=20, eval_every=0, eval_batches=4,
             checkpoint_every=150, progress="lines")


@pytest.fixture(autouse=True, scope="module")
def _compilation_cache(tmp_path_factory):
    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def _cfg(tmp_path, name="run", **kw):
    return TrainConfig(**{"run_dir": str(tmp_path / name), **LEARN, **kw})


def _one_device():
    return jax.devices()[:1]


def _unigram_entropy() -> float:
    corpus = load_text_corpus(None)
    counts = np.bincount(np.asarray(corpus[: 2_000_000]), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())  # nats per byte


def test_gpt_tiny_learns_and_resume_matches_uninterrupted_run(tmp_path, capsys):
    full = train(_cfg(tmp_path, "full"), devices=_one_device())
    assert full.step == 300 and not full.interrupted
    entropy = _unigram_entropy()
    assert full.eval_loss < entropy - 0.45, (full.eval_loss, entropy)
    assert "compiled train step" in capsys.readouterr().out
    full_records = read_jsonl(os.path.join(full.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in full_records] == list(range(20, 301, 20))
    assert full_records[-1]["loss"] < full_records[0]["loss"] - 1.0
    assert {"loss", "tokens_per_s", "step_time_s", "grad_norm", "lr", "eval_loss"} <= set(full_records[-1])
    assert sorted(os.listdir(os.path.join(full.run_dir, "checkpoints"))) == ["150", "300"]

    split_cfg = _cfg(tmp_path, "split")
    first = train(split_cfg, until_step=160, devices=_one_device())
    assert first.step == 160
    second = train(dataclasses.replace(split_cfg, resume=True), devices=_one_device())
    assert second.step == 300
    for a, b in zip(jax.tree.leaves(full.trainer.params), jax.tree.leaves(second.trainer.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    records = read_jsonl(os.path.join(split_cfg.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [r["step"] for r in full_records]  # appended
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in full_records],
                               rtol=1e-4)
    # The same run dir without --resume must not destroy the run.
    with pytest.raises(RunDirError, match="--resume"):
        train(split_cfg, devices=_one_device())
    # Resuming into a model of another shape is refused by name.
    other = dataclasses.replace(split_cfg, resume=True, model_overrides=dict(TINY))
    with pytest.raises(RunDirError, match="model_overrides"):
        train(other, devices=_one_device())


def _gpt_trainer(devices, microbatches):
    cfg = get_gpt_config("gpt-tiny", seq_len=16, **TINY)
    return Trainer(GPT(cfg, rngs=nnx.Rngs(0)), gpt_loss_fn, optimizer=optax.sgd(0.5),
                   microbatches=microbatches, devices=devices)


def test_data_parallel_8_devices_equals_one_device():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(3, 16, 17)).astype(np.int32)
    single = _gpt_trainer(jax.devices()[:1], microbatches=1)
    parallel = _gpt_trainer(jax.devices()[:8], microbatches=2)
    assert parallel.num_devices == 8
    for t in tokens:
        batch = {"inputs": t[:, :-1], "targets": t[:, 1:]}
        loss_1 = single.step(batch)["loss"]
        loss_8 = parallel.step(batch)["loss"]
        np.testing.assert_allclose(loss_1, loss_8, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(parallel.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert "arguments" in parallel.memory_report
    with pytest.raises(ValueError, match="divisible"):
        parallel.step({"inputs": tokens[0, :12, :-1], "targets": tokens[0, :12, 1:]})


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(4, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_trainer_matches_reference_sgd_step():
    x = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    batch = {"x": x, "y": x.sum(1, keepdims=True)}
    model = _MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def reference_loss(p):
        return _mse(nnx.merge(graphdef, p), batch)

    grads = jax.jit(jax.grad(reference_loss))(params)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    trainer = Trainer(model, _mse, optimizer=optax.sgd(0.1), devices=jax.devices()[:4])
    trainer.step(batch)
    got = nnx.split(trainer.model, nnx.Param)[1]
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_fp16_nonfinite_step_is_skipped():
    trainer = Trainer(_MLP(nnx.Rngs(0)), _mse, precision="fp16", optimizer=optax.sgd(0.1),
                      devices=jax.devices()[:2])
    before = jax.tree.map(np.asarray, trainer.params)
    x = np.ones((4, 4), np.float32)
    metrics = trainer.step({"x": x, "y": np.full((4, 1), np.inf, np.float32)})
    assert not bool(metrics["finite"][0])
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(trainer.state.loss_scale.skipped_steps) == 1
    assert int(trainer.state.nonfinite_streak) == 1
    small = np.full((4, 4), 0.01, np.float32)
    assert bool(trainer.step({"x": small, "y": np.zeros((4, 1), np.float32)})["finite"][0])
    assert int(trainer.state.nonfinite_streak) == 0


def test_linen_module_trains():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.Dense(16)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(1)(nn.relu(x))

    def loss_fn(apply, batch, train):
        return jnp.mean((apply(batch["x"], train=train) - batch["y"]) ** 2)

    x = np.random.default_rng(2).normal(size=(16, 4)).astype(np.float32)
    batch = {"x": x, "y": x.sum(1, keepdims=True)}
    trainer = Trainer(Net(), loss_fn, init_args=(x[:2],), lr=3e-2, total_steps=30,
                      devices=jax.devices()[:1])
    first = float(trainer.step(batch)["loss"][0])
    for _ in range(29):
        last = float(trainer.step(batch)["loss"][0])
    assert last < 0.3 * first
    stats = trainer.state.model_state["batch_stats"]
    assert float(jnp.abs(jax.tree.leaves(stats)[0]).sum()) > 0  # running stats moved
    assert trainer.evaluate(batch) < first


def test_nonfinite_run_stops_with_clear_error(tmp_path):
    cfg = _cfg(tmp_path, model_overrides=TINY, seq_len=16, batch_size=4, lr=1e30, clip_norm=0.0,
               warmup=0, max_nonfinite_steps=2, log_every=2, steps=8, checkpoint_every=2)
    with pytest.raises(NonFiniteError, match="consecutive steps had non-finite"):
        train(cfg, devices=_one_device())
    steps = sorted(int(s) for s in os.listdir(os.path.join(cfg.run_dir, "checkpoints")))
    assert steps == [] or steps[-1] <= 2  # nothing saved after the guard tripped


def test_sigterm_saves_checkpoint_and_exits_cleanly(tmp_path):
    class KillAtStep4:
        def write(self, text):
            if text.startswith("step 20 "):
                os.kill(os.getpid(), signal.SIGTERM)

        def flush(self):
            pass

        def isatty(self):
            return False

    before = signal.getsignal(signal.SIGTERM)
    cfg = _cfg(tmp_path)
    result = train(cfg, devices=_one_device(), stream=KillAtStep4())
    assert result.interrupted and result.step == 20
    assert os.listdir(os.path.join(cfg.run_dir, "checkpoints")) == ["20"]
    assert signal.getsignal(signal.SIGTERM) is before
    saved = json.load(open(os.path.join(cfg.run_dir, "config.json")))
    assert saved["config"]["steps"] == 300
