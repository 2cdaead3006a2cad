"""Image classification arrays from ``.npz`` files, in a resumable order."""

from __future__ import annotations

import os
import pathlib
import warnings
import zipfile
import zlib

import numpy as np

from jaxopt_train.data._files import regular_file
from jaxopt_train.data.sampling import batch_indices, check_positive_int, check_seed, held_out_count
from jaxopt_train.data.tokens import SPLITS


def load_image_npz(path: str | os.PathLike, *, num_classes: int | None = None) -> dict[str, np.ndarray]:
    """Loads ``{"images": [N, H, W, C], "labels": int32 [N]}`` from an ``.npz`` file.

    ``images`` may be uint8 (0..255) or floating; it is returned as stored
    (`ImageDataset` scales uint8 to [0, 1] per batch, keeping host memory small).

    Args:
      path: the ``.npz`` file.
      num_classes: if given, every label must be a class id in [0, num_classes).
        Without it the labels must still fit int32, the dtype they are returned in.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a folder or other non-regular file, a damaged archive, missing or object
        (ragged) arrays, wrong ranks/dtypes, mismatched lengths, or labels out of range.
    """
    path = regular_file(path, "image file",
                        "an .npz written by np.savez(path, images=..., labels=...)")
    with _open_npz(path) as npz:
        missing = {"images", "labels"} - set(npz.files)
        if missing:
            raise ValueError(
                f"{str(path)!r} lacks arrays {sorted(missing)}; expected 'images' "
                f"(N, H, W, C) and 'labels' (N,), found {sorted(npz.files)}"
            )
        images, labels = (_read_array(npz, path, name) for name in ("images", "labels"))
    check_image_arrays(images, labels)
    source = f"labels of {str(path)!r}"
    if num_classes is not None:
        check_labels(labels, num_classes, source)
    else:
        # An int64 label past int32 would wrap round in the cast below and pass as another id.
        _check_range(labels, np.iinfo(np.int32).min, np.iinfo(np.int32).max + 1, source,
                     "labels must fit int32")
    return {"images": images, "labels": labels.astype(np.int32)}


def _open_npz(path: pathlib.Path):
    """`np.load` of an ``.npz`` archive, refusing anything else with what was expected.

    np.load returns a bare array for ``.npy`` content and reports other files as
    "pickled (object) data", neither of which says that the archive is what's missing.
    """
    expected = "expected np.savez(path, images=..., labels=...)"
    try:
        loaded = np.load(path, allow_pickle=False)
    except zipfile.BadZipFile as err:
        # A zip whose write was cut short (no central directory): zipfile's own text names
        # neither the file nor the fix.
        raise ValueError(f"{str(path)!r} is a damaged .npz archive ({err}); was its write cut "
                         f"short? Write it again: {expected}") from None
    except (ValueError, OSError, EOFError) as err:
        # numpy's own text here suggests allow_pickle=True: wrong advice for a stray file.
        with open(path, "rb") as file:
            head = file.read(8)
        raise ValueError(f"{str(path)!r} is not an .npz archive (neither a zip archive nor .npy "
                         f"data; it starts with {head!r}: {type(err).__name__}); {expected}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{str(path)!r} is not an .npz archive (a single .npy array of "
                         f"shape={loaded.shape} dtype={loaded.dtype}); {expected}")
    return loaded


def _read_array(npz, path: pathlib.Path, name: str) -> np.ndarray:
    """``npz[name]``, refusing an object array with what was expected.

    A list of images of different sizes saves as dtype=object, which np.load reads only
    with pickling; its own message names neither the file nor the array.
    """
    try:
        return npz[name]
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        # Damaged member data (bad CRC, corrupt deflate stream): the bare error named no file.
        raise ValueError(f"{str(path)!r}: array {name!r} is damaged ({type(err).__name__}: {err}); "
                         "write the file again with np.savez(path, images=..., labels=...)") from None
    except ValueError as err:
        if "allow_pickle" not in str(err):
            raise
        raise ValueError(
            f"{str(path)!r}: array {name!r} is stored as Python objects (dtype=object, as a list "
            "of images of different sizes saves); expected images (N, H, W, C) uint8 or float, "
            "all of one size, and labels (N,) int: resize the images to one shape and save "
            "np.stack(images)") from None


def check_labels(labels: np.ndarray, num_classes: int, source: str = "labels") -> None:
    """Raises ValueError unless every label is a class id in [0, num_classes).

    A label outside that range (e.g. -100, an ignore index elsewhere) has no
    logit to pick; under `jit` the loss would turn it into NaN mid-run, so it is
    refused here, before anything is compiled, naming the offending values.
    """
    check_positive_int("num_classes", num_classes)  # numpy ints too (labels.max() + 1)
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        # NaN and 1.7 pass both range tests below, yet name no class: one-hot encoded they
        # match none, and the loss trains towards an all-zero target without a word.
        raise ValueError(f"{source}: labels must be integer class ids in [0, num_classes), got "
                         f"dtype={labels.dtype}; if they hold whole numbers (floats read from a "
                         "CSV), convert them with labels.astype(np.int32)")
    fixes = []
    if np.any(labels < 0):
        fixes.append("there is no ignore index (such as -100): drop or relabel those examples")
    if np.any(labels >= num_classes):
        fixes.append("raise num_classes (--num-classes) if the ids above it are real classes")
    _check_range(labels, 0, num_classes, source, f"labels must be class ids in [0, num_classes) "
                 f"with num_classes={num_classes}; " + "; ".join(fixes))


def _check_range(labels: np.ndarray, low: int, high: int, source: str, rule: str) -> None:
    labels = np.asarray(labels)
    bad = (labels < low) | (labels >= high)
    if bad.any():
        values = np.unique(labels[bad])
        shown = ", ".join(str(v) for v in values[:8]) + (", ..." if values.size > 8 else "")
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{source}: {int(bad.sum())} of {labels.size} labels are out of range "
                         f"(values {shown}; first at index {first}); {rule}")


# Channel counts of real images (grey, grey+alpha, RGB, RGBA).
_CHANNELS = (1, 2, 3, 4)
# Float pixels above this look like 0..255 values (mean/std-normalised ones stay within ~3).
_FLOAT_PIXEL_WARN = 16.0


def check_image_arrays(images: np.ndarray, labels: np.ndarray) -> None:
    """Raises ValueError unless images is (N, H, W, C) uint8/float and labels (N,) int."""
    if images.ndim != 4 or not (images.dtype == np.uint8 or np.issubdtype(images.dtype, np.floating)):
        raise ValueError(
            f"images must be (N, H, W, C) uint8 or float, got shape={images.shape} dtype={images.dtype}"
        )
    if 0 in images.shape[1:]:
        raise ValueError(f"images must have H, W and C of at least 1, got shape={images.shape}")
    _, height, _, channels = images.shape
    if height in _CHANNELS and channels not in _CHANNELS:
        # PyTorch's layout: read as NHWC it would be images `height` pixels tall with
        # `channels` channels, and train on scrambled pixels or fail deep in the model.
        raise ValueError(
            f"images of shape={images.shape} look channels-first (N, C, H, W); they must be "
            "(N, H, W, C): convert with images.transpose(0, 2, 3, 1)"
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be (N,) integers, got shape={labels.shape} dtype={labels.dtype}")
    if images.shape[0] != labels.shape[0] or images.shape[0] == 0:
        raise ValueError(
            f"need as many labels as images (and at least one), got {images.shape[0]} images "
            f"and {labels.shape[0]} labels"
        )
    if np.issubdtype(images.dtype, np.floating):
        _check_finite(images)


def _check_finite(images: np.ndarray, chunk: int = 1024) -> None:
    # One NaN pixel makes every batch holding it NaN (BatchNorm shares statistics across the
    # batch), and the trainer skips each such step without a word about the image. Checked a
    # chunk at a time: a memory-mapped file is read once, not copied whole.
    bad_images = 0
    first = None
    largest = -np.inf
    for start in range(0, images.shape[0], chunk):
        block = images[start:start + chunk]
        finite = np.isfinite(block).all(axis=(1, 2, 3))
        bad_images += int((~finite).sum())
        if first is None and not finite.all():
            first = start + int(np.flatnonzero(~finite)[0])
        if finite.any():
            largest = max(largest, float(np.abs(block[finite]).max()))
    if bad_images:
        raise ValueError(f"{bad_images} of {images.shape[0]} images hold NaN or inf pixels (first "
                         f"at index {first}); expected finite pixel values")
    if largest > _FLOAT_PIXEL_WARN:
        # Float images go in as stored (only uint8 is scaled by 1/255): 0..255 floats trained
        # on inputs 255x the usual scale. Not refused: a range of one's own may be meant.
        warnings.warn(f"float images hold values up to {largest:g} (0..255 pixel values?); float "
                      "images are used as stored and only uint8 ones are scaled to [0, 1]: store "
                      "them as uint8 or divide by 255, unless this range is meant", stacklevel=3)


def _val_size(num_examples: int, val_fraction: float) -> int:
    """How many of ``num_examples`` the "val" split takes: ``val_fraction`` of them, rounded down,
    but at least 1 and at most ``num_examples - 1``.

    The bounds keep both splits non-empty, so a set of 2..9 examples trains and
    evaluates instead of being refused (the trainer builds both splits, with a
    fixed val_fraction no CLI flag changes).

    Example:
      >>> _val_size(100, 0.1), _val_size(9, 0.1), _val_size(2, 0.9)
      (10, 1, 1)
    """
    if num_examples < 2:
        raise ValueError(f"an image set needs at least 2 examples, one for the 'train' split and "
                         f"one for 'val', got num_examples={num_examples}; add examples")
    return min(max(1, held_out_count(num_examples, val_fraction)), num_examples - 1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping) arithmetic: a fixed integer hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def split_rows(num_examples: int, num_val: int, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns the (train, val) example indices, each ascending: ``num_val`` for "val".

    The ``num_val`` examples whose 64-bit hash of (``split_seed``, index) is smallest
    are held out. Plain integer arithmetic, not a numpy Generator
    (whose streams numpy does not promise to keep across versions) nor Python's
    `hash` (salted per process): every process and every rerun gets the same split.

    Example:
      >>> [rows.tolist() for rows in split_rows(6, 2, 0)]
      [[0, 2, 3, 5], [1, 4]]
    """
    # int(): a numpy int (which check_seed accepts) & 2**64-1 overflows int64 under NumPy 2.
    seed_key = _splitmix64(np.array([int(split_seed) & _MASK64], dtype=np.uint64))
    keys = _splitmix64(np.arange(num_examples, dtype=np.uint64) ^ seed_key)
    order = np.argsort(keys, kind="stable")
    return np.sort(order[num_val:]), np.sort(order[:num_val])


class ImageDataset:
    """Image batches ``{"images": float32 [B,H,W,C], "labels": int32 [B]}``.

    Uses the same epoch-aware, seeded order as `TokenDataset`. The "val" split is
    ``val_fraction`` of the examples, at least one and never all of them
    (`_val_size`), drawn by a seeded shuffle (`split_rows`) rather than taken
    from the end: a file sorted by class would otherwise hold out one class.
    The split depends only on ``split_seed`` and the number of examples, not on
    ``seed`` (the batch order) nor on the numpy version or the process, so the
    "train" and "val" datasets of one file are disjoint, cover it, and are the
    same on every host and every rerun. Each split keeps its examples in file
    order.

    Args:
      images: [N, H, W, C] uint8 or float.
      labels: [N] integer class ids.
      split: "train" or "val".
      val_fraction: Share of the examples held out for "val", in (0, 1).
      seed: Seed of the batch order.
      split_seed: Seed of the train/val split; the same for both splits.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        split: str = "train",
        val_fraction: float = 0.1,
        seed: int = 0,
        split_seed: int = 0,
    ):
        # Lists too (labels are often built as one): "'list' object has no attribute 'ndim'"
        # otherwise. An ndarray, memory-mapped ones included, is kept as it is, uncopied.
        images = images if isinstance(images, np.ndarray) else np.asarray(images)
        labels = np.asarray(labels)
        check_image_arrays(images, labels)
        check_seed(seed)
        check_seed(split_seed, "split_seed")
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; legal values: {SPLITS}")
        # The int32 cast below would wrap a larger id (2**32 + 4) round into another class.
        _check_range(labels, np.iinfo(np.int32).min, np.iinfo(np.int32).max + 1, "labels",
                     "labels must fit int32")
        num_val = _val_size(len(labels), val_fraction)
        train_rows, val_rows = split_rows(len(labels), num_val, split_seed)
        rows = train_rows if split == "train" else val_rows
        self.rows = rows  # which examples of `images` this split holds, ascending
        # Not images[rows]: that copy would read a memory-mapped image array whole into RAM.
        self._all_images, self.labels = images, labels[rows].astype(np.int32)
        self.split, self.seed = split, seed

    @property
    def images(self) -> np.ndarray:
        """This split's images, as stored (a copy, gathered on each access)."""
        return self._all_images[self.rows]

    @property
    def num_examples(self) -> int:
        return len(self.labels)

    def num_batches_per_epoch(self, batch_size: int) -> int:
        check_positive_int("batch_size", batch_size)
        return max(1, self.num_examples // batch_size)

    def batch(self, step: int, batch_size: int, *, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Returns batch ``step`` (uint8 images scaled to [0, 1])."""
        items, _ = batch_indices(step, batch_size, self.num_examples, self.seed, rows)
        images = self._all_images[self.rows[items]]
        if images.dtype == np.uint8:
            images = images.astype(np.float32) / np.float32(255.0)
        return {"images": images.astype(np.float32), "labels": self.labels[items]}
