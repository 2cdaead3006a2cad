"""Stopping and resuming safely: a signal saves before anything else, an unaligned resume or a
resume that dies early changes nothing on disk, a refused run leaves no empty folder.

(Several processes agreeing on the stop step: tests/test_multiprocess.py.)
"""

import dataclasses
import json
import os
import signal

import pytest

from jaxopt_train.train import RunDirError, Trainer, train
from jaxopt_train.train import loop as loop_lib
from jaxopt_train.train import resume
from jaxopt_train.train.checkpoint import existing_checkpoint_steps
from jaxopt_train.runtime import read_jsonl

from test_train import _tiny

pytestmark = pytest.mark.usefixtures("jax_compile_cache")


def _saved_config(run_dir):
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)["config"]


def test_a_signal_saves_the_checkpoint_and_skips_the_eval_it_would_have_run(tmp_path, monkeypatch):
    real = loop_lib.dispatch_batch

    def signal_before_step_1(task, step, k):
        if step == 1:  # arrives while step 2's boundary, an eval point, is still ahead
            os.kill(os.getpid(), signal.SIGTERM)
        return real(task, step, k)

    monkeypatch.setattr(loop_lib, "dispatch_batch", signal_before_step_1)
    cfg = _tiny(tmp_path, eval_every=2)
    result = train(cfg)
    assert result.interrupted and result.step == 2
    assert result.eval_loss is None  # no eval between the signal and the save
    assert existing_checkpoint_steps(cfg.run_dir) == [2]
    records = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2] and "eval_loss" not in records[0]


def test_until_step_must_be_a_multiple_of_steps_per_dispatch(tmp_path):
    cfg = _tiny(tmp_path, steps_per_dispatch=2)
    for bad in (3, 0, 2.0, True):
        with pytest.raises(ValueError, match=r"until_step=.* must be a positive multiple of "
                                             r"steps_per_dispatch=2"):
            train(cfg, until_step=bad)
    assert not os.path.exists(cfg.run_dir)


def test_resume_at_a_step_off_the_dispatch_size_is_refused_before_anything_changes(tmp_path):
    cfg = _tiny(tmp_path)
    train(cfg, until_step=3)
    files = sorted(os.listdir(cfg.run_dir))
    resume = dataclasses.replace(cfg, resume=True, steps_per_dispatch=2)
    with pytest.raises(RunDirError, match=r"is at step 3, which is not a multiple of "
                                          r"steps_per_dispatch=2; resume with a "
                                          r"--steps-per-dispatch that divides 3 \(e.g. 1\), or "
                                          r"with --steps-per-dispatch 1 --until-step 4 for 1 step\(s\) and then with 2"):
        train(resume)
    assert sorted(os.listdir(cfg.run_dir)) == files
    assert _saved_config(cfg.run_dir)["steps_per_dispatch"] == 1
    assert existing_checkpoint_steps(cfg.run_dir) == [3]


def test_a_resume_that_dies_before_its_first_checkpoint_keeps_the_saved_settings(tmp_path, monkeypatch):
    cfg = _tiny(tmp_path)
    train(cfg, until_step=2)
    assert _saved_config(cfg.run_dir)["lr"] == cfg.lr
    changed = dataclasses.replace(cfg, resume=True, lr=cfg.lr / 2)

    def interrupted_compile(self, batch):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "compile", interrupted_compile)
        with pytest.raises(KeyboardInterrupt):
            train(changed)
    assert _saved_config(cfg.run_dir)["lr"] == cfg.lr  # what the checkpoint at step 2 ran with
    train(changed, until_step=4)  # this resume saves a checkpoint: its settings are the run's now
    assert _saved_config(cfg.run_dir)["lr"] == cfg.lr / 2
    assert existing_checkpoint_steps(cfg.run_dir) == [2, 4]
    assert not os.path.exists(os.path.join(cfg.run_dir, "config.json.tmp"))


def test_a_run_refused_while_building_leaves_no_empty_folder(tmp_path):
    cfg = _tiny(tmp_path, name="fresh", data=str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError):
        train(cfg)
    assert not os.path.exists(cfg.run_dir)
    existing = tmp_path / "mine"
    existing.mkdir()
    with pytest.raises(FileNotFoundError):
        train(dataclasses.replace(cfg, run_dir=str(existing)))
    assert existing.is_dir()  # a folder the user made stays, even empty


def test_a_resume_may_not_change_the_weights_dtype(tmp_path):
    cfg = _tiny(tmp_path)
    train(cfg, until_step=2)
    with pytest.raises(RunDirError, match=r"param_dtype: saved 'float32', now 'bfloat16'"):
        train(dataclasses.replace(cfg, resume=True, precision="bf16-pure"))
    assert existing_checkpoint_steps(cfg.run_dir) == [2]
    # bf16 compute keeps f32 weights: the same shape, resumable.
    assert (dataclasses.replace(cfg, precision="bf16").model_shape()
            == cfg.model_shape())


def test_runs_saved_before_the_weights_dtype_was_recorded_still_resume(tmp_path):
    class _OldMeta:
        def read_meta(self):
            shape = _tiny(tmp_path).model_shape()
            shape.pop("param_dtype")
            return {"model_shape": shape}

    resume.check_resume_shape(str(tmp_path), _tiny(tmp_path), _OldMeta())  # no RunDirError


def test_a_failing_eval_at_a_checkpoint_step_keeps_that_steps_checkpoint(tmp_path, monkeypatch):
    """The save comes before the eval at a checkpoint step: an eval that fails (out of memory,
    a bad eval batch) used to lose every step since the previous checkpoint."""
    calls = []

    def failing_eval(trainer, task, batches):
        calls.append(trainer.state.step)
        raise RuntimeError("eval went out of memory")

    monkeypatch.setattr(loop_lib, "_evaluate", failing_eval)
    cfg = _tiny(tmp_path, steps=4, eval_every=2, checkpoint_every=2)
    with pytest.raises(RuntimeError, match="eval went out of memory"):
        train(cfg)
    assert len(calls) == 1 and existing_checkpoint_steps(cfg.run_dir) == [2]


def test_a_resume_on_data_of_another_size_says_its_batches_differ(tmp_path):
    """Batch `step` is drawn from a permutation of the data: appended text (or a corpus past
    16 MiB, which earlier versions cut there) gives other batches. Allowed, but said."""
    import io

    corpus = tmp_path / "corpus.txt"
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    corpus.write_text(text)
    cfg = _tiny(tmp_path, data=str(corpus))
    train(cfg, until_step=4, stream=io.StringIO())
    same = io.StringIO()
    train(dataclasses.replace(cfg, resume=True), until_step=6, stream=same)
    assert "warning: the training data" not in same.getvalue()
    corpus.write_text(text + text[:5000])
    grown = io.StringIO()
    train(dataclasses.replace(cfg, resume=True), stream=grown)
    assert (f"warning: the training data holds {len(text) + 5000:,} tokens now, {len(text):,} when "
            "the checkpoint at step 6 was written") in grown.getvalue()


def test_a_default_run_dir_whose_checkpoints_could_not_be_read_back_is_refused_and_removed(
        tmp_path, monkeypatch):
    """Before: trained and saved into runs/... under a folder named like `sweep[1]`, where
    orbax (which globs the path) cannot restore what it saved; and a refusal of the run dir
    left the default run dir it had just made behind."""
    project = tmp_path / "sweep[1]"
    project.mkdir()
    monkeypatch.chdir(project)
    with pytest.raises(RunDirError, match=r"'\[' and '\]' in its checkpoint path .*pick a --run-dir"):
        train(dataclasses.replace(_tiny(tmp_path), run_dir=None))
    assert os.listdir(project / "runs") == []
