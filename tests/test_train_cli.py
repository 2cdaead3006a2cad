"""`jaxopt-train train` argument handling (no training: parsing and validation only)."""

import pytest

from jaxopt_train.train import cli
from jaxopt_train.train.config import TrainConfig


def _exit_code_and_err(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code, capsys.readouterr().err


def test_help_exits_zero(capsys):
    code, _ = _exit_code_and_err(["--help"], capsys)
    assert code == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--steps", "--batch-size", "--microbatches", "--precision", "--lr",
                 "--data", "--run-dir", "--resume", "--log-every", "--checkpoint-every"):
        assert flag in out or flag in cli.build_parser().format_help()


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--preset", "gpt-huge"], "--preset"),
    (["--steps", "0"], "--steps: steps=0"),
    (["--steps", "ten"], "--steps"),
    (["--batch-size", "10", "--microbatches", "3"], "--batch-size"),
    (["--precision", "fp8"], "--precision: precision='fp8'"),
    (["--lr", "-1"], "--lr: lr=-1.0"),
    (["--grad-sync", "carrier-pigeon"], "--grad-sync"),
    (["--resume", "--overwrite"], "not allowed with argument"),
    (["--resume"], "resume=True needs run_dir"),
    (["--model", "d_model"], "FIELD=VALUE"),
    (["--profile-steps", "5:2"], "--profile-steps"),
    (["--steps-per-dispatch", "4", "--steps", "10"], "multiple of steps_per_dispatch"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    code, err = _exit_code_and_err(argv, capsys)
    assert code == 2
    assert needle in err


def test_defaults_and_overrides_parse():
    assert cli.config_from_args([]) == TrainConfig()
    cfg = cli.config_from_args(["--preset", "gpt-tiny", "--model", "d_model=64", "--model",
                                "remat=dots", "--no-scan-layers", "--steps", "20",
                                "--run-dir", "/tmp/x", "--resume"])
    assert cfg.model_overrides == {"d_model": 64, "remat": "dots"}
    assert cfg.steps == 20 and cfg.resume and not cfg.scan_layers


@pytest.mark.parametrize("kwargs, needle", [
    (dict(preset="nope"), "preset='nope'"),
    (dict(batch_size=True), "batch_size=True"),
    (dict(clip_norm=float("nan")), "clip_norm=nan"),
    (dict(prometheus_port=70000), "prometheus_port=70000"),
    (dict(preset="cnn-small", model_overrides={"d_model": 8}), "model_overrides"),
])
def test_config_errors_name_field_and_value(kwargs, needle):
    with pytest.raises((ValueError, TypeError), match=needle.replace("(", r"\(").replace("[", r"\[")):
        TrainConfig(**kwargs)
