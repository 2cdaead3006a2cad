"""Collectives on 2 real GPUs: a narrow wire keeps the replicas bit-identical.

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

from jaxopt_train.collectives import ErrorFeedbackState, all_reduce_tree, ring_all_reduce

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
