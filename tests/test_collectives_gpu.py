"""Collectives on 2 real GPUs: a narrow wire keeps the replicas bit-identical; the peer kernel.

XLA's GPU compiler folds f32 -> bf16 -> f32 convert pairs away (excess
precision), which the CPU compiler does not, so these checks only mean
something on a GPU: without `wire_cast`'s pin the sending device kept its own
unrounded value and the two devices' sums differed (tools/probe_wire.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxopt_train.collectives import ErrorFeedbackState, all_reduce_tree, peer_all_reduce, ring_all_reduce

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_pair():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs, found {len(gpus)}")
    return jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus[:2])


def _run(mesh, body, *args):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(P("data") for _ in args),
                               out_specs=P("data"), check_vma=False))
    return fn(*args)


def _bf16(a):
    """Rounded to bf16 and widened on the host (numpy, ml_dtypes): no XLA pass in the way."""
    return np.asarray(a, np.float32).astype(jnp.bfloat16).astype(np.float32)


def test_bf16_wire_exchange_is_bit_identical_on_both_gpus(gpu_pair):
    x = jax.random.normal(jax.random.key(0), (2, 1 << 20), jnp.float32)
    out = np.asarray(_run(gpu_pair, lambda v: ring_all_reduce(v, "data", wire_dtype=jnp.bfloat16), x))
    exact = _bf16(x).sum(0)  # both devices add the same two bf16-rounded values in f32
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], exact)


def test_bf16_compression_error_feedback_is_what_the_wire_lost_on_gpu(gpu_pair):
    size = 3 * 4096 + 5
    g = jax.random.normal(jax.random.key(1), (2, size), jnp.float32)
    err0 = jnp.zeros_like(g)

    def body(g, err):
        summed, new = all_reduce_tree([g], "data", method="ring", compression="bf16",
                                      error_state=ErrorFeedbackState([err]))
        return jnp.stack([summed[0], new.error[0]])

    fn = jax.jit(jax.shard_map(body, mesh=gpu_pair, in_specs=(P("data"), P("data")),
                               out_specs=P(None, "data"), check_vma=False))
    got, err1 = (np.asarray(a) for a in fn(g, err0))
    v = np.asarray(g)
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], _bf16(v).sum(0))
    np.testing.assert_array_equal(err1, v - _bf16(v))
    assert np.abs(err1).max() > 0  # a folded-away rounding would leave no error to feed back


def _peer_capable(mesh):
    if float(getattr(mesh.devices.flat[0], "compute_capability", "0")) < 9.0:
        pytest.skip("the peer all-reduce needs compute capability >= 9.0")


@pytest.mark.parametrize("size", [1, 1000, 1024, 4096 * 1000 + 7, 1 << 22])
@pytest.mark.parametrize("wire", [jnp.bfloat16, jnp.float32])
def test_peer_all_reduce_is_exact_and_bit_identical(gpu_pair, size, wire):
    _peer_capable(gpu_pair)
    x = jax.random.normal(jax.random.key(size), (2, size), jnp.float32)
    out = np.asarray(_run(gpu_pair, lambda v: peer_all_reduce(v[0], "data", wire_dtype=wire)[None], x))
    host = np.asarray(x)
    expected = (_bf16(host) if wire == jnp.bfloat16 else host).sum(0)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], expected)


def test_peer_all_reduce_of_bf16_data_and_odd_shape(gpu_pair):
    _peer_capable(gpu_pair)
    x = jax.random.normal(jax.random.key(7), (2, 37, 129), jnp.float32).astype(jnp.bfloat16)
    out = np.asarray(_run(gpu_pair, lambda v: peer_all_reduce(v[0], "data")[None], x), np.float32)
    expected = np.asarray(x, np.float32).sum(0).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], expected)


def test_peer_tree_and_bf16_error_feedback_on_gpu(gpu_pair):
    _peer_capable(gpu_pair)
    tree = [jax.random.normal(jax.random.key(8), (2, 3 * 4096 + 5), jnp.float32),
            jax.random.normal(jax.random.key(9), (2, 64, 33), jnp.float32)]

    def body(a, b):
        leaves = [a[0], b[0]]
        plain = all_reduce_tree(leaves, "data", method="peer", bucket_mb=0.01)
        ref = all_reduce_tree(leaves, "data", method="psum")
        errs = ErrorFeedbackState([jnp.zeros_like(v) for v in leaves])
        comp, new = all_reduce_tree(leaves, "data", method="peer", compression="bf16", error_state=errs)
        return [[v[None] for v in t] for t in (plain, ref, comp, new.error)]

    fn = jax.jit(jax.shard_map(body, mesh=gpu_pair, in_specs=(P("data"), P("data")), out_specs=P("data"),
                               check_vma=False))
    plain, ref, comp, err = fn(*tree)
    for i, leaf in enumerate(tree):
        v = np.asarray(leaf)
        np.testing.assert_allclose(np.asarray(plain[i])[0], np.asarray(ref[i])[0], rtol=1e-6, atol=1e-6)
        got = np.asarray(comp[i])
        np.testing.assert_array_equal(got[0], got[1])
        np.testing.assert_array_equal(got[0], _bf16(v).sum(0))
        np.testing.assert_array_equal(np.asarray(err[i]), v - _bf16(v))
        assert np.abs(np.asarray(err[i])).max() > 0
