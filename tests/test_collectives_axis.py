"""Axis names of the collectives (jaxopt_train.collectives._axis): a value that cannot name a
mesh axis (an int, which lax reads as a positional axis, a list, a dict) is refused by name;
`embedding_grad_exchange` takes a list or tuple of axes as the rings do and refuses a
repeated axis.

Traced only where the point is the error (nothing compiles); the one numerical check
compares against `lax.psum` on a 2 x 4 mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxopt_train.collectives import (
    all_reduce_tree,
    embedding_grad_exchange,
    grouped_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

AUTO = jax.sharding.AxisType.Auto

X = jnp.zeros((8 * 4, 2), jnp.float32)


def _trace(fn, x=X, mesh_shape=(8,), names=("data",)):
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AUTO,) * len(names))
    spec = P(names if len(names) > 1 else names[0])
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)).trace(x)


@pytest.mark.parametrize("fn, got", [
    (lambda x: ring_all_reduce(x, 0), "int"),  # lax reads an int as a positional axis
    (lambda x: ring_reduce_scatter(x, np.int32(0)), "int32"),
    (lambda x: ring_all_gather(x, ("data", 1)), "int"),
    (lambda x: ring_all_reduce(x, (["data"],)), "list"),  # was "unhashable type: 'list'"
    (lambda x: all_reduce_tree(x, {"data": 8}), "dict"),
    (lambda x: all_reduce_tree(x, ("data", ["data"]), method="hierarchical"), "list"),
    (lambda x: grouped_all_reduce(x, [["data"]], 2), "list"),
    (lambda x: embedding_grad_exchange(jnp.zeros((4,), jnp.int32), x[:4], 0, 10), "int"),
])
def test_an_axis_name_that_cannot_name_a_mesh_axis_is_refused_by_name(fn, got):
    with pytest.raises(TypeError, match=f"must be a mesh axis name such as 'data' .* got a name of type {got}\\b"):
        _trace(fn)


def test_embedding_exchange_takes_axis_names_as_the_rings_do():
    """A list of axes reached lax unhashable, and a repeated axis failed with lax's
    "repeated axis in `source` argument"; a list now names its axes, as in the rings."""
    ids = jax.random.randint(jax.random.key(0), (8, 3), 0, 5)
    cotangent = jax.random.normal(jax.random.key(1), (8, 3, 2))
    both = ("a", "b")

    def body(i, c):
        local = jnp.zeros((5, 2)).at[i[0]].add(c[0])
        return (embedding_grad_exchange(i[0], c[0], ["a", "b"], 5)[None],
                embedding_grad_exchange(i[0], c[0], ["b", "a"], 5)[None], lax.psum(local, both)[None])

    mesh = jax.make_mesh((2, 4), both, axis_types=(AUTO, AUTO))
    got_ab, got_ba, ref = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(both), out_specs=P(both),
                                                check_vma=False))(ids, cotangent)
    np.testing.assert_allclose(got_ab, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_ba, ref, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"axis_name=\('a', 'a'\) must be one mesh axis name or a tuple of distinct"):
        _trace(lambda x: embedding_grad_exchange(jnp.zeros((4,), jnp.int32), x[:4], ("a", "a"), 10),
               mesh_shape=(2, 4), names=both)
