"""XLA flag presets: every preset parses in a real XLA; merging, command buffers, errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxopt_train.runtime import XLA_FLAG_PRESETS, command_buffer_flags, flags_in_force, xla_flags
from jaxopt_train.runtime.xla_flags import format_xla_flags, parse_xla_flags


def test_every_preset_is_accepted_by_xla():
    # XLA aborts at start-up on an unknown flag name or value. Start one real backend
    # after applying a preset, with every other preset's flags (and the command-buffer
    # switch) appended verbatim, so XLA parses each name and value of every preset.
    script = textwrap.dedent("""
        import os
        from jaxopt_train.runtime import XLA_FLAG_PRESETS, command_buffer_flags, xla_flags
        from jaxopt_train.runtime.xla_flags import format_xla_flags
        report = xla_flags("gpu-throughput")
        everything = [format_xla_flags(flags) for flags in XLA_FLAG_PRESETS.values()]
        everything.append(format_xla_flags(command_buffer_flags("off")))
        os.environ["XLA_FLAGS"] += " " + " ".join(everything)
        import jax
        assert jax.numpy.arange(4).sum() == 6
        print("OK", report)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK XLA flags (preset gpu-throughput): --xla_cpu_enable_fast_math=false" in result.stdout
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in result.stdout


def test_a_wrong_flag_would_abort_xla():
    # The check above can fail: XLA really rejects unknown flags.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_enable_latency_hiding_schedule=true")
    result = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Unknown flag" in result.stderr


def test_merge_keeps_user_flags_over_the_preset(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=false")
    report = xla_flags("gpu-throughput", extra={"xla_gpu_enable_triton_gemm": "false"}, apply=False)
    assert list(report.in_force)[:2] == ["xla_dump_to", "xla_gpu_enable_latency_hiding_scheduler"]
    # The user's own value wins over the preset's default, and the report says so.
    assert report.in_force["xla_gpu_enable_latency_hiding_scheduler"] == "false"
    assert report.kept == {"xla_gpu_enable_latency_hiding_scheduler": ("false", "true")}
    assert "kept XLA_FLAGS' --xla_gpu_enable_latency_hiding_scheduler=false over the preset's true" \
        in str(report)
    assert report.in_force["xla_gpu_enable_triton_gemm"] == "false"
    assert report.added["xla_gpu_all_reduce_combine_threshold_bytes"] == str(256 * 2**20)
    assert os.environ["XLA_FLAGS"].startswith("--xla_dump_to")  # apply=False left it alone


def test_extra_as_string_and_command_buffer(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    report = xla_flags("none", extra="--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops",
                       command_buffer=["FUSION", "CUBLAS"], apply=False)
    assert report.added == {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS",
                            "xla_gpu_autotune_level": "0", "xla_gpu_deterministic_ops": "true"}


def test_command_buffer_switch():
    assert command_buffer_flags(None) == {}
    assert command_buffer_flags("off") == {"xla_gpu_enable_command_buffer": ""}
    assert command_buffer_flags(("WHILE",)) == {"xla_gpu_enable_command_buffer": "WHILE"}
    for bad in ("on", ["FUSION", "GRAPHS"], []):
        with pytest.raises(ValueError, match="command_buffer must be None, 'off' or"):
            command_buffer_flags(bad)


def test_parse_and_format_round_trip():
    text = "--a=1 --b= --c"
    assert parse_xla_flags(text) == {"a": "1", "b": "", "c": "true"}
    assert parse_xla_flags(format_xla_flags({"a": "1", "b": ""})) == {"a": "1", "b": ""}
    with pytest.raises(ValueError, match="--name=value"):
        parse_xla_flags("xla_gpu_foo=1")


def test_errors(monkeypatch):
    assert {"none", "gpu-throughput", "gpu-latency", "gpu-deterministic"} == set(XLA_FLAG_PRESETS)
    with pytest.raises(ValueError, match="unknown XLA flag preset.*gpu-throughput"):
        xla_flags("fastest", apply=False)
    with pytest.raises(ValueError, match="without dashes"):
        xla_flags("none", extra={"--xla_gpu_foo": "1"}, apply=False)
    jax.devices()
    with pytest.raises(RuntimeError, match="must run before the JAX backend starts"):
        xla_flags("gpu-throughput")


@pytest.mark.parametrize("extra, error, match", [
    ({"xla_x": None}, TypeError, r"values must be str, bool, int or float; got \{'xla_x': None\}"),
    ({"xla_x": [1]}, TypeError, "values must be str, bool, int or float"),
    ({5: "1"}, TypeError, r"names must be non-empty strings .*got \[5\]"),
    ({"": "1"}, TypeError, r"names must be non-empty strings .*got \[''\]"),
    (["--xla_x=1"], TypeError, "extra must be a dict {name: value} or an XLA_FLAGS string, got list"),
])
def test_extra_rejects_bad_names_and_values(monkeypatch, extra, error, match):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(error, match=match):
        xla_flags("none", extra=extra, apply=False)
    assert "XLA_FLAGS" not in os.environ


def test_extra_values_and_apply_types(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    report = xla_flags("none", extra={"a": True, "b": False, "c": 2, "d": 0.5, "e": "x"}, apply=False)
    assert report.added == {"a": "true", "b": "false", "c": "2", "d": "0.5", "e": "x"}
    with pytest.raises(TypeError, match="apply must be True or False, got apply='no'"):
        xla_flags("none", apply="no")


def test_flags_in_force_reports_env(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    report = flags_in_force()
    assert report["--xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert report["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and report["XLA_CLIENT_MEM_FRACTION"] == "0.5"


def test_explicit_arguments_replace_env_flags_and_say_so(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION --xla_gpu_autotune_level=4")
    report = xla_flags("gpu-latency", command_buffer="off", extra={"xla_gpu_autotune_level": 0},
                       apply=False)
    assert report.in_force["xla_gpu_enable_command_buffer"] == ""
    assert report.in_force["xla_gpu_autotune_level"] == "0"
    assert report.in_force["xla_gpu_graph_min_graph_size"] == "1"  # no conflict: preset's
    assert report.replaced == {"xla_gpu_enable_command_buffer": ("FUSION", ""),
                               "xla_gpu_autotune_level": ("4", "0")}
    assert report.kept == {} and "from the arguments replaced XLA_FLAGS' 4" in str(report)


@pytest.mark.parametrize("text, error, match", [
    ("--xla_dump_to='/tmp/x", ValueError, r"cannot read the flags given: the ' opened at "
                                           r"\"--xla_dump_to='\" is never closed.*quote"),
    ("--=1", ValueError, "must look like --name=value, got token='--=1'"),
    (5, TypeError, "XLA flags must be a string .*got int: 5"),
])
def test_parse_rejects_malformed_flags_clearly(text, error, match):
    with pytest.raises(error, match=match):
        parse_xla_flags(text)


def test_malformed_env_flags_leave_env_alone(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", '--xla_dump_to="/tmp/x')
    with pytest.raises(ValueError, match="cannot read the XLA_FLAGS environment variable"):
        xla_flags("gpu-throughput", apply=False)
    assert os.environ["XLA_FLAGS"] == '--xla_dump_to="/tmp/x'


def test_values_with_spaces_round_trip(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    report = xla_flags("none", extra={"xla_dump_to": "/tmp/my dir"}, apply=False)
    assert format_xla_flags(report.in_force) == '--xla_dump_to="/tmp/my dir"'
    assert parse_xla_flags(format_xla_flags(report.in_force)) == {"xla_dump_to": "/tmp/my dir"}


@pytest.mark.parametrize("preset, command_buffer, match", [
    (["gpu-throughput"], None, r"unknown XLA flag preset preset=\['gpu-throughput'\]; expected one of"),
    ("none", 5, "command_buffer must be None, 'off' or a non-empty list .*got mode=5"),
    ("none", [1], r"command_buffer must be None.*got mode=\[1\]"),
])
def test_bad_preset_or_command_buffer_types_are_value_errors(monkeypatch, preset, command_buffer, match):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(ValueError, match=match):
        xla_flags(preset, command_buffer=command_buffer, apply=False)


@pytest.mark.parametrize("text, expected", [
    # Backslashes and apostrophes in an unquoted value are literal (shlex dropped the first
    # and refused the second).
    (r"--xla_dump_to=/tmp/d --xla_dump_hlo_module_re=jit_train\.step|jit_eval",
     {"xla_dump_to": "/tmp/d", "xla_dump_hlo_module_re": r"jit_train\.step|jit_eval"}),
    ("--xla_dump_hlo_pass_re=it's", {"xla_dump_hlo_pass_re": "it's"}),
    # Quotes count only around a whole value; backslash escapes only inside double quotes.
    (r"""--a="x \"y\" \\z" --b='p \q' --c=a"b""", {"a": r'x "y" \z', "b": r"p \q", "c": 'a"b'}),
    ("\t--a=1\n--b\r\n", {"a": "1", "b": "true"}),
])
def test_parse_splits_as_xla_does(text, expected):
    assert parse_xla_flags(text) == expected
    assert parse_xla_flags(format_xla_flags(expected)) == expected


def test_format_quotes_what_xla_would_read_as_quotes():
    # A leading quote would open a quoted value; inside double quotes " and \ are escaped.
    flags = {"a": "'leading", "b": '"x"', "c": "sp ace\\", "d": r"a\.b"}
    text = format_xla_flags(flags)
    assert text == r"""--a="'leading" --b="\"x\"" --c="sp ace\\" --d=a\.b"""
    assert parse_xla_flags(text) == flags


def _allow_apply(monkeypatch):
    """Lets xla_flags(apply=True) write XLA_FLAGS although this process's backend runs."""
    # The module, not the `xla_flags` function that jaxopt_train.runtime re-exports by its name.
    xla_flags_lib = sys.modules["jaxopt_train.runtime.xla_flags"]
    monkeypatch.setattr(xla_flags_lib, "require_backend_not_started", lambda what: None)


def test_a_backslash_value_survives_a_preset_and_xla_reads_it(monkeypatch):
    _allow_apply(monkeypatch)
    value = r"jit_train\.step|jit_eval"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/d --xla_dump_hlo_module_re={value}")
    xla_flags("gpu-deterministic")
    assert os.environ["XLA_FLAGS"] == (f"--xla_dump_to=/tmp/d --xla_dump_hlo_module_re={value} "
                                       "--xla_gpu_deterministic_ops=true")
    # XLA itself takes the merged string (it aborts on what it cannot parse), apostrophe too.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_dump_hlo_pass_re=it's")
    result = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_flags_file_in_xla_flags_is_read_and_kept(monkeypatch, tmp_path):
    # XLA reads XLA_FLAGS as a file of flags when it does not start with "-".
    path = tmp_path / "flags.txt"
    path.write_text("--xla_gpu_deterministic_ops=true\n--xla_dump_hlo_pass_re=it's\n")
    monkeypatch.setenv("XLA_FLAGS", str(path))
    _allow_apply(monkeypatch)
    in_file = {"xla_gpu_deterministic_ops": "true", "xla_dump_hlo_pass_re": "it's"}
    assert parse_xla_flags() == in_file
    assert flags_in_force()["--xla_dump_hlo_pass_re"] == "it's"

    # Nothing to add: XLA_FLAGS keeps naming the file.
    report = xla_flags("gpu-deterministic")
    assert os.environ["XLA_FLAGS"] == str(path) and report.flags_file == str(path)
    assert not report.inlined and "XLA_FLAGS still names it" in str(report)

    # A preset adds flags: the file's flags go into XLA_FLAGS with them, none lost.
    report = xla_flags("gpu-latency")
    assert report.inlined and "written into XLA_FLAGS" in str(report)
    assert parse_xla_flags() == {**in_file, **XLA_FLAG_PRESETS["gpu-latency"]}


@pytest.mark.parametrize("value", ["/no/such/flags/file", "   "])
def test_unreadable_flags_file_is_a_clear_error(monkeypatch, value):
    # XLA aborts at start-up on both (a blank XLA_FLAGS is read as a file name too).
    monkeypatch.setenv("XLA_FLAGS", value)
    with pytest.raises(ValueError, match="does not start with '-', so XLA reads it as the path of a "
                                         "file of flags, and that file cannot be read"):
        parse_xla_flags()
    with pytest.raises(ValueError, match="cannot be read"):
        xla_flags("gpu-throughput", apply=False)
    assert os.environ["XLA_FLAGS"] == value


def test_text_after_a_non_flag_is_refused_as_xla_would_ignore_it():
    with pytest.raises(ValueError, match="got token='garbage' in the flags given \\(XLA stops reading there"):
        parse_xla_flags("--xla_dump_to=/tmp/x garbage --xla_gpu_autotune_level=0")


@pytest.mark.parametrize("name", [" xla_gpu_autotune_level", "xla_gpu autotune", "xla'x", 'xla"x'])
def test_extra_names_xla_would_misread_are_refused(monkeypatch, name):
    # " xla_gpu_autotune_level" was written as "-- xla_gpu_autotune_level=0": an XLA_FLAGS
    # that XLA misreads at start-up and that parse_xla_flags() then refused to read back.
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    with pytest.raises(ValueError, match=r"extra flag names .*whitespace or quotes.*got \["):
        xla_flags("none", extra={name: 0})
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"


def test_command_buffer_and_extra_must_agree(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    # Two explicit requests for one flag: extra's value silently won over command_buffer's.
    for extra in ({"xla_gpu_enable_command_buffer": "FUSION"}, "--xla_gpu_enable_command_buffer=FUSION"):
        with pytest.raises(ValueError, match=r"command_buffer='off' asks for "
                                             r"--xla_gpu_enable_command_buffer= but extra for FUSION"):
            xla_flags("none", command_buffer="off", extra=extra, apply=False)
    report = xla_flags("none", command_buffer=["FUSION"], apply=False,
                       extra={"xla_gpu_enable_command_buffer": "FUSION"})  # agreeing is fine
    assert report.in_force == {"xla_gpu_enable_command_buffer": "FUSION"}


def test_flags_after_clear_backends_are_refused():
    """clear_backends() empties JAX's backend cache, but XLA parsed its flags at the first
    start and never reads them again: xla_flags then said nothing and did nothing."""
    script = textwrap.dedent("""
        import jax
        from jax.extend.backend import clear_backends
        from jaxopt_train.runtime import xla_flags
        jax.devices()
        clear_backends()
        try:
            xla_flags("gpu-throughput")
        except RuntimeError as err:
            print("REFUSED", err)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout and "already started" in result.stdout


def test_xla_flags_extra_takes_numpy_scalars(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    report = xla_flags("none", extra={"xla_gpu_all_reduce_combine_threshold_bytes": np.int64(2**28),
                                      "xla_gpu_enable_latency_hiding_scheduler": np.True_,
                                      "xla_gpu_deterministic_ops": np.False_},
                       apply=False)
    assert report.added == {"xla_gpu_all_reduce_combine_threshold_bytes": str(2**28),
                            "xla_gpu_enable_latency_hiding_scheduler": "true",
                            "xla_gpu_deterministic_ops": "false"}
    with pytest.raises(TypeError, match="values must be str, bool, int or float"):
        xla_flags("none", extra={"xla_foo": np.array([1, 2])}, apply=False)
