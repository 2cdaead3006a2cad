"""Tests for jaxopt_train.precision against fp32 / hand-worked references."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

from jaxopt_train import precision as prec

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


# ----------------------------------------------------------------------------- policies


@pytest.mark.parametrize("name, param, compute, output, matmul", [
    ("fp32", F32, F32, F32, None),
    ("tf32", F32, F32, F32, "tensorfloat32"),
    ("bf16", F32, BF16, F32, None),
    ("bf16-pure", BF16, BF16, BF16, None),
    ("fp16", F32, F16, F32, None),
])
def test_presets(name, param, compute, output, matmul):
    policy = prec.get_policy(name)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (param, compute, output)
    assert policy.matmul_precision == matmul
    assert policy.needs_loss_scale == (name == "fp16")
    expected = prec.DynamicLossScale if name == "fp16" else prec.NoOpLossScale
    assert isinstance(prec.loss_scale_for(name), expected)
    assert prec.get_policy(policy) is policy


def test_from_string_and_defaults():
    assert prec.Policy.from_string("p=f32,c=bf16,o=f32") == prec.get_policy("bf16")
    assert prec.get_policy("p=float32, c=float16") == prec.Policy(F32, F16, F16)
    assert prec.Policy.from_string("p=f32,m=tensorfloat32") == prec.get_policy("tf32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        prec.get_policy("bf16").param_dtype = F16


@pytest.mark.parametrize("bad, match", [
    ("bf17", "unknown precision policy 'bf17'.*fp32.*bf16-pure"),
    ("p=f32,x=bf16", "bad policy item 'x=bf16'.*compute"),
    ("p=f33", "param_dtype='f33' is not a known dtype name.*bf16"),
    ("c=bf16", "must name the param dtype"),
    ("p=f32,m=fast", "matmul_precision='fast'.*tensorfloat32"),
])
def test_bad_policy_strings(bad, match):
    with pytest.raises(ValueError, match=match):
        prec.get_policy(bad)


def test_bad_policy_types():
    with pytest.raises(ValueError, match="must be a floating dtype"):
        prec.Policy(jnp.int32, jnp.float32, jnp.float32)
    # Floating, but nothing computes in them: float8 params were accepted and float128
    # (which JAX cannot hold) reached the first cast.
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2, np.longdouble):
        if np.dtype(dtype) == np.float64:  # long double is plain double on some platforms
            continue
        with pytest.raises(ValueError, match=f"param_dtype={np.dtype(dtype)} must be a floating "
                                             "dtype this library computes in"):
            prec.Policy(dtype, jnp.float32, jnp.float32)
    with pytest.raises(TypeError, match="must be a Policy or one of"):
        prec.get_policy(3)


def test_policy_rejects_none_dtype():
    # np.dtype(None) is float64: it must not become the param dtype silently.
    with pytest.raises(TypeError, match="param_dtype=None is not a dtype.*bf16"):
        prec.Policy(None, "f32", "f32")
    with pytest.raises(TypeError, match="output_dtype=None is not a dtype"):
        prec.Policy("f32", "f32", None)


@pytest.mark.parametrize("spec, match", [
    ("p=f32,p=bf16", "item 'p=bf16' in spec='p=f32,p=bf16' sets param_dtype again (already 'f32')"),
    ("p=f32,param=bf16", "item 'param=bf16' in spec='p=f32,param=bf16' sets param_dtype again"),
    ("p=f32,c=bf16,compute=f16", "sets compute_dtype again (already 'bf16')"),
    ("p=f32,m=high,m=highest", "sets matmul_precision again (already 'high')"),
])
def test_from_string_rejects_repeated_keys(spec, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        prec.Policy.from_string(spec)


def test_cast_floating_parses_dtype_names_and_rejects_non_floating():
    tree = {"w": jnp.array([1.5, -2.5], jnp.float32), "i": jnp.arange(2)}
    out = prec.cast_floating(tree, "bf16")
    assert out["w"].dtype == BF16 and out["i"].dtype == tree["i"].dtype
    np.testing.assert_array_equal(out["w"].astype(jnp.float32), tree["w"])
    assert prec.cast_floating(tree, jnp.float16)["w"].dtype == F16
    with pytest.raises(ValueError, match="dtype=int32 must be a floating dtype"):
        prec.cast_floating(tree, jnp.int32)  # would truncate 1.5 to 1
    with pytest.raises(ValueError, match="dtype='bf17' is not a known dtype name"):
        prec.cast_floating(tree, "bf17")


def test_casts_leave_non_floating_leaves_alone():
    tree = {"w": jnp.ones((2,), F32), "h": jnp.ones((2,), F16), "i": jnp.arange(3),
            "b": jnp.array([True]), "key": jax.random.key(0), "raw_key": jax.random.PRNGKey(1),
            "n": np.ones(2, np.float32), "py": 1.5}
    policy = prec.get_policy("bf16-pure")
    out = jax.jit(policy.cast_to_compute)(tree)
    assert out["w"].dtype == BF16 and out["h"].dtype == BF16 and out["n"].dtype == BF16
    for name in ("i", "b", "raw_key"):
        assert out[name].dtype == tree[name].dtype
        np.testing.assert_array_equal(out[name], tree[name])
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
    assert out["py"] == 1.5
    back = prec.get_policy("fp32").cast_to_param(out)
    assert back["w"].dtype == F32 and back["i"].dtype == tree["i"].dtype


def test_tf32_scope_sets_matmul_precision():
    x = jnp.ones((4, 4), jnp.float32)

    def matmul(policy):
        with policy.matmul_scope():
            return jax.jit(lambda a: a @ a).lower(x).as_text()
    assert "HIGH" in matmul(prec.get_policy("tf32"))
    assert "precision = [HIGH" not in matmul(prec.get_policy("fp32"))


# ----------------------------------------------------------------------------- model apply


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


class _LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(4)(jax.nn.gelu(linen.Dense(16)(x)))


def _nnx_loss(policy, graphdef, state, x, y):
    out = prec.nnx_apply(policy, graphdef, state, x)
    assert out.dtype == policy.output_dtype
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _linen_loss(policy, variables, x, y):
    out = prec.linen_apply(policy, _LinenMLP(), variables, x)
    assert out.dtype == policy.output_dtype
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


@pytest.fixture(scope="module")
def mlp_problems():
    x = jax.random.normal(jax.random.key(1), (16, 8), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (16, 4), jnp.float32)
    graphdef, state = nnx.split(_NNXMLP(nnx.Rngs(0)))
    variables = _LinenMLP().init(jax.random.key(0), x)
    problems = {"nnx": (lambda policy, p: _nnx_loss(policy, graphdef, p, x, y), state),
                "linen": (lambda policy, p: _linen_loss(policy, p, x, y), variables)}
    fp32 = prec.get_policy("fp32")
    refs = {name: jax.jit(jax.value_and_grad(lambda p, f=f: f(fp32, p)))(params)
            for name, (f, params) in problems.items()}
    return problems, refs


@pytest.mark.parametrize("policy_name, rtol", [("bf16", 3e-2), ("fp16", 5e-3), ("tf32", 1e-5)])
@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_nnx_and_linen_under_policy_match_fp32(mlp_problems, kind, policy_name, rtol):
    problems, refs = mlp_problems
    loss, params = problems[kind]
    ref_loss, ref_grads = refs[kind]
    policy = prec.get_policy(policy_name)
    got_loss, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(policy, p)))(params)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=rtol)
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == F32  # gradients land on the f32 master weights
        np.testing.assert_allclose(g, r, rtol=rtol * 4, atol=rtol * np.abs(r).max())
    # A wrong compute dtype must show up: bf16 cannot match fp32 to 1e-7.
    if policy_name == "bf16":
        assert not np.allclose(got_loss, ref_loss, rtol=1e-7, atol=0)


def test_nnx_apply_with_state_and_linen_mutable():
    class WithStats(nnx.Module):
        def __init__(self):
            self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(x)
    x = jax.random.normal(jax.random.key(3), (8, 4))
    graphdef, state = nnx.split(WithStats())
    policy = prec.get_policy("bf16")
    # Flax's BatchNorm calls jnp.promote_types(bf16, f32), which strict
    # promotion (tests/conftest.py) rejects.
    with jax.numpy_dtype_promotion("standard"):
        out, new_state = prec.nnx_apply_with_state(policy, graphdef, state, x)
        module = linen.BatchNorm(use_running_average=False)
        variables = module.init(jax.random.key(0), x)
        out_linen, updates = prec.linen_apply(policy, module, variables, x, mutable=["batch_stats"])
    assert out.dtype == F32
    assert all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)))
    mean = new_state["bn"]["mean"][...]
    # Flax momentum 0.99: running mean = 0.01 * batch mean (of the bf16 input).
    np.testing.assert_allclose(mean, 0.01 * x.mean(0), rtol=2e-2, atol=1e-4)
    assert out_linen.dtype == F32 and updates["batch_stats"]["mean"].dtype == F32
    np.testing.assert_allclose(updates["batch_stats"]["mean"], mean, rtol=1e-6)


def _batchnorm_mlp_state():
    class WithStats(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.linear(x))
    return nnx.split(WithStats(nnx.Rngs(0)))


def test_nnx_apply_leaves_the_callers_state_untouched():
    # nnx.merge reuses the state's Variables: the cast to bf16 and the new
    # BatchNorm statistics used to be written into the caller's state.
    graphdef, state = _batchnorm_mlp_state()
    before = jax.tree.map(np.array, state)
    x = jax.random.normal(jax.random.key(5), (8, 4), jnp.float32)
    with jax.numpy_dtype_promotion("standard"):  # Flax's BatchNorm promotes bf16 with f32
        out, new_state = prec.nnx_apply_with_state("bf16", graphdef, state, x)
        prec.nnx_apply("bf16", graphdef, state, x)
    assert out.dtype == F32
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        assert got.dtype == want.dtype == F32
        np.testing.assert_array_equal(got, want)  # master weights and statistics unchanged
    assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)
    # The new state carries the call's statistics (momentum 0.99), the caller's does not.
    assert np.abs(new_state["bn"]["mean"][...]).max() > 0 == np.abs(state["bn"]["mean"][...]).max()


def test_nnx_apply_with_the_state_closed_over_under_jit():
    # Closed over, `state` holds concrete Variables of the outer trace; writing
    # into them raised flax.errors.TraceContextError.
    graphdef, state = _batchnorm_mlp_state()
    x = jax.random.normal(jax.random.key(6), (8, 4), jnp.float32)
    with jax.numpy_dtype_promotion("standard"):
        out, new_state = jax.jit(lambda x: prec.nnx_apply_with_state("bf16", graphdef, state, x))(x)
        eager_out, eager_state = prec.nnx_apply_with_state("bf16", graphdef, state, x)
    # bf16 compute: jit and eager may round differently (fusion), within bf16's precision.
    np.testing.assert_allclose(out, eager_out, rtol=2e-2, atol=2e-2)
    assert new_state["linear"]["kernel"][...].dtype == F32
    np.testing.assert_allclose(new_state["bn"]["mean"][...], eager_state["bn"]["mean"][...],
                               rtol=2e-2, atol=1e-4)
    assert state["linear"]["kernel"][...].dtype == F32


def test_apply_functions_take_policy_names():
    x = jax.random.normal(jax.random.key(4), (2, 8), jnp.float32)
    graphdef, state = nnx.split(_NNXMLP(nnx.Rngs(0)))
    by_name = prec.nnx_apply("bf16", graphdef, state, x)
    np.testing.assert_array_equal(by_name, prec.nnx_apply(prec.get_policy("bf16"), graphdef, state, x))
    out, _ = prec.nnx_apply_with_state("p=f32,c=bf16,o=bf16", graphdef, state, x)
    assert by_name.dtype == F32 and out.dtype == BF16
    variables = _LinenMLP().init(jax.random.key(0), x)
    assert prec.linen_apply("fp16", _LinenMLP(), variables, x).dtype == F32
    with pytest.raises(ValueError, match="unknown precision policy 'bf17'"):
        prec.nnx_apply("bf17", graphdef, state, x)
    with pytest.raises(TypeError, match="must be a Policy or one of"):
        prec.linen_apply(None, _LinenMLP(), variables, x)


# ----------------------------------------------------------------------------- loss scales


def test_dynamic_loss_scale_hand_worked_sequence():
    scale = prec.DynamicLossScale(initial_scale=8.0, growth_interval=3, growth_factor=2.0,
                                  backoff_factor=0.5, hysteresis=2, min_scale=2.0)
    adjust = jax.jit(lambda s, finite: s.adjust(finite))
    # (finite?, scale after, skipped after). Worked by hand from the docstring rules.
    sequence = [
        (True, 8, 0), (True, 8, 0), (True, 16, 0),    # 3 finite steps -> grow
        (False, 16, 1),                               # 1st overflow: hysteresis absorbs it
        (True, 16, 1), (True, 16, 1),                 # counter restarted at 0 after overflow
        (False, 8, 2),                                # 2nd overflow since growth: back off
        (False, 4, 3),                                # budget spent: back off again
        (False, 2, 4), (False, 2, 5),                 # floor at min_scale
        (True, 2, 5), (True, 2, 5), (True, 4, 5),     # growth refills hysteresis
        (False, 4, 6),                                # absorbed again
    ]
    for step, (finite, want_scale, want_skipped) in enumerate(sequence):
        scale = adjust(scale, finite)
        assert float(scale.loss_scale) == want_scale, f"step {step}"
        assert int(scale.skipped_steps) == want_skipped, f"step {step}"
    assert isinstance(scale, prec.DynamicLossScale) and scale.growth_interval == 3


def test_dynamic_loss_scale_growth_never_overflows():
    scale = prec.DynamicLossScale(initial_scale=prec.MAX_LOSS_SCALE, growth_interval=1)
    scale = scale.adjust(True)
    assert float(scale.loss_scale) == prec.MAX_LOSS_SCALE


@pytest.mark.parametrize("kwargs, match", [
    (dict(initial_scale=0.0), "initial_scale > 0"),
    (dict(growth_interval=0), "growth_interval >= 1"),
    (dict(growth_factor=0.5), "growth_factor > 1"),
    (dict(backoff_factor=1.5), "0 < backoff_factor < 1"),
    (dict(hysteresis=0), "hysteresis >= 1"),
    (dict(min_scale=-1.0), "min_scale > 0"),
])
def test_dynamic_loss_scale_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prec.DynamicLossScale(**kwargs)


def test_static_loss_scale_bad_scale():
    with pytest.raises(ValueError, match="finite positive"):
        prec.StaticLossScale(0.0)
    with pytest.raises(TypeError, match="must be a scalar"):
        prec.StaticLossScale(jnp.ones(2))


@pytest.mark.parametrize("scale, stored", [
    (1e40, "inf"), (1e-50, "0.0"), (float("inf"), "inf"), (float("nan"), "nan"),
    (1e-40, "1e-40"),  # a float32 subnormal: 1/scale would overflow to inf
    (2.0**127, "1.7014118e+38"),  # 1/scale would be subnormal: flushed to 0 by XLA
])
def test_static_loss_scale_checked_as_float32(scale, stored):
    with pytest.raises(ValueError, match=re.escape("finite positive number in 1.18e-38..2**126")
                                         + f".*where it is {re.escape(stored)}"):
        prec.StaticLossScale(scale)


@pytest.mark.parametrize("scale", [None, "1024", True, 1 + 2j, [2.0]])
def test_static_loss_scale_needs_a_real_number(scale):
    with pytest.raises(TypeError, match="must be a scalar real number"):
        prec.StaticLossScale(scale)


def test_static_loss_scale_float32_extremes_are_kept():
    big, tiny = prec.MAX_LOSS_SCALE, float(np.finfo(np.float32).tiny)
    assert float(prec.StaticLossScale(big).loss_scale) == big
    assert float(prec.StaticLossScale(tiny).unscale(jnp.ones((), jnp.float32))) == 1 / np.float32(tiny)


@pytest.mark.parametrize("kwargs, match", [
    (dict(initial_scale=float("inf")), r"initial_scale > 0 in 1.18e-38..2\*\*126"),
    (dict(initial_scale=1e40), r"initial_scale > 0 in 1.18e-38..2\*\*126"),
    (dict(initial_scale=2.0**127), r"initial_scale > 0 in 1.18e-38..2\*\*126"),
    (dict(min_scale=float("inf")), r"min_scale > 0 in 1.18e-38..2\*\*126"),
    (dict(min_scale=1e-50), r"min_scale > 0 in 1.18e-38..2\*\*126"),
    (dict(growth_factor=float("inf")), "growth_factor > 1 and finite in float32"),
    (dict(growth_factor=1e39), "growth_factor > 1 and finite in float32"),
    (dict(growth_factor=1.0), "growth_factor > 1"),
    (dict(backoff_factor=1.0), "0 < backoff_factor < 1"),
    (dict(backoff_factor=1e-50), "0 < backoff_factor < 1 in float32"),
    (dict(backoff_factor=float("nan")), "0 < backoff_factor < 1"),
    (dict(initial_scale=0.5), "initial_scale >= min_scale; got initial_scale=0.5.*min_scale=1.0"),
])
def test_dynamic_loss_scale_checked_as_float32(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prec.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("name", ["initial_scale", "growth_factor", "backoff_factor", "min_scale"])
def test_dynamic_loss_scale_needs_real_numbers(name):
    with pytest.raises(TypeError, match=f"{name}=None must be a scalar real number"):
        prec.DynamicLossScale(**{name: None})


def test_dynamic_loss_scale_initial_equal_to_min_is_kept():
    scale = prec.DynamicLossScale(initial_scale=4.0, min_scale=4.0)
    assert float(scale.loss_scale) == 4.0


@pytest.mark.parametrize("make", [prec.NoOpLossScale, lambda: prec.StaticLossScale(8.0),
                                  lambda: prec.DynamicLossScale(initial_scale=8.0)])
@pytest.mark.parametrize("bad, error, message", [
    (jnp.array([True, False]), ValueError, "must be a scalar boolean (shape ()); got shape (2,)"),
    (np.array([True]), ValueError, "got shape (1,)"),
    ("yes", TypeError, "must be a bool or a boolean array such as all_finite(grads); got str"),
    (float("nan"), TypeError, "got float"),
    (0.5, TypeError, "got float"),
    (1, TypeError, "got int"),
    (jnp.float32(1.0), TypeError, "with dtype float32"),
])
def test_adjust_needs_one_boolean(make, bad, error, message):
    scale, match = make(), re.escape(message)
    with pytest.raises(error, match=match):
        scale.adjust(bad)
    if hasattr(bad, "dtype"):  # shape and dtype are static: the check fires under jit too
        with pytest.raises(error, match=match):
            jax.jit(lambda s, f: s.adjust(f))(scale, bad)


@pytest.mark.parametrize("make", [prec.NoOpLossScale, lambda: prec.StaticLossScale(8.0),
                                  lambda: prec.DynamicLossScale(initial_scale=8.0)])
@pytest.mark.parametrize("flag", [False, np.bool_(False), jnp.asarray(False)])
def test_adjust_accepts_python_numpy_and_jax_booleans(make, flag):
    scale = make().adjust(flag)
    assert scale.skipped_steps.shape == () and int(scale.skipped_steps) == 1
    assert scale.loss_scale.shape == ()


@pytest.mark.parametrize("make", [prec.NoOpLossScale, lambda: prec.StaticLossScale(1024.0),
                                  lambda: prec.DynamicLossScale(initial_scale=2.0**10)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_scale_unscale_round_trip_is_a_pytree(make, dtype):
    scale = make()
    grads = {"a": jnp.linspace(-3, 3, 7, dtype=dtype), "n": jnp.arange(3)}

    @jax.jit
    def round_trip(s, g):
        return s.unscale(s.scale(g)), s.scale(jnp.asarray(2.0, dtype))
    back, scaled_loss = round_trip(scale, grads)
    np.testing.assert_array_equal(back["a"], grads["a"])
    assert back["n"].dtype == grads["n"].dtype
    assert float(scaled_loss) == 2.0 * float(scale.loss_scale)
    if not isinstance(scale, prec.NoOpLossScale):  # scaling runs (and stays) in f32
        assert back["a"].dtype == scaled_loss.dtype == F32
    leaves, treedef = jax.tree.flatten(scale)
    assert type(jax.tree.unflatten(treedef, leaves)) is type(scale)
    assert scale.skipped_steps.dtype == jnp.int32 and scale.loss_scale.dtype == jnp.float32


@pytest.mark.parametrize("exponent", [16, 20])
@pytest.mark.parametrize("make", [prec.StaticLossScale, lambda s: prec.DynamicLossScale(s)])
def test_scale_of_an_fp16_loss_is_finite_float32(make, exponent):
    # In fp16, 2**16 is already inf (max 65504): multiplying there overflowed
    # every step once the dynamic scale had grown that far.
    scale = make(2.0**exponent)
    loss = jnp.asarray(3.0, jnp.float16)
    scaled = jax.jit(lambda s, x: s.scale(x))(scale, loss)
    assert scaled.dtype == F32 and float(scaled) == 3.0 * 2.0**exponent
    assert float(scale.scale(jnp.asarray(-1e-3, jnp.float16))) == float(np.float16(-1e-3)) * 2.0**exponent


@pytest.mark.parametrize("exponent", [16, 20, 30])
def test_unscale_of_fp16_gradients_runs_in_float32(exponent):
    # 2**-30 is 0 in fp16 and 2**-20 subnormal: dividing in fp16 would lose the gradients.
    scale = prec.StaticLossScale(2.0**exponent)
    want = np.array([1e-3, -2.5e-2, 3e-5, 0.0], np.float32)
    scaled = jnp.asarray(want * 2.0**exponent, jnp.float32)
    if exponent <= 20:  # then the scaled gradients fit fp16: unscale them from there
        scaled = scaled.astype(jnp.float16)
    got = jax.jit(lambda s, g: s.unscale(g))(scale, scaled)
    assert got.dtype == scaled.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-3)


def test_fp16_gradients_are_correct_after_unscale():
    # The backward hands each fp16 value y the cotangent scale * dloss/dy in
    # fp16: an fp16 loss (dloss/dloss = 1) takes scales up to 2**15, while a
    # loss reduced in f32 from fp16 outputs (output_dtype f32) with small
    # dloss/dy works at 2**16 and 2**20.
    w = jnp.asarray([0.25, -0.5, 1.0], jnp.float32)
    x = jnp.asarray([1e-2, 2e-2, -1e-2], jnp.float32)

    def outputs16(w):
        return w.astype(jnp.float16) * x.astype(jnp.float16)
    want = jax.grad(lambda w: jnp.sum((w * x) ** 2))(w)
    for scale, loss in [(prec.StaticLossScale(2.0**10), lambda w: jnp.sum(outputs16(w) ** 2)),
                        (prec.StaticLossScale(2.0**16), lambda w: jnp.sum(outputs16(w).astype(F32) ** 2)),
                        (prec.DynamicLossScale(2.0**20), lambda w: jnp.sum(outputs16(w).astype(F32) ** 2))]:
        value, grads = jax.jit(jax.value_and_grad(lambda w: scale.scale(loss(w))))(w)
        assert bool(jnp.isfinite(value)) and grads.dtype == F32
        np.testing.assert_allclose(scale.unscale(grads), want, rtol=2e-3)


def test_all_finite_and_select_tree():
    good = {"a": jnp.ones(3), "i": jnp.arange(2)}
    assert bool(jax.jit(prec.all_finite)(good)) and bool(prec.all_finite({"i": jnp.arange(2)}))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        assert not bool(jax.jit(prec.all_finite)({"a": jnp.array([1.0, bad]), "i": jnp.arange(2)}))
    other = {"a": jnp.zeros(3), "i": jnp.arange(2) + 5}
    picked = jax.jit(prec.select_tree)(jnp.asarray(False), good, other)
    np.testing.assert_array_equal(picked["i"], other["i"])
    with pytest.raises(ValueError, match="pred must be a scalar"):
        prec.select_tree(jnp.array([True, False]), good, other)


@pytest.mark.parametrize("tree, want", [
    ({"a": float("nan")}, False),
    ({"a": float("inf"), "b": jnp.ones(2)}, False),
    ({"a": complex(0, float("inf"))}, False),
    ({"a": jnp.array([1 + 1j, complex(float("nan"), 0)], jnp.complex64)}, False),
    ({"a": 1.5, "b": 2, "c": jnp.ones(2)}, True),
])
def test_all_finite_sees_python_scalars_and_complex(tree, want):
    assert bool(prec.all_finite(tree)) is want


@pytest.mark.parametrize("on_true, on_false, message", [
    ({"a": jnp.ones(2)}, {"a": jnp.ones(3)},
     "on_true['a'] has shape (2,); expected (3,), the shape of on_false['a']"),
    ({"a": jnp.ones(())}, {"a": jnp.ones(1)}, "on_true['a'] has shape (); expected (1,)"),
    ({"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)},
     "on_true['a'] has dtype float32; expected bfloat16, the dtype of on_false['a']"),
    ({"a": jnp.arange(2)}, {"a": jnp.ones(2)}, "has dtype int32; expected float32"),
    ({"a": jnp.ones(2)}, {"b": jnp.ones(2)}, "on_true must have the tree structure of on_false; "
     "on_true has no leaf at ['b'] (on_false has); on_true has a leaf at ['a'] (on_false has none)"),
    ({"a": jnp.ones(2), "b": jnp.ones(2)}, {"a": jnp.ones(2)}, "on_true has a leaf at ['b']"),
    ((jnp.ones(2),), [jnp.ones(2)], "tree structure of on_false; expected PyTreeDef([*])"),
])
def test_select_tree_mismatches_are_clear(on_true, on_false, message):
    match = re.escape(message)
    with pytest.raises(ValueError, match=match):
        prec.select_tree(jnp.asarray(True), on_true, on_false)
    with pytest.raises(ValueError, match=match):  # raised while tracing, before lax.select
        jax.jit(prec.select_tree)(jnp.asarray(True), on_true, on_false)


@pytest.mark.parametrize("pred", [0.5, jnp.float32(float("nan")), jnp.int32(1)])
def test_select_tree_pred_must_be_boolean(pred):
    with pytest.raises(TypeError, match="pred must be a boolean"):
        prec.select_tree(pred, {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})


def test_select_tree_keeps_keys_and_python_numbers():
    on_true = {"k": jax.random.key(0), "s": jnp.ones(()), "tag": "x"}
    on_false = {"k": jax.random.key(1), "s": 2.0, "tag": "x"}
    picked = prec.select_tree(jnp.asarray(False), on_true, on_false)
    np.testing.assert_array_equal(jax.random.key_data(picked["k"]), jax.random.key_data(on_false["k"]))
    assert float(picked["s"]) == 2.0 and picked["tag"] == "x"
    # The Python number on the taken side: it crashed comparing 1.0 with an array.
    swapped = prec.select_tree(jnp.asarray(True), on_false, on_true)
    assert float(swapped["s"]) == 2.0 and swapped["s"].dtype == jnp.float32
    assert float(jax.jit(prec.select_tree)(jnp.asarray(False), {"s": 3.0}, {"s": jnp.ones(())})["s"]) == 1.0


@pytest.mark.parametrize("grads, message", [
    ({"w": jnp.ones((1,))}, "grads['w'] has shape (1,); expected (3,), the shape of params['w']"),
    ({"w": jnp.ones(())}, "grads['w'] has shape (); expected (3,)"),
    ({"w": jnp.ones((4,))}, "grads['w'] has shape (4,); expected (3,)"),
    ({"w": jnp.ones((3, 1))}, "grads['w'] has shape (3, 1); expected (3,)"),
    ({"v": jnp.ones((3,))}, "grads must have the tree structure of params; grads has no leaf at ['w']"),
    ({"w": jnp.ones((3,)), "b": jnp.ones(1)}, "grads has a leaf at ['b'] (params has none)"),
    ([jnp.ones((3,))], "grads has no leaf at ['w'] (params has); grads has a leaf at [0]"),
])
def test_apply_updates_if_finite_checks_grads_against_params(grads, message):
    params = {"w": jnp.ones((3,), jnp.float32)}
    optimizer = optax.sgd(0.1)
    state = optimizer.init(params)
    step = jax.jit(lambda g: prec.apply_updates_if_finite(optimizer, g, state, params,
                                                           prec.NoOpLossScale()))
    with pytest.raises(ValueError, match=re.escape(message)):
        step(grads)


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_non_finite_step_is_skipped_with_real_optimizer(bad):
    """fp16 training loop: an injected inf/nan leaves params and Adam state as they were."""
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3),
              "b": jnp.zeros((3,), jnp.float32)}
    x = jax.random.normal(jax.random.key(0), (4, 2), jnp.float32)
    optimizer = optax.sgd(0.1, momentum=0.9)
    policy = prec.get_policy("fp16")

    @jax.jit
    def step(params, opt_state, scale, poison):
        def loss_fn(p):
            p = policy.cast_to_compute(p)
            out = (x.astype(policy.compute_dtype) @ p["w"] + p["b"]) * poison
            return scale.scale(jnp.mean(out.astype(jnp.float32) ** 2))
        grads = jax.grad(loss_fn)(params)
        return prec.apply_updates_if_finite(optimizer, grads, opt_state, params, scale)

    scale = prec.loss_scale_for(policy)
    opt_state = optimizer.init(params)
    params1, opt_state1, scale1, finite = step(params, opt_state, scale, jnp.float16(1.0))
    assert bool(finite) and not np.allclose(params1["w"], params["w"])
    # Reference for the finite step: plain f32 optax without scaling.
    ref_grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
    ref_updates, _ = optimizer.update(ref_grads, opt_state, params)
    np.testing.assert_allclose(params1["w"], optax.apply_updates(params, ref_updates)["w"],
                               rtol=2e-3, atol=2e-4)
    params2, opt_state2, scale2, finite = step(params1, opt_state1, scale1, jnp.float16(bad))
    assert not bool(finite)
    for new, old in zip(jax.tree.leaves((params2, opt_state2)), jax.tree.leaves((params1, opt_state1))):
        np.testing.assert_array_equal(new, old)
    assert int(scale2.skipped_steps) == 1
    # Default hysteresis=2: the first overflow is absorbed, the second backs off.
    assert float(scale2.loss_scale) == 2.0**15
    _, _, scale3, _ = step(params2, opt_state2, scale2, jnp.float16(bad))
    assert float(scale3.loss_scale) == 2.0**14 and int(scale3.skipped_steps) == 2


def test_adam_under_standard_promotion_is_skipped_too():
    # optax.adam mixes Python floats with its int32 count, which strict
    # promotion (tests/conftest.py) rejects; users run with standard promotion.
    params = {"w": jnp.ones((3,), jnp.float32)}
    optimizer = optax.adam(1e-2)
    with jax.numpy_dtype_promotion("standard"):
        state = optimizer.init(params)
        step = jax.jit(lambda g, s, p, ls: prec.apply_updates_if_finite(optimizer, g, s, p, ls))
        p1, s1, ls1, ok = step({"w": jnp.array([1.0, jnp.nan, 0.0])}, state, params,
                               prec.NoOpLossScale())
    assert not bool(ok) and int(ls1.skipped_steps) == 1
    np.testing.assert_array_equal(p1["w"], params["w"])
    assert int(s1[0].count) == 0


def test_fp16_gradients_of_f32_params_are_unscaled_in_f32():
    # Loss scaling keeps 1e-8 representable in fp16 (as 3.3e-4 at 2**15); unscaled back
    # in fp16 it was 0 (and 1e-7 off by 19%) before the f32 optimizer saw it.
    params = {"w": jnp.zeros((4,), jnp.float32)}
    want = jnp.asarray([1e-8, 1e-7, 3e-6, 1e-3], jnp.float32)
    scale = prec.StaticLossScale(2.0**15)
    grads = {"w": (want * 2.0**15).astype(jnp.float16)}
    optimizer = optax.sgd(1.0)
    step = jax.jit(lambda g, p: prec.apply_updates_if_finite(optimizer, g, optimizer.init(p), p, scale))
    with jax.numpy_dtype_promotion("standard"):  # JAX's default, where optax mixes them
        new_params, _, _, finite = step(grads, params)
    assert bool(finite) and new_params["w"].dtype == jnp.float32
    # Reference: plain SGD on the f32 gradients the fp16 ones hold (rounded to fp16 once).
    reference = -np.asarray(grads["w"], np.float32) / 2.0**15
    np.testing.assert_allclose(new_params["w"], reference, rtol=1e-6)
    np.testing.assert_allclose(new_params["w"], -want, rtol=1e-3)
