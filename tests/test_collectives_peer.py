"""The peer all-reduce (one Mosaic GPU kernel storing into the other GPU) on CPU.

The kernel itself only runs on 2 Hopper GPUs (tests/test_collectives_gpu.py).
Here: it lowers for CUDA from this CPU (tracing and the Mosaic GPU module),
the wrapper's arithmetic (tiles, padded tail, accumulation, the wire copy for
error feedback) is checked with the kernel replaced by a ppermute that returns
the same outputs, and every bad input gets its error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxopt_train.collectives import ErrorFeedbackState, all_reduce_tree, peer_all_reduce
from jaxopt_train.collectives import peer as peer_lib


def _mesh(shape=(2,), names=("data",)):
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


def _emulated_kernel(n_tiles, tile, grid, has_tail, wire, narrow, axis_name):
    """The kernel's outputs made with a ppermute: [[mine] recv] [[mine_tail] recv_tail]."""
    assert 1 <= grid <= max(1, n_tiles)

    def call(flat, *tail):
        outs = []
        for source in ([flat[: n_tiles * tile]] if n_tiles else []) + list(tail):
            mine = source.astype(wire)
            theirs = lax.ppermute(mine, axis_name, [(0, 1), (1, 0)])
            outs += [mine, theirs] if narrow else [theirs]
        return tuple(outs)

    return call


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(peer_lib, "check_platform", lambda: None)
    monkeypatch.setattr(peer_lib, "_kernel_call", _emulated_kernel)


def _run(mesh, body, x):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    return np.asarray(fn(x))


@pytest.mark.parametrize("size", [1, 511, 1024, 3 * 1024 + 5, 40000])
@pytest.mark.parametrize("dtype,wire", [("float32", "bfloat16"), ("float32", "float32"),
                                        ("bfloat16", "bfloat16"), ("float16", "float32"),
                                        ("float32", "float16"),
                                        # Equal widths round too; the own copy used to go unrounded
                                        # there, so the two devices' sums differed.
                                        ("float16", "bfloat16")])
def test_sum_is_exact_sum_of_wire_rounded_inputs(emulated, size, dtype, wire):
    mesh = _mesh()
    x = jax.random.normal(jax.random.key(size), (2, size), jnp.float32).astype(dtype)
    out = _run(mesh, lambda v: peer_all_reduce(v[0], "data", wire_dtype=wire)[None], x)
    host = np.asarray(x.astype(wire).astype(jnp.float32))  # a widening wire is exact
    expected = host.sum(0).astype(dtype)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], expected)
    assert out.dtype == np.dtype(dtype)


def test_shape_is_kept_and_psum_matched(emulated):
    mesh = _mesh()
    x = jax.random.normal(jax.random.key(3), (2, 7, 33, 5), jnp.float32)
    got = _run(mesh, lambda v: peer_all_reduce(v, "data"), x.reshape(14, 33, 5))
    ref = _run(mesh, lambda v: lax.psum(v, "data"), x.reshape(14, 33, 5))
    assert got.shape == (14, 33, 5)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_small_tiles_and_grid(emulated):
    mesh = _mesh()
    x = jax.random.normal(jax.random.key(4), (2, 5 * 512 + 3), jnp.float32)
    out = _run(mesh, lambda v: peer_all_reduce(v[0], "data", tile=512, ctas_per_sm=1)[None], x)
    np.testing.assert_allclose(out[0], np.asarray(x).sum(0), rtol=1e-6, atol=1e-6)


def test_tree_method_peer_matches_psum_and_bf16_error_feedback(emulated):
    mesh = _mesh()
    tree = {"a": jax.random.normal(jax.random.key(5), (2, 3, 17), jnp.float32),
            "b": jax.random.normal(jax.random.key(6), (2, 2000), jnp.float32).astype(jnp.bfloat16)}

    def body(a, b):
        leaves = {"a": a[0], "b": b[0]}
        plain = all_reduce_tree(leaves, "data", method="peer", bucket_mb=0.004)
        ref = all_reduce_tree(leaves, "data", method="psum")
        errs = ErrorFeedbackState(jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32), leaves))
        comp, new = all_reduce_tree(leaves, "data", method="peer", compression="bf16", error_state=errs)
        return [jax.tree.map(lambda v: v[None], t) for t in (plain, ref, comp, new.error)]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                               check_vma=False))
    plain, ref, comp, err = fn(tree["a"], tree["b"])
    for k in tree:
        np.testing.assert_allclose(np.asarray(plain[k], np.float32), np.asarray(ref[k], np.float32),
                                   rtol=1e-2 if k == "b" else 1e-6, atol=1e-2 if k == "b" else 1e-6)
    a = np.asarray(tree["a"])
    rounded = a.astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(comp["a"])[0], rounded.sum(0))
    np.testing.assert_array_equal(np.asarray(err["a"]), a - rounded)  # what the wire lost, per device
    assert np.abs(np.asarray(err["a"])).max() > 0


def test_empty_input_is_an_empty_sum(emulated):
    """"Any shape and size": a size-0 array (or an empty leaf under method='peer') used to fail
    with "Need at least one array to concatenate" (no tile and no tail to add)."""
    mesh = _mesh()
    x = jnp.ones((2, 0, 3), jnp.float32)
    out = _run(mesh, lambda v: peer_all_reduce(v[0], "data", wire_dtype=jnp.bfloat16)[None], x)
    assert out.shape == (2, 0, 3) and out.dtype == np.float32

    def body(v):
        summed, copy = peer_all_reduce(v[0], "data", wire_dtype=jnp.bfloat16, return_wire_copy=True)
        assert copy.shape == (0,) and copy.dtype == jnp.float32
        tree = all_reduce_tree({"empty": v[0], "w": jnp.ones((5,), jnp.float32)}, "data", method="peer",
                               bucket_mb=0)
        return summed[None], tree["w"][None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    summed, w = fn(x)
    assert summed.shape == (2, 0, 3)
    np.testing.assert_array_equal(np.asarray(w), np.full((2, 5), 2.0, np.float32))


def test_tree_method_peer_sums_integer_leaves_with_psum(emulated):
    mesh = _mesh()
    counts = jnp.arange(2 * 5, dtype=jnp.int32).reshape(2, 5)
    out = _run(mesh, lambda v: all_reduce_tree({"n": v[0]}, "data", method="peer")["n"][None], counts)
    np.testing.assert_array_equal(out[0], np.asarray(counts).sum(0))


def test_lowers_to_one_mosaic_gpu_kernel_for_cuda(monkeypatch):
    """Traces the real kernel and builds its Mosaic GPU module, here on CPU (no GPU needed)."""
    monkeypatch.setattr(peer_lib, "check_platform", lambda: None)
    mesh = _mesh((2, 4), ("data", "model"))  # the peer is found along one axis of a 2-D mesh
    for size, wire in ((4096 * 3 + 17, jnp.bfloat16), (2048, jnp.float32)):
        fn = jax.jit(jax.shard_map(lambda v: peer_all_reduce(v, "data", wire_dtype=wire), mesh=mesh,
                                   in_specs=P("data"), out_specs=P("data"), check_vma=False))
        arg = jax.ShapeDtypeStruct((2 * size,), jnp.float32,
                                   sharding=jax.sharding.NamedSharding(mesh, P("data")))
        text = fn.trace(arg).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1, text[:2000]
        assert "collective_permute" not in text and "all_reduce" not in text


def test_bad_inputs_are_clear(monkeypatch):
    mesh8 = _mesh((8,))
    x8 = jnp.ones((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="exactly 2 devices"):
        _run(mesh8, lambda v: peer_all_reduce(v, "data"), x8)
    with pytest.raises(ValueError, match="not a mapped axis"):
        _run(_mesh(), lambda v: peer_all_reduce(v, "nope"), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="one mesh axis"):
        _run(_mesh(), lambda v: peer_all_reduce(v, ("data",)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="Mosaic GPU finds the peer through the mesh"):
        jax.vmap(lambda v: peer_all_reduce(v, "i"), axis_name="i", axis_size=2)(jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        _run(_mesh(), lambda v: peer_all_reduce(v, "data"), jnp.ones((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        _run(_mesh(), lambda v: peer_all_reduce(v, "data", wire_dtype=jnp.int8), jnp.ones((2, 4)))
    for tile in (1000, 256, 0, True):
        with pytest.raises(ValueError, match="tile must be a power of two"):
            _run(_mesh(), lambda v, tile=tile: peer_all_reduce(v, "data", tile=tile), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="ctas_per_sm"):
        _run(_mesh(), lambda v: peer_all_reduce(v, "data", ctas_per_sm=0), jnp.ones((2, 4)))
    # On this CPU the kernel cannot run: the platform check says so.
    with pytest.raises(ValueError, match="needs CUDA GPUs; the default backend here is 'cpu'"):
        _run(_mesh(), lambda v: peer_all_reduce(v, "data"), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="method='peer'"):
        _run(_mesh(), lambda v: all_reduce_tree([v], "data", method="peer", compression="int8")[0],
             jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="method='peer'"):
        _run(_mesh(), lambda v: all_reduce_tree([v], "data", method="peer", num_chunks=2)[0], jnp.ones((2, 4)))


def test_trainer_config_rejects_peer_with_int8():
    from jaxopt_train.train.config import TrainConfig

    with pytest.raises(ValueError, match="grad_sync='peer'"):
        TrainConfig(grad_sync="peer", grad_compression="int8")
    TrainConfig(grad_sync="peer", grad_compression="bf16")  # accepted
