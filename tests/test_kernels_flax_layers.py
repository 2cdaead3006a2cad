"""The kernel `dot_general` as a Flax user swaps it in: layers, transforms, meshes.

Each layer is compared with the same layer on `lax.dot_general` at Precision.HIGHEST,
forward and gradient (params and inputs). Shapes are tiny: the kernel runs interpreted.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.kernels import make_dot_general

KERNEL = make_dot_general("interpret")
TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}


def highest(lhs, rhs, dims, precision=None, **kwargs):  # jnp.einsum passes precision positionally
    return lax.dot_general(lhs, rhs, dims, precision=lax.Precision.HIGHEST, **kwargs)


def _assert_trees_close(got, want, dtype):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        tol = TOLERANCE[dtype]
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * (1 + np.abs(w).max()))


def _square_sum(y):
    return jnp.sum(y.astype(jnp.float32) ** 2)


def _check_nnx(make, x, dtype):
    ours, ref = make(KERNEL), make(highest)
    _assert_trees_close(nnx.jit(lambda m, x: m(x))(ours, x), ref(x), dtype)
    grad = lambda m, x: nnx.grad(lambda m, x: _square_sum(m(x)), argnums=(0, 1))(m, x)  # noqa: E731
    _assert_trees_close(nnx.jit(grad)(ours, x), grad(ref, x), dtype)


NNX_LAYERS = {
    "Linear": lambda d, kw: nnx.Linear(7, 5, dot_general=d, rngs=nnx.Rngs(0), **kw),
    # multiple in and out axes: a 4-D kernel, which goes to XLA
    "LinearGeneral_axes": lambda d, kw: nnx.LinearGeneral((3, 7), (2, 3), axis=(-2, -1), dot_general=d,
                                                          rngs=nnx.Rngs(0), **kw),
    "LinearGeneral_batch": lambda d, kw: nnx.LinearGeneral(7, 4, axis=-1, batch_axis={0: 2}, dot_general=d,
                                                           rngs=nnx.Rngs(0), **kw),
    # jnp.einsum calls dot_general(kernel, x, ...) for this one: XLA
    "Einsum_out_first": lambda d, kw: nnx.Einsum("abc,cd->dab", (7, 5), rngs=nnx.Rngs(0),
                                                 einsum_op=functools.partial(jnp.einsum, _dot_general=d), **kw),
    "Einsum_transposed_kernel": lambda d, kw: nnx.Einsum("abc,dc->abd", (5, 7), rngs=nnx.Rngs(0),
                                                         einsum_op=functools.partial(jnp.einsum, _dot_general=d),
                                                         **kw),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", list(NNX_LAYERS))
def test_nnx_layers_match_lax(name, dtype):
    x = jax.random.normal(jax.random.key(0), (2, 3, 7), jnp.float32)  # f32 in, cast by the layer
    _check_nnx(lambda d: NNX_LAYERS[name](d, dict(dtype=dtype, param_dtype=jnp.float32)), x, dtype)


@pytest.mark.parametrize("shape", [(1, 7), (2, 1, 3, 7)])
def test_nnx_linear_of_size_one_and_several_batch_dims_with_float32_output(shape):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, preferred_element_type=jnp.float32,
              use_bias=False)  # flax adds a bf16 bias to the f32 output: refused when strict
    _check_nnx(lambda d: nnx.Linear(7, 1, dot_general=d, rngs=nnx.Rngs(0), **kw), x, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("make", [lambda d, kw: linen.Dense(5, dot_general=d, **kw),
                                  lambda d, kw: linen.DenseGeneral((2, 3), axis=(-2, -1), dot_general=d, **kw)],
                         ids=["Dense", "DenseGeneral_axes"])
def test_linen_layers_match_lax(make, dtype):
    x = jax.random.normal(jax.random.key(0), (2, 3, 7), jnp.float32)
    kw = dict(dtype=dtype, param_dtype=jnp.float32)
    ours, ref = make(KERNEL, kw), make(highest, kw)
    variables = ours.init(jax.random.key(1), x)
    _assert_trees_close(jax.jit(ours.apply)(variables, x), ref.apply(variables, x), dtype)
    grad = lambda m: jax.grad(lambda v, x: _square_sum(m.apply(v, x)), (0, 1))  # noqa: E731
    _assert_trees_close(jax.jit(grad(ours))(variables, x), grad(ref)(variables, x), dtype)


def test_stacked_layers_under_vmap_scan_and_remat():
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    stack = lambda d: nnx.vmap(lambda k: nnx.Linear(7, 7, dot_general=d, rngs=nnx.Rngs(k), **kw))(keys)  # noqa: E731
    ours, ref = stack(KERNEL), stack(highest)
    x = jax.random.normal(jax.random.key(1), (3, 2, 7), jnp.float32)

    def per_layer(m, x):  # layer i on x[i]
        return _square_sum(nnx.vmap(lambda m, x: m(x))(m, x))

    def scanned(m, x):  # the layers in sequence, each rematerialised
        body = nnx.remat(lambda h, layer: (layer(h).astype(h.dtype), None))
        h, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x[0], m)
        return _square_sum(h)

    for loss in (per_layer, scanned):
        grad = nnx.grad(loss, argnums=(0, 1))
        _assert_trees_close(nnx.jit(grad)(ours, x), grad(ref, x), jnp.bfloat16)


def _data_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


@pytest.mark.parametrize("check_vma", [False, True])
def test_nnx_linear_inside_shard_map(check_vma, kernel_in_jaxpr):
    """Under shard_map's default check_vma=True the BlockSpec kernel's pallas_call raised
    "`manual_axis_type` on `jax.ShapeDtypeStruct` must not be `None`" where lax.dot_general
    works: the drop-in now leaves that case to XLA (check_vma=False keeps the kernel)."""
    mesh = _data_mesh()
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 3, 7), jnp.float32), NamedSharding(mesh, P("data")))

    def grads(dot):
        layer = nnx.Linear(7, 5, dot_general=dot, rngs=nnx.Rngs(0), **kw)
        graph, params = nnx.split(layer)

        def local(params, x):
            loss = lambda p, x: _square_sum(nnx.merge(graph, p)(x))  # noqa: E731
            return lax.psum(jax.grad(loss, (0, 1))(params, x)[0], "data"), jax.grad(loss, 1)(params, x)

        fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")),
                           check_vma=check_vma)
        return jax.jit(fn)(params, x), jax.make_jaxpr(fn)(params, x)

    (got, jaxpr), (want, _) = grads(KERNEL), grads(highest)
    _assert_trees_close(got, want, jnp.bfloat16)
    assert kernel_in_jaxpr(jaxpr) == (not check_vma)
    if check_vma:  # fused_dense, which models call with the same function, says "not here"
        w, bias = jnp.ones((7, 5), jnp.bfloat16), jnp.zeros((5,), jnp.bfloat16)
        fused = []
        jax.make_jaxpr(jax.shard_map(lambda x: fused.append(KERNEL.fused_dense(x.astype(jnp.bfloat16), w, bias,
                                                                               "gelu")) or x,
                                     mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
        assert fused == [None]


def test_explicit_mesh_and_out_sharding_give_what_lax_gives():
    mesh = _data_mesh()
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 3, 7), jnp.float32), NamedSharding(mesh, P("data")))
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    with jax.set_mesh(mesh):
        for out_sharding in (None, P("data", None, None)):
            call = lambda m, x: m(x, out_sharding=out_sharding)  # noqa: E731
            ours, ref = (nnx.Linear(7, 5, dot_general=d, rngs=nnx.Rngs(0), **kw) for d in (KERNEL, highest))
            got = nnx.jit(call)(ours, x)
            assert got.sharding.spec == P("data", None, None)
            _assert_trees_close(got, nnx.jit(call)(ref, x), jnp.bfloat16)


@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("preferred", [None, jnp.bfloat16, jnp.float16, jnp.float32, "float32", jnp.int32])
def test_preferred_element_type_gives_the_dtype_lax_gives(in_dtype, preferred):
    x = jax.random.normal(jax.random.key(0), (2, 3, 7), in_dtype)
    w = jax.random.normal(jax.random.key(1), (7, 5), in_dtype)
    dims = (((2,), (0,)), ((), ()))
    got = KERNEL(x, w, dims, preferred_element_type=preferred)
    assert got.dtype == lax.dot_general(x, w, dims, preferred_element_type=preferred).dtype
    if jnp.issubdtype(got.dtype, jnp.floating):
        want = highest(x, w, dims, preferred_element_type=jnp.float32).astype(got.dtype)
        _assert_trees_close(got, want, jnp.bfloat16 if got.dtype == jnp.bfloat16 else jnp.float16)


def test_forward_mode_is_refused_clearly():
    layer = nnx.Linear(7, 5, dot_general=KERNEL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 7), jnp.float32)
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(layer, (x,), (x,))


def _linear_loss_and_grads_in_shard_map(dot, mesh, x, features):
    """((loss, (d params, dx)), jaxpr) of an nnx.Linear on `dot` inside jax.shard_map over the
    mesh's "data" axis, varying axes checked (its default); the loss is summed over the devices
    (psum: typed invariant, so each device's share must be typed varying to count once)."""
    layer = nnx.Linear(x.shape[-1], features, dot_general=dot, rngs=nnx.Rngs(0),
                       dtype=jnp.bfloat16, param_dtype=jnp.float32)
    graph, params = nnx.split(layer)

    def local(params, x):
        def loss(p, x):
            return lax.psum(_square_sum(nnx.merge(graph, p)(x)), "data")
        return loss(params, x), jax.grad(loss, (0, 1))(params, x)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), (P(), P("data"))))
    return jax.jit(fn)(params, x), jax.make_jaxpr(fn)(params, x)


def test_kernel_outputs_vary_as_their_operands_inside_shard_map(monkeypatch, cpu_devices,
                                                                fresh_kernel_launches):
    """The GPU kernels' outputs come back from their custom calls with no varying axes, though
    each device computed its own; the backward then returned an invariant dA for a per-device
    `a`, which the custom VJP refused (on the GPU: "the manual axis types do not match"). Here
    a pure_callback stand-in for the Triton kernel drops the varying axes the same way, on
    two CPU devices, under a loss summed over them (psum), against lax.dot_general."""
    import importlib

    from jaxopt_train.kernels import triton_kernel

    def stand_in(a, b, bias, *, activation, out_dtype, config, transpose_a=False,
                 transpose_b=False, save_preactivation=False):
        assert bias is None and activation is None and not save_preactivation

        def host(a, b):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            return ((a.T if transpose_a else a) @ (b.T if transpose_b else b)).astype(out_dtype)

        m, n = a.shape[1 if transpose_a else 0], b.shape[0 if transpose_b else 1]
        return jax.pure_callback(host, jax.ShapeDtypeStruct((m, n), out_dtype), a, b)

    for name in ("matmul", "dot_general"):  # the modules: the package's names are functions
        module = importlib.import_module(f"jaxopt_train.kernels.{name}")
        monkeypatch.setattr(module, "resolve_backend", lambda backend: backend)
    monkeypatch.setattr(triton_kernel, "triton_matmul", stand_in)  # fresh_kernel_launches: traced anew
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,), devices=cpu_devices[:2])
    with jax.default_device(cpu_devices[0]):  # the layer's parameters too, also on a GPU machine
        x = jax.device_put(jax.random.normal(jax.random.key(0), (4, 8, 16), jnp.bfloat16),
                           NamedSharding(mesh, P("data")))
        (got, jaxpr), (want, _) = (_linear_loss_and_grads_in_shard_map(dot, mesh, x, 24)
                                   for dot in (make_dot_general("triton"), highest))
    _assert_trees_close(got, want, jnp.bfloat16)
    assert "pure_callback" in str(jaxpr)  # the stand-in ran, not XLA's dot


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
def test_gpu_kernels_inside_shard_map_with_varying_axes_checked(backend, kernel_in_jaxpr):
    """The drop-in leaves only the BlockSpec backends to XLA under check_vma=True; the GPU
    kernels stay in: they must run there and agree with lax.dot_general."""
    if backend == "triton":
        pytest.importorskip("jax_triton", exc_type=ImportError)
    if backend == "mosaic_gpu" and not str(
            getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
        pytest.skip("mosaic_gpu kernel needs a Hopper GPU")
    gpu = [d for d in jax.devices() if d.platform == "gpu"][:1]
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=gpu)
    kernel = make_dot_general(backend)
    # Placed as in_specs says: on an Explicit mesh, jax 0.11's shard_map refuses an input
    # whose sharding is not the spec (it ran first on the GPU machine and failed there).
    x = jax.device_put(jax.random.normal(jax.random.key(0), (4, 256, 512), jnp.bfloat16),
                       NamedSharding(mesh, P("data")))

    (got, jaxpr), (want, _) = (_linear_loss_and_grads_in_shard_map(dot, mesh, x, 384)
                               for dot in (kernel, highest))
    _assert_trees_close(got, want, jnp.bfloat16)
    assert kernel_in_jaxpr(jaxpr), str(jaxpr)[:2000]
