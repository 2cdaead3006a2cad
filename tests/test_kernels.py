"""CPU tests of jaxopt_train.kernels: interpret-mode Pallas kernel vs the jnp reference."""

from __future__ import annotations

import dataclasses
import functools
import json
from types import SimpleNamespace

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxopt_train.kernels import (MatmulConfig, autotune, dot_general_for, make_dot_general,
                                  matmul, matmul_reference)
from jaxopt_train.kernels import autotune as _  # noqa: F401  (the function re-export)
from jaxopt_train.kernels import configs
from jaxopt_train.kernels import matmul as matmul_fn
from jaxopt_train.kernels import pallas_blocked

import importlib
import logging

autotune_mod = importlib.import_module("jaxopt_train.kernels.autotune")
matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")

TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-2}


@pytest.fixture(autouse=True)
def _private_cache(private_autotune_cache):
    """Every test sees an empty autotune cache in its own directory (conftest)."""


def _operands(shape_a, k, n, dtype, seed=0):
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (*shape_a, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    bias = jax.random.normal(kc, (n,), jnp.float32)
    return a, b, bias


def _assert_close(out, ref, dtype):
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    scale = max(1.0, float(np.max(np.abs(ref32))))
    np.testing.assert_allclose(out32, ref32, atol=TOL[dtype] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (127, 129, 65)])
def test_interpret_matches_reference(m, n, k, dtype):
    a, b, _ = _operands((m,), k, n, dtype)
    out = jax.jit(lambda a, b: matmul(a, b, backend="interpret", out_dtype=jnp.float32))(a, b)
    ref = matmul_reference(a, b, out_dtype=jnp.float32)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    # Same bf16/fp16 inputs, f32 accumulation both sides: only summation order differs.
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_batched_and_default_out_dtype():
    a, b, bias = _operands((2, 3, 17), 40, 33, jnp.bfloat16)
    out = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation="relu",
                                            backend="interpret"))(a, b, bias)
    assert out.shape == (2, 3, 17, 33) and out.dtype == jnp.bfloat16
    _assert_close(out, matmul_reference(a, b, bias=bias, activation="relu"), jnp.bfloat16)


def test_float32_inputs_are_rounded_to_bfloat16():
    a, b, _ = _operands((9,), 20, 11, jnp.float32)
    out = matmul(a, b, backend="interpret")
    assert out.dtype == jnp.float32
    rounded = matmul_reference(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), out_dtype=jnp.float32)
    np.testing.assert_allclose(out, rounded, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("activation", [None, "gelu", "relu", "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_epilogue_combinations(with_bias, activation):
    a, b, bias = _operands((24,), 16, 40, jnp.bfloat16, seed=3)
    bias = bias if with_bias else None
    out = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation=activation,
                                            backend="interpret", out_dtype=jnp.float32))(a, b, bias)
    ref = matmul_reference(a, b, bias=bias, activation=activation, out_dtype=jnp.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_xla_backend_matches_reference(dtype):
    a, b, bias = _operands((2, 31), 47, 29, dtype)
    out = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu", backend="xla"))(
        a, b, bias)
    _assert_close(out, matmul_reference(a, b, bias=bias, activation="gelu"), dtype)


@pytest.mark.slow
def test_large_odd_shape_once():
    a, b, bias = _operands((1000,), 513, 777, jnp.bfloat16)
    big_tiles = MatmulConfig(block_m=256, block_n=256, block_k=256)  # 4x4x3 interpreted steps
    out = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation="silu", backend="interpret",
                                            out_dtype=jnp.float32, config=big_tiles))(a, b, bias)
    ref = matmul_reference(a, b, bias=bias, activation="silu", out_dtype=jnp.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)


def test_pallas_tpu_kernel_under_tpu_interpreter_with_race_detection():
    from jax.experimental.pallas import tpu as pltpu

    a, b, bias = _operands((64,), 96, 64, jnp.bfloat16)
    config = MatmulConfig(block_m=32, block_n=32, block_k=32)
    params = pltpu.InterpretParams(detect_races=True)
    out = jax.jit(lambda a, b, bias: pallas_blocked.blocked_matmul(
        a, b, bias, activation="gelu", out_dtype=jnp.float32, config=config,
        interpret=params))(a, b, bias)
    ref = matmul_reference(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    races = getattr(tpu_interpreter, "races", None)
    assert races is not None and not races.races_found


def _loss(fn):
    return lambda a, b, bias: jnp.sum(jnp.sin(fn(a, b, bias).astype(jnp.float32)))


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("with_bias,activation", [(False, None), (True, "gelu")])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gradients_match_reference(backend, with_bias, activation, transpose_b):
    # transpose_b: b stored (N, K), product a @ b.T (the tied LM head's layout).
    a, b, bias = _operands((2, 19), 33, 21, jnp.bfloat16, seed=1)
    b = b.T if transpose_b else b
    as_kn = (lambda b: b.T) if transpose_b else (lambda b: b)
    bias = bias if with_bias else None
    ours = _loss(lambda a, b, bias: matmul(a, b, bias=bias, activation=activation, backend=backend,
                                           out_dtype=jnp.float32, transpose_b=transpose_b))
    ref = _loss(lambda a, b, bias: matmul_reference(a, as_kn(b), bias=bias, activation=activation,
                                                    out_dtype=jnp.float32))
    out = matmul(a, b, bias=bias, activation=activation, backend=backend, transpose_b=transpose_b)
    assert out.shape == (2, 19, 21)
    _assert_close(out, matmul_reference(a, as_kn(b), bias=bias, activation=activation), jnp.bfloat16)
    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.jit(jax.grad(ours, argnums=argnums))(a, b, bias)
    want = jax.grad(ref, argnums=argnums)(a, b, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        # dZ is rounded to bf16 before the backward kernels (as XLA's bf16 dots do).
        _assert_close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_saved_preactivation_gradients_match_reference(backend, activation, with_bias):
    """save_preactivation keeps Z for the activation's backward instead of recomputing it:
    same forward, gradients against the full-precision reference, and no extra matmul."""
    a, b, bias = _operands((2, 19), 33, 21, jnp.bfloat16, seed=4)
    bias = bias if with_bias else None

    def call(save):
        return lambda a, b, bias: matmul(a, b, bias=bias, activation=activation, backend=backend,
                                         save_preactivation=save)

    ref = lambda a, b, bias: matmul_reference(a, b, bias=bias, activation=activation)  # noqa: E731
    _assert_close(call(True)(a, b, bias), ref(a, b, bias), jnp.bfloat16)
    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.jit(jax.grad(_loss(call(True)), argnums=argnums))(a, b, bias)
    want = jax.grad(_loss(ref), argnums=argnums)(a, b, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        _assert_close(g, w, jnp.bfloat16)
    # Recomputing Z costs one more product in the backward: 4 launches against 3.
    counts = {save: jax.jit(jax.grad(_loss(call(save)), argnums=argnums)).lower(a, b, bias)
              .as_text().count("call @_launch") for save in (False, True)}
    if backend == "interpret":
        assert counts == {False: 4, True: 3}, counts


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("m, n, k", [(100, 137, 73), (9, 13, 5), (64, 48, 40)])
def test_triton_operands_get_16_byte_rows_and_the_strides_that_address_them(m, n, k, transpose_a,
                                                                          transpose_b):
    """The Triton wrapper pads each operand's minor dim to a multiple of 8 elements (so the
    kernel can pipeline its loads) and passes the strides of the padded arrays: reading A
    and B through those strides, as the kernel does for rows < M, cols < N and k < K, gives
    the operands back, with zeros in the padded part of K. Aligned operands are not copied."""
    from jaxopt_train.kernels.triton_kernel import aligned_operands

    rng = np.random.default_rng(m + n + k)
    a_mat = rng.standard_normal((m, k)).astype(np.float16)
    b_mat = rng.standard_normal((k, n)).astype(np.float16)
    a = jnp.asarray(a_mat.T if transpose_a else a_mat)
    b = jnp.asarray(b_mat.T if transpose_b else b_mat)
    a_pad, b_pad, k_pad, (s_am, s_ak, s_bk, s_bn) = aligned_operands(a, b, transpose_a, transpose_b)
    assert a_pad.shape[1] % 8 == 0 and b_pad.shape[1] % 8 == 0, (a_pad.shape, b_pad.shape)
    assert k <= k_pad < k + 8
    if (m, n, k) == (64, 48, 40):
        assert a_pad is a and b_pad is b and k_pad == k
    rows, cols, depth = np.arange(m), np.arange(n), np.arange(k_pad)
    read_a = np.asarray(a_pad).ravel()[rows[:, None] * s_am + depth[None, :] * s_ak]
    read_b = np.asarray(b_pad).ravel()[depth[:, None] * s_bk + cols[None, :] * s_bn]
    np.testing.assert_array_equal(read_a[:, :k], a_mat)
    np.testing.assert_array_equal(read_b[:k], b_mat)
    assert not read_a[:, k:].any() and not read_b[k:].any()
    as_given = aligned_operands(a, b, transpose_a, transpose_b, multiple=1)
    assert as_given[0] is a and as_given[1] is b and as_given[2] == k


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_writes_the_preactivation_from_its_forward_launch(transpose_b, with_bias,
                                                                monkeypatch, fresh_kernel_launches):
    """On triton, `save_preactivation` takes act(Z) and Z from the forward kernel's one
    launch (its two-output epilogue), also for the tied head's transposed B; the backward
    then launches dA and dB only. The Triton kernel needs a GPU: here a jnp stand-in with
    its signature records the launches (the GPU tests run the kernel itself)."""
    import importlib

    from jaxopt_train.kernels import triton_kernel
    from jaxopt_train.kernels.epilogue import apply_epilogue

    module = importlib.import_module("jaxopt_train.kernels.matmul")
    monkeypatch.setattr(module, "resolve_backend", lambda backend: backend)
    launches = []

    def stand_in(a, b, bias, *, activation, out_dtype, config, transpose_a=False,
                 transpose_b=False, save_preactivation=False):
        launches.append((activation, transpose_a, transpose_b, save_preactivation))
        lhs, rhs = (a.T if transpose_a else a), (b.T if transpose_b else b)
        z = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32,
                    precision=lax.Precision.HIGHEST)
        z = z if bias is None else z + bias.astype(jnp.float32)
        out = apply_epilogue(z, None, activation).astype(out_dtype)
        return (out, z.astype(out_dtype)) if save_preactivation else out

    monkeypatch.setattr(triton_kernel, "triton_matmul", stand_in)  # fresh_kernel_launches: traced anew
    a, b, bias = _operands((2, 19), 33, 21, jnp.bfloat16, seed=5)
    b = b.T if transpose_b else b
    bias = bias if with_bias else None

    def ours(a, b, bias):
        return matmul(a, b, bias=bias, activation="gelu", backend="triton",
                      transpose_b=transpose_b, save_preactivation=True)

    def ref(a, b, bias):
        return matmul_reference(a, b.T if transpose_b else b, bias=bias, activation="gelu")

    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.grad(_loss(ours), argnums=argnums)(a, b, bias)
    # Forward: one launch writing both; backward: dA and dB, no recomputed Z.
    assert launches[0] == ("gelu", False, transpose_b, True), launches
    assert len(launches) == 3 and not any(save for *_, save in launches[1:]), launches
    want = jax.grad(_loss(ref), argnums=argnums)(a, b, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        _assert_close(g, w, jnp.bfloat16)
    assert module.writes_preactivation("triton", transpose_b)
    assert module.writes_preactivation("mosaic_gpu", transpose_b) == (not transpose_b)
    assert not module.writes_preactivation("interpret")


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_saved_preactivation_gelu_gradient_is_finite_for_large_preactivations(backend, dtype):
    """The kept Z's GELU derivative squares Z: above 255 that overflows fp16 (0 * inf = NaN),
    so it is taken in f32 for every input dtype."""
    a = jnp.ones((4, 8), dtype)
    b = jnp.stack([jnp.full((8,), 40.0), jnp.full((8,), -40.0), jnp.full((8,), 0.1)], 1).astype(dtype)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32))

    ours = loss(lambda a, b: matmul(a, b, activation="gelu", backend=backend,
                                    save_preactivation=True))
    got = jax.grad(ours, argnums=(0, 1))(a, b)
    want = jax.grad(loss(lambda a, b: matmul_reference(a, b, activation="gelu")),
                    argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), g
        _assert_close(g, w, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gelu_derivative_matches_autodiff_of_gelu(dtype):
    """The backward's closed-form GELU derivative against jax.grad of jax.nn.gelu (tanh form)
    in f32, over small, moderate and huge pre-activations (clamped, never NaN)."""
    from jaxopt_train.kernels.epilogue import gelu_derivative

    big = float(jnp.finfo(dtype).max)
    z = jnp.concatenate([jnp.linspace(-12.0, 12.0, 481), jnp.array([-300.0, 300.0, -big, big])])
    z = z.astype(dtype)
    got = gelu_derivative(z)
    assert got.dtype == jnp.float32
    want = jax.vmap(jax.grad(lambda x: jax.nn.gelu(x, approximate=True)))(
        jnp.clip(z.astype(jnp.float32), -1e4, 1e4))
    # atol: the tanh form cancels in 1 + tanh(u) below z ~ -9 (f32 noise of a few 1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-5)
    assert float(got[-4]) == 0.0 and float(got[-3]) == 1.0  # -300: 0, +300: 1


def test_gelu_derivative_is_differentiable_everywhere():
    """A second derivative through the fused epilogue differentiates `gelu_derivative`: its
    exp overflowed below z ~ -9 and gave NaN there (0 * inf) for a pre-activation as mild
    as -10. Against the tanh form's second derivative, finite everywhere."""
    from jaxopt_train.kernels.epilogue import gelu_derivative

    z = jnp.concatenate([jnp.linspace(-12.0, 12.0, 481),
                         jnp.array([-300.0, 300.0, -1e30, 1e30, -jnp.inf, jnp.inf])])
    got = jax.vmap(jax.grad(gelu_derivative))(z)
    assert bool(jnp.all(jnp.isfinite(got))), z[~jnp.isfinite(got)]
    # The tanh form's second derivative in float64, closed form: with u = c (z + a z^3),
    # gelu'' = sech^2(u) (u' - z tanh(u) u'^2 + z u'' / 2). Not jax.grad of jax.nn.gelu in f32:
    # that cancels at |z| ~ 4 to 5 (~2e-5 off), and XLA CPU's older emitters (tests/conftest.py)
    # round its tanh to ~1e-4 off at z ~ -7, where the true value is ~1e-14.
    x = np.asarray(z[:481], np.float64)
    c, a = np.sqrt(2.0 / np.pi), 0.044715
    u, du, d2u = c * (x + a * x**3), c * (1.0 + 3.0 * a * x**2), 6.0 * a * c * x
    want = (1.0 / np.cosh(u) ** 2) * (du - x * np.tanh(u) * du**2 + 0.5 * x * d2u)
    np.testing.assert_allclose(np.asarray(got[:481]), want, rtol=1e-4, atol=2e-6)  # measured 9.4e-7
    np.testing.assert_array_equal(np.asarray(got[481:]), 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name,reference", [("relu", jax.nn.relu), ("silu", jax.nn.silu)])
def test_activation_derivatives_match_jax_nn(name, reference, dtype):
    """relu's and silu's closed-form derivatives against jax.grad of jax.nn's functions in
    f32, including z == 0 (relu: 0, where autodiff of a max gives 0.5) and z far below
    zero (silu: 0, where autodiff of x / (1 + exp(-x)) gives NaN)."""
    from jaxopt_train.kernels.epilogue import ACTIVATION_DERIVATIVES

    big = float(jnp.finfo(dtype).max)
    z = jnp.concatenate([jnp.linspace(-12.0, 12.0, 481),
                         jnp.array([0.0, -100.0, 100.0, -big, big])]).astype(dtype)
    got = ACTIVATION_DERIVATIVES[name](z)
    assert got.dtype == jnp.float32
    want = jax.vmap(jax.grad(reference))(z.astype(jnp.float32))
    assert bool(jnp.all(jnp.isfinite(got))), got
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_matmul_gradient_at_activation_edge_points(backend, activation):
    """Gradients through the fused epilogue where the pre-activation sits exactly at relu's
    kink (a zero row with Flax's zero-initialised bias) or far below zero for silu (z = -128):
    equal to the reference's (jax.nn), finite, for A, B and the bias."""
    b = jnp.full((8, 4), 4.0, jnp.bfloat16)
    a = jnp.stack([jnp.zeros((8,)), jnp.full((8,), -4.0), jnp.full((8,), 0.25)]).astype(jnp.bfloat16)
    bias = jnp.zeros((4,), jnp.float32)

    def loss(fn):
        return lambda a, b, bias: jnp.sum(fn(a, b, bias).astype(jnp.float32))

    ours = loss(lambda a, b, bias: matmul(a, b, bias=bias, activation=activation,
                                          backend=backend, out_dtype=jnp.float32))
    ref = loss(lambda a, b, bias: matmul_reference(a, b, bias=bias, activation=activation,
                                                   out_dtype=jnp.float32))
    got = jax.grad(ours, argnums=(0, 1, 2))(a, b, bias)
    want = jax.grad(ref, argnums=(0, 1, 2))(a, b, bias)
    for g, w in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), g
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("activation,with_bias,transpose_b,save", [
    (None, False, False, False), ("gelu", True, False, False), ("silu", True, True, False),
    ("gelu", True, False, True), ("relu", False, True, True)])
def test_second_derivatives_on_a_kernel_backend_match_xla(activation, with_bias, transpose_b, save):
    """Grad of grad through the kernel backend (its backward differentiated again) used to
    fail with a bare AssertionError from pallas_call's JVP rule; it now equals the xla
    backend's, and the reference's within bf16 rounding (dZ is rounded to bf16 at each
    backward, as XLA's bf16 products do)."""
    a, b, bias = _operands((2, 9), 12, 10, jnp.bfloat16, seed=6)
    b = b.T if transpose_b else b
    bias = bias if with_bias else None

    def grad_norm(fn):  # the squared norm of d(loss)/d(a, b): a gradient penalty
        def loss(a, b):
            return jnp.sum(jnp.sin(fn(a, b).astype(jnp.float32)))

        def penalty(a, b):
            return sum(jnp.sum(g.astype(jnp.float32) ** 2)
                       for g in jax.grad(loss, argnums=(0, 1))(a, b))
        return jax.grad(penalty, argnums=(0, 1))

    def ours(backend):
        return grad_norm(lambda a, b: matmul(a, b, bias=bias, activation=activation,
                                             backend=backend, out_dtype=jnp.float32,
                                             transpose_b=transpose_b, save_preactivation=save))

    got = jax.jit(ours("interpret"))(a, b)
    xla = jax.jit(ours("xla"))(a, b)
    want = grad_norm(lambda a, b: matmul_reference(
        a, b.T if transpose_b else b, bias=bias, activation=activation,
        out_dtype=jnp.float32))(a, b)
    for g, x, w in zip(got, xla, want):
        assert g.dtype == w.dtype == jnp.bfloat16 and g.shape == w.shape
        _assert_close(g, x, jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=5e-2, atol=5e-2 * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("activation", [None, "gelu", "relu", "silu"])
def test_second_derivatives_through_lax_scan_match_xla(activation):
    """Grad of grad of layers stacked with lax.scan (as nnx.scan stacks them). It failed on
    the kernel backends: the padding of operands to whole blocks was a jnp.pad, a jit called
    with a literal, and a jit with a literal inside a custom_vjp's primal shifts its
    residuals in this transpose (jax 0.10): the backward got a scalar for `a`. The 4 x 12
    carry needs padding."""
    x0 = _operands((4,), 12, 12, jnp.bfloat16, seed=7)[0]
    w = jax.random.normal(jax.random.key(8), (3, 12, 12), jnp.float32) * 0.3
    bias = jax.random.normal(jax.random.key(9), (3, 12), jnp.float32) * 0.1

    def penalty(backend):
        def loss(w):
            def layer(x, wb):
                return matmul(x, wb[0].astype(jnp.bfloat16), bias=wb[1],
                              activation=activation, backend=backend), None
            return jnp.sum(jnp.sin(jax.lax.scan(layer, x0, (w, bias))[0].astype(jnp.float32)))
        return jax.grad(lambda w: jnp.sum(jax.grad(loss)(w) ** 2))

    got = jax.jit(penalty("interpret"))(w)
    want = jax.jit(penalty("xla"))(w)
    assert got.shape == w.shape and bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2,
                               atol=2e-2 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("activation,out_dtype", [(None, jnp.float32), ("gelu", jnp.float32),
                                                  ("silu", jnp.bfloat16)])
def test_float16_gradients_survive_a_cotangent_past_the_float16_range(backend, activation,
                                                                      out_dtype):
    """fp16 inputs with a wider output (f32, bf16): the backward rounded the cotangent to
    fp16, so one above 65504 became inf and made dA, dB and dbias inf, where the reference
    (and lax.dot_general) give finite gradients. Here dZ = 2e5 x act'(Z) > 65504 (act' is
    ~0.45 for gelu and silu at Z ~ -0.1), and |dA| <= 2e5 x 0.252, |dB| <= 2e5 x 0.2."""
    a = jnp.full((2, 4), 0.1, jnp.float16)
    b = jnp.full((4, 3), 1e-3, jnp.float16).at[0, 0].set(0.25)
    bias = jnp.full((3,), -0.1, jnp.float32)

    def loss(fn):  # a cotangent of 2e5 on every output
        return lambda a, b, bias: jnp.sum(fn(a, b, bias).astype(jnp.float32) * 2e5)

    got = jax.jit(jax.grad(loss(lambda a, b, bias: matmul(
        a, b, bias=bias, activation=activation, backend=backend, out_dtype=out_dtype)),
        argnums=(0, 1, 2)))(a, b, bias)
    want = jax.grad(loss(lambda a, b, bias: matmul_reference(
        a, b, bias=bias, activation=activation, out_dtype=out_dtype)), argnums=(0, 1, 2))(a, b, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), g
        _assert_close(g, w, jnp.float16)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_float16_gradients_keep_cotangents_below_the_float16_range(backend):
    """An f32 cotangent of ~1e-8 (below fp16's subnormals) was rounded to fp16 zero: dA was
    all zero and dB mostly so, where the reference keeps them."""
    keys = jax.random.split(jax.random.key(3), 3)
    a = jax.random.normal(keys[0], (8, 64)).astype(jnp.float16)
    b = (jax.random.normal(keys[1], (64, 32)) * 0.05).astype(jnp.float16)
    g = jax.random.normal(keys[2], (8, 32)) * 1e-8
    got = jax.vjp(lambda a, b: matmul(a, b, out_dtype=jnp.float32, backend=backend), a, b)[1](g)
    want = jax.vjp(lambda a, b: matmul_reference(a, b, out_dtype=jnp.float32), a, b)[1](g)
    for x, w in zip(got, want):
        x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
        # fp16 results: the reference's own are subnormal (relative precision ~1e-3 at best)
        np.testing.assert_allclose(x, w, rtol=0, atol=0.05 * np.max(np.abs(w)))
        assert np.count_nonzero(x) >= 0.9 * np.count_nonzero(w)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_float16_bias_gradient_of_a_wider_output_is_finite(backend, out_dtype):
    """fp16 inputs and bias, f32 or bf16 output: the backward shifts dZ to ~2**14, and its
    column sum was cast to the fp16 bias before being shifted back: 4 rows of a cotangent of
    1 gave dbias = inf instead of 4."""
    a, b = jnp.ones((4, 8), jnp.float16), jnp.ones((8, 3), jnp.float16)
    bias = jnp.zeros((3,), jnp.float16)
    got = jax.grad(lambda bias: jnp.sum(matmul(a, b, bias=bias, out_dtype=out_dtype,
                                               backend=backend).astype(jnp.float32)))(bias)
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [4.0, 4.0, 4.0])


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_one_non_finite_cotangent_leaves_the_other_rows_shifted(bad):
    """The shift read max|g| including the inf (or NaN), got no shift, and every other row
    of a 1e5 cotangent overflowed fp16."""
    a, b = jnp.full((2, 4), 2.0**-6, jnp.float16), jnp.full((4, 3), 2.0**-12, jnp.float16)
    g = jnp.full((2, 3), 1e5, jnp.float32).at[0, 0].set(bad)
    got = jax.vjp(lambda a, b: matmul(a, b, out_dtype=jnp.float32, backend="xla"), a, b)[1](g)[0]
    want = jax.vjp(lambda a, b: matmul_reference(a, b, out_dtype=jnp.float32), a, b)[1](g)[0]
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32),
                               rtol=1e-3)  # the row without the inf or NaN


def test_float16_dot_general_with_float32_output_takes_large_cotangents():
    """The audit's case: the drop-in's gradient was inf where lax.dot_general's is 300."""
    x, w = jnp.ones((2, 4), jnp.float16), jnp.full((4, 3), 1e-3, jnp.float16)
    dims = (((1,), (0,)), ((), ()))

    def grad(dot):
        return jax.grad(lambda x: jnp.sum(
            dot(x, w, dims, preferred_element_type=jnp.float32) * 1e5))(x)

    got, want = grad(make_dot_general("interpret")), grad(lax.dot_general)
    assert bool(jnp.all(jnp.isfinite(got))), got
    _assert_close(got, want, jnp.float16)


@pytest.mark.parametrize("name", ["gelu", "relu", "silu"])
def test_activation_derivatives_are_finite_at_infinite_preactivations(name):
    """A pre-activation kept in fp16 (save_preactivation) is +-inf past 65504; silu's
    derivative there was 0 * inf = NaN. Equal to the derivative's limits: 0 and 1."""
    from jaxopt_train.kernels.epilogue import ACTIVATION_DERIVATIVES

    z = jnp.array([-jnp.inf, jnp.inf, -70000.0, 70000.0], jnp.float32)
    for dtype in (jnp.float32, jnp.float16):
        got = ACTIVATION_DERIVATIVES[name](z.astype(dtype))
        np.testing.assert_array_equal(np.asarray(got), [0.0, 1.0, 0.0, 1.0])


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_saved_float16_preactivation_past_the_range_gives_finite_gradients(backend, activation):
    """Z = -80000 and +80000 are kept as fp16 -inf and +inf: gradients as the reference's."""
    a = jnp.stack([jnp.full((4,), -200.0), jnp.full((4,), 200.0)]).astype(jnp.float16)
    b = jnp.full((4, 3), 100.0, jnp.float16)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32))

    got = jax.grad(loss(lambda a, b: matmul(a, b, activation=activation, backend=backend,
                                            save_preactivation=True)), argnums=(0, 1))(a, b)
    want = jax.grad(loss(lambda a, b: matmul_reference(a, b, activation=activation)),
                    argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), g
        _assert_close(g, w, jnp.float16)


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", None])
def test_epilogue_backward_split_sum_changes_no_value(activation):
    """The GPU backends sum dbias in a pass of its own (an optimization barrier before the
    sum); the values are those of the fused pass the other backends let XLA choose."""
    from jaxopt_train.kernels.matmul_vjp import _epilogue_backward

    z, g = (jax.random.normal(jax.random.key(i), (48, 40)).astype(jnp.bfloat16) for i in (0, 1))
    bias = jnp.zeros((40,), jnp.float32)
    run = jax.jit(_epilogue_backward, static_argnums=(0, 4, 5))
    fused, split = (run(activation, z, g, bias, jnp.bfloat16, s) for s in (False, True))
    assert fused[0].dtype == jnp.bfloat16 and fused[1].dtype == jnp.float32
    for got, want in zip(split, fused):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_save_preactivation_bad_inputs():
    a, b, _ = _operands((4,), 8, 6, jnp.bfloat16)
    with pytest.raises(ValueError, match="save_preactivation=True needs an activation"):
        matmul(a, b, backend="xla", save_preactivation=True)
    with pytest.raises(TypeError, match="save_preactivation must be a bool"):
        matmul(a, b, backend="xla", activation="gelu", save_preactivation="yes")


def test_fused_dense_of_a_kernel_dot_general():
    """`make_dot_general(...).fused_dense`: the dense layer plus its activation from the
    kernel (pre-activation saved), and None where the kernels do not apply."""
    x, w, bias = _operands((3, 5), 24, 40, jnp.bfloat16, seed=5)
    fused = make_dot_general("interpret").fused_dense
    out = jax.jit(lambda x, w, bias: fused(x, w, bias, "gelu"))(x, w, bias)
    assert out.shape == (3, 5, 40) and out.dtype == jnp.bfloat16
    _assert_close(out, matmul_reference(x, w, bias=bias, activation="gelu"), jnp.bfloat16)
    assert fused(x.astype(jnp.float32), w.astype(jnp.float32), bias, "gelu") is None
    assert fused(x, w[None], bias, "gelu") is None
    assert make_dot_general("xla").fused_dense(x, w, bias, "gelu") is None
    for backend in ("interpret", "xla"):
        assert not make_dot_general(backend).fuses_in_one_launch(), backend


def test_only_mosaic_gpu_and_triton_apply_the_activation_in_the_kernel(monkeypatch):
    """`fuses_in_one_launch()` (the models' default fuses only there) by resolved backend,
    with every backend made resolvable on CPU."""
    import importlib

    module = importlib.import_module("jaxopt_train.kernels.dot_general")
    monkeypatch.setattr(module, "resolve_backend", lambda backend: backend)
    for backend in ("mosaic_gpu", "triton"):
        assert make_dot_general(backend).fuses_in_one_launch(), backend
    for backend in ("pallas_tpu", "interpret", "xla"):
        assert not make_dot_general(backend).fuses_in_one_launch(), backend


def test_layers_of_equal_shape_share_one_lowered_kernel():
    # Unrolled models call the kernel once per layer; each distinct launch must be
    # lowered once (gpt-1b's Mosaic GPU step lowered 195 kernels before this).
    import re

    config = {"block_m": 32, "block_n": 32, "block_k": 32}

    def loss(x, w):
        for _ in range(4):
            x = matmul(x, w, backend="interpret", config=config)
        return jnp.sum(x.astype(jnp.float32))

    x, w, _ = _operands((64,), 32, 32, jnp.bfloat16, seed=3)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    kernels = re.findall(r"func\.func (?:private )?@(_launch\w*)", text)
    calls = re.findall(r"call @_launch", text)
    assert len(calls) >= 11, calls  # 4 forward + 4 dW + at least 3 dX launches
    assert 1 <= len(kernels) <= 3, kernels  # forward, a.T @ g, g @ b.T at most
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    def ref_loss(x, w):
        for _ in range(4):
            x = matmul_reference(x, w).astype(jnp.bfloat16)
        return jnp.sum(x.astype(jnp.float32))

    for g, want in zip(got, jax.grad(ref_loss, argnums=(0, 1))(x, w)):
        _assert_close(g, want, jnp.bfloat16)


def test_dot_general_routes_rhs_contracted_on_dim_1_to_the_kernel():
    # x @ embedding.T written as a contraction on the embedding's dim 1 (no copy).
    x = jax.random.normal(jax.random.key(0), (3, 5, 24), jnp.bfloat16)
    table = jax.random.normal(jax.random.key(1), (40, 24), jnp.bfloat16)  # [vocab, d]
    dims = (((2,), (1,)), ((), ()))
    dot = make_dot_general("interpret")
    text = jax.jit(lambda x, t: dot(x, t, dims)).lower(x, table).as_text()
    assert "@_launch" in text  # went to the kernel, not to lax.dot_general
    out = jax.jit(lambda x, t: dot(x, t, dims))(x, table)
    _assert_close(out, lax.dot_general(x, table, dims, preferred_element_type=jnp.float32),
                  jnp.bfloat16)


@pytest.mark.parametrize("dims, kernel", [
    (((1, 0), ((), ())), True),  # ints for one-dim tuples
    (((1, 1), ((), ())), True),  # b stored (N, K)
    ((([1], [0]), ([], [])), True),
    (None, False),  # lax.dot's plain product of <= 2-D operands
])
def test_dot_general_reads_dimension_numbers_as_lax_does(dims, kernel):
    """`lax.dot_general` takes a contracting dim as a bare int (and no dimension numbers
    at all for a plain product); the drop-in raised "'int' object is not iterable"."""
    x = jax.random.normal(jax.random.key(0), (6, 24), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (24, 40), jnp.bfloat16)
    rhs = w.T if dims is not None and dims[0][1] in (1, [1]) else w
    dot = make_dot_general("interpret")
    text = jax.jit(lambda x, rhs: dot(x, rhs, dims)).lower(x, rhs).as_text()
    assert ("@_launch" in text) == kernel
    got, want = dot(x, rhs, dims), lax.dot_general(x, rhs, dims)
    assert got.shape == want.shape == (6, 40) and got.dtype == want.dtype
    _assert_close(got, lax.dot_general(x, rhs, dims, preferred_element_type=jnp.float32),
                  jnp.bfloat16)


def test_nnx_linear_with_kernel_dot_general():
    x = jax.random.normal(jax.random.key(0), (3, 5, 24), jnp.bfloat16)
    kwargs = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    layer = nnx.Linear(24, 40, rngs=nnx.Rngs(0), dot_general=make_dot_general("interpret"), **kwargs)
    plain = nnx.Linear(24, 40, rngs=nnx.Rngs(0), **kwargs)
    out = nnx.jit(lambda m, x: m(x))(layer, x)
    assert out.shape == (3, 5, 40) and out.dtype == jnp.bfloat16
    _assert_close(out, plain(x), jnp.bfloat16)
    grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(layer)
    want = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(plain)
    _assert_close(grads["kernel"][...], want["kernel"][...], jnp.bfloat16)


def test_linen_dense_with_kernel_dot_general():
    x = jax.random.normal(jax.random.key(0), (4, 24), jnp.bfloat16)
    dense = linen.Dense(16, dtype=jnp.bfloat16, dot_general=make_dot_general("interpret"))
    variables = dense.init(jax.random.key(1), x)
    out = jax.jit(dense.apply)(variables, x)
    want = linen.Dense(16, dtype=jnp.bfloat16).apply(variables, x)
    _assert_close(out, want, jnp.bfloat16)


def test_dot_general_falls_back_for_unsupported_dimension_numbers():
    dot = make_dot_general("interpret")
    lhs = jax.random.normal(jax.random.key(0), (2, 3, 4), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (2, 4, 5), jnp.bfloat16)
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(dot(lhs, rhs, batched), lax.dot_general(lhs, rhs, batched))
    f32 = lhs.astype(jnp.float32)[0]
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_array_equal(dot(f32, f32.T, dims, precision=lax.Precision.HIGHEST),
                                  lax.dot_general(f32, f32.T, dims, precision=lax.Precision.HIGHEST))
    # Empty operands (an empty batch, N = 0, K = 0), which the kernels refuse, go to XLA.
    for shape_l, shape_r in (((0, 4, 8), (8, 5)), ((4, 8), (8, 0)), ((4, 0), (0, 5))):
        l, r = jnp.ones(shape_l, jnp.bfloat16), jnp.ones(shape_r, jnp.bfloat16)
        flax_dims = (((l.ndim - 1,), (0,)), ((), ()))
        got, want = dot(l, r, flax_dims), lax.dot_general(l, r, flax_dims)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        assert dot.fused_dense(l, r, jnp.zeros((r.shape[1],), jnp.bfloat16), "gelu") is None
    assert dot_general_for("xla") is lax.dot_general
    with pytest.raises(ValueError, match="expected one of"):
        dot_general_for("cuda")
    # A typo fails where the layer is built, not at its first forward pass.
    with pytest.raises(ValueError, match="backend='bogus' is unknown"):
        make_dot_general("bogus")
    with pytest.raises(ValueError, match="unknown MatmulConfig fields"):
        make_dot_general("interpret", config={"block_x": 1})


def test_out_dtype_takes_dtype_names():
    a = jnp.ones((4, 8), jnp.bfloat16)
    b = jnp.ones((8, 6), jnp.bfloat16)
    assert matmul(a, b, backend="xla", out_dtype="f32").dtype == jnp.float32
    assert matmul(a, b, backend="xla", out_dtype="bf16").dtype == jnp.bfloat16


@pytest.mark.parametrize("call,error,match", [
    (lambda a, b: matmul(a[0], b), ValueError, "rank >= 2"),
    (lambda a, b: matmul(a, b[None]), ValueError, "rank 2"),
    (lambda a, b: matmul(a, b.astype(jnp.float16)), TypeError, "share a dtype"),
    (lambda a, b: matmul(a.astype(jnp.int32), b.astype(jnp.int32)), TypeError, "not supported"),
    (lambda a, b: matmul(a, b[:7]), ValueError, "contracting dims differ"),
    (lambda a, b: matmul(a, b, transpose_b=True), ValueError, r"b \(N, K\) with transpose_b=True"),
    (lambda a, b: matmul(a, b.T, transpose_b=True, bias=jnp.ones((8,))), ValueError, r"\(N,\)=\(6,\)"),
    (lambda a, b: matmul(a, b.T, transpose_b=1), TypeError, "transpose_b must be a bool"),
    (lambda a, b: matmul(a, b, backend="cuda"), ValueError, "expected one of"),
    pytest.param(lambda a, b: matmul(a, b, backend="mosaic_gpu"), RuntimeError, "unavailable",
                 marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU may run it")),
    (lambda a, b: matmul(a, b, activation="tanh"), ValueError, "activation"),
    (lambda a, b: matmul(a, b, bias=jnp.ones((3,))), ValueError, "bias must have shape"),
    (lambda a, b: matmul(a, b, config={"block_m": 48}), ValueError, "power of two"),
    (lambda a, b: matmul(a, b, config={"tile": 4}), ValueError, "unknown MatmulConfig"),
    (lambda a, b: matmul(a, b, config=(1, 2)), TypeError, "MatmulConfig"),
    (lambda a, b: matmul(a, b, config={"schedule": "stream_k"}), ValueError, "cooperative"),
    (lambda a, b: matmul(a, b, config={"schedule": "pingpong", "cluster": "m"}), ValueError,
     "needs cluster='none'"),
    (lambda a, b: matmul(a, b, bias=[1.0] * 6), TypeError, r"bias must be an array of shape \(N,\)=\(6,\)"),
    (lambda a, b: matmul(a, b, bias=1.0), TypeError, "bias must be an array"),
    (lambda a, b: matmul(a, b, out_dtype="int8"), ValueError, "out_dtype='int8' is not supported; expected one of"),
    (lambda a, b: matmul(a, b, out_dtype=jnp.int32), ValueError, r"out_dtype=<class '.*int32'> is not supported"),
    # float64 was a TypeError, after the int8 message had listed it as accepted
    (lambda a, b: matmul(a, b, out_dtype=jnp.float64), ValueError, "bfloat16, float16, float32, or None"),
    (lambda a, b: matmul(a, b, out_dtype="float64"), ValueError, "'float64' is not supported"),
    (lambda a, b: matmul(a, b, config={"num_stages": True}), ValueError, "num_stages=True must be an int"),
    (lambda a, b: matmul(a, b, config={"num_warps": 4.0}), ValueError, "num_warps=4.0 must be an int"),
])
def test_bad_inputs_raise_clear_errors(call, error, match):
    a = jnp.ones((4, 8), jnp.bfloat16)
    b = jnp.ones((8, 6), jnp.bfloat16)
    with pytest.raises(error, match=match):
        call(a, b)


def test_default_configs_by_device_kind():
    hopper = configs.default_config("mosaic_gpu", "NVIDIA H100 80GB HBM3", 8192, 8192, 8192)
    assert hopper == configs.SHIPPED_DEFAULTS[("mosaic_gpu", "NVIDIA H100")]
    assert configs.default_config("triton", "NVIDIA H200", 256, 256, 256).block_m == 64
    with pytest.raises(ValueError, match="no default config"):
        configs.default_config("auto", "cpu", 1, 1, 1)


_HOPPER_TRITON = configs.SHIPPED_DEFAULTS[("triton", "NVIDIA H200")]
_KINDS = ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "Tesla T4",
          "NVIDIA GeForce RTX 4090")
_SHAPES = ((64, 64, 64), (512, 512, 4096), (1000, 777, 513), (4096, 1024, 4096),
           (8192, 8192, 8192), (50304, 2048, 2048))


def _fake_gpu(monkeypatch, capability: str, device_kind: str = "NVIDIA A100-SXM4-80GB"):
    """jax.devices() answers one GPU of `capability` ("8.0"); only platform, device_kind and
    compute_capability are read by the code under test."""
    gpu = SimpleNamespace(platform="gpu", device_kind=device_kind, compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu])


# Triton 3.6's own figures for our kernel, compiled for each target on the H200
# (tools/probe_triton_smem.py, benchmarks/session34/callC/smem_table.txt):
# (block_m, block_n, block_k, num_stages) -> {major: bytes}
_TRITON_REPORTED = {
    (128, 256, 64, 4): {8: 147_456, 9: 196_608}, (128, 256, 64, 3): {8: 98_304, 9: 147_456},
    (128, 256, 64, 2): {8: 49_152, 9: 98_304}, (256, 128, 64, 3): {8: 98_304, 9: 147_456},
    (128, 128, 64, 4): {8: 98_304, 9: 131_072}, (128, 128, 64, 3): {8: 65_536, 9: 98_304},
    (128, 128, 32, 4): {8: 49_152, 9: 65_536}, (64, 64, 32, 3): {8: 16_384, 9: 24_576},
}


@pytest.mark.parametrize("tile", sorted(_TRITON_REPORTED))
@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_triton_shared_memory_estimate_is_what_triton_reported(tile, capability):
    bm, bn, bk, stages = tile
    config = MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=8)
    got = configs.triton_shared_memory_bytes(config, capability)
    assert got == _TRITON_REPORTED[tile][capability[0]]


def test_triton_shared_memory_of_an_unmeasured_gpu_counts_every_stage():
    hand_computed = 4 * (128 * 64 + 64 * 256) * 2
    for capability in (None, (7, 5), (10, 0), (12, 0)):
        assert configs.triton_shared_memory_bytes(_HOPPER_TRITON, capability) == hand_computed
    three = dataclasses.replace(_HOPPER_TRITON, num_stages=3)
    assert configs.triton_shared_memory_bytes(three, itemsize=4) == 2 * 147_456
    one = dataclasses.replace(_HOPPER_TRITON, num_stages=1)  # one buffer even unpipelined
    assert configs.triton_shared_memory_bytes(one, (8, 0)) == 49_152


@pytest.mark.parametrize("kind, capability, limit, stages", [
    ("NVIDIA A100-SXM4-80GB", (8, 0), 166_912, 4),  # 147,456 bytes on sm_80: it fits as it is
    ("NVIDIA L4", (8, 9), 101_376, 3),
    ("NVIDIA A10", (8, 6), 101_376, 3),
    ("Tesla T4", (7, 5), 65_536, None),
])
def test_triton_default_fits_the_shared_memory_of_a_non_hopper_gpu(kind, capability, limit,
                                                                    stages):
    """The Hopper tile fell back on every device kind without a shipped tile: 147,456 bytes
    on sm_86/sm_89, over the 101,376 of an L4, A10 or RTX 30/40 ("out of resource: shared
    memory")."""
    config = configs.default_config("triton", kind, 8192, 8192, 8192,
                                    compute_capability=capability)
    assert configs.SHARED_MEMORY_PER_BLOCK[capability] == limit
    assert configs.triton_shared_memory_bytes(config, capability) <= limit
    if stages is not None:  # the same tile, with as many stages as fit
        assert config == dataclasses.replace(_HOPPER_TRITON, num_stages=stages)


@pytest.mark.parametrize("m, n, k", _SHAPES)
def test_triton_default_on_hopper_and_on_unknown_gpus_is_unchanged(m, n, k):
    today = _HOPPER_TRITON if max(m, n) > 512 else configs._SMALL_TRITON
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert configs.default_config("triton", kind, m, n, k, compute_capability=(9, 0)) == today
    for capability in (None, (0, 0), (7, 0), (11, 0)):  # unknown: the tile as before
        assert configs.default_config("triton", "NVIDIA A100-SXM4-80GB", m, n, k,
                                      compute_capability=capability) == today


def test_every_triton_default_fits_every_known_gpu():
    for capability, limit in configs.SHARED_MEMORY_PER_BLOCK.items():
        for kind in _KINDS:
            for m, n, k in _SHAPES:
                config = configs.default_config("triton", kind, m, n, k,
                                                compute_capability=capability)
                assert configs.triton_shared_memory_bytes(config, capability) <= limit, (
                    capability, kind, m, n)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "pallas_tpu", "interpret", "xla"])
def test_compute_capability_changes_no_other_backends_default(backend):
    for kind in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB", "TPU v5 lite", "cpu"):
        for m, n, k in _SHAPES:
            untold = configs.default_config(backend, kind, m, n, k)
            for capability in configs.SHARED_MEMORY_PER_BLOCK:
                assert configs.default_config(backend, kind, m, n, k,
                                              compute_capability=capability) == untold


@pytest.mark.parametrize("capability", ["8.0", (8,), (8, 0, 1), (8.0, 0), [8, 0], (True, 0)])
def test_default_config_refuses_a_compute_capability_that_is_not_two_ints(capability):
    with pytest.raises(ValueError, match=r"must be None or a \(major, minor\) tuple of ints"):
        configs.default_config("triton", "NVIDIA A100", 8192, 8192, 8192,
                               compute_capability=capability)


def test_resolve_config_fits_the_triton_tile_to_the_devices_shared_memory(monkeypatch):
    _fake_gpu(monkeypatch, "8.9", "NVIDIA L4")
    config = matmul_mod.resolve_config("triton", 8192, 8192, 8192, jnp.bfloat16)
    assert config == dataclasses.replace(_HOPPER_TRITON, num_stages=3)
    _fake_gpu(monkeypatch, "7.5", "Tesla T4")
    config = matmul_mod.resolve_config("triton", 8192, 8192, 8192, jnp.bfloat16, "b")
    assert configs.triton_shared_memory_bytes(config, (7, 5)) <= 65_536
    _fake_gpu(monkeypatch, "8.0")
    assert matmul_mod.resolve_config("triton", 8192, 8192, 8192, jnp.bfloat16) == _HOPPER_TRITON


@pytest.mark.parametrize("m, n, split", [
    (50304, 2048, "n"),   # gpt-1b's head weight gradient: 393 x 128 rows, no pad side by side
    (8192, 2048, "m"),    # fits the shipped 256 x 128 CTA tile
    (50304, 2000, "m"),   # both splits pad: the shipped split stays
    (127, 129, "m"),
])
def test_mosaic_default_picks_the_consumer_split_that_needs_no_padding(m, n, split):
    config = configs.default_config("mosaic_gpu", "NVIDIA H200", m, n, 512)
    shipped = configs.SHIPPED_DEFAULTS[("mosaic_gpu", "NVIDIA H200")]
    assert config == dataclasses.replace(shipped, wg_split=split)


@pytest.mark.parametrize("m, n, k, half", [
    (2048, 512, 2048, True),    # 32 CTAs, 32 K steps (measured 1.40x faster halved)
    (1024, 1024, 1024, True),   # 32 CTAs, 16 K steps (1.08x)
    (768, 768, 3072, True),     # 18 CTAs (1.24x)
    (1000, 777, 513, False),    # 28 CTAs but 9 K steps (measured 0.74x halved)
    (1024, 2048, 4096, False),  # 64 CTAs (0.91x)
    (1024, 1152, 4096, False),  # 36 CTAs: over a quarter of the 132 SMs
    (127, 129, 8192, True),
])
def test_mosaic_default_halves_the_tile_when_few_ctas_run_a_long_k_loop(m, n, k, half):
    shipped = configs.SHIPPED_DEFAULTS[("mosaic_gpu", "NVIDIA H200")]
    config = configs.default_config("mosaic_gpu", "NVIDIA H200", m, n, k)
    assert config == (dataclasses.replace(shipped, block_m=64, group_m=8) if half else shipped)


def test_autotune_picks_fastest_correct_candidate_and_caches_it(tmp_path, monkeypatch):
    small, large = (MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1),
                    MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1))
    fake_seconds = {small: 2e-3, large: 1e-3, None: 3e-3}  # None: XLA's dot (config=None)
    timed = []

    def timer(fn):
        fn()
        timed.append(current[0])
        return fake_seconds[current[0]]

    current = [None]
    real_matmul = matmul_mod.matmul

    def spying_matmul(a, b, *, config, **kw):
        current[0] = config
        return real_matmul(a, b, config=config, **kw)

    monkeypatch.setattr(matmul_mod, "matmul", spying_matmul)
    winners = autotune([(40, 24, 36)], jnp.bfloat16, backend="interpret",
                       candidates=[small, large], timer=timer)
    assert winners == {(40, 24, 36): large} and timed == [small, large, None]
    data = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert sorted(key.rsplit("|", 1)[1] for key in data) == ["40x24x36", "m64_n32_k64"]
    for key, entry in data.items():
        assert "jax" + jax.__version__ in key and entry["config"] == large.to_dict()
        assert (entry["seconds"], entry["xla_seconds"]) == (1e-3, 3e-3)
    autotune_mod._loaded.clear()  # read back from disk, as a new process would
    device_kind = jax.devices()[0].device_kind
    assert autotune_mod.lookup("interpret", device_kind, 33, 17, 60, jnp.bfloat16) == large
    assert matmul_mod.resolve_config("interpret", 33, 17, 60, jnp.bfloat16) == large
    assert autotune_mod.lookup("interpret", device_kind, 33, 17, 60, jnp.float16) is None


def test_autotune_cache_keeps_each_tuned_shape_of_a_bucket(tmp_path, monkeypatch):
    """Two tuned shapes of one bucket keep their own winners; the bucket serves untuned
    shapes with the last one tuned (the sixteenth session's sweep of 1024^3 and
    1000x777x513 lost the first winner before exact entries)."""
    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", str(tmp_path))
    autotune_mod._loaded.clear()
    first, second = (MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1),
                     MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1))
    kind = "NVIDIA H200"
    autotune_mod.store("mosaic_gpu", kind, 1024, 1024, 1024, jnp.bfloat16, first, 1e-5)
    autotune_mod.store("mosaic_gpu", kind, 1000, 777, 513, jnp.bfloat16, second, 2e-5)
    assert len(json.loads((tmp_path / "matmul_autotune.json").read_text())) == 3  # one bucket
    autotune_mod._loaded.clear()
    assert autotune_mod.lookup("mosaic_gpu", kind, 1024, 1024, 1024, jnp.bfloat16) == first
    assert autotune_mod.lookup("mosaic_gpu", kind, 1000, 777, 513, jnp.bfloat16) == second
    assert autotune_mod.lookup("mosaic_gpu", kind, 900, 1000, 600, jnp.bfloat16) == second  # bucket
    assert autotune_mod.lookup("mosaic_gpu", kind, 1000, 777, 513, jnp.bfloat16, "a") is None
    autotune_mod._loaded.clear()


def test_autotune_rejects_wrong_candidates(monkeypatch):
    good = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    broken = MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1)
    real_matmul = matmul_mod.matmul

    def faulty_matmul(a, b, *, config, **kw):
        out = real_matmul(a, b, config=config, **kw)
        return out * 1.5 if config == broken else out

    monkeypatch.setattr(matmul_mod, "matmul", faulty_matmul)
    winners = autotune([(16, 16, 16)], backend="interpret", candidates=[broken, good],
                       timer=lambda fn: 1.0, write_cache=False)
    assert winners == {(16, 16, 16): good}
    with pytest.raises(RuntimeError, match="no candidate passed"):
        autotune([(16, 16, 16)], backend="interpret", candidates=[broken],
                 timer=lambda fn: 1.0, write_cache=False)
    with pytest.raises(ValueError, match="nothing to tune"):
        autotune([(16, 16, 16)], backend="xla")


def test_matmul_fn_is_reexported():
    assert matmul_fn is matmul


def test_mosaic_pipeline_depth_fits_shared_memory():
    from jaxopt_train.kernels.mosaic_gpu import fit_stages

    square = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4)
    assert fit_stages(square, jnp.bfloat16, jnp.bfloat16, has_bias=False) == 4
    assert fit_stages(square, jnp.bfloat16, jnp.float32, has_bias=True) == 3
    wide = MatmulConfig(block_m=128, block_n=256, block_k=64, num_stages=4)
    assert fit_stages(wide, jnp.bfloat16, jnp.bfloat16, has_bias=False) == 3
    with pytest.raises(ValueError, match="shared memory"):
        fit_stages(MatmulConfig(block_m=256, block_n=256, block_k=256), jnp.bfloat16,
                   jnp.bfloat16, has_bias=False)
    with pytest.raises(ValueError, match="wgmma_in_flight"):
        MatmulConfig(num_stages=1, wgmma_in_flight=1)
    with pytest.raises(ValueError, match="at least 2 stages; got num_stages=1"):
        fit_stages(MatmulConfig(num_stages=1, wgmma_in_flight=0), jnp.bfloat16, jnp.bfloat16,
                   has_bias=False)
    # Ping-pong: one shared ring of 128x64 + 64x128 bf16 tiles (32 KiB a stage) next to
    # 32 KiB of output slots and 1 KiB of bias: 6 stages fit, 7 do not.
    pingpong = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=8, schedule="pingpong")
    assert fit_stages(pingpong, jnp.bfloat16, jnp.bfloat16, has_bias=True) == 6
    assert fit_stages(dataclasses.replace(pingpong, num_stages=4), jnp.bfloat16, jnp.bfloat16,
                      has_bias=True) == 4


def test_chained_pipeline_depth_divides_the_k_steps():
    from jaxopt_train.kernels.mosaic_gpu import chained_depth

    chained = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, chain_tiles=True)
    assert chained_depth(chained, 32, 4) == (4, True)  # gpt-1b's K = 2048
    assert chained_depth(chained, 786, 4) == (3, True)  # K = 50304 (the LM head's dA)
    assert chained_depth(chained, 9, 3) == (3, True)
    # No divisor >= 2 within the fitted depth: unchained, and never deeper than what fits
    # (the H200 rejected 4 stages of f32 output at K = 777 before this rule).
    assert chained_depth(chained, 13, 3) == (3, False)
    assert chained_depth(chained, 1, 3) == (3, False)
    unchained = dataclasses.replace(chained, chain_tiles=False)
    assert chained_depth(unchained, 32, 4) == (4, False)
    assert chained_depth(dataclasses.replace(chained, wgmma_in_flight=1), 32, 4) == (4, False)


@pytest.mark.parametrize("layout", [{}, {"schedule": "pingpong"}, {"cluster": "m"}, {"cluster": "n"},
                                    {"chain_tiles": True, "wgmma_in_flight": 0}],
                         ids=["cooperative", "pingpong", "cluster_m", "cluster_n", "chained"])
@pytest.mark.parametrize("transposed", [None, "a", "b"])
def test_mosaic_gpu_kernel_lowers_for_cuda_on_cpu(layout, transposed):
    """The Pallas -> Mosaic GPU lowering runs without a GPU: it catches layout, barrier
    and ref errors of every schedule here (the GPU tests run the kernels)."""
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4,
                          **{"wgmma_in_flight": 1, **layout})
    m, k, n = 1000, 384, 520
    shape = jax.ShapeDtypeStruct
    a = shape((k, m) if transposed == "a" else (m, k), jnp.bfloat16)
    b = shape((n, k) if transposed == "b" else (k, n), jnp.bfloat16)
    fn = jax.jit(lambda a, b, bias: mosaic_matmul(
        a, b, bias, activation="gelu", out_dtype=jnp.bfloat16, config=config,
        transpose_a=transposed == "a", transpose_b=transposed == "b"))
    text = fn.trace(a, b, shape((n,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("transposed", [None, "a", "b"])
def test_mosaic_gpu_pads_only_what_tma_needs(transposed):
    """TMA zero-fills loads and drops stores past an edge, so partial tiles need no
    padding: M = 3000 (a multiple of 8 rows, not of the 256-row tile) lowers with no pad
    of A and no slice of the output, while a minor dim off the 128-byte granule (N =
    5000) is padded to it (5056), not to whole tiles (5120)."""
    from jaxopt_train.kernels.mosaic_gpu import _tma_extent, mosaic_matmul

    assert _tma_extent(3000, 256, False, 2) == 3000  # major: 8-row granule
    assert _tma_extent(5000, 128, True, 2) == 5056  # minor: 64 bf16 elements
    assert _tma_extent(1000, 64, True, 4) == 1024  # minor: 32 f32 elements
    assert _tma_extent(130, 256, False, 2) == 256  # never under one tile
    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, chain_tiles=True)
    shape = jax.ShapeDtypeStruct

    def ops(m, k, n):
        a = shape((k, m) if transposed == "a" else (m, k), jnp.bfloat16)
        b = shape((n, k) if transposed == "b" else (k, n), jnp.bfloat16)
        fn = jax.jit(lambda a, b: mosaic_matmul(a, b, None, activation=None, out_dtype=jnp.bfloat16,
                                                config=config, transpose_a=transposed == "a",
                                                transpose_b=transposed == "b"))
        text = fn.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "stablehlo.pad" in line or "stablehlo.slice" in line]

    # Transposed A stores M as its minor dim: 3000 is off the granule there (3008).
    assert len(ops(3000, 1024, 4096)) == (1 if transposed == "a" else 0)
    padded = ops(3000, 1024, 5000)
    assert any("3000x5056" in line and "slice" in line for line in padded), padded
    assert not any("5120" in line for line in padded), padded


@pytest.mark.parametrize("name, a, b, options", [
    ("qkv", (8192, 2048), (2048, 6144), {}),
    ("fc1 + bias + GELU, Z kept", (8192, 2048), (2048, 8192),
     {"bias": True, "activation": "gelu", "save_preactivation": True}),
    ("fc2", (8192, 8192), (8192, 2048), {}),
    ("tied head", (8192, 2048), (50304, 2048), {"transpose_b": True}),
])
def test_gpt1b_products_and_their_gradients_copy_nothing_on_mosaic_gpu(name, a, b, options,
                                                                       monkeypatch):
    """gpt-1b's training step (8 x 1024 tokens, d_model 2048) launches Mosaic GPU kernels
    on its operands as they are: lowered for cuda, no product of its layers, forward or
    backward, pads an operand or slices a result (the twelfth session found a pad of the
    824 MB logits gradient costing ~0.5 ms a step)."""
    import importlib

    module = importlib.import_module("jaxopt_train.kernels.matmul")
    monkeypatch.setattr(module, "resolve_backend", lambda backend: backend)
    options = dict(options)
    with_bias = options.pop("bias", False)
    shape = jax.ShapeDtypeStruct
    args = [shape(a, jnp.bfloat16), shape(b, jnp.bfloat16)]
    if with_bias:
        args.append(shape((b[1],), jnp.float32))

    def loss(a, b, bias=None):
        return jnp.sum(matmul(a, b, bias=bias, backend="mosaic_gpu", **options).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    copies = [line.strip() for line in text.splitlines()
              if "stablehlo.pad" in line or "stablehlo.slice" in line]
    assert not copies, (name, copies[:3])


@pytest.mark.parametrize("layout", [{}, {"wg_split": "n"}, {"chain_tiles": True}, {"cluster": "m"},
                                    {"schedule": "pingpong"}, {"warpgroup_lowering": True}],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("with_bias", [False, True])
def test_mosaic_gpu_kernel_saving_the_preactivation_lowers_for_cuda(layout, with_bias):
    """The two-output epilogue (act(Z) and Z from one kernel) lowers for every layout; the
    ping-pong schedule writes Z and leaves the activation to XLA."""
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, **layout)
    m, k, n = 1000, 384, 520
    shape = jax.ShapeDtypeStruct
    fn = jax.jit(lambda a, b, bias: mosaic_matmul(
        a, b, bias, activation="gelu", out_dtype=jnp.bfloat16, config=config,
        save_preactivation=True))
    traced = fn.trace(shape((m, k), jnp.bfloat16), shape((k, n), jnp.bfloat16),
                      shape((n,), jnp.float32) if with_bias else None)
    assert [(o.shape, o.dtype) for o in traced.out_info] == [((m, n), jnp.bfloat16)] * 2
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="needs an activation"):
        mosaic_matmul(jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16), None,
                      activation=None, out_dtype=jnp.bfloat16, config=config,
                      save_preactivation=True)


def test_fused_layer_backward_on_mosaic_gpu_lowers_with_its_separate_bias_sum(monkeypatch):
    """The kept-Z layer's gradient, lowered for cuda on CPU: the dZ pass and dbias's column
    sum sit on either side of an optimization barrier on Mosaic GPU (measured faster there
    than XLA's one fused pass), and the interpret backend has no barrier."""
    import importlib

    module = importlib.import_module("jaxopt_train.kernels.matmul")
    monkeypatch.setattr(module, "resolve_backend", lambda backend: backend)
    shape = jax.ShapeDtypeStruct
    args = (shape((256, 128), jnp.bfloat16), shape((128, 256), jnp.bfloat16),
            shape((256,), jnp.float32))
    texts = {}
    for backend in ("mosaic_gpu", "interpret"):
        def loss(a, b, bias, backend=backend):
            out = matmul(a, b, bias=bias, activation="gelu", backend=backend,
                         save_preactivation=True)
            return jnp.sum(out.astype(jnp.float32))

        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args)
        platforms = ("cuda",) if backend == "mosaic_gpu" else ("cpu",)
        texts[backend] = traced.lower(lowering_platforms=platforms).as_text()
    assert "mosaic_gpu" in texts["mosaic_gpu"]
    assert "optimization_barrier" in texts["mosaic_gpu"]
    assert "optimization_barrier" not in texts["interpret"]


@pytest.mark.parametrize("index", range(len(autotune_mod.default_candidates("mosaic_gpu", quick=True))))
def test_quick_mosaic_gpu_candidates_lower_for_cuda(index):
    """Every config of `autotune --quick` builds (a candidate failing on the GPU would
    only be skipped there, silently shrinking the sweep); the shipped default leads."""
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    candidates = autotune_mod.default_candidates("mosaic_gpu", quick=True)
    assert candidates[0] == configs.default_config("mosaic_gpu", "NVIDIA H200", 8192, 8192, 8192)
    assert any(c.chain_tiles for c in candidates) and any(not c.chain_tiles for c in candidates)
    assert {c.cluster for c in candidates} == {"none", "m", "n"}
    shape = jax.ShapeDtypeStruct
    fn = jax.jit(lambda a, b: mosaic_matmul(a, b, None, activation=None, out_dtype=jnp.bfloat16,
                                            config=candidates[index]))
    lowered = fn.trace(shape((2048, 1024), jnp.bfloat16), shape((1024, 2048), jnp.bfloat16))
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_burst_timer_warms_up_then_times_rotating_inputs():
    seen = []
    fn = autotune_mod.rotating(lambda x: (seen.append(x), jnp.zeros(()))[1], [(1,), (2,), (3,)])
    assert autotune_mod.burst_timer(fn, calls=2, repeats=3, warmup_s=0.05) >= 0
    assert seen[:4] == [1, 2, 3, 1]
    assert len(seen) > 1 + 2 * 3  # the warm-up ran calls besides the compile and the bursts


def test_autotune_times_each_candidate_over_rotating_input_sets():
    outputs = []

    def timer(fn):
        outputs.extend(np.asarray(fn(), np.float32) for _ in range(3))
        return 1.0

    config = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    autotune([(16, 16, 16)], backend="interpret", candidates=[config], timer=timer,
             write_cache=False, input_sets=2)
    assert not np.array_equal(outputs[0], outputs[1]) and np.array_equal(outputs[0], outputs[2])
    with pytest.raises(ValueError, match="input_sets"):
        autotune([(16, 16, 16)], backend="interpret", candidates=[config], timer=timer,
                 input_sets=0)


def test_transposed_layouts_are_cached_and_resolved_apart(monkeypatch):
    """A winner of A^T @ B is stored under its own key and never serves A @ B or A @ B^T,
    and a transposed product with no entry of its own gets the shipped default."""
    kind = jax.devices()[0].device_kind
    plain_key = autotune_mod.cache_key("triton", kind, 64, 32, 48, jnp.bfloat16)
    assert plain_key.endswith("m64_n32_k64")  # the key of caches written before layouts
    assert autotune_mod.cache_key("triton", kind, 64, 32, 48, jnp.bfloat16, "a") == plain_key + "|aT"
    with pytest.raises(ValueError, match="transposed='c' must be one of"):
        autotune_mod.cache_key("triton", kind, 64, 32, 48, jnp.bfloat16, "c")

    seen = []

    def fake_product(a, b, transposed, out_dtype, backend, config, bias=None, activation=None):
        seen.append((a.shape, b.shape, transposed, backend))
        lhs, rhs = (a.T, b) if transposed == "a" else (a, b.T)
        return jnp.dot(lhs, rhs, preferred_element_type=jnp.float32).astype(out_dtype)

    monkeypatch.setattr(matmul_mod, "_product_with_transpose", fake_product)
    monkeypatch.setattr(matmul_mod, "resolve_backend", lambda backend: backend)
    slow, fast = (MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1),
                  MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1))
    times = iter([2.0, 1.0, 3.0])  # the last: XLA's dot, in the same layout
    winners = autotune([(64, 32, 48)], backend="triton", candidates=[slow, fast], transposed="a",
                       timer=lambda fn: (fn(), next(times))[1], input_sets=1)
    assert winners == {(64, 32, 48): fast}
    assert seen[0] == ((48, 64), (48, 32), "a", "triton")  # A stored (K, M)
    assert seen[-1] == ((48, 64), (48, 32), "a", "xla")
    autotune_mod._loaded.clear()
    assert autotune_mod.lookup("triton", kind, 64, 32, 48, jnp.bfloat16, "a") == fast
    assert autotune_mod.lookup("triton", kind, 64, 32, 48, jnp.bfloat16) is None
    assert autotune_mod.lookup("triton", kind, 64, 32, 48, jnp.bfloat16, "b") is None
    default = configs.default_config("triton", kind, 64, 32, 48)
    assert matmul_mod.resolve_config("triton", 64, 32, 48, jnp.bfloat16, "a") == fast
    assert matmul_mod.resolve_config("triton", 64, 32, 48, jnp.bfloat16) == default
    autotune_mod.store("triton", kind, 64, 48, 32, jnp.bfloat16, slow, 1.0)  # a plain winner
    assert matmul_mod.resolve_config("triton", 64, 48, 32, jnp.bfloat16, "b") == default
    with pytest.raises(ValueError, match="tuned only for"):
        autotune([(16, 16, 16)], backend="interpret", transposed="b", timer=lambda fn: 1.0)


def test_autotune_cli_refuses_a_layout_the_backend_cannot_read(capsys):
    with pytest.raises(SystemExit):
        autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16", "--transposed", "a"])
    assert "--transposed a: only ('mosaic_gpu', 'triton')" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--backend", "interpret", "--shapes", "0x16x16"], "positive dims"),
    (["--backend", "interpret", "--shapes", "16x16"], "comma list of MxNxK"),
    (["--backend", "interpret", "--shapes", "16x16x16,16x16x16"], "repeats ['16x16x16']"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--budget-s", "-1"], "--budget-s must be >= 0"),
    (["--backend", "nope", "--shapes", "16x16x16"], "invalid choice: 'nope'"),
    # pallas_tpu: unavailable on the CPU and the GPU machines alike (mosaic_gpu is there on the H200)
    (["--backend", "pallas_tpu", "--shapes", "16x16x16"], "--backend pallas_tpu: matmul backend"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--candidates", "[{"], "not JSON"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--candidates", "[]"], "non-empty JSON list"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--candidates", '[{"block_q": 8}]'],
     "entry 0 {'block_q': 8} is not a MatmulConfig"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--candidates", '[{"block_m": 0}]'],
     "entry 0 {'block_m': 0} is not a MatmulConfig"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--candidates", "/nope/c.json"], "cannot read"),
    (["--backend", "interpret", "--shapes", "16x16x16", "--candidates", "[{}]", "--quick"],
     "give one of them"),
    # XLA aborted the process allocating the operands (exit 134, a C++ stack)
    (["--backend", "interpret", "--shapes", "1000000x1000000x1000000", "--quick"],
     "shape 1000000x1000000x1000000 needs ~"),
])
def test_autotune_cli_refuses_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        autotune_mod.main(argv)
    assert message in capsys.readouterr().err


def test_autotune_cli_sweeps_the_given_candidates(tmp_path, monkeypatch):
    """--candidates (inline or a .json file) replaces the default list; the winner among
    them is cached for the shape."""
    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", str(tmp_path))
    swept = []
    real = autotune_mod.autotune

    def spy(shapes, dtype, **kwargs):
        swept.append(kwargs["candidates"])
        return real(shapes, dtype, **{**kwargs, "timer": lambda fn: 1.0})

    monkeypatch.setattr(autotune_mod, "autotune", spy)
    file = tmp_path / "c.json"
    file.write_text('[{"block_m": 16, "block_n": 16, "block_k": 16, "num_stages": 1}]')
    inline = '[{"block_m": 8, "block_n": 8, "block_k": 8, "num_stages": 1}]'
    for source, block in ((inline, 8), (str(file), 16)):
        assert autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16",
                                  "--candidates", source]) == 0
        assert [c.block_m for c in swept[-1]] == [block]
        cached = autotune_mod.lookup("interpret", jax.devices()[0].device_kind, 16, 16, 16,
                                     jnp.bfloat16)
        assert cached is not None and cached.block_m == block


def test_autotune_times_the_shapes_own_default_first(monkeypatch):
    """Without given candidates each shape's sweep starts with the config it would get
    untuned (so a spent budget has timed it, and a winner never measured slower), then the
    default list without that config again; `--quick` picks the short list."""
    timed, current = [], [None]
    real_matmul = matmul_mod.matmul

    def spying_matmul(a, b, *, config, **kw):
        current[0] = config
        return real_matmul(a, b, config=config, **kw)

    def timer(fn):
        fn()
        timed.append(current[0])
        return 1.0

    monkeypatch.setattr(matmul_mod, "matmul", spying_matmul)
    autotune([(16, 16, 16)], backend="interpret", timer=timer, write_cache=False)
    default = configs.default_config("interpret", jax.devices()[0].device_kind, 16, 16, 16)
    listed = autotune_mod.default_candidates("interpret")
    # XLA's dot last (matmul called with config=None), on the same timer.
    assert timed == [default] + [c for c in listed if c != default] + [None]
    # The winner of a tie is the first timed: the default.
    assert autotune([(16, 16, 16)], backend="interpret", timer=lambda fn: 1.0,
                    write_cache=False) == {(16, 16, 16): default}
    passed = []
    monkeypatch.setattr(autotune_mod, "autotune", lambda shapes, dtype, **kw: passed.append(kw) or {})
    assert autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16", "--quick"]) == 0
    assert passed[-1]["quick"] is True and passed[-1]["candidates"] is None
    # Mosaic GPU's lists hold the half-height tile that wins on small grids.
    halved = MatmulConfig(block_m=64, block_n=128, block_k=64, num_stages=4, group_m=8, chain_tiles=True)
    assert halved in autotune_mod.default_candidates("mosaic_gpu", quick=True)
    assert halved in autotune_mod.default_candidates("mosaic_gpu")


def test_autotune_sweeps_only_the_triton_tiles_that_fit_the_device(monkeypatch, caplog):
    """On an L4 the default sweep dropped no tile, so the two 4-stage 128 x 256 tiles
    (147,456 bytes of shared memory per block on sm_89, over its 101,376) were compiled,
    failed and warned for every shape. Candidates given explicitly are all swept."""
    _fake_gpu(monkeypatch, "8.9", "NVIDIA L4")
    monkeypatch.setattr(matmul_mod, "resolve_backend", lambda backend: backend)
    timed = []

    def fake_matmul(a, b, *, backend, config):  # records the config; compiles no kernel
        timed.append(config)
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    monkeypatch.setattr(matmul_mod, "matmul", fake_matmul)
    with caplog.at_level(logging.DEBUG, logger="jaxopt_train.kernels.autotune"):
        autotune([(640, 576, 64)], backend="triton", timer=lambda fn: 1.0, write_cache=False,
                 input_sets=1)
    listed = autotune_mod.default_candidates("triton")
    fitting = [c for c in listed if configs.triton_shared_memory_bytes(c, (8, 9)) <= 101_376]
    default = dataclasses.replace(_HOPPER_TRITON, num_stages=3)
    assert len(fitting) == len(listed) - 2
    assert timed == [default] + [c for c in fitting if c != default]
    assert "dropped 2 of 16 candidates" in caplog.text
    too_large = dataclasses.replace(_HOPPER_TRITON, num_stages=4)
    timed.clear()
    autotune([(640, 576, 64)], backend="triton", candidates=[too_large, default],
             timer=lambda fn: 1.0, write_cache=False, input_sets=1)
    assert timed == [too_large, default]


def test_autotune_refuses_bad_shapes_and_budget():
    with pytest.raises(ValueError, match="positive ints; got \\(16, 0, 16\\)"):
        autotune([(16, 0, 16)], backend="interpret", timer=lambda fn: 1.0, write_cache=False)
    with pytest.raises(ValueError, match="budget_s=-1"):
        autotune([(16, 16, 16)], backend="interpret", budget_s=-1, write_cache=False)
    with pytest.raises(ValueError, match=r"candidates=\[\] leaves nothing to time"):
        autotune([(16, 16, 16)], backend="interpret", candidates=[], write_cache=False)
    with pytest.raises(ValueError, match="dtype=int8 is not a matmul input dtype"):
        autotune([(16, 16, 16)], jnp.int8, backend="interpret", write_cache=False)
    # Refused before anything is allocated, naming what it needs and what there is.
    with pytest.raises(ValueError, match=r"shape 16x1000000x1000000 needs ~.* for 4 operand set\(s\)"
                                         r".* more than this host's memory \("):
        autotune([(16, 16, 16), (16, 1_000_000, 1_000_000)], backend="interpret", write_cache=False,
                 timer=lambda fn: pytest.fail("timed before the memory check"))


def test_autotune_of_float32_tunes_the_bfloat16_entry_matmul_reads(tmp_path):
    """matmul runs f32 inputs as bf16 and looks the cache up under bf16, so that is where
    autotune(dtype=float32) stores its winner."""
    config = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    autotune([(24, 16, 16)], jnp.float32, backend="interpret", candidates=[config],
             timer=lambda fn: 1.0)
    keys = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert keys and all("|bfloat16|" in key for key in keys), keys
    assert matmul_mod.resolve_config("interpret", 24, 16, 16, jnp.bfloat16) == config


def test_autotune_refuses_an_unwritable_cache_before_tuning(tmp_path, monkeypatch):
    """A cache folder that cannot be written fails before the sweep (whose winners would be
    lost after it), saying what to do; the CLI says so as a usage error."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", str(blocker / "cache"))
    timed = []
    with pytest.raises(OSError, match="JAXOPT_TRAIN_CACHE_DIR to a writable folder"):
        autotune([(16, 16, 16)], backend="interpret", timer=lambda fn: timed.append(fn) or 1.0)
    assert timed == []
    with pytest.raises(SystemExit) as exit_info:
        autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16", "--candidates",
                           '[{"block_m": 16, "block_n": 16, "block_k": 16, "num_stages": 1}]'])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("content,problem", [
    (b"\xff\xfe not text", "UnicodeDecodeError"),
    (b"[]", "got a JSON list"),
    (b'{"a": {"config": {"block_m"', "JSONDecodeError"),
    (b"[" * 100_000, "RecursionError"),  # json.loads raised it, and every matmul with it
])
def test_an_unreadable_autotune_cache_is_ignored_then_kept_aside(tmp_path, content, problem,
                                                                 caplog):
    """matmul runs on the shipped defaults with a warning; the next store moves the file
    to `<name>.corrupt-<time>` instead of overwriting what the user had."""
    path = tmp_path / "matmul_autotune.json"
    path.write_bytes(content)
    a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger=autotune_mod.__name__):
        np.testing.assert_array_equal(matmul(a, b, backend="interpret"), jnp.full((4, 2), 8.0))
    assert problem in caplog.text
    config = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    autotune_mod.store("interpret", "cpu", 64, 64, 64, jnp.bfloat16, config, 1e-3)
    kept = list(tmp_path.glob("matmul_autotune.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == content
    autotune_mod._loaded.clear()
    assert autotune_mod.lookup("interpret", "cpu", 64, 64, 64, jnp.bfloat16) == config


@pytest.mark.parametrize("entry", [
    {"seconds": 1.0},                                      # no config
    {"config": {"block_m": 16, "new_knob": 1}},            # a field this version lacks
    {"config": {"block_m": 100}},                          # an illegal value
    ["not", "an", "entry"],
])
def test_a_malformed_cache_entry_is_skipped_for_the_default(tmp_path, entry, caplog):
    """A hand-edited or foreign entry is skipped (warning) and matmul takes the default,
    instead of every matmul call raising."""
    a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    key = autotune_mod.cache_key("interpret", jax.devices()[0].device_kind, 4, 2, 8,
                                 jnp.bfloat16, exact=True)
    (tmp_path / "matmul_autotune.json").write_text(json.dumps({key: entry}))
    with caplog.at_level(logging.WARNING, logger=autotune_mod.__name__):
        assert matmul_mod.resolve_config("interpret", 4, 2, 8, jnp.bfloat16) == \
            configs.default_config("interpret", jax.devices()[0].device_kind, 4, 2, 8)
        np.testing.assert_array_equal(matmul(a, b, backend="interpret"), jnp.full((4, 2), 8.0))
    assert "not a valid config" in caplog.text


def test_autotune_store_keeps_entries_another_process_wrote(tmp_path):
    """store re-reads the file under a lock before merging: a winner stored by another
    process after this one read the cache survives this one's next store."""
    first = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    autotune_mod.store("interpret", "cpu", 64, 64, 64, jnp.bfloat16, first, 1e-3)
    other = dict(json.loads((tmp_path / "matmul_autotune.json").read_text()))
    other["cpu|other process|entry"] = {"config": first.to_dict()}
    (tmp_path / "matmul_autotune.json").write_text(json.dumps(other))  # not through _loaded
    autotune_mod.store("interpret", "cpu", 128, 128, 128, jnp.bfloat16, first, 1e-3)
    data = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert "cpu|other process|entry" in data and len(data) == 5


def test_backward_products_look_up_their_own_layouts(monkeypatch):
    """Lowering the gradient of a Mosaic GPU matmul (for CUDA, on the CPU) asks the cache
    for the forward as A @ B, for dA as A @ B^T and for dB as A^T @ B."""
    asked = []
    real = matmul_mod.resolve_config

    def spy(backend, m, n, k, dtype, transposed=None):
        asked.append((m, n, k, transposed))
        return real(backend, m, n, k, dtype, transposed)

    monkeypatch.setattr(matmul_mod, "resolve_config", spy)
    monkeypatch.setattr(matmul_mod, "resolve_backend", lambda backend: backend)  # no GPU here
    shape = jax.ShapeDtypeStruct
    loss = lambda a, b: jnp.sum(matmul(a, b, backend="mosaic_gpu").astype(jnp.float32))
    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(
        shape((256, 128), jnp.bfloat16), shape((128, 384), jnp.bfloat16)
    ).lower(lowering_platforms=("cuda",))
    assert asked == [(256, 384, 128, None), (256, 128, 384, "b"), (128, 384, 256, "a")]


def test_autotune_budget_keeps_best_so_far():
    first, second = (MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1),
                     MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1))
    winners = autotune([(16, 16, 16)], backend="interpret", candidates=[first, second],
                       timer=lambda fn: 1.0, write_cache=False, budget_s=0.0)
    assert winners == {(16, 16, 16): first}


@pytest.mark.parametrize("precision, kernel", [
    (None, True), ("default", True), (lax.Precision.DEFAULT, True), (("default", None), True),
    (["default", "default"], True), (lax.DotAlgorithmPreset.DEFAULT, True),
    ("highest", False), (lax.Precision.HIGHEST, False), (("default", "highest"), False),
    (["default", "highest"], False), (lax.DotAlgorithmPreset.F32_F32_F32, False),
])
def test_dot_general_takes_default_precision_in_any_spelling(monkeypatch, precision, kernel):
    """`lax.dot_general` accepts precision="default"; the drop-in sent it to XLA, silently
    skipping the kernel. Other precisions still go to XLA (the kernel has one)."""
    import importlib

    dot_general_module = importlib.import_module("jaxopt_train.kernels.dot_general")
    calls = []
    real = dot_general_module.matmul
    monkeypatch.setattr(dot_general_module, "matmul",
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    lhs = jax.random.normal(jax.random.key(0), (8, 16), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (16, 8), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    got = make_dot_general("interpret")(lhs, rhs, dims, precision=precision)
    assert bool(calls) == kernel
    want = lax.dot_general(lhs, rhs, dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("shape_a, shape_b", [((0, 8), (8, 4)), ((2, 0, 8), (8, 4)), ((3, 8), (8, 0)),
                                              ((2, 0), (0, 3))])
def test_empty_operands_give_what_jnp_dot_gives(backend, shape_a, shape_b):
    """They were refused ("empty operands are not supported"): an empty batch reached matmul
    as an error. K = 0 gives the epilogue of zeros, e.g. gelu(bias)."""
    a, b = jnp.ones(shape_a, jnp.bfloat16), jnp.ones(shape_b, jnp.bfloat16)
    bias = jnp.linspace(-1.0, 1.0, shape_b[1]).astype(jnp.bfloat16)
    got = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32,
                                            backend=backend))(a, b, bias)
    want = matmul_reference(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32)
    assert got.shape == want.shape == (*shape_a[:-1], shape_b[1]) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    grads = jax.grad(lambda a, b, bias: jnp.sum(matmul(a, b, bias=bias, activation="gelu",
                                                        out_dtype=jnp.float32, backend=backend)),
                     (0, 1, 2))(a, b, bias)
    assert [g.shape for g in grads] == [a.shape, b.shape, bias.shape]


def test_xla_backend_gradient_of_a_vmapped_b_on_cpu():
    """Under jax.vmap the dB product's moveaxis folded into a transposed bf16 dot, which
    XLA:CPU cannot run (UNIMPLEMENTED: Unsupported element type for DotThunk::Execute)."""
    a = jax.random.normal(jax.random.key(0), (5, 7), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (3, 7, 4), jnp.bfloat16)

    def loss(f, a, b):
        return jnp.sum(jax.vmap(f, (None, 0))(a, b) ** 2)
    ours = lambda a, b: matmul(a, b, out_dtype=jnp.float32, backend="xla")  # noqa: E731
    ref = lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))  # noqa: E731
    got = jax.jit(jax.grad(functools.partial(loss, ours), (0, 1)))(a, b)
    want = jax.grad(functools.partial(loss, ref), (0, 1))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32),
                                   rtol=2e-2, atol=2e-2)
