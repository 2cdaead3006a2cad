"""`jaxopt-train train`: argument handling, and one short end-to-end run of the CLI."""

import dataclasses
import json
import os
from types import SimpleNamespace

import jax
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
    # TrainConfig's "must be a non-empty path or None": None is no value a flag can take.
    (["--run-dir", ""], "--run-dir: expected a folder path, got ''; leave --run-dir out"),
    (["--run-dir", "", "--resume"], "--run-dir: expected a folder path, got ''"),
    # The model's own check named its dtype= argument, not the --precision that sets it.
    (["--attention", "cudnn"], "--attention: attention='cudnn' needs a bf16 or fp16 compute dtype "
                               "(cuDNN's fused attention) but precision='fp32' computes in float32; "
                               "use --precision bf16 (or fp16), or attention='auto' or 'xla'"),
    # A vision run took it without a word: it has no attention.
    (["--preset", "cnn-small", "--attention", "cudnn"],
     "--attention: attention='cudnn' only applies to GPT presets"),
    # The collective's own error, from inside the trainer, said "use method='ring' or 'psum'".
    pytest.param(["--grad-sync", "peer"], "--grad-sync peer: the peer all-reduce is a Mosaic GPU "
                 "kernel and needs CUDA GPUs; the default backend here is 'cpu' (use --grad-sync "
                 "ring or psum)",
                 marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU is here")),
    (["--devices", "0"], "--devices 0: expected a count >= 1"),
    (["--devices", "-2"], "--devices -2: expected a count >= 1"),
    (["--devices", "two"], "argument --devices: invalid int value: 'two'"),
    pytest.param(["--devices", "99"], "--devices 99: only 8 cpu device(s) are visible; on CPU, "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=99",
                 marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU is here")),
    (["--model", "d_model"], "FIELD=VALUE"),
    (["--profile-steps", "5:2"], "--profile-steps"),
    (["--steps", "8", "--profile-steps", "100:110"], "--profile-steps: profile_steps='100:110' starts at"),
    (["--steps-per-dispatch", "4", "--steps", "10"], "multiple of steps_per_dispatch"),
    (["--matmul", "cuda-cores"], "--matmul"),
    (["--matmul", "pallas"], "--matmul: matmul='pallas' needs a bf16 or fp16 compute dtype"),
    pytest.param(["--matmul", "triton", "--precision", "bf16"], "'triton' is unavailable: needs a CUDA GPU",
                 marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU is here")),
    (["--matmul", "pallas", "--precision", "bf16", "--preset", "cnn-small"], "GPT presets"),
    (["--prometheus-port", "-1"], "--prometheus-port"),
    # An OverflowError traceback from jax.random.key, after the run dir was made.
    (["--seed", str(2**63)], "--seed: seed=9223372036854775808 must be an integer in "
                             "[0, 2**63 - 1 = 9223372036854775807]"),
    (["--seed", "-1"], "--seed: seed=-1 must be an integer >= 0"),
    # Ignored with --data (the file's images), yet saved in the model shape: it refused a resume.
    (["--preset", "cnn-small", "--data", "x.npz", "--image-size", "64"],
     f"image_size=64 sizes the synthetic images; with data={os.path.abspath('x.npz')!r} the images "
     "are the file's own size"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    code, err = _exit_code_and_err(argv, capsys)
    assert code == 2
    assert needle in err


def test_defaults_and_overrides_parse(tmp_path, capsys):
    assert cli.config_from_args([]) == TrainConfig()
    run_dir = tmp_path / "no_config_json"
    argv = ["--preset", "gpt-tiny", "--model", "d_model=64", "--model", "remat_rest=dots", "--no-scan-layers",
            "--steps", "20", "--run-dir", str(run_dir), "--resume"]
    cfg = cli.config_from_args(argv)
    assert cfg.model_overrides == {"d_model": 64, "remat_rest": "dots"}
    assert cfg.steps == 20 and cfg.resume and not cfg.scan_layers
    # No run dir: nothing to warn about (the run refuses: nothing to resume).
    assert "config.json is missing" not in capsys.readouterr().err
    run_dir.mkdir()
    assert cli.config_from_args(argv) == cfg
    assert "config.json is missing" in capsys.readouterr().err


def test_resume_keeps_the_runs_own_settings_and_changes_only_the_flags_given(tmp_path, capsys):
    """A run started with non-default settings and resumed with `--resume --run-dir D
    --steps N` (the README's command) continues with its own batch, precision, seed, lr and
    model, not the defaults; flags given on the resume line change what they name."""
    run_dir = str(tmp_path / "run")
    first = cli.config_from_args(["--batch-size", "8", "--precision", "bf16", "--seed", "3",
                                  "--lr", "1e-3", "--microbatches", "2", "--model", "d_model=32",
                                  "--seq-len", "32", "--run-dir", run_dir])
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"config": first.to_dict()}, f)  # as the loop writes it
    resumed = cli.config_from_args(["--run-dir", run_dir, "--resume", "--steps", "400",
                                    "--model", "n_layers=1"])
    assert resumed == dataclasses.replace(first, steps=400, resume=True,
                                          model_overrides={"d_model": 32, "n_layers": 1})
    err = capsys.readouterr().err
    assert "resuming with the settings in" in err and "--steps 200 -> 400" in err
    data = str(tmp_path / "x.txt")
    cli.config_from_args(["--run-dir", run_dir, "--resume", "--data", data])
    assert f"--data (the embedded corpus) -> {data!r}" in capsys.readouterr().err  # was "None"
    # An unreadable record is an error naming the file, not a silent fall-back to defaults.
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(SystemExit) as exit_info:
        cli.config_from_args(["--run-dir", run_dir, "--resume"])
    assert exit_info.value.code == 2
    assert "cannot read the run's settings" in capsys.readouterr().err
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write("[1, 2]")  # was "TypeError: list indices must be integers or slices, not str"
    with pytest.raises(SystemExit):
        cli.config_from_args(["--run-dir", run_dir, "--resume"])
    assert "(TypeError: expected a JSON object with a 'config' key, got a list)" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, needle", [
    (dict(preset="nope"), "preset='nope'"),
    (dict(batch_size=True), "batch_size=True"),
    (dict(clip_norm=float("nan")), "clip_norm=nan"),
    (dict(prometheus_port=70000), "prometheus_port=70000"),
    (dict(preset="cnn-small", model_overrides={"d_model": 8}), "model_overrides"),
    (dict(preset="cnn-small", seq_len=64), "seq_len=64 only applies to GPT presets"),
    (dict(preset="resnet18", scan_layers=True), "scan_layers=True only applies to GPT presets"),
    (dict(steps=8, profile_steps="100:110"), "profile_steps='100:110' starts at step 100, but "
                                             "training runs steps 0..7 "),
    (dict(steps=8, profile_steps="100:110"), "steps=8"),
    (dict(steps=8, profile_steps="8"), "profile_steps='8' starts at step 8"),
])
def test_config_errors_name_field_and_value(kwargs, needle):
    with pytest.raises((ValueError, TypeError), match=needle.replace("(", r"\(").replace("[", r"\[")):
        TrainConfig(**kwargs)


def test_the_largest_seed_is_int64s():
    assert TrainConfig(seed=2**63 - 1).seed == 2**63 - 1


@pytest.mark.parametrize("error, needle", [
    (IsADirectoryError(21, "Is a directory", "run/metrics.jsonl"),
     "cannot use 'run/metrics.jsonl': Is a directory (a file was expected there, found a folder)"),
    (NotADirectoryError(20, "Not a directory", "run/tb"),
     "cannot use 'run/tb': Not a directory (a folder was expected there"),
    (PermissionError(13, "Permission denied", "run/checkpoints"),
     "cannot use 'run/checkpoints': Permission denied"),
    (NotADirectoryError("logdir='run/profile' is a file"), "logdir='run/profile' is a file"),
])
def test_file_system_errors_exit_2_in_one_line(error, needle, monkeypatch, capsys):
    from jaxopt_train.train import loop

    def failing_train(cfg, until_step=None, devices=None):
        raise error

    monkeypatch.setattr(loop, "train", failing_train)
    assert cli.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxopt-train train: error: ") and len(err.strip().splitlines()) == 1
    assert needle in err


def test_profile_range_inside_a_dispatch_group_is_accepted():
    # The profiler traces the group of 4 that runs steps 10 and 11 (steps 8..11).
    cfg = TrainConfig(steps=16, steps_per_dispatch=4, log_every=4, eval_every=0,
                      checkpoint_every=0, profile_steps="10:12")
    assert cfg.profile_steps == "10:12"
    assert TrainConfig(steps=8, profile_steps="7:100").profile_steps == "7:100"


def test_matmul_flag_reaches_the_gpt_config():
    from jaxopt_train.precision import get_policy
    from jaxopt_train.train.task import gpt_model_config

    cfg = cli.config_from_args(["--matmul", "pallas", "--precision", "bf16"])
    model_cfg = gpt_model_config(cfg, get_policy(cfg.precision))
    # the Pallas kernel: interpreted on CPU, compiled on a GPU (Mosaic GPU on Hopper)
    assert (model_cfg.dot_general.backend == "interpret") == (jax.default_backend() == "cpu")
    assert gpt_model_config(TrainConfig(), get_policy("fp32")).dot_general in (None, jax.lax.dot_general)


def test_memory_limit_is_set_preallocated_before_the_run_and_not_saved(monkeypatch, tmp_path, capsys):
    from jaxopt_train.runtime import memory
    from jaxopt_train.train import loop

    calls = []

    def fake_limit_memory(**kwargs):
        calls.append(("limit", kwargs))
        return {"XLA_CLIENT_MEM_FRACTION": "0.1140", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}

    def fake_train(cfg, until_step=None, devices=None):
        calls.append(("train", cfg))
        return loop.TrainResult(run_dir=cfg.run_dir, step=cfg.steps, final_loss=None, eval_loss=None,
                                interrupted=False, trainer=None)

    monkeypatch.setattr(memory, "limit_memory", fake_limit_memory)
    monkeypatch.setattr(loop, "train", fake_train)
    run_dir = str(tmp_path / "run")
    assert cli.main(["--memory-limit", "16GiB", "--steps", "3", "--run-dir", run_dir]) == 0
    assert [kind for kind, _ in calls] == ["limit", "train"]  # the cap comes first
    assert calls[0][1] == {"bytes": 16 * 2**30, "preallocate": True}
    assert calls[1][1] == cli.config_from_args(["--steps", "3", "--run-dir", run_dir])
    assert "GPU memory capped at 16GiB: XLA_CLIENT_MEM_FRACTION=0.1140" in capsys.readouterr().err


def test_memory_limit_takes_a_share_of_the_gpu_too(monkeypatch, capsys):
    from jaxopt_train.runtime import memory
    from jaxopt_train.train import loop

    calls = []
    monkeypatch.setattr(memory, "limit_memory", lambda **kw: calls.append(kw) or {"X": "1"})
    monkeypatch.setattr(loop, "train", lambda cfg, until_step=None, devices=None: loop.TrainResult(
        run_dir="r", step=1, final_loss=None, eval_loss=None, interrupted=False, trainer=None))
    assert cli.main(["--memory-limit", "0.5", "--steps", "1"]) == 0
    assert cli.main(["--memory-limit", "2", "--steps", "1"]) == 0  # above 1: bytes
    assert calls == [{"fraction": 0.5, "preallocate": True}, {"bytes": 2, "preallocate": True}]
    # Where NVML finds no GPU (this CPU machine, or a fake NVML with none) it says the cap does nothing.
    from jaxopt_train.runtime import nvml as nvml_lib

    fake = SimpleNamespace(nvmlDeviceGetCount=lambda: 0, nvmlShutdown=lambda: None)
    for count, said in ((0, True), (2, False)):
        fake.nvmlDeviceGetCount = lambda count=count: count
        monkeypatch.setattr(nvml_lib, "load_nvml", lambda: (fake, ""))
        capsys.readouterr()
        assert cli.main(["--memory-limit", "0.5", "--steps", "1"]) == 0
        assert ("no NVIDIA GPU found: the cap has no effect on this machine" in capsys.readouterr().err) == said


def test_memory_limit_without_nvml_says_to_give_a_share(monkeypatch, capsys):
    from jaxopt_train.runtime import memory

    def no_nvml():
        raise RuntimeError("limit_memory(bytes=...) needs the GPU's total memory ..., but NVML "
                           "could not start")

    monkeypatch.setattr(memory, "_gpu_total_bytes", no_nvml)
    code, err = _exit_code_and_err(["--memory-limit", "16GiB"], capsys)
    assert code == 2 and "(Here: a share of the GPU's memory, e.g. --memory-limit 0.5 for half.)" in err


@pytest.mark.parametrize("value, needle", [
    ("lots", "cannot read a byte count from --memory-limit='lots'"),
    ("-0.5", "--memory-limit -0.5: fraction must be a number in (0, 1], got fraction=-0.5"),
    ("0GiB", "--memory-limit 0GiB: bytes=0 is 0.000 of the device's"),
    ("16GiB", "--memory-limit 16GiB: limit_memory() must run before the JAX backend starts"),
])
def test_bad_memory_limit_exits_2_before_training(value, needle, monkeypatch, capsys):
    from jaxopt_train.runtime import memory
    from jaxopt_train.train import loop

    jax.devices()  # as in any test process: the backend has started, so the cap is too late
    monkeypatch.setattr(memory, "_gpu_total_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(loop, "train", lambda cfg: pytest.fail("trained without the cap"))
    code, err = _exit_code_and_err(["--memory-limit", value], capsys)
    assert code == 2
    assert needle in err


def test_cli_trains_end_to_end_and_leaves_a_run_dir(tmp_path, capsys, monkeypatch, jax_compile_cache):
    # jax_compile_cache: shared with tests/test_train.py, whose TINY_RUN this CLI run mirrors.
    from jaxopt_train.runtime import read_jsonl

    run_dir = str(tmp_path / "run")
    argv = ["--model", "d_model=32", "--model", "n_layers=1", "--model", "n_heads=2",
            "--seq-len", "32", "--batch-size", "8", "--microbatches", "1", "--steps", "8",
            "--warmup", "2", "--lr", "1e-2", "--log-every", "2", "--eval-every", "0",
            "--eval-batches", "1", "--checkpoint-every", "0", "--progress", "lines",
            "--run-dir", run_dir]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled train step" in out and f"done: 8 steps in {run_dir}; eval loss" in out
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert all(r["loss"] > 0 for r in records) and "eval_loss" in records[-1]
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["8"]
    assert os.path.exists(os.path.join(run_dir, "config.json"))
    # Running it again without --resume refuses to clobber the run: exit 2, no traceback.
    assert cli.main(argv) == 2
    assert "--resume" in capsys.readouterr().err
    # A resume whose step cannot fit the device's memory pool stops before its first step
    # (exit 2, the ways out named) and leaves the run as it was.
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: 1024)
    assert cli.main(["--run-dir", run_dir, "--resume", "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "error: the compiled train step does not fit" in err and "--remat auto|dots_attention" in err
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["8"]
    assert read_jsonl(os.path.join(run_dir, "metrics.jsonl")) == records


@pytest.mark.parametrize("override, flag", [("remat=dots", "remat (--remat)"),
                                            ("seq_len=64", "seq_len (--seq-len)"),
                                            ("dtype=float32", "precision (--precision)")])
def test_a_model_override_of_a_field_the_run_sets_itself_is_refused(override, flag, capsys):
    """`--model remat=dots` with `--remat full` ran dots while config.json said full."""
    code, err = _exit_code_and_err(["--preset", "gpt-tiny", "--remat", "full", "--model", override],
                                   capsys)
    assert code == 2
    assert "--model: model_overrides=" in err and f"use {flag} instead" in err


@pytest.mark.parametrize("given, want", [([], "dots"), (["--remat", "full"], "full"),
                                         (["--model", "d_model=32"], "dots")])
def test_resume_of_a_run_saved_with_a_remat_override_moves_it_to_its_flag(tmp_path, given, want, capsys):
    run_dir = str(tmp_path / "old")
    os.makedirs(run_dir)
    saved = dataclasses.asdict(TrainConfig(preset="gpt-tiny", steps=5, run_dir=run_dir))
    saved["model_overrides"] = {"d_model": 32, "remat": "dots"}  # accepted before
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"config": saved}, f)
    cfg = cli.config_from_args(["--resume", "--run-dir", run_dir, "--steps", "10", *given])
    assert cfg.remat == want and cfg.model_overrides == {"d_model": 32} and cfg.steps == 10


@pytest.mark.parametrize("extra, want", [([], {"d_model": 32}),
                                         (["--model", "remat_layers=4"], {"d_model": 32, "remat_layers": 4})])
def test_resume_with_another_remat_drops_the_saved_remat_layers(tmp_path, extra, want, capsys):
    """An auto search saves remat_layers / remat_rest with its remat: resumed with
    --remat full, they used to stay, and "full" covered only those blocks."""
    run_dir = str(tmp_path / "auto")
    os.makedirs(run_dir)
    saved = dataclasses.asdict(TrainConfig(preset="gpt-tiny", steps=5, run_dir=run_dir,
                                           remat="dots_attention",
                                           model_overrides={"d_model": 32, "remat_layers": 13,
                                                            "remat_rest": "dots"}))
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"config": saved}, f)
    cfg = cli.config_from_args(["--resume", "--run-dir", run_dir, "--remat", "full", *extra])
    assert cfg.remat == "full" and cfg.model_overrides == want
    kept = cli.config_from_args(["--resume", "--run-dir", run_dir, "--steps", "9"])
    assert kept.model_overrides == {"d_model": 32, "remat_layers": 13, "remat_rest": "dots"}


def _config_error(argv, capsys):
    """(exit status, stderr) of parsing argv, which must fail: never a training run."""
    with pytest.raises(SystemExit) as exc:
        cli.config_from_args(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("spec, needle", [
    ("p=f32,c=xx", "compute_dtype='xx' is not a known dtype name"),
    ("p=f32,c=bf16,m=fast", "matmul_precision='fast'"),
    ("p=f32,q=bf16", "bad policy item 'q=bf16'"),
    ("p=f16,c=f16", "param_dtype=float16 cannot hold the weights being trained"),
])
def test_a_bad_precision_spec_exits_2_naming_the_flag_before_anything_is_built(spec, needle, capsys):
    """Before: any spec starting with 'p=' passed the flag's check, and the bad dtype surfaced
    only while the run was being built, in an error that named no flag."""
    code, err = _config_error(["--precision", spec], capsys)
    assert code == 2
    assert f"--precision: precision='{spec}' is not supported ({needle}" in err


@pytest.mark.parametrize("spec", ["c=bf16,p=f32", "params=f32,compute=bf16,o=f32"])
def test_a_precision_spec_in_any_order_or_with_long_keys_is_accepted(spec):
    """Before: refused as not starting with 'p=', though `Policy.from_string` takes it."""
    assert cli.config_from_args(["--precision", spec]).precision == spec


@pytest.mark.parametrize("argv, needle", [
    (["--num-classes", "100"], "--num-classes: num_classes=100 only applies to vision presets"),
    (["--preset", "gpt-124m", "--image-size", "64"],
     "--image-size: image_size=64 only applies to vision presets"),
])
def test_a_vision_flag_with_a_gpt_preset_exits_2_instead_of_being_ignored(argv, needle, capsys):
    """Before: accepted and silently ignored (the other way round, --seq-len and
    --scan-layers with a vision preset, was already refused)."""
    code, err = _config_error(argv, capsys)
    assert code == 2 and needle in err
    assert cli.config_from_args(["--preset", "cnn-small", "--num-classes", "100"]).num_classes == 100


def test_until_step_stops_early_and_a_resume_may_spell_out_the_presets_seq_len(
        tmp_path, capsys, jax_compile_cache):
    """--until-step stops with a checkpoint and leaves the schedule to --steps; a resume
    that names the preset's own --seq-len (128 for gpt-tiny) continues the run: the
    length saved for "the preset's" is the length itself, not a different shape."""
    from jaxopt_train.train.checkpoint import existing_checkpoint_steps

    run_dir = str(tmp_path / "run")
    argv = ["--model", "d_model=32", "--model", "n_layers=1", "--model", "n_heads=2",
            "--batch-size", "8", "--steps", "4", "--warmup", "1", "--log-every", "2",
            "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
            "--progress", "lines", "--run-dir", run_dir]
    assert cli.main(argv + ["--until-step", "2"]) == 0
    out = capsys.readouterr().out
    assert f"stopped at step 2 of 4 (--until-step); checkpoint saved in {run_dir}" in out
    assert existing_checkpoint_steps(run_dir) == [2]
    with open(os.path.join(run_dir, "config.json")) as f:
        assert "until_step" not in json.load(f)["config"]  # a setting of that invocation only
    assert cli.main(["--run-dir", run_dir, "--resume", "--seq-len", "128"]) == 0
    assert f"done: 4 steps in {run_dir}" in capsys.readouterr().out
    assert existing_checkpoint_steps(run_dir) == [2, 4]
    # An --until-step past --steps ends at --steps, and says so (it was dropped silently).
    assert cli.main(["--run-dir", run_dir, "--resume", "--steps", "6", "--until-step", "8"]) == 0
    captured = capsys.readouterr()
    assert "note: --until-step 8 is past --steps 6; the run ends at step 6" in captured.err
    assert f"done: 6 steps in {run_dir}" in captured.out
    # Another length is still a change of shape.
    assert cli.main(["--run-dir", run_dir, "--resume", "--steps", "8", "--seq-len", "64"]) == 2
    assert "seq_len: saved 128, now 64" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "3"])
def test_until_step_must_be_a_positive_multiple_of_steps_per_dispatch(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--steps-per-dispatch", "2", "--until-step", value,
                  "--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert (f"--until-step {value}: expected a positive multiple of --steps-per-dispatch (2)"
            in capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "run")


def test_a_run_saved_with_seq_len_none_resumes_under_the_presets_length(tmp_path):
    """Checkpoints written before the length was resolved hold seq_len None ("the
    preset's"); they resume with or without --seq-len equal to it."""
    from jaxopt_train.train import resume

    cfg = TrainConfig(preset="gpt-tiny", run_dir=str(tmp_path), seq_len=128)

    class OldCheckpoint:
        def read_meta(self):
            shape = {**cfg.model_shape(), "seq_len": None}
            return {"model_shape": shape}

    resume.check_resume_shape(str(tmp_path), cfg, OldCheckpoint())
    resume.check_resume_shape(str(tmp_path), dataclasses.replace(cfg, seq_len=None), OldCheckpoint())
    with pytest.raises(resume.RunDirError, match="seq_len: saved 128, now 64"):
        resume.check_resume_shape(str(tmp_path), dataclasses.replace(cfg, seq_len=64), OldCheckpoint())


@pytest.mark.parametrize("argv, needle", [
    (["--coordinator", "10.0.0.1:1234"],
     "--coordinator given without --num-processes, --process-id: give all three"),
    (["--num-processes", "2", "--process-id", "0"], "given without --coordinator"),
    (["--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"],
     "--coordinator 10.0.0.1: expected HOST:PORT"),
    (["--coordinator", "h:70000", "--num-processes", "2", "--process-id", "0"], "expected HOST:PORT"),
    (["--coordinator", "h:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes 0: expected a count >= 1"),
    (["--coordinator", "h:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2: expected 0 .. 1 (--num-processes 2)"),
    (["--distributed", "--distributed-timeout", "0"], "--distributed-timeout 0: expected seconds >= 1"),
    # Here the backend runs already (and no job is detected): refused, not ignored.
    (["--distributed"], "--distributed: jax.distributed.initialize() failed"),
])
def test_bad_multi_host_flags_exit_2_naming_them(argv, needle, capsys):
    """The CLI had no way to join a multi-host job: the README told users to call
    jax.distributed.initialize(), which `jaxopt-train train` gave them no place to do."""
    jax.devices()  # as in any test here: a started backend must make --distributed fail loudly
    with pytest.raises(SystemExit) as exc:
        cli.apply_distributed(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_no_multi_host_flag_leaves_jax_distributed_alone(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    cli.apply_distributed(["--steps", "2"])
    assert calls == [] and capsys.readouterr().err == ""
    cli.apply_distributed(["--coordinator", "h:1234", "--num-processes", "4", "--process-id", "3",
                           "--distributed-timeout", "30"])
    assert calls == [dict(coordinator_address="h:1234", num_processes=4, process_id=3,
                          initialization_timeout=30)]
    # Said before initialize(): a peer that never joins makes JAX abort the process with
    # SIGABRT and a C++ stack trace, nothing of ours.
    assert ("joining the job as process 3 of 4 via h:1234; waiting up to 30 s for every process "
            "(if one never joins, JAX aborts this process)") in capsys.readouterr().err
    assert "distributed" not in {f.name for f in dataclasses.fields(TrainConfig)}  # not saved


def test_a_relative_data_path_resumes_from_another_folder(tmp_path, monkeypatch, capsys):
    """config.json kept --data as typed, so `--resume --run-dir /abs/run` from another
    folder was refused ("does not exist") or read another file of that name."""
    first, elsewhere, run_dir = tmp_path / "first", tmp_path / "elsewhere", str(tmp_path / "run")
    (first / "d").mkdir(parents=True)
    elsewhere.mkdir()
    (first / "d" / "corpus.txt").write_text("to be or not to be, that is the question\n" * 200)
    tiny = ["--model", "d_model=32", "--model", "n_layers=1", "--model", "n_heads=2",
            "--seq-len", "32", "--batch-size", "8", "--eval-every", "0", "--eval-batches", "1",
            "--log-every", "2", "--progress", "lines", "--run-dir", run_dir]
    monkeypatch.chdir(first)
    assert cli.main(["--data", "d/corpus.txt", "--steps", "2", *tiny]) == 0
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["config"]["data"] == str(first / "d" / "corpus.txt")
    monkeypatch.chdir(elsewhere)
    assert cli.main(["--resume", "--run-dir", run_dir, "--steps", "4"]) == 0, capsys.readouterr().err
    assert "stopped" not in capsys.readouterr().out
    # The same relative path given again on the resume line is no change.
    monkeypatch.chdir(first)
    assert cli.main(["--resume", "--run-dir", run_dir, "--steps", "6", "--data", "d/corpus.txt"]) == 0
    assert "--data" not in capsys.readouterr().err


@pytest.mark.parametrize("field, value, needle", [
    ("precision", None, "precision=None"),
    ("batch_size", "four", "batch_size='four'"),
])
def test_a_bad_value_in_a_resumed_runs_config_names_the_file_not_a_flag(tmp_path, capsys, field,
                                                                        value, needle):
    """A damaged config.json was blamed on a flag never passed ('--precision: precision=None')."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"config": {**TrainConfig().to_dict(), field: value}}, f)
    code, err = _exit_code_and_err(["--run-dir", run_dir, "--resume"], capsys)
    assert code == 2
    assert (f"--resume: the run's settings in {os.path.join(run_dir, 'config.json')} hold "
            f"{needle}") in err and "restore the file, pass the setting's flag" in err, err
    # The flag given on the resume line replaces the saved value.
    flag = {"precision": ["--precision", "fp32"], "batch_size": ["--batch-size", "8"]}[field]
    assert getattr(cli.config_from_args(["--run-dir", run_dir, "--resume", *flag]), field) in ("fp32", 8)


def test_a_resume_flag_that_clashes_with_the_saved_settings_is_named(tmp_path, capsys):
    """--preset cnn-small on a GPT run with model overrides was reported as the overrides'
    fault ("--model: model_overrides=... only apply to GPT presets")."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    saved = TrainConfig(model_overrides={"d_model": 32}).to_dict()
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"config": saved}, f)
    code, err = _exit_code_and_err(["--run-dir", run_dir, "--resume", "--preset", "cnn-small"], capsys)
    assert code == 2
    assert (f"error: --preset: model_overrides={{'d_model': 32}} only apply to GPT presets" in err
            and f"(the other settings are the resumed run's, from {run_dir}/config.json)" in err), err


def test_devices_picks_the_first_n_devices_and_is_not_saved_with_the_run(monkeypatch, tmp_path):
    """`--devices N` is the command-line twin of `train(devices=...)` (the Trainer's data mesh);
    a process setting like --memory-limit, so config.json (and a resume) does not hold it."""
    from jaxopt_train.train import loop

    seen = []

    def fake_train(cfg, until_step=None, devices=None):
        seen.append(devices)
        return loop.TrainResult(run_dir=cfg.run_dir, step=cfg.steps, final_loss=None, eval_loss=None,
                                interrupted=False, trainer=None)

    monkeypatch.setattr(loop, "train", fake_train)
    run_dir = str(tmp_path / "run")
    assert cli.main(["--devices", "2", "--steps", "3", "--run-dir", run_dir]) == 0
    assert cli.main(["--steps", "3", "--run-dir", run_dir]) == 0
    assert seen == [jax.devices()[:2], None]  # None: the trainer takes every device
    assert "devices" not in {f.name for f in dataclasses.fields(TrainConfig)}


def test_devices_is_refused_in_a_multi_process_job(monkeypatch, capsys):
    """jax.devices() lists the whole job's devices: its first N could all be another host's."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    code, err = _exit_code_and_err(["--devices", "1", "--steps", "1"], capsys)
    assert code == 2
    assert "--devices 1: picks devices within one process, but this job has 2 processes" in err


def test_an_unknown_xla_flag_aborts_before_the_run_folder_is_made(tmp_path):
    """XLA aborts the process (SIGABRT) on an unknown flag in XLA_FLAGS when the backend
    starts; that came after train() had made the run folder, left empty behind."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_no_such_flag_here=1"}
    out = subprocess.run([sys.executable, "-m", "jaxopt_train", "train", "--steps", "1",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode != 0 and "xla_no_such_flag_here" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_grad_sync_peer_needs_exactly_two_devices_named_by_flag(monkeypatch, capsys):
    """Past the platform check (faked here), the device count is the CLI's to check: 8 devices
    ran into the collective's "axis 'data' has 8 (use method='ring' ...)" inside the trainer."""
    from jaxopt_train.collectives import peer
    from jaxopt_train.train import loop

    monkeypatch.setattr(peer, "check_platform", lambda **kwargs: None)
    code, err = _exit_code_and_err(["--grad-sync", "peer", "--steps", "1"], capsys)
    assert code == 2
    assert (f"--grad-sync peer exchanges between exactly 2 devices; this run has "
            f"{jax.device_count()} (pass --devices 2, or another --grad-sync)") in err
    seen = []
    monkeypatch.setattr(loop, "train", lambda cfg, until_step=None, devices=None: seen.append(
        devices) or loop.TrainResult(run_dir="r", step=1, final_loss=None, eval_loss=None,
                                     interrupted=False, trainer=None))
    assert cli.main(["--grad-sync", "peer", "--devices", "2", "--steps", "1"]) == 0
    assert seen == [jax.devices()[:2]]
