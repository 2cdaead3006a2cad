"""Tests for jaxopt_train.runtime.kernel_time on hand-built XSpace traces (no GPU needed)."""

import json
import os

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from jaxopt_train.cli import main as cli_main
from jaxopt_train.runtime import KernelTime, kernel_time, kernel_times
from jaxopt_train.runtime.kernel_time import compare, find_xplane


def write_xspace(path, planes):
    """planes: {plane name: {line name: [(kernel name, duration in us), ...]}}."""
    names = sorted({k for lines in planes.values() for events in lines.values() for k, _ in events})
    ids = {n: i + 1 for i, n in enumerate(names)}
    text = []
    for p, (plane, lines) in enumerate(planes.items()):
        body = []
        for l, (line, events) in enumerate(lines.items()):
            evs = " ".join(f"events {{ metadata_id: {ids[k]} offset_ps: {i * 10**9} duration_ps: {int(us * 10**6)} }}"
                           for i, (k, us) in enumerate(events))
            body.append(f'lines {{ id: {l + 1} name: "{line}" timestamp_ns: 0 {evs} }}')
        meta = " ".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in ids.items())
        text.append(f'planes {{ id: {p + 1} name: "{plane}" {" ".join(body)} {meta} }}')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(ProfileData.text_proto_to_serialized_xspace("\n".join(text)))
    return str(path)


STREAM = "Stream #14(Compute,Memset)"


def test_sums_by_stream_and_name_per_step(tmp_path):
    # Two steps: two launches each of two numbered instances of one fusion, one GEMM.
    write_xspace(tmp_path / "plugins/profile/t1/host.xplane.pb", {
        "/device:GPU:0": {
            STREAM: [("input_scatter_fusion_3", 10.0), ("nvjet_gemm", 4.0), ("input_scatter_fusion.7", 6.0),
                     ("input_scatter_fusion_3", 12.0), ("nvjet_gemm", 4.0), ("input_scatter_fusion.7", 8.0)],
            "Stream #15(MemcpyH2D)": [("MemcpyH2D", 1.0)],
            "XLA Ops": [("input_scatter_fusion_3", 99.0)],  # the same time again: not counted
        },
        "/host:CPU": {"python": [("PjitFunction(step)", 500.0)]},
    })
    rows = kernel_times(tmp_path, steps=2)
    assert rows == [
        KernelTime("input_scatter_fusion", STREAM, 2.0, 0.018),
        KernelTime("nvjet_gemm", STREAM, 1.0, 0.004),
        KernelTime("MemcpyH2D", "Stream #15(MemcpyH2D)", 0.5, 0.0005),
    ]


def test_all_gpus_and_the_newest_trace(tmp_path):
    old = write_xspace(tmp_path / "plugins/profile/a/h.xplane.pb", {"/device:GPU:0": {STREAM: [("old", 1.0)]}})
    new = write_xspace(tmp_path / "plugins/profile/b/h.xplane.pb", {
        "/device:GPU:0": {STREAM: [("k", 1.0)]}, "/device:GPU:1": {STREAM: [("k", 3.0)]}})
    os.utime(old, (1, 1))
    assert find_xplane(tmp_path) == str(new)
    # Per GPU: the two GPUs' streams share a number, and were summed as 2 launches of one.
    assert kernel_times(tmp_path) == [KernelTime("k", f"GPU:1 {STREAM}", 1.0, 0.003),
                                      KernelTime("k", f"GPU:0 {STREAM}", 1.0, 0.001)]
    assert kernel_times(old) == [KernelTime("old", STREAM, 1.0, 0.001)]  # a file, read as given


def test_an_empty_trace_file_is_refused_as_empty(tmp_path, capsys):
    """A 0-byte .xplane.pb parsed as a trace with no planes: 'no GPU kernels (a trace of a
    CPU run?)', exit 1."""
    empty = tmp_path / "plugins/profile/a/h.xplane.pb"
    empty.parent.mkdir(parents=True)
    empty.write_bytes(b"")
    for given in (empty, tmp_path):
        with pytest.raises(ValueError, match=r"h\.xplane\.pb' is empty \(0 bytes\)"):
            find_xplane(given)
    with pytest.raises(SystemExit) as exc:
        cli_main(["kernels", str(tmp_path)])
    assert exc.value.code == 2 and "is empty (0 bytes)" in capsys.readouterr().err


def test_a_run_dir_with_glob_characters_is_a_folder_not_a_pattern(tmp_path):
    trace = write_xspace(tmp_path / "lr=[0.1]/profile/plugins/profile/t/h.xplane.pb",
                         {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    assert find_xplane(tmp_path / "lr=[0.1]/profile") == trace


def test_compare_orders_by_change(tmp_path):
    a = kernel_times(write_xspace(tmp_path / "a.xplane.pb", {"/device:GPU:0": {STREAM: [
        ("scatter_1", 13.8), ("gemm", 5.0), ("gone", 0.5)]}}))
    b = kernel_times(write_xspace(tmp_path / "b.xplane.pb", {"/device:GPU:0": {STREAM: [
        ("scatter_2", 48.9), ("gemm", 5.1), ("new", 0.2)]}}))
    pairs = compare(a, b)
    # (name, missing before, missing after), largest change first: +35.1, -0.5, +0.2, +0.1 us.
    names = [((x or y).name, x is None, y is None) for x, y in pairs]
    assert names == [("scatter", False, False), ("gone", False, True), ("new", True, False), ("gemm", False, False)]
    assert pairs[0][1].ms_per_step - pairs[0][0].ms_per_step == pytest.approx(0.0351)


def test_cli_table_diff_and_json(tmp_path, capsys):
    a = write_xspace(tmp_path / "a/t.xplane.pb", {"/device:GPU:0": {STREAM: [("scatter_1", 13.8), ("gemm", 5.0)]}})
    b = write_xspace(tmp_path / "b/t.xplane.pb", {"/device:GPU:0": {STREAM: [("scatter_9", 48.9), ("gemm", 5.0)]}})
    assert cli_main(["kernels", str(tmp_path / "a"), "--json", str(tmp_path / "one.json")]) == 0
    out = capsys.readouterr().out
    assert "0.019 ms of GPU time per step over 1 stream(s)" in out and "73.4%" in out
    assert json.loads((tmp_path / "one.json").read_text())[0] == {
        "name": "scatter", "stream": STREAM, "launches_per_step": 1.0, "ms_per_step": pytest.approx(0.0138)}
    assert cli_main(["kernels", a, "--against", b, "--top", "1", "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert f"{STREAM}: 0.019 -> 0.054 ms/step" in out
    assert "+0.035     0.014     0.049" in out and "gemm" not in out.split("kernel\n")[1]
    assert json.loads((tmp_path / "d.json").read_text())[0]["after_ms_per_step"] == pytest.approx(0.0489)
    # An existing file is kept unless --overwrite; a folder or a path through a file is refused.
    (tmp_path / "mine.json").write_text("precious")
    (tmp_path / "afile").write_text("")
    for path, message in ((tmp_path / "mine.json", "already exists (pass --overwrite"),
                          (tmp_path, "is a folder"), (tmp_path / "afile/x.json", "afile")):
        with pytest.raises(SystemExit) as exc:
            cli_main(["kernels", a, "--json", str(path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"--json {path}: " in err and message in err, err
    assert (tmp_path / "mine.json").read_text() == "precious"
    assert cli_main(["kernels", a, "--json", str(tmp_path / "mine.json"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "mine.json").read_text())[0]["name"] == "scatter"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a trace here would hold GPU kernels")
def test_a_cpu_trace_has_no_gpu_kernels(tmp_path, capsys):
    with jax.profiler.trace(str(tmp_path)):
        jnp.ones((64, 64)).sum().block_until_ready()
    assert kernel_times(tmp_path) == []
    assert cli_main(["kernels", str(tmp_path)]) == 1
    assert "no GPU kernels in" in capsys.readouterr().err


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "3"])
def test_bad_steps(tmp_path, steps):
    path = write_xspace(tmp_path / "a.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    with pytest.raises(ValueError, match="steps must be a positive int"):
        kernel_times(path, steps=steps)


def test_missing_trace(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no trace at"):
        kernel_times(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"no \*\.xplane\.pb under"):
        kernel_times(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli_main(["kernels", str(tmp_path), "--steps", "3"])
    assert exc.value.code == 2 and "no *.xplane.pb under" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["kernels", str(tmp_path), "--top", "0"])
    assert exc.value.code == 2 and "--top must be at least 1, got 0" in capsys.readouterr().err


def test_kernels_cli_with_all_zero_durations_does_not_divide_by_zero(tmp_path, capsys):
    trace = write_xspace(tmp_path / "t.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 0.0)]}})
    assert cli_main(["kernels", trace]) == 0  # was ZeroDivisionError
    assert "0.0%" in capsys.readouterr().out


def test_a_file_that_is_not_a_trace_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "t.trace.json.gz"
    bad.write_bytes(os.urandom(200))
    # Was RuntimeError "Failed to parse XSpace from array", naming no file; a traceback in the CLI.
    with pytest.raises(ValueError, match=r"cannot read .*t.trace.json.gz.* as a jax.profiler trace"):
        kernel_times(bad)
    with pytest.raises(SystemExit) as exc:
        cli_main(["kernels", str(bad)])
    assert exc.value.code == 2 and "expected an XSpace file" in capsys.readouterr().err


def test_a_broken_symlink_beside_a_trace_is_skipped(tmp_path):
    trace = write_xspace(tmp_path / "p/good.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    os.symlink(tmp_path / "gone", tmp_path / "p/bad.xplane.pb")
    assert find_xplane(tmp_path) == trace  # was FileNotFoundError from getmtime


def test_kernels_json_never_replaces_a_trace_it_reads(tmp_path, capsys):
    trace = write_xspace(tmp_path / "t.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    before = open(trace, "rb").read()
    for argv in (["kernels", trace], ["kernels", trace, "--against", trace]):
        with pytest.raises(SystemExit) as exc:
            cli_main([*argv, "--json", trace, "--overwrite"])
        assert exc.value.code == 2 and "is the trace" in capsys.readouterr().err
    assert open(trace, "rb").read() == before  # was replaced by the JSON table


def test_kernels_json_failed_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    trace = write_xspace(tmp_path / "t.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    out = tmp_path / "table.json"
    out.write_text("earlier table")

    def fail(*args, **kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(kernel_time.json, "dump", fail)
    monkeypatch.setattr(kernel_time.json, "dumps", fail)
    with pytest.raises(OSError, match="No space left"):
        cli_main(["kernels", trace, "--json", str(out), "--overwrite"])
    assert out.read_text() == "earlier table"  # was truncated to nothing
    monkeypatch.undo()
    assert cli_main(["kernels", trace, "--json", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text())[0]["name"] == "k"

