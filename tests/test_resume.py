"""`resume`: the checks that refuse a checkpoint a run cannot continue, and what they advise.

The vision classifier's width: --num-classes is a lower bound (the model widens to the
data's largest label + 1), so a checkpoint records the width itself, and one saved before
it did (the flag only) still resumes as it did then.

A run already at its last step: a resume says the run is complete and compiles nothing.
An unreadable config.json behind a checkpoint whose meta predates the model shape and
data order is refused naming the file, and changes nothing.
"""

import dataclasses
import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxopt_train.train import RunDirError, TrainConfig, cli, train
from jaxopt_train.train import resume
from jaxopt_train.train.checkpoint import Checkpointer, existing_checkpoint_steps
from jaxopt_train.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("jax_compile_cache")


def test_a_checkpoint_past_until_step_names_until_step():
    """--steps 16 --until-step 4 against a checkpoint at 8 was told to pass --steps > 8."""
    with pytest.raises(RunDirError, match=r"at step 8, past the last step asked for "
                                          r"\(--until-step 4\), .*pass an --until-step greater "
                                          r"than 8, or leave it out to train on to --steps 16$"):
        resume.check_steps_left(8, 4, 16, "ckpts")


def test_a_checkpoint_past_steps_names_steps():
    with pytest.raises(RunDirError, match=r"\(--steps 4\), .*pass --steps greater than 8$"):
        resume.check_steps_left(8, 4, 4, "ckpts")
    resume.check_steps_left(8, 8, 16, "ckpts")  # at the limit: passes; train() then says the run is complete


class _Meta:
    """A Checkpointer as check_resume_shape reads it: the latest checkpoint's meta."""

    def __init__(self, shape=None):
        self.meta = {} if shape is None else {"model_shape": shape}

    def read_meta(self):
        return self.meta


def _vision(**kw):
    return TrainConfig(**{"preset": "cnn-small", "data": "imgs.npz", "num_classes": 10, **kw})


def test_the_saved_shape_holds_the_classifier_width_not_the_flag():
    shape = _vision().model_shape(15)
    assert shape["classes"] == 15 and "num_classes" not in shape
    assert TrainConfig(preset="cnn-small", num_classes=7).model_shape()["classes"] == 7
    assert "classes" not in TrainConfig().model_shape()  # GPT


@pytest.mark.parametrize("flag", [10, 12, 15])
def test_a_resume_compares_the_classifier_width(tmp_path, flag):
    saved = _Meta(_vision().model_shape(15))  # labels up to 14 widened num_classes=10
    resume.check_resume_shape(str(tmp_path), _vision(num_classes=flag), saved)  # width unknown yet
    resume.check_resume_shape(str(tmp_path), _vision(num_classes=flag), saved, classes=15)


def test_another_classifier_width_is_refused_naming_num_classes(tmp_path):
    saved = _Meta(_vision().model_shape(15))
    with pytest.raises(RunDirError, match=r"hold a classifier of 15 classes, but this run's has "
                                          r"20 \(num_classes=10, widened to the largest label \+ 1 "
                                          r"in data='imgs.npz'\); resume on the run's own data "
                                          r"and --num-classes"):
        resume.check_resume_shape(str(tmp_path), _vision(), saved, classes=20)
    with pytest.raises(RunDirError, match=r"classifier of 15 classes, but this run's has 16 "
                                          r"\(num_classes=16\)"):
        resume.check_resume_shape(str(tmp_path), _vision(num_classes=16), saved, classes=16)


def test_another_preset_is_named_before_the_width(tmp_path):
    saved = _Meta(_vision().model_shape(15))
    with pytest.raises(RunDirError, match=r"preset: saved 'cnn-small', now 'resnet18'"):
        resume.check_resume_shape(str(tmp_path), _vision(preset="resnet18"), saved, classes=10)


def _old_shape():
    """A vision shape saved before the width was recorded: the --num-classes flag."""
    shape = _vision().model_shape()
    return {**{k: v for k, v in shape.items() if k != "classes"}, "num_classes": 10}


@pytest.mark.parametrize("in_meta", [True, False])
def test_a_shape_saved_before_the_width_compares_the_flag_as_then(tmp_path, in_meta):
    """From the checkpoint's meta, or (older still) from config.json."""
    if not in_meta:
        with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
            json.dump({"config": {}, "model_shape": _old_shape()}, f)
    saved = _Meta(_old_shape() if in_meta else None)
    for classes in (None, 10, 15):  # the flag decides, whatever the data widens it to
        resume.check_resume_shape(str(tmp_path), _vision(), saved, classes=classes)
    with pytest.raises(RunDirError, match=r"saved with num_classes=10, but now num_classes=12; "
                                          r"resume with --num-classes 10"):
        resume.check_resume_shape(str(tmp_path), _vision(num_classes=12), saved)


def _images(path, num_labels):
    labels = np.arange(40) % num_labels
    images = np.random.default_rng(0).integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    np.savez(path, images=images, labels=labels)
    return str(path)


def test_resuming_on_data_with_more_classes_is_refused_and_the_true_flag_accepted(tmp_path):
    """A run on labels 0..14 with --num-classes 10 has a 15-way classifier: resuming it with
    --num-classes 15 was refused (the flag was compared), and resuming it on labels 0..19
    failed in the restore, blaming a ZeRO run from before the per-leaf layout."""
    cfg = TrainConfig(preset="cnn-small", data=_images(tmp_path / "c15.npz", 15), num_classes=10,
                      batch_size=8, steps=4, log_every=2, eval_every=0, eval_batches=1,
                      checkpoint_every=0, progress="lines", run_dir=str(tmp_path / "run"))
    train(cfg, until_step=2)
    with open(os.path.join(cfg.run_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_shape"]["classes"] == 15
    wider = dataclasses.replace(cfg, resume=True, data=_images(tmp_path / "c20.npz", 20))
    with pytest.raises(RunDirError, match=r"classifier of 15 classes, but this run's has 20 "
                                          r"\(num_classes=10, widened"):
        train(wider)
    assert existing_checkpoint_steps(cfg.run_dir) == [2]
    assert train(dataclasses.replace(cfg, resume=True, num_classes=15)).step == 4


# ---------------------------------------------------------------- a run already at its last step

# tests/test_train.py's TINY_RUN at 2 steps (one log line, one checkpoint).
TINY = dict(model_overrides=dict(d_model=32, n_layers=1, n_heads=2), seq_len=32, batch_size=8,
            microbatches=1, steps=2, warmup=1, lr=1e-2, log_every=2, eval_every=0,
            eval_batches=1, checkpoint_every=0, progress="lines")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, jax_compile_cache):
    """A run trained to its last step (2); each test works on its own copy."""
    result = train(TrainConfig(run_dir=str(tmp_path_factory.mktemp("done") / "run"), **TINY))
    assert result.step == 2 and existing_checkpoint_steps(result.run_dir) == [2]
    return result


@pytest.fixture
def run_dir(finished_run, tmp_path):
    copy = str(tmp_path / "run")
    shutil.copytree(finished_run.run_dir, copy)
    return copy


def _snapshot(run_dir: str) -> dict[str, tuple[bytes, int]]:
    """Every file under run_dir: its bytes and modification time."""
    files = {}
    for folder, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, run_dir)] = (f.read(), os.stat(path).st_mtime_ns)
    return files


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled the train step of a run with nothing left to train")

    monkeypatch.setattr(Trainer, "_compile_staged", refuse)


def test_resume_at_the_last_step_says_the_run_is_complete_and_compiles_nothing(
        run_dir, capsys, no_compile):
    """It compiled the step, trained nothing and printed "done: 2 steps"."""
    before = _snapshot(run_dir)
    assert cli.main(["--run-dir", run_dir, "--resume"]) == 0
    out = capsys.readouterr().out
    assert (f"run_dir {run_dir}: the run is already complete at step 2 (--steps 2): nothing "
            "left to train; raise --steps to continue it") in out
    assert "done:" not in out and "compiled train step" not in out
    assert _snapshot(run_dir) == before


def test_train_at_the_last_step_returns_the_checkpoints_state(finished_run, run_dir, no_compile):
    cfg = TrainConfig(run_dir=run_dir, resume=True, **TINY)
    before = _snapshot(run_dir)
    result = train(cfg)
    assert (result.step, result.interrupted, result.already_complete) == (2, False, True)
    assert int(result.trainer.state.step) == 2 and not result.trainer.compiled
    for got, want in zip(jax.tree.leaves(result.trainer.params),
                         jax.tree.leaves(finished_run.trainer.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # At --until-step (short of --steps) it says which limit it is at, and how to go on.
    until = train(dataclasses.replace(cfg, steps=4), until_step=2)
    assert until.already_complete and until.step == 2
    assert _snapshot(run_dir) == before


def test_until_step_at_the_checkpoint_names_until_step(run_dir, capsys, no_compile):
    assert cli.main(["--run-dir", run_dir, "--resume", "--steps", "4", "--until-step", "2"]) == 0
    out = capsys.readouterr().out
    assert ("already at step 2 (--until-step 2): nothing to train; to continue, resume with a "
            "later --until-step, or without one to train on to --steps 4") in out
    assert "stopped at step" not in out and "done:" not in out


# ---------------------------------------------------------------- an unreadable config.json

class _OldCheckpoint:
    """A checkpoint whose meta predates model_shape and data_order: config.json is read."""

    def read_meta(self):
        return {}


@pytest.mark.parametrize("text, problem", [
    ('{"config": {"batch_size": 8', r"is not valid JSON \(JSONDecodeError: "),
    ("[1, 2]", r"holds a JSON array, not an object"),
    ("null", r"holds a JSON null, not an object"),
    ('{"model_shape": 3, "config": ["batch_size"]}', r"holds a JSON (number|array) under "),
])
@pytest.mark.parametrize("check", [resume.check_resume_shape, resume.check_resume_data_order])
def test_an_unreadable_config_json_is_refused_naming_it(tmp_path, text, problem, check):
    """A corrupt or non-object config.json raised a bare JSONDecodeError or AttributeError."""
    path = tmp_path / "config.json"
    path.write_text(text)
    before = _snapshot(str(tmp_path))
    with pytest.raises(RunDirError, match=rf"cannot resume run_dir=.*predate recording .* read "
                                          rf"from {path}, which {problem}.*expected the JSON "
                                          r"object the run wrote.*start a new --run-dir"):
        check(str(tmp_path), TrainConfig(**TINY), _OldCheckpoint())
    assert _snapshot(str(tmp_path)) == before


def test_a_resume_behind_an_unreadable_config_json_changes_nothing(run_dir, monkeypatch):
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write("{truncated")
    monkeypatch.setattr(Checkpointer, "read_meta", lambda self, step=None: {})
    before = _snapshot(run_dir)
    with pytest.raises(RunDirError, match=r"config\.json, which is not valid JSON"):
        train(TrainConfig(run_dir=run_dir, resume=True, **{**TINY, "steps": 4}))
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("saved, now", [("bf16", "f32"), ("f32", "bf16")])
def test_an_optimizer_state_dtype_change_names_both_dtypes(saved, now):
    """--opt-state-dtype f32 on a bf16 run was refused as 'saved 'bf16', now None'."""
    shape = json.loads(json.dumps(TrainConfig(**TINY, opt_state_dtype=saved).model_shape()))
    with pytest.raises(RunDirError, match=rf"another shape or dtype \(opt_state_dtype: saved "
                                          rf"'{saved}', now '{now}'\)"):
        resume.check_resume_shape("ckpts", TrainConfig(**TINY, opt_state_dtype=now),
                                  _Meta(shape))
    resume.check_resume_shape("ckpts", TrainConfig(**TINY, opt_state_dtype=saved),
                              _Meta(shape))


def test_a_corrupt_checkpoint_is_refused_naming_the_array_that_failed(run_dir):
    """orbax's own message for a truncated array file is a bound method's repr and a page of
    TensorStore spec; its cause names the array and what is wrong with it."""
    files = glob.glob(os.path.join(run_dir, "checkpoints", "2", "state", "ocdbt.process_*",
                                   "d", "*"))
    assert files, os.listdir(os.path.join(run_dir, "checkpoints", "2", "state"))
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(100)
    with pytest.raises(RunDirError, match=r"checkpoint at step 2 in .*: ValueError: [A-Z_]+: "
                                          r"Error reading \"[^\"]+\.value/.*damaged or "
                                          r"incomplete; no earlier checkpoint is kept") as info:
        train(TrainConfig(run_dir=run_dir, resume=True, **{**TINY, "steps": 4}))
    assert "bound method" not in str(info.value) and "TensorStore({" not in str(info.value)
