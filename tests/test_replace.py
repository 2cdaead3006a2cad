"""Files replaced whole (jaxopt_train._replace): staged beside, renamed over, all or none.

The benches' --json with --overwrite goes through it: the old file stays whole until the
new text is ready. `open(path, "w")` emptied the file before `json.dumps` ran, so a refused
value (strict JSON: no NaN) or a crash cost the user the previous run's record as well as
this one's.
"""

import json
import os
import types

import pytest

from jaxopt_train import _replace
from jaxopt_train._replace import replace_all_or_none, replace_file, replace_text
from jaxopt_train.bench import accumulation, matmul


def _text_writer(text, seen=None):
    def write(path):
        if seen is not None:
            seen.append(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return write


def test_every_file_is_written_and_nothing_else_is_left(tmp_path):
    seen = []
    replace_all_or_none({tmp_path / "a.md": _text_writer("new a", seen),
                         str(tmp_path / "b.png"): _text_writer("new b", seen)})
    assert (tmp_path / "a.md").read_text() == "new a" and (tmp_path / "b.png").read_text() == "new b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "b.png"]
    # Each writer was given a path with its file's own name (savefig reads the extension),
    # in a hidden folder inside the final one (one file system: the rename is atomic).
    assert [os.path.basename(p) for p in seen] == ["a.md", "b.png"]
    for path in seen:
        assert os.path.dirname(os.path.dirname(path)) == str(tmp_path)
        assert os.path.basename(os.path.dirname(path)).startswith(".")


def test_a_failing_writer_leaves_every_earlier_file_as_it_was(tmp_path):
    (tmp_path / "a.md").write_text("old a")
    (tmp_path / "b.json").write_text("old b")

    def full_disk(path):
        with open(path, "w") as f:
            f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        replace_all_or_none({tmp_path / "a.md": _text_writer("new a"), tmp_path / "b.json": full_disk})
    assert (tmp_path / "a.md").read_text() == "old a"  # written in full, but not moved in
    assert (tmp_path / "b.json").read_text() == "old b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "b.json"]


def test_a_symlink_is_replaced_where_it_points(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text("old")
    (tmp_path / "config.json").symlink_to(tmp_path / "real" / "config.json")
    replace_text(tmp_path / "config.json", "new")
    assert (tmp_path / "config.json").is_symlink()
    assert (tmp_path / "real" / "config.json").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["config.json"]


def test_two_names_of_one_file_write_it_once_with_the_later_writer(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "out")
    seen = []
    replace_all_or_none({tmp_path / "out" / "r.json": _text_writer("first", seen),
                         tmp_path / "link" / "r.json": _text_writer("second", seen)})
    assert (tmp_path / "out" / "r.json").read_text() == "second" and len(seen) == 1


def test_sync_fsyncs_each_staged_file_before_any_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(_replace.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    monkeypatch.setattr(_replace.os, "replace", lambda a, b: renamed.append(len(synced)) or real_replace(a, b))
    replace_all_or_none({tmp_path / "a": _text_writer("a"), tmp_path / "b": _text_writer("b")}, sync=True)
    assert len(synced) == 2 and renamed == [2, 2]
    synced.clear()
    replace_file(tmp_path / "a", _text_writer("again"))
    assert synced == [] and (tmp_path / "a").read_text() == "again"


def test_a_missing_folder_is_an_error_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        replace_text(tmp_path / "absent" / "x.txt", "x")
    assert list(tmp_path.iterdir()) == []


def _refusing_json():
    """json whose dumps refuses the --json record (written with indent=); the benches'
    one-line progress prints (no indent) go through."""
    def dumps(obj, **kwargs):
        if "indent" in kwargs:
            raise ValueError("Out of range float values are not JSON compliant")
        return json.dumps(obj, **kwargs)
    return types.SimpleNamespace(dumps=dumps, loads=json.loads)


@pytest.mark.parametrize("module, argv", [
    (accumulation, ["--quick", "--width", "8", "--steps", "2", "--repeats", "2"]),
    (matmul, ["--quick", "--backends", "xla", "--no-layer"]),
])
def test_an_overwritten_json_survives_a_failed_write(tmp_path, monkeypatch, module, argv):
    if module is accumulation:
        monkeypatch.setattr(module, "_time", lambda *a, **k: ([1e-3, 2e-3], 5e-3, 1.0))
    path = tmp_path / "old.json"
    path.write_text('{"previous": "run"}')
    monkeypatch.setattr(module, "json", _refusing_json())
    with pytest.raises(ValueError, match="not JSON compliant"):
        module.main([*argv, "--json", str(path), "--overwrite"])
    assert path.read_text() == '{"previous": "run"}'
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]  # no staging file left
    monkeypatch.undo()
    if module is accumulation:
        monkeypatch.setattr(module, "_time", lambda *a, **k: ([1e-3, 2e-3], 5e-3, 1.0))
    assert module.main([*argv, "--json", str(path), "--overwrite"]) == 0
    assert "previous" not in json.loads(path.read_text())


def test_a_folder_at_a_final_path_is_named_before_any_writer_runs(tmp_path):
    """os.replace's IsADirectoryError named the staging file (.loss.png.partial-.../loss.png)."""
    (tmp_path / "loss.png").mkdir()
    seen = []
    with pytest.raises(IsADirectoryError, match=r"is a folder, where a file is to be written.*"
                                                r"'[^']*/loss\.png'$"):
        replace_all_or_none({tmp_path / "a.txt": _text_writer("a", seen),
                             tmp_path / "loss.png": _text_writer("b", seen)})
    assert seen == [] and sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
