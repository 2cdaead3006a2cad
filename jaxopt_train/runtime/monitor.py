"""A background NVML sampler of GPU health, named after DCGM's fields.

DCGM is what cluster dashboards scrape; naming our samples after its fields
(`DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_DEV_MEM_COPY_UTIL`, `DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`, ...)
lets a training run's log line up with them. Units follow DCGM: % for utilisation,
MiB for frame-buffer memory, W for power, C for temperature, MHz for clocks.
"""

from __future__ import annotations

import contextlib
import math
import operator
import statistics
import sys
import threading
import time
from typing import Any

from jaxopt_train.runtime.nvml import check_device_indices, device_handles, load_nvml, read_dcgm_fields

# An hour between samples is already useless for a training run; far larger values
# overflow threading.Event.wait's timeout and kill the sampler thread.
MAX_INTERVAL_S = 3600.0


def _check_interval(interval_s: Any) -> None:
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)):
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s=}")
    # nan passes `<= 0` and would busy-poll NVML; inf kills the sampler thread.
    if not (math.isfinite(interval_s) and 0 < interval_s <= MAX_INTERVAL_S):
        raise ValueError(f"interval_s must be a positive number of seconds, finite and at most "
                         f"{MAX_INTERVAL_S:g}, got {interval_s=}")


def _check_max_samples(max_samples: Any) -> None:
    try:
        operator.index(max_samples)
        is_int = not isinstance(max_samples, bool)
    except TypeError:
        is_int = False
    if not is_int:
        raise TypeError(f"max_samples must be an int >= 1, got {max_samples=}")
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples=}")


class GPUMonitor:
    """Samples every GPU's DCGM fields every `interval_s` seconds on a daemon thread.

    Off where NVML is absent (CPU machines): `start()` prints one line saying so and
    `latest()` / `summary()` return empty dicts, so a training loop can always use it.

    Example:
      >>> import time
      >>> with GPUMonitor(interval_s=0.1) as monitor:
      ...     for step in range(3):
      ...         time.sleep(0.1)  # a train step; then sink.write(step, {**metrics, **monitor.latest()})
      >>> summary = monitor.summary()  # {} where NVML finds no GPU

    Metric keys are `FIELD/gpuN`, e.g. `DCGM_FI_DEV_GPU_UTIL/gpu0`.

    Args:
      interval_s: seconds between samples, finite, in (0, 3600].
      devices: NVML GPU indices to watch, distinct ints >= 0 (default: all).
      max_samples: keep at most this many samples per GPU (oldest dropped), an int >= 1.
      log: where the one-line "monitoring off" notice goes (default stderr).

    Raises:
      TypeError: for a `devices` that is not a list of ints, or a non-int `max_samples`.
      ValueError: for a negative or repeated device index, or an out-of-range
        `interval_s` / `max_samples`.
    """

    def __init__(self, interval_s: float = 1.0, devices: list[int] | None = None,
                 *, max_samples: int = 100_000, log=None):
        _check_interval(interval_s)
        _check_max_samples(max_samples)
        self.interval_s = float(interval_s)
        # Checked here: in start() a wrong type would read as "NVML could not list GPUs".
        self._device_indices = check_device_indices(devices)
        self._max_samples = operator.index(max_samples)
        self._log = log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._handles: list[tuple[int, Any]] = []
        # samples[gpu] = list of (unix time, {field: value})
        self.samples: dict[int, list[tuple[float, dict[str, float]]]] = {}
        self.enabled = False
        self.reason = ""

    def start(self) -> GPUMonitor:
        """Starts sampling (a no-op with one notice line where NVML is unavailable)."""
        if self._stop.is_set():  # the sampler thread would exit at once
            raise RuntimeError("GPUMonitor.start(): this monitor was stopped and cannot restart; "
                               "create a new GPUMonitor (the stopped one keeps its samples)")
        if self._thread is not None:
            raise RuntimeError("GPUMonitor.start(): already started")
        nvml, reason = load_nvml()
        if nvml is not None:
            try:
                self._handles = device_handles(nvml, self._device_indices)
            except Exception as err:
                with contextlib.suppress(Exception):
                    nvml.nvmlShutdown()
                if isinstance(err, ValueError):
                    raise
                nvml, reason = None, f"NVML could not list GPUs: {err}"
            else:
                if not self._handles:
                    nvml.nvmlShutdown()
                    nvml, reason = None, "NVML sees no GPU"
        if nvml is None:
            self.reason = reason
            print(f"GPU monitoring off: {reason}", file=self._log or sys.stderr)
            return self
        self._nvml, self.enabled = nvml, True
        self.samples = {index: [] for index, _ in self._handles}
        self._sample_once()  # so latest() has data right after start()
        self._thread = threading.Thread(target=self._run, name="GPUMonitor", daemon=True)
        self._thread.start()
        return self

    def _sample_once(self) -> None:
        now = time.time()
        for index, handle in self._handles:
            sample = read_dcgm_fields(self._nvml, handle)
            with self._lock:
                buffer = self.samples[index]
                buffer.append((now, sample))
                if len(buffer) > self._max_samples:
                    del buffer[: len(buffer) - self._max_samples]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample_once()
            except Exception as err:  # a sampler must never take the training run down
                print(f"GPU monitoring stopped: {err}", file=self._log or sys.stderr)
                return

    def stop(self) -> None:
        """Stops sampling and shuts NVML down; the samples stay readable."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def __enter__(self) -> GPUMonitor:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def latest(self) -> dict[str, float]:
        """The newest sample of every GPU as flat `{"FIELD/gpuN": value}`."""
        flat: dict[str, float] = {}
        with self._lock:
            for index, buffer in self.samples.items():
                if buffer:
                    flat.update({f"{field}/gpu{index}": value for field, value in buffer[-1][1].items()})
        return flat

    def summary(self) -> dict[str, dict[str, float]]:
        """`{"FIELD/gpuN": {"mean", "min", "max", "last", "count"}}` over all samples so far."""
        series: dict[str, list[float]] = {}
        with self._lock:
            for index, buffer in self.samples.items():
                for _, sample in buffer:
                    for field, value in sample.items():
                        series.setdefault(f"{field}/gpu{index}", []).append(value)
        return {key: {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
                      "last": values[-1], "count": float(len(values))}
                for key, values in series.items()}

