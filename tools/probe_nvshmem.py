"""Issue 4: a 2-GPU exchange whose cast and send are ONE Mosaic GPU kernel (peer stores).

    python tools/probe_nvshmem.py --single [--sizes 16M,256M,1G] [--configs 528x1024] \
        [--tma 64x32x4,128x64x3]            # one process, both GPUs (what works)
    python tools/probe_nvshmem.py --check-only   # two processes, one GPU each (fails, see below)

The library's bf16-wire exchange was three kernels: a cast (0.43 ms at 1 GiB), a ppermute (NCCL
send/recv, 1.41 ms) and an add (0.58 ms); nothing overlaps. Here each device's kernel reads its
f32 data, rounds it to the wire dtype, keeps that copy and stores it straight into the peer's
receive buffer through NVLink (`plgpu.remote_ref`); each CTA then signals the peer's semaphore
and waits for its own. XLA adds the two copies afterwards. The file is named after the first
plan, NVSHMEM: jax 0.11.2's XLA has no --xla_gpu_experimental_enable_nvshmem, so Mosaic GPU uses
XLA's collective metadata instead (peer pointers to symmetric buffers XLA allocates). That works
with one process driving both GPUs (`--single`); with two processes XLA's
ncclGetPeerDevicePointer failed (tenth session). The library's version is
`jaxopt_train.collectives.peer`.

Variants: `fused_gGRID_tTILE` (register loads and stores, GRID CTAs, TILE elements a step; the
library's kernel) and, with --tma, `tma_gGRID_rROWS_sSTAGES` (TMA pipeline of (ROWS x 128) tiles
through shared memory, STAGES in flight, few CTAs). Checks before timing: a one-tile peer store,
and every exchange on random data against the exact sum of the two rounded inputs, on both GPUs
(sizes up to 256 MiB). Multicast is never used (NCCL_NVLS_ENABLE=0: ../shared/GPU.md).
Writes $OUT/nvshmem_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(args) -> int:
    if args.single:  # one process driving both GPUs
        return worker(args)
    env = dict(os.environ, NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    # jax 0.11.2's XLA does not know --xla_gpu_experimental_enable_nvshmem; without it Mosaic GPU
    # uses XLA's collective metadata (peer pointers to symmetric buffers XLA allocates).
    env["PYTHONPATH"] = ROOT + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--port", str(port),
                               "--sizes", args.sizes, "--configs", args.configs, "--iters", str(args.iters),
                               "--bursts", str(args.bursts), "--tma", args.tma] + (["--check-only"] if args.check_only else []),
                              env=env) for r in range(2)]
    deadline = time.time() + args.timeout
    rcs = [None, None]
    while time.time() < deadline and None in rcs:
        rcs = [p.poll() for p in procs]
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
    rcs = [p.wait() for p in procs]
    print(f"[launch] worker exit codes {rcs}", flush=True)
    return 0 if rcs == [0, 0] else 1


def exchange_kernel_fn(axis, n, wire, grid, tile):
    """A function of this device's flat f32 `x` (n,) -> (mine, recv): mine = x rounded to `wire`,
    recv = the peer's rounded copy, stored here by the peer's kernel."""
    import jax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.numpy as jnp
    from jax import lax

    tiles = n // tile
    per_cta = -(-tiles // grid)

    def kernel(x_ref, mine_ref, recv_ref, sem_ref):
        cta = lax.axis_index("cta")
        peer = 1 - lax.axis_index(axis)

        @pl.loop(0, per_cta)
        def _tile(i):
            t = i * grid + cta

            @pl.when(t < tiles)
            def _send():
                span = pl.ds(t * tile, tile)
                v = x_ref[span].astype(wire)
                mine_ref[span] = v
                plgpu.remote_ref(recv_ref.at[span], peer)[...] = v

        pl.semaphore_signal(sem_ref.at[cta], 1, device_id=peer)
        pl.semaphore_wait(sem_ref.at[cta], 1)

    from jaxopt_train.kernels.mosaic_gpu import kernel_io_kwargs

    shape = jax.ShapeDtypeStruct((n,), wire)
    return plgpu.kernel(kernel, grid=(grid,), grid_names=("cta",),
                        **kernel_io_kwargs(plgpu, (shape, shape), [plgpu.SemaphoreType.REGULAR((grid,))]))


def tma_kernel_fn(axis, n, wire, grid, rows, stages):
    """The same exchange with few CTAs: each CTA pipelines (rows, 128) tiles through SMEM with TMA
    (emit_pipeline, `stages` in flight), casts in registers and TMA-stores to the peer's buffer.
    `n` must split into grid x whole tiles. Returns (mine, recv) of shape (n // 128, 128)."""
    import jax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    from jaxopt_train.kernels.mosaic_gpu import kernel_io_kwargs

    total_rows = n // 128
    per_cta = total_rows // (grid * rows)

    def kernel(x_ref, mine_ref, recv_ref, sem_ref):
        cta = lax.axis_index("cta")
        peer = {axis: 1 - lax.axis_index(axis)}
        span = pl.ds(cta * per_cta * rows, per_cta * rows)

        def body(_, x_smem, mine_smem, out_smem):
            v = x_smem[...].astype(wire)
            mine_smem[...] = v
            out_smem[...] = v

        spec = plgpu.BlockSpec((rows, 128), lambda i: (i, 0))
        plgpu.emit_pipeline(body, grid=(per_cta,), in_specs=[spec], out_specs=[spec, spec],
                            max_concurrent_steps=stages)(
            x_ref.at[span], mine_ref.at[span], plgpu.remote_ref(recv_ref.at[span], peer))
        plgpu.wait_smem_to_gmem(0)
        pl.semaphore_signal(sem_ref.at[cta], 1, device_id=peer)
        pl.semaphore_wait(sem_ref.at[cta], 1)

    shape = jax.ShapeDtypeStruct((total_rows, 128), wire)
    return plgpu.kernel(kernel, grid=(grid,), grid_names=("cta",),
                        **kernel_io_kwargs(plgpu, (shape, shape), [plgpu.SemaphoreType.REGULAR((grid,))]))


def worker(args) -> int:
    import jax

    if not args.single:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                                   process_id=args.rank, local_device_ids=[args.rank],
                                   initialization_timeout=60, heartbeat_timeout_seconds=10)
    else:
        args.rank = 0
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxopt_train.bench.collectives import fmt_size, parse_size, time_burst
    from jaxopt_train.collectives import ring_all_reduce

    say = (lambda *a: print("[rank0]", *a, flush=True)) if args.rank == 0 else (lambda *a: None)
    import jax.experimental.mosaic.gpu as mgpu
    info = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
            "local": [str(d) for d in jax.local_devices()]}
    for name in ("supports_cross_device_collectives", "is_nvshmem_available"):
        fn = getattr(mgpu, name, None)
        info[name] = None if fn is None else bool(fn())
    say(json.dumps(info))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    results = {"info": info, "rows": []}

    def global_array(host):  # host: (2, n) -> a (2n,) array sharded one row per device
        flat = host.reshape(-1)
        return jax.make_array_from_callback(flat.shape, sharding, lambda idx: flat[idx])

    def local(arr):  # {device index on the axis: this process's shard}
        index = {d: i for i, d in enumerate(mesh.devices.flat)}
        return {index[s.device]: np.asarray(s.data) for s in arr.addressable_shards}

    # 1. One tile stored into the peer's output.
    def tiny(x_ref, y_ref, sem):
        peer = 1 - lax.axis_index("data")
        plgpu.remote_ref(y_ref, peer)[...] = x_ref[...]
        pl.semaphore_signal(sem, 1, device_id=peer)
        pl.semaphore_wait(sem, 1)

    from jaxopt_train.kernels.mosaic_gpu import kernel_io_kwargs

    def tiny_kernel(x_ref, y_ref, sem):
        tiny(x_ref, y_ref, sem)

    tiny_call = plgpu.kernel(tiny_kernel, grid=(1,), grid_names=("cta",),
                             **kernel_io_kwargs(plgpu, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                                                [plgpu.SemaphoreType.REGULAR]))
    host = np.arange(2 * 8 * 128, dtype=np.float32).reshape(2, 8 * 128)
    fn = jax.jit(jax.shard_map(lambda x: tiny_call(x.reshape(8, 128)).reshape(-1), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data"), check_vma=False))
    got = local(fn(global_array(host)))
    ok = all(np.array_equal(v, host[1 - i]) for i, v in got.items())
    results["tiny_peer_store"] = ok
    print(f"[rank{args.rank}] tiny peer store: {'ok' if ok else 'WRONG'}", flush=True)

    wire, acc = jnp.bfloat16, jnp.float32
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.check_only:
        sizes = [4 << 20]
    for size in sizes:
        n = size // 4
        x = jax.make_array_from_callback(
            (2 * n,), sharding,
            lambda idx: np.random.default_rng(0).standard_normal(2 * n, dtype=np.float32)[idx])
        halves = None
        if n <= (64 << 20):  # exact reference on the host (both rows), affordable up to 256 MiB
            full = np.random.default_rng(0).standard_normal(2 * n, dtype=np.float32).reshape(2, n)
            import ml_dtypes
            halves = full.astype(ml_dtypes.bfloat16).astype(np.float32).sum(0)
        variants = {"psum": lambda v: lax.psum(v, "data"),
                    "lib": lambda v: ring_all_reduce(v, "data", wire_dtype=wire)}
        for grid, tile in configs:
            if n % tile:
                continue

            def fused(v, grid=grid, tile=tile):
                mine, recv = exchange_kernel_fn("data", n, wire, grid, tile)(v)
                return mine.astype(acc) + recv.astype(acc)
            variants[f"fused_g{grid}_t{tile}"] = fused
        for grid, rows, stages in [tuple(int(v) for v in c.split("x")) for c in args.tma.split(",") if c]:
            if n % (grid * rows * 128):
                continue

            def tma(v, grid=grid, rows=rows, stages=stages):
                mine, recv = tma_kernel_fn("data", n, wire, grid, rows, stages)(v.reshape(-1, 128))
                return (mine.astype(acc) + recv.astype(acc)).reshape(-1)
            variants[f"tma_g{grid}_r{rows}_s{stages}"] = tma
        base = None
        for name, body in variants.items():
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                      check_vma=False))
            try:
                out = local(f(x))
            except Exception as e:  # noqa: BLE001 - report and go on with the next variant
                print(f"[rank{args.rank}] {name} {fmt_size(size)} FAILED: {type(e).__name__}: "
                      f"{str(e)[:2000]}", flush=True)
                results["rows"].append({"size_bytes": size, "variant": name, "error": str(e)[:2000]})
                continue
            if halves is None:
                check = None
            elif name == "psum":
                check = all(np.allclose(v, full.sum(0), rtol=1e-6, atol=1e-6) for v in out.values())
            else:
                check = all(np.array_equal(v, halves) for v in out.values())
            if args.check_only:
                row = {"size_bytes": size, "variant": name, "checked": check}
            else:
                seconds = time_burst(f, (x,), warmup=3, iters=args.iters, bursts=args.bursts)
                row = {"size_bytes": size, "variant": name, "time_us": seconds * 1e6,
                       "f32_busbw_gbs": size / seconds / 1e9, "checked": check}
                base = base or row
                row["x_psum_f32"] = base["time_us"] / row["time_us"]
            results["rows"].append(row)
            print(f"[rank{args.rank}] " + json.dumps(row), flush=True)
        del x
    if args.rank == 0:
        out_dir = os.environ.get("OUT", "/tmp")
        with open(os.path.join(out_dir, "nvshmem_probe.json"), "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"\n{'size':>6} {'variant':<20} {'time_us':>10} {'f32 GB/s':>9} {'x psum':>7} check")
        for r in results["rows"]:
            if "time_us" in r:
                print(f"{fmt_size(r['size_bytes']):>6} {r['variant']:<20} {r['time_us']:>10.1f} "
                      f"{r['f32_busbw_gbs']:>9.1f} {r['x_psum_f32']:>7.3f} {r['checked']}")
    if not args.single:
        jax.distributed.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16M,256M,1G", help="f32 bytes per device")
    p.add_argument("--configs", default="132x8192,264x8192,132x16384",
                   help="comma-separated GRIDxTILE: CTAs and elements per tile of the fused kernel")
    p.add_argument("--tma", default="", help="comma-separated GRIDxROWSxSTAGES of the TMA-pipelined variant")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--timeout", type=float, default=200.0, help="seconds for both workers (launcher)")
    p.add_argument("--single", action="store_true", help="one process with both GPUs (no jax.distributed)")
    p.add_argument("--check-only", action="store_true", help="one 4 MiB size, checks, no timing")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return launch(args) if args.rank is None else worker(args)


if __name__ == "__main__":
    raise SystemExit(main())
