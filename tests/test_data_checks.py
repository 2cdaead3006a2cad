"""Inputs `jaxopt_train.data` used to take silently (or refuse only deep inside): now refused up front."""

import compileall
import os
import re

import jax
import numpy as np
import pytest

from jaxopt_train.data import (ImageDataset, TokenDataset, corpus_lm_batch, load_image_npz, load_text_corpus,
                               load_token_file, max_token_id, process_batch_slice, shard_batch,
                               stdlib_source_files, synthetic_image_batch, synthetic_lm_batch)
from jaxopt_train.data.images import split_rows


def test_big_endian_token_dtype_is_refused_not_read_as_little_endian(tmp_path):
    path = tmp_path / "be.bin"
    np.arange(10, dtype=">u2").tofile(path)
    with pytest.raises(ValueError, match="is big-endian; token files are little-endian: pass 'uint16'"):
        load_token_file(path, ">u2")
    np.testing.assert_array_equal(load_token_file(path, "<u2"), np.arange(10).astype(">u2").view("<u2"))


@pytest.mark.parametrize("seed", [-1, 1.5, None, True])
def test_bad_seeds_are_refused_when_the_dataset_is_built(seed):
    """numpy refused them only at the first batch, with no word of which argument."""
    match = f"seed={seed!r} must be a non-negative int"
    with pytest.raises(ValueError, match=match):
        TokenDataset(np.arange(1000) % 256, 8, seed=seed)
    with pytest.raises(ValueError, match=match):
        ImageDataset(np.zeros((10, 4, 4, 3), np.uint8), np.zeros(10, np.int32), seed=seed)
    with pytest.raises(ValueError, match=match):
        synthetic_lm_batch(2, 4, 10, seed=seed)
    with pytest.raises(ValueError, match=match):
        synthetic_image_batch(2, seed=seed)


def test_numpy_int_seeds_reproduce_python_int_seeds():
    tokens = np.arange(1000) % 256
    want = TokenDataset(tokens, 8, seed=3).batch(5, 4)["inputs"]
    np.testing.assert_array_equal(TokenDataset(tokens, 8, seed=np.int64(3)).batch(5, 4)["inputs"], want)


def test_channels_first_images_are_refused_with_the_fix(tmp_path):
    path = tmp_path / "nchw.npz"
    np.savez(path, images=np.zeros((10, 3, 32, 32), np.uint8), labels=np.zeros(10, np.int64))
    with pytest.raises(ValueError, match=r"look channels-first \(N, C, H, W\).*transpose\(0, 2, 3, 1\)"):
        load_image_npz(path)
    with pytest.raises(ValueError, match="look channels-first"):
        ImageDataset(np.zeros((10, 1, 28, 28), np.float32), np.zeros(10, np.int32))
    # real NHWC shapes still load, including grey and RGBA
    for shape in [(10, 28, 28, 1), (10, 32, 32, 3), (10, 4, 4, 4), (10, 64, 48, 3)]:
        ImageDataset(np.zeros(shape, np.uint8), np.zeros(10, np.int32))


def test_images_with_an_empty_dimension_are_refused():
    with pytest.raises(ValueError, match="H, W and C of at least 1"):
        ImageDataset(np.zeros((10, 0, 32, 3), np.uint8), np.zeros(10, np.int32))


def test_process_batch_slice_takes_numpy_ints_like_the_datasets():
    assert process_batch_slice(np.int64(8)) == slice(0, 8)
    with pytest.raises(ValueError, match="global_batch_size=True must be a positive int"):
        process_batch_slice(True)


def test_text_folder_skips_bytecode_and_binary_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("print('hi')\n")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert compileall.compile_dir(str(tmp_path / "pkg"), quiet=1)
    assert list((tmp_path / "pkg").rglob("*.pyc"))
    corpus = load_text_corpus(tmp_path)
    assert bytes(corpus) == b"print('hi')\n"
    # a file named explicitly is read as given
    assert load_text_corpus(tmp_path / "logo.png").size == 16
    # a folder of binary files only was "empty (0 files, 0 bytes)"
    (tmp_path / "images").mkdir()
    (tmp_path / "logo.png").rename(tmp_path / "images" / "logo.png")
    with pytest.raises(ValueError, match=r"images' holds only binary files \(1: .*\) and no text"):
        load_text_corpus(tmp_path / "images")


@pytest.mark.parametrize("suffix, kind", [(".gz", "gzip"), (".bz2", "bzip2"), (".xz", "xz"),
                                          (".zip", "zip")])
def test_a_compressed_text_file_is_refused(tmp_path, suffix, kind):
    """--data corpus.txt.gz trained on gzip's output bytes, exit 0."""
    import bz2
    import gzip
    import lzma
    import zipfile

    text = b"to be or not to be\n" * 100
    path = tmp_path / f"corpus.txt{suffix}"
    if kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("corpus.txt", text)
    else:
        path.write_bytes({"gzip": gzip, "bzip2": bz2, "xz": lzma}[kind].compress(text))
    with pytest.raises(ValueError, match=rf"corpus\.txt\{suffix}' is {kind}-compressed; expected "
                                         r"the text itself: decompress it first"):
        load_text_corpus(path)
    (tmp_path / "plain.txt").write_bytes(b"\x1f text that only starts like gzip")
    assert bytes(load_text_corpus(tmp_path / "plain.txt")).startswith(b"\x1f text")


def test_text_folder_with_token_files_is_refused_naming_them(tmp_path):
    """A nanoGPT data folder used to train on prepare.py alone, its .bin files skipped as binary."""
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "prepare.py").write_text("print('tokenise')\n")
    with pytest.raises(ValueError, match=r"holds \.bin token files \(train\.bin, val\.bin\).*"
                                         f"--data {re.escape(str(tmp_path / 'train.bin'))}"):
        load_text_corpus(tmp_path)
    # one nested deeper, and one with no NUL byte (which would have been read as text), too
    for name in ("train.bin", "val.bin"):
        (tmp_path / name).unlink()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ids.bin").write_bytes(b"\x41\x42" * 100)
    with pytest.raises(ValueError, match=r"\(sub/ids\.bin\).*move the \.bin files out"):
        load_text_corpus(tmp_path)
    # the extension in upper case is a token file too (it was read as text)
    (tmp_path / "sub" / "ids.bin").rename(tmp_path / "sub" / "IDS.BIN")
    with pytest.raises(ValueError, match=r"\(sub/IDS\.BIN\)"):
        load_text_corpus(tmp_path)
    # without them the folder's text is read as before
    (tmp_path / "sub" / "IDS.BIN").unlink()
    assert bytes(load_text_corpus(tmp_path)) == b"print('tokenise')\n"


def _image_splits(num_examples, **kwargs):
    # Each image is filled with its own index, so a split's contents can be read back.
    index = np.arange(num_examples, dtype=np.float32)[:, None, None, None]
    images = np.broadcast_to(index, (num_examples, 4, 4, 3))
    labels = np.arange(num_examples) % 3
    return [ImageDataset(images, labels, split=split, **kwargs) for split in ("train", "val")]


@pytest.mark.filterwarnings("ignore:float images hold values")  # ids as pixels
@pytest.mark.parametrize("num_examples, num_val", [(2, 1), (9, 1), (10, 1), (25, 2)])
def test_small_image_sets_keep_one_val_example(num_examples, num_val):
    """val_fraction=0.1 (fixed in the trainer) used to leave 'val' empty, and refuse, below 10 examples."""
    train, val = _image_splits(num_examples)
    assert (train.num_examples, val.num_examples) == (num_examples - num_val, num_val)
    # disjoint, covering the set, the same for every batch-order seed
    held = np.concatenate([train.images[:, 0, 0, 0], val.images[:, 0, 0, 0]])
    np.testing.assert_array_equal(np.sort(held), np.arange(num_examples))
    again_train, again_val = _image_splits(num_examples, seed=7)
    np.testing.assert_array_equal(again_train.images, train.images)
    np.testing.assert_array_equal(again_val.labels, val.labels)
    assert val.batch(0, 4)["images"].shape == (4, 4, 4, 3)  # a batch wraps round one example


@pytest.mark.filterwarnings("ignore:float images hold values")  # ids as pixels
def test_image_val_split_is_a_seeded_shuffle_not_the_last_examples():
    """A set sorted by class used to hold out its last 10%: one class, never seen in training."""
    num_examples = 200
    index = np.arange(num_examples, dtype=np.float32)[:, None, None, None]
    images = np.broadcast_to(index, (num_examples, 4, 4, 1))
    labels = np.repeat(np.arange(10), 20)  # sorted by class, as a folder per class saves
    train, val = (ImageDataset(images, labels, split=split) for split in ("train", "val"))
    assert (train.num_examples, val.num_examples) == (180, 20)
    assert len(np.unique(val.labels)) >= 5 and len(np.unique(train.labels)) == 10
    train_ids, val_ids = train.images[:, 0, 0, 0].astype(int), val.images[:, 0, 0, 0].astype(int)
    assert not set(train_ids) & set(val_ids)
    np.testing.assert_array_equal(np.sort(np.concatenate([train_ids, val_ids])), np.arange(num_examples))
    np.testing.assert_array_equal(val_ids, val.rows)
    np.testing.assert_array_equal(val.labels, labels[val.rows])
    # Pure integer hashing: the same split in every process, rerun and numpy version.
    assert val.rows.tolist() == [1, 18, 25, 27, 43, 47, 58, 75, 126, 127, 130, 136, 145, 146, 154,
                                 158, 170, 177, 187, 191]
    # The batch-order seed leaves the split alone (train and val built with different seeds
    # stay disjoint); split_seed moves it.
    np.testing.assert_array_equal(ImageDataset(images, labels, split="val", seed=5).rows, val.rows)
    other = ImageDataset(images, labels, split="val", split_seed=1).rows
    assert other.size == 20 and not np.array_equal(other, val.rows)


def test_image_split_of_a_memory_mapped_array_reads_only_its_batches(tmp_path):
    # A shuffled split taken as images[rows] read a memory-mapped set whole into RAM when
    # the dataset was built; the batches must come from the mapped file itself.
    path = tmp_path / "images.npy"
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(50, 4, 4, 1))
    images[:] = np.arange(50, dtype=np.uint8)[:, None, None, None]
    labels = np.arange(50) % 5
    train, val = (ImageDataset(images, labels, split=split) for split in ("train", "val"))
    images[:] += 100  # the file changes after the datasets are built: still read from it
    for ds in (train, val):
        batch = ds.batch(3, 8)
        ids = (batch["images"][:, 0, 0, 0] * 255).round().astype(int) - 100
        assert set(ids) <= set(ds.rows)
        np.testing.assert_array_equal(ids % 5, batch["labels"])
        np.testing.assert_array_equal(ds.images[:, 0, 0, 0], np.asarray(ds.rows) + 100)


def test_image_dataset_takes_labels_and_images_as_lists():
    # Was: AttributeError: 'list' object has no attribute 'ndim'.
    images = np.zeros((4, 2, 2, 1), np.float32)
    ds = ImageDataset(images.tolist(), [0, 1, 2, 3], split="val", val_fraction=0.5)
    np.testing.assert_array_equal(np.sort(ds.labels), ds.rows)
    assert ds.batch(0, 2)["images"].shape == (2, 2, 2, 1)
    with pytest.raises(ValueError, match=r"labels must be \(N,\) integers, got shape=\(4,\) dtype=float64"):
        ImageDataset(images, [0.0, 1.0, 2.0, 3.0])


@pytest.mark.parametrize("split_seed", [-1, 1.5, None, True])
def test_bad_split_seeds_are_refused(split_seed):
    with pytest.raises(ValueError, match=re.escape(f"split_seed={split_seed!r} must be a non-negative int")):
        ImageDataset(np.zeros((10, 4, 4, 3), np.uint8), np.zeros(10, np.int32), split_seed=split_seed)


@pytest.mark.parametrize("split_seed", [np.int32(3), np.int64(3), np.uint64(3), np.int64(0)])
def test_numpy_int_split_seeds_give_the_python_int_split(split_seed):
    """check_seed takes numpy ints, but split_seed=np.int64(0) raised OverflowError under NumPy 2."""
    want = split_rows(50, 5, int(split_seed))
    for got, expected in zip(split_rows(50, 5, split_seed), want):
        np.testing.assert_array_equal(got, expected)
    images, labels = np.zeros((50, 2, 2, 1), np.uint8), np.arange(50) % 5
    val = ImageDataset(images, labels, split="val", split_seed=split_seed)
    np.testing.assert_array_equal(val.rows, ImageDataset(images, labels, split="val", split_seed=int(split_seed)).rows)
    np.testing.assert_array_equal(val.rows, want[1])


def test_image_split_leaves_one_training_example():
    train, val = _image_splits(2, val_fraction=0.9)
    assert (train.num_examples, val.num_examples) == (1, 1)


def test_one_image_is_refused_saying_how_many_are_needed():
    with pytest.raises(ValueError, match="needs at least 2 examples, one for the 'train' split and one "
                                         "for 'val', got num_examples=1"):
        _image_splits(1)


@pytest.mark.parametrize("step_type", [np.int32, np.uint32, np.int64])
def test_numpy_int_steps_give_the_python_int_batch_past_2_31_stream_items(step_type):
    """Before: np.int32(4_500_000) * 1024 wrapped in int32 and silently gave an earlier batch."""
    ds = TokenDataset(np.arange(200_000, dtype=np.uint32), seq_len=8)
    want = ds.batch(4_500_000, 1024)
    for batch_size in (1024, np.int32(1024)):
        got = ds.batch(step_type(4_500_000), batch_size)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])


@pytest.mark.parametrize("step", [True, False, np.True_])
def test_bool_steps_are_refused(step):
    with pytest.raises(ValueError, match=re.escape(f"step={step!r} must be a non-negative int")):
        TokenDataset(np.arange(1000) % 256, 8).batch(step, 4)
    with pytest.raises(ValueError, match=re.escape(f"step={step!r} must be a non-negative int")):
        ImageDataset(np.zeros((10, 4, 4, 3), np.uint8), np.zeros(10, np.int32)).batch(step, 4)


@pytest.mark.parametrize("rows", [slice(2, 9), slice(-2, None), slice(0, 4, 2), slice(3, 1), [0, 1]])
def test_rows_outside_the_batch_are_refused(rows):
    from jaxopt_train.data.sampling import batch_indices

    with pytest.raises(ValueError, match=r"rows=.* must be a slice start:stop with 0 <= start <= "
                                         r"stop <= batch_size=4"):
        batch_indices(0, 4, 100, 0, rows=rows)
    items, _ = batch_indices(0, 4, 100, 0, rows=slice(1, 3))
    np.testing.assert_array_equal(items, batch_indices(0, 4, 100, 0)[0][1:3])


@pytest.mark.parametrize("bad_id", [-1, 2**31 + 5])
def test_token_ids_that_int32_cannot_hold_are_refused_not_wrapped(bad_id):
    # Was: batches are int32, so 2**31 + 5 came out as -2147483643 and -1 went to the
    # embedding as-is (numpy-style indexing reads it as the last row): other tokens, silently.
    tokens = np.arange(1000, dtype=np.int64) % 256
    tokens[500] = bad_id
    dataset = TokenDataset(tokens, 8, seed=0)
    with pytest.raises(ValueError, match=rf"token id {bad_id} .*int32 ids in \[0, 2\*\*31\)"):
        dataset.batch(0, dataset.num_sequences)  # one epoch's windows: every token
    clean = TokenDataset(np.arange(1000, dtype=np.uint32) % 256, 8)  # other dtypes still work
    assert clean.batch(0, 4)["inputs"].dtype == np.int32


def test_image_labels_that_int32_cannot_hold_are_refused_not_wrapped():
    # Was: ImageDataset cast 2**32 + 4 to int32, i.e. class 4.
    images = np.zeros((10, 4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match=r"1 of 10 labels are out of range \(values 4294967300; "
                                         r"first at index 4\); labels must fit int32"):
        ImageDataset(images, np.where(np.arange(10) == 4, 2**32 + 4, 1))
    assert ImageDataset(images, np.arange(10, dtype=np.uint8)).batch(0, 4)["labels"].dtype == np.int32


def test_a_file_that_is_not_an_npz_archive_is_refused_with_what_was_expected(tmp_path):
    # Was: "contains pickled (object) data" for a stray file, and a TypeError about the
    # context manager protocol for a single .npy array saved under an .npz name.
    garbage, single = tmp_path / "garbage.npz", tmp_path / "single.npz"
    garbage.write_bytes(b"not a zip archive")
    with open(single, "wb") as f:
        np.save(f, np.zeros((4, 8, 8, 3), np.uint8))
    for path, found in ((garbage, "neither"), (single, "a single .npy array")):
        with pytest.raises(ValueError, match=rf"is not an .npz archive \({found}.*\); expected "
                                             r"np.savez\(path, images=\.\.\., labels=\.\.\.\)"):
            load_image_npz(path)


def test_an_edited_text_corpus_is_read_again_not_served_from_the_cache(tmp_path):
    # Was: cached by path alone, so a notebook that rewrote its corpus trained on the old text.
    import os

    path = tmp_path / "corpus.txt"
    path.write_bytes(b"old text")
    assert load_text_corpus(path).tobytes() == b"old text"
    assert load_text_corpus(path) is load_text_corpus(path)  # unchanged: still cached
    path.write_bytes(b"new text, longer")
    assert load_text_corpus(path).tobytes() == b"new text, longer"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"aaaa")
    assert load_text_corpus(folder).tobytes() == b"aaaa"
    (folder / "a.txt").write_bytes(b"bbbb")  # same size; the mtime tells
    os.utime(folder / "a.txt", ns=(1, 1))
    (folder / "b.txt").write_bytes(b"cc")
    assert load_text_corpus(folder).tobytes() == b"bbbbcc"


def test_an_edited_text_corpus_does_not_keep_its_old_versions_in_memory(tmp_path):
    # Was: the cache was keyed by (path, size and mtime), so each edit left the old corpus
    # cached where nothing could reach it: up to 8 copies of a corpus read whole.
    import gc
    import os
    import weakref

    path = tmp_path / "corpus.txt"
    path.write_bytes(b"version 0")
    old = weakref.ref(load_text_corpus(path))
    for version in range(1, 4):
        path.write_bytes(b"version %d" % version)
        os.utime(path, ns=(version, version))
        assert load_text_corpus(path).tobytes() == b"version %d" % version
    gc.collect()
    assert old() is None
    assert load_text_corpus(path) is load_text_corpus(path)  # the current version stays cached


def test_text_corpus_max_bytes_takes_numpy_ints_and_refuses_bools(tmp_path):
    # Was: np.int64(4) refused as "must be a positive int", and True read as a 1-byte corpus.
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"some text")
    assert load_text_corpus(path, max_bytes=np.int64(4)).tobytes() == b"some"
    with pytest.raises(ValueError, match="max_bytes=True must be a positive int or None"):
        load_text_corpus(path, max_bytes=True)


def test_a_text_corpus_past_16_mib_is_read_whole(tmp_path):
    # Was: a user's corpus was cut to its first 16 MiB (the cap meant for the embedded
    # corpus) without a word, and the "val" split came from the middle of the text.
    from jaxopt_train.data.text import DEFAULT_MAX_BYTES

    path = tmp_path / "big.txt"
    tail = b"the end of the corpus\n"
    path.write_bytes(b"a" * DEFAULT_MAX_BYTES + tail)
    corpus = load_text_corpus(path)
    assert corpus.size == DEFAULT_MAX_BYTES + len(tail) and corpus[-len(tail):].tobytes() == tail
    assert load_text_corpus(path, max_bytes=10).tobytes() == b"a" * 10  # an explicit cap still cuts
    assert load_text_corpus().size <= DEFAULT_MAX_BYTES  # the embedded corpus keeps its cap


def test_ragged_images_stored_as_objects_are_refused_naming_the_file(tmp_path):
    # Was: numpy's "Object arrays cannot be loaded when allow_pickle=False", naming neither
    # the file nor the array, and hinting at allow_pickle (wrong advice for image data).
    path = tmp_path / "ragged.npz"
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.zeros((4, 4, 3), np.uint8), np.zeros((5, 5, 3), np.uint8)]
    np.savez(path, images=ragged, labels=np.arange(2))
    with pytest.raises(ValueError, match=r"ragged.npz'.*'images' is stored as Python objects "
                                         r"\(dtype=object.*expected images \(N, H, W, C\)"):
        load_image_npz(path)


def test_a_folder_given_as_a_token_or_image_file_is_named_a_folder(tmp_path):
    # Was: "does not exist" for a folder that does exist.
    for name, load in (("data.bin", load_token_file), ("images.npz", load_image_npz)):
        (tmp_path / name).mkdir()
        with pytest.raises(ValueError, match=rf"{name}' is a folder, not a file"):
            load(tmp_path / name)


def test_check_labels_takes_a_numpy_int_num_classes(tmp_path):
    # Was: "num_classes=np.int64(3) must be a positive int" for labels.max() + 1.
    from jaxopt_train.data import check_labels

    labels = np.array([0, 1, 2])
    check_labels(labels, labels.max() + 1)
    with pytest.raises(ValueError, match=r"values 2; first at index 2\).*num_classes=2"):
        check_labels(labels, np.int32(2))
    path = tmp_path / "images.npz"
    np.savez(path, images=np.zeros((3, 4, 4, 3), np.uint8), labels=labels)
    assert load_image_npz(path, num_classes=labels.max() + 1)["labels"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="num_classes=True must be a positive int"):
        check_labels(labels, True)


@pytest.mark.parametrize("labels", [[0.0, 1.7, 2.0], [0.0, np.nan, 1.0], [True, False, True]])
def test_check_labels_refuses_labels_that_are_not_integers(labels):
    # Was: NaN and 1.7 passed as class ids of num_classes=3 (both range tests are False for NaN).
    from jaxopt_train.data import check_labels

    dtype = np.asarray(labels).dtype
    with pytest.raises(ValueError, match=f"must be integer class ids .*got dtype={dtype}; .*astype"):
        check_labels(np.asarray(labels), 3)
    check_labels(np.array([0, 1, 2], np.uint8), 3)  # any integer dtype is fine


def test_images_with_nan_or_inf_pixels_are_refused(tmp_path):
    """One NaN pixel made every batch holding it NaN (BatchNorm shares batch statistics): the
    trainer skipped 5 of 12 steps without naming the image."""
    images = np.random.default_rng(0).random((3000, 4, 4, 3)).astype(np.float32)
    images[2049, 1, 2, 0] = np.nan
    images[2500, 0, 0, 1] = np.inf
    labels = np.zeros(3000, np.int32)
    with pytest.raises(ValueError, match=r"2 of 3000 images hold NaN or inf pixels \(first at index 2049\)"):
        ImageDataset(images, labels)
    np.savez(tmp_path / "bad.npz", images=images, labels=labels)
    with pytest.raises(ValueError, match="hold NaN or inf pixels"):
        load_image_npz(str(tmp_path / "bad.npz"))
    images[2049, 1, 2, 0] = images[2500, 0, 0, 1] = 0.5
    ImageDataset(images, labels)  # finite: accepted


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


def test_float_images_in_0_to_255_get_a_warning_and_are_kept_as_stored(tmp_path, recwarn):
    """Float images go in as stored (only uint8 is scaled by 1/255): 0..255 floats trained on
    inputs 255x the usual scale without a word. Warned, not refused: a range may be meant."""
    pixels = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 3))
    labels = np.arange(20, dtype=np.int32) % 2
    with pytest.warns(UserWarning, match=r"float images hold values up to 255 \(0\.\.255 pixel "
                                         r"values\?\); .* divide by 255"):
        ds = ImageDataset(pixels.astype(np.float32), labels)
    assert ds.batch(0, 4)["images"].max() > 1.0  # as stored
    np.savez(tmp_path / "f.npz", images=pixels.astype(np.float32), labels=labels)
    with pytest.warns(UserWarning, match="float images hold values up to 255"):
        load_image_npz(str(tmp_path / "f.npz"))
    recwarn.clear()
    ImageDataset((pixels / 255.0).astype(np.float32), labels)  # [0, 1]
    ImageDataset(((pixels / 255.0 - 0.45) / 0.225).astype(np.float32), labels)  # mean/std
    ImageDataset(pixels.astype(np.uint8), labels)  # uint8 is scaled per batch
    assert not [w for w in recwarn if "float images hold" in str(w.message)]
