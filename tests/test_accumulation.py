"""Tests for jaxopt_train.accumulation against full-batch references and compiled HLO."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train import precision as prec
from jaxopt_train.accumulation import (accumulate_gradients, check_divisible,
                                       data_parallel_value_and_grad, multi_steps)

BATCH = 16


def _data(batch=BATCH, dtype=jnp.float32):
    kx, ky = jax.random.split(jax.random.key(42))
    return {"x": jax.random.normal(kx, (batch, 6), dtype), "y": jax.random.normal(ky, (batch, 3), dtype)}


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


class _LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(3)(jnp.tanh(linen.Dense(16)(x)))


def _nnx_problem():
    graphdef, state = nnx.split(_NNXMLP(nnx.Rngs(0)))

    def loss_fn(state, batch):
        out = nnx.merge(graphdef, state)(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)
    return loss_fn, state


def _linen_problem():
    module = _LinenMLP()
    variables = module.init(jax.random.key(0), jnp.zeros((1, 6)))

    def loss_fn(variables, batch):
        return jnp.mean((module.apply(variables, batch["x"]) - batch["y"]) ** 2)
    return loss_fn, variables


def _assert_trees_close(got, want, rtol, atol=0.0):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=rtol, atol=atol)


@pytest.mark.parametrize("problem", [_nnx_problem, _linen_problem], ids=["nnx", "linen"])
@pytest.mark.parametrize("num_microbatches", [1, 8])
def test_matches_full_batch(problem, num_microbatches):
    loss_fn, params = problem()
    batch = _data()
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    got_loss, got_grads = jax.jit(accumulate_gradients(loss_fn, num_microbatches))(params, batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    _assert_trees_close(got_grads, want_grads, rtol=1e-5, atol=1e-7)


def test_bf16_params_accumulate_in_f32_within_bf16_tolerance():
    loss_fn, params = _linen_problem()
    batch = _data()
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    policy = prec.get_policy("bf16-pure")
    bf16_params, bf16_batch = policy.cast_to_param(params), policy.cast_to_compute(batch)
    got_loss, got_grads = jax.jit(accumulate_gradients(loss_fn, 4))(bf16_params, bf16_batch)
    assert got_loss.dtype == jnp.bfloat16
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(got_grads))
    np.testing.assert_allclose(np.float32(got_loss), want_loss, rtol=2e-2)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=5e-2, atol=2e-2 * np.abs(w).max())


def _dropout_loss(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    h = jnp.where(keep, batch["x"], 0.0) @ params["w"]
    return jnp.mean((h - batch["y"]) ** 2)


def test_prng_key_is_split_per_microbatch():
    params = {"w": jax.random.normal(jax.random.key(1), (6, 3))}
    batch, key, k = _data(), jax.random.key(7), 4
    got_loss, got_grads = jax.jit(accumulate_gradients(_dropout_loss, k))(params, batch, key)
    # Reference: micro-batch i is rows i::K with key split(key, K)[i].
    keys = jax.random.split(key, k)
    reference = jax.jit(jax.value_and_grad(_dropout_loss))
    parts = [reference(params, jax.tree.map(lambda x: x[i::k], batch), keys[i]) for i in range(k)]
    np.testing.assert_allclose(got_loss, np.mean([float(loss) for loss, _ in parts]), rtol=1e-6)
    want_grad = sum(g["w"] for _, g in parts) / k
    np.testing.assert_allclose(got_grads["w"], want_grad, rtol=1e-5, atol=1e-7)
    # The same key for every micro-batch would give another result: the test can fail.
    same = np.mean([float(reference(params, jax.tree.map(lambda x: x[i::k], batch), key)[0])
                    for i in range(k)])
    assert not np.isclose(float(got_loss), same, rtol=1e-4)


def _aux_loss(params, batch):
    err = batch["x"] @ params["w"] - batch["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err)), "n_pos": jnp.sum(err > 0, dtype=jnp.int32)}


@pytest.mark.parametrize("combine", ["mean", "sum", "stack"])
def test_has_aux_combine(combine):
    params = {"w": jax.random.normal(jax.random.key(1), (6, 3))}
    batch, k = _data(), 4
    (want_loss, want_aux), want_grads = jax.jit(jax.value_and_grad(_aux_loss, has_aux=True))(params, batch)
    fn = accumulate_gradients(_aux_loss, k, has_aux=True, aux_combine=combine)
    (loss, aux), grads = jax.jit(fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5)
    assert aux["n_pos"].dtype == jnp.int32 and aux["mae"].dtype == jnp.float32
    if combine == "stack":
        assert aux["mae"].shape == (k,) and int(aux["n_pos"].sum()) == int(want_aux["n_pos"])
    elif combine == "mean":  # means of equal-size micro-batches = full-batch mean; counts add
        np.testing.assert_allclose(aux["mae"], want_aux["mae"], rtol=1e-5)
        assert int(aux["n_pos"]) == int(want_aux["n_pos"])
    else:
        np.testing.assert_allclose(aux["mae"], k * want_aux["mae"], rtol=1e-5)
        assert int(aux["n_pos"]) == int(want_aux["n_pos"])


def _flag_loss(params, batch):
    # Micro-batches of 2 (rows k::2): rows 0, 2 are small, rows 1, 3 are not.
    loss = jnp.mean(batch @ params["w"])
    return loss, {"all_small": jnp.all(batch < 4), "mae": jnp.mean(jnp.abs(batch))}


@pytest.mark.parametrize("combine, want", [("mean", False), ("sum", True), ("stack", [True, False])])
def test_bool_aux_is_anded_under_mean(combine, want):
    params, batch = {"w": jnp.ones(1, jnp.float32)}, jnp.asarray([[0.0], [10.0], [1.0], [10.0]])
    fn = accumulate_gradients(_flag_loss, 2, has_aux=True, aux_combine=combine)
    (_, aux), _ = jax.jit(fn)(params, batch)
    # "mean" matches the full batch's jnp.all (False); "sum" or-s, as a bool sum does.
    (_, full_aux), _ = jax.value_and_grad(_flag_loss, has_aux=True)(params, batch)
    assert aux["all_small"].dtype == jnp.bool_
    np.testing.assert_array_equal(aux["all_small"], want)
    if combine == "mean":
        assert bool(aux["all_small"]) == bool(full_aux["all_small"])


@pytest.mark.parametrize("combine", ["mean", "sum", "stack"])
def test_one_microbatch_combines_like_many(combine):
    params, batch = {"w": jnp.ones(1, jnp.float32)}, jnp.asarray([[0.0], [10.0], [1.0], [10.0]])
    (_, want), _ = jax.value_and_grad(_flag_loss, has_aux=True)(params, batch)
    fn = accumulate_gradients(_flag_loss, 1, has_aux=True, aux_combine=combine)
    (_, aux), _ = jax.jit(fn)(params, batch)
    for name in want:
        # "stack" gives a leading axis of size K = 1 (it gave none); the others the value.
        expected = np.asarray(want[name])[None] if combine == "stack" else np.asarray(want[name])
        assert aux[name].dtype == want[name].dtype and aux[name].shape == expected.shape
        np.testing.assert_array_equal(aux[name], expected)


def test_raw_prng_key_draws_a_warning():
    params, batch = {"w": jax.random.normal(jax.random.key(1), (6, 3))}, _data()
    raw = jax.random.PRNGKey(7)  # uint32[2]: indistinguishable from data, so not split
    with pytest.warns(UserWarning, match=r"position\(s\) \[0\] are uint32\[2\].*jax.random.key"):
        accumulate_gradients(_dropout_loss, 4)(params, batch, raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a typed key is split; one micro-batch needs no split
        accumulate_gradients(_dropout_loss, 4)(params, batch, jax.random.wrap_key_data(raw))
        accumulate_gradients(_dropout_loss, 1)(params, batch, raw)


def test_bad_inputs():
    params = {"w": jnp.ones((6, 3))}
    with pytest.raises(ValueError, match="batch size 16 is not divisible by num_microbatches=3"):
        accumulate_gradients(_aux_loss, 3)(params, _data())
    with pytest.raises(ValueError, match="same leading batch axis"):
        accumulate_gradients(_aux_loss, 2)(params, {"x": jnp.ones((4, 6)), "y": jnp.ones((8, 3))})
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_microbatches=.* must be a positive int"):
            accumulate_gradients(_aux_loss, bad)
    with pytest.raises(ValueError, match="aux_combine='max'.*mean"):
        accumulate_gradients(_aux_loss, 2, aux_combine="max")
    with pytest.raises(ValueError, match="accum_dtype"):
        accumulate_gradients(_aux_loss, 2, accum_dtype=jnp.int32)
    (_, _), grads = accumulate_gradients(_aux_loss, 2, accum_dtype="f32", has_aux=True)(params, _data())
    assert grads["w"].dtype == jnp.float32  # dtype names as the precision policies take them
    with pytest.raises(ValueError, match="accum_dtype='f8' is not a known dtype name"):
        accumulate_gradients(_aux_loss, 2, accum_dtype="f8")
    with pytest.raises(ValueError, match=r"the batch is empty \(leading axis 0\)"):  # was a NaN loss
        accumulate_gradients(_aux_loss, 2)(params, {"x": jnp.ones((0, 6)), "y": jnp.ones((0, 3))})
    with pytest.raises(ValueError, match="every_k=0"):
        multi_steps(optax.sgd(0.1), 0)


def test_check_divisible():
    assert check_divisible(64, 4, 8) == 2
    with pytest.raises(ValueError, match="global_batch=30 is not divisible by num_microbatches=4"):
        check_divisible(30, 4, 8)
    with pytest.raises(ValueError, match=r"micro-batch size 4 .* not divisible by num_devices=8.*32"):
        check_divisible(16, 4, 8)
    with pytest.raises(ValueError, match="num_devices=0 must be a positive int"):
        check_divisible(16, 4, 0)


# ----------------------------------------------------------------------------- token-weighted


def _masked_loss(params, batch):
    """Mean squared error over the tokens whose mask is 1: 0/0 = NaN on a micro-batch of none."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    err = jnp.sum((h @ params["w2"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def _token_weight(batch):
    return jnp.sum(batch["mask"])


def _masked_problem(batch=16, tokens=5, empty_rows=()):
    keys = jax.random.split(jax.random.key(7), 5)
    params = {"w1": jax.random.normal(keys[0], (6, 16)), "b1": jnp.zeros((16,)),
              "w2": jax.random.normal(keys[1], (16, 3))}
    lengths = jax.random.randint(keys[2], (batch,), 1, tokens + 1).at[jnp.asarray(empty_rows, int)].set(0)
    data = {"x": jax.random.normal(keys[3], (batch, tokens, 6)),
            "y": jax.random.normal(keys[4], (batch, tokens, 3)),
            "mask": (jnp.arange(tokens)[None, :] < lengths[:, None]).astype(jnp.float32)}
    return params, data


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_token_weighted_micro_batches_match_the_full_batch(num_microbatches):
    # Micro-batch 3 (rows 3, 7, 11, 15) has no tokens: its own mean is 0/0.
    params, batch = _masked_problem(empty_rows=[3, 7, 11, 15] if num_microbatches == 4 else [3])
    want_loss, want_grads = jax.jit(jax.value_and_grad(_masked_loss))(params, batch)
    fn = accumulate_gradients(_masked_loss, num_microbatches, weight_fn=_token_weight)
    loss, grads = jax.jit(fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)
    if num_microbatches > 1:  # a mean of means is NaN here, and wrong without the empty rows
        assert np.isnan(jax.jit(accumulate_gradients(_masked_loss, num_microbatches))(params, batch)[0])
        params, batch = _masked_problem()
        want = jax.value_and_grad(_masked_loss)(params, batch)[0]
        plain = accumulate_gradients(_masked_loss, num_microbatches)(params, batch)[0]
        weighted = accumulate_gradients(_masked_loss, num_microbatches, weight_fn=_token_weight)(
            params, batch)[0]
        assert abs(float(plain - want)) > 1e-3 and float(weighted) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_a_batch_of_no_tokens_is_nan_like_its_full_batch_mean(num_microbatches):
    params, batch = _masked_problem(empty_rows=list(range(16)))

    def guarded(params, batch):  # a loss that returns 0, not 0/0, for no tokens
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        err = jnp.sum((h @ params["w2"] - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1)

    for loss_fn in (_masked_loss, guarded):
        loss, grads = accumulate_gradients(loss_fn, num_microbatches, weight_fn=_token_weight)(
            params, batch)
        assert np.isnan(loss) and all(np.isnan(g).all() for g in jax.tree.leaves(grads))


def test_token_weights_do_not_overflow_a_float16_accumulator():
    # Two micro-batches of 80,000 tokens: w * g in float16 was inf (the weights too).
    params, batch = _masked_problem(batch=4, tokens=40_000)
    batch = {**batch, "mask": jnp.ones_like(batch["mask"])}
    want_loss, want_grads = jax.value_and_grad(_masked_loss)(params, batch)
    loss, grads = accumulate_gradients(_masked_loss, 2, accum_dtype="f16", weight_fn=_token_weight)(
        params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_trees_close(grads, want_grads, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_a_negative_weight_makes_the_loss_and_gradients_nan(num_microbatches):
    """A micro-batch of weight -w added nothing (its share failed `share > 0`) while the total
    counted -w, so the other micro-batches were scaled up without a word."""
    params, batch = _masked_problem()

    def weight(b):  # the micro-batch holding row 0 counts negatively, the others positively
        return jnp.where(b["mask"][0, 0] > 0, -1.0, 1.0) * jnp.sum(b["mask"])
    batch = {**batch, "mask": batch["mask"].at[:, 0].set(0.0).at[0, 0].set(1.0)}
    if num_microbatches > 1:  # one share negative, the total positive: only the new NaN tells
        weights = [float(weight(jax.tree.map(lambda x, k=k: x[k::4], batch))) for k in range(4)]
        assert weights[0] < 0 < sum(weights) and min(weights[1:]) > 0, weights
    loss, grads = jax.jit(accumulate_gradients(_masked_loss, num_microbatches, weight_fn=weight))(
        params, batch)
    assert np.isnan(loss) and all(np.isnan(g).all() for g in jax.tree.leaves(grads))


def test_weight_fn_bad_inputs():
    params, batch = _masked_problem()
    with pytest.raises(TypeError, match=r"weight_fn=3 is not callable; expected weight_fn\(batch\)"):
        accumulate_gradients(_masked_loss, 4, weight_fn=3)
    for k in (1, 4):
        with pytest.raises(ValueError, match=r"weight_fn\(batch\) must return a real scalar .* "
                                             r"it returned shape=\(\d+,\) dtype=float32"):
            accumulate_gradients(_masked_loss, k, weight_fn=lambda b: b["mask"].sum(1))(params, batch)


# ----------------------------------------------------------------------------- HLO: one all-reduce


def _computations(hlo: str) -> dict[str, str]:
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name, lines = header.group(1), []
        elif line.startswith("}") and name:
            comps[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return comps


_ALL_REDUCE = re.compile(r"\s(?:all-reduce|all-reduce-start|reduce-scatter)\(")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")


def _all_reduce_counts(hlo: str) -> tuple[int, int]:
    """(all-reduce ops in the module, those inside a while loop body)."""
    comps = _computations(hlo)
    total = sum(len(_ALL_REDUCE.findall(text)) for text in comps.values())
    todo = [b.lstrip("%") for text in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", text)]
    in_loops, seen = 0, set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        in_loops += len(_ALL_REDUCE.findall(comps[name]))
        for group in _CALLED.findall(comps[name]):
            todo += [n.strip().lstrip("%") for n in group.split(",")]
    return total, in_loops


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def sharded_problem():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    keys = jax.random.split(jax.random.key(3), 3)
    params = {"w1": jax.random.normal(keys[0], (6, 16)), "b1": jnp.zeros((16,)),
              "w2": jax.random.normal(keys[1], (16, 3))}
    batch = _data(batch=64)
    return (mesh, jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(batch, NamedSharding(mesh, P("data"))), params, batch)


def test_shard_map_step_reduces_once_after_the_scan(sharded_problem):
    mesh = sharded_problem[0]

    def shard(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))

    step = shard(data_parallel_value_and_grad(_mlp_loss, 4, "data"))
    _assert_one_reduction_and_full_batch(step, sharded_problem)


def _assert_one_reduction_and_full_batch(step, sharded_problem):
    """One all-reduce in the compiled step, none inside a loop, and the full-batch result."""
    _, sharded_params, sharded_batch, params, batch = sharded_problem
    total, in_loops = _all_reduce_counts(step.lower(sharded_params, sharded_batch).compile().as_text())
    assert (total, in_loops) == (1, 0)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_mlp_loss))(params, batch)
    loss, grads = step(sharded_params, sharded_batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_data_parallel_token_weighting_matches_the_full_batch(num_microbatches):
    # 64 rows over 8 devices: device 5 (rows 40-47) has no tokens at all.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params, batch = _masked_problem(batch=64, empty_rows=list(range(40, 48)))
    step = jax.jit(jax.shard_map(
        data_parallel_value_and_grad(_masked_loss, num_microbatches, "data", weight_fn=_token_weight),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(batch, NamedSharding(mesh, P("data"))))
    # The gradients' one all-reduce, and one of the scalar weights; none in the scan.
    assert _all_reduce_counts(step.lower(*args).compile().as_text()) == (2, 0)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_masked_loss))(params, batch)
    loss, grads = step(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)


def _recipe(num_microbatches, axis_name="data", num_devices=8):
    """The documented recipe: accumulate_gradients inside shard_map, then one psum."""
    def step(params, batch):
        loss, grads = accumulate_gradients(_mlp_loss, num_microbatches)(params, batch)
        loss, grads = jax.lax.psum((loss, grads), axis_name)
        return loss / num_devices, jax.tree.map(lambda g: g / num_devices, grads)
    return step


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_shard_map_recipe_reduces_once_and_matches_full_batch(sharded_problem, num_microbatches,
                                                              check_vma):
    # With check_vma=True (shard_map's default) replicated params used to be
    # psummed by autodiff inside every micro-batch's backward: K all-reduces in
    # the loop and, with the recipe's own psum, 8x the gradient.
    mesh = sharded_problem[0]
    step = jax.jit(jax.shard_map(_recipe(num_microbatches), mesh=mesh,
                                 in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma))
    _assert_one_reduction_and_full_batch(step, sharded_problem)


def test_shard_map_recipe_marks_only_the_batch_axes_varying(sharded_problem):
    # On a ("data", "model") mesh with the batch split over "data" only, the
    # gradients must stay invariant over "model": out_specs=P() after a psum
    # over "data" alone is then accepted by check_vma.
    _, _, _, params, batch = sharded_problem
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    sharded_params = jax.device_put(params, NamedSharding(mesh, P()))
    sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    step = jax.jit(jax.shard_map(_recipe(4, num_devices=4), mesh=mesh,
                                 in_specs=(P(), P("data")), out_specs=P()))
    total, in_loops = _all_reduce_counts(step.lower(sharded_params, sharded_batch).compile().as_text())
    assert (total, in_loops) == (1, 0)
    _, want_grads = jax.jit(jax.value_and_grad(_mlp_loss))(params, batch)
    _assert_trees_close(step(sharded_params, sharded_batch)[1], want_grads, rtol=1e-5, atol=1e-6)


def test_jit_named_sharding_step_matches_full_batch(sharded_problem):
    """Plain jit over a batch sharded on "data": correct values; XLA places the reduction.

    XLA:CPU keeps one all-reduce per micro-batch inside the loop here (measured
    with jax 0.10.2); use `data_parallel_value_and_grad` under shard_map for a
    single reduction per step.
    """
    mesh, sharded_params, sharded_batch, params, batch = sharded_problem
    step = jax.jit(accumulate_gradients(_mlp_loss, 4))
    loss, grads = step(sharded_params, sharded_batch)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_mlp_loss))(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)
    total, _ = _all_reduce_counts(step.lower(sharded_params, sharded_batch).compile().as_text())
    assert total >= 1  # the batch really is split over devices


# ----------------------------------------------------------------------------- MultiSteps


def test_multi_steps_with_loss_scaled_grads_matches_full_batch_sgd():
    loss_fn, params = _linen_problem()
    batch, k, lr = _data(), 4, 0.1
    optimizer = multi_steps(optax.sgd(lr), k)
    scale = prec.DynamicLossScale(initial_scale=2.0**10)

    @jax.jit
    def micro_step(params, opt_state, scale, micro_batch, poison):
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, micro_batch) * poison))(params)
        grads = scale.unscale(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.adjust(prec.all_finite(grads))

    opt_state = optimizer.init(params)
    p = params
    for i in range(k):
        micro = jax.tree.map(lambda x, i=i: x[i::k], batch)
        if i == 2:  # an overflowing micro-step is dropped: nothing moves, nothing counts
            p_bad, state_bad, scale = micro_step(p, opt_state, scale, micro, jnp.float32(jnp.inf))
            _assert_trees_close(p_bad, p, rtol=0)
            assert int(state_bad.mini_step) == int(opt_state.mini_step) == 2
            opt_state = state_bad
            assert int(scale.skipped_steps) == 1
        p, opt_state, scale = micro_step(p, opt_state, scale, micro, jnp.float32(1.0))
        if i < k - 1:
            _assert_trees_close(p, params, rtol=0)  # no optimizer step before the K-th
    assert int(opt_state.mini_step) == 0
    grads = jax.jit(jax.grad(loss_fn))(params, batch)
    want = jax.tree.map(lambda w, g: w - lr * g, params, grads)
    _assert_trees_close(p, want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- float16 sums


def _fp16_scaled_problem(batch=16, tokens=1):
    """f16 params and inputs, an f32 loss times a loss scale of 2**11: each micro-batch's
    f16 gradients are ~1e4, so a sum of 8 of them passes f16's 65,504; their mean does not."""
    kx, kw = jax.random.split(jax.random.key(0))
    params = {"w": (jax.random.normal(kw, (6, 3)) * 0.1).astype(jnp.float16)}
    data = {"x": (jax.random.normal(kx, (batch, tokens, 6)) + 1.0).astype(jnp.float16),
            "y": jnp.full((batch, tokens, 3), -3.0), "mask": jnp.ones((batch, tokens))}
    return params, data


def _fp16_scaled_loss(params, batch):
    err = jnp.sum(((batch["x"] @ params["w"]).astype(jnp.float32) - batch["y"]) ** 2, axis=-1)
    return 2.0**11 * jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def _fp16_reference(params, batch):
    """The full-batch loss and gradients in f32 (from the same f16-rounded values)."""
    return jax.jit(jax.value_and_grad(_fp16_scaled_loss))(*prec.cast_floating((params, batch), "f32"))


def _assert_close_in_fp16(loss, grads, want_loss, want_grads):
    assert grads["w"].dtype == jnp.float16 and np.isfinite(np.asarray(grads["w"], np.float32)).all()
    assert np.abs(want_grads["w"]).max() * 8 > np.finfo(np.float16).max  # a sum of 8 overflows
    np.testing.assert_allclose(np.float32(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["w"], np.float32), want_grads["w"], rtol=1e-2)


@pytest.mark.parametrize("accum_dtype", ["f16", "bf16", "f32"])
def test_fp16_gradients_are_averaged_not_summed_past_fp16_range(accum_dtype):
    # Eight micro-batch gradients of ~1e4 summed in an f16 accumulator were inf.
    params, batch = _fp16_scaled_problem()
    want_loss, want_grads = _fp16_reference(params, batch)
    loss, grads = jax.jit(accumulate_gradients(_fp16_scaled_loss, 8, accum_dtype=accum_dtype))(
        params, batch)
    _assert_close_in_fp16(loss, grads, want_loss, want_grads)


@pytest.mark.parametrize("weighted", [False, True])
def test_data_parallel_fp16_gradients_do_not_overflow_the_device_sum(weighted):
    # A pmean of f16 gradients is a psum (8 devices x ~1e4: inf) then / 8; weighted,
    # with every token on device 0, weighted_share made that device's 8 x ~1e4 first.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params, batch = _fp16_scaled_problem(batch=64, tokens=2)
    if weighted:
        batch["mask"] = batch["mask"].at[8:].set(0.0)
    step = jax.jit(jax.shard_map(
        data_parallel_value_and_grad(_fp16_scaled_loss, 2, "data",
                                     weight_fn=_token_weight if weighted else None),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    loss, grads = step(jax.device_put(params, NamedSharding(mesh, P())),
                       jax.device_put(batch, NamedSharding(mesh, P("data"))))
    _assert_close_in_fp16(loss, grads, *_fp16_reference(params, batch))


@pytest.mark.parametrize("accum_dtype", ["f16", "bf16"])
def test_f32_loss_and_aux_are_averaged_in_f32_with_narrow_accumulators(accum_dtype):
    # A loss scale of 2**15 takes the f32 loss to ~7e5: cast to an f16 accumulator it was
    # inf (aux too), and rounded to bf16 it lost its low bits, while the gradients were fine.
    def loss_fn(params, batch):
        loss = 2.0**15 * _fp16_scaled_loss(params, batch) / 2.0**11
        return loss, {"scaled": loss}
    params, batch = _fp16_scaled_problem()
    params, batch = prec.cast_floating((params, batch), "f32")
    (want, _), _ = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    (loss, aux), _ = jax.jit(accumulate_gradients(loss_fn, 4, accum_dtype=accum_dtype, has_aux=True))(
        params, batch)
    assert loss.dtype == aux["scaled"].dtype == jnp.float32 and float(want) > 2 * 65504
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(aux["scaled"], want, rtol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("accum_dtype", ["f32", "bf16", "f64"])
def test_float64_and_complex_gradients_keep_their_dtype_over_micro_batches(weighted, accum_dtype):
    # The accumulator was accum_dtype for every leaf: a complex gradient lost its imaginary
    # part when K > 1 (it was exact with K = 1), and a float64 one was summed in float32
    # (8e-8 off; 3e-8 with weight_fn's float32 shares even under a float64 accumulator).
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        batch = {"x": jnp.asarray(rng.normal(size=(8, 5))), "y": jnp.asarray(rng.normal(size=8))}
        w = jnp.asarray(rng.normal(size=5))
        params = {"w": w, "c": jax.lax.complex(w, w[::-1])}

        def loss(p, b):
            return (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
                    + jnp.mean(jnp.abs(b["x"].astype(p["c"].dtype) @ p["c"] - b["y"].astype(p["c"].dtype)) ** 2))
        want_loss, want = jax.value_and_grad(loss)(params, batch)
        weight_fn = (lambda b: b["y"].shape[0]) if weighted else None
        got_loss, got = jax.jit(accumulate_gradients(
            loss, 4, accum_dtype=accum_dtype, weight_fn=weight_fn))(params, batch)
        assert got["w"].dtype == np.float64 and got["c"].dtype == np.complex128
        np.testing.assert_allclose(got["c"].imag, want["c"].imag, rtol=1e-12)
        np.testing.assert_allclose(got["c"].real, want["c"].real, rtol=1e-12)
        np.testing.assert_allclose(got["w"], want["w"], rtol=1e-12)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-12)


def test_complex64_gradients_under_a_bf16_accumulator_stay_complex():
    params = jnp.asarray([1 + 2j, -0.5 + 1j], jnp.complex64)
    batch = jnp.asarray(np.random.default_rng(1).normal(size=(4, 2)), jnp.float32)

    def loss(p, b):
        return jnp.mean(jnp.abs(b.astype(jnp.complex64) @ p) ** 2)
    want = jax.grad(loss)(params, batch)
    _, got = accumulate_gradients(loss, 2, accum_dtype="bf16")(params, batch)
    assert got.dtype == jnp.complex64
    np.testing.assert_allclose(got, want, rtol=1e-5)
