"""Tests for jaxopt_train.data."""

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxopt_train.data import (
    ImageDataset,
    TokenDataset,
    check_labels,
    load_image_npz,
    check_token_width,
    load_text_corpus,
    load_token_file,
    max_token_id,
    process_batch_slice,
    shard_batch,
    stdlib_source_files,
    synthetic_image_batch,
    synthetic_lm_batch,
)

# ---------------------------------------------------------------- text corpus


def test_stdlib_corpus_is_real_deterministic_and_cached():
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    assert not any({"site-packages", "test", "tests"} & set(f.parts) for f in files)
    corpus = load_text_corpus()
    assert corpus.dtype == np.uint8 and corpus.size > 2**20
    assert load_text_corpus() is corpus  # cached per process
    assert not corpus.flags.writeable
    assert bytes(corpus[:4096]) == b"".join(f.read_bytes() for f in files[:3])[:4096]
    small = load_text_corpus(max_bytes=1000)
    np.testing.assert_array_equal(small, corpus[:1000])


def test_text_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("world")
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / ".hidden").write_text("SECRET")
    np.testing.assert_array_equal(load_text_corpus(tmp_path), np.frombuffer(b"hello world", np.uint8))
    np.testing.assert_array_equal(load_text_corpus(str(tmp_path / "b.txt")), np.frombuffer(b"world", np.uint8))


def test_text_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        load_text_corpus(tmp_path / "empty")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_text_corpus(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="max_bytes=0 must be a positive int"):
        load_text_corpus(max_bytes=0)


# ---------------------------------------------------------------- TokenDataset


def _window_starts(ds, batch):
    """Finds where each input row starts in the split (tokens are 0..n-1)."""
    return batch["inputs"][:, 0] - ds.tokens[0]


def test_packed_batches_shift_by_one_and_are_deterministic():
    tokens = np.arange(10_000, dtype=np.int64)
    ds = TokenDataset(tokens, seq_len=16, val_fraction=0.1)
    batch = ds.batch(3, 8)
    assert batch["inputs"].shape == batch["targets"].shape == (8, 16)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
    np.testing.assert_array_equal(np.diff(batch["inputs"], axis=1), 1)
    # A fresh dataset (a resumed run) gives the same batch for the same step.
    again = TokenDataset(tokens, seq_len=16, val_fraction=0.1).batch(3, 8)
    np.testing.assert_array_equal(batch["inputs"], again["inputs"])
    other_seed = TokenDataset(tokens, seq_len=16, val_fraction=0.1, seed=1).batch(3, 8)
    assert not np.array_equal(batch["inputs"], other_seed["inputs"])


def test_one_epoch_visits_every_window_once_and_epochs_differ():
    ds = TokenDataset(np.arange(1_000), seq_len=10, val_fraction=0.05)  # 950 train tokens
    assert ds.num_sequences == 94 and ds.num_batches_per_epoch(4) == 23
    epoch0 = np.concatenate([_window_starts(ds, ds.batch(s, 2)) for s in range(47)])
    epoch1 = np.concatenate([_window_starts(ds, ds.batch(s, 2)) for s in range(47, 94)])
    for starts in (epoch0, epoch1):
        assert len(set(starts)) == 94
        assert len(set(starts % 10)) == 1  # one shift per epoch
        assert starts.max() + 11 <= 950  # every target inside the split
    assert not np.array_equal(np.sort(epoch0) - epoch0.min(), epoch0 - epoch0.min())  # shuffled
    assert not np.array_equal(epoch0, epoch1)


def test_rows_select_a_process_share_of_the_global_batch():
    ds = TokenDataset(np.arange(5_000), seq_len=8)
    full = ds.batch(7, 12)
    part = ds.batch(7, 12, rows=slice(4, 8))
    np.testing.assert_array_equal(part["inputs"], full["inputs"][4:8])


def test_train_and_val_splits_do_not_overlap():
    tokens = np.arange(2_000)
    train = TokenDataset(tokens, seq_len=8, split="train", val_fraction=0.25)
    val = TokenDataset(tokens, seq_len=8, split="val", val_fraction=0.25)
    assert train.tokens.max() < val.tokens.min() and val.tokens.size == 500
    assert val.batch(0, 4)["inputs"].min() >= 1500


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tokens=np.arange(20), seq_len=30), ValueError, "seq_len=30 needs at least 31 tokens"),
        (dict(tokens=np.arange(200), seq_len=8, split="test"), ValueError, "split='test'; legal values"),
        (dict(tokens=np.arange(200), seq_len=0), ValueError, "seq_len=0 must be a positive int"),
        (dict(tokens=np.ones(200, np.float32), seq_len=8), ValueError, "1-D integer array"),
        (dict(tokens=np.arange(200), seq_len=8, val_fraction=1.0), ValueError, "val_fraction"),
        # A string used to fail with a bare TypeError from the comparison.
        (dict(tokens=np.arange(200), seq_len=8, val_fraction="0.1"), ValueError,
         r"val_fraction='0.1' must be a number in \(0, 1\)"),
        (dict(tokens=np.arange(200), seq_len=8, val_fraction=True), ValueError, "must be a number"),
    ],
)
def test_token_dataset_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        TokenDataset(**kwargs)


def test_token_dataset_bad_step_and_batch():
    ds = TokenDataset(np.arange(200), seq_len=8)
    with pytest.raises(ValueError, match="step=-1"):
        ds.batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size=0"):
        ds.batch(0, 0)


# ---------------------------------------------------------------- token files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_roundtrip(tmp_path, dtype):
    tokens = (np.arange(3_000) * 7919 % 50_000).astype(dtype)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    loaded = load_token_file(path, dtype)
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(loaded, tokens)
    batch = TokenDataset(loaded, seq_len=32).batch(0, 4)
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].max() < 50_000


def test_token_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_token_file(tmp_path / "missing.bin")
    odd = tmp_path / "odd.bin"
    np.arange(5, dtype=np.uint16).tofile(odd)  # 10 bytes: not a whole number of uint32
    with pytest.raises(ValueError, match="not a multiple of 4.*another dtype"):
        load_token_file(odd, "uint32")
    with pytest.raises(ValueError, match=r"legal values: \('uint16', 'uint32'\)"):
        load_token_file(odd, "int64")
    with pytest.raises(ValueError, match="legal values"):
        load_token_file(odd, "float16")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_token_file(empty)


def test_token_file_read_with_the_other_width_is_refused(tmp_path):
    ids = (np.arange(3_000) * 7919 % 50_000).astype(np.uint32)
    ids.tofile(tmp_path / "u32.bin")
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")
    with pytest.raises(ValueError, match=r"every second 16-bit word of the first 6,000 is 0.*"
                                         r"dtype='uint32'.*--token-dtype uint32"):
        load_token_file(tmp_path / "u32.bin", "uint16")
    with pytest.raises(ValueError, match=r"read as uint32, past any tokenizer's vocabulary.*"
                                         r"dtype='uint16'"):
        load_token_file(tmp_path / "u16.bin", "uint32")
    # uint32 ids past 65535 (a 128 K vocabulary) load as uint32
    big = np.array([5, 70_000, 131_071, 0] * 100, np.uint32)
    big.tofile(tmp_path / "big.bin")
    np.testing.assert_array_equal(load_token_file(tmp_path / "big.bin", "uint32"), big)


def test_a_text_file_named_bin_is_refused_as_text(tmp_path):
    """It was read as uint16 ids, and the run asked for --model vocab_size=29817."""
    path = tmp_path / "corpus.bin"
    path.write_text("hello world, this is some text.\n" * 500)
    with pytest.raises(ValueError, match=r"corpus\.bin' holds text \(100% of its first 16,000 "
                                         r"bytes are printable ASCII\), not token ids"):
        load_token_file(path)
    # Real ids are far from that: a Zipf stream of GPT-2's vocabulary has ~15% such bytes.
    _zipf_ids(50_257).astype(np.uint16).tofile(tmp_path / "ids.bin")
    assert load_token_file(tmp_path / "ids.bin").size == 200_000


@pytest.mark.parametrize("vocab", [65_537, 128_256, 262_144, 1 << 24])
def test_uint32_ids_past_65535_read_as_uint16_are_refused(tmp_path, vocab):
    """A Llama-3 uint32 file read at the default uint16 trained on (low, high) halves: the
    zero-word check saw high halves of 1."""
    ids = _zipf_ids(vocab, size=5_000)
    ids[:2] = [vocab - 1, 65_536]  # ids past 65535 present, as in any such corpus
    ids.tofile(tmp_path / "ids.bin")
    with pytest.raises(ValueError, match=r"every second 16-bit word of the first 10,000 is below "
                                         r"256.*dtype='uint32'.*--token-dtype uint32"):
        load_token_file(tmp_path / "ids.bin", "uint16")
    np.testing.assert_array_equal(load_token_file(tmp_path / "ids.bin", "uint32"), ids)


@pytest.mark.parametrize("vocab", [2, 4, 65, 256, 50_257, 65_536])
def test_real_uint16_streams_pass_the_split_check(vocab):
    check_token_width(_zipf_ids(vocab).astype(np.uint16))
    check_token_width(np.random.default_rng(1).integers(0, vocab, 100_000).astype(np.uint16))


@pytest.mark.parametrize("tokens", [
    np.array([7, 0] * 63, np.uint16),  # 63 pairs: too few for the zero pattern to mean anything
    np.zeros(1_000, np.uint16),  # all zeros: no id at all to tell the widths apart
    np.array([7, 0] * 200 + [7, 1], np.uint16),  # one non-zero odd word
    np.array([(1 << 24) - 1], np.uint32),  # the largest plausible id
])
def test_token_width_check_passes_real_layouts(tokens):
    check_token_width(tokens)


def _zipf_ids(vocab, size=200_000, seed=0):
    ranks = np.random.default_rng(seed).zipf(1.2, size=4 * size)
    return (ranks[ranks <= vocab][:size] - 1).astype(np.uint32)


@pytest.mark.parametrize("vocab", [65, 4, 256, 50_257])
def test_small_vocabulary_uint16_ids_read_as_uint32_are_refused(vocab):
    """Character-level ids (shakespeare_char: 65) paired into uint32 stay under 2^24, so the
    largest-id check passed them, and a vocabulary of ~4 M ids was built from the pairs."""
    ids = _zipf_ids(vocab).astype(np.uint16)
    ids[:vocab] = np.arange(vocab)  # every id present
    with pytest.raises(ValueError, match=r"the layout of uint16 ids read two at a time.*dtype='uint16'"):
        check_token_width(ids.view(np.uint32))


@pytest.mark.parametrize("vocab", [100, 50_257, 128_256, 262_144, 2_000_000])
def test_real_uint32_vocabularies_pass_the_paired_check(vocab):
    check_token_width(_zipf_ids(vocab))  # Zipf, as text is
    check_token_width(np.random.default_rng(1).integers(0, vocab, 100_000).astype(np.uint32))


# ---------------------------------------------------------------- images, synthetic


def test_image_npz_and_dataset(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(20) % 10
    np.savez(tmp_path / "d.npz", images=images, labels=labels)
    data = load_image_npz(tmp_path / "d.npz")
    assert data["labels"].dtype == np.int32
    ds = ImageDataset(data["images"], data["labels"], val_fraction=0.25)
    assert ds.num_examples == 15 and ds.num_batches_per_epoch(4) == 3
    batch = ds.batch(1, 4)
    assert batch["images"].dtype == np.float32 and batch["images"].shape == (4, 8, 8, 3)
    train_images, train_labels = images[ds.rows], labels[ds.rows]
    idx = [np.flatnonzero((train_images == (b * 255).round()).all(axis=(1, 2, 3)))[0]
           for b in batch["images"]]
    np.testing.assert_array_equal(batch["labels"], train_labels[idx])
    seen = np.concatenate([ds.batch(s, 5)["labels"] for s in range(3)])
    assert sorted(seen) == sorted(train_labels)


def test_image_npz_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_image_npz(tmp_path / "none.npz")
    np.savez(tmp_path / "a.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match=r"lacks arrays \['images', 'labels'\]"):
        load_image_npz(tmp_path / "a.npz")
    np.savez(tmp_path / "b.npz", images=np.zeros((3, 4, 4, 1)), labels=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="3 images and 2 labels"):
        load_image_npz(tmp_path / "b.npz")
    np.savez(tmp_path / "c.npz", images=np.zeros((3, 4, 4)), labels=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"\(N, H, W, C\)"):
        load_image_npz(tmp_path / "c.npz")


def test_image_labels_out_of_range_are_refused_naming_values(tmp_path):
    images = np.zeros((6, 4, 4, 1), np.uint8)
    np.savez(tmp_path / "neg.npz", images=images, labels=np.array([0, -100, 2, -100, -1, 1]))
    with pytest.raises(ValueError, match=r"3 of 6 labels are out of range \(values -100, -1; first "
                                         r"at index 1\); labels must be class ids in \[0, "
                                         r"num_classes\) with num_classes=3"):
        load_image_npz(tmp_path / "neg.npz", num_classes=3)
    np.savez(tmp_path / "big.npz", images=images, labels=np.array([0, 1, 2, 3, 7, 1]))
    with pytest.raises(ValueError, match=r"2 of 6 labels .*values 3, 7;.*num_classes=3"):
        load_image_npz(tmp_path / "big.npz", num_classes=3)
    assert load_image_npz(tmp_path / "big.npz", num_classes=8)["labels"].max() == 7
    # Without num_classes, an int64 label that int32 cannot hold must not wrap round.
    np.savez(tmp_path / "wrap.npz", images=images, labels=np.array([0, 1, 2**32 + 1, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"values 4294967297;.*labels must fit int32"):
        load_image_npz(tmp_path / "wrap.npz")
    with pytest.raises(ValueError, match="num_classes=0 must be a positive int"):
        check_labels(np.array([0]), 0)


def test_max_token_id_reads_memmaps_in_chunks(tmp_path):
    tokens = (np.arange(10_001, dtype=np.uint16) % 300).astype(np.uint16)
    tokens[9_999] = 50256  # in the last, partial chunk
    tokens.tofile(tmp_path / "t.bin")
    memmap = load_token_file(tmp_path / "t.bin", "uint16")
    assert max_token_id(memmap, chunk_size=1000) == 50256
    assert max_token_id(memmap) == 50256
    assert max_token_id(np.array([3], np.uint32)) == 3
    with pytest.raises(ValueError, match="non-empty 1-D"):
        max_token_id(np.zeros((2, 2), np.uint16))


def test_synthetic_batches():
    lm = synthetic_lm_batch(4, 16, 100, seed=3)
    assert lm["inputs"].shape == (4, 16) and lm["inputs"].dtype == np.int32
    np.testing.assert_array_equal(lm["inputs"][:, 1:], lm["targets"][:, :-1])
    assert lm["inputs"].max() < 100
    img = synthetic_image_batch(6, image_size=8, num_classes=3)
    assert img["images"].shape == (6, 8, 8, 3) and img["images"].dtype == np.float32
    assert img["labels"].dtype == np.int32 and img["labels"].max() < 3
    with pytest.raises(ValueError, match="vocab_size=0"):
        synthetic_lm_batch(4, 16, 0)


# ---------------------------------------------------------------- sharding


def test_shard_batch_over_8_devices():
    mesh = jax.make_mesh((8,), ("data",))
    batch = synthetic_lm_batch(16, 4, 50)
    sharded = shard_batch(batch, mesh)
    assert sharded["inputs"].sharding.spec == P("data")
    shards = sharded["inputs"].addressable_shards
    assert len(shards) == 8 and {s.data.shape for s in shards} == {(2, 4)}
    np.testing.assert_array_equal(sharded["targets"], batch["targets"])
    total = jax.jit(lambda b: jnp.sum(b["inputs"]))(sharded)
    assert int(total) == int(batch["inputs"].sum())
    assert process_batch_slice(16, mesh) == slice(0, 16)
    assert process_batch_slice(16) == slice(0, 16)


def test_shard_batch_replicates_over_other_axes():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = shard_batch({"x": np.arange(8.0).reshape(8, 1)}, mesh)
    shards = sharded["x"].addressable_shards
    assert len(shards) == 8 and {s.data.shape for s in shards} == {(2, 1)}


def test_shard_batch_errors():
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match="batch size 12 is not divisible by the 8 devices.*multiple of 8"):
        shard_batch(synthetic_lm_batch(12, 4, 50), mesh)
    with pytest.raises(ValueError, match="axis='batch' is not an axis of the mesh"):
        shard_batch(synthetic_lm_batch(8, 4, 50), mesh, axis="batch")
    with pytest.raises(ValueError, match="same leading batch size"):
        shard_batch({"a": np.zeros(8), "b": np.zeros(16)}, mesh)
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        process_batch_slice(12, mesh)


def test_shard_batch_names_the_leaves_at_fault():
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match=r"same leading batch size; got \['a'\]: 8, \['b'\]: 16"):
        shard_batch({"a": np.zeros(8), "b": np.zeros((16, 2))}, mesh)
    with pytest.raises(ValueError, match=r"leading batch axis; \['step'\] are scalars"):
        shard_batch({"x": np.zeros(8), "step": np.float32(1)}, mesh)
    with pytest.raises(ValueError, match="a pytree of scalars: pass np.asarray"):
        shard_batch({"x": list(range(8))}, mesh)
    with pytest.raises(ValueError, match="batch has 0 rows"):
        shard_batch({"x": np.zeros((0, 3))}, mesh)


def test_process_batch_slice_without_a_mesh_is_refused_with_several_processes(monkeypatch):
    """Under ("model", "data") = (2, 4) over 2 processes, mesh=None gave each process half the
    rows while its devices hold every data shard: shard_batch built a 4-row batch whose copies
    differed between processes. shard_batch sees the same shapes as a right 4-row batch, so
    the refusal has to be here."""
    assert process_batch_slice(8) == slice(0, 8)  # one process loads everything
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(ValueError, match=r"needs the training mesh with more than one process, got mesh=None "
                                         r"with jax.process_count\(\)=2.*pass process_batch_slice\(8, mesh, 'data'\)"):
        process_batch_slice(8)
    with pytest.raises(ValueError, match=r"mesh axis 'batch'.*process_batch_slice\(16, mesh, 'batch'\)"):
        process_batch_slice(16, axis="batch")


_TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys, jax
    jax.config.update("jax_num_cpu_devices", 4)
    pid = int(sys.argv[1])
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=pid)
    import numpy as np
    from jaxopt_train.data import TokenDataset, process_batch_slice, shard_batch
    mesh = jax.make_mesh((8,), ("data",))
    ds = TokenDataset(np.arange(10_000), seq_len=8)
    rows = process_batch_slice(16, mesh)
    assert rows == slice(8 * pid, 8 * pid + 8), rows
    batch = shard_batch(ds.batch(2, 16, rows=rows), mesh)
    assert batch["inputs"].shape == (16, 8)
    total = jax.jit(lambda b: b["inputs"].sum())(batch)
    expected = int(ds.batch(2, 16)["inputs"].sum())
    assert int(total) == expected, (int(total), expected)
    # The data axis inside each process: every process holds all 4 data shards, so loads all rows.
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    rows = process_batch_slice(16, mesh)
    assert rows == slice(0, 16), rows
    batch = shard_batch(ds.batch(2, 16, rows=rows), mesh)
    for shard in batch["inputs"].addressable_shards:
        np.testing.assert_array_equal(shard.data, ds.batch(2, 16)["inputs"][shard.index])
    try:
        process_batch_slice(16)
    except ValueError as e:
        assert "got mesh=None with jax.process_count()=2" in str(e), e
    else:
        raise AssertionError("process_batch_slice(16) without a mesh was not refused")
    print("OK", pid)
    """
)


def test_two_processes_each_load_their_rows(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "two.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(pid), str(port)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for pid in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("two-process shard_batch test timed out")
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"OK {pid}" in out, out[-3000:]


@pytest.mark.parametrize("fraction, want", [(0.29, 29), (0.57, 57), (0.1, 10), (0.05, 5),
                                            # were 28, 56 and 9: widened to float first
                                            (np.float32(0.29), 29), (np.float32(0.57), 57),
                                            (np.float16(0.1), 10), (np.float64(0.29), 29)])
def test_the_held_out_share_is_what_the_fraction_says(fraction, want):
    """100 * 0.29 is 28.999999999999996 in floats: int() of it held out 28 tokens or images
    of 100 where 29 were asked for (0.57: 56)."""
    tokens = TokenDataset(np.arange(100), seq_len=4, split="val", val_fraction=fraction)
    assert tokens.tokens.size == want
    images = ImageDataset(np.zeros((100, 2, 2, 1), np.uint8), np.zeros(100, np.int32),
                          split="val", val_fraction=fraction)
    assert images.num_examples == want
    with pytest.raises(ValueError, match="val_fraction=nan must be a number in"):
        ImageDataset(np.zeros((4, 2, 2, 1), np.uint8), np.zeros(4, np.int32), val_fraction=float("nan"))


def test_epoch_orders_are_cached_in_uint32_and_unchanged():
    """The cached order of an epoch is uint32 (half numpy's int64 draw) and the same order."""
    from jaxopt_train.data.sampling import batch_indices, epoch_permutation

    perm = epoch_permutation(1000, 3, 2)
    assert perm.dtype == np.uint32 and not perm.flags.writeable
    np.testing.assert_array_equal(perm, np.random.default_rng([3, 2]).permutation(1000))
    items, epochs = batch_indices(2, 600, 1000, 3)  # rows 1200..1799: epoch 1
    assert items.dtype == np.int64
    np.testing.assert_array_equal(items, np.random.default_rng([3, 1]).permutation(1000)[200:800])
    np.testing.assert_array_equal(epochs, 1)


def test_corpus_lm_batch_is_windows_of_the_corpus(tmp_path):
    from jaxopt_train.data import corpus_lm_batch, load_text_corpus

    corpus = load_text_corpus()
    batch = corpus_lm_batch(6, 64, seed=3)
    assert set(batch) == {"inputs", "targets"}
    assert batch["inputs"].shape == batch["targets"].shape == (6, 64)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    # Each row is a real window: find its first 64 bytes in the corpus, then compare all 65.
    raw = corpus.tobytes()
    for row, target in zip(batch["inputs"], batch["targets"]):
        start = raw.find(row.astype(np.uint8).tobytes())
        assert start >= 0
        np.testing.assert_array_equal(corpus[start:start + 65], np.append(row, target[-1]))
    np.testing.assert_array_equal(corpus_lm_batch(6, 64, seed=3)["inputs"], batch["inputs"])
    assert not np.array_equal(corpus_lm_batch(6, 64, seed=4)["inputs"], batch["inputs"])
    # Real text: one byte (the space) is far more frequent than uniform ids would make it.
    counts = np.bincount(corpus_lm_batch(64, 256, seed=0)["inputs"].ravel(), minlength=256)
    assert counts.max() / counts.sum() > 0.15


def test_corpus_lm_batch_bad_input(tmp_path):
    from jaxopt_train.data import corpus_lm_batch

    small = tmp_path / "small.txt"
    small.write_text("x" * 10)
    with pytest.raises(ValueError, match="the corpus has 10 bytes; a window of seq_len=10 needs at least 11"):
        corpus_lm_batch(2, 10, path=small)
    assert corpus_lm_batch(2, 9, path=small)["inputs"].shape == (2, 9)
    with pytest.raises(ValueError, match="batch_size"):
        corpus_lm_batch(0, 8)
    with pytest.raises(ValueError, match="seq_len"):
        corpus_lm_batch(2, -1)


def test_process_batch_slice_of_a_mesh_without_this_process_is_a_clear_error(monkeypatch):
    """A mesh holding none of this process's devices: it was a bare IndexError."""
    from types import SimpleNamespace

    from jaxopt_train.data import sharding as sharding_mod

    mesh = jax.make_mesh((8,), ("data",))
    none_here = SimpleNamespace(addressable_devices_indices_map=lambda shape: {})
    monkeypatch.setattr(sharding_mod, "NamedSharding", lambda mesh, spec: none_here)
    with pytest.raises(ValueError, match=r"none of this process's devices \(process 0\) are in the "
                                         r"mesh.*got one of 8 devices of processes \[0\]"):
        process_batch_slice(16, mesh)
