"""Dynamic loss scaling (`jaxopt_train.loss_scale`) against a Python reference of
Megatron-LM's state machine, under shard_map with an overflow on one device, and with
leaves that are not floating point."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.loss_scale import MAX_LOSS_SCALE, DynamicLossScale
from jaxopt_train.precision import all_finite


def _reference_scales(flags, initial, interval, growth, backoff, hysteresis, minimum):
    """Megatron-LM's DynamicGradScaler.update, in float32, with the scale capped at 2**126."""
    scale, counter, left, out = np.float32(initial), 0, hysteresis, []
    for finite in flags:
        if finite:
            counter += 1
            if counter == interval:
                counter, left = 0, hysteresis
                with np.errstate(over="ignore"):  # inf lands on the cap, as in adjust
                    scale = min(scale * np.float32(growth), np.float32(MAX_LOSS_SCALE))
        else:
            counter, left = 0, left - 1
            if left <= 0:
                scale = max(scale * np.float32(backoff), np.float32(minimum))
        out.append(float(scale))
    return out


@pytest.mark.parametrize("config", [(2.0**15, 3, 2.0, 0.5, 2, 1.0), (1000.0, 1, 3.0, 0.3, 1, 7.0),
                                    (5.0, 4, 1.5, 0.25, 3, 0.1), (2.0**120, 2, 4.0, 0.5, 1, 1.0)])
def test_dynamic_loss_scale_follows_the_reference_state_machine(config):
    flags = np.random.default_rng(0).random(200) < 0.75
    scale, got = DynamicLossScale(*config), []

    @jax.jit
    def run(scale, flags):
        def body(s, f):
            s = s.adjust(f)
            return s, s.loss_scale
        return jax.lax.scan(body, scale, flags)

    scale, got = run(scale, jnp.asarray(flags))
    np.testing.assert_array_equal(np.asarray(got), _reference_scales(flags, *config))
    assert int(scale.skipped_steps) == int((~flags).sum())


def test_devices_agree_on_an_overflow_seen_by_one_of_them():
    """Under shard_map the finiteness of the reduced gradients is one flag for all devices:
    inf on one device and nan on another both back the scale off everywhere, and the
    scale stays invariant (out_specs=P() is accepted)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def step(scale, grads):
        grads = jax.lax.psum(scale.unscale(grads), "data")
        return scale.adjust(all_finite(grads))

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    grads = jnp.ones((8, 4)).at[3, 1].set(jnp.inf).at[6, 0].set(jnp.nan)
    new = run(DynamicLossScale(hysteresis=1), jax.device_put(grads, NamedSharding(mesh, P("data"))))
    assert float(new.loss_scale) == 2.0**14 and int(new.skipped_steps) == 1


def test_int_bool_and_empty_leaves_pass_through_scale_and_unscale():
    scale = DynamicLossScale(initial_scale=3.0)
    tree = {"empty": jnp.ones((0, 3)), "ints": jnp.arange(3), "flags": jnp.array([True, False]),
            "half": jnp.full((2,), 3.0, jnp.float16)}
    scaled = scale.scale(tree)
    assert scaled["half"].dtype == jnp.float32 and float(scaled["half"][0]) == 9.0
    back = scale.unscale(tree)
    np.testing.assert_array_equal(back["ints"], tree["ints"])
    np.testing.assert_array_equal(back["flags"], tree["flags"])
    assert back["empty"].shape == (0, 3) and bool(all_finite(back))
