"""The autotune cache when the disk says no: a store that would fail is caught before the
sweep, a failing store after it keeps the winners, and a cache file that cannot be read is
left alone rather than moved aside as corrupt.

Permissions are simulated by monkeypatching the calls that would fail, so the tests also
bite as root (as CI runs), where chmod does not.
"""

from __future__ import annotations

import builtins
import importlib
import json
import logging
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.kernels import MatmulConfig, autotune

autotune_mod = importlib.import_module("jaxopt_train.kernels.autotune")
matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
LARGE = MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1)
CANDIDATES = '[{"block_m": 16, "block_n": 16, "block_k": 16, "num_stages": 1}]'


@pytest.fixture(autouse=True)
def _private_cache(private_autotune_cache):
    """Every test sees an empty autotune cache in its own directory (conftest)."""


def _store(m=64, n=64, k=64, config=SMALL):
    autotune_mod.store("interpret", "cpu", m, n, k, jnp.bfloat16, config, 1e-3)


def _refuse_replace(monkeypatch):
    """Every rename fails, as in a folder whose files can be created but not replaced."""
    def refuse(src, dst, **kwargs):
        raise PermissionError(13, "Permission denied", str(dst))
    monkeypatch.setattr(os, "replace", refuse)


def _make_lock_read_only(monkeypatch, lock: pathlib.Path):
    """A lock file another user left read-only: opening it for writing is refused, whether
    through `open` or `os.open`; reading it works."""
    lock.touch()
    lock.chmod(0o444)
    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if os.fspath(file) == str(lock) and set(mode) & set("wa+x"):
            raise PermissionError(13, "Permission denied", str(lock))
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(file, flags, *args, **kwargs):
        if os.fspath(file) == str(lock) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(lock))
        return real_os_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)


def test_a_read_only_lock_file_does_not_stop_a_store(tmp_path, monkeypatch):
    """The lock was opened for appending: the pre-sweep check passed, then the store after
    the sweep failed and its winners were lost. flock needs no write access."""
    _make_lock_read_only(monkeypatch, tmp_path / "matmul_autotune.json.lock")
    assert autotune_mod.check_cache_writable() == tmp_path / "matmul_autotune.json"
    _store()
    autotune_mod._loaded.clear()
    assert autotune_mod.lookup("interpret", "cpu", 64, 64, 64, jnp.bfloat16) == SMALL


def test_the_check_before_the_sweep_tries_the_rename_a_store_needs(tmp_path, monkeypatch):
    """Only creating a temporary file was tried; a folder refusing the rename passed the
    check, and the store failed after the sweep."""
    _refuse_replace(monkeypatch)
    timed = []
    with pytest.raises(OSError, match=r"could not be stored .*PermissionError.*writable folder, "
                                      r"or pass write_cache=False"):
        autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL],
                 timer=lambda fn: timed.append(fn) or 1.0)
    assert timed == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matmul_autotune.json.lock"]


def test_a_failed_store_removes_its_temporary_file_and_keeps_the_cache(tmp_path, monkeypatch):
    _store()
    before = (tmp_path / "matmul_autotune.json").read_bytes()
    _refuse_replace(monkeypatch)
    with pytest.raises(PermissionError):
        _store(128, 128, 128)
    assert (tmp_path / "matmul_autotune.json").read_bytes() == before
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_store_failing_after_the_sweep_still_returns_the_winners(monkeypatch, caplog):
    """The OSError escaped autotune: the sweep's results were lost with it."""
    def failing_store(*args):
        raise PermissionError(13, "Permission denied", "matmul_autotune.json")

    monkeypatch.setattr(autotune_mod, "store", failing_store)
    with caplog.at_level(logging.WARNING, logger=autotune_mod.__name__):
        winners = autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL],
                           timer=lambda fn: 1.0, input_sets=1)
    assert winners == {(16, 16, 16): SMALL}
    assert "was not cached (PermissionError" in caplog.text


@pytest.mark.parametrize("unreadable", ["folder", "permission"])
def test_an_unreadable_cache_is_left_alone_not_moved_aside(tmp_path, monkeypatch, caplog,
                                                           unreadable):
    """Any OSError reading the file counted as corrupt content, and store renamed the
    user's cache to `.corrupt-<time>`. Lookups ignore it; stores and the check refuse."""
    path = tmp_path / "matmul_autotune.json"
    if unreadable == "folder":
        path.mkdir()
    else:
        path.write_text(json.dumps({}))
        real_read_text = pathlib.Path.read_text

        def read_text(self, *args, **kwargs):
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return real_read_text(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    with caplog.at_level(logging.WARNING, logger=autotune_mod.__name__):
        assert autotune_mod.lookup("interpret", "cpu", 64, 64, 64, jnp.bfloat16) is None
    assert "cannot read the autotune cache" in caplog.text
    with pytest.raises(OSError, match=rf"cannot read the autotune cache '{path}'.*left as it is"):
        _store()
    with pytest.raises(OSError, match="could not be stored"):
        autotune_mod.check_cache_writable()
    assert not list(tmp_path.glob("*.corrupt-*"))
    assert path.is_dir() if unreadable == "folder" else path.read_bytes() == b"{}"


def test_when_every_candidate_fails_the_error_counts_them_and_chains_the_cause(monkeypatch,
                                                                              caplog):
    """The error said only how many were tried; build failures were logged at INFO,
    unseen under Python's default WARNING level."""
    real_matmul = matmul_mod.matmul

    def faulty_matmul(a, b, *, config, **kw):
        if config == SMALL:
            raise NotImplementedError("no such tiling\nand pages of lowering")
        return real_matmul(a, b, config=config, **kw) * 1.5

    monkeypatch.setattr(matmul_mod, "matmul", faulty_matmul)
    with caplog.at_level(logging.WARNING, logger=autotune_mod.__name__):
        with pytest.raises(RuntimeError) as raised:
            autotune([(16, 16, 16)], backend="interpret", candidates=[LARGE, SMALL],
                     timer=lambda fn: 1.0, write_cache=False)
    message = str(raised.value)
    assert "no candidate passed" in message and "of 2 tried, 1 failed to build or run and " \
        "1 gave a relative error over 0.02" in message
    assert message.endswith("the last failure: NotImplementedError: no such tiling")
    assert isinstance(raised.value.__cause__, NotImplementedError)
    assert "failed: NotImplementedError: no such tiling" in caplog.text


def test_the_cli_reports_a_value_error_as_a_usage_error(monkeypatch, capsys):
    def refusing_autotune(shapes, dtype, **kwargs):
        raise ValueError("transposed='a': no candidate reads the operand as stored")

    monkeypatch.setattr(autotune_mod, "autotune", refusing_autotune)
    with pytest.raises(SystemExit) as exit_info:
        autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16"])
    assert exit_info.value.code == 2
    assert "no candidate reads the operand as stored" in capsys.readouterr().err


def test_the_cli_names_no_python_argument_for_an_unwritable_cache(tmp_path, monkeypatch,
                                                                 capsys):
    """It said "or pass write_cache=False", an argument the CLI does not have."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(SystemExit) as exit_info:
        autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16", "--candidates",
                           CANDIDATES])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "set $JAXOPT_TRAIN_CACHE_DIR to a writable folder" in err
    assert "write_cache" not in err


def test_store_takes_numpy_dims_and_writes_python_ints(tmp_path):
    """json could not serialise np.int64: the store raised TypeError."""
    _store(np.int64(1000), np.int32(777), np.uint16(513))
    data = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert [entry["shape"] for entry in data.values()] == [[1000, 777, 513]] * 2
    assert sorted(key.rsplit("|", 1)[1] for key in data) == ["1000x777x513", "m1024_n1024_k1024"]
    autotune_mod._loaded.clear()
    assert autotune_mod.lookup("interpret", "cpu", 1000, 777, 513, jnp.bfloat16) == SMALL


@pytest.mark.parametrize("dims", [(0, 16, 16), (16, 2.5, 16), (16, 16, True), ("16", 16, 16),
                                  (np.int64(-1), 16, 16)])
def test_store_refuses_dims_that_are_not_positive_ints(tmp_path, dims):
    with pytest.raises(ValueError, match=r"m, n, k must be positive ints .*got \(m, n, k\)="):
        _store(*dims)
    assert not (tmp_path / "matmul_autotune.json").exists()


def test_a_store_syncs_the_new_file_before_renaming_it_over_the_cache(tmp_path, monkeypatch):
    """A rename before the data reached the disk could leave an empty cache after a power
    loss, which the next load moves aside as corrupt, with every earlier winner."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _store()
    cache = str(tmp_path / "matmul_autotune.json")
    synced = [e for e in events if e[0] == "fsync"]
    renamed = [e for e in events if e[0] == "replace" and e[2] == cache]
    assert renamed, events
    tmp = renamed[-1][1]
    # the file renamed over the cache was synced first, whole
    assert ("fsync", tmp, os.path.getsize(cache)) in synced
    assert events.index(("fsync", tmp, os.path.getsize(cache))) < events.index(renamed[-1])
