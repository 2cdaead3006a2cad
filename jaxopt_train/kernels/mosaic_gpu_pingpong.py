"""Ping-pong schedule of the Hopper matmul: the epilogue of one tile runs under the next's main loop.

The cooperative kernel (`mosaic_gpu._matmul_kernel`) gives both consumer
warpgroups halves of one CTA tile, so both reach the epilogue together and the
tensor cores idle while the accumulators are converted and stored. Timed on an
H200 (`tools/probe_matmul.py --epilogue one`, BENCHMARKS.md), that epilogue costs
1-8% of the kernel on K = 2048 products (gpt-1b's forward) and ~1% at K = 8192.
Here each consumer owns whole block_m x block_n tiles, alternately (this CTA's
even tiles go to consumer 0, odd ones to consumer 1), so while one consumer runs
its epilogue the other keeps the tensor cores busy (CUTLASS calls this the
ping-pong schedule).

The producer warpgroup fills ONE ring of SMEM stages in tile order, so whichever
consumer runs its main loop has the whole ring ahead of it. (The first version
gave each consumer its own ring: two rings in 227 KiB left each 3 stages, and it
measured 12-15% slower than the cooperative kernel.) The shared ring is no faster
on an H200 (0.84x XLA's dot over 8 shapes against 0.99x for the cooperative kernel;
0.89x with one wgmma in flight): one warpgroup at a time drives the tensor cores on
128 x 128 tiles. So ping-pong stays an option, not the default. Each slot has one "empty"
barrier, which the producer waits on before every refill after the first, and
one "full" barrier per consumer, on which the producer's copies arrive for that
consumer's tiles.

Barrier phases in Pallas are tracked per thread, one parity bit per barrier,
flipped by each wait: every barrier here is waited on by one thread kind in
every phase, in order (consumer c waits on its own "full" barriers, which only its
tiles' copies complete; the producer on every "empty" barrier except for each
slot's first fill), so the implicit tracking stays exact whatever K and the ring
depth are.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxopt_train.kernels.configs import MatmulConfig
from jaxopt_train.kernels.epilogue import apply_epilogue
from jaxopt_train.kernels.mosaic_gpu import _NUM_CONSUMERS as NUM_CONSUMERS
from jaxopt_train.kernels.mosaic_gpu import (_epilogue_tile, _load_bias, _store_epilogue,
                                             _swizzled, _transposed)

_PRODUCER_REGISTERS = 40
_CONSUMER_REGISTERS = 232  # (512 - 40) / 2 rounded down to a multiple of 8


def ring_scratch(plgpu, config: MatmulConfig, in_dtype, stages: int, transpose_a: bool,
                 transpose_b: bool) -> list:
    """The shared SMEM ring (`stages` deep) and its barriers; the epilogue's slots
    follow them (`mosaic_gpu.epilogue_scratch`)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a_tile = (bk, bm) if transpose_a else (bm, bk)
    b_tile = (bn, bk) if transpose_b else (bk, bn)
    return [
        plgpu.SMEM((stages, *a_tile), in_dtype, transforms=_swizzled(plgpu, a_tile[1], in_dtype)),
        plgpu.SMEM((stages, *b_tile), in_dtype, transforms=_swizzled(plgpu, bk, in_dtype)),
        # "full" [consumer * stages + slot]: the A and B copies for that consumer's tile landed
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_CONSUMERS * stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # "empty": its consumer is done with it
    ]


def kernel(a_gmem, b_gmem, bias_gmem, out_gmem, a_smem, b_smem, full, empty, out_smem,
           bias_smem, bias_barrier, *, config: MatmulConfig, activation: str | None,
           m_iters: int, n_iters: int, k_iters: int, stages: int, grid_size: int,
           transpose_a: bool, transpose_b: bool):
    """Kernel body, run by 3 warpgroups on each of `grid_size` SMs (persistent)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bm, bn, bk = config.block_m, config.block_n, config.block_k
    wg = lax.axis_index("wg")
    sm = lax.axis_index("sm")
    # Tiles sm, sm + grid_size, ...; the wrapper keeps grid_size <= the tile count.
    my_tiles = (m_iters * n_iters - sm + grid_size - 1) // grid_size
    minor = 0 if config.grid_minor == "m" else 1
    in_flight = config.wgmma_in_flight if k_iters > 1 else 0

    def tile_origin(j):
        m_idx, n_idx = plgpu.planar_snake(sm + j * grid_size, (m_iters, n_iters), minor,
                                          config.group_m)
        return m_idx * bm, n_idx * bn

    def ring_slot(tile, k):
        """The slot of this CTA's `tile`-th tile's K step `k`: one shared ring, in tile order."""
        return lax.rem(tile * k_iters + k, stages)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

        @pl.loop(0, my_tiles)
        def _tile(j):
            full_base = lax.rem(j, 2) * stages  # this tile's consumer's "full" barriers
            row0, col0 = tile_origin(j)

            @pl.loop(0, k_iters)
            def _step(k):
                slot = ring_slot(j, k)

                @pl.when(j * k_iters + k >= stages)  # a slot's first fill has nothing to wait for
                def _():
                    plgpu.barrier_wait(empty.at[slot])

                ks = pl.ds(k * bk, bk)
                a_src = a_gmem.at[ks, pl.ds(row0, bm)] if transpose_a else a_gmem.at[pl.ds(row0, bm), ks]
                b_src = b_gmem.at[pl.ds(col0, bn), ks] if transpose_b else b_gmem.at[ks, pl.ds(col0, bn)]
                plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot], full.at[full_base + slot])
                plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], full.at[full_base + slot])

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        consumer = wg

        @pl.loop(0, (my_tiles - consumer + 1) // 2)
        def _tile(local):
            j = 2 * local + consumer  # this CTA's tile index
            row0, col0 = tile_origin(j)
            if bias_gmem is not None:  # fetched while the main loop runs
                plgpu.copy_gmem_to_smem(bias_gmem.at[pl.ds(col0, bn)], bias_smem.at[consumer],
                                        bias_barrier.at[consumer])

            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
            def _accumulate(acc_ref):
                def step(k, acc):
                    slot = ring_slot(j, k)
                    plgpu.barrier_wait(full.at[consumer * stages + slot])
                    a_op = _transposed(a_smem.at[slot]) if transpose_a else a_smem.at[slot]
                    b_op = _transposed(b_smem.at[slot]) if transpose_b else b_smem.at[slot]
                    plgpu.wgmma(acc, a_op, b_op)
                    plgpu.wgmma_wait(in_flight)  # the step `in_flight` back has finished
                    if in_flight:
                        @pl.when(k > 0)
                        def _():
                            plgpu.barrier_arrive(empty.at[ring_slot(j, k - 1)])
                    else:
                        plgpu.barrier_arrive(empty.at[slot])
                    return acc

                lax.fori_loop(0, k_iters, step, acc_ref)
                if in_flight:
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[ring_slot(j, k_iters - 1)])
                acc = acc_ref[...]
                bias = None
                if bias_gmem is not None:
                    plgpu.barrier_wait(bias_barrier.at[consumer])
                    bias = lax.broadcast_in_dim(_load_bias(bias_smem.at[consumer]), (bm, bn), [1])
                out = apply_epilogue(acc, bias, activation).astype(out_gmem.dtype)
                _store_epilogue([(lambda rows, cols: out[rows, cols],
                                  out_gmem.at[pl.ds(row0, bm), pl.ds(col0, bn)])],
                                out_smem.at[consumer], (bm, bn), *_epilogue_tile(config))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
