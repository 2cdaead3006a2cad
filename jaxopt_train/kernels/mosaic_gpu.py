"""Hopper matmul in Pallas Mosaic GPU: TMA loads, wgmma, warp-specialised pipeline.

Layout of one CTA (persistent: one CTA per SM loops over output tiles):
  - warpgroup 2 (producer) issues TMA copies of A (2*bm x bk) and B (bk x bn)
    tiles into a `num_stages`-deep ring of swizzled shared-memory buffers;
  - warpgroups 0 and 1 (consumers) each own one bm x bn f32 wgmma accumulator
    (rows [0, bm) and [bm, 2*bm) of the CTA tile) and issue wgmma as soon as a
    stage lands; the producer refills a stage once both consumers release it;
  - the epilogue adds the bias (TMA-loaded once per tile, overlapped with the
    main loop), applies the activation in registers, and streams 64x64 output
    sub-tiles to global memory through two shared-memory slots with TMA stores.
Tiles are visited in a planar snake of width `group_m` so consecutive tiles on
neighbouring SMs share A rows or B columns in L2.

Options of `MatmulConfig` (defaults give the layout above): `wg_split="n"`
puts the consumers side by side (CTA tile block_m x 2*block_n, one shared A
tile); `cluster="m"|"n"` pairs CTAs in a 2-CTA cluster that TMA-multicasts the
shared B (resp. A) tile; `epilogue_tile` sets the output sub-tile edge;
`warpgroup_lowering` and `no_auto_barriers` are Mosaic GPU compiler switches;
`chain_tiles` (the Hopper default) chains the pipelines of the tiles an SM visits
so loads never stop at a tile boundary; `schedule="pingpong"` is the alternative
layout of `mosaic_gpu_pingpong` (measured slower, kept as an option).

Any M, N, K without masks in the kernel: TMA zero-fills the part of a load box
past an operand's edge and drops the part of a store box past the output's, so
partial last tiles are exact as they are. The wrapper zero-pads only to what the
swizzled TMA copies need (`_tma_extent`: whole 128-byte rows along a stored minor
dim, 8 rows along a major one, at least one tile), not to whole tiles: an M that
is a multiple of 8 (a token count, say) costs no copy of A or of the output.
All Mosaic GPU imports are lazy.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax

from jaxopt_train.kernels.configs import MatmulConfig
from jaxopt_train.kernels.epilogue import apply_epilogue
from jaxopt_train.kernels.mosaic_gpu_tiling import check_tiling

_NUM_CONSUMERS = 2  # compute warpgroups per CTA, stacked along M (or N: wg_split)
_PRODUCER_REGISTERS = 40  # the TMA-issuing warpgroup needs few registers
_SMEM_BYTES = 232448  # Hopper's per-block shared memory limit (227 KiB)
_SMEM_SLACK = 2048  # barriers and Pallas bookkeeping


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _tma_extent(size: int, tile: int, minor: bool, itemsize: int) -> int:
    """The extent an operand's dim of `size` is zero-padded to for the kernel's TMA
    copies: at least one `tile` (one box), and a multiple of the granule Mosaic GPU
    tiles global memory by for swizzled copies (8 rows along the major dim, 128 bytes
    along the minor one, which every swizzle width divides). TMA zero-fills the part of
    a load box past the edge and drops the part of a store box past it, so nothing
    more is padded: a partial last tile is exact as it is."""
    granule = 128 // itemsize if minor else 8
    return _round_up(max(size, tile), granule)


def _swizzled(plgpu, minor_dim: int, dtype) -> tuple:
    """Tiling + swizzle transforms for a tile whose minor dim has `minor_dim` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_dim * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def num_sms() -> int:
    """SMs of the default device (132 on an H100/H200 when the runtime does not say)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def cta_tile(config: MatmulConfig) -> tuple[int, int]:
    """(rows, cols) of C computed by one CTA (both consumer warpgroups) at a time."""
    if config.schedule == "pingpong":  # each consumer owns a whole tile
        return config.block_m, config.block_n
    split_m = config.wg_split == "m"
    return (config.block_m * (_NUM_CONSUMERS if split_m else 1),
            config.block_n * (1 if split_m else _NUM_CONSUMERS))


def cluster_tile(config: MatmulConfig) -> tuple[int, int]:
    """(rows, cols) of C computed by one cluster (1 or 2 CTAs); the padding unit."""
    rows, cols = cta_tile(config)
    return (rows * (2 if config.cluster == "m" else 1),
            cols * (2 if config.cluster == "n" else 1))


def _epilogue_tile(config: MatmulConfig) -> tuple[int, int]:
    edge = config.epilogue_tile
    return min(edge, config.block_m), min(edge, config.block_n)


def _epilogue_slots(config: MatmulConfig) -> int:
    """SMEM output slots per consumer: two, so one is filled while the other is stored."""
    epi_m, epi_n = _epilogue_tile(config)
    return min(2, (config.block_m * config.block_n) // (epi_m * epi_n))


def epilogue_scratch(plgpu, config: MatmulConfig, out_dtype, has_bias: bool) -> list:
    """Each consumer's output slots, then (with a bias) its bias row and that row's barrier."""
    epi_m, epi_n = _epilogue_tile(config)
    scratch = [plgpu.SMEM((_NUM_CONSUMERS, _epilogue_slots(config), epi_m, epi_n), out_dtype,
                          transforms=_swizzled(plgpu, epi_n, out_dtype))]
    if has_bias:
        scratch += [plgpu.SMEM((_NUM_CONSUMERS, config.block_n), jnp.float32),
                    plgpu.Barrier(num_barriers=_NUM_CONSUMERS)]
    return scratch


def fit_stages(config: MatmulConfig, in_dtype, out_dtype, has_bias: bool) -> int:
    """The deepest pipeline <= config.num_stages whose buffers fit in shared memory
    (with the ping-pong schedule a stage holds one consumer's block_m x block_n tile's operands)."""
    if config.num_stages < 2:
        raise ValueError(f"mosaic_gpu pipelines its TMA loads over at least 2 stages; got "
                         f"num_stages={config.num_stages} in {config}: pass num_stages >= 2")
    bk, bn = config.block_k, config.block_n
    rows, cols = cta_tile(config)
    per_stage = (rows * bk + bk * cols) * jnp.dtype(in_dtype).itemsize
    epi_m, epi_n = _epilogue_tile(config)
    fixed = _NUM_CONSUMERS * _epilogue_slots(config) * epi_m * epi_n * jnp.dtype(out_dtype).itemsize + _SMEM_SLACK
    fixed += _NUM_CONSUMERS * bn * 4 if has_bias else 0
    stages = min(config.num_stages, (_SMEM_BYTES - fixed) // per_stage)
    if stages < 2:
        raise ValueError(f"{config} needs {fixed + 2 * per_stage} bytes of shared memory for a "
                         f"2-stage pipeline; Hopper has {_SMEM_BYTES}: use smaller blocks")
    return int(stages)


def chained_depth(config: MatmulConfig, k_iters: int, fitted: int) -> tuple[int, bool]:
    """(stages, chained) for a launch of `k_iters` K steps whose buffers fit `fitted` stages.

    Chained pipelines need the K steps to fill whole rounds of the ring, so the depth
    drops to the deepest divisor of k_iters (>= 2); with none (k_iters prime, say) the
    launch runs unchained at the fitted depth.
    """
    if not (config.chain_tiles and not config.wgmma_in_flight and config.schedule == "cooperative"):
        return fitted, False
    depth = next((s for s in range(fitted, 1, -1) if k_iters % s == 0), None)
    return (fitted, False) if depth is None else (depth, True)


def _matmul_kernel(a_gmem, b_gmem, bias_gmem, out_gmem, aux_gmem, out_smem, bias_smem,
                   bias_barrier, *, config: MatmulConfig, activation: str | None, m_iters: int,
                   n_iters: int, k_iters: int, transpose_a: bool = False,
                   transpose_b: bool = False, grid_size: int = 0, chain: bool = False):
    """Kernel body, run by 3 warpgroups ("wg") on every SM ("sm").

    `aux_gmem` (or None): also store the pre-activation A @ B + bias there, so a
    training step's backward reads it instead of recomputing the product.

    `transpose_a`: a_gmem holds A^T (K, M); `transpose_b`: b_gmem holds B^T (N, K). The
    TMA then loads (bk, rows) / (cols, bk) tiles as stored and wgmma reads them
    transposed from shared memory, so the backward pass needs no transposed copies.
    `chain`: the tiles' pipelines are chained (see `MatmulConfig.chain_tiles`); this SM
    (or cluster, of `grid_size`) then visits tiles sm, sm + grid_size, ... itself.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bm, bn, bk = config.block_m, config.block_n, config.block_k
    epi_m, epi_n = _epilogue_tile(config)
    split_m = config.wg_split == "m"
    cta_m, cta_n = cta_tile(config)

    spec_kwargs = dict(memory_space=plgpu.SMEM)
    if config.wgmma_in_flight:
        # A stage is still being read by the in-flight wgmma: release it one step late.
        spec_kwargs["delay_release"] = config.wgmma_in_flight
    # In a cluster the two CTAs share one operand tile: its TMA load is split
    # between them and multicast to both SMEMs.
    # Each tile is swizzled along its stored minor dim (bk, or the M/N extent when transposed).
    a_kwargs = dict(spec_kwargs, transforms=_swizzled(plgpu, cta_m if transpose_a else bk, a_gmem.dtype))
    b_kwargs = dict(spec_kwargs, transforms=_swizzled(plgpu, bk, b_gmem.dtype))
    if config.cluster == "n":
        a_kwargs["collective_axes"] = ("cluster",)
    elif config.cluster == "m":
        b_kwargs["collective_axes"] = ("cluster",)

    def make_pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=_PRODUCER_REGISTERS,
            in_specs=[
                (plgpu.BlockSpec((bk, cta_m), lambda k: (k, 0), **a_kwargs) if transpose_a
                 else plgpu.BlockSpec((cta_m, bk), lambda k: (0, k), **a_kwargs)),
                (plgpu.BlockSpec((cta_n, bk), lambda k: (0, k), **b_kwargs) if transpose_b
                 else plgpu.BlockSpec((bk, cta_n), lambda k: (k, 0), **b_kwargs)),
            ],
            wg_axis="wg",
            num_compute_wgs=_NUM_CONSUMERS,
            max_concurrent_steps=config.num_stages,
            compute_context=compute_context,
            **({} if state is None else dict(pipeline_state=state)),
        )

    def no_op(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=make_pipeline(no_op, no_op).get_allocations(a_gmem, b_gmem),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs):
        wg = lax.axis_index("wg")
        minor = 0 if config.grid_minor == "m" else 1

        def run_tile(linear, state=None):
            m_idx, n_idx = plgpu.planar_snake(linear, (m_iters, n_iters), minor, config.group_m)
            if config.cluster == "m":  # (m_iters, n_iters) count cluster tiles
                m_idx = m_idx * 2 + lax.axis_index("cluster")
            elif config.cluster == "n":
                n_idx = n_idx * 2 + lax.axis_index("cluster")
            cta_rows = pl.ds(m_idx * cta_m, cta_m)
            cta_cols = pl.ds(n_idx * cta_n, cta_n)
            if split_m:  # this warpgroup's rows / columns of the CTA tile
                wg_rows, wg_cols = pl.ds(wg * bm, bm), slice(None)
                bias_cols = cta_cols
                out_tile = lambda ref: ref.at[cta_rows, cta_cols].at[wg_rows]  # noqa: E731
            else:
                wg_rows, wg_cols = slice(None), pl.ds(wg * bn, bn)
                bias_cols = pl.ds(n_idx * cta_n + wg * bn, bn)
                out_tile = lambda ref: ref.at[cta_rows, cta_cols].at[:, wg_cols]  # noqa: E731

            def compute_context(run_pipeline):
                if bias_gmem is not None:  # fetch the bias while the main loop runs
                    plgpu.copy_gmem_to_smem(bias_gmem.at[bias_cols], bias_smem.at[wg],
                                            bias_barrier.at[wg])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                def _accumulate(acc_ref):
                    run_pipeline(acc_ref)
                    acc = acc_ref[...]
                    bias = None
                    if bias_gmem is not None:
                        plgpu.barrier_wait(bias_barrier.at[wg])
                        if config.warpgroup_lowering:  # layouts are inferred there
                            row = bias_smem.at[wg][...]
                        else:
                            row = _load_bias(bias_smem.at[wg])
                        bias = lax.broadcast_in_dim(row, (bm, bn), [1])
                    if aux_gmem is None:
                        out = apply_epilogue(acc, bias, activation).astype(out_gmem.dtype)
                        parts = [(lambda rows, cols: out[rows, cols], out_tile(out_gmem))]
                    else:
                        # The activation runs per sub-tile, on the f32 pre-activation, so
                        # only one extra sub-tile of registers is live at a time.
                        z = apply_epilogue(acc, bias, None)
                        parts = [(lambda rows, cols: z[rows, cols].astype(aux_gmem.dtype),
                                  out_tile(aux_gmem)),
                                 (lambda rows, cols: apply_epilogue(z[rows, cols], None, activation)
                                  .astype(out_gmem.dtype), out_tile(out_gmem))]
                    _store_epilogue(parts, out_smem.at[wg], (bm, bn), epi_m, epi_n)

            def mma_body(_, a_smem, b_smem, acc_ref):
                # Slice this warpgroup's part as stored, then view it transposed.
                if transpose_a:
                    a_op = _transposed(a_smem.at[:, wg_rows] if split_m else a_smem)
                else:
                    a_op = a_smem.at[wg_rows] if split_m else a_smem
                if transpose_b:
                    b_op = _transposed(b_smem if split_m else b_smem.at[wg_cols])
                else:
                    b_op = b_smem if split_m else b_smem.at[:, wg_cols]
                plgpu.wgmma(acc_ref, a_op, b_op)
                plgpu.wgmma_wait(config.wgmma_in_flight)  # reading acc_ref waits for all
                return acc_ref

            make_pipeline(mma_body, compute_context, state)(
                a_gmem.at[:, cta_rows] if transpose_a else a_gmem.at[cta_rows, :],
                b_gmem.at[cta_cols, :] if transpose_b else b_gmem.at[:, cta_cols],
                allocations=pipeline_allocs)

        if not chain:
            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tile_loop(loop_info):
                (linear,) = getattr(loop_info, "index", loop_info)
                run_tile(linear)
        else:
            _chained_tiles(run_tile, m_iters * n_iters, grid_size)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _chained_tiles(run_tile, num_tiles: int, grid_size: int):
    """Runs this SM's tiles sm, sm + grid_size, ... as one chain of pipelines.

    The pipeline state must be static (its prologue is unrolled), so the first tile
    (START), the middle ones (STEADY) and the last (STOP) are traced apart; an SM with a
    single tile runs an ordinary, self-contained pipeline.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    pipeline = plgpu.PipelinePipeline
    sm = lax.axis_index("sm")
    count = (num_tiles - sm + grid_size - 1) // grid_size  # >= 1: grid_size <= num_tiles
    tile = lambda i: sm + i * grid_size  # noqa: E731

    @pl.when(count == 1)
    def _single():
        run_tile(tile(0))

    @pl.when(count > 1)
    def _chain():
        run_tile(tile(0), pipeline.START)

        @pl.loop(1, count - 1)
        def _middle(i):
            run_tile(tile(i), pipeline.STEADY)

        run_tile(tile(count - 1), pipeline.STOP)


def _transposed(ref):
    """A (1, 0)-transposed view of an SMEM ref, for wgmma.

    `ref.transpose(perm)` is the body of `plgpu.transpose_ref` in jax 0.10 and its stated
    replacement in 0.11, where merely looking the old name up raises a DeprecationWarning.
    """
    return ref.transpose((1, 0))


def _store_epilogue(parts, slots, tile: tuple[int, int], epi_m: int, epi_n: int):
    """Streams a bm x bn tile of each output to global memory via two SMEM slots and TMA.

    `parts`: (value, gmem) pairs; `value(rows, cols)` gives that output's sub-tile in
    registers and `gmem` is the output's bm x bn tile. The outputs of one sub-tile go
    out one after the other, all through the same two slots.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bm, bn = tile
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's stores left SMEM
    step = 0
    for i in range(bm // epi_m):
        for j in range(bn // epi_n):
            rows, cols = slice(i * epi_m, (i + 1) * epi_m), slice(j * epi_n, (j + 1) * epi_n)
            for value, out_gmem in parts:
                slot = step % slots.shape[0]
                step += 1
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store is done
                slots[slot] = value(rows, cols)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(slots.at[slot], out_gmem.at[rows, cols])


def kernel_io_kwargs(plgpu, out_shape, scratch) -> dict:
    """`plgpu.kernel`'s output and scratch keywords in this jax's spelling
    (out_shape/out_type, scratch_shapes/scratch_types)."""
    params = inspect.signature(plgpu.kernel).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    scratch_kw = "scratch_types" if "scratch_types" in params else "scratch_shapes"
    return {out_kw: out_shape, scratch_kw: scratch}


def _kernel_fn(plgpu, body, out_shape, scratch, grid, compiler_params, cluster: int = 1):
    """`plgpu.kernel` for the matmul's layout (one CTA per SM, 2 consumers + a producer)."""
    kwargs = kernel_io_kwargs(plgpu, out_shape, scratch)
    if compiler_params is not None:
        kwargs["compiler_params"] = compiler_params
    if cluster > 1:
        kwargs.update(cluster=(cluster,), cluster_names=("cluster",))
    return plgpu.kernel(body, grid=grid, grid_names=("sm",), num_threads=_NUM_CONSUMERS + 1,
                        thread_name="wg", **kwargs)


def _compiler_params(plgpu, config: MatmulConfig, activation: str | None):
    """CompilerParams for the config's switches, or None when all are defaults."""
    wanted = {}
    if activation in ("gelu", "silu"):
        # tanh.approx / ex2.approx in the epilogue: well inside bf16 output precision.
        wanted["approx_math"] = True
    if config.warpgroup_lowering:
        wanted["lowering_semantics"] = plgpu.LoweringSemantics.Warpgroup
    if config.no_auto_barriers:
        wanted["unsafe_no_auto_barriers"] = True
    if not wanted:
        return None
    known = {f.name for f in dataclasses.fields(plgpu.CompilerParams)}
    missing = sorted(set(wanted) - known)
    if missing:
        raise ValueError(f"this jax {jax.__version__} has no Mosaic GPU CompilerParams "
                         f"{missing} needed by {config}; it has {sorted(known)}")
    return plgpu.CompilerParams(**wanted)


def mosaic_matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, *,
                  activation: str | None, out_dtype, config: MatmulConfig,
                  transpose_a: bool = False, transpose_b: bool = False,
                  save_preactivation: bool = False):
    """act(A @ B + bias) on a Hopper GPU, bf16/fp16, any M, N, K.

    A is `a` (M, K), or `a.T` when `transpose_a` (then `a` is (K, M)); B is `b`
    (K, N), or `b.T` when `transpose_b` (`b` is (N, K)). Transposed operands are
    read as stored: no transposed copy is made.

    With `save_preactivation` it returns (act(Z), Z), Z = A @ B + bias, both in
    `out_dtype` and written by the one kernel's epilogue (cuBLASLt's GELU_AUX): a
    training step then keeps Z for the activation's backward and never re-reads Z to
    apply the activation. The ping-pong schedule writes Z in f32 and applies the
    activation outside the kernel.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from jaxopt_train.kernels.matmul import _pad_to

    if save_preactivation and activation is None:
        raise ValueError("save_preactivation=True needs an activation: without one the "
                         "pre-activation is the output")
    if save_preactivation and config.schedule == "pingpong":
        z = mosaic_matmul(a, b, bias, activation=None, out_dtype=jnp.float32, config=config,
                          transpose_a=transpose_a, transpose_b=transpose_b)
        return apply_epilogue(z, None, activation).astype(out_dtype), z.astype(out_dtype)

    m, k = a.shape[::-1] if transpose_a else a.shape
    n = b.shape[0] if transpose_b else b.shape[1]
    bk = config.block_k
    check_tiling(config, a.dtype, out_dtype, transpose_a=transpose_a, transpose_b=transpose_b)
    unit_m, unit_n = cluster_tile(config)
    mp, np_, kp = _round_up(m, unit_m), _round_up(n, unit_n), _round_up(k, bk)
    # Each operand as stored: (size, tile) of its major dim, then of its minor dim.
    a_dims = ((k, bk), (m, unit_m)) if transpose_a else ((m, unit_m), (k, bk))
    b_dims = ((n, unit_n), (k, bk)) if transpose_b else ((k, bk), (n, unit_n))
    itemsize = jnp.dtype(a.dtype).itemsize
    operands = [_pad_to(x, [_tma_extent(d, t, minor, itemsize)
                            for (d, t), minor in zip(dims, (False, True))])
                for x, dims in ((a, a_dims), (b, b_dims))]
    if bias is not None:
        operands.append(_pad_to(bias.astype(jnp.float32), (np_,)))
    m_iters, n_iters, k_iters = mp // unit_m, np_ // unit_n, kp // bk
    if k_iters == 1 and config.wgmma_in_flight:
        # One K step has nothing to overlap; keep the simplest barrier schedule.
        config = dataclasses.replace(config, wgmma_in_flight=0)
    stages = max(fit_stages(config, a.dtype, out_dtype, bias is not None),
                 config.wgmma_in_flight + 1)
    stages, chain = chained_depth(config, k_iters, stages)
    if stages != config.num_stages:
        config = dataclasses.replace(config, num_stages=stages)
    cluster = 1 if config.cluster == "none" else 2
    grid = (min(num_sms() // cluster, m_iters * n_iters),)
    if config.schedule == "pingpong":
        from jaxopt_train.kernels import mosaic_gpu_pingpong as pingpong

        scratch = pingpong.ring_scratch(plgpu, config, a.dtype, stages, transpose_a, transpose_b)
        body = functools.partial(
            pingpong.kernel, config=config, activation=activation, m_iters=m_iters,
            n_iters=n_iters, k_iters=k_iters, stages=stages, grid_size=grid[0],
            transpose_a=transpose_a, transpose_b=transpose_b)
        if bias is None:
            body = functools.partial(_without_bias, body)
    else:
        scratch = []
        body = _cooperative_io(
            functools.partial(_matmul_kernel, config=config, activation=activation,
                              m_iters=m_iters, n_iters=n_iters, k_iters=k_iters,
                              transpose_a=transpose_a, transpose_b=transpose_b,
                              grid_size=grid[0], chain=chain),
            has_bias=bias is not None, has_aux=save_preactivation)
    scratch += epilogue_scratch(plgpu, config, out_dtype, bias is not None)
    params = _compiler_params(plgpu, config, activation)
    out_dims = (_tma_extent(m, unit_m, False, jnp.dtype(out_dtype).itemsize),
                _tma_extent(n, unit_n, True, jnp.dtype(out_dtype).itemsize))
    out_shape = jax.ShapeDtypeStruct(out_dims, out_dtype)
    outs = _kernel_fn(plgpu, body, (out_shape, out_shape) if save_preactivation else out_shape,
                      scratch, grid, params, cluster)(*operands)
    unpad = (lambda x: x[:m, :n]) if out_dims != (m, n) else (lambda x: x)  # noqa: E731
    return tuple(map(unpad, outs)) if save_preactivation else unpad(outs)


def _without_bias(body, a_gmem, b_gmem, out_gmem, *scratch):
    body(a_gmem, b_gmem, None, out_gmem, *scratch, None, None)


def _cooperative_io(body, *, has_bias: bool, has_aux: bool):
    """Adapts `plgpu.kernel`'s refs (inputs, outputs, scratch: the bias and the aux output
    only when present) to `_matmul_kernel`'s fixed order, with None for what is absent."""
    def bound(*refs):
        refs = list(refs)
        a_gmem, b_gmem = refs.pop(0), refs.pop(0)
        bias_gmem = refs.pop(0) if has_bias else None
        out_gmem = refs.pop(0)
        aux_gmem = refs.pop(0) if has_aux else None
        scratch = refs if has_bias else [*refs, None, None]  # no bias row, no barrier
        body(a_gmem, b_gmem, bias_gmem, out_gmem, aux_gmem, *scratch)

    return bound


def _load_bias(ref):
    """The bias row in the wgmma accumulator's column layout (lane semantics)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layout = plgpu.Layout.WGMMA.reduce(0)
    # jax 0.10 requires the index argument; jax 0.11 deprecates passing it (the ref is
    # indexed with ref.at[...] instead, and the whole ref needs no index).
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)
