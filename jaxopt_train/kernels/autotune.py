"""Autotuning: sweep tilings, verify each against the reference, time, cache the winner.

The cache is one JSON file (default `~/.cache/jaxopt_train/matmul_autotune.json`,
directory overridable with `$JAXOPT_TRAIN_CACHE_DIR`) mapping
"device kind | jax version | backend | dtype | shape bucket [| operand layout]" to a
config. Shape buckets round each of M, N, K up to a power of two, so one tuning
run serves the nearby shapes a model produces. Each winner is also kept under its
exact shape, which a lookup tries first: two tuned shapes of one bucket (1024^3 and
1000x777x513, say) each keep their own winner, and the bucket holds the last one
tuned for the shapes nobody tuned. A product that reads A^T or B^T as
stored (the backward of every dense layer, a tied LM head) is tuned and looked up
under its own layout: on an H200 the winners of plain A @ B made gpt-1b's step
slower when applied to its transposed products (BENCHMARKS.md, sixth session).
`matmul(..., config=None)` reads the cache first, then the shipped defaults in
`configs.py`.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The cache's names are re-exported: `autotune.lookup`, `.store`, ... are public here.
from jaxopt_train._checks import is_int
from jaxopt_train.kernels.autotune_cache import (TRANSPOSED, _check_transposed, _loaded,  # noqa: F401
                                                 cache_key, cache_path, check_cache_writable,
                                                 lookup, lookup_timings, shape_bucket,
                                                 speed_against_xla, store)
from jaxopt_train.kernels.configs import (BACKENDS, TRANSPOSING_BACKENDS, MatmulConfig,
                                          as_config, default_config, shared_memory_per_block,
                                          triton_shared_memory_bytes)
from jaxopt_train.runtime._backend import compute_capability
from jaxopt_train.runtime.memory import device_pool_limit, format_bytes

logger = logging.getLogger(__name__)

Timer = Callable[[Callable[[], jax.Array]], float]


def default_candidates(backend: str, *, quick: bool = False) -> list[MatmulConfig]:
    """The sweep for `backend`: tiles x pipeline depth x warps x tile order.

    `quick` gives a short list (about 10) of the likeliest winners.
    """
    if backend == "mosaic_gpu" and quick:
        # The shipped default first, so a spent budget still has timed it; then the
        # chained kernel's tile orders and 2-CTA clusters, then the unchained winners
        # of earlier sweeps (BENCHMARKS.md).
        chained = [MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=g,
                                grid_minor=minor, cluster=cluster, chain_tiles=True)
                   for g, minor, cluster in ((16, "n", "none"), (8, "n", "none"),
                                             (16, "m", "none"), (16, "n", "m"), (16, "n", "n"))]
        return chained + [
            # Half-height CTA tiles: the winner on small grids (sixteenth session).
            MatmulConfig(block_m=64, block_n=128, block_k=64, num_stages=4, group_m=8,
                         chain_tiles=True),
            MatmulConfig(block_m=64, block_n=256, block_k=64, num_stages=4, group_m=8,
                         chain_tiles=True),
            MatmulConfig(block_m=128, block_n=128, block_k=128, num_stages=2, group_m=16,
                         chain_tiles=True),
            MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=16),
            MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=16,
                         wgmma_in_flight=1),
            MatmulConfig(block_m=64, block_n=256, block_k=64, num_stages=4, group_m=8,
                         wgmma_in_flight=1),
        ]
    if backend == "triton" and quick:
        return [MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=s, num_warps=w)
                for bm, bn, bk, s, w in ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8),
                                         (128, 256, 64, 4, 8), (128, 128, 64, 4, 4))]
    if backend == "mosaic_gpu":
        # Chaining needs wgmma_in_flight=0 (MatmulConfig.chain_tiles), so the in-flight
        # variants run unchained; clusters are swept on the shipped tile only.
        grid = itertools.product(((128, 128, 64), (64, 256, 64)), (3, 4), (4, 8, 16), ("m", "n"),
                                 ((0, True), (0, False), (1, False)))
        tiles = [MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=s, group_m=g,
                              grid_minor=minor, wgmma_in_flight=f, chain_tiles=chain)
                 for (bm, bn, bk), s, g, minor, (f, chain) in grid]
        return tiles + [MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4,
                                     group_m=g, cluster=cluster, chain_tiles=True)
                        for g, cluster in itertools.product((8, 16), ("m", "n"))] + [
            MatmulConfig(block_m=64, block_n=128, block_k=64, num_stages=4, group_m=8,
                         chain_tiles=True)]
    if backend == "triton":
        grid = itertools.product(((128, 256, 64), (256, 128, 64), (128, 128, 64), (128, 128, 32),
                                  (64, 128, 64)), (3, 4), (4, 8))
        return [MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=s, num_warps=w)
                for (bm, bn, bk), s, w in grid if not (bm * bn >= 128 * 256 and w == 4)]
    if backend == "pallas_tpu":
        return [MatmulConfig(block_m=bm, block_n=bn, block_k=bk)
                for bm, bn, bk in ((128, 128, 128), (256, 256, 256), (512, 512, 256),
                                   (256, 512, 512))]
    if backend == "interpret":
        return [MatmulConfig(block_m=b, block_n=b, block_k=b, num_stages=1) for b in (16, 32)]
    raise ValueError(f"{backend=} has no tunable kernel; expected mosaic_gpu, triton, "
                     f"pallas_tpu or interpret")


def _fitting_candidates(backend: str, candidates: list[MatmulConfig],
                        capability: tuple[int, int]) -> list[MatmulConfig]:
    """`candidates` less the Triton tiles whose pipeline needs more shared memory than a
    block gets on a GPU of `capability` (each would only fail to compile, once per shape);
    all of them on other backends and where the limit is unknown."""
    limit = shared_memory_per_block(capability)
    if backend != "triton" or limit is None:
        return candidates
    kept = [c for c in candidates if triton_shared_memory_bytes(c, capability) <= limit]
    logger.debug("autotune triton: dropped %d of %d candidates needing more than the %d bytes "
                 "of shared memory per block of compute capability %d.%d",
                 len(candidates) - len(kept), len(candidates), limit, *capability)
    return kept


def burst_timer(fn: Callable[[], jax.Array], *, calls: int = 10, repeats: int = 3,
                warmup_s: float = 0.3) -> float:
    """Median seconds per call over `repeats` bursts of `calls` back-to-back calls.

    The first call compiles; then `fn` runs for `warmup_s` seconds before timing,
    because GPU clocks idle low and ramp up under load: without it the first
    candidates of a sweep are timed at lower clocks than the later ones.
    """
    def burst() -> float:  # one sync at the end; only the last output is kept alive
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls

    jax.block_until_ready(fn())  # compile
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        burst()
    return statistics.median(burst() for _ in range(repeats))


def rotating(fn: Callable[..., jax.Array], sets: Sequence[tuple]) -> Callable[[], jax.Array]:
    """A zero-argument call of `fn` on the next input set, so successive timed calls
    read operands that are not already in L2."""
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def _shape(shape) -> tuple:
    """One (M, N, K) of `autotune`'s `shapes` as a tuple; anything else is refused (a lone
    (M, N, K) passed for the list gets here as its first int)."""
    dims = tuple(shape) if np.iterable(shape) and not isinstance(shape, str) else None
    if dims is None or len(dims) != 3 or not all(
            is_int(d) and d >= 1 for d in dims):
        raise ValueError(f"shapes: each must be (M, N, K) of positive ints; got {shape!r} "
                         f"(shapes is a list of them, e.g. [(1024, 1024, 1024)])")
    return dims


def _given_candidates(candidates) -> list[MatmulConfig] | None:
    """`autotune`'s `candidates` as configs (dicts of fields taken, as `matmul` takes them),
    checked before the sweep: a bad one would otherwise be skipped as a kernel that fails
    to build, or be timed and then crash the cache write."""
    if candidates is None:
        return None
    if isinstance(candidates, (MatmulConfig, dict)):
        raise TypeError(f"candidates must be a list of configs; got one "
                        f"{type(candidates).__name__}: pass [config]")
    given = []
    for i, candidate in enumerate(candidates):
        if not isinstance(candidate, (MatmulConfig, dict)):
            raise TypeError(f"candidates[{i}]={candidate!r} must be a MatmulConfig or a dict "
                            f"of its fields")
        try:
            given.append(as_config(candidate))
        except ValueError as err:
            raise ValueError(f"candidates[{i}]: {err}") from err
    return given


def _seconds(timer: Timer, fn: Callable[[], jax.Array], what) -> float:
    """`timer(fn)` as a float; a NaN would win the shape (nothing compares below it).
    `what` (a config, or "XLA's dot") names the timed call in the error."""
    seconds = timer(fn)
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ValueError(f"timer returned {seconds!r} for {what}; expected a finite number "
                         f"of seconds >= 0")
    return value


def reference_tolerance(dtype) -> float:
    """The largest error, over max |reference|, that a kernel's output of input `dtype` may
    have against the f32 reference: what autotune accepts and `bench matmul` calls right."""
    return 2e-2 if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32) else 5e-3


def _check_fits_memory(shape: tuple[int, int, int], dtype, input_sets: int, device) -> None:
    """Refuses a shape whose operands and reference cannot fit where they are made: XLA
    aborted the process on 100000^3 ("Check failed: buffer_.IsConcrete()")."""
    m, n, k = (int(x) for x in shape)
    # The operand sets, one f32 draw before its cast, the f32 reference and one f32 output.
    need = input_sets * (m * k + k * n) * jnp.dtype(dtype).itemsize + max(m * k, k * n) * 4 \
        + 2 * m * n * 4
    limit, where = device_pool_limit(device), f"the {device.device_kind} memory pool"
    if limit is None:  # CPU: the operands live in this host's memory
        try:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            where = "this host's memory"
        except (AttributeError, OSError, ValueError):
            return
    if need > limit:
        raise ValueError(f"shape {m}x{n}x{k} needs ~{format_bytes(need)} for {input_sets} operand "
                         f"set(s), the reference and an output, more than {where} "
                         f"({format_bytes(limit)}); tune a smaller shape, or fewer input sets")


def autotune(shapes: Iterable[Sequence[int]], dtype=jnp.bfloat16, *, backend: str = "auto",
             candidates: Sequence[MatmulConfig | dict] | None = None, timer: Timer | None = None,
             write_cache: bool = True, seed: int = 0,
             budget_s: float | None = None, input_sets: int = 4,
             transposed: str | None = None, quick: bool = False,
             compare_xla: bool = True) -> dict[tuple[int, int, int], MatmulConfig]:
    """Finds the fastest correct config for each (M, N, K) and caches it.

    Every candidate first runs on random data and must match `matmul_reference`
    (relative max error under 2e-2 for bf16, 5e-3 for fp16); failing or
    non-compiling candidates are skipped with a warning.

    Args:
        shapes: (M, N, K) triples.
        dtype: input dtype, or its name as `matmul`'s `out_dtype` takes it ("bf16",
            "fp16", "f32", ...): bfloat16 or float16; float32 tunes bfloat16, which is
            what `matmul` runs f32 inputs as (and the cache entry it reads).
        backend: a kernel backend, or "auto".
        candidates: configs (or dicts of their fields) to sweep; default
            `default_candidates(backend, quick=quick)`, less the Triton tiles that need more
            shared memory than the device has (`configs.SHARED_MEMORY_PER_BLOCK`),
            after the shape's own default (`configs.default_config`), which is timed first
            so that a spent budget has timed it and a winner never measured slower than it.
        timer: `timer(fn) -> seconds per call`; default `burst_timer`.
        write_cache: store winners in the cache file. Whether it can be written is checked
            before the sweep; should a store still fail after it, the winners are returned
            uncached, with a warning saying why.
        budget_s: per shape: stop trying further candidates once this many
            seconds have passed on the shape (the best so far wins).
        input_sets: random operand pairs each candidate's timed calls rotate over
            (together larger than L2 on large shapes, as in `bench matmul`).
        transposed: the operand layout to tune: None for A @ B, "a" for A^T @ B with
            A stored (K, M) (a dense layer's weight gradient), "b" for A @ B^T with
            B stored (N, K) (its input gradient, a tied LM head). Winners are cached
            under that layout; only mosaic_gpu and triton read it.
        quick: sweep `default_candidates(backend, quick=True)`, about 10 configs.
        compare_xla: also time XLA's dot (`matmul(backend="xla")`, in the same layout) on
            the same input sets with the same timer, after the sweep: logged beside the
            winner, with a warning where it is faster, and cached with the winner, so that
            `matmul(backend="auto")` runs XLA's dot on a tuned shape where the kernel lost
            (as PyTorch's max-autotune keeps cuBLAS among its choices). An explicit kernel
            backend still runs the kernel, with the winning config.

    Returns:
        {(M, N, K): winning config}.

    Raises:
        RuntimeError: when no candidate passes for some shape, counting the candidates that
            failed to build or run and those that gave wrong results (chained to the last
            failure's exception).
        OSError: with `write_cache`, when the cache cannot be written (before the sweep).
    """
    # The module, not the function `jaxopt_train.kernels.matmul` re-exported over its name.
    matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")

    backend = matmul_mod.resolve_backend(backend)
    if backend == "xla":
        raise ValueError("backend resolved to 'xla', which has nothing to tune; pass a kernel backend")
    # True would pass as 1 input set.
    if not is_int(input_sets) or input_sets < 1:
        raise ValueError(f"input_sets={input_sets!r} must be an int >= 1")
    input_sets = int(input_sets)
    if budget_s is not None and (isinstance(budget_s, bool)
                                 or not isinstance(budget_s, (int, float, np.integer, np.floating))
                                 or not budget_s >= 0):
        raise ValueError(f"budget_s={budget_s!r} must be None or a number >= 0 of seconds")
    # Any other value was taken for its truth: write_cache="no" wrote the cache.
    for name, flag in (("write_cache", write_cache), ("quick", quick),
                       ("compare_xla", compare_xla)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool; got {flag!r}")
    # True was seeded as 1; 1.5 failed in jax.random.key naming a JitTracer.
    if not is_int(seed):
        raise TypeError(f"seed={seed!r} must be an int")
    if isinstance(dtype, str):  # the names matmul's out_dtype takes ("bf16", "fp16", "f32")
        dtype = matmul_mod.as_float_dtype(dtype, "dtype")
    # jnp.dtype(None) is float64: dtype=None was reported as "dtype=float64".
    try:
        resolved = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in matmul_mod.INPUT_DTYPES:
        shown = repr(dtype) if resolved is None else resolved
        raise ValueError(f"dtype={shown} is not a matmul input dtype; expected "
                         f"bfloat16, float16 or float32")
    # matmul runs f32 inputs as bf16 and looks the cache up under bf16: tune that.
    dtype = jnp.dtype(jnp.bfloat16) if resolved == jnp.float32 else resolved
    shapes = [_shape(shape) for shape in shapes]
    _check_transposed(transposed)
    if transposed is not None and backend not in TRANSPOSING_BACKENDS:
        raise ValueError(f"transposed={transposed!r} is tuned only for {TRANSPOSING_BACKENDS}, "
                         f"which read the operand as stored; {backend=} multiplies a "
                         f"transposed copy, i.e. runs the plain layout: tune that instead")
    given = _given_candidates(candidates)
    if given is not None and not given:
        raise ValueError("candidates=[] leaves nothing to time; pass None for the default "
                         "sweep, or a non-empty list of MatmulConfig")
    device = jax.devices()[0]
    device_kind, capability = device.device_kind, compute_capability(device)
    # Given candidates are swept as given: Triton's own error names a tile that does not fit.
    listed = given or _fitting_candidates(backend, default_candidates(backend, quick=quick),
                                          capability)
    for shape in shapes:
        _check_fits_memory(shape, dtype, input_sets, device)
    if write_cache:
        check_cache_writable()
    timer = timer or burst_timer
    winners = {}
    for shape in shapes:
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        m, n, k = (int(x) for x in shape)
        if given is not None:
            candidates = given
        else:
            default = default_config(backend, device_kind, m, n, k,
                                     compute_capability=capability)
            candidates = [default] + [c for c in listed if c != default]
        if transposed is not None:
            # A config that cannot read the operand as stored would time the plain kernel on
            # a transposed copy; cached as this layout's winner, the model would then run the
            # copy with the plain layout's config instead, so the time would be of nothing run.
            kept = [c for c in candidates if matmul_mod.reads_transposed_as_stored(backend, c, dtype)]
            if not kept:
                raise ValueError(f"transposed={transposed!r}: no candidate reads the operand as "
                                 f"stored on {backend=} (mosaic_gpu needs block_k * itemsize == "
                                 f"128 bytes and no warpgroup_lowering); got {candidates}")
            candidates = kept
        shape_a = (k, m) if transposed == "a" else (m, k)  # as stored
        shape_b = (n, k) if transposed == "b" else (k, n)
        keys = jax.random.split(jax.random.key(seed), 2 * input_sets)
        sets = [(jax.random.normal(keys[2 * i], shape_a, jnp.float32).astype(dtype),
                 jax.random.normal(keys[2 * i + 1], shape_b, jnp.float32).astype(dtype))
                for i in range(input_sets)]
        a, b = sets[0]
        reference = np.asarray(matmul_mod.matmul_reference(
            a.T if transposed == "a" else a, b.T if transposed == "b" else b, out_dtype=jnp.float32))
        scale = float(np.max(np.abs(reference))) or 1.0
        best: tuple[float, MatmulConfig] | None = None
        failed, wrong, last_error = 0, 0, None
        for config in candidates:
            if best is not None and deadline is not None and time.perf_counter() > deadline:
                logger.warning("autotune %s %s: time budget spent, keeping %s", backend,
                               (m, n, k), best[1])
                break
            if transposed is None:
                fn = jax.jit(lambda a, b, c=config: matmul_mod.matmul(a, b, backend=backend, config=c))
            else:  # the kernel a model's backward launches, reading the operand as stored
                fn = jax.jit(lambda a, b, c=config: matmul_mod._product_with_transpose(
                    a, b, transposed, a.dtype, backend, c))
            try:
                out = np.asarray(fn(a, b).astype(jnp.float32))
            except Exception as err:  # noqa: BLE001 - a candidate that fails to build is skipped
                logger.warning("autotune %s %s: %s failed: %s: %s", backend, (m, n, k), config,
                               type(err).__name__, err)
                failed, last_error = failed + 1, err
                continue
            error = float(np.max(np.abs(out - reference))) / scale
            if not error <= reference_tolerance(dtype):
                logger.warning("autotune %s %s: %s rejected, relative error %.3g",
                               backend, (m, n, k), config, error)
                wrong += 1
                continue
            seconds = _seconds(timer, rotating(fn, sets), config)
            logger.info("autotune %s %s: %s %.1f us", backend, (m, n, k), config, seconds * 1e6)
            if best is None or seconds < best[0]:
                best = (seconds, config)
        if best is None:
            last = ""
            if last_error is not None:  # its first line: a lowering error runs to pages
                first_line = str(last_error).split("\n", 1)[0]
                last = f"; the last failure: {type(last_error).__name__}: {first_line}"
            raise RuntimeError(
                f"autotune: no candidate passed the reference check for {(m, n, k)=} on "
                f"{backend=}: of {len(candidates)} tried, {failed} failed to build or run and "
                f"{wrong} gave a relative error over {reference_tolerance(dtype)}{last}"
            ) from last_error
        winners[(m, n, k)] = best[1]
        xla_seconds = _time_xla(matmul_mod, timer, sets, transposed) if compare_xla else None
        if xla_seconds is not None:
            speed = speed_against_xla(best[0], xla_seconds)
            logger.info("autotune %s %s: XLA's dot %.1f us; the winner runs at %.3gx its speed",
                        backend, (m, n, k), xla_seconds * 1e6, speed)
            if speed < 1:
                logger.warning("autotune %s %s: XLA's dot is faster than every candidate (the "
                               "winner %s runs at %.3gx its speed); matmul(backend='auto') runs "
                               "XLA's dot on this shape%s", backend, (m, n, k), best[1], speed,
                               "" if write_cache else " once it is cached")
        if write_cache:
            try:
                store(backend, device_kind, m, n, k, dtype, best[1], best[0], transposed,
                      xla_seconds)
            except OSError as err:  # checked before the sweep, yet it can still happen
                logger.warning("autotune %s %s: the winner %s was not cached (%s: %s); it is "
                               "still returned", backend, (m, n, k), best[1],
                               type(err).__name__, err)
    return winners


def _time_xla(matmul_mod, timer: Timer, sets, transposed: str | None) -> float:
    """Seconds per call of XLA's dot (what `backend="auto"` would run instead) in the tuned
    layout, over the same rotating input sets and timer as the candidates."""
    if transposed is None:
        fn = jax.jit(lambda a, b: matmul_mod.matmul(a, b, backend="xla", config=None))
    else:
        fn = jax.jit(lambda a, b: matmul_mod._product_with_transpose(
            a, b, transposed, a.dtype, "xla", None))
    return _seconds(timer, rotating(fn, sets), "XLA's dot")


def parse_shapes(parser, flag: str, text: str) -> list[tuple[int, int, int]]:
    """A CLI's `MxNxK,...` list of matmul shapes (autotune, bench matmul); a bad list, or
    one that names a shape twice, is an argparse error naming `flag`."""
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
        if any(len(s) != 3 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"{flag}={text!r} must be a comma list of MxNxK with positive dims, "
                     f"e.g. 8192x8192x8192,1000x777x513")
    # A repeat would tune or time the same shape twice and print it twice.
    if repeats := sorted({"x".join(map(str, s)) for i, s in enumerate(shapes) if s in shapes[:i]}):
        parser.error(f"{flag}={text!r} repeats {repeats}; give each shape once")
    return shapes


def _parse_candidates(parser, text: str) -> list[MatmulConfig]:
    """--candidates: a JSON list of MatmulConfig field dicts, inline or in a .json file."""
    source = "--candidates"
    if text.endswith(".json"):
        try:
            text, source = pathlib.Path(text).read_text(), f"--candidates {text}"
        except OSError as err:
            parser.error(f"--candidates: cannot read {text!r}: {err}")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        parser.error(f"{source}: expected a JSON list of config dicts; not JSON ({err})")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        parser.error(f"{source}: expected a non-empty JSON list of config dicts, e.g. "
                     f'[{{"block_m": 64, "block_n": 128}}]; got {text[:80]!r}')
    configs = []
    for i, item in enumerate(items):
        try:
            configs.append(MatmulConfig(**item))
        except (TypeError, ValueError) as err:
            parser.error(f"{source}: entry {i} {item} is not a MatmulConfig: {err}")
    return configs


def main(argv: list[str] | None = None) -> int:
    """`jaxopt-train autotune --backend mosaic_gpu --shapes 8192x8192x8192`."""
    import argparse

    parser = argparse.ArgumentParser(prog="jaxopt-train autotune",
                                     description="tune matmul tilings and cache the winners")
    parser.add_argument("--backend", default="auto",
                        choices=[b for b in BACKENDS if b != "xla"])
    parser.add_argument("--shapes", required=True, help="comma list of MxNxK")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="short candidate list")
    parser.add_argument("--candidates", metavar="JSON",
                        help="sweep these configs instead of the default list: a JSON list of "
                        "MatmulConfig field dicts, inline or as the path of a .json file, e.g. "
                        "'[{\"block_m\": 64, \"block_n\": 128, \"block_k\": 64}]'")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget per shape")
    parser.add_argument("--transposed", choices=("a", "b"), default=None,
                        help="tune A^T @ B (a stored K x M) or A @ B^T (b stored N x K) instead "
                        "of A @ B: the layouts of a dense layer's backward")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shapes = parse_shapes(parser, "--shapes", args.shapes)
    if args.budget_s is not None and not args.budget_s >= 0:
        parser.error(f"--budget-s must be >= 0 seconds; got {args.budget_s}")
    from jaxopt_train.kernels.matmul import resolve_backend

    try:
        backend = resolve_backend(args.backend)
    except RuntimeError as err:  # e.g. mosaic_gpu asked for on a machine without a GPU
        parser.error(f"--backend {args.backend}: {err}")
    if backend == "xla":
        parser.error("--backend auto resolved to 'xla' (no kernel backend runs here), which has "
                     "nothing to tune; pass --backend interpret to tune the CPU interpreter")
    if args.candidates is not None and args.quick:
        parser.error("--candidates replaces the candidate list; --quick picks the short default "
                     "one: give one of them")
    candidates = None if args.candidates is None else _parse_candidates(parser, args.candidates)
    if args.transposed is not None and backend not in TRANSPOSING_BACKENDS:
        parser.error(f"--transposed {args.transposed}: only {TRANSPOSING_BACKENDS} read a "
                     f"transposed operand as stored; --backend resolved to {backend!r}")
    try:
        check_cache_writable(instead=None)  # the CLI has no write_cache=False
    except OSError as err:
        parser.error(str(err))
    try:
        winners = autotune(shapes, jnp.dtype(args.dtype), backend=backend, candidates=candidates,
                           budget_s=args.budget_s, transposed=args.transposed, quick=args.quick)
    except ValueError as err:  # input the checks above let through, e.g. no layout-ready candidate
        parser.error(str(err))
    except RuntimeError as err:  # no candidate passed the reference check: nothing cached
        print(f"autotune: {err}", file=sys.stderr)
        return 1
    layout = "" if args.transposed is None else f" ({args.transposed}^T)"
    kind = jax.devices()[0].device_kind
    for shape, config in winners.items():
        seconds, xla_seconds = lookup_timings(backend, kind, *shape, jnp.dtype(args.dtype),
                                              args.transposed)
        versus = ""
        if seconds is not None and xla_seconds is not None:
            speed = speed_against_xla(seconds, xla_seconds)
            versus = (f"; {seconds * 1e6:.1f} us, XLA's dot {xla_seconds * 1e6:.1f} us: "
                      f"{speed:.3f}x XLA" + (" (auto runs XLA's dot here)" if speed < 1 else ""))
        print(f"{backend} {'x'.join(map(str, shape))}{layout}: {config}{versus}")
    print(f"cache: {cache_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
