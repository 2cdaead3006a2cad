"""The checks `bench train` makes before its first row (jaxopt_train.bench.train_checks):
a --json path that is the --out folder or one of the report's own files is refused.

More output-path checks, run through the whole bench, are in tests/test_bench_train.py."""

from __future__ import annotations

from test_bench_train import _checked, _exit_2


def test_json_naming_the_out_folder_or_its_report_is_refused(tmp_path, capsys):
    """Was: --json OUT made OUT a folder, and writing the JSON there failed after the whole
    run; --json OUT/train_bench.md was silently replaced by the Markdown report."""
    out = tmp_path / "out"
    err = _exit_2(capsys, _checked, ["--quick", "--out", str(out), "--json", str(out)])
    assert "is the --out folder; expected a file path" in err
    for name in ("train_bench.md", "train_bench.png"):
        err = _exit_2(capsys, _checked, ["--quick", "--out", str(out), "--json", str(out / name)])
        assert f"is --out's {name}, which the report writes" in err
    assert list(tmp_path.iterdir()) == []  # refused before any folder was made
    # --out's own JSON holds the same text: still fine.
    _checked(["--quick", "--out", str(out), "--json", str(out / "train_bench.json")])


def test_a_folder_named_like_a_report_file_is_refused_before_the_run(tmp_path, capsys):
    """os.replace failed on it after the whole run, naming the hidden staging file."""
    out = tmp_path / "out"
    (out / "train_bench.png").mkdir(parents=True)
    for extra in ([], ["--overwrite"]):
        err = _exit_2(capsys, _checked, ["--quick", "--out", str(out), *extra])
        assert "holds a folder named train_bench.png, where the report writes a file" in err
