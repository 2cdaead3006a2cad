"""A/B probe of our Mosaic GPU matmul variants against XLA on one Hopper GPU.

    python tools/probe_matmul.py                  # <= ~3.7 min on one H200, JSON in $OUT
    python tools/probe_matmul.py --list           # the variants, no GPU needed
    python tools/probe_matmul.py --trace-only     # trace every variant's kernel (CPU is fine)
    python tools/probe_matmul.py --variants default,wg_n --shapes 8192x8192x8192

Shapes are M x N x K (A is M x K, B is K x N), as in `jaxopt-train bench matmul`.
Timed on each shape: XLA's plain bf16 `jnp.dot` ("xla_dot", the ratio baseline, as in
`bench matmul`), XLA with f32 output cast to bf16 ("xla_f32acc"), each variant
of our `mosaic_gpu` backend (a `MatmulConfig` built from the shipped H200
default with a few fields changed), and JAX's example kernel
`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu` if it imports. Every
result is checked against XLA's f32 output before timing (max |err| / max |ref|
<= --tol); a failing or crashing variant is reported and the probe goes on.
Timing reuses `bench.matmul.time_fn` (bursts of back-to-back calls, one sync per
burst, median) over rotating random inputs larger than L2. The loop is
variant-major (every variant gets all shapes, so its geomean is complete); it
starts no new variant after --budget-s (180) seconds, then re-times XLA
("xla_dot_again": clock drift over the run) and prints the table; a watchdog
prints what it has and exits (rc 3) at budget + --grace-s (220 s) in case a
measurement hangs. The JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
import time

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 2048), (16384, 2048, 8192)]
BASELINE = "xla_dot"

# Most promising first: the probe may run out of budget before the tail.
# Each entry: name -> fields replaced in the shipped H200 default config.
VARIANTS: dict[str, dict] = {
    "default": {},
    # JAX's example layout: consumers side by side, CTA tile 128 x 256, shared A.
    "wg_n": {"wg_split": "n"},
    # ... plus its warpgroup lowering semantics.
    "wg_n_wglower": {"wg_split": "n", "warpgroup_lowering": True},
    "wglower": {"warpgroup_lowering": True},
    "noautobar": {"no_auto_barriers": True},
    "wg_n_noautobar": {"wg_split": "n", "no_auto_barriers": True},
    # 2-CTA clusters: the shared operand tile is TMA-multicast to both CTAs.
    "wg_n_cluster_m": {"wg_split": "n", "cluster": "m"},
    "cluster_n": {"cluster": "n"},
    "wg_n_inflight": {"wg_split": "n", "wgmma_in_flight": 1},
    "wg_n_g8m": {"wg_split": "n", "group_m": 8, "grid_minor": "m"},
    "epi128": {"epilogue_tile": 128},
    # Ping-pong with one shared ring (eleventh session): each consumer owns 128 x 128 tiles.
    "pp4": {"schedule": "pingpong", "num_stages": 4},
    "pp6": {"schedule": "pingpong", "num_stages": 6},
    "pp6_inflight": {"schedule": "pingpong", "num_stages": 6, "wgmma_in_flight": 1},
}
# The default run (fits the 220 s budget with compile times of a few seconds).
# Cluster variants go last: a cluster synchronisation bug would hang, not fail.
DEFAULT_VARIANTS = ["default", "wg_n", "wg_n_wglower", "wglower", "noautobar",
                    "wg_n_inflight", "wg_n_cluster_m", "cluster_n"]


def _parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape={text!r} must be MxNxK, e.g. 8192x8192x8192")
    return tuple(int(p) for p in parts)


def _base_config():
    from jaxopt_train.kernels.configs import SHIPPED_DEFAULTS

    return SHIPPED_DEFAULTS[("mosaic_gpu", "NVIDIA H200")]


def variant_configs(names: list[str]) -> dict:
    """name -> MatmulConfig for each requested variant (ValueError on unknown names)."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    base = _base_config()
    return {n: dataclasses.replace(base, **VARIANTS[n]) for n in names}


def _example_fn(**overrides):
    """jit-able (a, b, bias) -> a @ b with JAX's example Hopper kernel, 128x128x64 tiles.

    `overrides` name enum members of the example's MatmulDimension for its
    TuningConfig fields (e.g. wg_dimension="M"); KeyError if it has no such field.
    """
    import inspect

    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as ex

    fields = {f.name for f in dataclasses.fields(ex.TuningConfig)}
    wanted = dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                  epi_tile_m=64, epi_tile_n=64, grid_minor_dim=ex.MatmulDimension.N,
                  grid_tile_width=16)
    for key, dim in overrides.items():
        if key not in fields:
            raise KeyError(f"this jax's TuningConfig has no {key!r}; it has {sorted(fields)}")
        wanted[key] = ex.MatmulDimension[dim]
    config = ex.TuningConfig(**{k: v for k, v in wanted.items() if k in fields})
    if hasattr(ex, "matmul"):  # jax 0.10: matmul(a, b, c, config); c=None: plain a @ b
        if "c" in inspect.signature(ex.matmul).parameters:
            return lambda a, b, bias: ex.matmul(a, b, None, config=config), config
        return lambda a, b, bias: ex.matmul(a, b, config=config), config
    return lambda a, b, bias: ex.matmul_kernel(a, b, config), config  # older spelling


def trace_only(configs: dict) -> int:
    """Traces each variant on an even and an odd (bias + gelu) shape; 1 if any fails."""
    import jax
    import jax.numpy as jnp

    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    failures = 0
    for name, config in configs.items():
        for m, n, k, act in [(1024, 1024, 512, None), (1000, 777, 513, "gelu")]:
            a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
            bias = None if act is None else jax.ShapeDtypeStruct((n,), jnp.float32)
            try:
                jax.make_jaxpr(lambda a, b, bias, act=act, config=config: mosaic_matmul(
                    a, b, bias, activation=act, out_dtype=jnp.bfloat16, config=config))(a, b, bias)
                print(f"traced {name:<16} {m}x{n}x{k} activation={act}")
            except Exception as err:  # noqa: BLE001 - report every variant
                failures += 1
                print(f"FAILED {name:<16} {m}x{n}x{k} activation={act}: {_first_lines(err)}")
    return 1 if failures else 0


def _patch_epilogue(mode: str) -> None:
    """Replaces our kernel's output store for a timing diagnostic (see --epilogue)."""
    from jaxopt_train.kernels import mosaic_gpu

    shipped = mosaic_gpu._store_epilogue

    def store_nowait(*args):
        # The shipped store with every wait for a slot's previous TMA store dropped
        # (races: a slot may be overwritten while the TMA engine still reads it).
        import jax.experimental.pallas.mosaic_gpu as plgpu

        wait = plgpu.wait_smem_to_gmem
        plgpu.wait_smem_to_gmem = lambda *_, **__: None
        try:
            shipped(*args)
        finally:
            plgpu.wait_smem_to_gmem = wait

    def store_one(out, slots, out_gmem, epi_m, epi_n):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        # Only one sub-tile, the sum of all: the accumulator stays live (dropping every store lets
        # the compiler drop the wgmmas too, so 'skip' times the loads alone).
        bm, bn = out.shape
        first = out[:epi_m, :epi_n]
        for i in range(bm // epi_m):  # every sub-tile feeds it: each wgmma stays live
            for j in range(bn // epi_n):
                if i or j:
                    first = first + out[i * epi_m:(i + 1) * epi_m, j * epi_n:(j + 1) * epi_n]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        slots[0] = first
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(slots.at[0], out_gmem.at[:epi_m, :epi_n])

    mosaic_gpu._store_epilogue = {"skip": lambda *args: None, "nowait": store_nowait,
                                  "one": store_one}[mode]
    print(f"DIAGNOSTIC: our kernel's epilogue is {mode!r}; its results are not checked",
          file=sys.stderr, flush=True)


def _first_lines(err: BaseException, n: int = 3) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines and err.__traceback__ is not None:  # e.g. a bare AttributeError: say where
        import traceback

        frame = traceback.extract_tb(err.__traceback__)[-1]
        lines = [f"at {os.path.basename(frame.filename)}:{frame.lineno} {frame.line}"]
    return f"{type(err).__name__}: " + " | ".join(lines[:n])[:400]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe_matmul", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma list, in order, or 'all' (default {','.join(DEFAULT_VARIANTS)}); "
                             f"known: {','.join(VARIANTS)}")
    parser.add_argument("--shapes", type=_parse_shape, nargs="+", default=SHAPES,
                        help="MxNxK shapes (default: the 4 issue shapes)")
    parser.add_argument("--no-example", action="store_true", help="skip JAX's example kernel")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="start no new variant after this many seconds")
    parser.add_argument("--grace-s", type=float, default=40.0,
                        help="watchdog: exit with what we have at budget + grace seconds")
    parser.add_argument("--calls", type=int, default=20, help="calls per burst")
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--input-sets", type=int, default=4, help="rotating input sets (> L2)")
    parser.add_argument("--warmup-s", type=float, default=0.3,
                        help="warm-up per measurement (plus 2 s of XLA at the start)")
    parser.add_argument("--tol", type=float, default=1e-2, help="max |err| / max |ref|")
    parser.add_argument("--epilogue", choices=("store", "skip", "nowait", "one"), default="store",
                        help="diagnostic (timing only, results are wrong): 'skip' drops the "
                             "output stores of our kernel, 'nowait' stores without waiting for "
                             "an SMEM slot's previous TMA store, 'one' stores one sub-tile per tile "
                             "(the sum of all); the difference to 'store' is "
                             "the epilogue's share of the kernel's time. Implies --no-check")
    parser.add_argument("--no-check", action="store_true",
                        help="time without checking results against XLA first")
    parser.add_argument("--list", action="store_true", help="print the variant configs and exit")
    parser.add_argument("--trace-only", action="store_true",
                        help="only trace each variant's kernel body to a jaxpr (works on CPU): "
                             "catches shape/indexing mistakes before spending GPU time")
    parser.add_argument("--json", default=None,
                        help="output path (default $OUT/matmul_probe.json, OUT default /tmp)")
    args = parser.parse_args(argv)
    names = list(VARIANTS) if args.variants == "all" else [
        n for n in args.variants.split(",") if n]
    try:
        configs = variant_configs(names)
    except ValueError as err:
        parser.error(str(err))
    if args.list:
        for name, config in configs.items():
            print(f"{name:<16} {config.to_dict()}")
        return 0
    if args.epilogue != "store":
        _patch_epilogue(args.epilogue)
        args.no_check = True
    if args.trace_only:
        return trace_only(configs)

    return run(args, configs)


def _make_fns(configs: dict, with_example: bool, header: dict):
    """name -> jitted (a, b, bias) -> bf16 (M, N): baselines, JAX's example, our variants."""
    import jax
    import jax.numpy as jnp

    from jaxopt_train.kernels import matmul

    fns = {BASELINE: jax.jit(lambda a, b, bias: jnp.dot(a, b)),
           "xla_f32acc": jax.jit(lambda a, b, bias: jnp.dot(
               a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))}
    example_error = None
    if with_example:
        try:
            example, example_config = _example_fn()
            fns["jax_example"] = jax.jit(example)
            header["jax_example_config"] = repr(example_config)
        except Exception as err:  # noqa: BLE001 - report why, keep probing ours
            example_error = _first_lines(err)
            print(f"jax_example unavailable: {example_error}", file=sys.stderr, flush=True)
    for name, config in configs.items():
        fns[name] = jax.jit(lambda a, b, bias, config=config: matmul(
            a, b, backend="mosaic_gpu", config=config))
    if with_example and example_error is None:
        # The example with its consumers stacked along M like our default: tells
        # the layout's share of its lead from the rest (lowering semantics...).
        try:
            example, example_config = _example_fn(wg_dimension="M")
            fns["jax_example_wg_m"] = jax.jit(example)
            header["jax_example_wg_m_config"] = repr(example_config)
        except Exception as err:  # noqa: BLE001 - older example: no wg_dimension
            print(f"jax_example_wg_m unavailable: {_first_lines(err)}", file=sys.stderr)
    return fns, example_error


def _report(state: dict, final: bool) -> None:
    """Ratios, geomeans, JSON (always) and the table (when `final`) from `state`."""
    rows, shapes, names = state["rows"], state["shapes"], state["names"]
    for shape in shapes:
        base = next((r for r in rows if r["shape"] == list(shape) and r["variant"] == BASELINE
                     and "tflops" in r), None)
        for r in rows:
            if base is not None and r["shape"] == list(shape) and "tflops" in r:
                r["vs_xla"] = r["tflops"] / base["tflops"]
    summary = {}
    for name in names:
        ratios = [r["vs_xla"] for r in rows if r["variant"] == name and "vs_xla" in r]
        summary[name] = {"geomean_vs_xla": _geomean(ratios) if ratios else None,
                         "shapes_measured": len(ratios)}
    wall = time.perf_counter() - state["start"]
    with open(state["out_path"], "w") as f:
        json.dump({**state["header"], "rows": rows, "summary": summary,
                   "stopped": state["stopped"], "jax_example_error": state["example_error"],
                   "wall_s": wall}, f, indent=1)
    if not final:
        return
    h = state["header"]
    print(f"\n{h['device_kind']}  jax {h['jax']}  median of {h['bursts']} bursts x "
          f"{h['calls']} calls, {h['input_sets']} rotating inputs; TFLOP/s and ratio vs {BASELINE}")
    cells = ["x".join(map(str, s)) for s in shapes]
    print(f"{'variant':<16}" + "".join(f"{c:>20}" for c in cells) + f"{'geomean':>9}")
    for name in names:
        line = f"{name:<16}"
        for shape in shapes:
            r = next((r for r in rows if r["variant"] == name and r["shape"] == list(shape)), None)
            if r is None:
                cell = "-"
            elif "error" in r:
                cell = "ERROR"
            else:
                cell = f"{r['tflops']:.0f} {r.get('vs_xla', float('nan')):.3f}x"
            line += f"{cell:>20}"
        g = summary[name]["geomean_vs_xla"]
        line += f"{'-' if g is None else f'{g:.3f}':>9}"
        print(line)
    for r in rows:
        if "error" in r:
            print(f"ERROR {r['variant']} {'x'.join(map(str, r['shape']))}: {r['error']}")
    if state["example_error"]:
        print(f"jax_example not run: {state['example_error']}")
    if state["stopped"]:
        print(f"STOPPED EARLY: {state['stopped']}")
    print(f"wall {wall:.0f}s; JSON: {state['out_path']}", flush=True)


def _watchdog(state: dict, after_s: float) -> threading.Timer:
    """A hung kernel (e.g. a cluster deadlock) must not eat the device call: after
    `after_s` print what we have and exit the process."""
    def fire():
        state["stopped"] = f"watchdog: still running after {after_s:.0f}s (a hung measurement?)"
        try:
            _report(state, final=True)
        finally:
            os._exit(3)

    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def run(args, configs: dict) -> int:
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp

    from jaxopt_train.bench.matmul import _input_sets, time_fn

    device = jax.devices()[0]
    header = {"device_kind": device.device_kind, "jax": jax.__version__,
              "calls": args.calls, "bursts": args.bursts, "input_sets": args.input_sets,
              "tol": args.tol, "variants": {n: c.to_dict() for n, c in configs.items()}}
    fns, example_error = _make_fns(configs, not args.no_example, header)
    print(json.dumps(header), file=sys.stderr, flush=True)
    state = {"rows": [], "shapes": args.shapes, "names": list(fns), "header": header,
             "start": start, "stopped": None, "example_error": example_error,
             "out_path": args.json or os.path.join(os.environ.get("OUT") or "/tmp",
                                                   "matmul_probe.json")}
    timer = _watchdog(state, args.budget_s + args.grace_s)
    # Every shape's inputs stay resident (~2 GB for the 4 issue shapes) so the
    # loop can run variant-major: the budget then cuts whole tail variants and
    # every variant measured has all its shapes (a complete geomean).
    data = {}
    for shape in args.shapes:
        m, n, k = shape
        sets = _input_sets(m, n, k, jnp.bfloat16, args.input_sets)
        ref = jnp.dot(sets[0][0], sets[0][1], preferred_element_type=jnp.float32)
        data[shape] = (sets, ref, float(jnp.max(jnp.abs(ref))) or 1.0)
    time_fn(fns[BASELINE], data[args.shapes[0]][0], calls=1, bursts=1, warmup_s=2.0)  # clocks
    # XLA again at the end: its drift over the run bounds how far to trust a ratio.
    order = list(fns) + [BASELINE + "_again"]
    fns[BASELINE + "_again"] = fns[BASELINE]
    state["names"] = order
    for name in order:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s and name != BASELINE + "_again":
            state["stopped"] = f"budget {args.budget_s:.0f}s reached at {elapsed:.0f}s"
            continue  # still re-time XLA for the drift check
        for shape in args.shapes:
            (m, n, k), (sets, ref, scale) = shape, data[shape]
            a, b, bias = sets[0]
            row = {"shape": list(shape), "variant": name}
            try:
                err = float(jnp.max(jnp.abs(fns[name](a, b, bias).astype(jnp.float32) - ref)))
                row["max_rel_error"] = err / scale
                if not args.no_check and not err / scale <= args.tol:  # also catches NaN
                    raise ValueError(f"max |err| / max |ref| = {err / scale:.3g} > tol {args.tol}")
                seconds = time_fn(fns[name], sets, calls=args.calls, bursts=args.bursts,
                                  warmup_s=args.warmup_s)
                row["ms"] = seconds * 1e3
                row["tflops"] = 2 * m * n * k / seconds / 1e12
            except Exception as err:  # noqa: BLE001 - one broken variant must not stop the rest
                row["error"] = _first_lines(err)
            row["t_s"] = round(time.perf_counter() - start, 1)
            state["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            _report(state, final=False)  # JSON so far, in case the process is killed
    timer.cancel()
    _report(state, final=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
