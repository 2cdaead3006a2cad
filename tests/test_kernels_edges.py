"""Edge cases of `autotune`'s arguments: bad input fails before the sweep with a message
naming the argument, and whatever the sweep measured reaches the cache."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from jaxopt_train.kernels import MatmulConfig, autotune

autotune_mod = importlib.import_module("jaxopt_train.kernels.autotune")
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, num_stages=1)


@pytest.fixture(autouse=True)
def _private_cache(private_autotune_cache):
    """Every test sees an empty autotune cache in its own directory (conftest)."""


def _refuses_before_timing(error, match, **kwargs):
    timed = []
    kwargs = {"backend": "interpret", "candidates": [SMALL], "write_cache": False, **kwargs}
    with pytest.raises(error, match=match):
        autotune(kwargs.pop("shapes", [(16, 16, 16)]),
                 timer=lambda fn: timed.append(fn) or 1.0, **kwargs)
    assert timed == []


@pytest.mark.parametrize("candidates, error, match", [
    # None ran matmul's default config, then crashed storing `None.to_dict()`.
    ([None], TypeError, r"candidates\[0\]=None must be a MatmulConfig"),
    ([SMALL, 16], TypeError, r"candidates\[1\]=16 must be a MatmulConfig"),
    # A bad field made every candidate "fail to build": "no candidate passed the check".
    ([{"block_x": 16}], ValueError, r"candidates\[0\]: unknown MatmulConfig fields \['block_x'\]"),
    ([{"block_m": 48}], ValueError, r"candidates\[0\]: MatmulConfig.block_m=48 must be a power"),
    (SMALL, TypeError, r"candidates must be a list of configs; got one MatmulConfig"),
])
def test_autotune_refuses_candidates_that_are_not_configs_before_tuning(candidates, error,
                                                                      match):
    _refuses_before_timing(error, match, candidates=candidates)


def test_autotune_takes_candidates_as_dicts_of_fields_and_caches_them(tmp_path):
    """A dict of fields (what matmul's `config` and the CLI's --candidates take) was timed,
    then lost with the sweep: `store` called `.to_dict()` on it."""
    winners = autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL.to_dict()],
                       timer=lambda fn: 1e-3)
    assert winners == {(16, 16, 16): SMALL}
    data = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert [entry["config"] for entry in data.values()] == [SMALL.to_dict()] * 2


@pytest.mark.parametrize("seconds", [np.float32(1e-3), np.array(1e-3, np.float32)])
def test_autotune_stores_what_a_timer_returns_as_a_number(tmp_path, seconds):
    """A timer returning a numpy (or JAX) scalar finished the sweep, then crashed writing
    the cache ("Object of type float32 is not JSON serializable"), losing its winner."""
    autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL], timer=lambda fn: seconds)
    data = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert [entry["seconds"] for entry in data.values()] == [pytest.approx(1e-3)] * 2


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0])
def test_autotune_refuses_a_timer_that_returns_no_duration(seconds):
    """A NaN time won the shape: no later candidate compares below NaN."""
    other = MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1)
    with pytest.raises(ValueError, match=r"timer returned .* for .*block_m=16.*; expected a "
                                         r"finite number of seconds >= 0"):
        autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL, other],
                 timer=lambda fn: seconds, write_cache=False)


@pytest.mark.parametrize("shapes, match", [
    ((16, 16, 16), r"shapes: each must be \(M, N, K\) of positive ints; got 16 .*e.g. \[\(1024, 1024, 1024\)\]"),
    ([(True, 16, 16)], r"positive ints; got \(True, 16, 16\)"),
])
def test_autotune_refuses_a_shape_list_it_would_misread(shapes, match):
    """One (M, N, K) tuple for the list of them raised "'int' object is not iterable";
    True passed as the dim 1."""
    _refuses_before_timing(ValueError, match, shapes=shapes)


@pytest.mark.parametrize("budget_s", ["5", True])
def test_autotune_refuses_a_budget_that_is_not_seconds(budget_s):
    _refuses_before_timing(ValueError, f"budget_s={budget_s!r} must be None or",
                           budget_s=budget_s)


def test_transposed_tuning_times_only_configs_that_read_the_operand_as_stored(monkeypatch):
    """A Mosaic GPU config whose K tile is not 128 B multiplies a transposed copy with the
    plain layout's config at run time: timed and cached as the transposed winner, its time
    was of a kernel the model never runs."""
    import jax.numpy as jnp

    matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")
    timed = []

    def fake_product(a, b, transposed, out_dtype, backend, config, bias=None, activation=None):
        timed.append(config)
        lhs, rhs = (a.T, b) if transposed == "a" else (a, b.T)
        return jnp.dot(lhs, rhs, preferred_element_type=jnp.float32).astype(out_dtype)

    monkeypatch.setattr(matmul_mod, "_product_with_transpose", fake_product)
    monkeypatch.setattr(matmul_mod, "resolve_backend", lambda backend: backend)
    as_stored, copy_k, lowered = (MatmulConfig(block_m=64, block_n=64, block_k=64, num_stages=1),
                                  MatmulConfig(block_m=64, block_n=64, block_k=128, num_stages=1),
                                  MatmulConfig(block_m=64, block_n=64, block_k=64, num_stages=1,
                                               warpgroup_lowering=True))
    assert matmul_mod.reads_transposed_as_stored("mosaic_gpu", as_stored, jnp.bfloat16)
    assert not matmul_mod.reads_transposed_as_stored("mosaic_gpu", copy_k, jnp.bfloat16)
    assert not matmul_mod.reads_transposed_as_stored("mosaic_gpu", lowered, jnp.bfloat16)
    assert matmul_mod.reads_transposed_as_stored("triton", copy_k, jnp.bfloat16)
    winners = autotune([(64, 64, 128)], backend="mosaic_gpu", candidates=[copy_k, as_stored, lowered],
                       transposed="b", timer=lambda fn: (fn(), 0.5 if timed[-1] is copy_k else 1.0)[1],
                       input_sets=1, write_cache=False)
    assert winners == {(64, 64, 128): as_stored} and copy_k not in timed and lowered not in timed
    with pytest.raises(ValueError, match=r"transposed='b': no candidate reads the operand as stored "
                                         r"on backend='mosaic_gpu' \(mosaic_gpu needs block_k"):
        autotune([(64, 64, 128)], backend="mosaic_gpu", candidates=[copy_k], transposed="b",
                 timer=lambda fn: 1.0, input_sets=1, write_cache=False)


@pytest.mark.parametrize("name, stored", [("bf16", "bfloat16"), ("fp16", "float16"),
                                          ("f32", "bfloat16"), ("BF16", "bfloat16")])
def test_autotune_takes_the_dtype_names_matmul_takes(tmp_path, name, stored):
    """matmul(out_dtype="bf16") works; autotune(dtype="bf16") failed with numpy's "data type
    'bf16' not understood"."""
    autotune([(16, 16, 16)], name, backend="interpret", candidates=[SMALL], timer=lambda fn: 1e-3,
             input_sets=1)
    keys = json.loads((tmp_path / "matmul_autotune.json").read_text())
    assert keys and all(f"|{stored}|" in key for key in keys), keys


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "int8"}, r"dtype='int8' is not a known dtype name; expected one of \["),
    ({"dtype": "float64"}, r"dtype=float64 is not a matmul input dtype"),
    ({"input_sets": True}, r"input_sets=True must be an int >= 1"),  # was taken as 1
    ({"input_sets": 2.0}, r"input_sets=2.0 must be an int >= 1"),
])
def test_autotune_refuses_a_dtype_name_or_input_sets_it_cannot_use(kwargs, match):
    _refuses_before_timing(ValueError, match, **kwargs)


def test_autotune_takes_a_numpy_int_of_input_sets():
    winners = autotune([(16, 16, 16)], backend="interpret", candidates=[SMALL],
                       timer=lambda fn: 1e-3, input_sets=np.int64(1), write_cache=False)
    assert winners == {(16, 16, 16): SMALL}


def test_a_cache_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """JAXOPT_TRAIN_CACHE_DIR="~/x" made a folder literally named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", "~/tuned")
    monkeypatch.chdir(tmp_path)
    assert autotune_mod.cache_path() == tmp_path / "home" / "tuned" / "matmul_autotune.json"
    autotune_mod.store("interpret", "cpu", 16, 16, 16, "bfloat16", SMALL, 1e-3)
    assert (tmp_path / "home" / "tuned" / "matmul_autotune.json").is_file()
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("cache_dir", [None, "~/tuned"])
def test_without_a_home_lookups_find_nothing_and_stores_say_what_to_set(tmp_path, monkeypatch,
                                                                        caplog, cache_dir):
    """With no $HOME and no password entry, Path.home() raised RuntimeError inside the cache
    lookup, so every non-xla matmul failed."""
    import logging
    import pwd

    monkeypatch.chdir(tmp_path)  # where an unexpanded "~/tuned" would be made
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    if cache_dir is None:
        monkeypatch.delenv("JAXOPT_TRAIN_CACHE_DIR")
    else:
        monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", cache_dir)
    with caplog.at_level(logging.DEBUG, logger=autotune_mod.__name__):
        assert autotune_mod.lookup("interpret", "cpu", 16, 16, 16, "bfloat16") is None
    assert "no autotune cache to read" in caplog.text
    with pytest.raises(RuntimeError, match=r"cannot be resolved .*set \$JAXOPT_TRAIN_CACHE_DIR"):
        autotune_mod.store("interpret", "cpu", 16, 16, 16, "bfloat16", SMALL, 1e-3)
    _refuses_before_timing(OSError, r"set \$JAXOPT_TRAIN_CACHE_DIR to an absolute folder, or "
                                    r"pass write_cache=False", write_cache=True)


def test_two_corrupt_caches_moved_aside_in_one_second_are_both_kept(tmp_path, monkeypatch):
    """The second `.corrupt-<time>` replaced the first: the user's file was lost."""
    monkeypatch.setattr(autotune_mod.time, "strftime", lambda fmt, *args: "20250101-000000")
    path = tmp_path / "matmul_autotune.json"
    for content in (b"[1]", b"[2]"):
        path.write_bytes(content)
        autotune_mod.store("interpret", "cpu", 16, 16, 16, "bfloat16", SMALL, 1e-3)
    kept = sorted(tmp_path.glob("matmul_autotune.json.corrupt-*"))
    assert sorted(p.read_bytes() for p in kept) == [b"[1]", b"[2]"], kept


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
