"""all_reduce_tree: methods, bucketing, compression with error feedback, ring topology."""

import math
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.collectives import (
    all_reduce_tree,
    describe_ring,
    init_error_feedback,
    plan_buckets,
    ring_order,
)
from jaxopt_train.collectives._axis import check_ring_order
from jaxopt_train.collectives.compression import INT8_BLOCK, ErrorFeedbackState, decode, encode

N = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _smap(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def _tree(mesh, integer_valued, seed=0):
    """Per-device gradient-like leaves (leading axis N*k sharded over "data") of mixed shapes and dtypes."""
    keys = jax.random.split(jax.random.key(seed), 4)
    draw = ((lambda k, s: jax.random.randint(k, s, -6, 7).astype(jnp.float32)) if integer_valued
            else (lambda k, s: jax.random.normal(k, s, jnp.float32)))
    tree = {"embed": draw(keys[0], (N * 4, 9)), "layers": [draw(keys[1], (N * 3, 5, 2)),
                                                          draw(keys[2], (N,)).astype(jnp.bfloat16)],
            "count": jnp.arange(N * 2, dtype=jnp.int32)}
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


CASES = [("psum", 25.0), ("ring", 0.0), ("ring", 25.0), ("ring_bidir", 25.0), ("hierarchical", 1e-4)]


@pytest.fixture(scope="module")
def tree_fns(mesh):
    def body(tree):
        out = {f"{m}/{b}": all_reduce_tree(tree, "data", method=m, bucket_mb=b,
                                           group_size=4 if m == "hierarchical" else None) for m, b in CASES}
        out["ref"] = lax.psum(tree, "data")
        out["abs"] = lax.psum(jax.tree.map(lambda x: jnp.abs(x).astype(jnp.float32), tree), "data")
        return out
    return _smap(body, mesh, P("data"), P("data"))


def test_all_reduce_tree_methods_and_bucket_sizes(mesh, tree_fns):
    out = tree_fns(_tree(mesh, integer_valued=False))
    eps = {jnp.dtype(jnp.float32): 2.0**-23, jnp.dtype(jnp.bfloat16): 2.0**-7, jnp.dtype(jnp.int32): 0.0}
    for case in (f"{m}/{b}" for m, b in CASES):
        for got, ref, mag in zip(jax.tree.leaves(out[case]), jax.tree.leaves(out["ref"]),
                                 jax.tree.leaves(out["abs"])):
            assert got.dtype == ref.dtype and got.shape == ref.shape, case
            err = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32))
            assert np.all(err <= N * eps[ref.dtype] * np.asarray(mag)), (case, err.max())


def test_bucket_size_never_changes_exact_sums(mesh, tree_fns):
    """With exactly representable data every method and bucket size gives psum's bits."""
    out = tree_fns(_tree(mesh, integer_valued=True, seed=1))
    for case in (f"{m}/{b}" for m, b in CASES):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                                np.asarray(b, np.float32), err_msg=case),
                     out[case], out["ref"])


def test_plan_buckets_reverse_order_small_first_and_dtype_groups():
    mib = 1 << 20
    f32 = lambda n_bytes: SimpleNamespace(shape=(n_bytes // 4,), dtype=jnp.float32)  # noqa: E731
    leaves = [f32(mib // 2), f32(mib // 2), SimpleNamespace(shape=(8,), dtype=jnp.bfloat16), f32(3 * mib),
              f32(mib // 2), f32(mib // 2)]
    buckets = plan_buckets(leaves, bucket_mb=2, first_bucket_mb=1)
    assert [b.leaf_indices for b in buckets] == [(5, 4), (3,), (2,), (1, 0)]
    assert buckets[0].nbytes == mib and buckets[1].nbytes == 3 * mib  # big leaf alone, never split
    assert sorted(i for b in buckets for i in b.leaf_indices) == list(range(len(leaves)))
    assert [len(b.leaf_indices) for b in plan_buckets(leaves, 0)] == [1] * 6
    assert len(plan_buckets(leaves, math.inf, math.inf)) == 2  # one per dtype
    with pytest.raises(ValueError, match="first_bucket_mb=-1 must be >= 0"):
        plan_buckets(leaves, 1, -1)


def test_plan_buckets_inf_is_one_bucket_per_dtype_by_default():
    """The documented math.inf: the default small first bucket must not split it in two."""
    f32 = lambda n_bytes: SimpleNamespace(shape=(n_bytes // 4,), dtype=jnp.float32)  # noqa: E731
    leaves = [f32(1 << 20), SimpleNamespace(shape=(8,), dtype=jnp.bfloat16), f32(1 << 20), f32(1 << 20)]
    buckets = plan_buckets(leaves, math.inf)
    assert [b.leaf_indices for b in buckets] == [(3, 2, 0), (1,)]
    assert len(plan_buckets(leaves, math.inf, first_bucket_mb=1)) == 3  # an explicit cap still applies
    with pytest.raises(TypeError, match="bucket_mb='25' must be a number of MiB"):
        plan_buckets(leaves, "25")
    with pytest.raises(TypeError, match="first_bucket_mb=True must be a number of MiB"):
        plan_buckets(leaves, 25, True)


def _compressed_step(mesh, codec, method, feedback):
    def body(g, err):
        state = init_error_feedback([g]) if not feedback else type(init_error_feedback(g))([err])
        summed, new = all_reduce_tree([g], "data", method=method, compression=codec, error_state=state)
        return summed[0], new.error[0] if feedback else err
    return _smap(body, mesh, (P("data"), P("data")), (P(), P("data")))


@pytest.mark.parametrize("codec, method", [("int8", "psum"), ("int8", "ring"), ("bf16", "ring"),
                                           ("bf16", "psum")])
def test_compression_error_within_documented_bound(mesh, codec, method):
    size = 3 * INT8_BLOCK + 17  # padded blocks too
    g = jax.random.normal(jax.random.key(5), (N, size), jnp.float32) * jnp.linspace(0.01, 3.0, size)
    err0 = jnp.zeros_like(g)
    fn = _compressed_step(mesh, codec, method, feedback=True)
    got, _ = fn(g, err0)
    true = np.asarray(g, np.float64).sum(0)
    err = np.abs(np.asarray(got, np.float64) - true)
    if codec == "int8":  # per element: sum_j s_j/2 + s_sum/2, with s <= max|block| / 127
        absg = np.abs(np.asarray(g, np.float64))
        pad = -size % (N * INT8_BLOCK)
        blocks = lambda a: np.repeat(np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]).reshape(  # noqa: E731
            a.shape[:-1] + (-1, INT8_BLOCK)).max(-1), INT8_BLOCK, -1)[..., :size]
        bound = (blocks(absg).sum(0) + blocks(np.abs(true)[None])[0]) / 254 * (1 + 1e-5) + 1e-6
    else:
        bound = 2.0**-8 * (np.abs(np.asarray(g, np.float64)).sum(0) + np.abs(true)) * (1 + 1e-5) + 1e-6
    assert np.all(err <= bound), (err / bound).max()
    assert err.max() > 0  # the wire really was compressed


def test_int8_encode_keeps_a_non_finite_block_non_finite():
    x = jnp.zeros((3, INT8_BLOCK), jnp.float32).at[0, 5].set(jnp.inf).at[1, 7].set(jnp.nan).at[2].set(1.0)
    got = np.asarray(decode(encode(x, "int8"), "int8"))
    assert np.isnan(got[:2]).all()  # the whole block: its scale is NaN
    np.testing.assert_allclose(got[2], 1.0, rtol=1e-6)  # other blocks untouched


@pytest.mark.parametrize("method, bad", [("ring", np.inf), ("ring", np.nan), ("psum", np.inf)])
def test_int8_non_finite_input_gives_a_non_finite_sum_on_4_devices(method, bad):
    """An overflow must reach the loss scaler's finite check (it used to come out as finite zeros),
    and keeping the previous error state on that step (as train.step does) leaves later steps exact."""
    n, size = 4, 4 * 2 * INT8_BLOCK  # each device's chunk holds two int8 blocks
    mesh4 = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    fn = _smap(lambda g, e: _int8_with_feedback(g, e, method), mesh4, (P("data"), P("data")),
               (P("data"), P("data")))
    g = np.ones((n, size), np.float32)
    g[1, 3] = bad
    err0 = jnp.zeros((n, size), jnp.float32)
    got, _ = (np.asarray(a) for a in fn(jnp.asarray(g), err0))
    assert np.isnan(got[:, :INT8_BLOCK]).all()  # the block holding the bad element, on every device
    np.testing.assert_allclose(got[:, INT8_BLOCK:], n, rtol=1e-5)  # the rest is still the sum
    later, _ = (np.asarray(a) for a in fn(jnp.ones((n, size), jnp.float32), err0))
    np.testing.assert_allclose(later, n, rtol=1e-5)


def _int8_with_feedback(g, err, method):
    summed, new = all_reduce_tree([g[0]], "data", method=method, compression="int8",
                                  error_state=ErrorFeedbackState([err[0]]))
    return summed[0][None], new.error[0][None]


def test_error_feedback_keeps_accumulated_error_bounded(mesh):
    """Same gradient T times: without feedback the error grows like T, with feedback it stays one step's."""
    steps = 5
    g = jax.random.normal(jax.random.key(6), (N, 2 * INT8_BLOCK), jnp.float32) * 0.37
    true = np.asarray(g, np.float64).sum(0)
    totals = {}
    for feedback in (False, True):
        fn = _compressed_step(mesh, "int8", "psum", feedback)
        err, total = jnp.zeros_like(g), 0.0
        for _ in range(steps):
            got, err = fn(g, err)
            total = total + np.asarray(got, np.float64)
        totals[feedback] = np.abs(total - steps * true).max()
        one_step = np.abs(np.asarray(fn(g, jnp.zeros_like(g))[0], np.float64) - true).max()
    assert totals[False] > 0.5 * steps * one_step
    assert totals[True] <= 2 * one_step
    assert totals[True] < totals[False] / 2


def test_compressed_training_converges_like_uncompressed(mesh):
    """Data-parallel SGD on linear regression: int8/bf16 with error feedback end within 5% of the f32 loss."""
    dim, per_device, steps, lr = 64, 16, 100, 0.25
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    w_true = jax.random.normal(k1, (dim,), jnp.float32)
    x = jax.random.normal(k2, (N * per_device, dim), jnp.float32)
    y = x @ w_true + 0.1 * jax.random.normal(k3, (N * per_device,), jnp.float32)
    loss = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)  # noqa: E731

    def train(codec):
        def body(xb, yb):
            w = jnp.zeros((dim,), jnp.float32)
            state = init_error_feedback(w)

            def step(carry, _):
                w, state = carry
                g = jax.grad(loss)(w, xb, yb)
                if codec is None:
                    g = all_reduce_tree(g, "data", method="psum")
                else:
                    g, state = all_reduce_tree(g, "data", method="psum", compression=codec, error_state=state)
                return (w - lr * g / N, state), None

            (w, _), _ = lax.scan(step, (w, state), None, length=steps)
            return lax.pmean(loss(w, xb, yb), "data")
        return float(_smap(body, mesh, (P("data"), P("data")), P())(x, y))

    base = train(None)
    assert base < 0.05  # it did converge (noise variance 0.01)
    for codec in ("bf16", "int8"):
        assert abs(train(codec) - base) <= 0.05 * base, codec


def test_ring_order_groups_processes_and_snakes_tpu_coords():
    gpus = [SimpleNamespace(id=i, process_index=1 - i // 4, platform="cpu") for i in range(8)]
    assert ring_order(gpus) == (4, 5, 6, 7, 0, 1, 2, 3)
    tpus = [SimpleNamespace(id=i, process_index=0, coords=(i % 2, i // 2, 0), core_on_chip=0) for i in range(4)]
    assert ring_order(tpus) == (0, 1, 3, 2)  # (0,0) (1,0) (1,1) (0,1): every hop one link
    assert ring_order(gpus, override=[7, 6, 5, 4, 3, 2, 1, 0]) == (7, 6, 5, 4, 3, 2, 1, 0)
    with pytest.raises(ValueError, match="must be a permutation of 0..7"):
        ring_order(gpus, override=[0, 0, 1, 2, 3, 4, 5, 6])
    text = describe_ring(gpus, ring_order(gpus))
    assert text.startswith("ring over 8 devices (2 processes, 2 cross-process hops)")
    assert text.count("(cross-process)") == 2
    assert describe_ring(gpus[:1]).startswith("ring over 1 device (1 process, 0 cross-process hops)")


def _hops(a, b):
    return sum(abs(p - q) for p, q in zip(a.coords, b.coords))


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 3, 4), (4, 4, 1), (1, 1, 1), (3, 3, 3), (3, 2, 1),
                                   (1, 5, 2), (2, 1, 3), (4, 2, 2)])
@pytest.mark.parametrize("cores", [1, 2])
def test_tpu_snake_moves_one_hop_per_step(shape, cores):
    """y never reversed between z layers: on 2x2x2 (0,1,0)->(0,0,1) was 2 hops, and so was the wrap."""
    X, Y, Z = shape
    # A host's block need not start at coordinate 0; list the devices shuffled so the order is ours.
    cells = [(x + 2, y, z + 1, c) for z in range(Z) for y in range(Y) for x in range(X) for c in range(cores)]
    cells = [cells[i] for i in np.random.default_rng(sum(shape)).permutation(len(cells))]
    tpus = [SimpleNamespace(id=i, process_index=0, coords=(x, y, z), core_on_chip=c)
            for i, (x, y, z, c) in enumerate(cells)]
    ring = [tpus[i] for i in ring_order(tpus)]
    steps = [_hops(a, b) + (a.coords == b.coords) for a, b in zip(ring, ring[1:])]
    assert steps == [1] * (len(ring) - 1), [d.coords for d in ring]  # the next chip, or this chip's next core
    wrap = (Z - 1) + (Y - 1 if Z % 2 else 0) + (X - 1 if Y * Z % 2 else 0)  # as _snake_keys documents
    assert _hops(ring[-1], ring[0]) == wrap


@pytest.mark.parametrize("order", [[0, 1, 9], [0, 1, 1, 2], [0, 1, 2], ["a", 1, 2, 3]])
def test_describe_ring_refuses_an_order_that_is_not_a_permutation(order):
    devices = [SimpleNamespace(id=i, process_index=0) for i in range(4)]
    with pytest.raises(ValueError, match=r"order=.* must be a permutation of 0..3 \(one index per device\)"):
        describe_ring(devices, order)


def test_ring_order_on_real_devices_is_a_permutation():
    devices = jax.devices()
    order = ring_order(devices)
    assert sorted(order) == list(range(len(devices)))
    assert "ring over 8 devices" in describe_ring(devices, order)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
@pytest.mark.parametrize("method", ["psum", "ring", "hierarchical"])
def test_compression_on_an_axis_of_1_device_is_exact_like_psum(codec, method):
    """Nothing travels on 1 device: the sum used to be encoded (twice) anyway, losing up to
    one int8 step per element where lax.psum returns the input unchanged."""
    mesh1 = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    size = INT8_BLOCK + 37
    g = jax.random.normal(jax.random.key(13), (1, size), jnp.float32) * jnp.linspace(0.01, 3.0, size)
    err0 = 0.01 * jax.random.normal(jax.random.key(14), (1, size), jnp.float32)

    def body(g, err):
        summed, new = all_reduce_tree({"w": g[0], "h": g[0, :7].astype(jnp.bfloat16)}, "data", method=method,
                                      compression=codec, error_state=init_error_feedback({"w": g[0], "h": g[0, :7]}))
        carried, new_carried = all_reduce_tree([g[0]], "data", method=method, compression=codec,
                                               error_state=ErrorFeedbackState([err[0]]))
        return summed["w"], summed["h"], lax.psum(g[0], "data"), carried[0], new_carried.error[0]

    w, h, ref, carried, new_carried = _smap(body, mesh1, (P("data"), P("data")), P("data"))(g, err0)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(g[0, :7].astype(jnp.bfloat16)))
    # The carried error is delivered whole, and nothing is left to carry.
    np.testing.assert_array_equal(np.asarray(carried), np.asarray(g[0] + err0[0]))
    np.testing.assert_array_equal(np.asarray(new_carried), np.zeros(size, np.float32))


@pytest.mark.parametrize("num_replicas", [2.5, "8", True, 0, -1, np.float32(8)])
def test_init_error_feedback_refuses_a_replica_count_that_is_not_a_positive_int(num_replicas):
    # int() used to truncate 2.5 to 2 and accept "8" and True: the wrong leading axis failed later in shard_map.
    with pytest.raises(ValueError, match=r"num_replicas=.* must be None or a positive int"):
        init_error_feedback({"w": jnp.zeros((3,), jnp.float32)}, num_replicas=num_replicas)
    assert init_error_feedback({"w": jnp.zeros((3,))}, num_replicas=np.int64(2)).error["w"].shape == (2, 3)


def test_int8_bucketing_changes_the_rounding_as_documented(mesh):
    """The docstring said bucket size never changes an element's sum; with int8 a small leaf
    sharing a block with a large one is quantised in the large one's steps."""
    small = jax.random.normal(jax.random.key(15), (N, 100), jnp.float32) * 0.01
    large = jax.random.normal(jax.random.key(16), (N, 100), jnp.float32) * 100

    def body(a, b):
        tree = {"a": a[0], "b": b[0]}
        return [all_reduce_tree(tree, "data", compression="int8", bucket_mb=mb)["a"][None] for mb in (0, 25)]

    alone, packed = (np.asarray(v)[0] for v in _smap(body, mesh, (P("data"), P("data")), P("data"))(small, large))
    true = np.asarray(small, np.float64).sum(0)
    assert np.abs(alone - true).max() < 0.05 * np.abs(true).max()  # its own int8 steps
    assert np.abs(packed - true).max() > 0.5 * np.abs(true).max()  # one step of the large leaf's scale
    doc = " ".join(all_reduce_tree.__doc__.split())
    assert "Without compression bucket size changes only which elements travel together" in doc
    assert "With \"int8\" it also changes the rounding" in doc


def test_init_error_feedback_shapes():
    params = {"w": jnp.zeros((3, 4), jnp.bfloat16), "b": jnp.zeros((4,), jnp.float32)}
    state = init_error_feedback(params)
    assert state.error["w"].shape == (3, 4) and state.error["w"].dtype == jnp.float32
    stacked = init_error_feedback(params, num_replicas=N)  # sharded P("data"): (1, 3, 4) per device
    assert stacked.error["w"].shape == (N, 3, 4) and stacked.error["b"].shape == (N, 4)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compression_on_2_devices_is_one_exchange_with_local_error_feedback(codec):
    """On 2 devices both add the same two decoded vectors; each keeps only its own encoding error."""
    mesh2 = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    size = 2 * INT8_BLOCK + 17  # a padded int8 block too
    k1, k2 = jax.random.split(jax.random.key(8))
    g = jax.random.normal(k1, (2, size), jnp.float32) * jnp.linspace(0.01, 3.0, size)
    err0 = 0.01 * jax.random.normal(k2, (2, size), jnp.float32)

    def body(g, err):
        summed, new = all_reduce_tree([g], "data", method="ring", compression=codec,
                                      error_state=ErrorFeedbackState([err]))
        return summed[0], new.error[0]

    fn = _smap(body, mesh2, (P("data"), P("data")), (P("data"), P("data")))
    hlo = fn.lower(g, err0).compile().as_text()
    assert len(re.findall(r"collective-permute(?:-start)?\(", hlo)) == (1 if codec == "bf16" else 2)  # q + scales
    got, err1 = (np.asarray(a) for a in fn(g, err0))
    np.testing.assert_array_equal(got[0], got[1])  # bit-identical on both devices
    v = np.asarray(g + err0)
    padded = jnp.pad(v, ((0, 0), (0, -size % INT8_BLOCK)))
    sent = np.asarray(decode(encode(padded, codec), codec))[:, :size]
    ulps = lambda a: 4 * np.finfo(np.float32).eps * np.abs(a) + 1e-30  # noqa: E731 (FMA contraction)
    assert np.all(np.abs(err1 - (v - sent)) <= ulps(v))  # what this device's encoding lost, nothing else
    assert np.all(np.abs(got[0] - (sent[0] + sent[1])) <= ulps(np.abs(sent).sum(0)))
    true = v.astype(np.float64).sum(0)
    if codec == "int8":  # sum_j s_j / 2: one encoding per device, the sum is not re-encoded
        blocks = np.abs(np.asarray(padded, np.float64)).reshape(2, -1, INT8_BLOCK).max(-1)
        bound = np.repeat(blocks, INT8_BLOCK, -1)[:, :size].sum(0) / 254 * (1 + 1e-5) + 1e-6
    else:
        bound = 2.0**-8 * np.abs(v.astype(np.float64)).sum(0) * (1 + 1e-5) + 1e-6
    assert np.all(np.abs(got[0] - true) <= bound) and np.abs(got[0] - true).max() > 0


@pytest.mark.parametrize("method", ["ring", "ring_bidir", "hierarchical"])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_num_chunks_with_compression_is_refused_not_ignored(mesh, method, codec):
    # The compressed exchange sends each float bucket whole; num_chunks used to be dropped silently.
    fn = _smap(lambda g: all_reduce_tree({"w": g}, "data", method=method, compression=codec, num_chunks=4,
                                         group_size=4 if method == "hierarchical" else None),
               mesh, P("data"), P("data"))
    with pytest.raises(ValueError, match=f"got num_chunks=4 with compression='{codec}' "
                                         r"\(drop num_chunks or compression\)"):
        fn(jnp.ones((N, 16), jnp.float32))
    # Without compression the same call is accepted and exact.
    ok = _smap(lambda g: all_reduce_tree({"w": g}, "data", method=method, num_chunks=4,
                                         group_size=4 if method == "hierarchical" else None),
               mesh, P("data"), P("data"))
    np.testing.assert_array_equal(np.asarray(ok(jnp.ones((N, 16), jnp.float32))["w"]), np.full((N, 16), N))


@pytest.mark.parametrize("method", ["psum", "ring", "hierarchical"])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_list_axis_name_under_compression_is_the_name(mesh, method, codec):
    # ["data"] used to reach lax.all_to_all / ppermute unhashable and fail there.
    g = jax.random.normal(jax.random.key(11), (N, 3 * INT8_BLOCK), jnp.float32)
    run = lambda axis: _smap(lambda x: all_reduce_tree(x, axis, method=method, compression=codec),  # noqa: E731
                             mesh, P("data"), P("data"))(g)
    np.testing.assert_array_equal(np.asarray(run(["data"])), np.asarray(run("data")))


@pytest.mark.parametrize("axis", [["a", "b"], ("a", "b")])
def test_compression_over_two_axes_is_refused_for_a_list_too(axis):
    mesh2 = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fn = _smap(lambda x: all_reduce_tree(x, axis, compression="int8"), mesh2, P(("a", "b")), P(("a", "b")))
    with pytest.raises(ValueError, match=r"compression runs over one axis; got axis_name=\('a', 'b'\)"):
        fn.trace(jnp.ones((N, 16), jnp.float32))


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_group_size_with_compression_is_refused_not_ignored(mesh, codec):
    # The float buckets went over the flat ring whatever group_size said.
    fn = _smap(lambda g: all_reduce_tree(g, "data", method="hierarchical", compression=codec, group_size=2),
               mesh, P("data"), P("data"))
    with pytest.raises(ValueError, match=f"got group_size=2 with compression='{codec}' "
                                         r"\(drop group_size or compression\)"):
        fn.trace(jnp.ones((N, 16), jnp.float32))
    # group_size alone, or compression alone, is accepted.
    for kwargs in ({"group_size": 2}, {"compression": codec}):
        ok = _smap(lambda g: all_reduce_tree(g, "data", method="hierarchical", **kwargs), mesh, P("data"), P("data"))
        np.testing.assert_allclose(np.asarray(ok(jnp.ones((N, 16), jnp.float32))), N)


@pytest.mark.parametrize("order", [[1.0, 0.0, 2.0], [2.9, 0.1, 1], [True, False, 2], "102", b"\x01\x00\x02", 3])
def test_topology_refuses_what_ring_order_refuses(order):
    # int(i) used to truncate floats and pass bools and digit strings in ring_order / describe_ring.
    devices = [SimpleNamespace(id=i, process_index=0) for i in range(3)]
    messages = []
    for call, name in [(lambda: ring_order(devices, override=order), "override"),
                       (lambda: describe_ring(devices, order), "order"),
                       (lambda: check_ring_order(order, 3), "ring_order")]:
        with pytest.raises(ValueError) as info:
            call()
        messages.append(str(info.value).removeprefix(f"{name}="))
    assert messages[0] == messages[1] == messages[2]
    assert messages[0].endswith("must be a permutation of 0..2 (one index per device), a sequence of ints")
    assert ring_order(devices, override=np.array([2, 0, 1])) == (2, 0, 1)  # numpy integers are ints


def test_compressed_psum_is_typed_varying_as_documented(mesh):
    """No public all_gather_invariant in this JAX: the compressed psum stays typed varying, as documented."""
    g = jax.random.normal(jax.random.key(12), (N, 300), jnp.float32)
    strict = lambda out_specs: jax.jit(jax.shard_map(  # noqa: E731 (check_vma on, as users run it)
        lambda x: all_reduce_tree(x[0], "data", compression="int8"), mesh=mesh, in_specs=P("data"),
        out_specs=out_specs))
    with pytest.raises(ValueError, match="could not infer replication"):
        strict(P())(g)
    rows = np.asarray(strict(P("data"))(g)).reshape(N, -1)  # the documented spec works, every row the same
    assert (rows == rows[0]).all()
    assert "every method with `compression`" in all_reduce_tree.__doc__
    assert '`out_specs=P()` fails with "could not infer replication"' in all_reduce_tree.__doc__


def test_nvlink_counts_ask_nvml_for_the_gpus_cuda_visible_devices_maps_to(monkeypatch):
    """NVML numbers every GPU of the host: under CUDA_VISIBLE_DEVICES=2,3 JAX's GPUs 0 and 1
    are NVML's 2 and 3 (it asked for 0 and 1, other GPUs' links)."""
    import sys
    import types

    from jaxopt_train.collectives.topology import nvlink_counts

    asked = []
    links = {2: [3, 3], 3: [2]}  # NVML index -> the NVML index each active link leads to

    class Bus:
        def __init__(self, index):
            self.busId = f"0000:{index:02x}:00.0"

    def handle(index):
        asked.append(index)
        return index

    def remote(h, link):
        return Bus(links[h][link])

    nvml = types.SimpleNamespace(
        NVMLError=RuntimeError, NVML_NVLINK_MAX_LINKS=4, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=handle, nvmlDeviceGetPciInfo=Bus,
        nvmlDeviceGetNvLinkState=lambda h, link: link < len(links.get(h, [])),
        nvmlDeviceGetNvLinkRemotePciInfo=remote)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    devices = [SimpleNamespace(platform="gpu", id=i, local_hardware_id=i) for i in range(2)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvlink_counts(devices) == [[0, 2], [1, 0]]
    assert asked == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0f3c,GPU-1a2b")  # cannot be mapped: no guess
    assert nvlink_counts(devices) is None and asked == [2, 3]


@pytest.mark.parametrize("method", ["ring", "ring_bidir", "hierarchical"])
def test_an_f32_wire_sums_bf16_buckets_as_exactly_as_psum(mesh, method):
    """bf16 gradients on their own wire round at every hop (as NCCL's ring does);
    wire_dtype=f32 rounds once, at the end, as psum of the f32 values does."""
    keys = jax.random.split(jax.random.key(5), 3)
    tree = {"g": jax.random.normal(keys[0], (N * 64, 33), jnp.float32).astype(jnp.bfloat16),
            "w": jax.random.normal(keys[1], (N * 5,), jnp.float32),
            "count": jax.random.randint(keys[2], (N * 3,), -2**20, 2**20, jnp.int32)}
    tree = jax.device_put(tree, NamedSharding(mesh, P("data")))
    group = {"group_size": 4} if method == "hierarchical" else {}

    def body(t):
        exact = lax.psum(t["g"].astype(jnp.float32), "data").astype(jnp.bfloat16)
        return (all_reduce_tree(t, "data", method=method, wire_dtype=jnp.float32, **group),
                all_reduce_tree(t, "data", method=method, **group), exact, lax.psum(t, "data"))
    wide, narrow, exact, ref = _smap(body, mesh, P("data"), P("data"))(tree)
    assert wide["g"].dtype == jnp.bfloat16 and wide["count"].dtype == jnp.int32
    same = lambda a, b: np.mean(np.asarray(a, np.float32) == np.asarray(b, np.float32))  # noqa: E731
    # f32 partial sums differ from psum's only in summation order: a tie rounds another way, rarely
    assert same(wide["g"], exact) > 0.995
    assert same(narrow["g"], exact) < 0.9  # the default bf16 wire: ~half the elements off by an ulp or more
    np.testing.assert_array_equal(np.asarray(wide["count"]), np.asarray(ref["count"]))
    np.testing.assert_allclose(np.asarray(wide["w"]), np.asarray(ref["w"]), rtol=1e-6, atol=1e-6)


def test_a_bf16_wire_halves_f32_precision_not_the_result_dtype(mesh):
    x = jax.device_put(jax.random.normal(jax.random.key(6), (N * 16, 8), jnp.float32),
                       NamedSharding(mesh, P("data")))
    got, ref, mag = _smap(lambda g: (all_reduce_tree(g, "data", method="ring", wire_dtype=jnp.bfloat16),
                                     lax.psum(g, "data"), lax.psum(jnp.abs(g), "data")),
                          mesh, P("data"), P("data"))(x)
    assert got.dtype == jnp.float32
    err = np.abs(np.asarray(got) - np.asarray(ref))
    assert err.max() > 0 and np.all(err <= N * 2.0**-8 * np.asarray(mag))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(method="psum", wire_dtype=jnp.float32), ValueError, r"got wire_dtype=.*method='psum'"),
    (dict(method="ring", compression="bf16", wire_dtype=jnp.float32), ValueError, "compression='bf16'"),
    (dict(method="ring", wire_dtype=jnp.int32), TypeError, "wire_dtype=int32 must be a floating dtype"),
    (dict(method="ring", wire_dtype="fp32x"), TypeError, "'fp32x' is not a dtype; expected a floating one"),
])
def test_a_wire_dtype_that_would_be_ignored_or_cannot_carry_floats_is_refused(mesh, kwargs, error, match):
    fn = _smap(lambda g: all_reduce_tree(g, "data", **kwargs), mesh, P("data"), P("data"))
    with pytest.raises(error, match=match):
        fn.trace(jnp.ones((N, 16), jnp.float32))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("method", ["psum", "ring"])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compressed_all_reduce_differentiates_as_the_exact_sum(n, method, codec):
    """Straight through: d sum(w * all_reduce(x)) / dx = sum of w over the devices, as for
    psum. Through the int8 codec autodiff gave 0 for all but each block's largest element."""
    mesh_n = jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.key(7), (n, 3 * INT8_BLOCK // 2), jnp.float32)
    w = jax.random.normal(jax.random.key(8), x.shape, jnp.float32)

    def grads(compression):
        def body(x, w):
            return jax.grad(lambda x: jnp.sum(w * all_reduce_tree(x, "i", method=method,
                                                                  compression=compression)))(x)
        return np.asarray(_smap(body, mesh_n, (P("i"), P("i")), P("i"))(x, w))
    want = np.broadcast_to(np.asarray(w).sum(0), x.shape)
    np.testing.assert_allclose(grads(None), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads(codec), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compression_on_one_device_keeps_float64_exact(codec):
    mesh1 = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.enable_x64(True):
        x = jnp.full((1, 3 * INT8_BLOCK), 1 + 2**-40, jnp.float64)
        got = _smap(lambda v: all_reduce_tree(v, "i", compression=codec), mesh1, P("i"), P("i"))(x)
        assert got.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x))  # it was rounded to f32's 1.0


@pytest.mark.parametrize("per_process, n, want", [
    ([4, 4], 8, 4),  # one group per process
    ([4, 2], 6, 6),  # unequal hosts: the flat ring, the same on both (each took its own count)
    ([2, 4], 6, 6),
    ([8], 8, 8),     # one process: one group
    ([4, 4], 6, 6),  # 4 does not split 6
])
def test_the_default_hierarchical_group_is_the_same_on_every_process(monkeypatch, per_process, n, want):
    from types import SimpleNamespace

    from jaxopt_train.collectives import tree as tree_mod

    fake = [SimpleNamespace(process_index=p) for p, count in enumerate(per_process) for _ in range(count)]
    monkeypatch.setattr(tree_mod.jax, "devices", lambda *a: fake)
    for local in per_process:  # what each process would see as its own count
        monkeypatch.setattr(tree_mod.jax, "local_device_count", lambda *a, local=local: local)
        assert tree_mod._default_group_size(n) == want


@pytest.mark.parametrize("codec, finite", [("bf16", False), ("int8", True)])
def test_a_finite_element_past_bf16_range_is_documented_as_non_finite(mesh, codec, finite):
    """3.3994e38 is a finite f32 that bf16 rounds to inf: the module docstring says so (its
    bound does not hold there); int8's f32 scale keeps it."""
    big = float(np.finfo(np.float32).max) * 0.999  # ~3.3994e38: past bf16's 3.3895e38 + half a step
    assert np.isinf(np.float32(jnp.asarray(big, jnp.float32).astype(jnp.bfloat16)))
    g = np.zeros((N, 2 * N * INT8_BLOCK), np.float32)
    g[0, 0] = big
    got, _ = _compressed_step(mesh, codec, "ring", feedback=True)(jnp.asarray(g), jnp.zeros_like(g))
    got = np.asarray(got).reshape(-1)
    assert bool(np.isfinite(got[0])) is finite
    np.testing.assert_array_equal(got[1:], 0)  # nothing else is touched
    if finite:
        np.testing.assert_allclose(got[0], big, rtol=1e-2)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_error_state_on_one_device_can_be_carried_by_a_scan(codec):
    """Under check_vma (shard_map's default) a loop carry keeps its type: on one device the new
    error used to come back typed invariant (a fresh jnp.zeros) and lax.scan refused the carry."""
    mesh1 = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    g = jax.random.normal(jax.random.key(17), (1, INT8_BLOCK + 3), jnp.float32)

    def body(g):
        def step(error_state, _):
            summed, error_state = all_reduce_tree([g[0]], "data", compression=codec, error_state=error_state)
            return error_state, summed[0]
        start = ErrorFeedbackState([jnp.zeros_like(g[0])])  # typed varying, as a P("data") input is
        _, summed = lax.scan(step, start, length=2)
        return summed[None], lax.psum(g[0], "data")[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh1, in_specs=P("data"), out_specs=P("data")))
    summed, ref = (np.asarray(a) for a in fn(g))
    np.testing.assert_array_equal(summed[0], np.broadcast_to(ref[0], summed[0].shape))


@pytest.mark.parametrize("error, got", [
    (0.0, "float"),
    (jnp.zeros((), jnp.complex64), "dtype=complex64"),  # the imaginary part was silently dropped
    (jnp.zeros((), jnp.bfloat16), "dtype=bfloat16"),  # came back f32: a scan or select_tree carry broke
    (jnp.zeros((), jnp.int32), "dtype=int32"),
])
def test_an_error_state_leaf_that_is_not_an_f32_array_is_refused(mesh, error, got):
    fn = _smap(lambda g: all_reduce_tree([g[0, 0]], "data", compression="int8",
                                         error_state=ErrorFeedbackState([error]))[0][0],
               mesh, P("data"), P())
    with pytest.raises(TypeError, match=f"error_state leaves must be float32 arrays .*; got {got}"):
        fn.trace(jnp.ones((N, 4), jnp.float32))


def test_int8_keeps_blocks_of_tiny_normal_values_within_the_bound(mesh):
    """A block whose largest |x| is under 127 * 2**-126 (~1.5e-36) had a subnormal scale,
    which XLA flushes to zero: the whole block decoded to 0 instead of psum's sum."""
    tiny = float(np.finfo(np.float32).tiny)
    g = jax.random.uniform(jax.random.key(18), (N, 2 * INT8_BLOCK), jnp.float32, 2.0, 100.0) * tiny
    got, ref = _smap(lambda x: (all_reduce_tree(x, "data", compression="int8"), lax.psum(x, "data")),
                     mesh, P("data"), P("data"))(g)
    got, ref = np.asarray(got, np.float64)[0], np.asarray(ref, np.float64)[0]
    # The documented sum_j s_j / 2 + s_sum / 2, with s = max|block| / 127 floored at 2**-126.
    scale = lambda a: max(float(np.abs(a).max()) / 127, tiny)  # noqa: E731
    bound = (N * scale(np.asarray(g)) + scale(ref)) / 2 * (1 + 1e-5)
    assert np.abs(got - ref).max() <= bound, np.abs(got - ref).max() / bound


@pytest.mark.parametrize("shape, ok", [
    ((4, 6), True), ((1, 4, 6), True),  # its own shape, or shard_map's view of init_error_feedback(p, n)
    ((6, 4), False),  # same size, transposed: was accepted and fed back into the wrong elements
    ((24,), False), ((2, 4, 6), False), ((4, 6, 1), False),
])
def test_an_error_state_leaf_must_have_its_gradient_leafs_shape(mesh, shape, ok):
    g = jax.random.normal(jax.random.key(19), (N, 4, 6), jnp.float32)
    fn = _smap(lambda g: all_reduce_tree([g[0]], "data", compression="bf16",
                                         error_state=ErrorFeedbackState([jnp.zeros(shape, jnp.float32)]))[0][0],
               mesh, P("data"), P())
    if ok:
        np.testing.assert_allclose(np.asarray(fn(g)), np.asarray(g).sum(0), rtol=2e-2, atol=5e-2)
    else:
        with pytest.raises(ValueError, match=rf"error_state leaf of shape \({shape[0]},.*does not match gradient "
                                             r"leaf of shape \(4, 6\) \(expected \(4, 6\) or \(1, 4, 6\)\)"):
            fn.trace(g)
