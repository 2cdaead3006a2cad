"""Checks made before lowering: Mosaic GPU and Mosaic TPU tilings, explicitly sharded operands,
the GPU a backend needs, the kernel dot_general's contracting dimensions, MatmulConfig's fields.

Each rule was read off lowering the kernels for cuda / tpu on CPU; the tests show the
refused tilings fail at trace time with a message naming the field, and the accepted
edge tilings lower.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.kernels import MatmulConfig, configs, make_dot_general, matmul, matmul_reference

matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")
S = jax.ShapeDtypeStruct


def _trace_mosaic(config, transposed=None, out_dtype=jnp.bfloat16, m=512, n=512, k=512):
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    a = S((k, m) if transposed == "a" else (m, k), jnp.bfloat16)
    b = S((n, k) if transposed == "b" else (k, n), jnp.bfloat16)
    fn = jax.jit(lambda a, b: mosaic_matmul(a, b, None, activation=None, out_dtype=out_dtype,
                                            config=config, transpose_a=transposed == "a",
                                            transpose_b=transposed == "b"))
    return fn.trace(a, b)


@pytest.mark.parametrize("fields, transposed, out_dtype, match", [
    ({"block_m": 32}, None, jnp.bfloat16, r"block_m to be a multiple of 64 .*block_m=32"),
    ({"block_k": 8}, None, jnp.bfloat16, r"multiple of 32 bytes .*block_k=8 x 2 B = 16 B"),
    ({"block_n": 8}, None, jnp.bfloat16, r"block_n must span 128 bytes; got .*block_n=8"),
    ({"block_n": 32, "block_k": 64}, None, jnp.float32, r"block_n must span 128 bytes"),
    ({"block_n": 16, "block_k": 32}, None, jnp.bfloat16, r"block_n must span 64 bytes"),
    ({"block_k": 32}, "a", jnp.bfloat16, r"transposed A .*block_k=32 x 2 B = 64 B"),
    ({"epilogue_tile": 32}, None, jnp.bfloat16, r"epilogue_tile must be >= 64; got .*=32"),
    ({"block_n": 8}, "b", jnp.bfloat16, r"rows of >= 32 bytes; .*block_n=8"),
    ({"warpgroup_lowering": True}, "b", jnp.bfloat16, r"warpgroup_lowering=False only"),
])
def test_mosaic_gpu_refuses_a_tiling_it_cannot_lower_before_lowering(fields, transposed,
                                                                     out_dtype, match):
    """These passed the old checks and failed inside the Pallas lowering with a bare
    AssertionError, "Swizzle 16 is not supported" or a slice-tiling error."""
    config = MatmulConfig(**{"num_stages": 2, **fields})
    with pytest.raises(ValueError, match=match):
        _trace_mosaic(config, transposed, out_dtype)


@pytest.mark.parametrize("fields, transposed, out_dtype", [
    ({"block_m": 64, "block_n": 16, "block_k": 16}, None, jnp.bfloat16),
    ({"block_m": 64, "block_n": 32, "block_k": 32, "wg_split": "n"}, None, jnp.bfloat16),
    ({"block_m": 64, "block_n": 8, "block_k": 16}, "b", jnp.float32),
    ({"block_m": 64, "block_n": 64, "block_k": 64}, "a", jnp.bfloat16),
])
def test_mosaic_gpu_edge_tilings_the_checks_accept_lower_for_cuda(fields, transposed, out_dtype):
    config = MatmulConfig(num_stages=2, **fields)
    text = _trace_mosaic(config, transposed, out_dtype).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()


def _trace_tpu(monkeypatch, n, config):
    monkeypatch.setattr(matmul_mod, "resolve_backend", lambda backend: backend)
    monkeypatch.setattr(matmul_mod, "resolve_config",  # the shipped TPU tile, no autotune cache
                        lambda backend, m, n, k, dtype, transposed=None: configs.default_config(
                            backend, "TPU v5 lite", m, n, k))
    fn = jax.jit(lambda a, b: matmul(a, b, backend="pallas_tpu", config=config))
    return fn.trace(S((300, 520), jnp.bfloat16), S((520, n), jnp.bfloat16))


@pytest.mark.parametrize("config, n, match", [
    ({"block_n": 64, "block_k": 128}, 200, r"block_n to be a multiple of 128 .*block_n=64 for N=200"),
    ({"block_n": 128}, 200, r"block_k to be a multiple of 128 .*block_k=64 for K=520"),
])
def test_pallas_tpu_refuses_tiles_off_the_lane_tiling_before_lowering(monkeypatch, config, n,
                                                                     match):
    """A partial config keeps MatmulConfig's block_k=64, which Mosaic TPU refused at lowering
    with a message about the padded internal arrays."""
    with pytest.raises(ValueError, match=match):
        _trace_tpu(monkeypatch, n, config)


@pytest.mark.parametrize("config, n", [(None, 200), ({"block_n": 64, "block_k": 128}, 64)])
def test_pallas_tpu_tiles_the_checks_accept_lower_for_tpu(monkeypatch, config, n):
    text = _trace_tpu(monkeypatch, n, config).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def _explicit_mesh_operands():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (8, 5, 24), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (24, 40), jnp.float32).astype(jnp.bfloat16)
    bias = jax.random.normal(keys[2], (40,), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    w = jax.device_put(w, NamedSharding(mesh, P()))
    return mesh, x, w, bias


def test_kernel_dot_general_leaves_explicitly_sharded_operands_to_xla():
    """`pallas_call` refuses operands typed with explicit sharding (jax.make_mesh's default
    axes); the drop-in used to raise there where `lax.dot_general` works."""
    mesh, x, w, bias = _explicit_mesh_operands()
    dot = make_dot_general("interpret")
    dims = (((2,), (0,)), ((), ()))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x, w: dot(x, w, dims, preferred_element_type=jnp.float32))(x, w)
        fused = dot.fused_dense(x, w, bias, "gelu")
    want = jnp.dot(np.asarray(x, np.float32), np.asarray(w, np.float32),
                   precision=lax.Precision.HIGHEST)
    assert out.shape == (8, 5, 40) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert fused is None


def test_matmul_kernel_backends_refuse_explicitly_sharded_operands_clearly():
    mesh, x, w, _ = _explicit_mesh_operands()
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"without explicit sharding; got a: P\('data'"):
            jax.jit(lambda x, w: matmul(x, w, backend="interpret"))(x, w)
        out = jax.jit(lambda x, w: matmul(x, w, backend="xla", out_dtype=jnp.float32))(x, w)
    want = jnp.dot(np.asarray(x, np.float32), np.asarray(w, np.float32),
                   precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placed_bias", [False, True])  # True: replicated on the mesh (dbias kept dZ's N-sharding)
@pytest.mark.parametrize("a_shape, a_spec, b_spec, transpose_b, save", [
    ((8, 16), P("x", None), None, False, False),  # M sharded (b not placed): dB contracts it
    ((2, 8, 16), P(None, "x", None), P(), False, True),  # a batch dim sharded past the first
    ((4, 8, 16), P(None, None, "y"), P(), False, False),  # K sharded
    ((4, 8, 16), P("x", None, None), P(None, "y"), False, True),  # N sharded: dbias too
    ((4, 8, 16), P("x", None, None), P("y", None), True, False),  # tied head, N sharded
])
def test_xla_backend_differentiates_explicitly_sharded_operands(a_shape, a_spec, b_spec,
                                                                transpose_b, save, placed_bias):
    """The kernel backends' error sends sharded operands to backend='xla', whose batch-merging
    reshape and 2-D backward products JAX refused for them ("This reshape is not supported",
    "Contracting dimensions are sharded", a custom VJP type mismatch), where jnp.dot works.
    Values and gradients against the reference; the gradients keep the operands' sharding.
    b_spec None: b is a plain array, typed without a mesh."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    keys = jax.random.split(jax.random.key(3), 3)
    n = 8
    a = jax.random.normal(keys[0], a_shape, jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(keys[1], (n, 16) if transpose_b else (16, n), jnp.float32)
    b = b.astype(jnp.bfloat16)
    bias = jax.random.normal(keys[2], (n,), jnp.float32)

    def loss(fn):
        return lambda a, b, bias: jnp.sum(jnp.sin(fn(a, b, bias).astype(jnp.float32)))

    ours = loss(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu", backend="xla",
                                          out_dtype=jnp.float32, transpose_b=transpose_b,
                                          save_preactivation=save))
    ref = loss(lambda a, b, bias: matmul_mod.matmul_reference(
        a, b.T if transpose_b else b, bias=bias, activation="gelu", out_dtype=jnp.float32))
    with jax.set_mesh(mesh):
        a_sh = jax.device_put(a, NamedSharding(mesh, a_spec))
        b_sh = b if b_spec is None else jax.device_put(b, NamedSharding(mesh, b_spec))
        bias_sh = jax.device_put(bias, NamedSharding(mesh, P())) if placed_bias else bias
        value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(a_sh, b_sh, bias_sh)
        assert [jax.typeof(g).sharding.spec for g in grads] == [
            jax.typeof(x).sharding.spec for x in (a_sh, b_sh, bias_sh)]
    want_value, want = jax.value_and_grad(ref, argnums=(0, 1, 2))(a, b, bias)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-2)
    for g, w in zip(grads, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(w))))


def test_xla_backend_differentiates_a_replicated_operand_inside_shard_map():
    # check_vma=True (shard_map's default): a per-device a times a replicated b gave a
    # per-device dB, which the custom VJP could not return for an invariant b.
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (8, 16), jnp.bfloat16)
    b = jax.random.normal(keys[1], (16, 4), jnp.bfloat16)
    bias = jax.random.normal(keys[2], (4,), jnp.float32)

    def grads(product):
        def loss(b, bias, a):
            return jax.lax.psum(jnp.sum(product(a, b, bias) ** 2), "d")
        return jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                                     in_specs=(P(), P(), P("d")), out_specs=P()))(b, bias, a)

    got = grads(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu", backend="xla",
                                          out_dtype=jnp.float32))
    want = grads(lambda a, b, bias: matmul_reference(a, b, bias=bias, activation="gelu",
                                                     out_dtype=jnp.float32))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2 * float(np.max(np.abs(np.asarray(w, np.float32)))))


@pytest.mark.parametrize("replicated_a", [False, True])
def test_blockspec_kernel_inside_shard_map_with_checked_axes_is_refused_clearly(replicated_a):
    """Called directly (not through the drop-in, which falls back to XLA), the interpret
    kernel under check_vma=True failed inside pallas_call with "`manual_axis_type` on
    `jax.ShapeDtypeStruct` must not be `None`". It now says what to do; check_vma=False
    still runs the kernel and matches the reference."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    a = jax.random.normal(jax.random.key(0), (8, 16), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (16, 4), jnp.bfloat16)
    spec = P() if replicated_a else P("d")

    def run(check_vma):
        fn = jax.shard_map(lambda a, b: matmul(a, b, backend="interpret", out_dtype=jnp.float32),
                           mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=check_vma)
        return jax.jit(fn)(a, b)

    with pytest.raises(ValueError, match=r"'interpret' runs a BlockSpec pallas_call.*"
                                         r"check_vma=True.*\('d',\).*check_vma=False.*dot_general"):
        run(True)
    want = jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(run(False)), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- triton on a pre-Ampere GPU
def _fake_gpu(monkeypatch, capability: str):
    """jax.devices() answers one GPU of `capability` ("7.5"), and jax_triton imports (a
    stand-in module: the CPU test machine has none), so only the capability decides."""
    gpu = types.SimpleNamespace(platform="gpu", device_kind="fake", compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu])
    monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton"))


def test_triton_needs_an_ampere_or_newer_gpu(monkeypatch):
    """A T4 (7.5) passed, so backend="auto" picked triton, whose bf16 dot needs sm_80."""
    _fake_gpu(monkeypatch, "7.5")
    reason = ("needs an NVIDIA Ampere or newer GPU (compute capability >= 8.0); "
              "got compute_capability='7.5'")
    assert matmul_mod._triton_available() == (False, reason)
    assert matmul_mod.resolve_backend("auto") == "xla"
    with pytest.raises(RuntimeError, match=re.escape(f"'triton' is unavailable: {reason}")):
        matmul_mod.resolve_backend("triton")
    for capability in ("8.0", "8.9", "12.0"):
        _fake_gpu(monkeypatch, capability)
        assert matmul_mod._triton_available()[0]
    assert matmul_mod.resolve_backend("auto") == "triton"


DIMS = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("rhs_shape, dims", [((6, 4), DIMS), ((4, 6), (((1,), (1,)), ((), ())))])
def test_kernel_dot_general_reports_unequal_contracting_dims_as_lax_does(rhs_shape, dims):
    """The kernel path raised matmul's ValueError about `a`, `b` and `transpose_b`, names
    the caller of a drop-in dot_general never used, where lax raises a TypeError."""
    lhs, rhs = jnp.ones((3, 5), jnp.bfloat16), jnp.ones(rhs_shape, jnp.bfloat16)
    with pytest.raises(TypeError, match=r"contracting dimensions to have the same shape"):
        make_dot_general("interpret")(lhs, rhs, dims)


def test_matmul_config_takes_numpy_ints_and_stores_python_ints():
    """np.int64(16) was refused as "must be an int"; the ints must stay JSON-serialisable."""
    config = MatmulConfig(block_m=np.int64(16), block_n=np.int32(16), block_k=16,
                          num_stages=np.int64(1), epilogue_tile=np.int64(32))
    assert config == MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1,
                                  epilogue_tile=32)
    assert type(config.block_m) is int and type(config.epilogue_tile) is int
    json.dumps(config.to_dict())
    with pytest.raises(ValueError, match=r"block_m=np.True_ must be an int"):
        MatmulConfig(block_m=np.bool_(True))
