"""`TrainConfig` (jaxopt_train.train.config): switches, paths, the ZeRO stage and model
overrides of the wrong type are refused naming the field, not read as truthy or failing
deep inside the run; a hand-edited config.json is refused by flag on --resume."""

import json

import numpy as np
import pytest

from jaxopt_train.train import cli
from jaxopt_train.train.config import TrainConfig
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
    """A hand-edited config.json ("tensorboard": "false") is refused on --resume, naming the
    file that holds it (the flag was not given) and the flag that would override it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"config": {**TrainConfig().to_dict(), "tensorboard": "false"}}
    (run_dir / "config.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit) as exit_info:
        cli.config_from_args(["--run-dir", str(run_dir), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"--resume: the run's settings in {run_dir / 'config.json'} hold tensorboard='false' "
            "must be True or False") in err and "pass the setting's flag" in err, err


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
