"""Token streams: pre-tokenised ``.bin`` files and packed next-token batches."""

from __future__ import annotations

import os

import numpy as np

from jaxopt_train.data._files import regular_file
from jaxopt_train.data.sampling import batch_indices, check_positive_int, check_seed, held_out_count

TOKEN_FILE_DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")


def load_token_file(path: str | os.PathLike, dtype: str | np.dtype = "uint16") -> np.memmap:
    """Memory-maps a pre-tokenised file in nanoGPT layout (raw little-endian ids, no header).

    Args:
      path: The ``.bin`` file, e.g. nanoGPT's ``train.bin``.
      dtype: "uint16" (vocab <= 65536, nanoGPT's default) or "uint32".

    Raises:
      FileNotFoundError: no such file.
      ValueError: a folder or other non-regular file, a text file (`_refuse_text`), an
        illegal dtype, a file size that is not a whole number of tokens, or ids whose layout
        says the file holds the other width (`check_token_width`).
    """
    name = np.dtype(dtype).name if _is_dtype_like(dtype) else repr(dtype)
    if name not in TOKEN_FILE_DTYPES:
        raise ValueError(f"dtype={dtype!r} for a token file; legal values: {TOKEN_FILE_DTYPES}")
    if np.dtype(dtype).byteorder == ">":
        # The file is read little-endian (nanoGPT's layout): a big-endian request would
        # otherwise be dropped and its ids silently read as other ids.
        raise ValueError(f"dtype={dtype!r} is big-endian; token files are little-endian: "
                         f"pass {name!r}, or convert the file")
    path = regular_file(path, "token file", "a .bin file of token ids, which is memory-mapped",
                        folder_expected="a .bin file of token ids (e.g. nanoGPT's train.bin "
                        "inside it)")
    size = path.stat().st_size
    itemsize = np.dtype(name).itemsize
    if size == 0:
        raise ValueError(f"token file {str(path)!r} is empty")
    _refuse_text(path)
    if size % itemsize:
        raise ValueError(
            f"token file {str(path)!r} has {size} bytes, not a multiple of {itemsize} "
            f"(dtype={name}); was it written with another dtype?"
        )
    tokens = np.memmap(path, dtype=np.dtype(name).newbyteorder("<"), mode="r")
    check_token_width(tokens, str(path))
    return tokens


# Printable ASCII and the whitespace of text files: text is almost all such bytes, token ids
# far from it (GPT-2's vocabulary: ~15% of a Zipf stream's bytes, ~44% of uniform ids).
_TEXT_BYTES = np.zeros(256, bool)
_TEXT_BYTES[0x20:0x7F] = _TEXT_BYTES[[0x09, 0x0A, 0x0D]] = True
_TEXT_SAMPLE, _TEXT_SHARE = 1 << 16, 0.99


def _refuse_text(path) -> None:
    """A text file named .bin was read as token ids: the error then asked for a vocabulary
    of ~30,000 (`--model vocab_size=29817`) for what is ASCII."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(_TEXT_SAMPLE), np.uint8)
    if head.size >= 256 and _TEXT_BYTES[head].mean() >= _TEXT_SHARE:
        raise ValueError(f"token file {str(path)!r} holds text ({_TEXT_BYTES[head].mean():.0%} of "
                         f"its first {head.size:,} bytes are printable ASCII), not token ids; "
                         "give it a text file's name (e.g. .txt) to train on its bytes, or "
                         "tokenise it into a .bin")


# The raw file has no header, so a width mismatch reads without error as other ids.
# The first _WIDTH_SAMPLE ids are enough to tell: 1 M ids cost ~2-4 ms to scan.
_WIDTH_SAMPLE = 1 << 20
_MIN_PAIRS = 64  # below this, a run of zeros in a real uint16 file is not rare enough
_IMPLAUSIBLE_ID = 1 << 24  # no tokenizer has 16.7 M tokens; uint16 pairs read as uint32 exceed it
# Distinct high 16-bit halves from which uint32 ids look paired: a real vocabulary of under
# 2^18 ids has at most 4 (Gemma's 262,144), and a stream of 4 symbols (DNA) read paired has 4.
_PAIRED_HIGH_VALUES = 4
# uint32 ids past 65535 read as uint16 alternate (low half, high half): a high half below 256
# (ids < 2^24) with few distinct values against the low halves' many. A real uint16 stream's
# even and odd words are draws from one distribution, with about as many distinct values.
_SPLIT_LOW_PER_HIGH = 8


def check_token_width(tokens: np.ndarray, source: str = "tokens") -> None:
    """Refuses ids that were written with the other width of `TOKEN_FILE_DTYPES`.

    uint32 ids below 65536 read as uint16 come out as (id, 0, id, 0, ...): every second
    16-bit word is zero; larger ids (Llama 3's 128,256) as (low half, high half), every
    second word below 256 with a few distinct values where the others have many. uint16
    ids read as uint32 pair two ids into one, id_0 + 65536 * id_1, which lands past 2^24 as soon as an id_1 is 256 or more.
    Both are checked on the first 2^20 ids. A small vocabulary (characters, ids < 256)
    stays below 2^24 when paired; its pairs show instead as high 16-bit halves that take
    as many distinct values as the low halves (the same stream, shifted by one), where a
    real uint32 vocabulary's high halves take a few (0..3 for 262,144 ids).
    """
    sample = np.asarray(tokens[:_WIDTH_SAMPLE])
    if sample.dtype == np.uint16:
        pairs = sample[:sample.size // 2 * 2].reshape(-1, 2)
        if pairs.shape[0] >= _MIN_PAIRS and not pairs[:, 1].any() and pairs[:, 0].any():
            raise ValueError(
                f"{source}: every second 16-bit word of the first {2 * pairs.shape[0]:,} is 0, "
                "the layout of uint32 ids read as uint16; load it with dtype='uint32' "
                "(jaxopt-train train: --token-dtype uint32)")
        if pairs.shape[0] >= _MIN_PAIRS and int(pairs[:, 1].max()) < 256:
            high, low = np.unique(pairs[:, 1]).size, np.unique(pairs[:, 0]).size
            if low >= _SPLIT_LOW_PER_HIGH * high:
                raise ValueError(
                    f"{source}: every second 16-bit word of the first {2 * pairs.shape[0]:,} is "
                    f"below 256 and takes {high} distinct values against {low} in the others, "
                    "the layout of uint32 ids (a vocabulary past 65,536, below 2^24) read as "
                    "uint16; load it with dtype='uint32' (jaxopt-train train: --token-dtype "
                    "uint32)")
    elif sample.dtype == np.uint32 and sample.size:
        largest = int(sample.max())
        if largest >= _IMPLAUSIBLE_ID:
            raise ValueError(
                f"{source}: id {largest:,} among the first {sample.size:,} read as uint32, past "
                f"any tokenizer's vocabulary (2^24 = {_IMPLAUSIBLE_ID:,}): the layout of uint16 "
                "ids read two at a time; load it with dtype='uint16' "
                "(jaxopt-train train: --token-dtype uint16)")
        high, low = np.unique(sample >> 16).size, np.unique(sample & 0xFFFF).size
        if sample.size >= 2 * _MIN_PAIRS and high >= _PAIRED_HIGH_VALUES and 2 * high >= low:
            raise ValueError(
                f"{source}: the first {sample.size:,} ids read as uint32 have {high} distinct high "
                f"16-bit halves and {low} distinct low ones, the layout of uint16 ids read two at "
                "a time (a real uint32 vocabulary's ids differ in their low halves); load it "
                "with dtype='uint16' (jaxopt-train train: --token-dtype uint16)")


def max_token_id(tokens: np.ndarray, chunk_size: int = 1 << 24) -> int:
    """The largest id in a 1-D token array, read ``chunk_size`` tokens at a time.

    Chunked so that a memory-mapped file of billions of tokens is scanned with
    bounded memory (a plain ``np.max`` would page the whole file into RAM at once
    and, on some numpy versions, allocate a full-size temporary).
    """
    check_positive_int("chunk_size", chunk_size)
    # asarray: a list raised "'list' object has no attribute 'ndim'" (a memmap stays unread).
    # Integers only: float ids were floored by int() into a vocab size that looked right.
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D integer array, got shape={tokens.shape} "
                         f"dtype={tokens.dtype}")
    return max(int(np.max(tokens[i:i + chunk_size])) for i in range(0, tokens.size, chunk_size))


def _is_dtype_like(value) -> bool:
    try:
        np.dtype(value)
    except TypeError:
        return False
    return True


class TokenDataset:
    """Packed next-token batches from a 1-D token array, in a resumable order.

    The split's tokens are cut into ``num_sequences = (n - 1) // seq_len``
    windows of ``seq_len + 1`` tokens (consecutive windows overlap by the one
    target token); each epoch shifts all windows by a seeded offset within
    the leftover tokens and visits them in a seeded permutation.
    ``inputs = x[i : i + T]``, ``targets = x[i + 1 : i + T + 1]``.

    The first ``1 - val_fraction`` of the tokens are "train", the rest "val".

    Example:
      >>> ds = TokenDataset(np.arange(1000) % 256, seq_len=8)
      >>> b = ds.batch(0, batch_size=4)
      >>> b["inputs"].shape, b["targets"].dtype
      ((4, 8), dtype('int32'))
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        split: str = "train",
        val_fraction: float = 0.05,
        seed: int = 0,
    ):
        tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got shape={tokens.shape} dtype={tokens.dtype}"
            )
        check_positive_int("seq_len", seq_len)
        # A Python int: np.int8(127) + 1 wrapped to -128 (empty windows, no error) and a
        # np.uint64 length made the window indices float64 (an IndexError at the first batch).
        seq_len = int(seq_len)
        check_seed(seed)
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; legal values: {SPLITS}")
        num_val = held_out_count(tokens.size, val_fraction)
        self.tokens = tokens[: tokens.size - num_val] if split == "train" else tokens[tokens.size - num_val :]
        if self.tokens.size < seq_len + 1:
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens in the {split!r} split, "
                f"which has {self.tokens.size} (of {tokens.size}, val_fraction={val_fraction}); "
                "use a shorter seq_len or more data"
            )
        self.seq_len, self.split, self.seed = seq_len, split, seed
        self.num_sequences = (self.tokens.size - 1) // seq_len
        self._slack = self.tokens.size - 1 - self.num_sequences * seq_len

    def num_batches_per_epoch(self, batch_size: int) -> int:
        """Whole batches in one pass over the split (at least 1)."""
        check_positive_int("batch_size", batch_size)
        return max(1, self.num_sequences // batch_size)

    def batch(self, step: int, batch_size: int, *, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Returns batch ``step`` as ``{"inputs", "targets"}`` int32 [B, seq_len].

        Args:
          step: Batch number; the same step always gives the same batch.
          batch_size: The global batch size.
          rows: Only these rows of the global batch (see `process_batch_slice`).

        Raises:
          ValueError: for a token id in the batch outside [0, 2**31) (the int32 cast would
            turn it into another id).
        """
        items, epochs = batch_indices(step, batch_size, self.num_sequences, self.seed, rows)
        # One shift per epoch in the batch (one or two), not per row: each is a seeded
        # generator, ~27 us apiece, 14 of the 21 ms of a 512-row batch.
        unique, where = np.unique(epochs, return_inverse=True)
        shifts = np.array([self._epoch_shift(int(e)) for e in unique], dtype=np.int64)[where]
        starts = items * self.seq_len + shifts
        window = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)])
        _check_int32_ids(window, step)
        window = window.astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}

    def _epoch_shift(self, epoch: int) -> int:
        if self._slack == 0:
            return 0
        return int(np.random.default_rng([self.seed, epoch, 1]).integers(0, self._slack + 1))


def _check_int32_ids(window: np.ndarray, step: int) -> None:
    """Refuses ids the int32 batch cannot hold: the cast would wrap them into other ids.

    Checked per batch (B * (T + 1) ids), not over the whole array up front: a token file
    of billions of ids would cost a full scan. uint8/uint16 ids always fit, so they skip it.
    """
    if np.can_cast(window.dtype, np.int32) and not np.issubdtype(window.dtype, np.signedinteger):
        return
    bad = (window < 0) | (window > np.iinfo(np.int32).max)
    if bad.any():
        raise ValueError(
            f"token id {window[bad][0]} in batch step={step} (dtype {window.dtype}) does not fit "
            "a batch: batches hold int32 ids in [0, 2**31), and a cast would turn it into "
            "another id; drop or remap such ids (e.g. a -1 separator) before building the dataset")
