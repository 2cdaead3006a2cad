"""Where step metrics go: run_dir/metrics.jsonl always, a terminal, optional sinks.

The JSONL file is opened in append mode, so a resumed run continues the same
file and an earlier run's lines are never lost (a crash's torn last line is ended
first, so the resumed run's first record stays readable). Each line is one JSON object
with "step", "time" (unix seconds) and the metrics of that log interval.
`jaxopt_train.runtime.read_jsonl` reads it back (skipping the torn last line of a crash).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from typing import Any, TextIO

import jax
import numpy as np

from jaxopt_train.runtime.sinks import open_for_append

# The fields every record writes itself; a metric of the same name would replace them.
_RECORD_FIELDS = ("step", "time")


class JsonlWriter:
    """Appends one JSON object per `write` to `path` (flushed each time)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file: TextIO | None = open_for_append(self.path)

    def check(self, step: int, metrics: dict[str, Any]) -> None:  # noqa: ARG002
        """Raises ValueError for a metric named like a record field ("step", "time").

        It would replace the record's own step or time: a plot then reads the record as a
        resumed run going back to that step and drops the steps logged before it.
        """
        clash = sorted({str(name) for name in metrics} & set(_RECORD_FIELDS))
        if clash:
            raise ValueError(f"metrics.jsonl writes {list(_RECORD_FIELDS)} itself; metric names "
                             f"{clash} are reserved there: rename them (e.g. 'train_{clash[0]}'); "
                             f"got {sorted(map(str, metrics))}")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"JsonlWriter({self.path!r}) is closed")
        self.check(step, metrics)
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them readable rather than invalid
    return value


def _is_real_scalar(value: Any) -> bool:
    """A number the sinks can take: NumPy and 0-d JAX scalars too, not bools or strings.

    `isinstance(v, float)` alone misses np.float32 and jax arrays, which then reached
    metrics.jsonl but were silently left out of TensorBoard and Prometheus.
    """
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "shape", None) != ():
        return False
    # jnp.issubdtype also knows bfloat16, which NumPy's does not count as floating.
    return jax.numpy.issubdtype(dtype, jax.numpy.integer) or jax.numpy.issubdtype(dtype, jax.numpy.floating)


def peak_memory_bytes() -> int | None:
    """The largest `peak_bytes_in_use` over local devices; None where not reported (CPU)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except (RuntimeError, NotImplementedError):  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class MetricsLogger:
    """Fans metrics out to JSONL, the terminal and optional TensorBoard/Prometheus sinks.

    Args:
      run_dir: the run directory; metrics go to run_dir/metrics.jsonl.
      total_steps: for the progress bar.
      start_step: the steps done before this run (a resumed checkpoint's step); its
        records come after it, and TensorBoard hides an earlier run's past it.
      tensorboard: also write TensorBoard events to run_dir/tb.
      prometheus_port: also serve the metrics on this port.
      prometheus_sink: or through this sink, bound beforehand (`open_prometheus_sink`:
        the trainer binds the port before it touches the run directory); the logger
        closes it.
      progress: "auto" (bar on a terminal, lines otherwise), "bar" or "lines".
      stream: where lines go (default stdout).
    """

    def __init__(self, run_dir: str, *, total_steps: int, start_step: int = 0,
                 tensorboard: bool = False, prometheus_port: int | None = None,
                 prometheus_sink=None, progress: str = "auto", stream: TextIO | None = None):
        if prometheus_port is not None and prometheus_sink is not None:
            raise ValueError(f"{prometheus_port=} and a prometheus_sink were both given; "
                             "expected one way to serve Prometheus metrics")
        self.is_main = jax.process_index() == 0
        self.stream = stream or sys.stdout
        self.jsonl = JsonlWriter(os.path.join(run_dir, "metrics.jsonl")) if self.is_main else None
        try:
            self.sinks = (_optional_sinks(run_dir, tensorboard, prometheus_port, start_step)
                          if self.is_main else [])
            if prometheus_sink is not None:
                self.sinks.append(prometheus_sink)
        except BaseException:
            if self.jsonl is not None:  # the caller never gets an object to close
                self.jsonl.close()
            raise
        use_bar = progress == "bar" or (progress == "auto" and _isatty(self.stream))
        self.bar = _make_bar(total_steps, start_step, self.stream) if (use_bar and self.is_main) else None
        # The bound port (prometheus_port=0 picks a free one), for scrapers and tests.
        self.prometheus_port = next((sink.port for sink in self.sinks if hasattr(sink, "port")), None)
        if self.prometheus_port is not None:
            self.message(f"prometheus metrics at http://127.0.0.1:{self.prometheus_port}/metrics")

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        numeric = {k: float(v) for k, v in metrics.items() if _is_real_scalar(v)}
        self.jsonl.check(step, metrics)
        for sink in self.sinks:  # every sink's checks first, so a refused record is written nowhere
            sink.check(step, numeric)
        self.jsonl.write(step, metrics)
        for sink in self.sinks:
            sink.write(step, numeric)
        line = format_metrics(step, metrics)
        if self.bar is not None:
            self.bar.set_postfix_str(_short(metrics), refresh=False)
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        for sink in self.sinks:
            sink.close()


_FORMATS = (("loss", "loss {:.4f}"), ("eval_loss", "eval {:.4f}"),
            ("tokens_per_s", "{:,.0f} tok/s"), ("images_per_s", "{:,.1f} img/s"),
            ("step_time_s", "{:.3f} s/step"), ("mfu", "MFU {:.1%}"),
            ("peak_memory_gib", "mem {:.2f} GiB"), ("loss_scale", "scale {:g}"),
            ("skipped_steps", "skipped {:d}"))


def format_metrics(step: int, metrics: dict[str, Any]) -> str:
    """One human line: `step 100 | loss 2.1234 | eval 2.2 | 12,000 tok/s | ...`."""
    parts = [f"step {step}"]
    for key, fmt in _FORMATS:
        value = metrics.get(key)
        if value is None:
            continue
        if key == "skipped_steps" and not value:
            continue
        if key == "loss_scale" and value == 1:
            continue
        parts.append(fmt.format(int(value) if key == "skipped_steps" else value))
    return " | ".join(parts)


def _short(metrics: dict[str, Any]) -> str:
    loss = metrics.get("loss")
    return "" if loss is None else f"loss={loss:.3f}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _make_bar(total: int, start: int, stream: TextIO):
    from tqdm.auto import tqdm  # noqa: PLC0415  (only on a terminal)

    return tqdm(total=total, initial=start, file=stream, unit="step", dynamic_ncols=True)


def _sinks_module():
    try:
        from jaxopt_train.runtime import sinks  # noqa: PLC0415
    except ImportError as err:
        raise RuntimeError(
            "tensorboard / prometheus_port need jaxopt_train.runtime.sinks, which failed to "
            f"import: {err}") from err
    return sinks


def open_prometheus_sink(prometheus_port: int):
    """A `runtime.sinks.PrometheusSink` serving on `prometheus_port` (0: any free port).

    Raises:
      ValueError: the port cannot be bound (in use, privileged), naming the flag.
    """
    try:
        return _sinks_module().PrometheusSink(prometheus_port)
    except ValueError as err:
        raise ValueError(f"--prometheus-port {prometheus_port} ({prometheus_port=}): {err}") from err


def _optional_sinks(run_dir: str, tensorboard: bool, prometheus_port: int | None,
                    start_step: int) -> list:
    out = []
    if tensorboard:
        # The steps after start_step are (re)logged by this run: TensorBoard hides an
        # earlier, crashed run's points there, as `jaxopt-train plot` drops its records.
        out.append(_sinks_module().TensorBoardSink(os.path.join(run_dir, "tb"),
                                                   purge_step=int(start_step) + 1))
    if prometheus_port is not None:
        try:
            out.append(open_prometheus_sink(prometheus_port))
        except ValueError:
            for sink in out:  # the TensorBoard writer opened above
                sink.close()
            raise
    return out
