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


def test_import_starts_no_backend():
    code = ("import jaxopt_train, jaxopt_train.models, jaxopt_train.train, jaxopt_train.kernels, "
            "jaxopt_train.runtime, jaxopt_train.data\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized(), 'backend started at import'\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_cli_unknown_command_exits_2():
    from jaxopt_train.cli import main
    assert main(["nonsense"]) == 2
    assert main(["--help"]) == 0


def test_cli_dispatches_autotune(capsys):
    # `jaxopt-train autotune` is the kernels' tuner (python -m of the module makes runpy warn).
    from jaxopt_train.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["autotune", "--shapes", "16x16"])
    assert exc.value.code == 2
    assert "jaxopt-train autotune: error: --shapes='16x16' must be a comma list of MxNxK" in capsys.readouterr().err
