"""Where does a gpt-1b training step spend its time? A one-GPU diagnostic.

    python tools/probe_gpt1b.py [--dry] [--variants v0,v1,...] [--profile]

Times the bench's optimised step (`jaxopt_train.bench.train_steps`) under a few
variants (precision policy, optimizer-state dtype, remat, micro-batches), each
with warm-up and bursts, and reports step time, MFU and XLA's memory estimate.
With --profile it also traces a few steps of the first variant and sums GPU
kernel time by kernel and by kind (matmul, attention, fusion, ...), so the gap
to the matmul-bound step is visible. Writes $OUT/gpt1b_probe.json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

VARIANTS = {
    # name: (policy, opt_state_dtype, remat, microbatches[, grad_dtype[, RunConfig fields]])
    "v0": ("bf16", "f32", "none", 1),
    "opt": ("bf16", "bf16", "none", 1, "compute"),  # the bench's optimised column
    "optcopy": ("bf16", "bf16", "none", 1, "compute", {"compute_copy": True}),
    "optsplit": ("bf16", "bf16", "none", 1, "compute", {"split_qkv": True}),
    "optboth": ("bf16", "bf16", "none", 1, "compute", {"compute_copy": True, "split_qkv": True}),
    # with --matmul pallas: fc + bias + GELU in one kernel launch (GPTConfig.fuse_mlp_activation),
    # and explicitly without. `opt` takes the default: fused in the thirteenth session's calls
    # 4 and 5 and again from the fifteenth session on, unfused in between.
    "optfuse": ("bf16", "bf16", "none", 1, "compute", {"fuse_mlp_activation": True}),
    "optnofuse": ("bf16", "bf16", "none", 1, "compute", {"fuse_mlp_activation": False}),
    "pure": ("bf16-pure", "f32", "none", 1),
    "st16": ("bf16", "bf16", "none", 1),
    "dots16": ("bf16", "bf16", "dots", 1),
    "dotsattn16": ("bf16", "bf16", "dots_attention", 1),  # cuDNN attention's forward saved too
    "full16": ("bf16", "bf16", "full", 1),
    "dots16m2": ("bf16", "bf16", "dots", 2),
    "none16m4": ("bf16", "bf16", "none", 4),
}


def _kind(name: str) -> str:
    n = name.lower()
    # Attention first: cuDNN's flash kernels carry "wgmma" in their names too.
    if any(s in n for s in ("cudnn", "flash", "fmha", "sdpa", "attn")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "matmul", "mosaic")):
        return "matmul"
    if "scatter" in n:
        return "scatter"
    if "reduce" in n or "softmax" in n:
        return "reduction"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    return "fusion/other"


def summarise_trace(logdir: str, steps: int) -> dict:
    from jaxopt_train.runtime.overlap import read_trace

    try:
        trace = read_trace(logdir)
    except FileNotFoundError as err:
        return {"error": str(err)}
    events, pnames, tnames = trace.events, trace.processes, trace.threads
    gpu_pids = {p for p, n in pnames.items() if "gpu" in n.lower() or "device" in n.lower()}
    streams = trace.gpu_streams
    ops_threads = {key for key, n in tnames.items() if key[0] in gpu_pids and "xla ops" in n.lower()}
    by_name, by_kind, by_op = collections.Counter(), collections.Counter(), collections.Counter()
    calls = collections.Counter()
    # Every Mosaic GPU launch is named bound_mosaic_gpu_kernel: its launch shape (grid, block,
    # shared memory) tells two products apart (what tools/trace_kernels.py prints).
    by_launch, launches = collections.Counter(), collections.Counter()
    first, last, samples = None, None, []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        key = (e.get("pid"), e.get("tid"))
        dur = float(e.get("dur", 0.0))
        name = e.get("name", "?")
        if key in ops_threads:
            by_op[name[:70]] += dur
            continue
        if streams and key not in streams:
            continue
        by_name[name[:90]] += dur
        calls[name[:90]] += 1
        launch = (name[:90], (e.get("args") or {}).get("kernel_details", ""))
        by_launch[launch] += dur
        launches[launch] += 1
        by_kind[_kind(name)] += dur
        if len(samples) < 5 and e.get("args"):
            samples.append({"name": name[:60], "args": e["args"]})
        ts = float(e.get("ts", 0.0))
        first = ts if first is None else min(first, ts)
        last = ts + dur if last is None else max(last, ts + dur)
    busy = sum(by_kind.values())
    return {
        "trace": trace.path, "gpu_processes": [pnames[p] for p in gpu_pids], "steps": steps,
        "sample_args": samples,
        "threads": sorted({n for (p, _), n in tnames.items() if p in gpu_pids})[:30],
        "busy_ms_per_step": busy / 1e3 / steps,
        "span_ms_per_step": ((last or 0) - (first or 0)) / 1e3 / steps,
        "by_kind_ms_per_step": {k: v / 1e3 / steps for k, v in by_kind.most_common()},
        "top_kernels_ms_per_step": [(k, v / 1e3 / steps) for k, v in by_name.most_common(45)],
        "top_ops_ms_per_step": [(k, v / 1e3 / steps) for k, v in by_op.most_common(30)],
        # every kernel: (name, ms per step, launches per step), to diff two variants' traces
        "all_kernels": [(k, v / 1e3 / steps, calls[k] / steps) for k, v in by_name.most_common()],
        # (name, launch details, ms per step, launches per step, mean us per launch)
        "by_launch": [(n, d, v / 1e3 / steps, launches[(n, d)] / steps, v / launches[(n, d)])
                      for (n, d), v in by_launch.most_common(60)],
    }


def run_variant(name, spec, args, out_dir):
    import jax

    from jaxopt_train.bench import _timing, train_steps
    from jaxopt_train.runtime import fits

    policy, state_dtype, remat, micro, grad_dtype, extra = (*spec, *("param", {})[len(spec) - 4:])
    workload = train_steps.Workload(args.model, args.batch, micro, seq_len=args.seq_len,
                                    n_layers=args.layers)
    run = train_steps.RunConfig(name, policy=policy, attention=args.attention,
                                accumulation="scan", donate=True, remat=remat,
                                opt_state=state_dtype, grad_dtype=grad_dtype, matmul=args.matmul,
                                **extra)
    runner = train_steps.build_runner(workload, run, train_steps.data_mesh(jax.devices()[:1]))
    mem = fits(runner.compiled[0], budget=2**60)
    state, runner.state = runner.state, None
    state = _timing.warm_up(runner.step, state, args.warmup, args.warmup_s)
    state, timing = _timing.time_bursts(runner.step, state, bursts=args.bursts,
                                        calls_per_burst=args.calls, steps_per_call=1)
    step_s = timing.step_s
    row = {"variant": name, **extra, "matmul": args.matmul, "matmul_config": args.matmul_config,
           "epilogue_bwd": args.epilogue_bwd, "policy": policy, "opt_state": state_dtype, "remat": remat,
           "microbatches": micro, "step_ms": step_s * 1e3,
           "tflops": workload.flops_per_step / step_s / 1e12,
           "mfu": workload.flops_per_step / step_s / 1e12 / args.peak,
           "needed_gib": mem.needed_bytes / 2**30, "temp_gib": mem.temp_bytes / 2**30,
           "args_gib": mem.argument_bytes / 2**30, "compile_s": runner.compile_s,
           "bursts_ms": [w * 1e3 for w in timing.wall_s]}
    if args.profile and name == args.variants[0]:
        logdir = os.path.join(out_dir, "trace_" + name + args.tag)
        jax.block_until_ready(state)
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(args.profile_steps):
                state, loss = runner.step(state)
            jax.block_until_ready((state, loss))
        row["profile"] = summarise_trace(logdir, args.profile_steps)
        with open(os.path.join(out_dir, f"hlo_{name}{args.tag}.txt"), "w") as f:
            f.write(runner.compiled[0].as_text())
    del state
    return row


def _force_matmul_config(fields: dict) -> None:
    """Every kernel launch gets the shipped default with `fields` replaced (a probe-only
    override: the library resolves a config per shape, from the autotune cache first)."""
    import dataclasses as dc
    import importlib

    mm = importlib.import_module("jaxopt_train.kernels.matmul_vjp")
    resolve = mm.resolve_config

    def forced(backend, m, n, k, dtype, transposed=None):
        return dc.replace(resolve(backend, m, n, k, dtype, transposed), **fields)

    mm.resolve_config = forced


def _force_epilogue_backward(spec: str) -> None:
    """Probe-only: the fused MLP's backward (`kernels.matmul_vjp._epilogue_backward`) in a given
    formulation, to time it inside the step. SPEC is FORM or FORM+split:
      tanh     GELU's derivative by autodiff of the tanh form in Z's dtype (bf16), the
               fourteenth session's backward;
      sigmoid  the closed form through s = sigmoid(2u) in f32 (`epilogue.gelu_derivative`);
      +split   dZ written by its own elementwise pass and summed for dbias by a second one
               (an optimization barrier between), instead of XLA's single column-reduce pass.
    The library ships sigmoid+split on GPU backends (fifteenth session: 132 + 43 us per fc
    layer in the step, against 219 us for tanh in one pass)."""
    import importlib

    import jax
    import jax.numpy as jnp

    from jaxopt_train.kernels.epilogue import gelu

    mm = importlib.import_module("jaxopt_train.kernels.matmul_vjp")
    shipped = mm._epilogue_backward
    form, _, split = spec.partition("+")
    if form not in ("tanh", "sigmoid") or split not in ("", "split"):
        raise SystemExit(f"--epilogue-bwd: expected tanh, sigmoid, tanh+split or sigmoid+split; "
                         f"got {spec!r}")

    def backward(activation, z, g, bias, compute_dtype, split_sum=False):
        if activation != "gelu":
            return shipped(activation, z, g, bias, compute_dtype, split_sum)
        if form == "sigmoid":  # the library's own derivative, split or not as asked
            return shipped(activation, z, g, bias, compute_dtype, bool(split))
        _, act_vjp = jax.vjp(gelu, z)
        dz = act_vjp(g.astype(z.dtype))[0].astype(compute_dtype)
        if split:
            dz = jax.lax.optimization_barrier(dz)
        dbias = None if bias is None else jnp.sum(dz.astype(jnp.float32), axis=0).astype(bias.dtype)
        return dz, dbias

    mm._epilogue_backward = backward


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU: gpt-tiny, tiny shapes")
    p.add_argument("--variants", default="v0,pure,st16,dots16,full16,dots16m2")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--xla-preset", default="gpu-throughput", help="jaxopt_train.runtime preset")
    p.add_argument("--xla-extra", default=None, help="more XLA flags, '--name=value ...'")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    p.add_argument("--bursts", type=int, default=None, help="timed bursts (default 3)")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="keep warming up until this many seconds have passed")
    p.add_argument("--matmul", default="xla", help="dense-layer kernel: xla, pallas or triton")
    p.add_argument("--matmul-config", default=None,
                   help="JSON of MatmulConfig fields over the device's shipped default, used for "
                        "every kernel launch of the step (in-situ tiling comparison)")
    p.add_argument("--epilogue-bwd", default=None,
                   help="the fused MLP's backward in a given formulation: tanh, sigmoid, "
                        "tanh+split or sigmoid+split (see _force_epilogue_backward)")
    args = p.parse_args(argv)
    from jaxopt_train.runtime import xla_flags

    print("[probe] XLA flags:", xla_flags(args.xla_preset, extra=args.xla_extra, apply=True).added, flush=True)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; legal: {sorted(VARIANTS)}")
    if args.dry:
        args.model, args.batch, args.seq_len, args.layers = "gpt-tiny", 8, 32, 1
        args.attention, args.warmup, args.calls, args.peak = "xla", 1, 2, 1.0
        args.bursts = args.bursts or 2
    else:
        args.model, args.batch, args.seq_len, args.layers = "gpt-1b", 8, None, None
        args.attention, args.warmup, args.calls, args.peak = "cudnn", 4, 8, 989.0
        args.bursts = args.bursts or 3
    if args.matmul_config:
        _force_matmul_config(json.loads(args.matmul_config))
    if args.epilogue_bwd:
        _force_epilogue_backward(args.epilogue_bwd)
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    rows, start = [], time.perf_counter()
    for name in args.variants:
        if time.perf_counter() - start > args.budget_s:
            print(f"[probe] time budget spent; skipping {name}", flush=True)
            continue
        try:
            row = run_variant(name, VARIANTS[name], args, out_dir)
        except Exception as err:  # noqa: BLE001 - report and go on with the next variant
            row = {"variant": name, "error": f"{type(err).__name__}: {str(err)[:600]}"}
        rows.append(row)
        print("[probe]", json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        with open(os.path.join(out_dir, f"gpt1b_probe{args.tag}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for row in rows:
        if "profile" in row:
            prof = row["profile"]
            print(json.dumps({k: v for k, v in prof.items()
                              if k not in ("top_kernels_ms_per_step", "top_ops_ms_per_step", "all_kernels",
                                           "by_launch")},
                             indent=1))
            for label in ("top_kernels_ms_per_step", "top_ops_ms_per_step"):
                print(label)
                for k, v in prof.get(label, []):
                    print(f"  {v:8.3f}  {k}")
    print(f"{'variant':10} {'policy':10} {'state':5} {'remat':5} {'mb':>2} {'ms':>8} "
          f"{'MFU':>6} {'needGiB':>8} {'compile':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:10} ERROR {r['error'][:200]}")
            continue
        print(f"{r['variant']:10} {r['policy']:10} {r['opt_state']:5} {r['remat']:5} "
              f"{r['microbatches']:>2} {r['step_ms']:8.2f} {100 * r['mfu']:5.1f}% "
              f"{r['needed_gib']:8.2f} {r['compile_s']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
