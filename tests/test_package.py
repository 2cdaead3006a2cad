"""The package imports cleanly, exports its public names, and starts no backend."""

import subprocess
import sys

import pytest

import jaxopt_train


def test_public_names_import():
    for name in ("Policy", "get_policy", "DynamicLossScale", "StaticLossScale", "NoOpLossScale",
                 "all_finite", "accumulate_gradients", "multi_steps", "all_reduce_tree",
                 "ring_all_reduce", "nnx_apply", "linen_apply"):
        assert hasattr(jaxopt_train, name), name


def test_every_public_name_is_its_owners_and_the_top_imports_no_jax():
    """The top re-exports are imported on first use: `import jaxopt_train` (and with it
    `jaxopt-train --help`) took ~1.2 s importing jax; each name is still its module's own."""
    import importlib

    for name, owner in jaxopt_train._EXPORTS.items():
        assert getattr(jaxopt_train, name) is getattr(importlib.import_module(f"jaxopt_train.{owner}"), name)
    assert set(jaxopt_train.__all__) <= set(dir(jaxopt_train))
    assert jaxopt_train.precision is importlib.import_module("jaxopt_train.precision")
    with pytest.raises(AttributeError, match="module 'jaxopt_train' has no attribute 'polcy'"):
        jaxopt_train.polcy  # noqa: B018
    code = ("import sys, jaxopt_train, jaxopt_train.cli\n"
            "assert 'jax' not in sys.modules, 'jax imported'\n"
            "from jaxopt_train import *\n"
            "assert Policy is jaxopt_train.precision.Policy and ring_all_reduce\n"
            "print('ok')")
    _run_python(code)


def test_import_starts_no_backend():
    code = ("import jaxopt_train, jaxopt_train.models, jaxopt_train.train, jaxopt_train.kernels, "
            "jaxopt_train.runtime, jaxopt_train.data\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized(), 'backend started at import'\n"
            "print('ok')")
    _run_python(code)


def _run_python(code: str) -> None:
    """Runs `code` in a fresh interpreter (imports start from nothing); it must print ok."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("argv, message", [
    (["nonsense"], "unknown command 'nonsense'; expected one of ['train', 'bench', 'doctor', 'plot', 'kernels', 'autotune']"),
    ([], "a command is required; expected one of ['train'"),
    (["--verbose", "train"], "unknown option '--verbose' before the command"),
    (["-x"], "unknown option '-x'"),
])
def test_cli_usage_errors_exit_2_with_usage_on_stderr(argv, message, capsys):
    from jaxopt_train.cli import main
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"jaxopt-train: error: {message}" in captured.err
    assert "usage: jaxopt-train COMMAND" in captured.err and "plot" in captured.err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_cli_help_lists_commands_on_stdout(flag, capsys):
    from jaxopt_train.cli import main
    assert main([flag]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: jaxopt-train COMMAND") and captured.err == ""
    for command in ("train", "bench", "doctor", "plot", "kernels", "autotune"):
        assert f"\n  {command} " in captured.out


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_cli_version(flag, capsys):
    from jaxopt_train.cli import main
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"jaxopt-train {jaxopt_train.__version__}\n"


def test_python_m_without_a_command_exits_2_and_trains_nothing(tmp_path):
    # It used to start a 200-step training run; now a usage error, from the real entry point.
    out = subprocess.run([sys.executable, "-m", "jaxopt_train"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "a command is required" in out.stderr and "Traceback" not in out.stderr and out.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_cli_dispatches_autotune(capsys):
    # `jaxopt-train autotune` is the kernels' tuner (python -m of the module makes runpy warn).
    from jaxopt_train.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["autotune", "--shapes", "16x16"])
    assert exc.value.code == 2
    assert "jaxopt-train autotune: error: --shapes='16x16' must be a comma list of MxNxK" in capsys.readouterr().err


def test_cli_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    import importlib

    from jaxopt_train.cli import main

    def interrupted(argv):
        raise KeyboardInterrupt
    plot = importlib.import_module("jaxopt_train.plot")
    monkeypatch.setattr(plot, "main", interrupted)
    assert main(["plot", "runs/x"]) == 130
    assert capsys.readouterr().err == "jaxopt-train plot: interrupted\n"
    # Ctrl-C while the command's module (and jax) is still importing, the first seconds of
    # every command, gave a traceback ending in importlib's frames.
    cli = importlib.import_module("jaxopt_train.cli")

    def importing(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.importlib, "import_module", importing)
    assert main(["bench", "train"]) == 130
    assert capsys.readouterr().err == "jaxopt-train bench: interrupted\n"


def test_cli_backend_that_cannot_start_is_one_error_line_not_a_traceback(monkeypatch, capsys):
    # JAX_PLATFORMS=cuda without the CUDA plugin: jax.devices() raises a bare AssertionError
    # from deep inside xla_bridge, wherever the command first touches the backend.
    import importlib

    import jax

    from jaxopt_train.cli import main

    def no_backend(*args, **kwargs):
        raise AssertionError
    plot = importlib.import_module("jaxopt_train.plot")
    monkeypatch.setattr(plot, "main", lambda argv: jax.devices())
    monkeypatch.setattr(jax, "devices", no_backend)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert main(["plot", "runs/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxopt-train plot: error: JAX could not start a backend: "
                          "AssertionError with JAX_PLATFORMS='cuda'\n"), err
    assert "unset JAX_PLATFORMS" in err and "jaxopt-train doctor" in err


def test_cli_other_assertion_and_runtime_errors_still_raise(monkeypatch):
    # The backend starts, so the command's own error is a bug to see in full, not hidden.
    import importlib

    from jaxopt_train.cli import main

    plot = importlib.import_module("jaxopt_train.plot")
    for error in (AssertionError("a bug of ours"), RuntimeError("another")):
        def failing(argv, error=error):
            raise error
        monkeypatch.setattr(plot, "main", failing)
        with pytest.raises(type(error), match=str(error)):
            main(["plot", "runs/x"])


def test_cli_train_with_cuda_platform_but_no_cuda_exits_1_without_a_traceback(tmp_path):
    import os

    from jaxopt_train.runtime import doctor

    if doctor._jax_cuda_plugins():
        pytest.skip("a JAX CUDA plugin is installed here")

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cuda"
    out = subprocess.run([sys.executable, "-m", "jaxopt_train", "train", "--steps", "1",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "error: JAX could not start a backend" in out.stderr
    assert not (tmp_path / "run").exists()


_CLI_SCRIPT = """
import atexit, gc, importlib, signal, sys, time
from jaxopt_train import cli
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran"))
# Whatever this test inherited (a shell gives a background job SIG_IGN): Python's default,
# or SIG_IGN for the case that checks an ignored Ctrl-C stays ignored.
signal.signal(signal.SIGINT, signal.SIG_IGN if mode == "ignored" else signal.default_int_handler)

def in_callback(phase, info):
    if phase == "start":
        signal.raise_signal(signal.SIGINT)  # its handler runs here, inside the callback
        gc.callbacks.remove(in_callback)

def command(argv):
    print("started", end="")  # unflushed: it must still reach the pipe
    if mode == "raise":
        raise KeyboardInterrupt
    gc.callbacks.append(in_callback)
    gc.collect()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print(" ran on")
    return 0

importlib.import_module("jaxopt_train.plot").main = command
sys.argv = ["jaxopt-train", "plot", "x"]
cli.run()
"""


@pytest.mark.parametrize("mode, code, stdout", [
    ("raise", 130, "started"),
    # A Ctrl-C inside a gc callback (JAX registers one) was printed as "Exception ignored"
    # and dropped: the command ran on and exited 0.
    ("gc_callback", 130, "started"),
    ("ignored", 0, "started ran on\natexit ran\n"),
])
def test_cli_program_ends_at_once_on_ctrl_c(mode, code, stdout):
    """`jaxopt-train` exits 130 straight after a Ctrl-C, stdio flushed and no atexit: an
    interrupted `bench train` died of SIGSEGV (-11) in the teardown while XLA compiled."""
    out = subprocess.run([sys.executable, "-c", _CLI_SCRIPT, mode], capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode, out.stdout) == (code, stdout), out.stderr
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert ("jaxopt-train plot: interrupted" in out.stderr) == (code == 130), out.stderr
