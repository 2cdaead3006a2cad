"""Model FLOP utilisation: achieved FLOP/s over the hardware's dense peak.

MFU = (model FLOPs per step / step time) / (peak FLOP/s per device x devices).
Model FLOPs are counted from the model (PaLM appendix B: 6N + 12*L*d*T per
token for a decoder), not from what XLA executes, so rematerialisation does
not inflate the figure.

The peak is the datasheet's *dense* figure for the dtype the matmuls run in.
A device we have no figure for (CPU included) omits MFU with one warning;
`peak_tflops=` (the CLI's `--peak-tflops`) overrides the table.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings

import numpy as np

# Dense TFLOP/s per device, by the dtype the matmuls run in. Keys of the outer
# table are lowercase names found in `jax.Device.device_kind` as whole words (so "l4" is
# not read into "l40s", nor "a10" into "a100"), checked in order (more specific names
# first: "h100 pcie" before "h100", "v5 lite" before "v5").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h100 pcie", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    # The NVL (PCIe, 350-600 W) parts: half of the datasheets' sparse 1,671 / 835 TFLOP/s.
    ("h100 nvl", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("h200 nvl", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("h100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("h200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("gh200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),  # H200's GPU
    ("a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # Colab's other GPUs. L4: half the datasheet's sparse 242 (bf16/fp16) and 120 (tf32).
    ("l4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # T4 (Turing): fp16 tensor cores only; no bf16 or TF32 ones, so bf16 has no entry and
    # JAX's default-precision f32 matmuls run at the plain fp32 rate.
    ("t4", {"fp16": 65.0, "tf32": 8.1, "fp32": 8.1}),
    # TPU v4i reports "TPU v4 lite": 4 MXUs to v4's 8 at 1.05 GHz (4 x 128^2 x 2 x 1.05e9).
    ("tpu v4 lite", {"bf16": 138.0}),
    ("tpu v4", {"bf16": 275.0}),
    ("tpu v5 lite", {"bf16": 197.0}),
    ("tpu v5e", {"bf16": 197.0}),
    ("tpu v5p", {"bf16": 459.0}),
    ("tpu v5", {"bf16": 459.0}),
    ("tpu v6 lite", {"bf16": 918.0}),
    ("tpu v6e", {"bf16": 918.0}),
)

_warned: set[tuple[str, str]] = set()


def matmul_dtype_name(compute_dtype, matmul_precision: str | None = None) -> str:
    """The peak-table column for a policy: "bf16", "fp16", "tf32", "fp32" or "fp64".

    float32 matmuls count as TF32 unless the precision forces full f32 passes,
    because that is what XLA runs on NVIDIA Ampere+ at its default precision.
    `matmul_precision="bfloat16"` is JAX's name for that same DEFAULT precision (one
    bf16 pass on TPU, TF32 on NVIDIA GPUs), so it counts as TF32 too: the GPU column.
    float64 has no TF32 mode: its column, absent from the table, omits MFU rather
    than measure f64 matmuls against the TF32 peak.
    """
    dtype = np.dtype(compute_dtype)
    if dtype.name == "bfloat16":
        return "bf16"
    if dtype == np.float16:
        return "fp16"
    if dtype == np.float64:
        return "fp64"
    if dtype == np.float32:
        return "fp32" if matmul_precision in ("highest", "float32") else "tf32"
    raise ValueError(f"compute_dtype={dtype} has no peak-table column; expected bf16, f16, f32 or f64")


def peak_tflops(device_kind: str, dtype_name: str) -> float | None:
    """Dense peak TFLOP/s of one device, or None when the table has no entry."""
    kind = device_kind.lower()
    for pattern, by_dtype in PEAK_TFLOPS:
        if re.search(rf"(?<![a-z0-9]){re.escape(pattern)}(?![a-z0-9])", kind):
            return by_dtype.get(dtype_name)
    return None


def resolve_peak_tflops(device_kind: str, dtype_name: str, override: float | None = None,
                        *, warn: bool = True) -> float | None:
    """The override if given, else the table's entry; warns once per unknown device/dtype."""
    if override is not None:
        # Finite too: an inf peak gave an MFU of 0.0 without a word; True passed as 1.0.
        real = not isinstance(override, bool) and isinstance(override, numbers.Real)
        if not (real and 0 < override < math.inf):
            raise ValueError(f"peak_tflops={override!r} must be a finite number > 0 (TFLOP/s "
                             "per device)")
        return float(override)
    peak = peak_tflops(device_kind, dtype_name)
    if peak is None and warn and (device_kind, dtype_name) not in _warned:
        _warned.add((device_kind, dtype_name))
        warnings.warn(
            f"MFU omitted: no dense peak TFLOP/s known for device kind {device_kind!r} with "
            f"{dtype_name} matmuls{_no_tensor_cores_note(device_kind, dtype_name)}; pass "
            "--peak-tflops (TrainConfig.peak_tflops) to set one.",
            stacklevel=2)
    return peak


def _no_tensor_cores_note(device_kind: str, dtype_name: str) -> str:
    """Where the table knows the GPU's fp16 peak but not a bf16 one (a T4: Turing has fp16
    tensor cores only), a bf16 policy runs every matmul without them: say so, and the fix."""
    fp16 = peak_tflops(device_kind, "fp16")
    if dtype_name != "bf16" or fp16 is None:  # the caller found no bf16 peak
        return ""
    return (f" ({device_kind} has no bf16 tensor cores, so XLA runs these matmuls in float32, "
            f"without them; --precision fp16 runs them on its fp16 tensor cores, "
            f"{fp16:g} TFLOP/s dense)")


def mfu(flops_per_step: float, step_time_s: float, peak_tflops_per_device: float | None,
        num_devices: int) -> float | None:
    """Model FLOP utilisation in [0, 1] (None when the peak is unknown)."""
    if peak_tflops_per_device is None:
        return None
    # `not >` so that a NaN step time is refused too: it gave an MFU of nan.
    if not step_time_s > 0 or isinstance(num_devices, bool) or not num_devices >= 1:
        raise ValueError(f"{step_time_s=} must be > 0 and {num_devices=} >= 1")
    return flops_per_step / step_time_s / (peak_tflops_per_device * 1e12 * num_devices)
