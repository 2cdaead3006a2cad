"""Lazy access to NVIDIA's NVML (the `pynvml` module of nvidia-ml-py).

NVML is the one boundary between this package and the GPU driver for health data;
everything here goes through `load_nvml()`, so tests can put a fake module in
`sys.modules["pynvml"]` and exercise the GPU code paths on a CPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
