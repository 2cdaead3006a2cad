"""Test-wide JAX settings, made once before any test imports jax-using code.

Eight emulated CPU devices let every data-parallel and collective test run on
a laptop or CI box; strict dtype promotion turns silent up-casts into errors.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")


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


@pytest.fixture
def cpu_devices():
    """The 8 emulated CPU devices (also on a GPU machine)."""
    devices = jax.devices("cpu")
    assert len(devices) == 8, f"expected 8 emulated CPU devices, got {len(devices)}"
    return devices
