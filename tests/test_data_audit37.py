"""Audit 37 of jaxopt_train.data and jaxopt_train.plot: each test failed before its fix."""

import os

import jax
import numpy as np
import pytest

from jaxopt_train import plot
from jaxopt_train.data import (
    TokenDataset,
    corpus_lm_batch,
    load_image_npz,
    load_text_corpus,
    load_token_file,
    max_token_id,
    shard_batch,
    stdlib_source_files,
)
from jaxopt_train.runtime import JsonlSink


@pytest.mark.parametrize("seq_len", [np.uint64(8), np.int8(127)])
def test_token_dataset_numpy_int_seq_len_gives_the_python_int_batch(seq_len):
    # np.uint64 made the window indices float64 (IndexError); np.int8(127) + 1 wrapped to -128,
    # giving (B, 0) windows without an error.
    tokens = np.arange(300) % 256
    got = TokenDataset(tokens, seq_len, val_fraction=0.01).batch(3, 4)
    want = TokenDataset(tokens, int(seq_len), val_fraction=0.01).batch(3, 4)
    assert got["inputs"].shape == (4, int(seq_len))
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])


def test_corpus_lm_batch_takes_a_numpy_uint64_seq_len(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, hello corpus")
    got = corpus_lm_batch(2, np.uint64(4), path=tmp_path / "a.txt")
    np.testing.assert_array_equal(got["inputs"], corpus_lm_batch(2, 4, path=tmp_path / "a.txt")["inputs"])


def test_an_empty_text_corpus_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("not a corpus")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="path='' is empty"):
        load_text_corpus("")


def test_stdlib_source_files_refuses_a_missing_or_file_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stdlib_source_files(tmp_path / "nope")
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        stdlib_source_files(tmp_path / "a.py")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_pipe_given_as_a_data_file_is_not_said_to_be_missing(tmp_path):
    fifo = tmp_path / "train.bin"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_token_file(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_image_npz(fifo)
    with pytest.raises(ValueError, match="neither a regular file nor a folder"):
        load_text_corpus(fifo)


def test_a_truncated_npz_is_refused_naming_the_file(tmp_path):
    np.savez(tmp_path / "full.npz", images=np.zeros((4, 2, 2, 1), np.uint8), labels=np.arange(4))
    data = (tmp_path / "full.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.npz' is a damaged \.npz archive"):
        load_image_npz(tmp_path / "cut.npz")


def test_a_corrupt_npz_member_is_refused_naming_the_file_and_array(tmp_path):
    images = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
    np.savez_compressed(tmp_path / "c.npz", images=images, labels=np.arange(4))
    data = bytearray((tmp_path / "c.npz").read_bytes())
    data[80:100] = b"\xff" * 20  # inside the first member's deflate stream
    (tmp_path / "c.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"c\.npz': array 'images' is damaged"):
        load_image_npz(tmp_path / "c.npz")


def test_max_token_id_takes_lists_and_refuses_float_ids():
    assert max_token_id([3, 9, 2]) == 9
    with pytest.raises(ValueError, match="integer array.*float64"):
        max_token_id(np.array([1.0, 7.9]))


def test_shard_batch_over_a_tuple_of_axes_says_it_needs_one_axis_name():
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    with pytest.raises(ValueError, match="name of one mesh axis"):
        shard_batch({"x": np.arange(8)}, mesh, ("model", "data"))


def test_plot_refuses_records_without_a_numeric_step(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0, "loss": 1.0}\n{"iteration": 1, "loss": 0.5}\n')
    assert plot.main([str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert 'has a numeric "step"' in err and "iteration, loss" in err
    assert "no finite numbers" not in err


def test_plot_draws_a_bytes_per_second_rate_as_throughput_not_memory(tmp_path):
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for step in range(3):
        sink.write(step, {"hbm_bytes_per_s": 2.0**40, "peak_memory_gib": 3.0})
    sink.close()
    curves = {panel: [name for _, name, _, _ in plot._panel_curves(
        {"run": plot.load_run(str(tmp_path / "run"))}, pattern)]
        for panel, (_, pattern, _) in plot.PANELS.items()}
    assert curves["throughput"] == ["hbm_bytes_per_s"]
    assert curves["memory"] == ["peak_memory_gib"]
