"""all_reduce_tree, the rings and accumulate_gradients used together: results against lax.psum.

Covers what the per-module tests leave out: odd leaves (scalars, 1 element, primes,
0-size) of mixed dtypes on a sub-mesh of 3 devices and under pmap, error feedback
carried over many steps, one reduction per step whatever the micro-batch count, and
gradients through the reductions.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import accumulate_gradients
from jaxopt_train.collectives import ErrorFeedbackState, all_reduce_tree, init_error_feedback, ring_all_reduce

from test_accumulation import _computations

AUTO = jax.sharding.AxisType.Auto
LEAVES = {"scalar": ((), jnp.float32), "one": ((1,), jnp.float32), "prime": ((13, 5), jnp.float32),
          "empty": ((0,), jnp.float32), "b_odd": ((11,), jnp.bfloat16), "b_empty": ((0, 3), jnp.bfloat16),
          "b_scalar": ((), jnp.bfloat16), "h_odd": ((257,), jnp.float16), "count": ((3,), jnp.int32)}


def _mesh(n, name="d"):
    return jax.make_mesh((n,), (name,), axis_types=(AUTO,), devices=jax.devices()[:n])


def _tree(n, seed=0):
    """Per-device leaves (leading axis n), small integers: every partial sum is exact in every dtype."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.integers(-8, 9, (n,) + shape).astype(np.float32)).astype(dtype)
            for k, (shape, dtype) in LEAVES.items()}


CASES = [dict(method="ring", bucket_mb=0.0), dict(method="ring", bucket_mb=math.inf, wire_dtype=jnp.bfloat16),
         dict(method="ring_bidir", bucket_mb=25.0, num_chunks=2), dict(method="hierarchical", bucket_mb=0.0),
         dict(method="ring", ring_order=[2, 0, 1], wire_dtype=jnp.float32)]
COMPRESSED = [dict(method="psum", compression="int8"), dict(method="ring", compression="bf16", bucket_mb=0.0),
              dict(method="ring_bidir", compression="int8", bucket_mb=math.inf)]


def _reductions(tree):
    out = {"ref": lax.psum(tree, "d")}
    for i, kwargs in enumerate(CASES + COMPRESSED):
        out[str(i)] = all_reduce_tree(tree, "d", **kwargs)
    return out


def _check_reductions(out, n):
    for i, kwargs in enumerate(CASES + COMPRESSED):
        for k, (shape, dtype) in LEAVES.items():
            got, ref = np.asarray(out[str(i)][k]), np.asarray(out["ref"][k])
            assert got.shape == (n,) + shape and got.dtype == jnp.dtype(dtype), (kwargs, k)
            assert all(np.array_equal(got[0], got[j]) for j in range(n)), (kwargs, k)  # replicas agree
            if "compression" not in kwargs or dtype == jnp.int32:
                np.testing.assert_array_equal(got.astype(np.float32), ref.astype(np.float32), err_msg=f"{kwargs} {k}")
            else:  # int8: (n + 1) / 2 steps of a block's scale, at most 8 * n / 127
                bound = 2.0**-8 * 8 * 2 * n if kwargs["compression"] == "bf16" else (n + 1) / 2 * 8 * n / 127
                assert np.abs(got.astype(np.float64) - ref.astype(np.float64)).max(initial=0) <= bound, (kwargs, k)


def test_odd_mixed_dtype_trees_on_a_3_device_sub_mesh_match_psum():
    n = 3
    fn = jax.jit(jax.shard_map(lambda t: jax.tree.map(lambda x: x[None], _reductions(jax.tree.map(lambda x: x[0], t))),
                               mesh=_mesh(n), in_specs=P("d"), out_specs=P("d")))
    _check_reductions(fn(_tree(n)), n)


def test_odd_mixed_dtype_trees_under_pmap_match_psum():
    n = 3
    _check_reductions(jax.pmap(_reductions, axis_name="d", devices=jax.devices()[:n])(_tree(n, seed=1)), n)


@pytest.mark.parametrize("method", ["psum", "ring"])
def test_error_feedback_over_many_steps_delivers_the_exact_running_total(method):
    """As the compression module says: summed over T steps, the delivered sums are the exact
    sums minus the errors still held (f32 leaves), and the gap stays one step's size."""
    n, steps = 3, 25
    rng = np.random.default_rng(4)
    grads = {"w": rng.standard_normal((steps, n, 13, 5)), "s": rng.standard_normal((steps, n)),
             "big": rng.standard_normal((steps, n, 300)) * np.linspace(0.01, 3, 300)}
    grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)

    def body(grads, error):
        grads = jax.tree.map(lambda g: g[:, 0], grads)

        def step(carry, g):
            state, total = carry
            summed, state = all_reduce_tree(g, "d", method=method, compression="int8", error_state=state)
            return (state, jax.tree.map(jnp.add, total, summed)), None
        zeros = jax.tree.map(lambda g: jnp.zeros_like(g[0]), grads)  # typed varying, as the sums
        (state, total), _ = lax.scan(step, (ErrorFeedbackState(error), zeros), grads)
        held = lax.psum(jax.tree.map(lambda e: e[0], state.error), "d")
        exact = lax.psum(jax.tree.map(lambda g: jnp.sum(g, 0), grads), "d")
        return jax.tree.map(lambda x: x[None], (total, held, exact))

    error = init_error_feedback(jax.tree.map(lambda g: g[0, 0], grads), n).error
    fn = jax.jit(jax.shard_map(body, mesh=_mesh(n), in_specs=(P(None, "d"), P("d")), out_specs=P("d")))
    total, held, exact = (jax.tree.map(lambda x: np.asarray(x[0], np.float64), t) for t in fn(grads, error))
    for k in grads:
        np.testing.assert_allclose(total[k] + held[k], exact[k], rtol=0, atol=1e-4, err_msg=k)
        one_step = (n + 1) / 2 * n * np.abs(np.asarray(grads[k])).max() / 127
        assert np.abs(total[k] - exact[k]).max() <= one_step, k


_COLLECTIVE = re.compile(r"\s(?:all-reduce|all-reduce-start|reduce-scatter|collective-permute|"
                         r"collective-permute-start|all-to-all|all-gather|all-gather-start)\(")


def _collective_counts(hlo):
    """(collectives in the module, those reachable from a while loop's body)."""
    comps = _computations(hlo)
    todo = [b for text in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", text)]
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in comps:
            seen.add(name)
            todo += [c.strip().lstrip("%") for group in re.findall(
                r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?", comps[name])
                for c in group.split(",")]
    return (sum(len(_COLLECTIVE.findall(text)) for text in comps.values()),
            sum(len(_COLLECTIVE.findall(comps[name])) for name in seen))


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


@pytest.mark.parametrize("sync", [dict(method="psum"), dict(method="ring"), dict(method="ring_bidir"),
                                  dict(method="hierarchical", group_size=2), dict(method="ring", compression="int8")])
def test_one_reduction_per_step_whatever_the_micro_batch_count(sync):
    """accumulate_gradients then all_reduce_tree under shard_map (check_vma on): the collectives
    of one reduction, none inside the scan, as many for 4 micro-batches as for 1; full-batch grads."""
    n = 4
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:n])
    k = jax.random.split(jax.random.key(3), 4)
    params = {"w1": jax.random.normal(k[0], (6, 16)), "b1": jnp.zeros((16,)), "w2": jax.random.normal(k[1], (16, 3))}
    batch = {"x": jax.random.normal(k[2], (32, 6)), "y": jax.random.normal(k[3], (32, 3))}
    args = jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(batch, NamedSharding(mesh, P("data")))
    want = jax.grad(_mlp_loss)(params, batch)
    counts = []
    for microbatches in (1, 4):
        def step(params, batch):
            _, grads = accumulate_gradients(_mlp_loss, microbatches)(params, batch)
            return jax.tree.map(lambda g: g[None] / n, all_reduce_tree(grads, "data", **sync))
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
        counts.append(_collective_counts(fn.lower(*args).compile().as_text()))
        tol = 5e-2 if "compression" in sync else 1e-5
        for name, g in fn(*args).items():
            np.testing.assert_allclose(np.asarray(g), np.broadcast_to(want[name], g.shape), rtol=tol, atol=tol)
    assert counts[0] == counts[1] and counts[0][1] == 0 and counts[0][0] >= 1, counts


def test_gradients_through_the_rings_equal_those_through_psum():
    n = 3
    x = jax.random.normal(jax.random.key(0), (n, 2, 7), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (n, 2, 7), jnp.float32)
    reductions = [lambda v: lax.psum(v, "d"), lambda v: ring_all_reduce(v, "d"),
                  lambda v: ring_all_reduce(v, "d", bidirectional=True, ring_order=[1, 2, 0], num_chunks=2),
                  lambda v: all_reduce_tree(v, "d", method="hierarchical")]

    def body(x, w):
        return jnp.stack([jax.grad(lambda x: jnp.sum(w * jnp.sin(reduce(x))))(x) for reduce in reductions])

    want = np.cos(np.asarray(x, np.float64).sum(0)) * np.asarray(w, np.float64).sum(0)
    for got in (jax.jit(jax.shard_map(lambda x, w: body(x[0], w[0])[None], mesh=_mesh(n), in_specs=P("d"),
                                      out_specs=P("d")))(x, w),
                jax.pmap(body, axis_name="d", devices=jax.devices()[:n])(x, w)):
        for i in range(len(reductions)):
            np.testing.assert_allclose(np.asarray(got)[:, i], np.broadcast_to(want, x.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["psum", "ring"])
def test_compressed_all_reduce_of_a_replicated_value_differentiates(method):
    """Under check_vma a replicated (invariant) input failed in the straight-through backward
    ("the manual axis types do not match"). The compressed result is typed varying, as the
    uncompressed ring's is, and differentiates as that ring does."""
    n = 3
    x, w = jnp.arange(5.0, dtype=jnp.float32), jnp.linspace(-1.0, 2.0, 5, dtype=jnp.float32)

    def body(x):
        grad = lambda reduce: jax.grad(lambda x: jnp.sum(w * reduce(x)))(x)  # noqa: E731
        return jnp.stack([grad(lambda v: all_reduce_tree(v, "d", method="ring"))]
                         + [grad(lambda v, c=c: all_reduce_tree(v, "d", method=method, compression=c))
                            for c in ("bf16", "int8")])[None]

    got = np.asarray(jax.jit(jax.shard_map(body, mesh=_mesh(n), in_specs=P(), out_specs=P("d")))(x))
    np.testing.assert_allclose(got, np.broadcast_to(n * n * np.asarray(w), got.shape), rtol=1e-6)
