"""`resume`: the checks that refuse a checkpoint a run cannot continue, and what they advise.

The vision classifier's width: --num-classes is a lower bound (the model widens to the
data's largest label + 1), so a checkpoint records the width itself, and one saved before
it did (the flag only) still resumes as it did then.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

from jaxopt_train.train import RunDirError, TrainConfig, train
from jaxopt_train.train import resume
from jaxopt_train.train.checkpoint import existing_checkpoint_steps

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
