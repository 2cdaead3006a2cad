"""GPU tests of the Mosaic GPU and Triton matmul kernels (run on the GPU machine)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.kernels import MatmulConfig, matmul, matmul_reference

pytestmark = pytest.mark.gpu

SHAPES = [(256, 256, 128), (1000, 777, 513), (2, 3, 129, 200, 64), (2048, 1024, 4096)]


def _backend_or_skip(backend):
    if backend == "triton":
        pytest.importorskip("jax_triton", exc_type=ImportError)
    if backend == "mosaic_gpu" and not str(
            getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
        pytest.skip("mosaic_gpu kernel needs a Hopper GPU")


def _operands(shape, dtype, seed=0):
    *lead, k, n = shape
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (*lead, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    return a, b, jax.random.normal(kc, (n,), jnp.float32)


def _close(out, ref, tol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    scale = max(1.0, float(np.max(np.abs(ref))))
    np.testing.assert_allclose(out, ref, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(backend, dtype, shape):
    _backend_or_skip(backend)
    a, b, _ = _operands(shape, dtype)
    out = jax.jit(lambda a, b: matmul(a, b, backend=backend, out_dtype=jnp.float32))(a, b)
    _close(out, matmul_reference(a, b, out_dtype=jnp.float32), 1e-4)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("activation", [None, "gelu", "relu", "silu"])
def test_fused_epilogue(backend, activation):
    _backend_or_skip(backend)
    a, b, bias = _operands((384, 320, 256), jnp.bfloat16)
    out = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation=activation,
                                            backend=backend))(a, b, bias)
    assert out.dtype == jnp.bfloat16
    _close(out, matmul_reference(a, b, bias=bias, activation=activation), 1e-2)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
def test_gradients_match_reference(backend):
    _backend_or_skip(backend)
    a, b, bias = _operands((300, 200, 136), jnp.bfloat16, seed=1)

    def loss(fn):
        return lambda a, b, bias: jnp.sum(jnp.sin(fn(a, b, bias).astype(jnp.float32)))

    ours = loss(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu", backend=backend,
                                          out_dtype=jnp.float32))
    ref = loss(lambda a, b, bias: matmul_reference(a, b, bias=bias, activation="gelu",
                                                   out_dtype=jnp.float32))
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(a, b, bias)
    want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(a, b, bias)
    for g, w in zip(got, want):
        _close(g, w, 2e-2)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("through_scan", [False, True], ids=["layer", "scan"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_second_derivatives_match_xla_on_gpu(backend, through_scan, activation):
    """Grad of grad (a gradient penalty) through the GPU kernels, one layer or three stacked
    with lax.scan (the case a jit-with-literal in the primal broke; see
    tests/test_kernels.py), against the xla backend. 300 x 136 operands need padding."""
    _backend_or_skip(backend)
    x0 = _operands((300, 136, 136), jnp.bfloat16, seed=3)[0]
    w = jax.random.normal(jax.random.key(4), (3, 136, 136), jnp.float32) * 0.1

    def penalty(backend):
        def layer(x, wi):
            return matmul(x, wi.astype(jnp.bfloat16), activation=activation,
                          backend=backend), None

        def loss(w):
            x = jax.lax.scan(layer, x0, w)[0] if through_scan else layer(x0, w[0])[0]
            return jnp.sum(jnp.sin(x.astype(jnp.float32)))
        return jax.grad(lambda w: jnp.sum(jax.grad(loss)(w) ** 2))

    got = jax.jit(penalty(backend))(w)
    want = jax.jit(penalty("xla"))(w)
    assert bool(jnp.all(jnp.isfinite(got)))
    _close(got, want, 3e-2)


@pytest.mark.parametrize("backend,config", [
    ("mosaic_gpu", MatmulConfig(block_m=64, block_n=256, block_k=64, num_stages=3, group_m=4,
                                grid_minor="m")),
    ("mosaic_gpu", MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4,
                                wgmma_in_flight=1)),
    ("triton", MatmulConfig(block_m=64, block_n=128, block_k=32, num_stages=4, num_warps=4)),
])
def test_config_override(backend, config):
    _backend_or_skip(backend)
    a, b, _ = _operands((512, 512, 384), jnp.bfloat16, seed=2)
    out = jax.jit(lambda a, b: matmul(a, b, backend=backend, config=config,
                                      out_dtype=jnp.float32))(a, b)
    _close(out, matmul_reference(a, b, out_dtype=jnp.float32), 1e-4)


def test_auto_picks_a_kernel_on_gpu():
    from jaxopt_train.kernels.matmul import resolve_backend

    assert resolve_backend("auto") in ("mosaic_gpu", "triton")


@pytest.mark.parametrize("shape", [(1000, 777, 513), (130, 250, 64), (2, 129, 300, 72)],
                         ids=lambda s: "x".join(map(str, s)))
def test_mosaic_wgmma_in_flight_odd_shapes_and_grad(shape):
    _backend_or_skip("mosaic_gpu")
    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, wgmma_in_flight=1)
    a, b, bias = _operands(shape, jnp.bfloat16, seed=4)

    def run(a, b, bias):
        return matmul(a, b, bias=bias, activation="gelu", backend="mosaic_gpu", config=config,
                      out_dtype=jnp.float32)

    _close(jax.jit(run)(a, b, bias),
           matmul_reference(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32), 1e-4)
    loss = lambda fn: lambda a, b, bias: jnp.sum(jnp.sin(fn(a, b, bias)))  # noqa: E731
    ref = lambda a, b, bias: matmul_reference(a, b, bias=bias, activation="gelu",  # noqa: E731
                                              out_dtype=jnp.float32)
    got = jax.jit(jax.grad(loss(run), argnums=(0, 1, 2)))(a, b, bias)
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(a, b, bias)
    for g, w in zip(got, want):
        _close(g, w, 2e-2)


# Every Mosaic GPU layout/compiler option of MatmulConfig (the A/B variants of
# tools/probe_matmul.py), each on its own and in the combinations the probe times.
_HOPPER = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=16)
MOSAIC_OPTIONS = {
    "wg_n": dict(wg_split="n"),
    "wg_n_wglower": dict(wg_split="n", warpgroup_lowering=True),
    "wglower": dict(warpgroup_lowering=True),
    "noautobar": dict(no_auto_barriers=True),
    "wg_n_cluster_m": dict(wg_split="n", cluster="m"),
    "cluster_n": dict(cluster="n"),
    "cluster_m_inflight": dict(cluster="m", wgmma_in_flight=1),
    "wg_n_inflight": dict(wg_split="n", wgmma_in_flight=1),
    "epi128": dict(epilogue_tile=128),
    "wg_n_64x256": dict(wg_split="n", block_m=64, block_n=128, num_stages=3),
    "pingpong": dict(schedule="pingpong"),
    "pingpong_inflight": dict(schedule="pingpong", wgmma_in_flight=1),
}


@pytest.mark.parametrize("option", MOSAIC_OPTIONS)
@pytest.mark.parametrize("shape", [(512, 1024, 384), (1000, 777, 513), (2, 129, 300, 72)],
                         ids=lambda s: "x".join(map(str, s)))
def test_mosaic_options_match_reference(option, shape):
    _backend_or_skip("mosaic_gpu")
    config = dataclasses.replace(_HOPPER, **MOSAIC_OPTIONS[option])
    a, b, _ = _operands(shape, jnp.bfloat16, seed=5)
    out = jax.jit(lambda a, b: matmul(a, b, backend="mosaic_gpu", config=config,
                                      out_dtype=jnp.float32))(a, b)
    _close(out, matmul_reference(a, b, out_dtype=jnp.float32), 1e-4)


@pytest.mark.parametrize("option", MOSAIC_OPTIONS)
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
def test_mosaic_options_fused_epilogue(option, activation):
    _backend_or_skip("mosaic_gpu")
    config = dataclasses.replace(_HOPPER, **MOSAIC_OPTIONS[option])
    a, b, bias = _operands((1000, 777, 513), jnp.bfloat16, seed=6)
    out = jax.jit(lambda a, b, bias: matmul(a, b, bias=bias, activation=activation,
                                            backend="mosaic_gpu", config=config))(a, b, bias)
    assert out.dtype == jnp.bfloat16
    _close(out, matmul_reference(a, b, bias=bias, activation=activation), 1e-2)


_LAYOUTS = {"m": dict(wg_split="m"), "n": dict(wg_split="n"), "pingpong": dict(schedule="pingpong"),
            "cluster_m": dict(cluster="m"), "cluster_n": dict(cluster="n")}


@pytest.mark.parametrize("transposed", ["a", "b"])
@pytest.mark.parametrize("shape", [(256, 256, 128), (127, 129, 65), (1000, 777, 513), (512, 768, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["m", "n", "pingpong", "cluster_m", "cluster_n"])
def test_mosaic_transposed_operands_read_as_stored(transposed, shape, layout):
    """A.T @ B and A @ B.T without transposed copies (the backward pass's products)."""
    _backend_or_skip("mosaic_gpu")
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    m, k, n = shape
    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=8,
                          **_LAYOUTS[layout])
    ka, kb = jax.random.split(jax.random.key(3))
    if transposed == "a":
        a = jax.random.normal(ka, (k, m), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.bfloat16)
        want = matmul_reference(a.T, b, out_dtype=jnp.float32)
    else:
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
        want = matmul_reference(a, b.T, out_dtype=jnp.float32)
    got = jax.jit(lambda a, b: mosaic_matmul(a, b, None, activation=None, out_dtype=jnp.float32, config=config,
                                             transpose_a=transposed == "a",
                                             transpose_b=transposed == "b"))(a, b)
    assert got.shape == (m, n)
    _close(got, want, 1e-4)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
def test_backward_reads_transposes_without_copies(backend):
    """The VJP's dA/dB go through the transposed kernel: no transpose op in the HLO."""
    _backend_or_skip(backend)
    a, b, _ = _operands((512, 256, 384), jnp.bfloat16, seed=4)
    g = jax.random.normal(jax.random.key(5), (512, 384), jnp.float32).astype(jnp.bfloat16)

    def vjp(a, b, g):
        return jax.vjp(lambda a, b: matmul(a, b, backend=backend), a, b)[1](g)

    text = jax.jit(vjp).lower(a, b, g).compile().as_text()
    assert " transpose(" not in text, [ln for ln in text.splitlines() if " transpose(" in ln][:3]
    da, db = jax.jit(vjp)(a, b, g)
    _close(da, matmul_reference(g, b.T, out_dtype=jnp.float32), 2e-2)
    _close(db, matmul_reference(a.T, g, out_dtype=jnp.float32), 2e-2)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_transpose_b_reads_the_table_as_stored(backend, with_bias):
    """a @ b.T with b (N, K) (a tied LM head): forward, dA, dB, no transpose op left."""
    _backend_or_skip(backend)
    a, b_kn, bias = _operands((512, 256, 384), jnp.bfloat16, seed=7)
    b = b_kn.T  # (N, K) = (384, 256)
    bias = bias if with_bias else None
    g = jax.random.normal(jax.random.key(8), (512, 384), jnp.float32).astype(jnp.bfloat16)

    def fwd_vjp(a, b, g):
        out, pull = jax.vjp(lambda a, b: matmul(a, b, bias=bias, backend=backend, transpose_b=True), a, b)
        return (out, *pull(g))

    text = jax.jit(fwd_vjp).lower(a, b, g).compile().as_text()
    assert " transpose(" not in text, [ln for ln in text.splitlines() if " transpose(" in ln][:3]
    out, da, db = jax.jit(fwd_vjp)(a, b, g)
    _close(out, matmul_reference(a, b.T, bias=bias, out_dtype=jnp.float32), 2e-2)
    _close(da, matmul_reference(g, b, out_dtype=jnp.float32), 2e-2)
    _close(db, matmul_reference(g.T, a, out_dtype=jnp.float32), 2e-2)


def test_tied_head_gradient_needs_no_padding():
    """A tied LM head whose vocabulary is an odd multiple of 128 (gpt-1b: 50,304 = 393 x 128):
    the default config puts the consumers side by side for the table's gradient, so the
    compiled step pads nothing, and with 270 tiles every SM chains two or three of them."""
    _backend_or_skip("mosaic_gpu")
    tokens, d_model, vocab = 1024, 512, 135 * 128
    ka, kb, kg = jax.random.split(jax.random.key(12), 3)
    x = jax.random.normal(ka, (tokens, d_model), jnp.float32).astype(jnp.bfloat16)
    table = jax.random.normal(kb, (vocab, d_model), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (tokens, vocab), jnp.float32).astype(jnp.bfloat16)

    def fwd_vjp(x, table, g):
        out, pull = jax.vjp(lambda x, t: matmul(x, t, backend="mosaic_gpu", transpose_b=True,
                                                out_dtype=jnp.float32), x, table)
        return (out, *pull(g.astype(jnp.float32)))

    text = jax.jit(fwd_vjp).lower(x, table, g).compile().as_text()
    assert " pad(" not in text, [ln for ln in text.splitlines() if " pad(" in ln][:3]
    out, dx, dtable = jax.jit(fwd_vjp)(x, table, g)
    _close(out, matmul_reference(x, table.T, out_dtype=jnp.float32), 1e-4)
    _close(dx, matmul_reference(g, table, out_dtype=jnp.float32), 2e-2)
    _close(dtable, matmul_reference(g.T, x, out_dtype=jnp.float32), 2e-2)


@pytest.mark.parametrize("align", [True, False])
@pytest.mark.parametrize("transposed", ["a", "b", None])
@pytest.mark.parametrize("shape", [(256, 256, 128), (127, 129, 65), (1000, 777, 513)],
                         ids=lambda s: "x".join(map(str, s)))
def test_triton_transposed_operands_read_as_stored(transposed, shape, align):
    """A.T @ B, A @ B.T and A @ B through the operands' strides (masked, odd shapes
    included), with the wrapper's 16-byte row padding and without it (`align=False`)."""
    _backend_or_skip("triton")
    from jaxopt_train.kernels.triton_kernel import triton_matmul

    m, k, n = shape
    config = MatmulConfig(block_m=64, block_n=64, block_k=32, num_stages=3, num_warps=4)
    ka, kb = jax.random.split(jax.random.key(9))
    a_shape = (k, m) if transposed == "a" else (m, k)
    b_shape = (n, k) if transposed == "b" else (k, n)
    a = jax.random.normal(ka, a_shape, jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, b_shape, jnp.float32).astype(jnp.bfloat16)
    want = matmul_reference(a.T if transposed == "a" else a, b.T if transposed == "b" else b,
                            out_dtype=jnp.float32)
    got = jax.jit(lambda a, b: triton_matmul(a, b, None, activation=None, out_dtype=jnp.float32, config=config,
                                             transpose_a=transposed == "a",
                                             transpose_b=transposed == "b", align=align))(a, b)
    assert got.shape == (m, n)
    _close(got, want, 1e-4)


@pytest.mark.parametrize("transposed", [None, "a", "b"])
def test_triton_offsets_past_int32(transposed):
    """An operand or the output with >= 2^31 elements (the logits of 64 K tokens over a
    50 K vocabulary, or such a table read as stored): int32 offsets would wrap and
    read or write the wrong rows. Checks the rows and columns at the far ends."""
    _backend_or_skip("triton")
    from jaxopt_train.kernels.triton_kernel import triton_matmul

    big, small, k = (1 << 31) // 1024 + 64, 64, 1024  # big * k and big * 1024 exceed 2^31
    m, n = (small, big) if transposed == "b" else (big, small) if transposed == "a" else (big, 1024)
    if transposed is None:
        k = 64
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, (k, m) if transposed == "a" else (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (n, k) if transposed == "b" else (k, n), jnp.bfloat16)
    assert max(a.size, b.size, m * n) >= 1 << 31
    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=8)
    got = jax.jit(lambda a, b: triton_matmul(a, b, None, activation=None, out_dtype=jnp.bfloat16,
                                             config=config, transpose_a=transposed == "a",
                                             transpose_b=transposed == "b"))(a, b)
    a_mk = a.T if transposed == "a" else a
    b_kn = b.T if transposed == "b" else b
    for rows, cols in ((slice(-128, None), slice(-128, None)), (slice(0, 128), slice(0, 128))):
        want = matmul_reference(a_mk[rows], b_kn[:, cols], out_dtype=jnp.float32)
        _close(got[rows, cols], want, 2e-2)


_SEVERAL_TILES = {
    "pingpong": dict(schedule="pingpong"),
    "pingpong_inflight": dict(schedule="pingpong", wgmma_in_flight=1),
    "chained": dict(chain_tiles=True),
}


@pytest.mark.parametrize("transposed", [None, "a", "b"])
@pytest.mark.parametrize("layout", _SEVERAL_TILES)
@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("k", [640, 1024])
def test_mosaic_several_tiles_per_sm(transposed, layout, activation, k):
    """Schedules whose barriers carry state from tile to tile, where every SM owns several
    tiles (ping-pong: 4-5 of 128 x 128, both consumers, odd counts; chained: 2-3 of
    256 x 128) and the K steps (10 or 16) wrap the rings evenly or not."""
    _backend_or_skip("mosaic_gpu")
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    m, n = 4096, 2176
    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=8,
                          **_SEVERAL_TILES[layout])
    ka, kb, kc = jax.random.split(jax.random.key(11), 3)
    a = jax.random.normal(ka, (k, m) if transposed == "a" else (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (n, k) if transposed == "b" else (k, n), jnp.float32).astype(jnp.bfloat16)
    bias = jax.random.normal(kc, (n,), jnp.float32) if activation else None
    lhs = a.T if transposed == "a" else a
    rhs = b.T if transposed == "b" else b
    want = matmul_reference(lhs, rhs, bias=bias, activation=activation, out_dtype=jnp.float32)
    got = jax.jit(lambda a, b, bias: mosaic_matmul(
        a, b, bias, activation=activation, out_dtype=jnp.float32, config=config,
        transpose_a=transposed == "a", transpose_b=transposed == "b"))(a, b, bias)
    _close(got, want, 5e-3 if activation else 1e-4)  # gelu runs tanh.approx


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("transposed", [None, "a", "b"])
def test_autotune_each_layout_on_gpu(backend, transposed, tmp_path, monkeypatch):
    """The sweep runs every quick candidate of a layout through the reference check on the GPU,
    caches the winner under that layout, and the backward then reads it."""
    import importlib

    _backend_or_skip(backend)
    autotune_mod = importlib.import_module("jaxopt_train.kernels.autotune")
    matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")
    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", str(tmp_path))
    autotune_mod._loaded.clear()
    m, n, k = 512, 384, 640
    candidates = autotune_mod.default_candidates(backend, quick=True)[:3]
    winners = autotune_mod.autotune([(m, n, k)], backend=backend, candidates=candidates,
                                    transposed=transposed, input_sets=2,
                                    timer=lambda fn: autotune_mod.burst_timer(fn, calls=2, repeats=1,
                                                                              warmup_s=0.0))
    assert winners[(m, n, k)] in candidates
    kind = jax.devices()[0].device_kind
    assert autotune_mod.lookup(backend, kind, m, n, k, jnp.bfloat16, transposed) == winners[(m, n, k)]
    assert matmul_mod.resolve_config(backend, m, n, k, jnp.bfloat16, transposed) == winners[(m, n, k)]
    autotune_mod._loaded.clear()


_SAVED_PREACTIVATION_LAYOUTS = {
    "default": {},
    "side_by_side": dict(wg_split="n"),
    "chained": dict(chain_tiles=True, group_m=8),
    "cluster_m": dict(cluster="m"),
    "pingpong": dict(schedule="pingpong"),
}


@pytest.mark.parametrize("layout", _SAVED_PREACTIVATION_LAYOUTS)
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_mosaic_kernel_writes_activation_and_preactivation(layout, activation, with_bias):
    """One kernel's epilogue writes act(Z) and Z (cuBLASLt's GELU_AUX): both against the
    reference, on an odd shape (padded) and on one where SMs chain several tiles."""
    _backend_or_skip("mosaic_gpu")
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    config = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4,
                          **_SAVED_PREACTIVATION_LAYOUTS[layout])
    for m, k, n in ((1000, 513, 777), (4096, 640, 2176)):
        a, b, bias = _operands((m, k, n), jnp.bfloat16, seed=m)
        bias = bias if with_bias else None
        out, z = jax.jit(lambda a, b, bias: mosaic_matmul(
            a, b, bias, activation=activation, out_dtype=jnp.bfloat16, config=config,
            save_preactivation=True))(a, b, bias)
        assert out.shape == z.shape == (m, n) and out.dtype == z.dtype == jnp.bfloat16
        _close(z, matmul_reference(a, b, bias=bias, out_dtype=jnp.float32), 1e-2)
        _close(out, matmul_reference(a, b, bias=bias, activation=activation,
                                     out_dtype=jnp.float32), 1e-2)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_kernel_writes_activation_and_preactivation(transpose_b, activation, with_bias):
    """Triton's two-output epilogue: act(Z) and Z from one launch, both against the
    reference, on a ragged shape (masked edges) and on whole tiles, B as stored or
    transposed (the tied head's layout)."""
    _backend_or_skip("triton")
    from jaxopt_train.kernels.triton_kernel import triton_matmul

    config = MatmulConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8)
    for m, k, n in ((1000, 513, 777), (2048, 640, 2048)):
        a, b, bias = _operands((m, k, n), jnp.bfloat16, seed=m)
        bias = bias if with_bias else None
        stored_b = b.T if transpose_b else b
        out, z = jax.jit(lambda a, b, bias: triton_matmul(
            a, b, bias, activation=activation, out_dtype=jnp.bfloat16, config=config,
            transpose_b=transpose_b, save_preactivation=True))(a, stored_b, bias)
        assert out.shape == z.shape == (m, n) and out.dtype == z.dtype == jnp.bfloat16
        _close(z, matmul_reference(a, b, bias=bias, out_dtype=jnp.float32), 1e-2)
        _close(out, matmul_reference(a, b, bias=bias, activation=activation,
                                     out_dtype=jnp.float32), 1e-2)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
@pytest.mark.parametrize("shape", [(300, 200, 136), (2, 1024, 2048, 8192)],
                         ids=lambda s: "x".join(map(str, s)))
def test_saved_preactivation_gradients_on_gpu(shape, backend):
    """`matmul(save_preactivation=True)` on mosaic_gpu and triton: the forward kernel's Z
    feeds the GELU's backward; gradients against the reference, and one kernel launch
    fewer than the recomputing path."""
    _backend_or_skip(backend)
    a, b, bias = _operands(shape, jnp.bfloat16, seed=2)
    # A fixed cotangent: with sin(out) the cotangent itself would depend on how each side
    # rounds outputs of magnitude ~45 (K = 2048) to bf16, and dA sums N = 8192 of those differences.
    weights = jax.random.normal(jax.random.key(3), (*shape[:-2], shape[-1]), jnp.float32)

    def loss(fn):
        return lambda a, b, bias: jnp.sum(fn(a, b, bias).astype(jnp.float32) * weights)

    def ours(save):
        return loss(lambda a, b, bias: matmul(a, b, bias=bias, activation="gelu",
                                              backend=backend, save_preactivation=save))

    ref = loss(lambda a, b, bias: matmul_reference(a, b, bias=bias, activation="gelu"))
    want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(a, b, bias)
    got = jax.jit(jax.grad(ours(True), argnums=(0, 1, 2)))(a, b, bias)
    for g, w in zip(got, want):
        _close(g, w, 3e-2)
    # value_and_grad: with grad alone JAX drops the recomputing path's unused forward launch
    # (the cotangent is fixed), and both paths would count 3.
    launches = {save: jax.jit(jax.value_and_grad(ours(save), argnums=(0, 1, 2))).lower(a, b, bias)
                .as_text().count("call @_launch") for save in (False, True)}
    assert launches == {False: 4, True: 3}, launches  # forward, (recomputed Z), dA, dB


@pytest.mark.parametrize("fields, transposed", [
    ({"block_m": 64, "block_n": 16, "block_k": 16}, None),
    ({"block_m": 64, "block_n": 32, "block_k": 32, "wg_split": "n"}, None),
    ({"block_m": 64, "block_n": 8, "block_k": 16}, "b"),
    ({"block_m": 64, "block_n": 64, "block_k": 64}, "a"),
], ids=["16x16", "32x32_split_n", "n8_transposed_b", "transposed_a"])
def test_mosaic_edge_tilings_that_pass_the_checks_compute_the_product(fields, transposed):
    """The narrowest tilings `mosaic_gpu_tiling.check_tiling` accepts run and are exact
    (f32 output, against jnp.dot at HIGHEST on the same bf16 inputs)."""
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    _backend_or_skip("mosaic_gpu")
    m, k, n = 200, 96, 72
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.bfloat16)
    stored_a = a.T if transposed == "a" else a
    stored_b = b.T if transposed == "b" else b
    config = MatmulConfig(num_stages=2, **fields)
    out = jax.jit(lambda x, y: mosaic_matmul(
        x, y, None, activation=None, out_dtype=jnp.float32, config=config,
        transpose_a=transposed == "a", transpose_b=transposed == "b"))(stored_a, stored_b)
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    _close(out, want, 1e-4)
