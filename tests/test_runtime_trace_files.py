"""Tests for jaxopt_train.runtime._trace_files: the bounded search for a profiler's newest file
that `jaxopt-train kernels` and runtime.overlap use."""

import pytest

from jaxopt_train.cli import main as cli_main
from jaxopt_train.runtime import _trace_files as trace_files
from jaxopt_train.runtime import overlap
from jaxopt_train.runtime._trace_files import newest_file_below
from jaxopt_train.runtime.kernel_time import find_xplane
from test_runtime_kernel_time import STREAM, write_xspace


def test_the_trace_search_is_bounded_in_depth_and_in_folders(tmp_path, monkeypatch, capsys):
    """`jaxopt-train kernels /` read the whole file system (a recursive glob) before
    answering: the walk now stops MAX_DEPTH folders down and after MAX_FOLDERS folders."""
    deep = write_xspace(tmp_path / "deep/a/b/c/d/e/f/g/h.xplane.pb", {"/device:GPU:0": {STREAM: [("k", 1.0)]}})
    with pytest.raises(FileNotFoundError, match=r"no \*\.xplane\.pb under .* \(looked 6 folders deep"):
        find_xplane(tmp_path / "deep")
    assert find_xplane(tmp_path / "deep/a/b") == deep  # 6 folders below: found
    assert newest_file_below(str(tmp_path / "deep"), ".xplane.pb", max_depth=8) == deep
    for i in range(12):
        (tmp_path / "many" / f"run{i}" / "profile").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"more than 10 folders under .*many.* name that"):
        newest_file_below(str(tmp_path / "many"), ".xplane.pb", max_folders=10)
    monkeypatch.setattr(trace_files, "MAX_FOLDERS", 10)
    with pytest.raises(SystemExit) as exc:
        cli_main(["kernels", str(tmp_path / "many")])
    assert exc.value.code == 2 and "more than 10 folders under" in capsys.readouterr().err
    with pytest.raises(ValueError, match="more than 10 folders"):
        overlap.find_trace_file(str(tmp_path / "many"))
