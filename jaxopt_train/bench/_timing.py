"""Timing and memory sampling for the training benchmark.

Steady-state timing follows the project rule: warm up, then time bursts of
back-to-back dispatches with ONE device sync at the end of each burst, and
report the median burst. A separate, slower *trace* pass syncs after every
step to get per-step time and memory for the plot; it never feeds the table's
step time.

Memory in use comes from the allocator (`device.memory_stats()`, GPU/TPU). On
backends without allocator statistics (CPU) it falls back to the bytes of the
live `jax.Array`s resident on the device, which misses XLA's scratch buffers;
every figure says which source it came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import numbers
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxopt_train._checks import is_int
from jaxopt_train.runtime.nvml import nvml_indices

ALLOCATOR = "allocator"
LIVE_ARRAYS = "live-arrays"
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap: clocks lowered to hold the power limit


def _memory_stats(device) -> dict[str, int] | None:
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None


def memory_source(device) -> str:
    """"allocator" when `device` reports allocator statistics, else "live-arrays"."""
    stats = _memory_stats(device)
    return ALLOCATOR if stats and "bytes_in_use" in stats else LIVE_ARRAYS


def live_array_bytes(device) -> int:
    """Bytes of the live arrays with a shard on `device` (XLA scratch not included)."""
    total = 0
    for array in jax.live_arrays():
        try:
            if array.is_deleted() or device not in array.sharding.device_set:
                continue
            shard_shape = array.sharding.shard_shape(array.shape)
        except Exception:  # noqa: BLE001 - an array freed while we look at it
            continue
        total += math.prod(shard_shape) * np.dtype(array.dtype).itemsize
    return total


def bytes_in_use(device) -> int:
    """Bytes in use on `device` now, from the source `memory_source` names."""
    stats = _memory_stats(device)
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    return live_array_bytes(device)


def peak_bytes_in_use(device) -> int | None:
    """The allocator's process-wide high-water mark, or None where there is none."""
    stats = _memory_stats(device)
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return None


StepFn = Callable[[Any], tuple[Any, Any]]


class Handoff:
    """A state handed to `warm_up`, `time_bursts` or `trace_steps` so the caller keeps no
    reference of its own: given one, they take the state out, step it, put the last state
    back and return the same Handoff.

    A caller's own reference would keep the state entering the call alive while the steps
    run; for a non-donated step that is one more full copy of the training state in every
    memory sample (and in the allocator's peak).
    """

    __slots__ = ("state",)

    def __init__(self, state: Any):
        self.state = state

    def take(self) -> Any:
        state, self.state = self.state, None
        return state


def _take(state: Any) -> tuple[Handoff | None, Any]:
    return (state, state.take()) if isinstance(state, Handoff) else (None, state)


def _give_back(handoff: Handoff | None, state: Any) -> Any:
    if handoff is None:
        return state
    handoff.state = state
    return handoff


@dataclasses.dataclass
class BurstTiming:
    """Per-optimizer-step seconds of each timed burst."""

    wall_s: list[float]  # burst wall time / steps (device-bound => device time per step)
    # Host time to dispatch one step: the burst's fastest call / its steps. Once the device's
    # queue is full a call also waits for it (gpt-1b on an H200: ~63 of its 87 ms), and waiting
    # only adds time, so the fastest call is the one closest to the pure launch cost.
    dispatch_s: list[float]
    steps_per_burst: int
    in_calls_s: list[float] = dataclasses.field(default_factory=list)  # all in-call time / steps

    @property
    def step_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def dispatch_step_s(self) -> float:
        return statistics.median(self.dispatch_s)


def _check_counts(**counts: tuple[Any, int]) -> None:
    """Each `name=(value, least)` must be an int (not a bool) >= least: a zero, a float or a
    bool reached the timing loops as an empty median or a division by zero, or ran a count
    nobody asked for."""
    for name, (value, least) in counts.items():
        if not is_int(value) or value < least:
            raise ValueError(f"{name}={value!r} must be an int >= {least}")


def warm_up(step: StepFn, state: Any, calls: int, seconds: float = 0.0) -> Any:
    """Runs `calls` dispatches (at least one) and waits for them; then keeps running bursts
    of that many until `seconds` have passed since the start. Returns the last state (or
    `state` itself, refilled, when it is a `Handoff`).

    The time-based part is for GPUs that hit their power cap: an H200 running gpt-1b
    draws its 700 W within a second, and its SM clock then sinks from 1980 MHz towards
    ~1550 MHz as the chip warms, so steps timed in the first seconds of load run a few
    percent faster than the steady state (BENCHMARKS.md, twelfth session).
    """
    _check_counts(calls=(calls, 0))
    # NaN never compares >= and inf never arrives: either would warm up forever.
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= seconds < math.inf:
        raise ValueError(f"seconds={seconds!r} must be a finite number >= 0")
    handoff, state = _take(state)
    start = time.perf_counter()
    while True:
        out = None
        for _ in range(max(1, calls)):
            state, out = step(state)
        jax.block_until_ready((state, out))
        if time.perf_counter() - start >= seconds:
            return _give_back(handoff, state)


def time_bursts(step: StepFn, state: Any, *, bursts: int, calls_per_burst: int,
                steps_per_call: int) -> tuple[Any, BurstTiming]:
    """Times `bursts` bursts of `calls_per_burst` back-to-back dispatches, one sync each."""
    _check_counts(bursts=(bursts, 1), calls_per_burst=(calls_per_burst, 1),
                  steps_per_call=(steps_per_call, 1))
    handoff, state = _take(state)
    wall, dispatch, in_calls = [], [], []
    steps = calls_per_burst * steps_per_call
    for _ in range(bursts):
        call_s = []
        out = None
        start = time.perf_counter()
        for _ in range(calls_per_burst):
            t0 = time.perf_counter()
            state, out = step(state)
            call_s.append(time.perf_counter() - t0)
        jax.block_until_ready((state, out))
        wall.append((time.perf_counter() - start) / steps)
        dispatch.append(min(call_s) / steps_per_call)
        in_calls.append(sum(call_s) / steps)
    return _give_back(handoff, state), BurstTiming(wall, dispatch, steps, in_calls)


@dataclasses.dataclass
class Trace:
    """Per-dispatch samples of the trace pass (synced after every dispatch)."""

    step_s: list[float] = dataclasses.field(default_factory=list)  # per optimizer step
    bytes_in_flight: list[int] = dataclasses.field(default_factory=list)  # right after dispatch
    bytes_at_rest: list[int] = dataclasses.field(default_factory=list)  # after the sync
    source: str = LIVE_ARRAYS

    @property
    def swing_bytes(self) -> int | None:
        samples = self.bytes_in_flight + self.bytes_at_rest
        return max(samples) - min(samples) if samples else None

    @property
    def max_bytes(self) -> int | None:
        samples = self.bytes_in_flight + self.bytes_at_rest
        return max(samples) if samples else None


def trace_steps(step: StepFn, state: Any, *, calls: int, steps_per_call: int,
                device) -> tuple[Any, Trace]:
    """Runs `calls` dispatches, each synced, sampling memory in use around each one."""
    _check_counts(calls=(calls, 0), steps_per_call=(steps_per_call, 1))
    handoff, state = _take(state)
    trace = Trace(source=memory_source(device))
    trace.bytes_at_rest.append(bytes_in_use(device))
    for _ in range(calls):
        start = time.perf_counter()
        state, out = step(state)
        trace.bytes_in_flight.append(bytes_in_use(device))
        jax.block_until_ready((state, out))
        trace.step_s.append((time.perf_counter() - start) / steps_per_call)
        trace.bytes_at_rest.append(bytes_in_use(device))
    return _give_back(handoff, state), trace


@contextlib.contextmanager
def gpu_clocks(devices, interval_s: float = 0.1) -> Iterator[dict[str, Any]]:
    """Samples the SM clock, board power and clock-event reasons of `devices`' GPUs while
    the block runs (NVML, on a background thread).

    Yields a dict that is filled when the block ends: `sm_clock_mhz` (median over the
    samples of every GPU, and `sm_clock_mhz_range`), `power_w` (median), `power_capped`
    (share of samples whose clocks the power cap lowered) and `samples`; or only `reason`
    where nothing could be sampled (CPU, no NVML, unmapped GPUs). A power-capped GPU's
    MFU depends on this clock, so the bench reports it next to each row.
    """
    figures: dict[str, Any] = {}
    indices, reason = nvml_indices(devices)
    monitor = None
    if indices is not None:
        monitor, reason = _start_monitor(indices, interval_s)
    try:
        yield figures
    finally:
        if monitor is None:
            figures["reason"] = reason
        else:
            monitor.stop()
            figures.update(_clock_figures(monitor.samples))


def _start_monitor(indices: list[int], interval_s: float):
    """(a started GPUMonitor of these NVML GPUs, "") or (None, why there is none)."""
    from jaxopt_train.runtime.monitor import GPUMonitor  # noqa: PLC0415 - NVML is GPU-only

    monitor = GPUMonitor(interval_s, devices=sorted(set(indices)), log=io.StringIO())
    try:
        monitor.start()
    except Exception as err:  # noqa: BLE001 - a missing figure must not stop a benchmark
        return None, f"NVML could not watch GPUs {indices}: {err}"
    return (monitor, "") if monitor.enabled else (None, monitor.reason)


def _clock_figures(samples: dict[int, list[tuple[float, dict[str, float]]]]) -> dict[str, Any]:
    clocks, power, reasons = [], [], []
    for series in samples.values():
        for _, sample in series:
            if "DCGM_FI_DEV_SM_CLOCK" in sample:
                clocks.append(sample["DCGM_FI_DEV_SM_CLOCK"])
            if "DCGM_FI_DEV_POWER_USAGE" in sample:
                power.append(sample["DCGM_FI_DEV_POWER_USAGE"])
            if "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" in sample:
                reasons.append(int(sample["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]))
    if not clocks:
        return {"reason": "NVML returned no SM clock samples"}
    return {"sm_clock_mhz": statistics.median(clocks),
            "sm_clock_mhz_range": [min(clocks), max(clocks)],
            "power_w": statistics.median(power) if power else None,
            "power_capped": (sum(bool(r & SW_POWER_CAP) for r in reasons) / len(reasons)
                             if reasons else None),
            "samples": len(clocks), "nvml_gpus": sorted(samples)}
