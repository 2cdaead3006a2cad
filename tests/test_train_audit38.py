"""Audit of jaxopt_train/train: inputs that were taken silently or failed deep inside."""

import json
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxopt_train.train.mfu as mfu_lib
from jaxopt_train.precision import NoOpLossScale
from jaxopt_train.train import cli
from jaxopt_train.train.checkpoint import Checkpointer
from jaxopt_train.train.config import TrainConfig
from jaxopt_train.train.state import init_train_state
from jaxopt_train.train.trainer import Trainer
from jaxopt_train.train.zero_step import check_zero


@pytest.mark.parametrize("name, value", [("resume", "no"), ("overwrite", 1),
                                         ("tensorboard", "false"), ("scan_layers", "yes")])
def test_a_switch_that_is_not_a_bool_is_refused_not_read_as_truthy(name, value):
    """resume="no" resumed the run and tensorboard="false" wrote events: any truthy value
    switched them on."""
    extra = {"run_dir": "somewhere"} if name == "resume" else {}
    with pytest.raises(TypeError, match=f"{name}={value!r} must be True or False"):
        TrainConfig(**{name: value}, **extra)


def test_a_switch_that_is_not_a_bool_exits_2_naming_its_flag_on_resume(tmp_path, capsys):
    """A hand-edited config.json ("tensorboard": "false") is refused by flag on --resume."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"config": {**TrainConfig().to_dict(), "tensorboard": "false"}}
    (run_dir / "config.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit) as exit_info:
        cli.config_from_args(["--run-dir", str(run_dir), "--resume"])
    assert exit_info.value.code == 2
    assert "--tensorboard: tensorboard='false' must be True or False" in capsys.readouterr().err


def test_path_objects_are_taken_as_paths_and_stored_as_str(tmp_path):
    """A pathlib.Path token file was refused its --token-dtype ("applies to a .bin token
    file") and a Path run_dir was told it "must be a non-empty path"."""
    cfg = TrainConfig(data=tmp_path / "train.bin", token_dtype="uint32", run_dir=tmp_path / "run")
    assert cfg.data == str(tmp_path / "train.bin") and isinstance(cfg.data, str)
    assert cfg.run_dir == str(tmp_path / "run") and isinstance(cfg.run_dir, str)
    assert json.loads(cfg.to_json())["data"] == str(tmp_path / "train.bin")


@pytest.mark.parametrize("name, value", [("data", 0), ("data", b"train.bin"), ("run_dir", 7)])
def test_a_path_of_another_type_is_refused_naming_the_field(name, value):
    """data=0 was accepted, then failed inside os.path once the run was being built."""
    with pytest.raises(TypeError, match=f"{name}={value!r} must be a path"):
        TrainConfig(**{name: value})


def test_an_empty_run_dir_is_still_refused():
    with pytest.raises(ValueError, match="run_dir='' must be a non-empty path or None"):
        TrainConfig(run_dir="")


@pytest.mark.parametrize("zero", [1.0, 3.0, np.int64(1)])
def test_zero_must_be_a_python_int(zero):
    """zero=1.0 passed `zero in (0, 1, 3)` and ran stage 1; a numpy int went into
    config.json as the string "1", which a --resume then refused."""
    with pytest.raises(TypeError, match="zero=.* must be a Python int"):
        TrainConfig(zero=zero)


@pytest.mark.parametrize("zero", [1.0, 3.0, "1"])
def test_check_zero_refuses_a_stage_that_is_not_an_int(zero):
    with pytest.raises(ValueError, match=r"is not supported; expected one of \[0, 1, 3\]"):
        check_zero(zero, "psum", None)
    check_zero(np.int64(1), "psum", None)  # an integer of another type is still a stage


def test_an_unknown_zero_stage_still_lists_the_stages():
    with pytest.raises(ValueError, match=r"zero=2 is not supported; expected one of \[0, 1, 3\]"):
        TrainConfig(zero=2)


def test_a_model_override_key_that_is_not_a_str_is_refused_up_front():
    """Before: TypeError "keywords must be strings" from deep inside the model's build."""
    with pytest.raises(TypeError, match=r"model_overrides=\{1: 64\} has keys \[1\]"):
        TrainConfig(model_overrides={1: 64})


@pytest.mark.parametrize("peak", [math.inf, True, "100", math.nan, 0.0])
def test_a_peak_tflops_override_must_be_a_finite_number(peak):
    """An inf peak gave an MFU of 0.0 without a word; True was read as 1 TFLOP/s."""
    with pytest.raises(ValueError, match="peak_tflops=.* must be a finite number > 0"):
        mfu_lib.resolve_peak_tflops("NVIDIA H100 80GB HBM3", "bf16", peak)
    assert mfu_lib.resolve_peak_tflops("cpu", "bf16", 100) == 100.0


@pytest.mark.parametrize("step_time, devices", [(math.nan, 1), (1.0, True)])
def test_mfu_refuses_a_nan_step_time_and_a_bool_device_count(step_time, devices):
    """A NaN step time gave an MFU of nan."""
    with pytest.raises(ValueError, match="step_time_s"):
        mfu_lib.mfu(1e12, step_time, 989.0, devices)


def _state():
    params = {"w": jnp.ones((2, 3), jnp.float32)}
    return init_train_state(params, {}, optax.sgd(0.1), NoOpLossScale())


def test_restoring_a_step_that_is_not_saved_names_the_saved_steps(tmp_path):
    """Orbax said only "Checkpoint at .../9 not found", and took step=True as a step
    named "True"."""
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(4, _state(), {"a": 1})
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step=9 in .*saved steps \[4\]"):
        ckpt.restore(_state(), step=9)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step=9 .*\[4\]"):
        ckpt.read_meta(9)
    for step in (True, 4.0, "4"):
        with pytest.raises(ValueError, match=f"step={step!r} must be an int"):
            ckpt.restore(_state(), step=step)
    assert ckpt.read_meta(np.int64(4)) == {"a": 1}
    ckpt.close()


class _Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)


def _mse(apply, batch):
    return jnp.mean((apply(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("seed", [True, 1.5, "3", 2**64])
def test_a_trainer_seed_that_is_not_an_int64_is_refused_naming_it(seed):
    """seed=True initialised with key 1; 1.5, "3" and 2**64 failed inside the Linen init
    with a tracer's TypeError or an OverflowError."""
    with pytest.raises(ValueError, match=f"seed={seed!r} must be an int"):
        Trainer(_Linear(), _mse, init_args=(jnp.ones((1, 4)),), seed=seed,
                devices=jax.devices()[:1])
