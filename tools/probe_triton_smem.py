"""Shared memory our Triton matmul kernel really asks for, per target GPU (thirty-fourth session).

`configs.default_config` picks a Triton tile that fits the device's shared memory per block
from an estimate, num_stages * (block_m*block_k + block_k*block_n) * 2 bytes. This compiles
the kernel (through jax_triton, lowering only: nothing runs) for compute capabilities 8.0,
8.6, 8.9 and 9.0 on whatever GPU is here, and reads the bytes Triton reports for each
launch (jax_triton's dump folder), so the estimate can be checked against Triton itself.

    JAX_TRITON_DUMP_DIR=/tmp/jtdump python3 tools/probe_triton_smem.py --json out.json
"""
import argparse
import json
import os
import pathlib
import sys
import time

CONFIGS = [  # (block_m, block_n, block_k, num_stages, num_warps)
    (128, 256, 64, 4, 8), (128, 256, 64, 3, 8), (128, 256, 64, 2, 8), (256, 128, 64, 3, 8),
    (128, 128, 64, 4, 4), (128, 128, 64, 3, 4), (128, 128, 32, 4, 4), (64, 64, 32, 3, 4),
]
TARGETS = (80, 86, 89, 90)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--shape", default="8192x8192x8192")
    args = p.parse_args()
    dump = pathlib.Path(os.environ["JAX_TRITON_DUMP_DIR"])  # read by jax_triton at import
    dump.mkdir(parents=True, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import jax_triton

    from jaxopt_train.kernels.configs import MatmulConfig
    from jaxopt_train.kernels.triton_kernel import triton_matmul

    m, n, k = (int(x) for x in args.shape.split("x"))
    original = jax_triton.triton_call
    rows = []
    for cc in TARGETS:
        jax_triton.triton_call = lambda *a, _cc=cc, **kw: original(*a, compute_capability=_cc, **kw)
        for bm, bn, bk, stages, warps in CONFIGS:
            config = MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=stages,
                                  num_warps=warps, group_m=8)
            before = set(dump.iterdir())
            t0 = time.perf_counter()
            row = dict(cc=cc, block_m=bm, block_n=bn, block_k=bk, num_stages=stages,
                       num_warps=warps, estimate=stages * (bm * bk + bk * bn) * 2)
            try:
                fn = jax.jit(lambda a, b, _c=config: triton_matmul(
                    a, b, None, activation=None, out_dtype=jnp.bfloat16, config=_c))
                fn.lower(jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                         jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
                infos = [f for d in set(dump.iterdir()) - before for f in d.glob("*.compile_info")]
                row["shared"] = [int(f.read_text().split(":")[-1]) for f in infos]
            except Exception as err:  # noqa: BLE001 - a probe: record and go on
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    jax_triton.triton_call = original
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
