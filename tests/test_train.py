"""The trainer end to end on CPU: learning, resume, data parallelism, guards, signals, sinks.

Compile time dominates here (2 CPU cores), so the loop tests share one tiny
run shape (`TINY_RUN`, on all 8 devices) and a compilation cache: its train
and eval steps compile once for the module (and for tests/test_train_cli.py).
Numerical claims are checked against plain-`jax.jit` references, never
against a second compile of the trainer itself.
"""

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopt_train.data.text import load_text_corpus
from jaxopt_train.models import GPT, get_gpt_config
from jaxopt_train.train import NonFiniteError, RunDirError, TrainConfig, Trainer, train
from jaxopt_train.train import train as train_run
from jaxopt_train.train import loop as loop_lib
from jaxopt_train.train.checkpoint import existing_checkpoint_steps
from jaxopt_train.runtime import read_jsonl
from jaxopt_train.train.model import gpt_loss_fn

TINY_MODEL = dict(d_model=32, n_layers=1, n_heads=2)
# The run shape of the resume / signal / non-finite / sink tests (and the CLI
# test). Everything that enters the compiled step (model, batch, optimizer
# schedule) must stay equal between them for the compilation cache to hit.
# (Micro-batching is covered by the Trainer reference test below; a scan here
# would only add compile time.)
TINY_RUN = dict(model_overrides=TINY_MODEL, seq_len=32, batch_size=8, microbatches=1, steps=8,
                warmup=2, lr=1e-2, log_every=2, eval_every=0, eval_batches=1, checkpoint_every=0,
                progress="lines")  # orbax saves cost ~1 s each here: only the final one
# The learning run: big enough to learn real structure in ~200 steps on one device.
LEARN_RUN = dict(model_overrides=dict(d_model=64, n_layers=1, n_heads=4), seq_len=64,
                 batch_size=16, steps=200, warmup=10, lr=1e-2, log_every=50, eval_every=0,
                 eval_batches=4, checkpoint_every=100, progress="lines")


# One compilation cache for the module (and tests/test_train_cli.py, tests/test_train_zero.py).
pytestmark = pytest.mark.usefixtures("jax_compile_cache")


def _tiny(tmp_path, name="run", **kw):
    return TrainConfig(**{"run_dir": str(tmp_path / name), **TINY_RUN, **kw})


def _unigram_entropy() -> float:
    corpus = load_text_corpus(None)
    counts = np.bincount(np.asarray(corpus[: 2_000_000]), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())  # nats per byte


def _assert_trees_close(a, b, **tol):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **tol)


# ---------------------------------------------------------------- the train() loop

def test_gpt_learns_well_below_unigram_entropy(tmp_path, capsys):
    cfg = TrainConfig(run_dir=str(tmp_path / "learn"), **LEARN_RUN)
    result = train(cfg, devices=jax.devices()[:1])
    assert result.step == 200 and not result.interrupted
    entropy = _unigram_entropy()  # ~3.1 nats/byte; a model of context must beat it clearly
    assert result.eval_loss < entropy - 0.4, (result.eval_loss, entropy)
    assert "compiled train step" in capsys.readouterr().out
    records = read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [50, 100, 150, 200]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert {"loss", "tokens_per_s", "step_time_s", "grad_norm", "lr", "eval_loss"} <= set(records[-1])
    assert sorted(os.listdir(os.path.join(result.run_dir, "checkpoints"))) == ["100", "200"]


def test_resume_matches_uninterrupted_run(tmp_path, cpu_devices):
    # The 8 CPU devices also on a GPU machine: the resume is checked sharded.
    train = functools.partial(train_run, devices=cpu_devices)
    full = train(_tiny(tmp_path, "full"))
    assert full.step == 8 and full.trainer.num_devices == 8
    full_records = read_jsonl(os.path.join(full.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in full_records] == [2, 4, 6, 8]

    split_cfg = _tiny(tmp_path, "split")
    first = train(split_cfg, until_step=2)  # saves its own checkpoint at step 2
    assert first.step == 2
    second = train(dataclasses.replace(split_cfg, resume=True))
    assert second.step == 8
    # Adam moments, the schedule position and the data order all come back.
    _assert_trees_close(full.trainer.params, second.trainer.params, rtol=1e-5, atol=1e-6)
    records = read_jsonl(os.path.join(split_cfg.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # appended to the same file
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in full_records],
                               rtol=1e-5)
    # The same run dir without --resume must not destroy the run.
    with pytest.raises(RunDirError, match="--resume"):
        train(split_cfg)
    # Resuming into a model of another shape is refused by name.
    other = dataclasses.replace(split_cfg, resume=True, model_overrides=dict(TINY_MODEL, d_model=16))
    with pytest.raises(RunDirError, match="model_overrides"):
        train(other)
    # The logged lr is the rate the interval's last step ran with: optax's schedule at the
    # optimizer count before that step (step - 1), as test_logged_lr_is_the_optimizer_schedule
    # pins _current_lr to that schedule.
    assert [r["lr"] for r in full_records] == [
        pytest.approx(loop_lib._current_lr(split_cfg, r["step"] - 1)) for r in full_records]
    assert full_records[0]["lr"] == pytest.approx(split_cfg.lr / 2)  # step 2 ran at count 1 of 2
    # --overwrite with a bad setting fails before it deletes anything the run had.
    files = sorted(os.listdir(split_cfg.run_dir))
    bad = dataclasses.replace(split_cfg, overwrite=True, data=str(tmp_path / "missing.txt"))
    with pytest.raises((FileNotFoundError, ValueError)):
        train(bad)
    assert sorted(os.listdir(split_cfg.run_dir)) == files
    assert existing_checkpoint_steps(split_cfg.run_dir) == [2, 8]
    # So does one whose step fails only when it is compiled (the peer all-reduce needs
    # 2 Hopper GPUs): the old run was deleted before the compile.
    metrics_before = open(os.path.join(split_cfg.run_dir, "metrics.jsonl")).read()
    with pytest.raises(ValueError, match="peer"):
        train(dataclasses.replace(split_cfg, overwrite=True, grad_sync="peer"))
    assert existing_checkpoint_steps(split_cfg.run_dir) == [2, 8]
    assert open(os.path.join(split_cfg.run_dir, "metrics.jsonl")).read() == metrics_before
    # and into a new folder it leaves none (it left config.json and an empty run that
    # --resume and a plain rerun both refused).
    with pytest.raises(ValueError, match="peer"):
        train(dataclasses.replace(split_cfg, run_dir=str(tmp_path / "new"), grad_sync="peer"))
    assert not os.path.exists(tmp_path / "new")
    # A damaged latest checkpoint is refused by step, pointing at the previous one.
    shutil.rmtree(os.path.join(split_cfg.run_dir, "checkpoints", "8", "state"))
    with pytest.raises(RunDirError, match=r"checkpoint at step 8 .* damaged or incomplete; to "
                                          r"resume from step 2 \(the previous checkpoint\)"):
        train(dataclasses.replace(split_cfg, resume=True))


def test_sigterm_saves_checkpoint_and_exits_cleanly(tmp_path):
    class KillAtStep2:
        def write(self, text):
            if text.startswith("step 2 "):
                os.kill(os.getpid(), signal.SIGTERM)

        def flush(self):
            pass

        def isatty(self):
            return False

    before = signal.getsignal(signal.SIGTERM)
    cfg = _tiny(tmp_path)
    result = train(cfg, stream=KillAtStep2())
    assert result.interrupted and result.step == 2
    assert os.listdir(os.path.join(cfg.run_dir, "checkpoints")) == ["2"]
    assert signal.getsignal(signal.SIGTERM) is before
    with open(os.path.join(cfg.run_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["config"]["steps"] == 8


@pytest.mark.parametrize("checkpoint_every", [4, 2])
def test_nonfinite_run_stops_with_clear_error_keeping_last_good_checkpoint(tmp_path, monkeypatch,
                                                                           checkpoint_every):
    real_build_task = loop_lib.build_task

    def poisoned_build_task(cfg, policy):
        task = real_build_task(cfg, policy)
        clean = task.train_batch

        def train_batch(step):
            batch = clean(step)
            if step >= 4:  # token ids past the vocabulary embed as NaN (jnp.take's "fill" mode)
                batch = dict(batch, inputs=np.full_like(batch["inputs"], 10_000))
            return batch

        task.train_batch = train_batch
        return task

    monkeypatch.setattr(loop_lib, "build_task", poisoned_build_task)
    cfg = _tiny(tmp_path, max_nonfinite_steps=2, checkpoint_every=checkpoint_every,
                keep_checkpoints=1)
    with pytest.raises(NonFiniteError, match="2 consecutive steps had non-finite"):
        train(cfg)
    # Steps 0-3 were clean and checkpointed at 4; nothing saved when the guard tripped at 6,
    # even where 6 is a checkpoint step (that save would have pushed 4 out: keep 1).
    assert os.listdir(os.path.join(cfg.run_dir, "checkpoints")) == ["4"]
    records = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6]
    assert np.isfinite(records[1]["loss"]) and records[2]["loss"] == "nan"


def test_nonfinite_limit_reached_at_a_checkpoint_between_log_lines_stops_there(tmp_path, monkeypatch):
    """Checkpoint step 6 between the log lines at 4 and 8: its save was skipped without a
    word and the run went on past the limit (to 8, or on to the end)."""
    real_build_task = loop_lib.build_task

    def poisoned_build_task(cfg, policy):
        task = real_build_task(cfg, policy)
        clean = task.train_batch
        task.train_batch = lambda step: (dict(clean(step), inputs=np.full_like(clean(step)["inputs"], 10_000))
                                         if 4 <= step < 6 else clean(step))  # two bad steps, then clean
        return task

    monkeypatch.setattr(loop_lib, "build_task", poisoned_build_task)
    cfg = _tiny(tmp_path, max_nonfinite_steps=2, checkpoint_every=2, log_every=4, keep_checkpoints=3)
    with pytest.raises(NonFiniteError, match="stopping at step 6: 2 consecutive steps had non-finite"):
        train(cfg)
    assert sorted(os.listdir(os.path.join(cfg.run_dir, "checkpoints"))) == ["2", "4"]


def test_resume_with_settings_that_change_the_state_or_data_is_refused_by_name(tmp_path):
    cfg = _tiny(tmp_path)
    train(cfg, until_step=2)
    # fp16 adds a dynamic loss scale, compression its error feedback: the checkpoint is sound,
    # so the error names the setting, not a damaged checkpoint to delete with --overwrite.
    for change, needle in ((dict(precision="fp16"), "the loss scale, set by --precision"),
                           (dict(grad_compression="bf16"), "set by --grad-compression")):
        with pytest.raises(RunDirError, match=needle) as info:
            train(dataclasses.replace(cfg, resume=True, **change))
        assert "damaged" not in str(info.value) and "--overwrite" not in str(info.value)
    # Batch `step` is rows step x batch_size on of a permutation seeded by seed: another
    # batch size or seed would skip or repeat examples, so both are refused before any build.
    for change, needle in ((dict(batch_size=16), "batch_size: saved 8, now 16"),
                           (dict(seed=1), "seed: saved 0, now 1")):
        with pytest.raises(RunDirError, match=needle):
            train(dataclasses.replace(cfg, resume=True, **change))
    # A checkpoint past the last step asked for trains nothing: said so, not "done".
    with pytest.raises(RunDirError, match=r"at step 2, past the last step asked for \(--steps 1\)"):
        train(dataclasses.replace(cfg, resume=True, steps=1))
    assert existing_checkpoint_steps(cfg.run_dir) == [2]


def test_logged_lr_is_the_optimizers_after_skipped_steps(tmp_path, monkeypatch):
    real_build_task = loop_lib.build_task

    def poisoned_build_task(cfg, policy):
        task = real_build_task(cfg, policy)
        clean = task.train_batch

        def train_batch(step):  # steps 2 and 3 are non-finite (ids past the vocabulary)
            batch = clean(step)
            return dict(batch, inputs=np.full_like(batch["inputs"], 10_000)) if step in (2, 3) else batch

        task.train_batch = train_batch
        return task

    monkeypatch.setattr(loop_lib, "build_task", poisoned_build_task)
    cfg = _tiny(tmp_path, max_nonfinite_steps=3)
    train(cfg)
    records = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert [r["skipped_steps"] for r in records] == [0, 2, 2, 2]
    # The skipped steps left optax's count behind: the last update of each interval was that
    # of steps 1, 1 (2 and 3 were skipped), 5 and 7, at counts 1, 1, 3 and 5. (The log was 2
    # steps ahead of the optimizer's schedule from step 4 on.)
    assert [r["lr"] for r in records] == [pytest.approx(loop_lib._current_lr(cfg, count))
                                          for count in (1, 1, 3, 5)]


def test_prometheus_scrape_and_tensorboard_events_during_a_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Scraper:
        """Metric lines arrive after the sinks were written: scrape the live endpoint then."""

        def __init__(self):
            self.port, self.scrapes = None, {}

        def write(self, text):
            if text.startswith("prometheus metrics at "):
                self.port = int(text.split(":")[2].split("/")[0])
            elif text.startswith("step "):
                url = f"http://127.0.0.1:{self.port}/metrics"
                with urllib.request.urlopen(url, timeout=10) as response:
                    self.scrapes[int(text.split()[1])] = response.read().decode()

        def flush(self):
            pass

    scraper = Scraper()
    cfg = _tiny(tmp_path, tensorboard=True, prometheus_port=0)
    train(cfg, until_step=4, stream=scraper)
    assert scraper.port and sorted(scraper.scrapes) == [2, 4]
    records = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    for record, (step, text) in zip(records, sorted(scraper.scrapes.items())):
        gauges = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert float(gauges["jaxopt_train_step"]) == step
        assert float(gauges["jaxopt_train_loss"]) == pytest.approx(record["loss"], rel=1e-6)
        assert float(gauges["jaxopt_train_tokens_per_s"]) > 0
        assert "jaxopt_train_step_time_s" in gauges and "jaxopt_train_loss_scale" in gauges
    with pytest.raises(OSError):  # the server is shut down with the run
        urllib.request.urlopen(f"http://127.0.0.1:{scraper.port}/metrics", timeout=2)

    events = EventAccumulator(os.path.join(cfg.run_dir, "tb"))
    events.Reload()
    assert {"loss", "tokens_per_s", "step_time_s", "lr"} <= set(events.Tags()["scalars"])
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [2, 4]
    np.testing.assert_allclose([e.value for e in losses], [r["loss"] for r in records], rtol=1e-6)


def test_default_run_dirs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop_lib.time, "time", lambda: 1_700_000_000.0)
    first, second = (loop_lib._default_run_dir(TrainConfig()) for _ in range(2))
    assert second == first + "-2" and os.path.isdir(first) and os.path.isdir(second)


def test_loop_evaluation_is_the_mean_over_eval_batches():
    """The loop hands each whole eval batch to `Trainer.evaluate`, which chunks it into the
    train step's micro-batches (tests/test_trainer_inputs.py)."""
    class RecordingTrainer:
        def __init__(self):
            self.sizes = []

        def evaluate(self, batch):
            self.sizes.append(len(batch["x"]))
            return float(np.mean(batch["x"]))

    task = loop_lib.Task(fns=None, train_batch=None, unit="tokens", units_per_example=1,
                         flops_per_example=1.0, description="",
                         eval_batch=lambda i: {"x": np.arange(16.0) + 16 * i})
    trainer = RecordingTrainer()
    assert loop_lib._evaluate(trainer, task, 2) == pytest.approx(15.5)
    assert trainer.sizes == [16, 16]


@pytest.mark.parametrize("steps, warmup", [(8, 2), (300, 30), (5, 0), (1, 3)])
def test_logged_lr_is_the_optimizer_schedule(steps, warmup):
    cfg = TrainConfig(steps=steps, warmup=warmup, lr=3e-3)
    w = min(warmup, steps - 1) if steps > 1 else 0
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if w else cfg.lr, peak_value=cfg.lr, warmup_steps=w, decay_steps=steps,
        end_value=cfg.lr / 10)
    for step in sorted({0, 1, w, w + 1, steps // 2, steps - 1, steps}):
        assert loop_lib._current_lr(cfg, step) == pytest.approx(float(schedule(step)), rel=1e-5)


@pytest.mark.parametrize("steps, warmup, cut", [(8, 2, False), (8, 7, False), (8, 8, True), (10, 20, True),
                                                (1, 3, False)])
def test_a_warmup_cut_to_the_run_is_said(steps, warmup, cut):
    cfg = TrainConfig(steps=steps, warmup=warmup, lr=3e-3)
    note = loop_lib.warmup_note(cfg)
    assert (note is not None) == cut
    if cut:  # what the note says: the last step runs at the peak lr, nothing decays
        assert f"warmup={warmup} >= steps={steps}" in note and f"over {steps - 1} step(s)" in note
        assert loop_lib._current_lr(cfg, steps - 1) == pytest.approx(cfg.lr)


# ---------------------------------------------------------------- Trainer vs references

def _tiny_gpt():
    return GPT(get_gpt_config("gpt-tiny", seq_len=32, **TINY_MODEL), rngs=nnx.Rngs(0))


def _token_batches(steps, batch):
    tokens = np.random.default_rng(0).integers(0, 256, size=(steps, batch, 33)).astype(np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


@pytest.fixture(scope="module")
def gpt_sgd_reference():
    """Batches and the params after each of 3 full-batch SGD steps, by plain jax.jit(jax.grad),
    on the CPU as the trainers below (a GPU's default TF32 dots would miss their tolerance)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return _gpt_sgd_reference()


def _gpt_sgd_reference():
    graphdef, params = nnx.split(_tiny_gpt())

    @jax.jit
    def step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: gpt_loss_fn(nnx.merge(graphdef, p), batch))(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    batches = _token_batches(3, 16)
    trajectory, losses = [], []
    for batch in batches:
        params, loss = step(params, batch)
        trajectory.append(params)
        losses.append(float(loss))
    return batches, trajectory, losses


def test_data_parallel_8_devices_matches_full_batch_reference(gpt_sgd_reference):
    batches, trajectory, losses = gpt_sgd_reference
    trainer = Trainer(_tiny_gpt(), gpt_loss_fn, optimizer=optax.sgd(0.5), microbatches=2,
                      devices=jax.devices("cpu"))
    assert trainer.num_devices == 8 and trainer.state.grad_error is None
    for batch, expected_loss in zip(batches, losses):
        np.testing.assert_allclose(trainer.step(batch)["loss"], [expected_loss], rtol=1e-5)
    _assert_trees_close(nnx.split(trainer.model)[1], trajectory[-1], rtol=1e-4, atol=1e-6)
    assert "arguments" in trainer.memory_report
    with pytest.raises(ValueError, match="divisible"):
        trainer.step({k: v[:12] for k, v in batches[0].items()})


def test_int8_compression_with_error_feedback_stays_close(gpt_sgd_reference):
    batches, trajectory, _ = gpt_sgd_reference
    trainer = Trainer(_tiny_gpt(), gpt_loss_fn, optimizer=optax.sgd(0.5), microbatches=2,
                      grad_compression="int8", devices=jax.devices("cpu"))
    errors = []
    for batch in batches:
        assert bool(trainer.step(batch)["finite"][0])
        errors.append(jax.tree.map(np.asarray, trainer.state.grad_error.error))
    # Error feedback lives in the state: one f32 slice per device, changing every step.
    leaf = jax.tree.leaves(errors[-1])[0]
    assert leaf.dtype == np.float32 and leaf.shape[0] == 8
    assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(errors[0]))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(errors[1]),
                                                         jax.tree.leaves(errors[2])))
    got, want = nnx.split(trainer.model)[1], trajectory[-1]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # int8 with 256-element blocks: each element within a few quantisation steps of its block.
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-2 * np.abs(w).max() + 1e-6)
    with pytest.raises(ValueError, match="grad_compression='fp4'"):
        Trainer(_tiny_gpt(), gpt_loss_fn, grad_compression="fp4")


def test_pallas_matmul_trains_like_xla_inside_shard_map(kernel_in_jaxpr):
    from jaxopt_train.precision import get_policy
    from jaxopt_train.train.task import build_task

    policy = get_policy("bf16")
    shape = dict(preset="gpt-tiny", precision="bf16", model_overrides=dict(TINY_MODEL, n_heads=1),
                 seq_len=8, batch_size=4)
    pallas_task = build_task(TrainConfig(matmul="pallas", **shape), policy)
    xla_fns = build_task(TrainConfig(matmul="xla", **shape), policy).fns
    trainer = Trainer.from_model_fns(pallas_task.fns, optax.sgd(0.5), policy, devices=jax.devices()[:2])

    @jax.jit
    def reference_step(params, batch):  # plain XLA matmuls, the full batch on one device
        grads = jax.grad(lambda p: xla_fns.loss(p, xla_fns.model_state, batch, True)[0])(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    # The kernel is really in the traced step (it silently falls back to XLA for f32 operands).
    jaxpr = jax.make_jaxpr(lambda p: pallas_task.fns.loss(p, pallas_task.fns.model_state,
                                                           pallas_task.train_batch(0), True)[0])
    assert kernel_in_jaxpr(jaxpr(pallas_task.fns.params))
    assert not kernel_in_jaxpr(jax.make_jaxpr(
        lambda p: xla_fns.loss(p, xla_fns.model_state, pallas_task.train_batch(0), True)[0])(xla_fns.params))
    params = xla_fns.params
    # JAX's XLA attention takes bf16 q.k^T with an f32 result; the transpose of that einsum
    # is a dot of the f32 cotangent with bf16 k, whose lowering consults the promotion mode
    # when the step compiles, not when gpt.py traces it (checked on jax 0.10.2: a custom_vjp
    # running the backward under "standard" still fails at jit lowering). So a bf16 GPT with
    # XLA attention compiles under standard promotion, here as for any strict-mode user.
    with jax.numpy_dtype_promotion("standard"):
        for step in range(2):
            batch = pallas_task.train_batch(step)
            trainer.step(batch)
            params = reference_step(params, batch)
    # bf16 operands either way, and both accumulate in f32, but in another order: one bf16 ulp
    # of a gradient is 2e-3 of a parameter at lr 0.5, too coarse for an elementwise tolerance
    # (on the H200 one bias moved 0.0488 against XLA's 0.0527). So each leaf's update is
    # compared as a whole: 3e-3..7e-3 relative on CPU, where a mis-wired dA/dB or a dropped
    # batch shard is O(1).
    for got, want, init in zip(*map(jax.tree.leaves, (trainer.params, params, xla_fns.params))):
        got, want, init = (np.asarray(x, np.float64) for x in (got, want, init))
        error = np.linalg.norm((got - init) - (want - init)) / np.linalg.norm(want - init)
        assert error < 3e-2, (got.shape, error)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(xla_fns.params)))
    assert moved > 1e-2  # the comparison is not between two untouched inits


def test_cnn_small_one_step_matches_full_batch_gradient_with_batchnorm():
    from jaxopt_train.models import create_vision_model
    from jaxopt_train.precision import get_policy
    from jaxopt_train.train.model import vision_loss_fn
    from jaxopt_train.train.task import build_task

    policy = get_policy("fp32")
    cfg = TrainConfig(preset="cnn-small", batch_size=16, image_size=8, num_classes=10)
    task = build_task(cfg, policy)
    trainer = Trainer.from_model_fns(task.fns, optax.sgd(0.1), policy)  # 8 devices, 2 images each
    batch = task.train_batch(0)
    trainer.step(batch)

    # Reference: the same model without axis_name, one device, the whole batch.
    model = create_vision_model("cnn-small", num_classes=10, rngs=nnx.Rngs(cfg.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    _assert_trees_close(params, task.fns.params, rtol=0, atol=0)

    @jax.jit
    def reference(params, rest):
        def loss(p):
            module = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
            value = vision_loss_fn(module, batch, train=True)
            return value, nnx.split(module, nnx.Param, ...)[2]
        return jax.grad(loss, has_aux=True)(params)

    grads, new_rest = reference(params, rest)
    got_grads = jax.tree.map(lambda before, after: (before - after) / 0.1, task.fns.params,
                             trainer.params)
    _assert_trees_close(got_grads, grads, rtol=2e-3, atol=2e-5)
    assert max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads)) > 1e-3
    # BatchNorm running statistics: full-batch moments, averaged over devices.
    _assert_trees_close(trainer.state.model_state, new_rest, rtol=1e-4, atol=1e-6)
    assert any(float(np.abs(np.asarray(a) - np.asarray(b)).max()) > 0
               for a, b in zip(jax.tree.leaves(new_rest), jax.tree.leaves(rest)))


# ---------------------------------------------------------------- small models

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
    _assert_trees_close(expected, nnx.split(trainer.model, nnx.Param)[1], rtol=1e-5, atol=1e-7)
    # The donated train state never owned the user's arrays: the model is intact.
    _assert_trees_close(params, nnx.split(model, nnx.Param)[1], rtol=0, atol=0)


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


def test_bf16_gradients_and_optimizer_state_follow_the_reference_sgd_step(cpu_devices):
    """grad_dtype='compute': gradients w.r.t. the bf16 copy, all-reduced in bf16, then widened.
    On the 8 CPU devices also on a GPU machine (one GPU has no all-reduce to check)."""
    x = np.random.default_rng(2).normal(size=(16, 4)).astype(np.float32)
    batch = {"x": x, "y": x.sum(1, keepdims=True)}
    model = _MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def reference_loss(p):  # full batch, f32: what the bf16 step approximates
        return _mse(nnx.merge(graphdef, p), batch)

    with jax.default_device(cpu_devices[0]):
        grads = jax.jit(jax.grad(reference_loss))(params)
        expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    trainer = Trainer(model, _mse, precision="bf16", optimizer=optax.sgd(0.1), grad_dtype="compute",
                      opt_state_dtype="bf16", devices=cpu_devices)
    assert trainer.num_devices == 8
    trainer.step(batch)
    # bf16 forward/backward: ~3 significant digits per gradient entry.
    _assert_trees_close(expected, nnx.split(trainer.model, nnx.Param)[1], rtol=2e-2, atol=2e-3)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(trainer.params))  # f32 master weights
    # The traced program reduces the gradients in bf16 (the loss in f32). XLA:CPU
    # widens bf16 all-reduces when it compiles, so check before that.
    lowered = trainer._train_step.lower(trainer.state, trainer._stage(batch)).as_text()
    reduced = re.findall(r'"stablehlo.all_reduce"\(.*?\}\) : \(([^)]*)\)', lowered, re.S)
    # One gradient bucket (4*16 + 16 + 16 + 1 = 97 values) in bf16, and the f32 loss.
    assert sorted(reduced) == ["tensor<97xbf16>", "tensor<f32>"], reduced


@pytest.mark.parametrize("kwargs, match", [
    (dict(grad_dtype="fp8"), "grad_dtype='fp8'"),
    (dict(grad_dtype="compute", grad_compression="int8"), "grad_compression"),
    (dict(opt_state_dtype="fp8"), "legal values"),
])
def test_grad_and_state_dtype_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Trainer(_MLP(nnx.Rngs(0)), _mse, precision="bf16", devices=jax.devices()[:2], **kwargs)


@pytest.mark.parametrize("zero", [0, 1])
def test_fp16_gradients_are_divided_by_the_devices_before_their_sum(zero, cpu_devices):
    """fp16 gradients w.r.t. the fp16 compute copy (grad_dtype="compute") meet in one
    cross-device sum. Each device's loss-scaled bias gradient here is 20,000 (finite in
    fp16); the sum of 8 passed 65,504, so every step was skipped as non-finite (and the
    dynamic scale cut) although the mean, 20,000, fits. fp16 leaves are now divided by
    the device count first, as PyTorch DDP does."""
    from jaxopt_train.loss_scale import DynamicLossScale

    scale = float(DynamicLossScale().loss_scale)
    c = 20_000 / scale
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    trainer = Trainer(model, lambda m, b: jnp.mean(m(b["x"]).astype(jnp.float32)) * c,
                      precision="fp16", grad_dtype="compute", optimizer=optax.sgd(1e-3), zero=zero,
                      devices=cpu_devices)  # 8 devices also on a GPU machine
    assert trainer.mesh.shape["data"] == 8
    bias = float(np.asarray(trainer.params["bias"])[0])
    metrics = trainer.step({"x": np.full((16, 4), 0.5, np.float32)})
    assert bool(metrics["finite"][0]) and int(trainer.state.loss_scale.skipped_steps) == 0
    # d loss / d bias = c on every device: SGD moves the bias by lr * c.
    np.testing.assert_allclose(float(np.asarray(trainer.params["bias"])[0]), bias - 1e-3 * c,
                               rtol=1e-3)


@pytest.mark.parametrize("zero", [0, 1])
def test_weighted_fp16_gradients_do_not_overflow_on_a_device_holding_the_weight(zero):
    """With weight_fn, a device's share used to be scaled by n * w / sum(w) (8 here: device 0
    holds every counted row) in fp16 before the sum: 20,000 became 160,000, inf. Its fp16
    shares are now scaled by w / sum(w) and summed."""
    from jaxopt_train.loss_scale import DynamicLossScale

    c = 20_000 / float(DynamicLossScale().loss_scale)

    def loss(m, b):
        pred, mask = m(b["x"])[:, 0].astype(jnp.float32), b["m"].astype(jnp.float32)
        return jnp.sum(mask * pred) / jnp.maximum(jnp.sum(mask), 1.0) * c

    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), loss, precision="fp16",
                      grad_dtype="compute", optimizer=optax.sgd(1e-3), zero=zero,
                      weight_fn=lambda b: jnp.sum(b["m"].astype(jnp.float32)))
    bias = float(np.asarray(trainer.params["bias"])[0])
    mask = np.zeros(16, np.float32)
    mask[:2] = 1.0  # the two rows of device 0
    metrics = trainer.step({"x": np.full((16, 4), 0.5, np.float32), "m": mask})
    assert bool(metrics["finite"][0]) and int(trainer.state.loss_scale.skipped_steps) == 0
    np.testing.assert_allclose(float(np.asarray(trainer.params["bias"])[0]), bias - 1e-3 * c,
                               rtol=1e-3)


@pytest.mark.parametrize("frozen_before", [False, True])
def test_the_step_loop_runs_with_the_collector_frozen_and_unfreezes_after(tmp_path, monkeypatch,
                                                                        frozen_before):
    """gpt-1b under --matmul pallas lost 0.2-0.3 s to one generation-2 collection every ~40
    steps, walking the ~600,000 objects the compiled step keeps alive (BENCHMARKS.md). The
    loop freezes what is alive after compiling; the run's end unfreezes it. Objects frozen
    before (Python 3.12 starts with some) must not stop it: that skip left the GPU run as slow."""
    import gc

    if frozen_before:
        gc.freeze()  # undone by the unfreeze below
    before = gc.get_freeze_count()
    seen = []
    original = Trainer.step

    def step(self, batch):
        seen.append(gc.get_freeze_count())
        return original(self, batch)

    monkeypatch.setattr(Trainer, "step", step)
    try:
        train(_tiny(tmp_path))
    finally:
        after = gc.get_freeze_count()
        gc.unfreeze()
    assert len(seen) == TINY_RUN["steps"] and min(seen) > before + 1000  # the compiled step's
    assert after == 0


def test_frozen_collector_frees_garbage_first_and_unfreezes_on_exit():
    import gc
    import weakref

    from jaxopt_train.runtime import frozen_collector

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # garbage only the cyclic collector frees
    dead = weakref.ref(cycle)
    del cycle
    with frozen_collector():
        assert dead() is None  # collected on entry, not frozen for the run
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        with pytest.raises(ZeroDivisionError):
            with frozen_collector():
                1 / 0  # noqa: B018
        assert gc.get_freeze_count() >= frozen  # a nested exit leaves the outer block frozen
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("precision, advice", [
    ("fp16", r"or a precision with more range than fp16 \(bf16, fp32\)\.$"),
    ("bf16", r"or look for inputs or labels that make the loss overflow\.$"),
    ("fp32", r"or look for inputs or labels that make the loss overflow\.$"),
])
def test_nonfinite_stop_advice_fits_the_precision(precision, advice):
    """An fp16 run was told to 'use a precision with a loss scaler (fp16)': it had one."""
    from types import SimpleNamespace

    from jaxopt_train.precision import get_policy

    trainer = SimpleNamespace(state=SimpleNamespace(nonfinite_streak=np.int32(2)),
                              policy=get_policy(precision))
    with pytest.raises(NonFiniteError, match=rf"stopping at step 7: 2 consecutive .*{advice}"):
        loop_lib.check_streak(TrainConfig(max_nonfinite_steps=2), trainer, 7)
    trainer.state.nonfinite_streak = np.int32(1)
    loop_lib.check_streak(TrainConfig(max_nonfinite_steps=2), trainer, 7)  # under the limit
