"""Tile configurations for the matmul kernels, and the defaults we ship.

One frozen dataclass describes a tiling for every backend; each backend reads
the fields it understands (the Pallas BlockSpec kernels ignore `num_warps`,
Triton ignores `grid_minor`). Defaults are keyed by backend and device kind;
`autotune` can replace them with measured winners.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

BACKENDS = ("auto", "mosaic_gpu", "triton", "pallas_tpu", "interpret", "xla")
# Backends whose kernels read a transposed operand (A^T @ B, A @ B^T) as stored; the others
# multiply a transposed copy, i.e. run the plain layout.
TRANSPOSING_BACKENDS = ("mosaic_gpu", "triton")
ACTIVATIONS = (None, "gelu", "relu", "silu")
GRID_MINOR = ("m", "n")
WG_SPLITS = ("m", "n")
CLUSTERS = ("none", "m", "n")
SCHEDULES = ("cooperative", "pingpong")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Block sizes and scheduling knobs of one matmul kernel launch.

    Attributes:
        block_m: rows of C computed per program (per warpgroup pair on Mosaic GPU).
        block_n: columns of C computed per program.
        block_k: depth of one K step (one TMA load / one pipeline stage).
        num_stages: software-pipeline depth (Triton `num_stages`, Mosaic GPU
            `max_concurrent_steps`).
        num_warps: Triton warps per program (ignored elsewhere).
        group_m: width of the L2-reuse band of the tile order (Triton's grouped
            ordering, Mosaic GPU's planar snake); 1 means plain row-major.
        grid_minor: which tile index varies fastest inside a band ("m" or "n").
        wgmma_in_flight: Mosaic GPU only: wgmma groups left running while the
            next K step is issued (0 or 1); 1 delays releasing each SMEM stage
            by one step so the tensor cores never wait on the issuing warps.
        wg_split: Mosaic GPU only: the axis along which the two consumer
            warpgroups split the CTA tile: "m" stacks them (CTA tile
            2*block_m x block_n, each reads its own A rows), "n" puts them side
            by side (block_m x 2*block_n, both read one shared A tile).
        cluster: Mosaic GPU only: "none", or pair CTAs in a 2-CTA cluster along
            "m" (the pair shares, and TMA-multicasts, the B tile) or "n"
            (shares the A tile): halves the L2->SMEM traffic of that operand.
        epilogue_tile: Mosaic GPU only: edge of the square output sub-tile
            staged in SMEM and TMA-stored (clamped to the block).
        warpgroup_lowering: Mosaic GPU only: lower with warpgroup semantics
            (the Mosaic GPU dialect with layout inference) instead of lanes.
        no_auto_barriers: Mosaic GPU only: ask Pallas not to insert its
            conservative SMEM barriers (`unsafe_no_auto_barriers`); safe here
            because no thread both reads and writes one SMEM region.
        schedule: Mosaic GPU only: "cooperative" (both consumer warpgroups
            share each CTA tile, see `wg_split`) or "pingpong" (each consumer
            owns a whole block_m x block_n tile, the two alternate, so one's
            epilogue runs under the other's main loop; the producer fills one
            SMEM ring for both in tile order). On an H200 it measured 10-15%
            slower than the cooperative schedule (BENCHMARKS.md).
        chain_tiles: Mosaic GPU only: chain the pipelines of the tiles an SM
            visits (Pallas's pipeline_state), so the producer loads the next
            tile's first stages during the current tile's last steps and
            epilogue instead of after it. Cooperative schedule with
            wgmma_in_flight=0 only (ignored otherwise); the stage count drops to
            the deepest one that divides the K steps (>= 2), else it runs unchained.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 8
    group_m: int = 8
    grid_minor: str = "n"
    wgmma_in_flight: int = 0
    wg_split: str = "m"
    cluster: str = "none"
    epilogue_tile: int = 64
    warpgroup_lowering: bool = False
    no_auto_barriers: bool = False
    schedule: str = "cooperative"
    chain_tiles: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_stages", "num_warps", "group_m",
                     "wgmma_in_flight", "epilogue_tile"):
            value = getattr(self, name)
            # A numpy int (a sweep over np.arange) was refused as "np.int64(64) must be an
            # int"; kept, it could not be written to the JSON autotune cache: store an int.
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        for name in ("block_m", "block_n", "block_k", "num_stages", "num_warps", "group_m",
                     "wgmma_in_flight"):
            value = getattr(self, name)  # True == 1 and 4.0 == 4 would pass the range checks
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"MatmulConfig.{name}={value!r} must be an int")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 8:
                raise ValueError(f"MatmulConfig.{name}={value!r} must be a power of two >= 8")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"MatmulConfig.num_stages={self.num_stages!r} must be an int in [1, 8]")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MatmulConfig.num_warps={self.num_warps!r} must be one of 1, 2, 4, 8, 16")
        if self.group_m < 1:
            raise ValueError(f"MatmulConfig.group_m={self.group_m!r} must be an int >= 1")
        if self.wgmma_in_flight not in (0, 1):
            raise ValueError(f"MatmulConfig.wgmma_in_flight={self.wgmma_in_flight!r} must be 0 or 1")
        if self.wgmma_in_flight >= self.num_stages:
            raise ValueError(f"MatmulConfig.wgmma_in_flight={self.wgmma_in_flight} needs "
                             f"num_stages > it; got num_stages={self.num_stages}")
        if self.grid_minor not in GRID_MINOR:
            raise ValueError(f"MatmulConfig.grid_minor={self.grid_minor!r} must be one of {GRID_MINOR}")
        if self.wg_split not in WG_SPLITS:
            raise ValueError(f"MatmulConfig.wg_split={self.wg_split!r} must be one of {WG_SPLITS}")
        if self.cluster not in CLUSTERS:
            raise ValueError(f"MatmulConfig.cluster={self.cluster!r} must be one of {CLUSTERS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"MatmulConfig.schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.schedule == "pingpong" and (self.cluster != "none" or self.warpgroup_lowering):
            raise ValueError(f"MatmulConfig.schedule='pingpong' needs cluster='none' and "
                             f"warpgroup_lowering=False; got cluster={self.cluster!r}, "
                             f"warpgroup_lowering={self.warpgroup_lowering}")
        if not isinstance(self.epilogue_tile, int) or not _is_pow2(self.epilogue_tile) \
                or self.epilogue_tile < 16:
            raise ValueError(f"MatmulConfig.epilogue_tile={self.epilogue_tile!r} must be a "
                             f"power of two >= 16")
        for name in ("warpgroup_lowering", "no_auto_barriers", "chain_tiles"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MatmulConfig.{name}={getattr(self, name)!r} must be a bool")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MatmulConfig":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown MatmulConfig fields {sorted(unknown)}; "
                             f"expected some of {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**data)


def as_config(config: MatmulConfig | dict | None) -> MatmulConfig | None:
    """Accepts a MatmulConfig, a dict of its fields, or None."""
    if config is None or isinstance(config, MatmulConfig):
        return config
    if isinstance(config, dict):
        return MatmulConfig.from_dict(config)
    raise TypeError(f"config={config!r} must be a MatmulConfig, a dict of its fields, or None")


# Hopper (H100 and H200 share the SM: the same tile wins on both). Mosaic GPU
# runs two consumer warpgroups, each owning a block_m x block_n accumulator,
# stacked along M, so one CTA covers 2*block_m rows. Measured on an H200 (jax
# 0.11.2, BENCHMARKS.md): 128x128x64, 4 stages, snake width 16 won or tied
# (within 1%) on all four large shapes; wgmma_in_flight=1 won 3 of 4 by <= 1%,
# inside run-to-run noise, so the default keeps the simpler schedule. Chained tile
# pipelines took the gpt-1b training step with our kernel from 1.043-1.047x XLA's
# to 1.029-1.031x (paired runs, fifth session); they cost ~2x the kernel's compile.
_HOPPER_MOSAIC = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4,
                              group_m=16, grid_minor="n", chain_tiles=True)
# Swept on an H200 (seventeenth session, autotune's 16 Triton candidates, BENCHMARKS.md):
# 128 x 256 x 64 with 8 warps leads every large shape; a fourth pipeline stage (192 KiB of
# shared memory) beat three at 8192^3 (1657 against 1699 us), 16384x8192x2048 (898 / 908)
# and 16384x2048x8192 (814 / 860), and lost at 4096^3 (225 / 219).
_HOPPER_TRITON = MatmulConfig(block_m=128, block_n=256, block_k=64, num_stages=4,
                              num_warps=8, group_m=8)
_SMALL_TRITON = MatmulConfig(block_m=64, block_n=64, block_k=32, num_stages=3,
                             num_warps=4, group_m=8)
# Interpret mode runs on the CPU: small tiles keep the emulated grid cheap.
_INTERPRET = MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1, num_warps=4,
                          group_m=1)
# TPU MXU wants lane-dense (x128) tiles; 256 fills v5e/v6e MXUs better but 128
# is legal everywhere.
_TPU = MatmulConfig(block_m=256, block_n=256, block_k=256, num_stages=2, group_m=1)

SHIPPED_DEFAULTS: dict[tuple[str, str], MatmulConfig] = {
    ("mosaic_gpu", "NVIDIA H100"): _HOPPER_MOSAIC,
    ("mosaic_gpu", "NVIDIA H200"): _HOPPER_MOSAIC,
    ("triton", "NVIDIA H100"): _HOPPER_TRITON,
    ("triton", "NVIDIA H200"): _HOPPER_TRITON,
}
# Another device kind gets the Hopper tile; default_config then fits a Triton tile to the
# device's shared memory when its compute capability is known.
_FALLBACK = {
    "mosaic_gpu": _HOPPER_MOSAIC,
    "triton": _HOPPER_TRITON,
    "pallas_tpu": _TPU,
    "interpret": _INTERPRET,
    "xla": MatmulConfig(),
}


def _device_family(device_kind: str) -> str:
    """Maps e.g. 'NVIDIA H100 80GB HBM3' to the 'NVIDIA H100' key."""
    for _, kind in SHIPPED_DEFAULTS:
        if device_kind.startswith(kind):
            return kind
    return device_kind


# Opt-in maximum shared memory per thread block, in bytes, by CUDA compute capability: CUDA
# C++ Programming Guide, "Technical Specifications per Compute Capability" (Triton's "out of
# resource: shared memory" error reports the same figure as its "Hardware limit").
SHARED_MEMORY_PER_BLOCK: dict[tuple[int, int], int] = {
    (7, 5): 65_536,    # 64 KB: T4, RTX 20
    (8, 0): 166_912,   # 163 KB: A100
    (8, 6): 101_376,   # 99 KB: A10, A40, RTX 30
    (8, 7): 166_912,   # 163 KB: Jetson Orin
    (8, 9): 101_376,   # 99 KB: L4, L40, RTX 40
    (9, 0): 232_448,   # 227 KB: H100, H200
    (10, 0): 232_448,  # 227 KB: B200
    (12, 0): 101_376,  # 99 KB: RTX 50
}
# The kernels' operands are 16-bit: bf16 or fp16 as given, f32 rounded to bf16 by `matmul`.
_OPERAND_BYTES = 2
# Tried in order when a Triton tile, with its stages cut down to 2, still needs more shared
# memory than the device gives a block. Chosen only to fit (a T4's 64 KB; then the
# small-problem tile), not timed on those GPUs: `kernels.autotune` measures the device's own
# winner.
_SMALLER_TRITON = (
    MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=4, group_m=8),
    MatmulConfig(block_m=128, block_n=128, block_k=32, num_stages=4, num_warps=4, group_m=8),
    _SMALL_TRITON,
)


def _pipeline_buffers(num_stages: int, compute_capability: tuple[int, int] | None) -> int:
    """Shared-memory buffers Triton's pipeline keeps per operand for `num_stages`.

    Triton 3.6 compiled our kernel with num_stages - 1 buffers for sm_80, sm_86 and sm_89
    (cp.async: the stage being computed on is read from the oldest buffer) and num_stages
    for sm_90 (TMA), e.g. 128 x 256 x 64 at 4 stages: 147,456 bytes on sm_80/86/89 and
    196,608 on sm_90 (tools/probe_triton_smem.py; BENCHMARKS.md, thirty-fourth session).
    Every major-8 GPU is counted as the three measured; other and unknown capabilities get
    the larger count, so that an unmeasured GPU errs towards a tile that fits.
    """
    if compute_capability is not None and compute_capability[0] == 8:
        return max(1, num_stages - 1)
    return num_stages


def triton_shared_memory_bytes(config: MatmulConfig,
                               compute_capability: tuple[int, int] | None = None,
                               itemsize: int = _OPERAND_BYTES) -> int:
    """Shared memory, in bytes, that Triton's software pipeline allocates for `config` on a
    GPU of `compute_capability`: `_pipeline_buffers` buffers, each one block_m x block_k tile
    of A and one block_k x block_n tile of B, of `itemsize`-byte elements.

    The Hopper tile, 128 x 256 x 64 at 4 stages: 4 * (128*64 + 64*256) * 2 = 196,608 bytes
    on sm_90, 3 * 49,152 = 147,456 on sm_80 (Triton's own figures for our kernel).
    """
    tile_elements = config.block_m * config.block_k + config.block_k * config.block_n
    return _pipeline_buffers(config.num_stages, compute_capability) * tile_elements * itemsize


def shared_memory_per_block(compute_capability: tuple[int, int] | None) -> int | None:
    """The opt-in shared memory limit of one thread block, in bytes, on a GPU of
    `compute_capability` (major, minor); None when unknown: None, (0, 0) (what
    `runtime._backend.compute_capability` gives a CPU or TPU) or a capability not in
    `SHARED_MEMORY_PER_BLOCK`."""
    if compute_capability is None:
        return None
    if not (isinstance(compute_capability, tuple) and len(compute_capability) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in compute_capability)):
        raise ValueError(f"compute_capability={compute_capability!r} must be None or a "
                         f"(major, minor) tuple of ints such as (8, 0)")
    return SHARED_MEMORY_PER_BLOCK.get(compute_capability)


def _fit_shared_memory(config: MatmulConfig, limit: int,
                       compute_capability: tuple[int, int]) -> MatmulConfig:
    """`config` if its pipeline fits `limit` bytes, else the same tile with fewer stages
    (down to 2: fewer loads in flight, the same tile shape), else the first of
    `_SMALLER_TRITON` that fits."""
    fewer_stages = [dataclasses.replace(config, num_stages=stages)
                    for stages in range(config.num_stages - 1, 1, -1)]
    for candidate in (config, *fewer_stages, *_SMALLER_TRITON):
        if triton_shared_memory_bytes(candidate, compute_capability) <= limit:
            return candidate
    smallest = _SMALLER_TRITON[-1]
    raise ValueError(f"no Triton tile fits {limit} bytes of shared memory per block; the "
                     f"smallest, {smallest}, needs "
                     f"{triton_shared_memory_bytes(smallest, compute_capability)}")


def default_config(backend: str, device_kind: str, m: int, n: int, k: int, *,
                   compute_capability: tuple[int, int] | None = None) -> MatmulConfig:
    """The shipped tiling for `backend` on `device_kind` at problem size (m, n, k).

    `compute_capability` is the device's (major, minor), e.g. (8, 0) for an A100
    (`runtime._backend.compute_capability(device)`). Where `SHARED_MEMORY_PER_BLOCK` knows
    it, a Triton tile that would not fit the device's shared memory (the Hopper tile on an
    L4 or an RTX 30/40 would fail to compile) gives way to one that does; None, (0, 0) or a
    capability not in the table keeps the tile as chosen. Other backends ignore it.
    """
    if backend not in _FALLBACK:
        raise ValueError(f"{backend=} has no default config; expected one of {sorted(_FALLBACK)}")
    limit = shared_memory_per_block(compute_capability)
    config = SHIPPED_DEFAULTS.get((backend, _device_family(device_kind)), _FALLBACK[backend])
    if backend == "triton" and max(m, n) <= 512:
        config = _SMALL_TRITON
    if backend == "triton" and limit is not None:
        config = _fit_shared_memory(config, limit, compute_capability)
    if backend == "mosaic_gpu":
        config = _fill_the_sms(_fewest_padded(config, m, n), m, n, k)
    return config


_HOPPER_SMS = 132  # H100 SXM and H200; devices that fall back to the Hopper tile use it too


def _fill_the_sms(config: MatmulConfig, m: int, n: int, k: int) -> MatmulConfig:
    """The shipped Hopper tile, or half its height (block_m 64: a 128 x 128 CTA tile) when
    the shipped 256 x 128 CTA tile leaves three quarters of the SMs idle through a long
    K loop.

    Measured on an H200 (sixteenth session, BENCHMARKS.md), shipped -> halved, us:
      - <= 32 CTAs and >= 16 K steps, halving won: 2048x512x2048 46.5 -> 33.3;
        1024^3 37.1 -> 34.2; 1024x1024x4096 47.0 -> 35.7; 768x768x3072 43.1 -> 34.8.
      - 64 CTAs, halving lost: 1024x2048x4096 47.9 -> 52.9; 512x4096x2048 52.8 -> 59.2;
        2048x1024x2048 34.4 -> 44.3 (and 68 CTAs: 1024x2176x4096 49.5 -> 53.3).
      - 28 CTAs but 9 K steps, it lost: 1000x777x513 43.1 -> 58.3.
    """
    if config != _HOPPER_MOSAIC:  # another split or device's tile: not what was measured
        return config
    from jaxopt_train.kernels.mosaic_gpu import cluster_tile  # it imports this module

    rows, cols = cluster_tile(config)
    ctas = -(-m // rows) * -(-n // cols)
    if 4 * ctas > _HOPPER_SMS or k < 16 * config.block_k:
        return config
    return dataclasses.replace(config, block_m=64, group_m=8)


def _padded_area(config: MatmulConfig, m: int, n: int) -> int:
    """Elements of C the Mosaic GPU kernel's tiles cover for an m x n product (whole
    cluster tiles)."""
    from jaxopt_train.kernels.mosaic_gpu import _round_up, cluster_tile  # it imports this module

    rows, cols = cluster_tile(config)
    return _round_up(m, rows) * _round_up(n, cols)


def _fewest_padded(config: MatmulConfig, m: int, n: int) -> MatmulConfig:
    """`config`, or its other consumer split when that one tiles M and N exactly and
    `config` does not.

    gpt-1b's tied-head weight gradient (M = 50,304 = 393 x 128 rows) was padded to
    256-row tiles: ~0.5 ms of its 89 ms step on an H200, where side-by-side consumers
    (128-row tiles) fit exactly. (That padding was a copy of the 824 MB logits
    gradient; since the wrapper lets TMA cover partial tiles, a partial tile costs
    only the idle part of its last wave, but this choice is the one measured.)
    Shapes that both splits pad keep the shipped split, which measured faster.
    """
    if config.cluster != "none" or config.schedule != "cooperative":
        return config
    other = dataclasses.replace(config, wg_split="n" if config.wg_split == "m" else "m")
    exact = m * n
    return other if _padded_area(config, m, n) > exact == _padded_area(other, m, n) else config
