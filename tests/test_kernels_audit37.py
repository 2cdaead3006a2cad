"""Argument checks of the kernels' public API found in an audit: each test failed before its fix."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.kernels import MatmulConfig, autotune, make_dot_general

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def _private_cache(private_autotune_cache):
    """Every test sees an empty autotune cache in its own directory (conftest)."""


@pytest.mark.parametrize("rhs_shape, dims", [((6, 4), DIMS), ((4, 6), (((1,), (1,)), ((), ())))])
def test_kernel_dot_general_reports_unequal_contracting_dims_as_lax_does(rhs_shape, dims):
    """The kernel path raised matmul's ValueError about `a`, `b` and `transpose_b`, names
    the caller of a drop-in dot_general never used, where lax raises a TypeError."""
    lhs, rhs = jnp.ones((3, 5), jnp.bfloat16), jnp.ones(rhs_shape, jnp.bfloat16)
    with pytest.raises(TypeError, match=r"contracting dimensions to have the same shape"):
        make_dot_general("interpret")(lhs, rhs, dims)


def test_matmul_config_takes_numpy_ints_and_stores_python_ints():
    """np.int64(16) was refused as "must be an int"; the ints must stay JSON-serialisable."""
    config = MatmulConfig(block_m=np.int64(16), block_n=np.int32(16), block_k=16,
                          num_stages=np.int64(1), epilogue_tile=np.int64(32))
    assert config == MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1,
                                  epilogue_tile=32)
    assert type(config.block_m) is int and type(config.epilogue_tile) is int
    json.dumps(config.to_dict())
    with pytest.raises(ValueError, match=r"block_m=np.True_ must be an int"):
        MatmulConfig(block_m=np.bool_(True))


def _refuses_before_timing(error, match, **kwargs):
    timed = []
    kwargs = {"backend": "interpret", "candidates": [SMALL], "write_cache": False, **kwargs}
    with pytest.raises(error, match=match):
        autotune([(16, 16, 16)], timer=lambda fn: timed.append(fn) or 1.0, **kwargs)
    assert timed == []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"write_cache": "no"}, TypeError, r"write_cache must be a bool; got 'no'"),  # was written
    ({"quick": "no"}, TypeError, r"quick must be a bool; got 'no'"),
    ({"seed": True}, TypeError, r"seed=True must be an int"),  # was seeded as 1
    ({"seed": 1.5}, TypeError, r"seed=1.5 must be an int"),  # failed naming a JitTracer
    ({"dtype": None}, ValueError, r"dtype=None is not a matmul input dtype"),  # said float64
])
def test_autotune_refuses_flags_seed_and_dtype_it_cannot_use(tmp_path, kwargs, error, match):
    _refuses_before_timing(error, match, **kwargs)
    assert not (tmp_path / "matmul_autotune.json").exists()


def test_autotune_takes_a_numpy_int_seed_and_numpy_bool_flag():
    winners = autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL], input_sets=1,
                       timer=lambda fn: 1e-3, seed=np.int64(3), write_cache=np.bool_(False))
    assert winners == {(16, 16, 16): SMALL}
