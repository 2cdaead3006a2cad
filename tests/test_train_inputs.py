"""Bad inputs to `jaxopt-train train` stop before training, with a message and exit status 2.

Image labels and token ids outside the model's classes / vocabulary, a
Prometheus port that cannot be bound and paths in the way of the run's outputs: the last
two found before the run directory is touched (an --overwrite's old run stays whole). Every check here fires before the train
step is compiled, so these tests build at most a tiny model and compile nothing
of the trainer's.

Also how `build_task` resolves attention="auto" on a GPU, checked on CPU with
faked devices.
"""

import dataclasses
import os
import socket
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.precision import get_policy
from jaxopt_train.train import RunDirError, TrainConfig, cli, train
from jaxopt_train.train import loop as loop_lib
from jaxopt_train.train.model import vision_loss_fn
from jaxopt_train.train.checkpoint import clear_run_dir
from jaxopt_train.train.task import build_task, gpt_model_config

TINY_GPT_FLAGS = ["--model", "d_model=32", "--model", "n_layers=1", "--model", "n_heads=2",
                  "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--progress", "lines"]


def _images_npz(path, labels):
    images = np.random.default_rng(0).integers(0, 256, (len(labels), 8, 8, 3), dtype=np.uint8)
    np.savez(path, images=images, labels=np.asarray(labels, np.int64))
    return str(path)


def test_negative_image_labels_exit_2_naming_values_and_num_classes(tmp_path, capsys):
    # Every other label is -100 (an ignore index elsewhere): before the fix the run
    # trained on, logging loss nan and exiting 0.
    labels = [-100 if i % 2 == 0 else i % 10 for i in range(40)]
    data = _images_npz(tmp_path / "neg.npz", labels)
    run_dir = tmp_path / "run"
    argv = ["--preset", "cnn-small", "--data", data, "--steps", "2", "--batch-size", "8",
            "--max-nonfinite-steps", "1", "--progress", "lines", "--run-dir", str(run_dir)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "labels of" in err and "neg.npz" in err
    assert "20 of 40 labels are out of range (values -100; first at index 0)" in err
    assert "num_classes=10" in err and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists()


def test_labels_above_num_classes_still_widen_the_classifier(tmp_path):
    # --num-classes is a lower bound: labels up to 11 give a 12-way classifier.
    data = _images_npz(tmp_path / "wide.npz", [i % 12 for i in range(40)])
    cfg = TrainConfig(preset="cnn-small", data=data, num_classes=10, batch_size=8)
    task = build_task(cfg, get_policy("fp32"))
    out_bias = [x for x in jax.tree.leaves(task.fns.params) if x.shape == (12,)]
    assert out_bias, "expected a 12-class output layer"


def test_a_one_class_classifier_is_refused(tmp_path, capsys):
    """One class gave a loss of exactly 0 at every step (log_softmax of one logit) and a run
    that exited 0 having learned nothing: synthetic images with --num-classes 1, or a data
    file whose labels are all 0 with --num-classes 1 (a lower bound the labels widen)."""
    with pytest.raises(ValueError, match=r"num_classes=1 with synthetic images: a classifier over "
                                         r"one class has a loss of 0 whatever it predicts; expected >= 2"):
        TrainConfig(preset="cnn-small", num_classes=1)
    zeros = _images_npz(tmp_path / "zeros.npz", [0] * 16)
    with pytest.raises(ValueError, match=r"every label of .*zeros.npz' is 0 and num_classes=1"):
        build_task(TrainConfig(preset="cnn-small", data=zeros, num_classes=1, batch_size=8),
                   get_policy("fp32"))
    negative = _images_npz(tmp_path / "negative.npz", [0, -100] * 8)  # not "every label is 0"
    with pytest.raises(ValueError, match=r"8 of 16 labels are out of range \(values -100"):
        build_task(TrainConfig(preset="cnn-small", data=negative, num_classes=1, batch_size=8),
                   get_policy("fp32"))
    # A lower bound still: labels 0 and 1 with --num-classes 1 train a 2-way classifier.
    two = _images_npz(tmp_path / "two.npz", [i % 2 for i in range(16)])
    task = build_task(TrainConfig(preset="cnn-small", data=two, num_classes=1, batch_size=8),
                      get_policy("fp32"))
    assert [x for x in jax.tree.leaves(task.fns.params) if x.shape == (2,)]
    run_dir = tmp_path / "run"
    assert cli.main(["--preset", "cnn-small", "--data", zeros, "--num-classes", "1", "--steps", "1",
                     "--batch-size", "8", "--progress", "lines", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "every label of" in err and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists()


def _linear_classifier_loss(w, labels):
    images = jnp.ones((len(labels), 4), jnp.float32)
    batch = {"images": images, "labels": jnp.asarray(labels, jnp.int32)}
    return vision_loss_fn(lambda x, train: x @ w, batch, True)


def test_vision_loss_gradient_is_nan_for_an_out_of_range_label_under_jit():
    # Under jit the id cannot be checked; the gradient (not only the loss) must be NaN
    # so the trainer's non-finite guard skips the step. optax's loss, used before,
    # gave a NaN loss with a finite gradient and the update went through.
    w = jnp.ones((4, 3), jnp.float32) * 0.1
    grad = jax.jit(jax.grad(_linear_classifier_loss))(w, jnp.array([-100, 1], jnp.int32))
    assert np.isnan(np.asarray(grad)).all()
    loss = jax.jit(_linear_classifier_loss)(w, jnp.array([3, 1], jnp.int32))
    assert np.isnan(np.asarray(loss))
    good = jax.jit(jax.grad(_linear_classifier_loss))(w, jnp.array([0, 2], jnp.int32))
    assert np.isfinite(np.asarray(good)).all()
    with pytest.raises(ValueError, match=r"ids in \[0, 3\)"):  # concrete ids are checked
        _linear_classifier_loss(w, np.array([-100, 1], np.int32))


def test_token_ids_beyond_the_vocab_are_refused_naming_the_fix(tmp_path):
    tokens = np.arange(4096, dtype=np.uint16) % 256
    tokens[3000] = 50256  # one GPT-2 id in a byte-level file
    path = tmp_path / "gpt2.bin"
    tokens.tofile(path)
    cfg = TrainConfig(data=str(path), model_overrides=dict(d_model=32, n_layers=1, n_heads=2),
                      seq_len=32, batch_size=8, steps=2, progress="lines",
                      run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"token ids up to 50256 but preset='gpt-tiny' has "
                                         r"vocab_size=256.*--model vocab_size=50257"):
        train(cfg)
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    # An override too small is named as the override, not as the preset's vocabulary.
    small = dataclasses.replace(cfg, model_overrides={**cfg.model_overrides, "vocab_size": 300})
    with pytest.raises(ValueError, match=r"token ids up to 50256 but --model vocab_size has "
                                         r"vocab_size=300"):
        train(small)


@pytest.mark.parametrize("name", ["bytes.bin", "TRAIN.BIN"])
def test_token_file_within_the_vocab_builds(tmp_path, name):
    """Read as uint16 ids whatever the extension's case (TRAIN.BIN was read as text: its
    ids as pairs of bytes)."""
    path = tmp_path / name
    ids = np.arange(4096, dtype=np.uint16) % 256
    ids.tofile(path)
    cfg = TrainConfig(data=str(path), model_overrides=dict(d_model=32, n_layers=1, n_heads=2),
                      seq_len=32, batch_size=8, token_dtype="uint16")
    task = build_task(cfg, get_policy("fp32"))
    assert "token file" in task.description
    assert task.train_batch(0)["inputs"].max() < 256
    assert TrainConfig(data=str(path).upper(), token_dtype="uint32").token_dtype == "uint32"


def test_uint32_token_file_needs_and_takes_token_dtype(tmp_path, capsys):
    """uint32 ids read as uint16 would train on (id, 0, id, 0, ...): refused, naming the flag."""
    path = tmp_path / "u32.bin"
    (np.arange(4096, dtype=np.uint32) * 7919 % 50_000).tofile(path)
    args = ["--data", str(path), "--run-dir", str(tmp_path / "run"), *TINY_GPT_FLAGS]
    assert cli.main(args) == 2
    assert "--token-dtype uint32" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    cfg = cli.config_from_args([*args, "--token-dtype", "uint32"])
    assert cfg.token_dtype == "uint32"
    task = build_task(dataclasses.replace(cfg, model_overrides={**cfg.model_overrides,
                                                                "vocab_size": 50_000}),
                      get_policy("fp32"))
    batch = task.train_batch(0)
    assert batch["inputs"].max() >= 256 and batch["inputs"].max() < 50_000


def test_token_dtype_without_a_token_file_is_refused():
    with pytest.raises(ValueError, match=r"token_dtype='uint32' applies to a \.bin token file"):
        TrainConfig(token_dtype="uint32")
    with pytest.raises(ValueError, match=r"token_dtype='int32' is not supported"):
        TrainConfig(data="x.bin", token_dtype="int32")


def test_token_dtypes_are_the_token_files():
    from jaxopt_train.data.tokens import TOKEN_FILE_DTYPES
    from jaxopt_train.train.config import TOKEN_DTYPES

    assert TOKEN_DTYPES == TOKEN_FILE_DTYPES


def _busy_port():
    """A listening socket (close it after use) and its port."""
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    return taken, taken.getsockname()[1]


def test_prometheus_port_in_use_exits_2_naming_the_flag(tmp_path, capsys):
    taken, port = _busy_port()
    with taken:
        argv = TINY_GPT_FLAGS + ["--prometheus-port", str(port), "--run-dir", str(tmp_path / "run")]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--prometheus-port {port}" in err and "in use" in err
    assert "or 0 for any free one" in err and "Traceback" not in err
    # Nothing left behind: it left config.json, an empty metrics.jsonl and checkpoints/,
    # and a rerun with a free port was then refused as "a run with no finished checkpoint".
    assert not (tmp_path / "run").exists()


def _old_run(run_dir):
    """A finished run's files (what --overwrite would delete); {relative path: bytes}."""
    files = {"checkpoints/8/state/data": b"weights", "metrics.jsonl": b'{"step": 8, "loss": 1.5}\n',
             "config.json": b'{"config": {}}'}
    for name, content in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(content)
    return files


def _contents(run_dir):
    return {str(path.relative_to(run_dir)): path.read_bytes()
            for path in sorted(run_dir.rglob("*")) if path.is_file()}


def test_a_busy_prometheus_port_costs_an_overwrites_old_run_nothing(tmp_path, capsys):
    """--overwrite deleted the old run, then failed to bind the port."""
    run_dir = tmp_path / "run"
    before = _old_run(run_dir)
    taken, port = _busy_port()
    with taken:
        argv = TINY_GPT_FLAGS + ["--prometheus-port", str(port), "--run-dir", str(run_dir),
                                 "--overwrite"]
        assert cli.main(argv) == 2
    assert "in use" in capsys.readouterr().err
    assert _contents(run_dir) == before


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_profile_path_that_is_a_file_costs_the_run_dir_nothing(tmp_path, capsys, overwrite):
    """RUN_DIR/profile a file: --overwrite deleted the old run, then failed with a traceback;
    without it the run left config.json, metrics.jsonl and checkpoints/ behind."""
    run_dir = tmp_path / "run"
    before = _old_run(run_dir) if overwrite else {}
    (run_dir / "profile").parent.mkdir(exist_ok=True)
    (run_dir / "profile").write_bytes(b"notes")
    argv = TINY_GPT_FLAGS + ["--profile-steps", "0:1", "--run-dir", str(run_dir)]
    assert cli.main(argv + ["--overwrite"] * overwrite) == 2
    err = capsys.readouterr().err
    assert f"{str(run_dir / 'profile')!r} is a file, but the run writes its profiler trace " \
           "(--profile-steps) there as a folder; move it away, or use another --run-dir" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _contents(run_dir) == {**before, "profile": b"notes"}


def test_a_tensorboard_path_that_is_a_file_is_refused_before_a_resume_writes(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir)
    (run_dir / "tb").write_bytes(b"")
    cfg = TrainConfig(run_dir=str(run_dir), resume=True, tensorboard=True)
    with pytest.raises(RunDirError, match=r"/tb' is a file, but the run writes its TensorBoard events"):
        loop_lib._check_output_paths(cfg, str(run_dir))
    # No run writes a file there, so --overwrite keeps it (clear_run_dir): still in the way.
    with pytest.raises(RunDirError, match=r"/tb' is a file"):
        loop_lib._check_output_paths(dataclasses.replace(cfg, resume=False, overwrite=True), str(run_dir))
    # An old run's tb folder is deleted by --overwrite: nothing is in the way then.
    (run_dir / "tb").unlink()
    (run_dir / "tb").mkdir()
    loop_lib._check_output_paths(dataclasses.replace(cfg, resume=False, overwrite=True), str(run_dir))


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json"])
def test_a_folder_where_the_run_writes_a_file_is_refused_not_deleted_by_overwrite(tmp_path, name):
    """--overwrite rmtree'd a folder named metrics.jsonl; and a config.json folder let the old
    run be deleted before writing the new settings failed."""
    run_dir = tmp_path / "run"
    (run_dir / name).mkdir(parents=True)
    (run_dir / name / "mine.txt").write_text("keep")
    cfg = TrainConfig(run_dir=str(run_dir), overwrite=True)
    with pytest.raises(RunDirError, match=f"/{name}' is a folder, but the run writes its .* there as a file"):
        loop_lib._check_output_paths(cfg, str(run_dir))
    clear_run_dir(str(run_dir))
    assert (run_dir / name / "mine.txt").read_text() == "keep"


def test_default_run_dir_under_a_file_named_runs_is_a_run_dir_error(tmp_path, monkeypatch, capsys):
    """./runs a file: NotADirectoryError with a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_bytes(b"")
    assert cli.main(TINY_GPT_FLAGS) == 2
    err = capsys.readouterr().err
    assert "cannot create the default run directory 'runs/gpt-tiny-" in err
    assert f"expected {str(tmp_path / 'runs')!r} to be a writable folder" in err
    assert "--run-dir" in err and "Traceback" not in err
    with pytest.raises(RunDirError, match="default run directory"):
        train(TrainConfig())


# ---------------------------------------------------------------- attention="auto" on a GPU
def _fake_gpus(monkeypatch, *capabilities):
    # _prefer_cudnn_attention reads only the backend name and the devices' capability.
    gpus = [SimpleNamespace(platform="gpu", device_kind="fake", compute_capability=c)
            for c in capabilities]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args: gpus)
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: gpus)


def _resolved_attention(head_dim, precision="bf16", attention="auto"):
    cfg = TrainConfig(precision=precision, attention=attention,
                      model_overrides=dict(d_model=2 * head_dim, n_heads=2, n_layers=1))
    return gpt_model_config(cfg, get_policy(precision)).attention


@pytest.mark.parametrize("capabilities, head_dim, expected", [
    (("9.0",), 64, "cudnn"),
    (("9.0",), 128, "cudnn"),
    (("9.0",), 136, "cudnn"),    # past 128: Hopper only
    (("9.0",), 256, "cudnn"),
    (("10.0",), 192, "cudnn"),   # Blackwell is newer than Hopper
    (("9.0",), 264, "auto"),     # past CUDNN_MAX_HEAD_DIM
    (("9.0",), 132, "auto"),     # head_dim % 8 != 0
    (("8.0",), 128, "cudnn"),
    (("8.0",), 136, "auto"),
    (("8.9",), 256, "auto"),     # Ada: sm89 < sm90
    (("9.0", "8.0"), 192, "auto"),  # the oldest GPU of the run decides
    (("",), 192, "auto"),        # unknown capability: no cuDNN past 128
    (("",), 64, "auto"),         # nor at all: cuDNN's attention needs sm_80, unproven here
])
def test_auto_attention_picks_cudnn_by_compute_capability(monkeypatch, capabilities, head_dim,
                                                          expected):
    _fake_gpus(monkeypatch, *capabilities)
    assert _resolved_attention(head_dim) == expected


@pytest.mark.parametrize("capabilities", [("7.5",), ("7.0",), ("8.0", "7.5")])
def test_auto_attention_keeps_xla_before_ampere(monkeypatch, capabilities):
    """A T4 (7.5) got attention="cudnn" (head_dim <= 128 was the only check), which cuDNN's
    fused attention cannot run before Ampere (sm_80): the first step failed inside XLA."""
    _fake_gpus(monkeypatch, *capabilities)
    assert _resolved_attention(64) == "auto"
    assert _resolved_attention(64, precision="fp16") == "auto"


def test_auto_attention_stays_xla_on_cpu_in_float32_and_when_chosen(monkeypatch):
    if jax.default_backend() == "cpu":
        assert _resolved_attention(64) == "auto"  # the real CPU backend
    _fake_gpus(monkeypatch, "9.0")
    assert _resolved_attention(192, precision="fp32") == "auto"
    assert _resolved_attention(192, attention="xla") == "xla"


def test_a_numpy_int_setting_is_refused_saying_what_to_pass():
    """config.json cannot hold a numpy int; the refusal used to read "np.int64(8) must be an
    integer", which it is."""
    with pytest.raises(TypeError, match=r"batch_size=np.int64\(8\) must be a Python int >= 1 "
                                        r"\(a numpy.int64: pass int\(batch_size\)\)"):
        TrainConfig(batch_size=np.int64(8))
    with pytest.raises(TypeError, match=r"steps=2.5 must be a Python int >= 1$"):
        TrainConfig(steps=2.5)
