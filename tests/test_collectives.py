"""Ring collectives against their lax references on 8 emulated devices (shard_map and pmap)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.collectives import (
    all_reduce_tree,
    grouped_all_reduce,
    hierarchical_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from jaxopt_train.collectives.compression import ErrorFeedbackState

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _smap(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _f32(x):
    return np.asarray(x, np.float32)


def _assert_sum_close(got, ref, abs_sum, n, dtype):
    """|got - ref| <= n * eps(dtype) * sum_j |x_j| elementwise: reordering / per-hop rounding only."""
    eps = float(jnp.finfo(dtype).eps)
    err = np.abs(_f32(got) - _f32(ref))
    bound = n * eps * _f32(abs_sum) + 1e-30
    assert np.all(err <= bound), f"max err {err.max()} vs bound {bound.max()}"


def _inputs(mesh, axes, rows_per_device, cols, dtype, integer_valued, seed=0):
    n = mesh.devices.size
    shape = (n * rows_per_device, cols)
    if integer_valued:
        x = jax.random.randint(jax.random.key(seed), shape, -8, 9).astype(dtype)
    else:
        x = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)
    return _put(x, mesh, P(axes))


# One compiled function per (mesh, axis, dtype) computes every ring variant and
# its reference, reused for random and exactly representable data: each ring
# costs ~0.5 s to compile on CPU.
@functools.cache
def _suite_1d(dtype_name):
    mesh = _mesh((8,), ("data",))
    n = 8
    dtype = jnp.dtype(dtype_name)
    full = dtype == jnp.float32

    def body(x, y):
        out = {
            "rs": ring_reduce_scatter(x, "data"),
            "rs_ref": lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True),
            "rs_abs": lax.psum_scatter(jnp.abs(x), "data", scatter_dimension=0, tiled=True),
            "ar": ring_all_reduce(y, "data"),
            "ar_wire32": ring_all_reduce(y, "data", wire_dtype=jnp.float32),
            "ar_ref": lax.psum(y, "data"),
            "ar_abs": lax.psum(jnp.abs(y).astype(jnp.float32), "data"),
        }
        if full:
            order = (3, 1, 0, 2, 7, 6, 5, 4)
            out["rs_order"] = ring_reduce_scatter(x, "data", ring_order=order, num_chunks=3)
            out["ag"] = ring_all_gather(x, "data", ring_order=order, num_chunks=2)
            out["ag_ref"] = lax.all_gather(x, "data", axis=0, tiled=True)
            out["ar_bidir"] = ring_all_reduce(y, "data", bidirectional=True, num_chunks=2)
            out["ar_grouped"] = grouped_all_reduce(y, "data", 4, ring_order=order, num_chunks=2)
        return out

    return mesh, n, _smap(body, mesh, (P("data"), P("data")), P("data"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("integer_valued", [False, True])
def test_rings_match_lax_on_8_devices(dtype, integer_valued):
    mesh, n, fn = _suite_1d(dtype)
    x = _inputs(mesh, "data", 2 * n, 3, dtype, integer_valued)  # divides n
    y = _inputs(mesh, "data", 7, 3, dtype, integer_valued, seed=1)  # 21 elements: padded
    out = fn(x, y)
    assert out["rs"].dtype == out["ar"].dtype == jnp.dtype(dtype)
    assert out["rs"].shape == out["rs_ref"].shape and out["ar"].shape == out["ar_ref"].shape
    if integer_valued:  # every partial sum is exact: results must be bit-equal
        for key in [k for k in out if not k.endswith(("_ref", "_abs"))]:
            ref = out["ag_ref" if key == "ag" else "rs_ref" if key.startswith("rs") else "ar_ref"]
            np.testing.assert_array_equal(_f32(out[key]), _f32(ref), err_msg=key)
        return
    _assert_sum_close(out["rs"], out["rs_ref"], out["rs_abs"], n, dtype)
    _assert_sum_close(out["ar"], out["ar_ref"], out["ar_abs"], n, dtype)
    # A f32 wire sums bf16/f16 in f32 with one final rounding: within one ulp of psum.
    _assert_sum_close(out["ar_wire32"], out["ar_ref"], out["ar_abs"], 1, dtype)
    if dtype == "float32":
        np.testing.assert_array_equal(out["ag"], out["ag_ref"])
        for key in ("rs_order",):
            _assert_sum_close(out[key], out["rs_ref"], out["rs_abs"], n, dtype)
        for key in ("ar_bidir", "ar_grouped"):
            _assert_sum_close(out[key], out["ar_ref"], out["ar_abs"], n, dtype)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_rings_and_hierarchical_on_2d_meshes(shape):
    mesh = _mesh(shape, ("hosts", "local"))
    both = ("hosts", "local")

    def body(x, y):
        out = {"hier": hierarchical_all_reduce(y, "local", "hosts"),
               "hier_tree": all_reduce_tree(y, both, method="hierarchical"),
               "ref": lax.psum(y, both), "abs": lax.psum(jnp.abs(y), both)}
        for axis in both:
            out[f"rs_{axis}"] = ring_reduce_scatter(x, axis)
            out[f"rs_{axis}_ref"] = lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
            out[f"ag_{axis}"] = ring_all_gather(x, axis)
            out[f"ag_{axis}_ref"] = lax.all_gather(x, axis, axis=0, tiled=True)
            out[f"ar_{axis}"] = ring_all_reduce(y, axis, bidirectional=axis == "local")
            out[f"ar_{axis}_ref"] = lax.psum(y, axis)
        return out

    fn = _smap(body, mesh, (P(both), P(both)), P(both))
    x = _inputs(mesh, both, 8, 2, jnp.float32, integer_valued=False)
    y = _inputs(mesh, both, 5, 3, jnp.float32, integer_valued=False, seed=1)
    out = fn(x, y)
    scale = 8 * 8 * float(jnp.finfo(jnp.float32).eps)
    for key in [k for k in out if k not in ("ref", "abs") and not k.endswith("_ref")]:
        ref = out["ref"] if key.startswith("hier") else out[f"{key}_ref"]
        assert out[key].shape == ref.shape, key
        np.testing.assert_allclose(out[key], ref, atol=scale * float(jnp.max(out["abs"])), rtol=0, err_msg=key)


def test_tuple_axis_names_match_lax_in_either_order():
    """A tuple of axes is summed / scattered / gathered as lax does, also against mesh order:
    lax.ppermute numbers devices of a tuple in mesh order but lax.axis_index in tuple order."""
    mesh = _mesh((2, 4), ("a", "b"))
    both = ("a", "b")

    def body(x, y):
        out = {}
        for axes in (("b", "a"), ("a", "b"), ("b",)):
            key = "".join(axes)
            out[f"ar_{key}"] = ring_all_reduce(y, axes, num_chunks=2)
            out[f"ar_{key}_ref"] = lax.psum(y, axes)
            out[f"rs_{key}"] = ring_reduce_scatter(x, axes, wire_dtype=jnp.float32)
            out[f"rs_{key}_ref"] = lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
            out[f"ag_{key}"] = ring_all_gather(x, axes)
            out[f"ag_{key}_ref"] = lax.all_gather(x, axes, axis=0, tiled=True)
        out["ar_bidir_ba"] = ring_all_reduce(y, ("b", "a"), bidirectional=True)
        out["ar_bidir_ba_ref"] = out["ar_ba_ref"]
        out["hier_ba"] = hierarchical_all_reduce(y, ("b",), ("a",))
        out["hier_ba_ref"] = lax.psum(y, both)
        return out

    fn = _smap(body, mesh, (P(both), P(both)), P(both))
    x = _inputs(mesh, both, 8, 3, jnp.bfloat16, integer_valued=True)
    y = _inputs(mesh, both, 5, 3, jnp.bfloat16, integer_valued=True, seed=1)  # 15 a device: padded
    out = fn(x, y)
    for key in [k for k in out if not k.endswith("_ref")]:
        assert out[key].shape == out[f"{key}_ref"].shape and out[key].dtype == jnp.bfloat16, key
        np.testing.assert_array_equal(_f32(out[key]), _f32(out[f"{key}_ref"]), err_msg=key)


def test_rings_under_pmap():
    n = 8

    def body(x):
        return {"ar": ring_all_reduce(x, "i", bidirectional=True), "ar_ref": lax.psum(x, "i"),
                "rs": ring_reduce_scatter(x, "i"),
                "rs_ref": lax.psum_scatter(x, "i", scatter_dimension=0, tiled=True),
                "ag": ring_all_gather(x, "i"), "ag_ref": lax.all_gather(x, "i", axis=0, tiled=True),
                "tree": all_reduce_tree({"w": x, "b": x[0]}, "i", method="ring", bucket_mb=0)}

    x = jax.random.randint(jax.random.key(3), (n, n, 3), -5, 6).astype(jnp.float32)
    out = jax.pmap(body, axis_name="i")(x)
    for key in ("ar", "rs", "ag"):
        np.testing.assert_array_equal(out[key], out[f"{key}_ref"], err_msg=key)
    np.testing.assert_array_equal(out["tree"]["w"], out["ar_ref"])
    np.testing.assert_array_equal(out["tree"]["b"], out["ar_ref"][:, 0])


# Bad input: traced only, nothing compiles.
def _trace(fn, x, mesh_shape=(8,), names=("data",)):
    mesh = _mesh(mesh_shape, names)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(names[0]), out_specs=P(names[0]),
                                 check_vma=False)).trace(x)


X = jnp.zeros((8 * 4, 2), jnp.float32)


@pytest.mark.parametrize("fn, match", [
    (lambda x: ring_all_reduce(x, "model"), "axis_name='model' is not a mapped axis"),
    (lambda x: ring_reduce_scatter(x, "batch"), "axis_name='batch' is not a mapped axis"),
    (lambda x: all_reduce_tree(x, "nope"), "axis_name='nope' is not a mapped axis"),
    (lambda x: ring_reduce_scatter(x[0, 0], "data"), r"dimension 0 to scatter; got x.shape=\(\)"),
    (lambda x: ring_all_gather(x[0, 0], "data"), r"dimension 0 to concatenate"),
    (lambda x: ring_reduce_scatter(x[:3], "data"), r"x.shape\[0\]=3 divisible by the size 8"),
    (lambda x: ring_all_reduce(x, "data", ring_order=[0, 1, 2]), "must be a permutation"),
    (lambda x: ring_all_reduce(x, "data", num_chunks=0), "num_chunks=0 must be a positive int"),
    (lambda x: all_reduce_tree(x, "data", method="tree"), r"method='tree' must be one of \('psum'"),
    (lambda x: all_reduce_tree(x, "data", compression="fp8"), r"compression='fp8' must be None or one of"),
    (lambda x: all_reduce_tree(x, "data", bucket_mb=-1), "bucket_mb=-1 must be >= 0"),
    (lambda x: all_reduce_tree(x, "data", method="hierarchical", group_size=3), "group_size=3 must be a positive divisor"),
    (lambda x: grouped_all_reduce(x, "data", 5), "group_size=5"),
    (lambda x: grouped_all_reduce(x, "data", True), "group_size=True"),
    (lambda x: ring_all_reduce(x, ()), r"axis_name=\(\) must be one mesh axis name or a tuple"),
    (lambda x: ring_all_reduce(x, ("data", "data")), "tuple of distinct names"),
    (lambda x: ring_all_reduce(x, "data", ring_order=[0.5, 1, 2, 3, 4, 5, 6, 7]), "a sequence of ints"),
    (lambda x: ring_all_reduce(x, "data", num_chunks=True), "num_chunks=True must be a positive int"),
])
def test_bad_input_gives_clear_errors(fn, match):
    with pytest.raises(ValueError, match=match):
        _trace(fn, X)


def test_bad_types_and_axis_pairs():
    with pytest.raises(TypeError, match="floating or integer array leaves"):
        _trace(lambda x: all_reduce_tree({"a": x, "b": "text"}, "data"), X)
    with pytest.raises(TypeError, match="floating or integer array; got dtype=bool"):
        _trace(lambda x: ring_all_reduce(x > 0, "data"), X)
    with pytest.raises(ValueError, match="must be two different mesh axes"):
        _trace(lambda x: hierarchical_all_reduce(x, "data", "data"), X)
    with pytest.raises(ValueError, match="summed twice"):
        _trace(lambda x: hierarchical_all_reduce(x, ("a", "b"), "a"), X, (2, 4), ("a", "b"))
    # hierarchical / grouped summed bools as a logical OR, and a list failed with AttributeError
    for fn in (lambda x: hierarchical_all_reduce(x > 0, "b", "a"), lambda x: grouped_all_reduce(x > 0, "b", 2)):
        with pytest.raises(TypeError, match="floating or integer array; got dtype=bool"):
            _trace(fn, X, (2, 4), ("a", "b"))
    with pytest.raises(TypeError, match="needs a jax or numpy array; got list"):
        _trace(lambda x: ring_all_reduce([x], "data"), X)
    with pytest.raises(ValueError, match="ring_order= orders the devices of one axis"):
        _trace(lambda x: ring_all_reduce(x, ("a", "b"), ring_order=range(8)), X, (2, 4), ("a", "b"))
    with pytest.raises(ValueError, match="a ring runs over one mesh axis"):
        _trace(lambda x: grouped_all_reduce(x, ("a", "b"), 2), X, (2, 4), ("a", "b"))
    with pytest.raises(ValueError, match="runs over one axis"):
        _trace(lambda x: all_reduce_tree(x, ("a", "b"), method="ring"), X, (2, 4), ("a", "b"))
    with pytest.raises(ValueError, match="error_state= is only used with compression"):
        _trace(lambda x: all_reduce_tree(x, "data", error_state=object()), X)


@pytest.mark.parametrize("fn, exc, match", [
    (lambda x: all_reduce_tree(x, "data", bucket_mb="25"), TypeError,
     "bucket_mb='25' must be a number of MiB .* not str"),
    (lambda x: all_reduce_tree(x, "data", bucket_mb=float("nan")), ValueError, "bucket_mb=nan must be >= 0"),
    (lambda x: all_reduce_tree(x, "data", first_bucket_mb=None, bucket_mb=None), TypeError,
     "bucket_mb=None must be a number of MiB"),
    (lambda x: all_reduce_tree({"a": x}, "data", compression="bf16", error_state={"a": jnp.zeros_like(x)}),
     TypeError, "error_state must be an ErrorFeedbackState, built with init_error_feedback.*got dict"),
    (lambda x: all_reduce_tree({"a": x}, "data", compression="bf16",
                               error_state=ErrorFeedbackState({"b": jnp.zeros_like(x)})),
     ValueError, "error_state.error must have the gradient tree's structure"),
    (lambda x: all_reduce_tree(x, "data", method="psum", ring_order=list(range(8))), ValueError,
     r"ring_order= applies to the ring methods .* with method='psum'"),
    (lambda x: all_reduce_tree(x, "data", method="ring", group_size=4), ValueError,
     "group_size= applies to method='hierarchical' only; got group_size=4 with method='ring'"),
    (lambda x: all_reduce_tree(x, "data", num_chunks=4), ValueError,
     r"num_chunks= applies to the ring methods .* got num_chunks=4 with method='psum'"),
])
def test_wrong_types_and_ignored_options_are_refused(fn, exc, match):
    """Each names the argument, what it must be and what was given (no raw AttributeError / silence)."""
    with pytest.raises(exc, match=match):
        _trace(fn, X)


@pytest.mark.parametrize("kwargs", [
    dict(num_chunks=True),  # == 1, so "num_chunks != 1" let it through
    dict(num_chunks=1.0),
    dict(num_chunks=True, method="ring", compression="bf16"),
    dict(num_chunks=0, method="ring", compression="int8"),  # float leaves only: the ring never saw it
])
def test_all_reduce_tree_refuses_a_num_chunks_that_is_not_a_positive_int(kwargs):
    got = kwargs["num_chunks"]
    with pytest.raises(ValueError, match=re.escape(f"num_chunks={got!r} must be a positive int")):
        _trace(lambda x: all_reduce_tree({"w": x}, "data", **kwargs), X)


def test_all_reduce_tree_still_names_the_method_for_an_int_num_chunks_it_would_ignore():
    with pytest.raises(ValueError, match="num_chunks= applies to the ring methods"):
        _trace(lambda x: all_reduce_tree(x, "data", num_chunks=2), X)
    with pytest.raises(ValueError, match="the compressed exchange sends each bucket whole"):
        _trace(lambda x: all_reduce_tree(x, "data", method="ring", compression="bf16", num_chunks=np.int64(2)),
               X)


@pytest.mark.parametrize("flag", ["no", 1, None, np.array([True])])
def test_ring_all_reduce_refuses_a_bidirectional_that_is_not_a_bool(flag):
    # Any truthy value ran the two opposite rings (bidirectional="no" among them), None ran one.
    with pytest.raises(TypeError, match="must be True or False"):
        _trace(lambda x: ring_all_reduce(x, "data", bidirectional=flag), X)


def test_ring_all_reduce_takes_a_numpy_bool_bidirectional():
    _trace(lambda x: ring_all_reduce(x, "data", bidirectional=np.bool_(True)), X)


X64 = jnp.zeros((8 * 8, 2), jnp.float32)  # 8 rows a device: reduce-scatter divides them
MESH_2x4 = ((2, 4), ("a", "b"))


@pytest.mark.parametrize("fn, x, mesh, match", [
    (lambda x: ring_all_reduce(x, "data", wire_dtype=jnp.int8), X, (), "wire_dtype=int8 cannot carry float32 data"),
    (lambda x: ring_reduce_scatter(x, "data", wire_dtype=jnp.int32), X64, (), "expected a floating dtype"),
    (lambda x: hierarchical_all_reduce(x, "a", "b", wire_dtype=jnp.complex64), X, MESH_2x4, "complex64 cannot carry"),
    (lambda x: ring_all_reduce(x, "data", wire_dtype=jnp.float32), X.astype(jnp.int32), (),
     "float32 cannot carry int32 partial sums"),
    (lambda x: ring_all_reduce(x, "data", wire_dtype=jnp.int16), X.astype(jnp.int32), (), "at least as wide as int32"),
    (lambda x: ring_all_reduce(x, "data", wire_dtype="bf16x"), X, (), "wire_dtype='bf16x' is not a dtype"),
])
def test_wire_dtype_that_would_corrupt_the_sum_is_refused(fn, x, mesh, match):
    """A float wire rounds by design; an integer wire for float data (or a narrower or
    float wire for integer data) would truncate, wrap or round silently: refused."""
    with pytest.raises(TypeError, match=match):
        _trace(fn, x, *mesh)


# Two devices: ring_all_reduce is one exchange (x + ppermute(x)), on a sub-mesh of the 8 devices.
def _mesh2():
    return jax.make_mesh((2,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:2])


@functools.cache
def _suite_2(dtype_name):
    mesh = _mesh2()
    dtype = jnp.dtype(dtype_name)

    def body(x, y):
        out = {"ar": ring_all_reduce(x, "data"), "ar_ref": lax.psum(x, "data"),
               "ar_odd": ring_all_reduce(y, "data", num_chunks=3), "ar_odd_ref": lax.psum(y, "data"),
               "ar_bidir": ring_all_reduce(y, "data", bidirectional=True, ring_order=(1, 0)),
               "ar_scalar": ring_all_reduce(y[0, 0], "data")[None],
               "ar_scalar_ref": lax.psum(y[0, 0], "data")[None],
               # (integers only travel in an integer wire at least as wide: int32 itself)
               "ar_wire32": ring_all_reduce(y, "data", wire_dtype=jnp.int32 if dtype == jnp.int32 else jnp.float32),
               "tree": all_reduce_tree({"x": x, "y": y}, "data", method="ring", bucket_mb=0),
               "tree_bidir": all_reduce_tree({"x": x, "y": y}, "data", method="ring_bidir", num_chunks=2),
               "tree_hier": all_reduce_tree(y, "data", method="hierarchical", group_size=2)}
        if jnp.issubdtype(dtype, jnp.floating):
            # bf16 wire: both devices add the two bf16-rounded contributions in f32.
            out["ar_wire16"] = ring_all_reduce(y, "data", wire_dtype=jnp.bfloat16)
            out["ar_wire16_ref"] = lax.psum(y.astype(jnp.bfloat16).astype(jnp.float32), "data").astype(dtype)
            out["abs"] = lax.psum(jnp.abs(y).astype(jnp.float32), "data")
        return out

    return mesh, _smap(body, mesh, (P("data"), P("data")), P("data"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
def test_ring_all_reduce_on_2_devices_is_psum_and_identical_on_both(dtype):
    mesh, fn = _suite_2(dtype)
    integer = dtype == "int32"
    x = _inputs(mesh, "data", 4, 3, dtype, integer_valued=integer)
    y = _inputs(mesh, "data", 7, 3, dtype, integer_valued=integer, seed=1)  # 21 per device: odd
    out = fn(x, y)
    ref = {"ar": out["ar_ref"], "ar_odd": out["ar_odd_ref"], "ar_bidir": out["ar_odd_ref"],
           "ar_scalar": out["ar_scalar_ref"], "ar_wire32": out["ar_odd_ref"], "tree_hier": out["ar_odd_ref"]}
    if not integer:
        ref["ar_wire16"] = out["ar_wire16_ref"]
    got = dict(ref)
    got.update({k: out[k] for k in ref})
    got["tree_x"], got["tree_y"] = out["tree"]["x"], out["tree"]["y"]
    got["tree_bidir_x"], got["tree_bidir_y"] = out["tree_bidir"]["x"], out["tree_bidir"]["y"]
    ref.update(tree_x=out["ar_ref"], tree_y=out["ar_odd_ref"], tree_bidir_x=out["ar_ref"],
               tree_bidir_y=out["ar_odd_ref"])
    for key, value in got.items():
        assert value.dtype == jnp.dtype(dtype) and value.shape == ref[key].shape, key
        # One addition of two values rounded once to x.dtype: bit-equal to psum.
        np.testing.assert_array_equal(_f32(value), _f32(ref[key]), err_msg=key)
        halves = np.split(_f32(value), 2)
        np.testing.assert_array_equal(halves[0], halves[1], err_msg=f"{key}: devices differ")
    if not integer:  # the bf16 wire stays within bf16 rounding of the exact sum
        _assert_sum_close(out["ar_wire16"], out["ar_odd_ref"], out["abs"], 1, jnp.bfloat16)


def _permutes(fn, mesh, x, compiled):
    jitted = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    lowered = jitted.lower(x)
    if compiled:
        return len(re.findall(r"collective-permute(?:-start)?\(", lowered.compile().as_text()))
    return lowered.as_text().count("stablehlo.collective_permute")


def test_ring_all_reduce_lowers_to_one_collective_permute_on_2_devices():
    mesh = _mesh2()
    x = jnp.zeros((2 * 7, 3), jnp.float32)
    for fn in (lambda x: ring_all_reduce(x, "data"),
               lambda x: ring_all_reduce(x, "data", bidirectional=True, wire_dtype=jnp.bfloat16),
               lambda x: all_reduce_tree({"a": x, "b": x[0]}, "data", method="ring_bidir")):
        assert _permutes(fn, mesh, x, compiled=True) == 1
    assert _permutes(lambda x: ring_all_reduce(x, "data", num_chunks=3), mesh, x, compiled=False) == 3
    mesh8 = _mesh((8,), ("data",))
    x8 = jnp.zeros((8 * 7, 3), jnp.float32)
    assert _permutes(lambda x: ring_all_reduce(x, "data"), mesh8, x8, compiled=False) == 2 * 7
    assert _permutes(lambda x: ring_all_reduce(x, "data", bidirectional=True), mesh8, x8, compiled=False) == 4 * 7


@pytest.mark.parametrize("src,dst,pinned", [
    (jnp.float32, jnp.bfloat16, True), (jnp.float32, jnp.float16, True), (jnp.bfloat16, jnp.float16, True),
    (jnp.bfloat16, jnp.float32, False), (jnp.float32, jnp.float32, False), (jnp.int32, jnp.float32, False),
])
def test_wire_cast_pins_only_casts_that_round(src, dst, pinned):
    """A rounding cast is kept behind an optimization barrier: XLA's GPU compiler would
    otherwise fold f32 -> bf16 -> f32 away (tests/test_collectives_gpu.py checks the effect)."""
    from jaxopt_train.collectives.ring import wire_cast

    x = (jnp.arange(-40, 40, dtype=jnp.float32) * 1.37).astype(src)
    jaxpr = str(jax.make_jaxpr(lambda v: wire_cast(v, dst).astype(jnp.float32))(x))
    assert ("optimization_barrier" in jaxpr) is pinned
    got = jax.jit(lambda v: wire_cast(v, dst))(x)
    assert got.dtype == jnp.dtype(dst)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x.astype(dst)))


def test_ring_all_reduce_on_1_device_is_exact_like_psum_whatever_the_wire():
    """Nothing travels on 1 device, yet a narrower wire_dtype used to round the result
    (f32 data came back bf16-rounded) where lax.psum returns the input unchanged."""
    mesh1 = jax.make_mesh((1,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:1])
    mesh1x1 = jax.make_mesh((1, 1), ("a", "b"), axis_types=(AUTO, AUTO), devices=jax.devices()[:1])
    x = jnp.float32(1.0) + jnp.arange(7, dtype=jnp.float32) * 2.0**-12  # not bf16-representable
    wire = jnp.bfloat16

    def body(v):
        return {"ring": ring_all_reduce(v, "data", wire_dtype=wire),
                "bidir": ring_all_reduce(v, "data", wire_dtype=wire, bidirectional=True, num_chunks=2),
                "grouped": grouped_all_reduce(v, "data", 1, wire_dtype=wire),
                "ref": lax.psum(v, "data")}

    out = _smap(body, mesh1, P("data"), P("data"))(x)
    hier = _smap(lambda v: (hierarchical_all_reduce(v, "b", "a", wire_dtype=wire), lax.psum(v, ("a", "b"))),
                 mesh1x1, P(("a", "b")), P(("a", "b")))(x)
    for key, got in list(out.items()) + [("hier", hier[0]), ("hier_ref", hier[1])]:
        assert got.dtype == jnp.float32, key
        np.testing.assert_array_equal(np.asarray(got), np.asarray(out["ref"]), err_msg=key)
    np.testing.assert_array_equal(np.asarray(out["ref"]), np.asarray(x))
    with pytest.raises(TypeError, match="wire_dtype=int8 cannot carry float32 data"):  # still validated
        _smap(lambda v: ring_all_reduce(v, "data", wire_dtype=jnp.int8), mesh1, P("data"), P("data")).trace(x)


def test_numpy_integer_group_size_and_num_chunks_are_ints():
    """np.int64(2) (e.g. from mesh arithmetic) was refused as "group_size=np.int64(2) must be a
    positive divisor of the size 4", though it is one; ring_order= already took numpy integers."""
    mesh4 = jax.make_mesh((4,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:4])
    two = np.int64(2)

    def body(v):
        return {"grouped": grouped_all_reduce(v, "data", two, num_chunks=two),
                "tree": all_reduce_tree(v, "data", method="hierarchical", group_size=two, num_chunks=two),
                "ring": ring_all_reduce(v, "data", num_chunks=np.int32(3)), "ref": lax.psum(v, "data")}

    x = _inputs(mesh4, "data", 3, 5, jnp.float32, integer_valued=True)
    out = _smap(body, mesh4, P("data"), P("data"))(x)
    for key in ("grouped", "tree", "ring"):
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(out["ref"]), err_msg=key)


def test_to_varying_is_a_no_op_outside_shard_map_as_documented():
    """_typed_sharding says its helpers are no-ops outside shard_map; to_varying used to call
    lax.pcast there (no axis bound, or a vmap axis) and raise "should be called under jax.shard_map"."""
    from jaxopt_train._typed_sharding import to_varying, varying_axes

    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    assert to_varying(x, "data") is x
    got = jax.vmap(lambda v: to_varying(v, "i") + lax.psum(v, "i"), axis_name="i")(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x + x.sum(0)))
    mesh = _mesh((2, 4), ("a", "b"))  # inside shard_map it still casts, and only to the mesh's axes
    seen = {}

    def body(v):
        seen["vma"] = varying_axes(to_varying(jax.vmap(lambda r: to_varying(r, ("b", "j")), axis_name="j")(v), "b"))
        return v

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a")))(jnp.zeros((4, 3)))
    assert seen["vma"] == {"a", "b"}
