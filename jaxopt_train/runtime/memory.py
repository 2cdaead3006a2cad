"""Device memory: limit what XLA may take, measure what a block used, check a step fits.

- `limit_memory` sets the XLA client allocator before the backend starts: JAX's answer
  to MIG quotas and CUDA memory limits (a second process on the same GPU then fits).
- `track_memory` reports peak and delta bytes per device around a block or function.
- `fits` compiles ahead of time and compares XLA's memory analysis with a budget,
  without allocating anything, so a GPU-sized budget can be checked on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import fractions
import functools
import inspect
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxopt_train.runtime._backend import require_backend_not_started

_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"
# jaxlib >= 0.10 reads the name above and refuses start-up when both are set.
_DEPRECATED_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
# The only spellings jaxlib reads as "off"; any other value preallocates ("no", "FALSE" too).
PREALLOCATE_OFF = ("false", "False", "0")
_ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
ALLOCATORS = ("default", "platform", "bfc", "cuda_async", "vmm")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, *, name: str = "value") -> int:
    """Bytes from an int or a string such as "16GiB", "80 GB", "512MiB", "1.5GiB".

    `name` is the argument the caller took `value` as; errors name it (`bytes=-1`).

    Raises:
      ValueError: for a negative or non-finite number, an unknown unit, or an amount that
        is not a whole number of bytes ("0.3KiB" is 307.2: refused, not truncated).
    """
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
        raise TypeError(f"expected a byte count (int or str like '16GiB'), got {name}={value!r}")
    if isinstance(value, numbers.Integral):
        # Exact, without float(): 10**400 raised OverflowError, np.int64(-3) was "cannot read".
        number, unit = int(value), ""
    elif isinstance(value, numbers.Real):
        # Numerically, not through str(): np.float32(16e9) prints "1.6e+10", which was refused
        # while np.float32(1024.0) was read.
        number, unit = float(value), ""
        if not math.isfinite(number):
            raise ValueError(f"a byte count must be a finite number, got {name}={value!r}")
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read a byte count from {name}={value!r}; expected e.g. "
                             f"17179869184, '16GiB' or '80GB' (units: {sorted(u for u in _UNITS if u)})")
        number, unit = match.group(1), match.group(2).lower()
        if not math.isfinite(float(number) * _UNITS[unit]):
            raise ValueError(f"a byte count must be a finite number, got {name}={value!r}")
    count = fractions.Fraction(number) * _UNITS[unit]  # exact: float("0.3") * 1024 is not 307.2
    if count < 0:
        raise ValueError(f"a byte count must be >= 0, got {name}={value!r}")
    if count.denominator != 1:
        raise ValueError(f"a byte count must be a whole number of bytes; {name}={value!r} comes to "
                         f"{float(count)} bytes")
    return int(count)


def allocator_env() -> dict[str, str]:
    """The XLA client allocator variables set in this process's environment, by name: what
    a report needs to explain an out-of-memory error (XLA reads them when the backend starts)."""
    names = (_FRACTION_VAR, _DEPRECATED_FRACTION_VAR, _PREALLOCATE_VAR, _ALLOCATOR_VAR)
    return {name: os.environ[name] for name in names if name in os.environ}


def grows_on_demand(env: Mapping[str, str]) -> bool:
    """Whether `env` (e.g. `allocator_env()`) has XLA grow its GPU pool on demand: in
    regions, no buffer of which spans two, so a large buffer may not fit where preallocated
    it would."""
    return env.get(_PREALLOCATE_VAR) in PREALLOCATE_OFF


def _gpu_total_bytes() -> int:
    """Smallest total memory over the visible GPUs, read through NVML."""
    from jaxopt_train.runtime.nvml import device_handles, nvml_session

    with nvml_session() as (nvml, reason):
        if nvml is None:
            raise RuntimeError(
                f"limit_memory(bytes=...) needs the GPU's total memory to turn bytes into the "
                f"fraction XLA takes, but {reason}. Pass fraction=... or total_bytes=... instead.")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        # Under MIG, XLA takes its fraction of the slice it sees, while NVML's total here is
        # the whole GPU's: 10 GiB of an H200 would come out ~1.3 GiB of an 18 GiB slice.
        mig = visible is not None and "MIG-" in visible
        indices = None
        if visible and all(part.strip().isdigit() for part in visible.split(",")):
            indices = [int(part) for part in visible.split(",")]
        handles = device_handles(nvml, indices)
        if not handles:
            raise RuntimeError("limit_memory(bytes=...): NVML sees no GPU; pass fraction=... instead")
        mig = mig or any(_mig_on(nvml, h) for _, h in handles)
        if mig:
            raise RuntimeError(
                "limit_memory(bytes=...) cannot size a MIG slice: NVML gives the whole GPU's "
                "memory, and XLA's fraction is of the slice. Pass fraction=... (a share of the "
                "slice) or total_bytes=<the slice's memory, from nvidia-smi -L>")
        return min(int(nvml.nvmlDeviceGetMemoryInfo(h).total) for _, h in handles)


def _mig_on(nvml, handle) -> bool:
    try:
        return bool(nvml.nvmlDeviceGetMigMode(handle)[0])
    except Exception:  # noqa: BLE001 - not supported (pre-Ampere) or an older binding
        return False


def memory_env(*, fraction: float | None = None, bytes: int | str | None = None,  # noqa: A002
               total_bytes: int | str | None = None, preallocate: bool | None = None,
               allocator: str | None = None) -> dict[str, str]:
    """The environment variables `limit_memory` would set (validated, nothing applied).

    See `limit_memory` for the arguments.
    """
    if (fraction is None) == (bytes is None):
        raise ValueError(f"pass exactly one of fraction= or bytes=; got {fraction=}, {bytes=}")
    if fraction is not None and total_bytes is not None:  # it would be silently ignored
        raise ValueError(f"total_bytes= only converts bytes= into a fraction; got it with {fraction=}")
    if fraction is None:
        limit = parse_bytes(bytes, name="bytes")
        total = (parse_bytes(total_bytes, name="total_bytes") if total_bytes is not None
                 else _gpu_total_bytes())
        if total <= 0:
            raise ValueError(f"total_bytes must be > 0, got {total_bytes=}")
        fraction = limit / total
        if not 0 < fraction <= 1:
            raise ValueError(f"bytes={limit} is {fraction:.3f} of the device's {total} bytes; "
                             "it must be > 0 and no more than the device holds")
        asked = f"bytes={limit} ({fraction:.2e} of the device's {total} bytes)"
    elif isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction=}")
    else:
        asked = f"{fraction=}"
    if bytes is None:
        # The share as the user put it, to 4 places rounded down (0.33339 became 0.3334,
        # over the cap); through the decimal form, so 0.3 stays 0.3000, not 0.2999. A numpy
        # scalar's own shortest form: through float(), np.float32(0.9) became 0.8999.
        text = str(fraction) if hasattr(fraction, "dtype") else repr(float(fraction))
        try:
            share = decimal.Decimal(text)
        except decimal.InvalidOperation:
            share = decimal.Decimal(repr(float(fraction)))
        share = share.quantize(decimal.Decimal("0.0001"), rounding=decimal.ROUND_FLOOR)
        written, smallest = f"{share:.4f}", "0.0001"
    else:
        # Rounded down, finely: to 4 places, 100 MiB of a 141 GiB GPU became 101.1 MiB, over
        # the cap asked for (jaxlib reads the value with float(), at any precision).
        written = f"{math.floor(fraction * 1e9) / 1e9:.9f}".rstrip("0").rstrip(".")
        smallest = "1e-09"
    if float(written) == 0:
        raise ValueError(f"{asked} would be written as {_FRACTION_VAR}={written}; the smallest "
                         f"share it can express is {smallest} of the device's memory")
    env = {_FRACTION_VAR: written}
    if preallocate is not None:
        # A string such as "false" is truthy: it would turn preallocation on.
        if not isinstance(preallocate, bool):
            raise TypeError(f"preallocate must be True, False or None, got {preallocate=}")
        env[_PREALLOCATE_VAR] = "true" if preallocate else "false"
    if allocator is not None:
        # jaxlib lowercases the variable's value before checking it: "BFC" is bfc there.
        if not isinstance(allocator, str) or allocator.lower() not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS} (any case), got {allocator=}")
        env[_ALLOCATOR_VAR] = allocator.lower()
    return env


def limit_memory(fraction: float | None = None, bytes: int | str | None = None,  # noqa: A002
                 *, total_bytes: int | str | None = None, preallocate: bool | None = None,
                 allocator: str | None = None) -> dict[str, str]:
    """Caps the GPU memory XLA takes in this process. Call before any JAX computation.

    XLA's GPU client reserves a fraction of each device's memory at start-up (75% by
    default, all of it preallocated). Two processes sharing a GPU, or a job that must
    stay inside a MIG-like quota, each set their own fraction here.

    Args:
      fraction: share of each GPU's total memory, in (0, 1].
      bytes: an absolute cap (int or "20GiB"); turned into a fraction of the device's
        total memory, read via NVML (or from `total_bytes`). Exactly one of
        `fraction`/`bytes` is required.
      total_bytes: the device's total memory, for `bytes` without NVML.
      preallocate: None (the default) leaves XLA_PYTHON_CLIENT_PREALLOCATE as it is
        (unset: XLA reserves at start-up); `True` reserves the whole share at start-up
        (fastest); or grow on demand (`False`: idle processes hold less, but the pool is then made of regions
        and no buffer spans two of them, so a step whose temporaries fill most of the cap
        may not fit: gpt-1b's 8.6 GiB of temporaries under a 16 GiB cap did not).
      allocator: XLA_PYTHON_CLIENT_ALLOCATOR, one of `ALLOCATORS` in any case (jaxlib
        lowercases it; the lowercase name is written); "platform" frees
        memory immediately (slow; for debugging out-of-memory errors).

    Returns:
      The environment variables set.

    Raises:
      RuntimeError: if the JAX backend has already started (the setting would be ignored).
      TypeError: if `preallocate` is not a bool or None.
      ValueError: for arguments out of range (a share below 0.0001 included).
    """
    # Arguments first: a bad value is the error to report even when it is also too late.
    env = memory_env(fraction=fraction, bytes=bytes, total_bytes=total_bytes,
                     preallocate=preallocate, allocator=allocator)
    require_backend_not_started("limit_memory()")
    # jaxlib refuses to start when both spellings are set; ours is the explicit request.
    os.environ.pop(_DEPRECATED_FRACTION_VAR, None)
    os.environ.update(env)
    return env


@dataclasses.dataclass
class DeviceMemory:
    """Memory of one device over a tracked block (bytes; None where unavailable)."""

    device: str
    bytes_in_use_before: int | None = None
    bytes_in_use_after: int | None = None
    peak_bytes_in_use: int | None = None  # allocator high-water mark at the end
    peak_increase: int | None = None  # how far the block raised the high-water mark
    bytes_limit: int | None = None

    @property
    def delta(self) -> int | None:
        """Bytes still held after the block minus those held before."""
        if self.bytes_in_use_before is None or self.bytes_in_use_after is None:
            return None
        return self.bytes_in_use_after - self.bytes_in_use_before


@dataclasses.dataclass
class MemoryReport:
    """What `track_memory` measured; `available` is False on backends without stats (CPU)."""

    devices: list[DeviceMemory] = dataclasses.field(default_factory=list)
    available: bool = False
    reason: str = ""

    @property
    def peak_bytes(self) -> int | None:
        """Largest allocator high-water mark over the devices."""
        peaks = [d.peak_bytes_in_use for d in self.devices if d.peak_bytes_in_use is not None]
        return max(peaks) if peaks else None

    def __str__(self) -> str:
        if not self.available:
            return f"memory: unavailable ({self.reason})"
        def gib(value: int | None, sign: str = "") -> str:
            return "n/a" if value is None else f"{value / 2**30:{sign}.3f}"

        return "\n".join(f"{d.device}: peak {gib(d.peak_bytes_in_use)} GiB "
                         f"({gib(d.peak_increase, '+')}), delta {gib(d.delta, '+')} GiB"
                         for d in self.devices)


def _is_device(obj: Any) -> bool:
    # Duck-typed: anything with jax.Device's memory_stats() (a test may script one).
    return hasattr(obj, "memory_stats")


def _device_list(devices: Any) -> list[Any] | None:
    """`devices` as a list of devices (a single device is wrapped), validated."""
    if devices is None:
        return None
    if _is_device(devices):
        return [devices]
    expected = "track_memory(devices) takes a jax Device or a list of them, e.g. jax.local_devices()"
    if isinstance(devices, str):
        raise TypeError(f"{expected}; got {devices=} (for a platform: jax.devices({devices!r}))")
    try:
        found = list(getattr(devices, "flat", devices))  # .flat: a Mesh's ndarray of devices
    except TypeError:
        raise TypeError(f"{expected}; got {devices=}") from None
    bad = [d for d in found if not _is_device(d)]
    if bad:
        raise TypeError(f"{expected}; got non-device entries {bad} in {devices=}")
    if not found:  # nothing to watch: the report would say "unavailable" for no reason
        raise ValueError(f"{expected}; got an empty {devices=}")
    return found


def _stats(device) -> dict[str, int] | None:
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


def _wait_for_pending_work(jax: Any) -> None:
    """Blocks until dispatched computations finish, so their buffers show in the stats.

    `jax.effects_barrier` alone only waits for side effects (callbacks, prints), not for
    a pure computation still running asynchronously.
    """
    for array in jax.live_arrays():
        with contextlib.suppress(Exception):  # deleted or donated meanwhile
            array.block_until_ready()
    with contextlib.suppress(Exception):
        jax.effects_barrier()


def _device_memory(device: Any, before: dict[str, int], after: dict[str, int]) -> DeviceMemory:
    # A backend may leave a statistic out: report None, not a made-up 0.
    peak_before, peak_after = before.get("peak_bytes_in_use"), after.get("peak_bytes_in_use")
    return DeviceMemory(
        device=str(device),
        bytes_in_use_before=before.get("bytes_in_use"),
        bytes_in_use_after=after.get("bytes_in_use"),
        peak_bytes_in_use=peak_after,
        peak_increase=None if peak_before is None or peak_after is None else peak_after - peak_before,
        bytes_limit=after.get("bytes_limit"),
    )


class track_memory(contextlib.ContextDecorator):  # noqa: N801 - used like a function
    """Reports peak and delta device memory of a block, as a context manager or decorator.

    The allocator's high-water mark is process-wide and cannot be reset, so a block's
    own peak is exact only when it raises that mark (`peak_increase > 0`); otherwise the
    block peaked somewhere at or below the earlier mark. Work is asynchronous: the
    exit waits for pending computations (every live array, then side effects) before reading.

    Example:
      >>> import jax.numpy as jnp
      >>> with track_memory() as report:
      ...     y = jnp.ones((1024, 1024)) @ jnp.ones((1024, 1024))
      >>> "peak" in str(report) or "unavailable" in str(report)  # the latter on CPU
      True

    As a decorator, `@track_memory` and `@track_memory(devices)` both work.

    Args:
      devices: a device or a list of devices to watch (default: `jax.local_devices()`).
      print_report: print the report on exit (always on for the decorator form's use).

    Raises:
      TypeError: if `devices` is not a device or a list of devices.
      ValueError: if `devices` is an empty list.
    """

    def __new__(cls, devices: Any = None, **kwargs: Any):
        if callable(devices) and not _is_device(devices):  # bare @track_memory
            return cls(**kwargs)(devices)
        return super().__new__(cls)

    def __init__(self, devices: Any = None, *, print_report: bool = False):
        if not isinstance(print_report, bool):
            raise TypeError(f"print_report must be True or False, got {print_report=}")
        self._devices = _device_list(devices)
        self._print = print_report
        self.report = MemoryReport()
        # One entry per open `with`: the same instance may be entered again inside itself.
        self._open: list[tuple[MemoryReport, list[tuple[Any, dict[str, int] | None]]]] = []

    def __enter__(self) -> MemoryReport:
        import jax

        devices = list(self._devices) if self._devices is not None else jax.local_devices()
        self.report = MemoryReport()
        self._open.append((self.report, [(d, _stats(d)) for d in devices]))
        return self.report

    def __exit__(self, *exc) -> bool:
        import jax

        report, before_stats = self._open.pop()
        _wait_for_pending_work(jax)
        if all(stats is None for _, stats in before_stats):
            kinds = sorted({getattr(d, "platform", "?") for d, _ in before_stats})
            report.reason = f"devices of platform {kinds} give no memory_stats()"
        for device, before in before_stats:
            after = _stats(device)
            if before is None or after is None:
                continue
            report.devices.append(_device_memory(device, before, after))
        report.available = bool(report.devices)
        if self._print:
            print(report)
        return False

    def __call__(self, fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) \
                or inspect.isasyncgenfunction(fn):
            # Calling one only creates the generator: the report would be printed before any
            # of its work ran.
            raise TypeError(f"@track_memory wraps a plain function; {fn.__qualname__} is a "
                            "generator or coroutine function, whose body runs after the call "
                            "returns: use `with track_memory():` around the loop that consumes it")
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with track_memory(self._devices, print_report=True):
                return fn(*args, **kwargs)
        return wrapper


@dataclasses.dataclass(frozen=True)
class FitReport:
    """Bytes a compiled step needs on one device against a budget."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    budget_bytes: int

    @property
    def needed_bytes(self) -> int:
        """Arguments + outputs + scratch, counting donated (aliased) buffers once."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes
                + self.temp_bytes + self.generated_code_bytes)

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.budget_bytes

    def __bool__(self) -> bool:
        return self.fits

    def __str__(self) -> str:
        gib = 2**30
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"needs {self.needed_bytes / gib:.3f} GiB of {self.budget_bytes / gib:.3f} GiB budget: "
                f"{verdict} (args {self.argument_bytes / gib:.3f}, outputs {self.output_bytes / gib:.3f}, "
                f"aliased {self.alias_bytes / gib:.3f}, temp {self.temp_bytes / gib:.3f} GiB)")


def fits(fn_or_lowered: Any, args: Sequence[Any] = (), budget: int | str = 0,
         *, kwargs: dict[str, Any] | None = None) -> FitReport:
    """Whether a step fits a per-device memory budget, from XLA's ahead-of-time analysis.

    Nothing is allocated: pass `jax.ShapeDtypeStruct`s (with shardings for a sharded
    step) as `args` to check a GPU-sized model on a CPU. XLA's CPU and GPU compilers
    fuse differently, so the CPU figure is an estimate of the GPU's (arguments and
    outputs are exact; scratch differs).

    Args:
      fn_or_lowered: a function (jitted or not), a `jax.stages.Lowered`, or a
        `jax.stages.Compiled`.
      args: a tuple or list of positional arguments (arrays or ShapeDtypeStructs) for a
        function: `(x,)` for one argument.
      budget: bytes per device, int or string such as "16GiB".
      kwargs: keyword arguments for a function.

    Returns:
      A FitReport; `bool(report)` is True when it fits.

    Raises:
      TypeError: if `args` is not a tuple or list, or `kwargs` not a dict.
      ValueError: for a budget <= 0, or args/kwargs given with a Lowered or Compiled.
    """
    import jax

    if isinstance(args, (str, numbers.Integral)) and not isinstance(args, bool) and budget == 0:
        # fits(compiled, "1GiB"): the budget in the args slot.
        raise TypeError(f"fits() got {args!r} as its second argument, `args`; the budget is the "
                        f"third, or a keyword: fits(compiled, budget={args!r}) or "
                        f"fits(f, (x,), {args!r})")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"fits() takes the function's positional arguments as a tuple or list, "
                        f"e.g. fits(f, (x,), '16GiB'); got args of type {type(args).__name__}: {args!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"fits(kwargs=...) takes a dict of keyword arguments; "
                        f"got {type(kwargs).__name__}: {kwargs!r}")
    budget_bytes = parse_bytes(budget, name="budget")
    if budget_bytes <= 0:
        raise ValueError(f"budget must be a positive byte count, got {budget=}")
    compiled = fn_or_lowered
    if isinstance(compiled, (jax.stages.Lowered, jax.stages.Compiled)) and (args or kwargs):
        raise ValueError(f"fits() got args/kwargs with a {type(compiled).__name__}, whose arguments "
                         "were fixed when it was lowered; pass the function instead, or drop them")
    if isinstance(compiled, jax.stages.Lowered):
        compiled = compiled.compile()
    elif not isinstance(compiled, jax.stages.Compiled):
        if not callable(compiled):
            raise TypeError("fits() takes a function, a jax.stages.Lowered or a jax.stages.Compiled; "
                            f"got {type(fn_or_lowered).__name__}")
        jitted = compiled if hasattr(compiled, "lower") else jax.jit(compiled)
        compiled = jitted.lower(*args, **(kwargs or {})).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("this backend gives no memory analysis for compiled code")
    if isinstance(stats, (list, tuple)):  # one entry per program on some backends
        stats = stats[0]
    return FitReport(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        budget_bytes=budget_bytes,
    )


def device_pool_limit(device) -> int | None:
    """The most bytes `device`'s allocator may hold (its `bytes_limit`: the GPU pool, after
    any `limit_memory` cap); None where the backend does not report one (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU and some plugins raise
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
