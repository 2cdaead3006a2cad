"""Resume edges: a run already at its last step, and an unreadable config.json behind a
checkpoint whose meta predates the model shape and data order."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

from jaxopt_train.train import RunDirError, TrainConfig, cli, resume, train
from jaxopt_train.train.checkpoint import Checkpointer, existing_checkpoint_steps
from jaxopt_train.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

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

