"""MFU formula and the peak table."""

import math
import warnings

import jax.numpy as jnp
import pytest

from jaxopt_train.train import mfu as mfu_lib


@pytest.mark.parametrize("kind, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
    ("NVIDIA H200", "bf16", 989.0),
    ("NVIDIA H200", "fp32", 67.0),
    ("NVIDIA H200", "tf32", 494.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "bf16", 835.0),  # not the SXM parts' 989
    ("NVIDIA H200 NVL", "bf16", 835.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA GH200 480GB", "bf16", 989.0),  # "h200" is not a word of it
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", None),  # not read as an L4
    ("NVIDIA A10", "bf16", None),  # nor an A10 as an A100
    ("Tesla T4", "fp16", 65.0),
    ("Tesla T4", "bf16", None),  # no bf16 tensor cores: no peak to measure against
    ("Tesla T4", "tf32", 8.1),
    ("NVIDIA T400", "fp16", None),  # not a T4
    ("TPU v4", "bf16", 275.0),
    ("TPU v4 lite", "bf16", 138.0),  # v4i: half v4's MXUs; it matched v4's 275 (MFU halved)
    ("TPU v5 lite", "bf16", 197.0),
    ("TPU v5p", "bf16", 459.0),
    ("TPU v6 lite", "bf16", 918.0),
    ("cpu", "bf16", None),
    ("TPU v4", "fp32", None),
])
def test_peak_table(kind, dtype, expected):
    assert mfu_lib.peak_tflops(kind, dtype) == expected


@pytest.mark.parametrize("dtype, precision, name", [
    (jnp.bfloat16, None, "bf16"), (jnp.float16, None, "fp16"), (jnp.float32, None, "tf32"),
    (jnp.float32, "tensorfloat32", "tf32"), (jnp.float32, "highest", "fp32"),
    (jnp.float32, "bfloat16", "tf32"),  # JAX's DEFAULT precision: TF32 on NVIDIA GPUs
])
def test_matmul_dtype_name(dtype, precision, name):
    assert mfu_lib.matmul_dtype_name(dtype, precision) == name


def test_matmul_dtype_name_rejects_ints():
    with pytest.raises(ValueError, match="compute_dtype=int32"):
        mfu_lib.matmul_dtype_name(jnp.int32)


def test_mfu_formula():
    # 989 TFLOP/s on 2 devices; a step of 989e12 FLOPs in 1 s is 50%.
    assert mfu_lib.mfu(989e12, 1.0, 989.0, 2) == pytest.approx(0.5)
    assert mfu_lib.mfu(1e12, 0.5, None, 1) is None
    with pytest.raises(ValueError, match="step_time_s"):
        mfu_lib.mfu(1e12, 0.0, 989.0, 1)


def test_unknown_device_warns_once_and_override_wins():
    mfu_lib._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mfu_lib.resolve_peak_tflops("Imaginary XPU", "bf16") is None
        assert mfu_lib.resolve_peak_tflops("Imaginary XPU", "bf16") is None
    assert len(caught) == 1 and "--peak-tflops" in str(caught[0].message)
    assert mfu_lib.resolve_peak_tflops("Imaginary XPU", "bf16", 123.0) == 123.0
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu_lib.resolve_peak_tflops("cpu", "bf16", -1.0)


def test_bf16_on_a_t4_says_it_has_no_bf16_tensor_cores_and_names_fp16():
    """A T4 under --precision bf16 runs every matmul in float32, without tensor cores, and
    was only told the table had no peak for it, as if the table were merely incomplete."""
    mfu_lib._warned.clear()
    with pytest.warns(UserWarning) as caught:
        assert mfu_lib.resolve_peak_tflops("Tesla T4", "bf16") is None
    message = str(caught[0].message)
    assert "Tesla T4 has no bf16 tensor cores" in message
    assert "--precision fp16 runs them on its fp16 tensor cores, 65 TFLOP/s dense" in message
    assert "--peak-tflops" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an A100 and an L4 have bf16 peaks: no warning at all
        assert mfu_lib.resolve_peak_tflops("NVIDIA A100-SXM4-40GB", "bf16") == 312.0
        assert mfu_lib.resolve_peak_tflops("NVIDIA L4", "bf16") == 121.0
    with pytest.warns(UserWarning) as caught:  # an unknown device keeps the plain message
        mfu_lib.resolve_peak_tflops("Imaginary XPU 2", "bf16")
    assert "tensor cores" not in str(caught[0].message)


def test_float64_matmuls_are_not_measured_against_the_tf32_peak():
    """Before: "tf32", so f64 matmuls (no TF32 mode; their own, far lower, peak) were
    measured against the TF32 peak: MFU read ~7x too low on an H100. The table has no
    f64 column, so MFU is omitted with the usual warning instead."""
    assert mfu_lib.matmul_dtype_name(jnp.float64) == "fp64"
    assert mfu_lib.matmul_dtype_name(jnp.float64, "highest") == "fp64"
    assert mfu_lib.peak_tflops("NVIDIA H100 80GB HBM3", "fp64") is None


@pytest.mark.parametrize("peak", [math.inf, True, "100", math.nan, 0.0])
def test_a_peak_tflops_override_must_be_a_finite_number(peak):
    """An inf peak gave an MFU of 0.0 without a word; True was read as 1 TFLOP/s."""
    with pytest.raises(ValueError, match="peak_tflops=.* must be a finite number > 0"):
        mfu_lib.resolve_peak_tflops("NVIDIA H100 80GB HBM3", "bf16", peak)
    assert mfu_lib.resolve_peak_tflops("cpu", "bf16", 100) == 100.0


@pytest.mark.parametrize("step_time, devices", [(math.nan, 1), (1.0, True)])
def test_mfu_refuses_a_nan_step_time_and_a_bool_device_count(step_time, devices):
    """A NaN step time gave an MFU of nan."""
    with pytest.raises(ValueError, match="step_time_s"):
        mfu_lib.mfu(1e12, step_time, 989.0, devices)
