"""`jaxopt-train bench collectives`: psum vs the ring all-reduce variants, side by side.

For each message size (bytes per device, as nccl-tests counts) and dtype it
times `lax.psum` and every ring variant in the same run and prints algorithm
bandwidth (size / time), bus bandwidth (algbw * 2(n-1)/n: what each link
carries, comparable across device counts), the ratio to psum and the share of
the NVLink peak per direction. With `--gpt` it also times a data-parallel GPT
step per grad-sync method: step time, compute-only and comm-only times, the
hidden-communication fraction 1 - (step - compute_only) / comm_only, and the
throughput against one device at equal per-device batch.

Timing: one untimed call that compiles, `--warmup` more untimed calls, then
bursts of back-to-back calls with one `block_until_ready` at the end; the
median over bursts is reported. The inputs are random small integers, exact in
every dtype and partial sum, so each variant's result must equal psum's: a variant
that differs is reported (`max_abs_diff_vs_psum`) and the command exits 1. So does
one that raises (a FAILED row, its "error" in the JSON; where psum itself failed,
that size's other rows have no check and no ratio), once the table and the JSON are
out. Variants this machine cannot run (peer off two Hopper GPUs, hierarchical on
fewer than 4 devices) are not built, and do not count as failed.

    python -m jaxopt_train.bench.collectives --quick
    python -m jaxopt_train.bench.collectives --sizes 1M,16M,256M,1G --dtypes f32,bf16 --json out.json
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from typing import Any, Callable

from jaxopt_train._replace import replace_text
from jaxopt_train.bench import collectives_flags as flags
# The flags' parser and names, also importable from here as before the split.
from jaxopt_train.bench.collectives_flags import DTYPES, RING_VARIANTS, build_parser, parse_size

__all__ = ["DTYPES", "RING_VARIANTS", "bench_collectives", "build_parser", "fmt_size", "main",
           "nvlink_peak", "parse_size", "print_table", "sweep_input", "time_burst", "trace_overlap",
           "variants"]

# NVLink bandwidth per direction by device kind, used when NVML cannot say (datasheets);
# matched in order, so the PCIe/NVL cards (a 600 GB/s NVLink bridge: 300 each way) come first.
NVLINK_PEAK_GBS = {"H100 PCIe": 300.0, "H100 NVL": 300.0, "H200": 450.0, "H100": 450.0, "GH200": 450.0,
                   "B200": 900.0, "A100": 300.0, "V100": 150.0}
# Per-direction GB/s of one NVLink, keyed by what nvmlDeviceGetNvLinkVersion returns: an
# nvmlNvlinkVersion_t enum, not the version (1: 1.0, 2: 2.0, 3: 2.2, 4: 3.0, 5: 3.1, 6: 4.0,
# 7: 5.0). An A100 returns 5 (NVLink 3.x, 25 GB/s), an H100/H200 6 (4.0, 25 GB/s).
PER_LINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def nvlink_peak(device) -> tuple[float | None, str]:
    """(GB/s per direction, where the figure came from) for `device`, or (None, why not)."""
    if device.platform != "gpu":
        return None, f"no NVLink on platform {device.platform!r}"
    from jaxopt_train.runtime.nvml import nvml_indices  # noqa: PLC0415

    # NVML numbers every GPU of the host, JAX only the visible ones (CUDA_VISIBLE_DEVICES).
    indices, reason = nvml_indices([device])
    if indices is not None:
        peak, reason = _nvml_nvlink_peak(indices[0])
        if peak is not None:
            return peak, reason
    else:
        reason = f"NVML not asked: {reason}"
    for kind, peak in NVLINK_PEAK_GBS.items():
        if kind in device.device_kind:
            return peak, f"datasheet table ({kind}); {reason}"
    return None, f"unknown device kind {device.device_kind!r}; {reason}"


def _nvml_nvlink_peak(index: int) -> tuple[float | None, str]:
    """(GB/s per direction of NVML GPU `index`'s active NVLinks, source) or (None, why not)."""
    try:
        import pynvml  # noqa: PLC0415 (GPU-only, lazy)

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            links, version = 0, None
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        links += 1
                        version = version or pynvml.nvmlDeviceGetNvLinkVersion(handle, link)
                except pynvml.NVMLError:
                    continue
        finally:
            pynvml.nvmlShutdown()
    except Exception as err:  # noqa: BLE001 (the caller falls back to the table)
        return None, f"NVML unavailable ({type(err).__name__})"
    if links and version in PER_LINK_GBS:
        return links * PER_LINK_GBS[version], f"NVML: {links} active NVLink links (version enum {version})"
    return None, (f"NVML reports {links} active NVLink links of unknown version enum {version}" if links
                  else "NVML reports no active NVLink")


def time_burst(fn: Callable, args: tuple, *, warmup: int, iters: int, bursts: int) -> float:
    """Median seconds per call over `bursts` bursts of `iters` back-to-back calls.

    One untimed call always comes first, so no burst times the compilation; `warmup`
    counts the untimed calls after it (0: the compiling call only).
    """
    import jax  # noqa: PLC0415

    out = fn(*args)
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def trace_overlap(fn: Callable, args: tuple, logdir: str, *, iters: int) -> dict:
    """Traces `iters` calls; the devices' mean collective/compute figures per call (ms).

    None values when the trace has no GPU streams (CPU).
    """
    import jax  # noqa: PLC0415

    from jaxopt_train.runtime.overlap import collective_overlap  # noqa: PLC0415

    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(logdir):
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
    per_device = collective_overlap(logdir, steps=iters)
    keys = ("span_ms", "compute_ms", "collective_ms", "concurrent_ms", "exposed_ms", "idle_ms")
    if not per_device:
        return dict.fromkeys(keys)
    return {k: statistics.fmean(getattr(d, k) for d in per_device) for k in keys}


def variants(n: int, dtype: str, chunks: list[int]) -> dict[str, Callable]:
    """name -> per-device function x -> sum over "data"."""
    import jax.numpy as jnp  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    from jaxopt_train.collectives import grouped_all_reduce, peer_all_reduce, ring_all_reduce  # noqa: PLC0415
    from jaxopt_train.collectives.peer import check_platform  # noqa: PLC0415

    out: dict[str, Callable] = {"psum": lambda x: lax.psum(x, "data")}
    for c in chunks:
        out[f"ring/c{c}"] = lambda x, c=c: ring_all_reduce(x, "data", num_chunks=c)
        # On 2 devices both are one exchange (x + ppermute(x)), which already uses both link directions.
        out[f"ring_bidir/c{c}"] = lambda x, c=c: ring_all_reduce(x, "data", bidirectional=True, num_chunks=c)
        if dtype == "f32":
            out[f"ring_wire_bf16/c{c}"] = lambda x, c=c: ring_all_reduce(x, "data", wire_dtype=jnp.bfloat16,
                                                                         num_chunks=c)
    if n == 2:  # the one-kernel peer exchange (2 Hopper GPUs, one process)
        try:
            check_platform()
        except (ValueError, NotImplementedError) as err:
            print(f"  peer variants skipped: {err}", file=sys.stderr)
        else:
            out["peer"] = lambda x: peer_all_reduce(x, "data")
            if dtype == "f32":
                out["peer_wire_bf16"] = lambda x: peer_all_reduce(x, "data", wire_dtype=jnp.bfloat16)
    if n >= 4 and n % 2 == 0:
        for c in chunks:  # (it used chunks[0] for every --chunks value, under a name without it)
            out[f"hierarchical/{n // 2}x2/c{c}"] = lambda x, c=c: grouped_all_reduce(x, "data", n // 2,
                                                                                   num_chunks=c)
    return out


def sweep_input(mesh, count: int, dtype, seed: int = 0):
    """`count` random small integers in `dtype`, sharded over "data", generated on the devices.

    Not constant (ones would hide a misplaced chunk), and every partial sum of n
    of them is exact in bf16 and f32, so each variant must equal psum bit for bit.
    """
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    bound = max(1, 128 // mesh.size)  # |partial sums| <= 128 < 256, bf16's exact integers

    def make(key):
        return jax.random.randint(key, (count,), -bound, bound + 1).astype(dtype)
    return jax.jit(make, out_shardings=NamedSharding(mesh, P("data")))(jax.random.key(seed))


def _max_abs_diff(a, b) -> float:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    diff = jax.jit(lambda u, v: jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
    return float(diff(a, b))


def bench_collectives(args, record: Callable[[dict], None]) -> list[dict]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    devices = jax.devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(devices, ("data",))
    rows = []
    for dtype in args.dtypes:
        np_dtype = jnp.dtype(DTYPES[dtype])
        fns = variants(n, dtype, args.chunks)
        if args.methods:
            fns = {k: v for k, v in fns.items() if k == "psum" or k.split("/")[0] in args.methods}
        for size in args.sizes:
            elems = size // np_dtype.itemsize
            x = sweep_input(mesh, n * elems, np_dtype)
            base = want = None
            for name, body in fns.items():
                fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                           check_vma=False))
                row = {"kind": "allreduce", "dtype": dtype, "size_bytes": size, "variant": name, "devices": n}
                try:
                    seconds = time_burst(fn, (x,), warmup=args.warmup, iters=args.iters, bursts=args.bursts)
                    out = fn(x)
                except Exception as err:  # noqa: BLE001 (one failing variant must not lose the sweep)
                    print(f"  {name} {dtype} {fmt_size(size)} failed: {type(err).__name__}: {err}", file=sys.stderr)
                    # Kept as a row, so the JSON says what failed and main fails the run at the end.
                    row["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
                    rows.append(row)
                    record(row)
                    continue
                algbw = size / seconds / 1e9
                row.update(time_s=seconds, algbw_gbs=algbw, busbw_gbs=algbw * 2 * (n - 1) / n)
                if name == "psum":
                    base, want = row, out
                # Exact inputs: any difference from psum is a wrong result, not rounding.
                diff = None if want is None else _max_abs_diff(out, want)
                if diff is not None and not math.isfinite(diff):
                    # nan/inf in the output: no distance strict JSON can hold; null, and flagged
                    row["non_finite_output"], diff = True, None
                row["max_abs_diff_vs_psum"] = diff
                del out
                row["ratio_to_psum"] = row["busbw_gbs"] / base["busbw_gbs"] if base else None
                if "wire_bf16" in name or dtype == "bf16":  # in f32-equivalent bytes against psum's f32
                    row["f32_equiv_busbw_gbs"] = row["busbw_gbs"] * 4 / np_dtype.itemsize
                row["share_of_nvlink_peak"] = row["busbw_gbs"] / args.peak if args.peak else None
                rows.append(row)
                record(row)
            del x, want
    return rows


def print_table(rows: list[dict], peak_note: str) -> None:
    print(f"\nall-reduce: bus bandwidth = algbw * 2(n-1)/n; peak: {peak_note}")
    print(f"{'dtype':<5} {'size':>6} {'variant':<22} {'time_us':>10} {'algbw':>8} {'busbw':>8} "
          f"{'x psum':>7} {'peak%':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['dtype']:<5} {fmt_size(r['size_bytes']):>6} {r['variant']:<22} FAILED {r['error'][:90]}")
            continue
        ratio = f"{r['ratio_to_psum']:.3f}" if r.get("ratio_to_psum") else "-"
        share = f"{100 * r['share_of_nvlink_peak']:.0f}" if r.get("share_of_nvlink_peak") else "-"
        wrong = "  WRONG RESULT" if _wrong(r) else ""
        print(f"{r['dtype']:<5} {fmt_size(r['size_bytes']):>6} {r['variant']:<22} {r['time_s'] * 1e6:>10.1f} "
              f"{r['algbw_gbs']:>8.2f} {r['busbw_gbs']:>8.2f} {ratio:>7} {share:>6}{wrong}")


def _wrong(row: dict) -> bool:
    """A variant's result differs from psum's (on exact inputs), or holds nan/inf."""
    return bool(row.get("max_abs_diff_vs_psum") or row.get("non_finite_output"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__.split("\n")[0])
    args = parser.parse_args(argv)
    problem = flags.value_problem(args)
    if problem:  # in argparse's form, as the other flag errors are
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    flags.check_gpt_flags(parser, args)
    flags.check_sizes(parser, args.sizes, args.dtypes)
    flags.apply_defaults(args)
    from jaxopt_train.bench import collectives_gpt  # noqa: PLC0415

    # Before any benchmark: a bad override must not cost a whole sweep first.
    args.gpt_overrides = collectives_gpt.parse_gpt_overrides(parser, args.gpt_overrides)
    if args.gpt:
        collectives_gpt.check_gpt_config(parser, args.gpt_config, args.gpt_overrides)
    import jax  # noqa: PLC0415

    device = jax.devices()[0]
    if jax.device_count() < 2:
        raise SystemExit(f"bench collectives needs at least 2 devices, found {jax.device_count()} "
                         f"({jax.devices()[0].platform}); on CPU set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    flags.check_methods_run(parser, args, jax.device_count(), device.platform, variants)
    # Last: these create their folders, and a refused run should leave none behind.
    flags.check_json_apart(parser, args.json, args.gpt_trace)
    flags.check_json(parser, args.json, args.overwrite)
    flags.check_gpt_trace(parser, args.gpt_trace)
    peak_note = "--peak given"
    if args.peak is None:
        args.peak, peak_note = nvlink_peak(device)
    meta = {"jax": jax.__version__, "python": platform.python_version(), "device_kind": device.device_kind,
            "platform": device.platform, "devices": jax.device_count(), "peak_gbs_per_direction": args.peak,
            "peak_source": peak_note, "argv": sys.argv[1:] if argv is None else argv}
    print(f"# {meta['devices']} x {meta['device_kind']} ({meta['platform']}), jax {meta['jax']}; "
          f"peak {args.peak} GB/s per direction ({peak_note})", flush=True)
    results: dict[str, Any] = {"meta": meta, "allreduce": [], "gpt_step": []}

    def dump():
        if args.json:
            # Strict (no NaN/Infinity), and swapped in whole after each row: a crash or a
            # refused value mid-write left the previous rows' file emptied or cut short.
            replace_text(args.json, json.dumps(results, indent=1, allow_nan=False))

    def record(key):
        def add(row):
            results[key].append(row)
            print("  " + json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}),
                  flush=True)
            dump()
        return add

    rows = bench_collectives(args, record("allreduce"))
    gpt_rows = []
    gpt_failed = False
    if args.gpt:
        try:
            # jax.nn's bf16 attention backward mixes bf16 with f32 constants, which a
            # caller's strict promotion setting (our tests') rejects while tracing.
            with jax.numpy_dtype_promotion("standard"):
                gpt_rows = collectives_gpt.bench_gpt(args, record("gpt_step"))
        except Exception as err:  # noqa: BLE001 (keep the all-reduce table, then fail)
            print(f"gpt step benchmark failed: {type(err).__name__}: {err}", file=sys.stderr)
            gpt_failed = True
    dump()
    print_table(rows, peak_note)
    collectives_gpt.print_gpt(gpt_rows)
    return _exit_status(rows, gpt_failed)


def _exit_status(rows: list[dict], gpt_failed: bool) -> int:
    """1 with a line on stderr per kind of failure (after the table and the JSON), else 0.

    A variant this machine cannot run (peer off 2 Hopper GPUs) is never built, so never
    a row: only variants that were built and then raised count as failed."""
    if not any("error" not in r for r in rows):
        print("bench collectives: every all-reduce variant failed (see the errors above)", file=sys.stderr)
        return 1
    failed = [f"{r['variant']} {r['dtype']} {fmt_size(r['size_bytes'])}" for r in rows if "error" in r]
    if failed:
        note = ("; where psum failed the other variants have no check and no ratio"
                if any(f.startswith("psum ") for f in failed) else "")
        print(f"bench collectives: failed: {failed} (see the errors above){note}", file=sys.stderr)
    wrong = sorted({f"{r['variant']} {r['dtype']}" for r in rows if _wrong(r)})
    if wrong:
        print(f"bench collectives: {wrong} differ from lax.psum on exact inputs: their timings are of "
              "a wrong all-reduce (see max_abs_diff_vs_psum, non_finite_output)", file=sys.stderr)
    return 1 if failed or wrong or gpt_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
