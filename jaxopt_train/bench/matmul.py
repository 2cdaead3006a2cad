"""`jaxopt-train bench matmul`: TFLOP/s of every matmul backend next to XLA's dot.

For each shape, every backend runs on random bf16 data rotating over several
input sets (on a GPU together over 128 MiB, so no call finds its operands in
L2; the smallest shapes, capped at 64 sets, stay smaller),
is checked against the f32 reference (max error over max |reference| within the
autotuner's tolerance: 2e-2 for bf16, 5e-3 for fp16; a backend outside it, or with
nan/inf output, is reported WRONG, not timed, and the command exits 1 at the end),
warmed up, then timed in bursts of back-to-back calls with one sync per burst; the
median burst gives TFLOP/s, the ratio to XLA's `jnp.dot` measured in the same run,
and % of dense peak.
A second table compares the fused matmul+bias+gelu with XLA's dot followed by
bias and gelu. A third times that layer as a training step runs it, forward and
backward (dA, dB and dbias for a fixed cotangent), for each kernel backend with the
pre-activation recomputed in the backward and kept from the forward
(`save_preactivation`, shown as "<backend>+saved"), against XLA's dot + bias + gelu
in bf16 as `nnx.Linear` and `jax.nn.gelu` compute it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_train._replace import replace_text
from jaxopt_train.kernels import available_backends, matmul, matmul_reference
# The autotuner's acceptance rule: a config it tuned is never called wrong here.
from jaxopt_train.kernels.autotune import burst_timer, parse_shapes, reference_tolerance, rotating
from jaxopt_train.kernels.configs import BACKENDS
from jaxopt_train.kernels.matmul import resolve_backend, resolve_config
from jaxopt_train.train.mfu import peak_tflops

LARGE_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 2048), (16384, 2048, 8192)]
SMALL_SHAPES = [(1024, 1024, 1024), (2048, 512, 2048), (1000, 777, 513), (3000, 5000, 1000)]
FUSED_SHAPES = [(8192, 8192, 8192), (16384, 8192, 2048)]
LAYER_SHAPES = [(8192, 8192, 2048)]  # gpt-1b's MLP fc layer: 8 x 1024 tokens, d_model 2048
QUICK_SHAPES = [(64, 64, 64), (127, 129, 65)]


def _peak(device_kind: str, dtype) -> float | None:
    """Dense peak FLOP/s from the one table MFU also uses (`train.mfu.PEAK_TFLOPS`)."""
    tflops = peak_tflops(device_kind, "bf16" if dtype == jnp.bfloat16 else "fp16")
    return None if tflops is None else tflops * 1e12


# On a GPU the rotating input sets of a shape together pass this many bytes (over twice an
# H100/H200's 50 MB L2, three times an A100's 40 MB), so no call finds its operands cached:
# 4 sets of 1024^3 bf16 were 16.8 MB, hot in L2. Capped at MAX_SETS: the smallest shapes'
# calls are mostly launch overhead, and thousands of sets would take longer to make than to time.
ROTATE_BYTES = 128 << 20
MAX_SETS = 64


def rotation_sets(m: int, n: int, k: int, dtype, requested: int, per_dispatch: int, platform: str) -> int:
    """Input sets to rotate over for one shape: at least `requested`; on a GPU enough to pass
    `ROTATE_BYTES` (at most `MAX_SETS`), rounded up to a multiple of `per_dispatch`."""
    count = requested
    if platform == "gpu":
        per_set = (m * k + k * n + n) * jnp.dtype(dtype).itemsize
        count = max(requested, min(MAX_SETS, -(-ROTATE_BYTES // per_set)))
    return -(-count // per_dispatch) * per_dispatch


def _input_sets(m, n, k, dtype, count, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3 * count)
    sets = []
    for i in range(count):
        a = jax.random.normal(keys[3 * i], (m, k), jnp.float32).astype(dtype)
        b = jax.random.normal(keys[3 * i + 1], (k, n), jnp.float32).astype(dtype)
        bias = jax.random.normal(keys[3 * i + 2], (n,), jnp.float32).astype(dtype)
        sets.append((a, b, bias))
    return jax.block_until_ready(sets)


def time_fn(fn, sets, *, calls: int, bursts: int, warmup_s: float, per_dispatch: int = 1) -> float:
    """Median seconds per call over `bursts` bursts of `calls` back-to-back calls,
    rotating over the input `sets`, after `warmup_s` seconds of warm-up (the
    autotuner's timer, so tuning and benchmark time alike).

    `per_dispatch` > 1 makes each dispatch one jitted call that runs `fn` on that many
    different input sets (`len(sets)` must be a multiple): the host then dispatches once
    per that many launches, which takes its overhead out of calls of a few tens of us,
    where it can be most of what one jitted matmul costs. The result is still per call.
    """
    if per_dispatch < 1 or len(sets) % per_dispatch:
        raise ValueError(f"per_dispatch={per_dispatch} must be >= 1 and divide the "
                         f"{len(sets)} input sets")
    if per_dispatch == 1:
        return burst_timer(rotating(fn, sets), calls=calls, repeats=bursts, warmup_s=warmup_s)
    groups = [(tuple(sets[i:i + per_dispatch]),) for i in range(0, len(sets), per_dispatch)]
    grouped = jax.jit(lambda group: [fn(*operands) for operands in group])
    dispatches = -(-calls // per_dispatch)
    return burst_timer(rotating(grouped, groups), calls=dispatches, repeats=bursts,
                       warmup_s=warmup_s) / per_dispatch


def _plain_fn(backend):
    if backend == "xla_dot":
        return jax.jit(lambda a, b, bias: jnp.dot(a, b))
    return jax.jit(lambda a, b, bias: matmul(a, b, backend=backend))


def _prime(shape, dtype, args) -> None:
    """On a GPU, one throwaway timing of XLA's dot at the run's first shape. The first row
    of a process read low for XLA after a 1-3 s warm-up (312-427 TFLOP/s at 3000x5000x1000
    against 471; 13.6 at 1024^3 against 41.9), which flattered our kernels' first ratio."""
    if args.platform != "gpu":
        return
    m, n, k = shape
    sets = _input_sets(m, n, k, dtype, _set_count(shape, dtype, args))
    time_fn(_plain_fn("xla_dot"), sets, calls=args.calls, bursts=args.bursts, warmup_s=args.warmup_s,
            per_dispatch=args.launches_per_dispatch)


def _fused_fn(backend):
    if backend == "xla_dot":
        return jax.jit(lambda a, b, bias: jax.nn.gelu(jnp.dot(a, b) + bias))
    return jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu", backend=backend))


def _layer_fn(backend: str, cotangent):
    """(out, dA, dB, dbias) of gelu(A @ B + bias) for the fixed `cotangent`."""
    if backend == "xla_dot":
        def layer(a, b, bias):
            return jax.nn.gelu(jnp.dot(a, b) + bias.astype(a.dtype), approximate=True)
    else:
        kernel, saved, _ = backend.partition("+saved")

        def layer(a, b, bias):
            return matmul(a, b, bias=bias, activation="gelu", backend=kernel,
                          save_preactivation=bool(saved))

    return with_backward(layer, cotangent)


class WrongOutputError(ArithmeticError):
    """A backend's output is farther from the f32 reference than the tolerance allows."""


def with_backward(layer, cotangent):
    """Jitted (out, dA, dB, dbias) of `layer(a, b, bias)` for the fixed `cotangent`."""
    def step(a, b, bias):
        out, pull = jax.vjp(layer, a, b, bias)
        return (out, *pull(cotangent.astype(out.dtype)))

    return jax.jit(step)


def _measure_layer(backends, shape, dtype, args, peak):
    """Rows of the forward + backward table: useful FLOPs 3 x 2MNK (the recomputing
    backward runs a fourth product that is not counted)."""
    m, n, k = shape
    sets = _input_sets(m, n, k, dtype, _set_count(shape, dtype, args))
    cotangent = jax.random.normal(jax.random.key(1), (m, n), jnp.float32).astype(dtype)

    def reference(a, b, bias):
        return matmul_reference(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32)

    ref_out, pull = jax.vjp(reference, *sets[0])
    # The reference's gradients come back in the inputs' dtype: compare in f32.
    refs = [r.astype(jnp.float32) for r in (ref_out, *pull(cotangent.astype(jnp.float32)))]

    def rel_error(got):  # the worst of the output and the three gradients
        return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) / (float(jnp.max(jnp.abs(r))) or 1.0)
                   for g, r in zip(got, refs))

    names = ["xla_dot"] + [backend + suffix for backend in backends if backend != "xla_dot"
                           for suffix in ("", "+saved")]
    entries = [({"shape": list(shape), "backend": name, "layer": True},
                lambda row, name=name: _layer_fn(name, cotangent)) for name in names]
    return _timed_rows(entries, sets, args, peak, 3 * 2 * m * n * k, rel_error,
                       reference_tolerance(dtype))


def _measure(make_fn, backends, shape, dtype, args, peak, fused: bool):
    m, n, k = shape
    sets = _input_sets(m, n, k, dtype, _set_count(shape, dtype, args))
    a, b, bias = sets[0]
    ref = matmul_reference(a, b, bias=bias if fused else None, activation="gelu" if fused else None,
                           out_dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(ref))) or 1.0

    def build(backend):
        def make(row):
            if backend not in ("xla_dot", "xla"):
                row["config"] = resolve_config(backend, m, n, k, dtype).to_dict()
            return make_fn(backend)
        return make

    entries = [({"shape": list(shape), "backend": backend, "fused": fused}, build(backend))
               for backend in backends]
    return _timed_rows(entries, sets, args, peak, 2 * m * n * k,
                       lambda out: float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / scale,
                       reference_tolerance(dtype))


def _set_count(shape, dtype, args) -> int:
    return rotation_sets(*shape, dtype, args.input_sets, args.launches_per_dispatch, args.platform)


def _timed_rows(entries, sets, args, peak, flops: int, rel_error, tolerance: float):
    """Fills each (row, make) entry's row: `make(row)` builds the jitted function (and may
    note its config in the row), `rel_error` scores its result on the first input set,
    then it is timed; TFLOP/s of `flops` per call, % of `peak`, and the ratio to the
    "xla_dot" row. One broken backend must not hide the rest: its row gets "error", and
    "wrong_output" too when its result is non-finite or off by more than `tolerance`
    (such a row is not timed: a fast wrong kernel has no TFLOP/s to claim)."""
    rows = []
    for row, make in entries:
        try:
            fn = make(row)
            row["max_rel_error"] = rel_error(fn(*sets[0]))
            if not math.isfinite(row["max_rel_error"]):  # nan/inf out: a broken kernel, no figure
                row["wrong_output"] = True
                raise FloatingPointError(f"non-finite output (max_rel_error={row.pop('max_rel_error')})")
            if row["max_rel_error"] > tolerance:
                row["wrong_output"] = True
                raise WrongOutputError(f"max_rel_error {row['max_rel_error']:.3g} vs the f32 "
                                       f"reference exceeds the tolerance {tolerance:g}")
            seconds = time_fn(fn, sets, calls=args.calls, bursts=args.bursts, warmup_s=args.warmup_s,
                              per_dispatch=args.launches_per_dispatch)
            row["ms"], row["input_sets"] = seconds * 1e3, len(sets)
            row["tflops"] = flops / seconds / 1e12
            row["pct_peak"] = None if peak is None else 100 * row["tflops"] * 1e12 / peak
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    base = next((r for r in rows if r["backend"] == "xla_dot" and "tflops" in r), None)
    for row in rows:
        if base is not None and "tflops" in row:
            row["vs_xla"] = row["tflops"] / base["tflops"]
    return rows


def _table(rows, title):
    lines = [f"\n{title}", f"{'shape (MxNxK)':<20} {'backend':<16} {'TFLOP/s':>8} {'vs XLA':>7} "
             f"{'% peak':>7} {'ms':>8} {'rel err':>8}  config (bm x bn x bk, stages, warps, group, in-flight, layout)"]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            label = "WRONG" if r.get("wrong_output") else "ERROR"
            lines.append(f"{shape:<20} {r['backend']:<16} {label} {r['error'][:90]}")
            continue
        pct = "-" if r.get("pct_peak") is None else f"{r['pct_peak']:.1f}"
        ratio = "-" if "vs_xla" not in r else f"{r['vs_xla']:.3f}"
        lines.append(f"{shape:<20} {r['backend']:<16} {r['tflops']:>8.3g} {ratio:>7} {pct:>7} "
                     f"{r['ms']:>8.3f} {r['max_rel_error']:>8.1e}  {_short(r.get('config'))}")
    return "\n".join(lines)


def _short(config: dict | None) -> str:
    """bm x bn x bk, stages, warps, snake width + minor axis, wgmma groups in flight; then
    the Mosaic GPU layout knobs only where they differ from the plain cooperative kernel."""
    if not config:
        return ""
    text = f"{config['block_m']}x{config['block_n']}x{config['block_k']} s{config['num_stages']}"
    text += f" w{config['num_warps']} g{config['group_m']}{config['grid_minor']}"
    text += f" f{config.get('wgmma_in_flight', 0)}"
    if config.get("chain_tiles"):
        text += " chained"
    if config.get("cluster", "none") != "none":
        text += f" cluster-{config['cluster']}"
    if config.get("schedule", "cooperative") != "cooperative":
        text += f" {config['schedule']}"
    return text


def _geomean_large(rows, backend):
    ratios = [r["vs_xla"] for r in rows if r["backend"] == backend and "vs_xla" in r
              and tuple(r["shape"]) in LARGE_SHAPES]
    return float(np.exp(np.mean(np.log(ratios)))) if len(ratios) == len(LARGE_SHAPES) else None


_DEFAULTS = {"calls": 20, "bursts": 5, "input_sets": 4, "warmup_s": 1.0}
_QUICK_DEFAULTS = {"calls": 2, "bursts": 2, "input_sets": 2, "warmup_s": 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxopt-train bench matmul", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret backend (CPU)")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    parser.add_argument("--backends", help="comma list (default: every available one)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    # None: not given, so --quick may pick its own value (explicit values always win).
    parser.add_argument("--calls", type=int, default=None, help="calls per burst (default 20; "
                        "--quick: 2)")
    parser.add_argument("--bursts", type=int, default=None, help="default 5 (--quick: 2)")
    parser.add_argument("--input-sets", type=int, default=None,
                        help="rotating input sets, at least (default 4; --quick: 2); on a GPU a shape "
                             "gets more, up to 64, until they pass 128 MiB, over twice L2")
    parser.add_argument("--warmup-s", type=float, default=None, help="default 1.0 (--quick: 0)")
    parser.add_argument("--launches-per-dispatch", type=int, default=1, metavar="K",
                        help="run each backend on K input sets per jitted call (K divides "
                             "--input-sets), so host dispatch is paid once per K launches: "
                             "small shapes then show kernel time (default 1: one call each)")
    parser.add_argument("--shapes", metavar="MxNxK,...",
                        help="the A @ B table's shapes (default: the four large shapes, then "
                             "small and odd ones; the geomean needs all four large ones)")
    parser.add_argument("--no-plain", action="store_true", help="skip the A @ B table")
    parser.add_argument("--no-fused", action="store_true", help="skip the bias+gelu table")
    parser.add_argument("--no-layer", action="store_true",
                        help="skip the forward + backward table of the bias+gelu layer")
    args = parser.parse_args(argv)
    defaults = _QUICK_DEFAULTS if args.quick else _DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("calls", "bursts", "input_sets", "launches_per_dispatch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not 0 <= args.warmup_s < float("inf"):  # NaN fails this too
        parser.error(f"--warmup-s must be a finite number >= 0; got {args.warmup_s}")
    if args.input_sets % args.launches_per_dispatch:
        parser.error(f"--launches-per-dispatch {args.launches_per_dispatch} must divide "
                     f"--input-sets {args.input_sets} (each launch of a dispatch reads its own set)")
    if args.no_plain and args.no_fused and args.no_layer:  # it printed a header and exited 0
        parser.error("--no-plain, --no-fused and --no-layer together leave nothing to measure: "
                     "drop at least one")
    if args.no_plain and args.shapes is not None:
        parser.error(f"--shapes {args.shapes} sets the A @ B table, which --no-plain skips: "
                     "drop one of them")
    custom = None if args.shapes is None else parse_shapes(parser, "--shapes", args.shapes)
    known = [b for b in BACKENDS if b != "auto"] + ["xla_dot"]
    if args.backends and (unknown := [b for b in args.backends.split(",") if b not in known]):
        parser.error(f"--backends: unknown {unknown}; expected a comma list of {known}")
    listed = (args.backends or "").split(",")
    if repeats := sorted({b for i, b in enumerate(listed) if b in listed[:i]}):
        parser.error(f"--backends={args.backends!r} repeats {repeats}; give each backend once")
    for backend in [b for b in (args.backends or "").split(",") if b not in ("", "xla_dot")]:
        try:  # now, not as an ERROR row after the whole sweep
            resolve_backend(backend)
        except RuntimeError as err:
            parser.error(f"--backends {backend}: {err}; expected some of "
                         f"{available_backends() + ['xla_dot']} here")
    if args.json:  # last, once nothing else is refused: its folder is created now
        from jaxopt_train.bench.train_report import output_file_problem  # noqa: PLC0415

        problem = output_file_problem(args.json, overwrite=args.overwrite)
        if problem:
            parser.error(f"--json {args.json}: {problem}")

    device = jax.devices()[0]
    args.platform = device.platform  # the input sets' rotation (_set_count)
    if args.backends:
        backends = args.backends.split(",")
    elif args.quick:
        backends = ["interpret", "xla"]
    else:
        backends = [b for b in available_backends() if b != "interpret"]
    backends = ["xla_dot"] + [b for b in backends if b != "xla_dot"]
    shapes = custom or (QUICK_SHAPES if args.quick else LARGE_SHAPES + SMALL_SHAPES)
    fused_shapes = QUICK_SHAPES[:1] if args.quick else FUSED_SHAPES
    layer_shapes = QUICK_SHAPES[1:] if args.quick else LAYER_SHAPES
    dtype = jnp.dtype(args.dtype)
    peak = _peak(device.device_kind, dtype)
    header = {"device_kind": device.device_kind, "platform": device.platform,
              "jax": jax.__version__, "dtype": args.dtype, "backends": backends,
              "calls": args.calls, "bursts": args.bursts, "input_sets": args.input_sets,
              "launches_per_dispatch": args.launches_per_dispatch,
              "peak_tflops": None if peak is None else peak / 1e12}
    print(json.dumps(header), file=sys.stderr, flush=True)
    first = (shapes if not args.no_plain else fused_shapes if not args.no_fused else layer_shapes)[0]
    _prime(first, dtype, args)
    rows = [] if args.no_plain else [
        r for shape in shapes for r in _measure(_plain_fn, backends, shape, dtype, args, peak, fused=False)]
    fused_rows = [] if args.no_fused else [
        r for shape in fused_shapes
        for r in _measure(_fused_fn, backends, shape, dtype, args, peak, fused=True)]
    layer_rows = [] if args.no_layer else [
        r for shape in layer_shapes for r in _measure_layer(backends, shape, dtype, args, peak)]
    summary = {b: _geomean_large(rows, b) for b in backends if b != "xla_dot"}
    if args.json:
        # Serialised first, then swapped in whole: open(..., "w") emptied an --overwrite'd
        # file before json.dumps could refuse a NaN, and a crash mid-write left half of it.
        replace_text(args.json, json.dumps({**header, "plain": rows, "fused": fused_rows,
                                            "layer": layer_rows, "geomean_vs_xla_large": summary},
                                           indent=1, allow_nan=False))
    print(f"device: {device.device_kind}  jax {jax.__version__}  dtype {args.dtype}  "
          f"(median of {args.bursts} bursts x {args.calls} calls, >= {args.input_sets} rotating inputs, "
          f"{args.launches_per_dispatch} per dispatch)")
    if rows:
        print(_table(rows, "matmul: C = A @ B"))
    if fused_rows:
        print(_table(fused_rows, "fused: gelu(A @ B + bias); xla_dot = jax.nn.gelu(jnp.dot(A, B) + bias)"))
    if layer_rows:
        print(_table(layer_rows, "layer, forward + backward (dA, dB, dbias) of gelu(A @ B + bias); "
                                 "TFLOP/s of 3 x 2MNK; <backend>+saved keeps the pre-activation"))
    for backend, value in summary.items():
        if value is not None:
            print(f"geomean vs XLA over the 4 large shapes, {backend}: {value:.3f}")
    errors = [r for r in rows + fused_rows + layer_rows if "error" in r]
    # A wrong result fails any run; other errors (a backend that cannot compile a shape)
    # only the --quick smoke run.
    wrong = [f"{r['backend']} {'x'.join(map(str, r['shape']))} "
             f"({'layer' if r.get('layer') else 'fused' if r.get('fused') else 'plain'})"
             for r in errors if r.get("wrong_output")]
    if wrong:
        print(f"bench matmul: wrong output (vs the f32 reference) from {wrong}", file=sys.stderr)
    return 1 if wrong or (errors and args.quick) else 0


if __name__ == "__main__":
    raise SystemExit(main())
