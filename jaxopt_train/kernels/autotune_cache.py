"""The autotune cache: one JSON file of tuned matmul configs, read by `matmul` and written
by `autotune` (see `jaxopt_train.kernels.autotune` for what the keys mean).

The file is shared by processes (a lock and an atomic replace on write, a re-read before
each merge) and by versions (an entry that is not a valid config is skipped with a
warning); a file that cannot be parsed is moved aside, never overwritten. A file that
cannot be read at all (no permission, a folder in its place) is left as it is: lookups
ignore it, stores raise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import time

import jax
import jax.numpy as jnp

from jaxopt_train._checks import is_int
from jaxopt_train._replace import replace_text
from jaxopt_train.kernels.configs import MatmulConfig

# The autotuner's logger: the name users filter its messages by.
logger = logging.getLogger("jaxopt_train.kernels.autotune")

_loaded: dict[str, dict] = {}  # cache path -> its parsed contents (read once per process)


def cache_path() -> pathlib.Path:
    """The cache file: under `$JAXOPT_TRAIN_CACHE_DIR` (a leading `~` expanded) if set,
    else `~/.cache/jaxopt_train`.

    Raises:
        RuntimeError: when `~` cannot be resolved (no $HOME and no password entry, as in
            some containers), naming the variable that fixes it.
    """
    root = os.environ.get("JAXOPT_TRAIN_CACHE_DIR") or "~/.cache/jaxopt_train"
    try:
        # Unexpanded, "~/x" made a folder literally named "~" in the working directory.
        folder = pathlib.Path(root).expanduser()
    except RuntimeError as err:
        raise RuntimeError(f"the autotune cache folder {root!r} names a home directory that "
                           f"cannot be resolved ({err}); set $JAXOPT_TRAIN_CACHE_DIR to an "
                           f"absolute folder") from err
    return folder / "matmul_autotune.json"


def shape_bucket(m: int, n: int, k: int) -> str:
    """Rounds each dim up to a power of two: (1000, 777, 513) -> 'm1024_n1024_k1024'."""
    up = [1 << max(0, int(x - 1).bit_length()) for x in (m, n, k)]
    return f"m{up[0]}_n{up[1]}_k{up[2]}"


TRANSPOSED = (None, "a", "b")  # A @ B, A^T @ B (a stored K x M), A @ B^T (b stored N x K)


def _check_transposed(transposed) -> None:
    if transposed not in TRANSPOSED:
        raise ValueError(f"transposed={transposed!r} must be one of {TRANSPOSED}")


def cache_key(backend: str, device_kind: str, m: int, n: int, k: int, dtype,
              transposed: str | None = None, exact: bool = False) -> str:
    """The cache entry's name, for the shape's bucket ('m1024_n1024_k1024') or, with
    `exact`, for the shape itself ('1000x777x513'); plain products keep the key they
    had before layouts."""
    _check_transposed(transposed)
    parts = [device_kind, f"jax{jax.__version__}", backend, str(jnp.dtype(dtype)),
             f"{m}x{n}x{k}" if exact else shape_bucket(m, n, k)]
    if transposed is not None:
        parts.append(f"{transposed}T")
    return "|".join(parts)


def _parse(path: pathlib.Path) -> tuple[dict, str | None]:
    """The cache file's entries, and why its content is unusable (None when it is usable).
    A missing file is an empty cache; content that is not a JSON object is unusable.

    Raises:
        OSError: when the file cannot be read (no permission, a folder): that says nothing
            about its content, so it is not to be moved aside as corrupt.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    # ValueError: bad JSON or bytes that are not UTF-8; RecursionError: JSON nested too deep.
    except (ValueError, RecursionError) as err:
        return {}, f"{type(err).__name__}: {err}"
    if not isinstance(data, dict):
        return {}, f"expected a JSON object of entries, got a JSON {type(data).__name__}"
    return data, None


def _read(path: pathlib.Path) -> dict:
    key = str(path)
    if key not in _loaded:
        try:
            data, problem = _parse(path)
        except OSError as err:
            logger.warning("cannot read the autotune cache %s (%s: %s); the shipped defaults "
                           "apply", path, type(err).__name__, err)
            data, problem = {}, None
        if problem is not None:
            logger.warning("ignoring the corrupt autotune cache %s (%s); the shipped defaults "
                           "apply, and the next autotune run moves it aside", path, problem)
        _loaded[key] = data
    return _loaded[key]


def lookup(backend: str, device_kind: str, m: int, n: int, k: int, dtype,
           transposed: str | None = None) -> MatmulConfig | None:
    """The cached winner for this problem in this operand layout (tuned on this exact
    shape if it was, else on its bucket), or None. An entry that is not a valid config
    (hand-edited, or written by a version with other fields) is skipped with a warning.
    Without a resolvable cache folder there is no cached entry: matmul runs on the
    shipped defaults instead of every call raising."""
    try:
        path = cache_path()
    except RuntimeError as err:
        logger.debug("no autotune cache to read: %s", err)
        return None
    data = _read(path)
    for exact in (True, False):
        name = cache_key(backend, device_kind, m, n, k, dtype, transposed, exact=exact)
        entry = data.get(name)
        if entry is None:
            continue
        try:
            return MatmulConfig.from_dict(entry["config"])
        except (KeyError, TypeError, ValueError) as err:
            logger.warning("autotune cache %s: skipping entry %r, not a valid config (%s: %s)",
                           path, name, type(err).__name__, err)
    return None


def xla_is_faster(backend: str, device_kind: str, m: int, n: int, k: int, dtype,
                  transposed: str | None = None) -> bool:
    """Whether `autotune` timed XLA's dot faster than its best `backend` config on this
    exact shape and layout (its `xla_seconds` below its `seconds`). Only the exact shape
    counts: a bucket holds one neighbour's timings, and on Hopper the kernel's ratio to XLA
    moves by 0.1-0.3x between shapes of one bucket (BENCHMARKS.md, thirty-second session).
    Entries written without XLA's time (before it was measured, or by `store` without
    it) say nothing, so the kernel runs."""
    seconds, xla_seconds = lookup_timings(backend, device_kind, m, n, k, dtype, transposed)
    return seconds is not None and xla_seconds is not None and speed_against_xla(
        seconds, xla_seconds) < 1


def speed_against_xla(seconds: float, xla_seconds: float) -> float:
    """A winner's speed as a multiple of XLA's dot's (below 1: XLA's dot is faster there)."""
    return xla_seconds / seconds if seconds > 0 else float("inf")


def lookup_timings(backend: str, device_kind: str, m: int, n: int, k: int, dtype,
                   transposed: str | None = None) -> tuple[float | None, float | None]:
    """(the winner's seconds, XLA's dot's seconds) cached for this exact shape and layout;
    None for each that is missing or not a number >= 0 (a hand-edited entry)."""
    try:
        path = cache_path()
    except RuntimeError:
        return None, None
    entry = _read(path).get(cache_key(backend, device_kind, m, n, k, dtype, transposed, exact=True))
    if not isinstance(entry, dict):
        return None, None

    def seconds(name):
        value = entry.get(name)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and 0 <= value < float("inf"))
        return float(value) if ok else None

    return seconds("seconds"), seconds("xla_seconds")


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """Holds an exclusive lock on `path`'s lock file, so that two processes storing
    winners at once (two GPUs tuning, two CLI runs) both keep theirs. POSIX only; elsewhere
    no lock (the last writer wins, as before)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    try:
        # Opened for writing where possible: NFS emulates flock with byte-range locks,
        # whose exclusive kind needs a writable descriptor.
        lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        # A lock file another user left read-only: on a local disk flock takes a read-only
        # descriptor, and the lock file's content is never used.
        lock = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)


def check_cache_writable(*, instead: str | None = "pass write_cache=False") -> pathlib.Path:
    """The cache file, after checking that `store` could write it: checked before tuning,
    so that a sweep's results are not lost after it has run. It does what `store` does,
    on a scratch file: takes the lock, reads the cache, writes a temporary file in the
    folder and renames it over another, then removes it.

    Args:
        instead: the other way out the error offers, after setting
            $JAXOPT_TRAIN_CACHE_DIR (None: no other); the CLI has no `write_cache`.

    Raises:
        OSError: when a store would fail, saying why and what to do.
    """
    alternative = "" if instead is None else f", or {instead}"
    try:
        path = cache_path()
    except RuntimeError as err:
        raise OSError(f"{err}{alternative}") from err
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            _parse(path)  # unusable content is moved aside by store; an unreadable file is not
            scratch = path.with_name(f".write_check{os.getpid()}")
            replace_text(scratch, "")  # exists only once the rename has worked
            scratch.unlink()
    except OSError as err:
        raise OSError(f"winners could not be stored in the autotune cache {str(path)!r} "
                      f"({type(err).__name__}: {err}); set $JAXOPT_TRAIN_CACHE_DIR to a writable "
                      f"folder{alternative}") from err
    return path


def _unused_name(path: pathlib.Path) -> pathlib.Path:
    """`path`, or `path-1`, `path-2`, ...: the first that does not exist. Called under the
    cache lock: two corrupt files moved aside in one second each keep their own name."""
    candidate, counter = path, 0
    while candidate.exists():
        counter += 1
        candidate = path.with_name(f"{path.name}-{counter}")
    return candidate


def _dims(m, n, k) -> tuple[int, int, int]:
    """(m, n, k) as Python ints (JSON cannot write numpy's), each checked positive."""
    if any(not is_int(d) or d < 1 for d in (m, n, k)):
        raise ValueError(f"m, n, k must be positive ints (numpy ints are taken); got "
                         f"{(m, n, k)=}")
    return int(m), int(n), int(k)


def store(backend: str, device_kind: str, m: int, n: int, k: int, dtype, config: MatmulConfig,
          seconds: float, transposed: str | None = None, xla_seconds: float | None = None) -> None:
    """Adds one winner to the cache file, under its exact shape and its bucket (atomic
    rename; other entries kept, except an earlier winner of the bucket). `xla_seconds`,
    XLA's dot timed beside the winner, is kept with it: where it is the smaller,
    `matmul(backend="auto")` runs XLA's dot on that exact shape (`xla_is_faster`).

    The file is re-read under a lock before the merge, so entries another process stored
    since this one read it are kept. A file whose content cannot be parsed is not
    overwritten: it is renamed to `<name>.corrupt-<time>[-<n>]` (with a warning) and a new
    one is started. A file that cannot be read is left as it is.

    Raises:
        ValueError: when m, n or k is not a positive int (numpy ints are taken).
        RuntimeError: when the cache folder cannot be resolved (see `cache_path`).
        OSError: when the cache cannot be read (naming it) or written; the temporary file
            of a failed write is removed.
    """
    m, n, k = _dims(m, n, k)
    path = cache_path()
    entry = {"config": config.to_dict(), "seconds": float(seconds), "shape": [m, n, k],
             "transposed": transposed}
    if xla_seconds is not None:
        entry["xla_seconds"] = float(xla_seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        try:
            data, problem = _parse(path)
        except OSError as err:
            raise OSError(f"cannot read the autotune cache {str(path)!r} to add a winner to it "
                          f"({type(err).__name__}: {err}); it was left as it is: make it a "
                          f"readable file, or set $JAXOPT_TRAIN_CACHE_DIR to another "
                          f"folder") from err
        if problem is not None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            kept = _unused_name(path.with_name(f"{path.name}.corrupt-{stamp}"))
            path.replace(kept)
            logger.warning("autotune cache %s was corrupt (%s); moved it to %s and started "
                           "a new one", path, problem, kept)
        for exact in (True, False):
            data[cache_key(backend, device_kind, m, n, k, dtype, transposed, exact)] = entry
        # Synced before the rename: without it a power loss soon after could leave the new
        # name on an empty file, and the next load would move the cache aside as corrupt,
        # losing every earlier winner with it.
        replace_text(path, json.dumps(data, indent=1, sort_keys=True), sync=True)
    _loaded[str(path)] = data
