"""`autotune` times XLA's dot beside its winner, and `backend="auto"` runs XLA's dot on the
exact shapes where it was faster (the kernel still runs when named, and on other shapes).

On CPU "auto" resolves to XLA whatever the cache says, so these tests let "auto" resolve to
the interpret kernel, and tell which ran by whether the traced program holds a pallas_call.
"""

from __future__ import annotations

import importlib
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.kernels import MatmulConfig, autotune

autotune_mod = importlib.import_module("jaxopt_train.kernels.autotune")
cache_mod = importlib.import_module("jaxopt_train.kernels.autotune_cache")
matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")
dot_general_mod = importlib.import_module("jaxopt_train.kernels.dot_general")
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
SHAPE = (24, 16, 40)  # M, N, K


@pytest.fixture(autouse=True)
def _private_cache(private_autotune_cache):
    """Every test sees an empty autotune cache in its own directory (conftest)."""


@pytest.fixture
def auto_is_interpret(monkeypatch):
    """"auto" resolves to the interpret kernel, as it resolves to mosaic_gpu on Hopper."""
    real = matmul_mod.resolve_backend

    def resolve(backend):
        return "interpret" if backend == "auto" else real(backend)

    monkeypatch.setattr(matmul_mod, "resolve_backend", resolve)
    monkeypatch.setattr(dot_general_mod, "resolve_backend", resolve)


def _tune(kernel_s: float, xla_s: float, shape=SHAPE, **kwargs):
    """Tunes `shape` on interpret with SMALL, timing the kernel at `kernel_s` and XLA's dot
    (the only call made with config=None) at `xla_s`."""
    timed = []

    def timer(fn):
        fn()
        return kernel_s if timed[-1] is not None else xla_s

    real = matmul_mod.matmul

    def spying(a, b, *, config, **kw):
        timed.append(config)
        return real(a, b, config=config, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matmul_mod, "matmul", spying)
        winners = autotune([shape], backend="interpret", candidates=[SMALL], timer=timer,
                           input_sets=1, **kwargs)
    return winners, timed


def _runs_kernel(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def _operands(m, n, k, dtype=jnp.bfloat16):
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    return a, b


def test_autotune_times_xla_last_and_caches_its_time_beside_the_winner(private_autotune_cache,
                                                                      caplog):
    with caplog.at_level(logging.INFO, logger="jaxopt_train.kernels.autotune"):
        winners, timed = _tune(2e-3, 1e-3)
    assert winners == {SHAPE: SMALL}  # the kernel's best config is still the winner
    assert timed[-1] is None and timed.count(None) == 1
    data = json.loads((private_autotune_cache / "matmul_autotune.json").read_text())
    assert [(e["seconds"], e["xla_seconds"]) for e in data.values()] == [(2e-3, 1e-3)] * 2
    assert "XLA's dot 1000.0 us; the winner runs at 0.5x its speed" in caplog.text
    assert "XLA's dot is faster than every candidate" in caplog.text
    kind = jax.devices()[0].device_kind
    assert cache_mod.lookup_timings("interpret", kind, *SHAPE, jnp.bfloat16) == (2e-3, 1e-3)
    assert cache_mod.xla_is_faster("interpret", kind, *SHAPE, jnp.bfloat16)


def test_auto_runs_xla_on_a_tuned_shape_where_xla_was_faster(auto_is_interpret):
    _tune(2e-3, 1e-3)
    a, b = _operands(24, 16, 40)
    auto = lambda a, b: matmul_mod.matmul(a, b, backend="auto")  # noqa: E731
    assert not _runs_kernel(auto, a, b)
    # A leading batch folds into M: (2, 12) rows are the tuned 24.
    assert not _runs_kernel(auto, a.reshape(2, 12, 40), b)
    # Named, the kernel runs; so it does with a config given (a tiling asked for), and on a
    # shape of the same bucket that was not tuned.
    assert _runs_kernel(lambda a, b: matmul_mod.matmul(a, b, backend="interpret"), a, b)
    assert _runs_kernel(lambda a, b: matmul_mod.matmul(a, b, config=SMALL), a, b)
    assert _runs_kernel(auto, *_operands(20, 16, 40))
    # XLA's dot on the tuned shape gives XLA's result, and differentiates.
    want = matmul_mod.matmul(a, b, backend="xla", out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(matmul_mod.matmul(a, b, out_dtype=jnp.float32)),
                                  np.asarray(want))
    grads = jax.grad(lambda a, b: auto(a, b).astype(jnp.float32).sum(), (0, 1))(a, b)
    assert [g.shape for g in grads] == [a.shape, b.shape]


def test_auto_keeps_the_kernel_where_it_was_faster_or_xla_was_not_timed(auto_is_interpret):
    a, b = _operands(24, 16, 40)
    auto = lambda a, b: matmul_mod.matmul(a, b, backend="auto")  # noqa: E731
    _tune(1e-3, 1e-3)  # a tie: the kernel stays
    assert _runs_kernel(auto, a, b)
    _tune(1e-3, 2e-3)
    assert _runs_kernel(auto, a, b)
    winners, timed = _tune(2e-3, 1e-3, compare_xla=False)  # not timed: nothing is known
    assert None not in timed and winners == {SHAPE: SMALL}
    assert _runs_kernel(auto, a, b)


def test_auto_reads_the_time_of_the_layout_it_runs(auto_is_interpret, monkeypatch):
    """transpose_b on a backend that multiplies a transposed copy runs the plain layout, so
    the plain layout's entry decides; on mosaic_gpu and triton it is the b^T entry."""
    _tune(2e-3, 1e-3)
    a, b = _operands(24, 16, 40)
    assert not _runs_kernel(lambda a, b: matmul_mod.matmul(a, b, transpose_b=True), a, b.T)
    kind = jax.devices()[0].device_kind
    cache_mod.store("triton", kind, *SHAPE, jnp.bfloat16, SMALL, 2e-3, "b", 1e-3)
    assert cache_mod.xla_is_faster("triton", kind, *SHAPE, jnp.bfloat16, "b")
    assert not cache_mod.xla_is_faster("triton", kind, *SHAPE, jnp.bfloat16)  # plain: untuned
    assert matmul_mod.auto_prefers_xla("triton", a, b.T, jnp.bfloat16, True)
    assert not matmul_mod.auto_prefers_xla("triton", a, b, jnp.bfloat16, False)


def test_dot_general_auto_falls_to_lax_on_a_shape_xla_won(auto_is_interpret):
    _tune(2e-3, 1e-3)
    a, b = _operands(24, 16, 40)
    dims = (((1,), (0,)), ((), ()))
    auto = dot_general_mod.make_dot_general("auto")
    named = dot_general_mod.make_dot_general("interpret")
    assert not _runs_kernel(lambda a, b: auto(a, b, dims), a, b)
    assert _runs_kernel(lambda a, b: named(a, b, dims), a, b)
    tiled = dot_general_mod.make_dot_general("auto", config=SMALL)  # a tiling asked for
    assert _runs_kernel(lambda a, b: tiled(a, b, dims), a, b)
    assert _runs_kernel(lambda a, b: auto(a, b, dims), *_operands(20, 16, 40))
    assert auto.fused_dense(a, b, None, "gelu") is None  # the plain layer, so XLA's dot
    assert named.fused_dense(a, b, None, "gelu") is not None


@pytest.mark.parametrize("entry", [
    {"seconds": 2e-3, "xla_seconds": "fast"}, {"seconds": 2e-3, "xla_seconds": -1.0},
    {"seconds": 2e-3, "xla_seconds": True}, {"seconds": None, "xla_seconds": 1e-3},
    {"seconds": 2e-3, "xla_seconds": float("nan")}, {"seconds": 2e-3}, "not a dict"])
def test_a_hand_edited_or_older_entry_keeps_the_kernel(private_autotune_cache, auto_is_interpret,
                                                       entry):
    kind = jax.devices()[0].device_kind
    key = cache_mod.cache_key("interpret", kind, *SHAPE, jnp.bfloat16, exact=True)
    (private_autotune_cache / "matmul_autotune.json").write_text(json.dumps({key: entry}))
    assert not cache_mod.xla_is_faster("interpret", kind, *SHAPE, jnp.bfloat16)
    assert _runs_kernel(lambda a, b: matmul_mod.matmul(a, b), *_operands(24, 16, 40))


def test_a_timer_without_a_duration_for_xla_is_named():
    with pytest.raises(ValueError, match=r"timer returned nan for XLA's dot; expected a finite"):
        _tune(1e-3, float("nan"), write_cache=False)


def test_compare_xla_must_be_a_bool():
    with pytest.raises(TypeError, match=r"compare_xla must be a bool; got 'no'"):
        autotune([SHAPE], backend="interpret", candidates=[SMALL], compare_xla="no")


def test_the_cli_prints_the_winner_against_xla(capsys):
    """Real timings of the interpret kernel and XLA's dot on this CPU: only the form is checked."""
    assert autotune_mod.main(["--backend", "interpret", "--shapes", "16x16x16",
                              "--candidates", json.dumps([SMALL.to_dict()])]) == 0
    out = capsys.readouterr().out
    assert "interpret 16x16x16: MatmulConfig(block_m=16" in out
    assert "us, XLA's dot " in out and "x XLA" in out
