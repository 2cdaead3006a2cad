"""Test-wide JAX settings, made once before any test imports jax-using code.

Eight emulated CPU devices let every data-parallel and collective test run on
a laptop or CI box; strict dtype promotion turns silent up-casts into errors.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# (doctor starts no backend: it reads the installed distributions' metadata)
from jaxopt_train.runtime.doctor import _jax_cuda_plugins, _release, _version  # noqa: E402

# The suite's programs are tiny, so its CPU time is mostly XLA compiling them, and
# most of that is LLVM optimising code that then runs for milliseconds. LLVM at -O0
# cut tests/test_models.py from 154-159 s to 92-95 s on a 2-core machine (XLA's default
# level 3; level 2: 105 s), and the whole suite from 18-21 to 15-17 minutes, with every
# test passing at unchanged tolerances (fast-math stays off, XLA CPU's default, at any
# level). Not on a GPU machine: there the flag would also lower the optimisation of the
# GPU kernels the GPU tests check.
#
# XLA CPU's older elemental emitters instead of its MLIR fusion emitters: most of the suite's
# compiles are tiny eager ops (a random draw or a divide per new shape, 60-250 ms each), and
# these compile ~40% faster with the older emitters, whole programs ~20% (tests/test_models.py
# with tests/test_bench_precision.py: 175 -> 107 s on 2 cores; the suite 24 -> 16 minutes).
# They round differently: two programs computing the same values may land a few ulps apart,
# and their tanh is less exact far from zero (the tests whose checks this changed say so where
# they check). XLA aborts the process on a flag it does not know, so this one is set only on
# jaxlib versions checked to have it (0.11.2 aborts on it).
_CPU_TEST_FLAGS = {"--xla_backend_optimization_level": "0"}
if _release(_version("jaxlib") or "")[:2] == (0, 10):
    _CPU_TEST_FLAGS["--xla_cpu_use_fusion_emitters"] = "false"
if not _jax_cuda_plugins():
    for _flag, _value in _CPU_TEST_FLAGS.items():
        if _flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# XLA's cheapest optimisation effort for every test program: ~10% faster compiles
# (tests/test_models.py with tests/test_kernels_flax_layers.py: 139 -> 126 s on 2 cores),
# where it was the trainer modules' alone. Not on a GPU machine, for the reason above; jax 0.11
# (the GPU machine's) has no such option.
if hasattr(jax.config, "jax_exec_time_optimization_effort") and not _jax_cuda_plugins():
    jax.config.update("jax_exec_time_optimization_effort", -1.0)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.devices() has none)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def jax_compile_cache(tmp_path_factory):
    """A persistent compilation cache shared by the trainer test modules.

    Their loop tests use one tiny run shape, so its train and eval steps
    compile once per pytest session. Restored after the module.
    """
    cache = tmp_path_factory.getbasetemp() / "jaxopt_train_jax_cache"
    cache.mkdir(exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(cache), "jax_persistent_cache_min_compile_time_secs": 0.0}
    old = {name: getattr(jax.config, name) for name in settings}
    for name in old:
        jax.config.update(name, settings[name])
    yield
    for name, value in old.items():
        jax.config.update(name, value)


@pytest.fixture
def real_run_xla_flags():
    """XLA_FLAGS without the suite's own CPU flags (above): for a subprocess that must compile
    as a user's run does."""
    return " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                    if flag.split("=")[0] not in _CPU_TEST_FLAGS)


@pytest.fixture
def cpu_devices():
    """The 8 emulated CPU devices (also on a GPU machine)."""
    devices = jax.devices("cpu")
    assert len(devices) == 8, f"expected 8 emulated CPU devices, got {len(devices)}"
    return devices


# The primitives our matmul kernels trace to: pallas_call (interpret on CPU, Mosaic on TPU);
# core_map for Mosaic GPU's plgpu.kernel (mpmd_map on jax 0.10), which has no pallas_call (a
# check for "pallas_call" alone failed on the GPU machine, in two tests); and
# jax-triton's custom call.
KERNEL_PRIMITIVES = frozenset({"pallas_call", "core_map", "mpmd_map", "triton_kernel_call"})


def _primitives(jaxpr, in_scan=False, out=None):
    """(primitive name, inside a scan?) of every equation, nested jaxprs included."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, in_scan))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    _primitives(inner, in_scan or eqn.primitive.name == "scan", out)
    return out


@pytest.fixture
def jaxpr_primitives():
    """`jaxpr_primitives(closed_jaxpr)`: (primitive name, inside a scan?) of every equation,
    nested jaxprs included (walked rather than read from the printed text, whose layout changes
    between jax versions: 0.11 prints a jit's body apart from the equation that calls it)."""
    return lambda closed: _primitives(closed.jaxpr)


@pytest.fixture
def kernel_in_jaxpr():
    """`kernel_in_jaxpr(closed_jaxpr)`: whether it calls one of our matmul kernels, nested
    jaxprs included (see `jaxpr_primitives`)."""
    return lambda closed: any(name in KERNEL_PRIMITIVES for name, _ in _primitives(closed.jaxpr))


@pytest.fixture
def fresh_kernel_launches():
    """Evicts the matmul kernels' launch jit (its traces and executables) before and after the
    test. A test that swaps a kernel for a stand-in must not reuse a launch traced with the real
    one, nor leave one traced with the stand-in (on a GPU machine the next test would run it).
    jax.clear_caches() did this too, but also dropped every program the worker had compiled."""
    import importlib  # noqa: PLC0415

    launch = importlib.import_module("jaxopt_train.kernels.matmul")._launch
    launch.clear_cache()
    yield
    launch.clear_cache()


@pytest.fixture
def private_autotune_cache(tmp_path, monkeypatch):
    """An empty autotune cache in the test's own directory (and no entries read before)."""
    from jaxopt_train.kernels import autotune_cache  # noqa: PLC0415

    monkeypatch.setenv("JAXOPT_TRAIN_CACHE_DIR", str(tmp_path))
    autotune_cache._loaded.clear()
    yield tmp_path
    autotune_cache._loaded.clear()
