"""Byte-level text corpora: the embedded default and the user's text files.

The default corpus is the running interpreter's own standard library
(``sysconfig.get_paths()["stdlib"]``, every ``*.py`` file): real text that
every machine has, so `jaxopt-train train` needs no download. The file list
is sorted (deterministic across runs and machines with the same Python), and
``site-packages``, ``test``/``tests``, ``idlelib`` and ``__pycache__`` folders
are skipped: installed packages differ between machines and the test suites
are half the stdlib with repetitive fixture data. Python 3.11/3.12 give
about 10 MiB; this corpus is capped at ``max_bytes`` (16 MiB by default).

Tokens are bytes (vocab 256), so the corpus *is* the token array.
"""

from __future__ import annotations

import collections
import os
import pathlib
import sys
import sysconfig

import numpy as np

from jaxopt_train._checks import is_int
from jaxopt_train.data.sampling import check_positive_int, check_seed

DEFAULT_MAX_BYTES = 16 * 2**20
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Returns the sorted ``*.py`` files of the stdlib (or of ``root``), skipping test dirs."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    # os.walk is silent about both: a typo'd root, or a file, gave [] without a word.
    if not root.exists():
        raise FileNotFoundError(f"root={str(root)!r} does not exist; expected a folder of *.py files")
    if not root.is_dir():
        raise NotADirectoryError(f"root={str(root)!r} is not a folder; expected a folder of *.py files")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages (10x the files).
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        files.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


def _is_binary(file: pathlib.Path) -> bool:
    """A NUL byte in the first 8 KiB (git's test): bytecode, images, archives, not text."""
    with open(file, "rb") as f:
        return b"\0" in f.read(8192)


# The first bytes of compressed files: a byte-level model would learn the compressor's output.
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
                     b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}


def _refuse_compressed(file: pathlib.Path) -> None:
    """A single file is read as given, binary or not, except a compressed one: its bytes are
    never the text it holds (`--data corpus.txt.gz` trained on gzip's output)."""
    with open(file, "rb") as f:
        head = f.read(8)
    kind = next((name for magic, name in _COMPRESSED_MAGIC.items() if head.startswith(magic)), None)
    if kind is not None:
        raise ValueError(f"text corpus path={str(file)!r} is {kind}-compressed; expected the text "
                         "itself: decompress it first and pass that file")


def _text_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The file itself, or a folder's text files, skipping hidden ones and ``__pycache__``."""
    if not path.exists():
        raise FileNotFoundError(f"text corpus path={str(path)!r} does not exist")
    if path.is_file():
        _refuse_compressed(path)
        return [path]
    if not path.is_dir():  # a pipe (--data <(zcat ...)) was walked as a folder: "empty (0 files)"
        raise ValueError(f"text corpus path={str(path)!r} is neither a regular file nor a folder "
                         "(a pipe or device?); save the text to a file and pass that")
    files = sorted(
        p for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                   for part in p.relative_to(path).parts)
    )
    _refuse_token_files(path, files)
    text = [p for p in files if not _is_binary(p)]
    if files and not text:  # else reported as "empty (0 files, 0 bytes)"
        raise ValueError(f"text corpus folder path={str(path)!r} holds only binary files "
                         f"({len(files)}: a NUL byte in their first 8 KiB: images, archives, "
                         "bytecode) and no text; give a folder with text files, or name one "
                         "file to read its bytes as they are")
    return text


def _refuse_token_files(folder: pathlib.Path, files: list[pathlib.Path]) -> None:
    """Refuses a folder that holds ``.bin`` files, whatever else it holds.

    ``.bin`` is what ``--data`` reads as token ids (nanoGPT's ``train.bin`` /
    ``val.bin``), so a folder holding them is almost surely a token data set
    given by its folder. Read as text, the tokens would be skipped as binary
    (or, with no NUL byte, read as bytes) and the run would train on whatever
    text sits beside them, such as ``prepare.py``. Refusing on the extension
    alone, not on how much text is left, keeps the rule one a user can predict;
    other binary files (images, archives) are still skipped as before.
    """
    token_files = [p for p in files if p.suffix.lower() == ".bin"]
    if not token_files:
        return
    names = [str(p.relative_to(folder)) for p in token_files]
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    example = next((p for p in token_files if p.name.lower() == "train.bin"), token_files[0])
    raise ValueError(
        f"text corpus folder path={str(folder)!r} holds .bin token files ({shown}), which are "
        f"token ids, not text; to train on them pass the file itself: --data {example} "
        "(or load_token_file); to train on the folder's text, move the .bin files out of it"
    )


def _read_concatenated(files: list[pathlib.Path], max_bytes: int) -> np.ndarray:
    chunks, total = [], 0
    for file in files:
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    corpus.setflags(write=False)  # Shared by the cache: nobody may mutate it.
    return corpus


def _file_signature(path: str) -> tuple:
    """Size and modification time of the file, or of every file under the folder.

    Part of the cache key: keyed by path alone, a corpus rewritten in the same process
    (a notebook editing its data) was served from the cache as the old text.
    """
    root = pathlib.Path(path)
    if not root.exists():
        return ()  # _text_files reports it
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)


# (path, max_bytes) -> (signature, corpus), least recently used first. Keyed without the
# signature: an lru_cache keyed with it kept every stale version of an edited corpus
# (up to 8 copies of a corpus read whole) although none could ever be served again.
_CORPUS_CACHE: collections.OrderedDict[tuple, tuple[tuple, np.ndarray]] = collections.OrderedDict()
_CORPUS_CACHE_SIZE = 8


def _cached_corpus(path: str | None, max_bytes: int, signature: tuple) -> np.ndarray:
    key = (path, max_bytes)
    cached = _CORPUS_CACHE.pop(key, None)
    if cached is None or cached[0] != signature:
        cached = (signature, _read_corpus(path, max_bytes))
    _CORPUS_CACHE[key] = cached
    while len(_CORPUS_CACHE) > _CORPUS_CACHE_SIZE:
        _CORPUS_CACHE.popitem(last=False)
    return cached[1]


def _read_corpus(path: str | None, max_bytes: int) -> np.ndarray:
    files = stdlib_source_files() if path is None else _text_files(pathlib.Path(path))
    corpus = _read_concatenated(files, max_bytes)
    if corpus.size == 0:
        where = "the stdlib" if path is None else f"path={path!r}"
        raise ValueError(
            f"text corpus from {where} is empty ({len(files)} files, 0 bytes); "
            "give a file or folder with some text"
        )
    return corpus


def load_text_corpus(
    path: str | os.PathLike | None = None, *, max_bytes: int | None = None
) -> np.ndarray:
    """Loads a byte-level corpus as a read-only uint8 array (cached per process).

    Args:
      path: A text file, or a folder whose non-hidden text files are read in
        sorted order and concatenated (``__pycache__`` folders and binary files,
        those with a NUL byte in their first 8 KiB, are skipped; a folder with
        ``.bin`` token files is refused). None: the stdlib sources (see module doc).
      max_bytes: Keep only the first ``max_bytes`` bytes. None: the stdlib corpus is
        capped at `DEFAULT_MAX_BYTES`, a ``path`` is read whole (the user's corpus, all
        of it: a cap there would quietly drop the rest and take "val" from its middle).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: ``path`` is an empty string, the corpus is empty, a folder holds ``.bin``
        token files, or ``max_bytes`` is not positive.
    """
    if max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES if path is None else sys.maxsize
    # numpy ints count (as everywhere in jaxopt_train.data); True is not 1 byte.
    if not is_int(max_bytes) or max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive int or None")
    max_bytes = int(max_bytes)
    if isinstance(path, str) and not path:
        # pathlib.Path("") is ".": an unset variable passed as the path trained on whatever
        # text sat in the working directory.
        raise ValueError(f"path={path!r} is empty; give a text file or folder, or None for the "
                         "embedded stdlib corpus")
    key = None if path is None else str(pathlib.Path(path).resolve())
    return _cached_corpus(key, max_bytes, () if key is None else _file_signature(key))


def corpus_lm_batch(batch_size: int, seq_len: int, *, seed: int = 0,
                    path: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """Windows of a byte corpus at random offsets, as ``{"inputs", "targets"}`` int32 [B, T].

    What `synthetic_lm_batch` gives, with real text's id frequencies (bytes: ids < 256):
    a benchmark on uniform random ids never sees a cost that follows them, such as the
    gradient of a frequent token's embedding row (models/embedding.py).

    Args:
      batch_size, seq_len: the batch shape; targets are the inputs shifted by one.
      seed: offsets are drawn from ``numpy.random.default_rng(seed)``.
      path: as `load_text_corpus` (None: the embedded stdlib corpus).

    Raises:
      ValueError: non-positive sizes, a bad seed, or a corpus of ``seq_len`` bytes or fewer.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        check_positive_int(name, value)
    check_seed(seed)
    seq_len = int(seq_len)  # a np.uint64 length made the window indices float64 (IndexError)
    corpus = load_text_corpus(path)
    if corpus.size <= seq_len:
        raise ValueError(f"the corpus has {corpus.size:,} bytes; a window of seq_len={seq_len} needs "
                         f"at least {seq_len + 1:,}")
    starts = np.random.default_rng(seed).integers(0, corpus.size - seq_len, batch_size)
    window = corpus[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}
