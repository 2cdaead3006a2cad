"""One-shot diagnostic: what makes 2-GPU data-parallel gpt-1b scale >= 95%, and the ring beat psum.

    export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
    python tools/probe_dp.py                 # 2 GPUs, <= ~200 s; JSON at $OUT/dp_probe.json
    python tools/probe_dp.py --dry           # CPU, 8 emulated devices, gpt-tiny, tiny sizes

The driver never touches a device: it runs phases as subprocesses (XLA flags and
NCCL settings are process-wide and read once), each with its own env, in
priority order, each capped by what is left of the wall budget; a child writes
its JSON after every variant, so a phase cut short still reports what it had.

Phases (run in the order A, B, A-lhs, B-p2p, A-memcpy, A-cb; A keeps 40 s back for B):
  B      ring vs psum, f32 messages of 256 MiB and 1 GiB per device, flags of the
         "gpu-throughput" preset (what the train bench runs under):
           psum_f32 (the baseline), psum_bf16wire, rs_ag_nccl (NCCL reduce-scatter +
           all-gather), ring / ring_bidir / ring_c4 / ring_bf16 / ring_bidir_bf16 (the
           library's ring), and two 2-device candidates built here:
           xchg   reduce-scatter + all-gather with minimal copies (2 ppermutes);
           swap   x + ppermute(x): ONE exchange moving the same bytes per link direction as
                  RS + AG at n = 2, no dependent second phase (_c4: 4 pipelined chunks,
                  _bf16: bf16 wire, f32 add of the two rounded copies, bit-identical).
         At n = 2 one ring already uses both link directions (0->1 and 1->0 at once), so
         ring_bidir can only add calls; it is measured to show that.
  B-p2p  a few B variants at 1 GiB with NCCL_{MIN,MAX}_P2P_NCHANNELS=32 and
         NCCL_P2P_NVL_CHUNKSIZE=1 MiB (XLA lowers ppermute to grouped ncclSend/ncclRecv,
         whose channel count and chunk size these set; psum's ring is unaffected).
  A      gpt-1b DP step (bf16 compute, f32 master weights, AdamW, cudnn attention,
         donation, `--k` optimizer steps per dispatch as the bench does), 1 GPU vs 2:
           1gpu         the reference (per-device batch --per-device-batch)
           psum_tree    the bench's path: all_reduce_tree(psum) after the backward
           psum_leaf    one lax.psum per leaf (no bucket pack/unpack copies)
           psum_bf16    grads cast to bf16, psum, cast back (bf16 wire; the per-device
                        grads are already bf16-exact because params are cast to bf16 before
                        use, so the only loss is one bf16 rounding of the 2-rank sum; with
                        more ranks NCCL would also accumulate in bf16)
           overlap_f32  DDP-style: a custom_vjp identity on each block's params whose bwd
                        psums that block's grads, so each reduction is issued inside the
                        backward as soon as the block is done; step does no other reduce
           overlap_bf16 the same with a bf16 wire
         optional (--a-variants): swap_f32 / swap_bf16 (the B "swap" exchange after the
         backward), overlap_swap_f32 / overlap_swap_bf16 (swap inside the backward hooks).
         Compiles run in parallel threads (one gpt-1b compile is ~15 s); each variant is
         timed from a fresh copy of the same initial state. --dry also checks that every
         variant's synced grads equal psum(grads)/n (exactly one reduction of each grad).
  A-memcpy  1gpu, psum_bf16 and the swap exchange (after / inside the backward) with
         --xla_gpu_use_memcpy_local_p2p=true: ppermute as copy-engine peer copies.
  A-nch8, A-nch4  1gpu, psum_bf16, overlap_bf16 with NCCL capped at 8 / 4 channels (SMs).
  A-simple  the same with NCCL_PROTO=Simple.
  A-cb   1gpu, psum_bf16, overlap_bf16 with command buffers off and collectives on the
         highest-priority stream.
  A-lhs  overlap/psum under the latency-hiding scheduler with XLA's default combine
         threshold instead of the preset's 256 MiB (if time is left).

Reading: A's `scaling` column = t(1 GPU) / t(2 GPUs) (weak scaling, target >= 0.95);
B's `vs_psum` = t(psum f32, same size) / t(variant) (targets: f32 ring >= 0.95,
bf16-wire ring >= 1.6).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
AXIS = "data"

# ------------------------------------------------------------------ driver

PHASES = (
    # name, XLA preset, extra XLA flags, env, variants (None: all), min seconds to start,
    # seconds kept back for the phases after it
    ("A", "gpu-throughput", "", {}, None, 40, 40),
    ("B", "gpu-throughput", "", {}, None, 20, 0),
    ("A-lhs", "none", "--xla_gpu_enable_latency_hiding_scheduler=true", {},
     "psum_tree,overlap_f32,overlap_bf16", 45, 0),
    ("B-p2p", "gpu-throughput", "", {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_MAX_P2P_NCHANNELS": "32",
                                     "NCCL_P2P_NVL_CHUNKSIZE": "1048576"},
     "psum_f32,ring,swap,swap_bf16,xchg", 15, 0),
    # ppermute as copy-engine peer copies (cudaMemcpy between the process's GPUs) instead of
    # NCCL send/recv; psum stays NCCL.
    ("A-memcpy", "gpu-throughput", "--xla_gpu_use_memcpy_local_p2p=true", {},
     "1gpu,psum_bf16,swap_bf16,overlap_swap_bf16", 40, 0),
    # no CUDA-graph capture, collectives on the highest-priority stream: can the bf16
    # reduction overlap the backward once nothing is recorded into one graph?
    # fewer NCCL channels (CTAs, i.e. SMs) per all-reduce: the hooks already hide ~97% of
    # the NCCL time under the backward, so fewer SMs taken from the GEMMs may pay
    ("A-nch8", "gpu-throughput", "--xla_gpu_nccl_collective_max_nchannels=8", {},
     "1gpu,psum_bf16,overlap_bf16", 40, 0),
    ("A-nch4", "gpu-throughput", "--xla_gpu_nccl_collective_max_nchannels=4", {},
     "1gpu,psum_bf16,overlap_bf16", 40, 0),
    # NCCL's Simple protocol only (its tuner may pick LL/LL128, which poll on SMs for longer)
    ("A-simple", "gpu-throughput", "", {"NCCL_PROTO": "Simple"}, "1gpu,psum_bf16,overlap_bf16", 40, 0),
    ("A-cb", "gpu-throughput",
     "--xla_gpu_enable_command_buffer= --xla_gpu_enable_highest_priority_async_stream=true", {},
     "1gpu,psum_bf16,overlap_bf16", 40, 0),
)


def _flags_for(preset: str, extra: str, dry: bool) -> str:
    from jaxopt_train.runtime.xla_flags import format_xla_flags, preset_flags  # noqa: PLC0415

    flags = format_xla_flags(preset_flags(preset))
    parts = [os.environ.get("XLA_FLAGS", ""), flags, extra]
    if dry:
        parts.append("--xla_force_host_platform_device_count=8")
    return " ".join(p for p in parts if p)


def drive(args) -> int:
    start = time.time()
    deadline = start + args.budget
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    results = {"budget_s": args.budget, "dry": args.dry, "phases": {}}
    one_gpu_ms = None
    for name, preset, extra, env_extra, variants, min_s, reserve in PHASES:
        if args.phases and name not in args.phases.split(","):
            continue
        left = deadline - time.time()
        if left < min_s:
            results["phases"][name] = {"skipped": f"only {left:.0f} s left (needs >= {min_s} s)"}
            print(f"[probe] skip {name}: {left:.0f} s left", flush=True)
            continue
        if args.phases and "B" not in args.phases.split(","):
            reserve = 0  # nothing of B's to keep time for
        fd, path = tempfile.mkstemp(suffix=f"_{name}.json")
        os.close(fd)
        env = dict(os.environ, XLA_FLAGS=_flags_for(preset, extra, args.dry),
                   XLA_PYTHON_CLIENT_PREALLOCATE="false", **env_extra)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name.split("-")[0],
               "--json", path, "--deadline", str(deadline - reserve - 3), "--k", str(args.k),
               "--per-device-batch", str(args.per_device_batch)]
        if name == "A" and args.a_variants:
            variants = args.a_variants
        if variants:
            cmd += ["--variants", variants]
        if one_gpu_ms:
            cmd += ["--one-gpu-ms", str(one_gpu_ms)]
        if args.profile_variants:
            cmd += ["--profile-variants", args.profile_variants, "--profile-calls", str(args.profile_calls)]
        cmd += ["--calls", str(args.calls)]
        if args.dry:
            cmd.append("--dry")
        print(f"[probe] phase {name} (+{time.time() - start:.0f} s) XLA_FLAGS={env['XLA_FLAGS']!r} "
              f"{ {k: v for k, v in env_extra.items()} }", flush=True)
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, env=env, timeout=max(1.0, deadline - reserve - time.time())).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            with open(path) as f:
                phase = json.load(f)
        except (OSError, ValueError):
            phase = {}
        phase.update(rc=rc, wall_s=round(time.time() - t0, 1), xla_flags=env["XLA_FLAGS"], env=env_extra)
        results["phases"][name] = phase
        for row in phase.get("rows", []):
            if row.get("name") == "1gpu" and "step_ms" in row:
                one_gpu_ms = row["step_ms"]
        os.unlink(path)
        _write(results, out_dir)
    results["total_s"] = round(time.time() - start, 1)
    _write(results, out_dir)
    print(render(results))
    return 0


def _write(results, out_dir):
    with open(os.path.join(out_dir, "dp_probe.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


def render(results) -> str:
    lines = [f"== dp probe (total {results.get('total_s')} s; JSON: $OUT/dp_probe.json) =="]
    for name, phase in results["phases"].items():
        if "skipped" in phase:
            lines.append(f"[{name}] skipped: {phase['skipped']}")
            continue
        lines.append(f"[{name}] rc={phase.get('rc')} {phase.get('wall_s')} s env={phase.get('env')} "
                     f"devices={phase.get('device_kind')} reached={phase.get('stage')}")
        for row in phase.get("rows", []):
            if "error" in row:
                lines.append(f"  {row['name']:<24} ERROR {row['error'][:150]}")
            elif name.startswith("A"):
                over = row.get("over_1gpu_ms")
                lines.append(f"  {row['name']:<17} {row['step_ms']:8.2f} ms/step  scaling "
                             f"{_fmt(row.get('scaling'))}  +{'-' if over is None else f'{over:.2f}'} ms vs 1 GPU"
                             f"  loss {row['loss']:.4f}")
                lines += _overlap_lines(row.get("overlap"))
            else:
                lines.append(f"  {row['name']:<18} {row['size_mib']:6.0f} MiB {row['ms']:8.3f} ms "
                             f"{row['bus_gbps']:7.1f} GB/s  vs_psum {_fmt(row.get('vs_psum'))}  "
                             f"max_err {row['max_err']:.2e}")
        for key in ("lower_s", "parallel_compile_s"):
            if key in phase:
                lines.append(f"  {key}: {phase[key]:.1f}")
        for note in phase.get("notes", []):
            lines.append(f"  note: {note}")
    lines += summary(results)
    return "\n".join(lines)


def _overlap_lines(report) -> list[str]:
    if not report:
        return []
    sched = report.get("schedule", {})
    lines = [f"    schedule: async collectives {sched.get('async_pairs')}, with nothing between start and done "
             f"{sched.get('with_nothing_between')}, with a GEMM between {sched.get('with_gemm_between')}"]
    for g in report.get("trace", []):
        lines.append(f"    {g['device']}: collectives {g['collective_ms']:.2f} ms/step, concurrent with compute "
                     f"{g['concurrent_ms']:.2f}, exposed {g['exposed_ms']:.2f}; compute {g['compute_ms']:.2f}, "
                     f"idle {g['idle_ms']:.2f}, span {g['span_ms']:.2f}; kernels {g['collective_kernels'][:2]}")
    if "trace_error" in report:
        lines.append(f"    trace error: {report['trace_error'][:150]}")
    return lines


def summary(results) -> list[str]:
    """One line per question: best DP scaling, best f32 and bf16-wire all-reduce vs psum f32."""
    out = []
    a_rows = [(phase, r) for phase, p in results["phases"].items() if phase.startswith("A")
              for r in p.get("rows", []) if r.get("scaling") is not None]
    if a_rows:
        phase, best = max(a_rows, key=lambda pr: pr[1]["scaling"])
        out.append(f"BEST DP step: {phase}/{best['name']} scaling {best['scaling']:.3f} (target 0.95)")
    b_rows = [(phase, r) for phase, p in results["phases"].items() if phase.startswith("B")
              for r in p.get("rows", []) if r.get("vs_psum") is not None]
    for label, is_bf16 in (("f32 wire", False), ("bf16 wire", True)):
        for size in sorted({r["size_mib"] for _, r in b_rows}):
            pick = [(ph, r) for ph, r in b_rows if r["size_mib"] == size and ("bf16" in r["name"]) == is_bf16
                    and not r["name"].startswith("psum")]
            if pick:
                ph, r = max(pick, key=lambda pr: pr[1]["vs_psum"])
                out.append(f"BEST {label} non-psum @ {size:.0f} MiB: {ph}/{r['name']} {r['vs_psum']:.3f}x psum f32 "
                           f"({r['bus_gbps']:.0f} GB/s; target {'1.6' if is_bf16 else '0.95'})")
    return out


def _fmt(x) -> str:
    return "   -  " if x is None else f"{x:6.3f}"


# ------------------------------------------------------------------ child plumbing

class Recorder:
    """Collects rows and rewrites the phase JSON after each one (a killed child keeps them)."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline, self.data = path, deadline, {"rows": [], "notes": []}

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.flush()
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        print(f"[probe]   {shown}", flush=True)

    def flush(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, default=str)

    def stage(self, what: str) -> None:
        """Records how far the phase got (shown when the driver has to kill it)."""
        self.data["stage"] = what
        self.flush()

    def left(self) -> float:
        return self.deadline - time.time()


# ------------------------------------------------------------------ phase B: ring vs psum

def swap_all_reduce(x, axis, *, wire=None, chunks: int = 1):
    """2-device all-reduce as ONE exchange: x + ppermute(x). Found here, it is now what the
    library's `ring_all_reduce` does on 2 devices (`collectives.ring.exchange_all_reduce`)."""
    from jaxopt_train.collectives import ring_all_reduce  # noqa: PLC0415

    return ring_all_reduce(x, axis, wire_dtype=wire, num_chunks=chunks)


def exchange_all_reduce(x, axis, *, wire=None):
    """2-device reduce-scatter + all-gather with minimal copies: send the peer's half, add it to
    mine (f32), send my summed half back; assemble with one fused concat + dynamic slice."""
    import jax.numpy as jnp  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    perm = [(0, 1), (1, 0)]
    idx = lax.axis_index(axis)
    flat = x.reshape(-1)
    halves = jnp.pad(flat, (0, flat.size % 2)).reshape(2, -1)
    wire = x.dtype if wire is None else wire
    peer_half = lax.dynamic_index_in_dim(halves, 1 - idx, keepdims=False)
    my_half = lax.dynamic_index_in_dim(halves, idx, keepdims=False)
    got = lax.ppermute(peer_half.astype(wire), axis, perm)
    summed = (my_half.astype(jnp.float32) + got.astype(jnp.float32)).astype(wire)
    other = lax.ppermute(summed, axis, perm)
    mine = summed.astype(x.dtype)
    full = jnp.concatenate([mine, other.astype(x.dtype), mine])
    out = lax.dynamic_slice_in_dim(full, idx * mine.size, 2 * mine.size)
    return out[: flat.size].reshape(x.shape)


def b_variants():
    import jax.numpy as jnp  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    from jaxopt_train.collectives import ring_all_reduce  # noqa: PLC0415

    bf16 = jnp.bfloat16

    def rs_ag(x):
        shard = lax.psum_scatter(x.reshape(2, -1), AXIS, scatter_dimension=0, tiled=True)
        return lax.all_gather(shard, AXIS, axis=0, tiled=True).reshape(x.shape)

    return {
        "psum_f32": lambda x: lax.psum(x, AXIS),
        "psum_bf16wire": lambda x: lax.psum(x.astype(bf16), AXIS).astype(x.dtype),
        "rs_ag_nccl": rs_ag,
        "ring": lambda x: ring_all_reduce(x, AXIS),
        "ring_bidir": lambda x: ring_all_reduce(x, AXIS, bidirectional=True),
        "ring_c4": lambda x: ring_all_reduce(x, AXIS, num_chunks=4),
        "ring_bf16": lambda x: ring_all_reduce(x, AXIS, wire_dtype=bf16),
        "ring_bidir_bf16": lambda x: ring_all_reduce(x, AXIS, bidirectional=True, wire_dtype=bf16),
        "xchg": lambda x: exchange_all_reduce(x, AXIS),
        "xchg_bf16": lambda x: exchange_all_reduce(x, AXIS, wire=bf16),
        "swap": lambda x: swap_all_reduce(x, AXIS),
        "swap_c4": lambda x: swap_all_reduce(x, AXIS, chunks=4),
        "swap_bf16": lambda x: swap_all_reduce(x, AXIS, wire=bf16),
        "swap_bf16_c4": lambda x: swap_all_reduce(x, AXIS, wire=bf16, chunks=4),
    }


def phase_b(args, rec: Recorder) -> None:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from jaxopt_train.bench.collectives import time_burst  # noqa: PLC0415

    devices = jax.devices()[:2]
    rec.data.update(device_kind=devices[0].device_kind, jax=jax.__version__, num_devices=2)
    rec.stage("started")
    mesh = jax.sharding.Mesh(np.asarray(devices), (AXIS,))
    sizes = [1 * MIB, 4 * MIB] if args.dry else [256 * MIB, 1024 * MIB]
    timing = dict(warmup=2, bursts=3, iters=3) if args.dry else dict(warmup=3, bursts=5, iters=8)
    variants = b_variants()
    chosen = args.variants.split(",") if args.variants else list(variants)
    if args.child == "B" and args.variants:  # B-p2p: the large size only
        sizes = sizes[-1:]
    for nbytes in sizes:
        n = nbytes // 4
        sharding = NamedSharding(mesh, P(AXIS))
        # Values exactly representable in bf16 and their sums in f32: every variant's error is
        # then rounding of the SUM only (0 for f32 wires; <= 2^-8 relative for bf16 wires).
        x = jax.jit(lambda: (jax.random.randint(jax.random.key(0), (2 * n,), -64, 64)
                             .astype(jnp.float32) / 8), out_shardings=sharding)()
        want = None
        base_s = None
        for name in chosen:
            if rec.left() < 4:
                rec.data["notes"].append(f"deadline: stopped before {name} @ {nbytes // MIB} MiB")
                return
            row = {"name": name, "size_mib": nbytes / MIB}
            try:
                fn = jax.jit(jax.shard_map(variants[name], mesh=mesh, in_specs=P(AXIS),
                                           out_specs=P(AXIS), check_vma=False))
                t0 = time.perf_counter()
                fn = fn.lower(x).compile()
                row["compile_s"] = time.perf_counter() - t0
                out = fn(x)
                if want is None:
                    want = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, AXIS), mesh=mesh, in_specs=P(AXIS),
                                                 out_specs=P(AXIS), check_vma=False))(x)
                row["max_err"] = float(jnp.max(jnp.abs(out - want)))
                del out
                sec = time_burst(fn, (x,), **timing)
                row.update(ms=sec * 1e3, bus_gbps=nbytes / sec / 1e9)  # 2(n-1)/n = 1 at n = 2
                if name == "psum_f32":
                    base_s = sec
                row["vs_psum"] = None if base_s is None else base_s / sec
            except Exception as err:  # noqa: BLE001 - one failure must not lose the rest
                row["error"] = f"{type(err).__name__}: {err}"
            rec.add(row)
        del x, want


# ------------------------------------------------------------------ phase A: the DP step

A_DEFAULT = ("1gpu", "psum_tree", "overlap_bf16", "overlap_f32", "psum_bf16", "psum_leaf")
A_VARIANTS = A_DEFAULT + ("swap_f32", "swap_bf16", "overlap_swap_f32", "overlap_swap_bf16")


def reducing_identity(reduce_fn):
    """Identity on a pytree whose VJP applies `reduce_fn` to the cotangents (a DDP hook)."""
    import jax  # noqa: PLC0415

    @jax.custom_vjp
    def ident(tree):
        return tree

    def fwd(tree):
        return tree, None

    def bwd(_, cotangents):
        return (reduce_fn(cotangents),)

    ident.defvjp(fwd, bwd)
    return ident


def _block_groups(params):
    """Leaf-index groups: one per transformer block ('blocks', i), one per other top-level module."""
    import jax  # noqa: PLC0415

    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    groups: dict = {}
    for i, path in enumerate(paths):
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
        groups.setdefault(tuple(keys[:2]) if keys[0] == "blocks" else (keys[0],), []).append(i)
    return list(groups.values())


def _reduce_tree(tree, wire, swap: bool = False):
    """Sum over AXIS of every leaf: lax.psum, or the 2-device one-exchange `swap_all_reduce`."""
    import jax  # noqa: PLC0415

    if swap:
        return jax.tree.map(lambda g: swap_all_reduce(g, AXIS, wire=wire), tree)
    return _psum_tree(tree, wire)


def _psum_tree(tree, wire):
    import jax  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    if wire is None:
        return jax.tree.map(lambda g: lax.psum(g, AXIS), tree)
    return jax.tree.map(lambda g: lax.psum(g.astype(wire), AXIS).astype(g.dtype), tree)


def build_step(workload, run, mesh, variant: str, k: int, state, *, check_grads: bool = False):
    """Lowered (not compiled) step of `variant`, mirroring train_steps._in_graph_step."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from jaxopt_train.bench import train_steps as ts  # noqa: PLC0415
    from jaxopt_train.collectives import all_reduce_tree  # noqa: PLC0415

    n = mesh.devices.size
    optimizer = ts.default_optimizer()
    graphdef = state[0]
    base_loss = ts.make_loss(graphdef, workload, run)
    wire = jnp.bfloat16 if variant.endswith("bf16") else None
    overlap = variant.startswith("overlap") and n > 1
    swap = "swap" in variant

    def loss(params, batch, model_state):
        if overlap:
            leaves, treedef = jax.tree.flatten(params)
            for group in _block_groups(params):
                hooked = reducing_identity(lambda ct: _reduce_tree(ct, wire, swap))([leaves[i] for i in group])
                for i, leaf in zip(group, hooked):
                    leaves[i] = leaf
            params = jax.tree.unflatten(treedef, leaves)
        return base_loss(params, batch, model_state)

    def sync(grads):
        if n == 1 or overlap:
            return grads if n == 1 else jax.tree.map(lambda g: g / n, grads)
        if variant == "psum_tree":
            summed = all_reduce_tree(grads, AXIS, method="psum")
        else:  # psum_leaf, psum_bf16, swap_f32, swap_bf16
            summed = _reduce_tree(grads, wire, swap)
        return jax.tree.map(lambda g: g / n, summed)

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    if check_grads:  # (synced grads, reference grads) on one batch, for the dry-mode check
        def grads_pair(params, batch, model_state):
            synced = sync(grad_fn(params, batch, model_state)[1])
            raw = jax.value_and_grad(base_loss, has_aux=True)(params, batch, model_state)[1]
            return synced, jax.tree.map(lambda g: lax.psum(g, AXIS) / n, raw)
        return grads_pair

    def one_step(st, batch):
        params, model_state, opt_state = st
        (value, new_model_state), grads = grad_fn(params, batch, model_state)
        grads = sync(grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        value = value if n == 1 else lax.pmean(value, AXIS)
        return (params, new_model_state, opt_state), value

    def per_device(st, batches):
        return lax.scan(one_step, st, batches)

    batches = jax.device_put(ts.host_batches(workload, k, run), NamedSharding(mesh, P(None, AXIS)))
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(None, AXIS)),
                            out_specs=(P(), P()), check_vma=False)
    with jax.numpy_dtype_promotion("standard"):
        lowered = jax.jit(sharded, donate_argnums=(0,)).lower(state[1], batches)
    return lowered, batches


def _check_variant_grads(chosen, model, extra, args, run, mesh, state, rec) -> None:
    """Dry mode: each 2-device variant's synced grads equal psum(grads)/n (one reduction each)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from jaxopt_train.bench import train_steps as ts  # noqa: PLC0415

    if state is None:
        return
    workload = ts.Workload(model, args.per_device_batch * 2, **extra)
    batch = jax.device_put(jax.tree.map(lambda v: v[0], ts.host_batches(workload, 1, run)),
                           NamedSharding(mesh, P(AXIS)))
    params, model_state, _ = state[1]
    for name in chosen:
        if name == "1gpu":
            continue
        pair = build_step(workload, run, mesh, name, 1, state, check_grads=True)
        fn = jax.jit(jax.shard_map(pair, mesh=mesh, in_specs=(P(), P(AXIS), P()), out_specs=(P(), P()),
                                   check_vma=False))
        with jax.numpy_dtype_promotion("standard"):
            got, want = fn(params, batch, model_state)
        err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        rec.data["notes"].append(f"grad check {name}: max rel err vs psum(grads)/n = {err:.2e}")
        print(f"[probe] grad check {name}: {err:.2e}", flush=True)


def phase_a(args, rec: Recorder) -> None:
    import concurrent.futures as cf  # noqa: PLC0415
    import gc  # noqa: PLC0415

    import jax  # noqa: PLC0415

    from jaxopt_train.bench import train_steps as ts  # noqa: PLC0415

    devices = jax.devices()
    gpu = jax.default_backend() == "gpu"
    rec.data.update(device_kind=devices[0].device_kind, jax=jax.__version__, k=args.k,
                    per_device_batch=args.per_device_batch)
    rec.stage("started")
    chosen = (args.variants.split(",") if args.variants else list(A_DEFAULT))
    unknown = [v for v in chosen if v not in A_VARIANTS]
    if unknown:
        raise ValueError(f"unknown phase-A variants {unknown}; legal values: {A_VARIANTS}")
    model, extra = ("gpt-tiny", dict(seq_len=32, n_layers=2)) if args.dry else ("gpt-1b", {})
    run = ts.RunConfig("optimised", policy="bf16", attention="cudnn" if gpu else "xla",
                       accumulation="scan", donate=True)
    timing = dict(warmup=1, bursts=2, calls=1) if args.dry else dict(warmup=2, bursts=3, calls=args.calls)
    meshes = {1: ts.data_mesh(devices[:1]), 2: ts.data_mesh(devices[:2])}
    states = {}
    lowered = {}
    t0 = time.perf_counter()
    for name in chosen:
        n = 1 if name == "1gpu" else 2
        workload = ts.Workload(model, args.per_device_batch * n, **extra)
        try:
            if n not in states:
                states[n] = ts.init_state(workload, run, meshes[n], ts.default_optimizer())
            lowered[name] = (n, *build_step(workload, run, meshes[n], name, args.k, states[n]))
        except Exception as err:  # noqa: BLE001
            rec.add({"name": name, "error": f"lower: {type(err).__name__}: {err}"})
    rec.data["lower_s"] = time.perf_counter() - t0
    rec.stage("lowered")
    if args.dry:
        _check_variant_grads(chosen, model, extra, args, run, meshes[2], states.get(2), rec)
    print(f"[probe] lowered {list(lowered)} in {rec.data['lower_s']:.1f} s; compiling in parallel", flush=True)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=max(1, len(lowered))) as pool:
        futures = {name: pool.submit(low.compile) for name, (_, low, _) in lowered.items()}
    rec.data["parallel_compile_s"] = time.perf_counter() - t0
    rec.stage("compiled")
    one_gpu_s = args.one_gpu_ms / 1e3 if args.one_gpu_ms else None
    for name, (n, _, batches) in lowered.items():
        row = {"name": name, "devices": n, "compile_s": rec.data["parallel_compile_s"]}
        try:
            if rec.left() < 6:
                rec.data["notes"].append(f"deadline: stopped before timing {name}")
                break
            compiled = futures[name].result()
            state = jax.tree.map(lambda a: a.copy(), states[n][1])
            step = lambda s, c=compiled, b=batches: c(s, b)  # noqa: E731
            for _ in range(timing["warmup"]):
                state, losses = step(state)
            jax.block_until_ready(state)
            walls = []
            for _ in range(timing["bursts"]):
                t1 = time.perf_counter()
                for _ in range(timing["calls"]):
                    state, losses = step(state)
                jax.block_until_ready((state, losses))
                walls.append((time.perf_counter() - t1) / (timing["calls"] * args.k))
            sec = sorted(walls)[len(walls) // 2]
            row.update(step_ms=sec * 1e3, loss=float(losses[-1]), bursts_ms=[w * 1e3 for w in walls])
            if name == "1gpu":
                one_gpu_s = sec
            row["scaling"] = None if one_gpu_s is None or n == 1 else one_gpu_s / sec
            row["over_1gpu_ms"] = None if one_gpu_s is None or n == 1 else (sec - one_gpu_s) * 1e3
            if name in (args.profile_variants or "").split(","):
                state, row["overlap"] = _profile_overlap(name, step, state, compiled, args)
            del state, losses, compiled
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"
        futures.pop(name, None)
        gc.collect()
        rec.add(row)
    if args.one_gpu_ms:
        rec.data["notes"].append(f"scaling vs phase A's 1-GPU step ({args.one_gpu_ms:.2f} ms)")


def _profile_overlap(name, step, state, compiled, args):
    """Traces `--profile-calls` dispatches: NCCL time under compute, and XLA's schedule."""
    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415

    from jaxopt_train.runtime.overlap import async_collective_schedule, collective_overlap  # noqa: PLC0415

    out_dir = os.environ.get("OUT", "/tmp")
    logdir = os.path.join(out_dir, f"trace_dp_{name}")
    text = compiled.as_text()
    with open(os.path.join(out_dir, f"hlo_dp_{name}.txt"), "w") as f:
        f.write(text)
    pairs = async_collective_schedule(text)
    report = {"schedule": {"async_pairs": len(pairs),
                           "with_nothing_between": sum(p.between == 0 for p in pairs),
                           "with_gemm_between": sum(p.gemms_between > 0 for p in pairs),
                           "pairs": [dataclasses.asdict(p) for p in pairs[:60]]}}
    try:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(args.profile_calls):
                state, losses = step(state)
            jax.block_until_ready((state, losses))
        report["trace"] = [dataclasses.asdict(d) for d in
                           collective_overlap(logdir, steps=args.k * args.profile_calls)]
    except Exception as err:  # noqa: BLE001 - the timing row stays useful
        report["trace_error"] = f"{type(err).__name__}: {err}"
    return state, report


def child(args) -> int:
    rec = Recorder(args.json, args.deadline)
    rec.flush()
    try:
        (phase_a if args.child == "A" else phase_b)(args, rec)
    except Exception as err:  # noqa: BLE001 - keep what was recorded
        rec.data["notes"].append(f"phase failed: {type(err).__name__}: {err}")
    rec.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU: 8 emulated devices, gpt-tiny, tiny sizes")
    p.add_argument("--budget", type=float, default=200.0, help="hard wall-clock cap, seconds")
    p.add_argument("--phases", help="comma list of phases to run (default all: A,B,A-lhs,B-p2p)")
    p.add_argument("--k", type=int, default=4, help="optimizer steps per dispatch (bench default 4)")
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--a-variants", help="phase A variants, comma list (default: 1gpu,psum_tree,"
                   "overlap_bf16,overlap_f32,psum_bf16,psum_leaf; also swap_f32, swap_bf16, "
                   "overlap_swap_f32, overlap_swap_bf16: the one-exchange 2-GPU reduce)")
    p.add_argument("--profile-variants", default="",
                   help="phase-A variants to trace once: NCCL time hidden under compute, and "
                        "what XLA scheduled between each collective's start and done")
    p.add_argument("--profile-calls", type=int, default=1, help="dispatches traced per profiled variant")
    p.add_argument("--calls", type=int, default=2, help="phase A: dispatches per timed burst")
    p.add_argument("--child", choices=("A", "B"), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--variants", help=argparse.SUPPRESS)
    p.add_argument("--one-gpu-ms", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
