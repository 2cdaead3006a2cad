"""Lazy access to NVIDIA's NVML (the `pynvml` module of nvidia-ml-py).

NVML is the one boundary between this package and the GPU driver for health data;
everything here goes through `load_nvml()`, so tests can put a fake module in
`sys.modules["pynvml"]` and exercise the GPU code paths on a CPU machine.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any


def load_nvml() -> tuple[ModuleType | None, str]:
    """Imports and initialises NVML.

    Returns:
      `(pynvml, "")` when NVML is usable (call `pynvml.nvmlShutdown()` when done), or
      `(None, reason)` saying why not (package missing, no driver, no GPU).
    """
    try:
        import pynvml  # GPU-only dependency: imported lazily by design
    except ImportError as err:
        return None, f"pynvml (nvidia-ml-py) is not installed: {err}"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        return None, f"NVML could not start (no NVIDIA driver or GPU?): {err}"
    return pynvml, ""


@contextlib.contextmanager
def nvml_session() -> Iterator[tuple[ModuleType | None, str]]:
    """`load_nvml()` as a context manager that shuts NVML down on exit."""
    nvml, reason = load_nvml()
    try:
        yield nvml, reason
    finally:
        if nvml is not None:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()


def as_text(value: Any) -> str:
    """NVML returns bytes in old releases of the bindings and str in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def try_call(fn, *args, default=None):
    """Calls an NVML getter, returning `default` where the GPU does not support it."""
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: field absent on this GPU
        return default


def check_device_indices(indices: Any) -> list[int] | None:
    """`indices` (None: all GPUs) as a list of distinct ints >= 0.

    Any iterable of ints is accepted, NumPy ints included; bools are not (True would
    mean GPU 1). A repeated index would read that GPU twice per sample.

    Raises:
      TypeError: for something that is not a list of ints (a bare int, a string).
      ValueError: for a negative or repeated index.
    """
    if indices is None:
        return None
    expected = "GPU indices must be a list of distinct ints >= 0 such as [0, 1] (None: all GPUs)"
    try:  # list() once: an iterator would be used up by the checks
        given = None if isinstance(indices, (str, bytes, Mapping)) else list(indices)
    except TypeError:  # not iterable: a bare int, a 0-d array
        given = None
    if given is None:
        raise TypeError(f"{expected}; got {type(indices).__name__}: {indices!r}")
    try:  # operator.index takes NumPy ints and refuses floats and strings
        as_ints = [operator.index(i) for i in given if not isinstance(i, bool)]
    except TypeError:
        as_ints = []
    if len(as_ints) != len(given):
        raise TypeError(f"{expected}; got {indices!r}")
    if any(i < 0 for i in as_ints) or len(set(as_ints)) != len(as_ints):
        raise ValueError(f"{expected}; got {indices!r}")
    return as_ints


def device_handles(nvml: ModuleType, indices: list[int] | None = None) -> list[tuple[int, Any]]:
    """`(index, handle)` for the requested GPU indices (all GPUs when None)."""
    count = nvml.nvmlDeviceGetCount()
    if indices is None:
        indices = list(range(count))
    bad = [i for i in indices if not 0 <= i < count]
    if bad:
        raise ValueError(f"GPU indices {bad} out of range: NVML sees {count=} GPUs")
    return [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]


# DCGM field name -> how to read it from NVML. Units follow DCGM: %, MiB, W, C, MHz, count.
def _util(nvml, h, attr):
    return getattr(nvml.nvmlDeviceGetUtilizationRates(h), attr)


def _ecc(nvml, h, error_type, counter_type):
    return nvml.nvmlDeviceGetTotalEccErrors(h, getattr(nvml, error_type), getattr(nvml, counter_type))


def clocks_event_reasons(nvml: ModuleType, handle: Any) -> int:
    """The bit mask of why the GPU's clocks are below their maximum (0x4: the software
    power cap). nvidia-ml-py renamed the getter from "Throttle" to "Event" reasons."""
    getter = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
              or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons"))
    return getter(handle)


DCGM_FIELDS: dict[str, Any] = {
    "DCGM_FI_DEV_GPU_UTIL": lambda nvml, h: _util(nvml, h, "gpu"),
    "DCGM_FI_DEV_MEM_COPY_UTIL": lambda nvml, h: _util(nvml, h, "memory"),
    "DCGM_FI_DEV_FB_USED": lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20,
    "DCGM_FI_DEV_FB_FREE": lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).free / 2**20,
    "DCGM_FI_DEV_POWER_USAGE": lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
    "DCGM_FI_DEV_GPU_TEMP": lambda nvml, h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
    "DCGM_FI_DEV_SM_CLOCK": lambda nvml, h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
    "DCGM_FI_DEV_MEM_CLOCK": lambda nvml, h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": clocks_event_reasons,
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": lambda nvml, h: _ecc(
        nvml, h, "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": lambda nvml, h: _ecc(
        nvml, h, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
}


def read_dcgm_fields(nvml: ModuleType, handle: Any) -> dict[str, float]:
    """One sample of every DCGM field this GPU supports (unsupported ones are left out)."""
    sample = {}
    for name, read in DCGM_FIELDS.items():
        value = try_call(read, nvml, handle)
        if value is not None:
            sample[name] = float(value)
    return sample


def nvml_indices(devices) -> tuple[list[int] | None, str]:
    """The NVML indices of these JAX GPU devices, or None and why they cannot be named.

    NVML numbers every GPU of the host and ignores CUDA_VISIBLE_DEVICES, while JAX numbers
    the visible ones: with CUDA_VISIBLE_DEVICES=1 JAX's GPU 0 is NVML's GPU 1. Both follow
    the PCI bus order here (CUDA's default order lists identical GPUs that way).
    """
    if not devices or any(d.platform != "gpu" for d in devices):
        return None, "not running on GPUs"
    local = [d.id if getattr(d, "local_hardware_id", None) is None else d.local_hardware_id
             for d in devices]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return local, ""
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        return None, f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs by UUID; not mapped to NVML"
    if max(local) >= len(entries):
        return None, f"JAX device ids {local} exceed CUDA_VISIBLE_DEVICES={visible!r}"
    return [int(entries[i]) for i in local], ""
