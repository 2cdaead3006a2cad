"""Where step metrics go: JSONL (always), TensorBoard event files, a Prometheus endpoint.

Every sink has `write(step: int, metrics: dict[str, float]) -> None` and `close()`.
Values may be Python, NumPy or JAX scalars; they are converted with `float()`, so
pass host values (a JAX array here forces a device sync).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO


def open_for_append(path: str | os.PathLike) -> TextIO:
    """Opens a JSONL file for appending (creating its directory), ending a torn last line first.

    A run killed mid-write leaves a last line without its newline; the next record
    appended straight after it would be glued onto it and lost with it on reading.
    The torn line itself stays, on its own line, for `read_jsonl` to skip and report.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Only a file has a last line to read back: a pipe or a terminal (/dev/stdout, a FIFO to
    # a log shipper) cannot seek, and refused the sink with "File or stream is not seekable".
    if not os.path.exists(path) or os.path.isfile(path):
        with open(path, "a+b") as file:  # binary: the torn line may end inside a UTF-8 character
            if file.seek(0, os.SEEK_END) > 0:
                file.seek(-1, os.SEEK_END)
                if file.read(1) != b"\n":
                    file.write(b"\n")  # "a" mode: writes go to the end whatever the read position
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - the caller closes it


def _as_floats(step: int, metrics: Mapping[str, Any], *, reserved: tuple[str, ...] = (),
               sink: str = "") -> dict[str, float]:
    if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
        raise TypeError(f"step must be an int, got {step=}")
    clash = sorted({str(name) for name in metrics} & set(reserved))
    if clash:  # the sink's own field would silently overwrite the metric, or the reverse
        raise ValueError(f"{sink} writes {list(reserved)} itself; metric names {clash} are reserved "
                         f"there: rename them (e.g. 'train_{clash[0]}'); got {sorted(map(str, metrics))}")
    names = [str(name) for name in metrics]
    if len(set(names)) < len(names):  # 1 and "1" would both be written as "1"
        raise ValueError(f"metric names must stay distinct as strings; got {list(metrics)}")
    # float("1.5") parses text: a string metric (a label passed by mistake) is refused,
    # not written as a number the run never computed.
    text = {str(name): value for name, value in metrics.items() if isinstance(value, (str, bytes))}
    if text:
        raise TypeError(f"metric values must be numbers, not text; got {text}")
    try:
        return {str(name): float(value) for name, value in metrics.items()}
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric values must be scalars convertible to float: {err}; "
                        f"got {dict(metrics)=}") from err


class JsonlSink:
    """Appends one JSON object per write: `{"step": s, "time": unix_s, **metrics}`.

    The file is flushed after each line, so a crashed run keeps its log and
    `jaxopt-train plot` can read a live run. Non-finite values are written as
    NaN/Infinity (which Python's json reads back).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = open_for_append(self.path)  # closed in close()

    def check(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """What `write` would write, validated: ValueError for a metric named "step" or
        "time" (the record's own fields), TypeError for a non-scalar value."""
        return _as_floats(step, metrics, reserved=("step", "time"), sink="JsonlSink")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Appends the record (see `check` for what is refused)."""
        values = self.check(step, metrics)
        record = {"step": int(step), "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike,
               on_skip: Callable[[int, bytes], None] | None = None) -> list[dict[str, float]]:
    """The records of a JsonlSink file.

    A line that is not a JSON object (the torn last line of a crashed run, or that line
    with a resumed run's first record appended to it) is skipped; `on_skip(line_number,
    line)` is told of each one (`jaxopt-train plot` warns).
    """
    records = []
    with open(path, "rb") as file:  # bytes: a torn line may end inside a UTF-8 character
        for number, line in enumerate(file, 1):
            line = line.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                record = None
            if isinstance(record, dict) and record:
                records.append(record)
            elif on_skip is not None:
                on_skip(number, line)
    return records


class TensorBoardSink:
    """Scalars in TensorBoard event files, written without TensorFlow.

    Uses tensorboard's own event writer and protobufs; `tensorboard --logdir LOGDIR`
    (or its EventAccumulator) reads them. Tags are the metric names.

    Args:
      logdir: the folder of the event files (a new file per sink; earlier ones stay).
      flush_secs: how often events reach the file.
      purge_step: a resumed run's first step to come: TensorBoard hides the events at
        this step and after it that earlier files hold (a `SessionLog.START` marker, as
        PyTorch's ``SummaryWriter(purge_step=)`` writes), so the points a crashed run
        logged past its last checkpoint do not stay beside the ones logged again.
    """

    def __init__(self, logdir: str | os.PathLike, *, flush_secs: float = 10.0,
                 purge_step: int | None = None):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if purge_step is not None and (isinstance(purge_step, bool) or not isinstance(purge_step, int)
                                       or purge_step < 0):
            raise ValueError(f"purge_step={purge_step!r} must be a non-negative int or None")
        os.makedirs(logdir, exist_ok=True)
        self.logdir = os.fspath(logdir)
        self._writer = EventFileWriter(self.logdir, flush_secs=flush_secs)
        if purge_step is not None:
            from tensorboard.compat.proto import event_pb2

            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=purge_step,
                                                   session_log=start))

    def check(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """What `write` would write, validated (TypeError for a non-scalar value)."""
        return _as_floats(step, metrics)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=name, simple_value=value)
                  for name, value in self.check(step, metrics).items()]
        event = event_pb2.Event(wall_time=time.time(), step=int(step),
                                summary=summary_pb2.Summary(value=values))
        self._writer.add_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


_PROMETHEUS_NAME = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(metric: str, prefix: str = "jaxopt_train_") -> str:
    """`prefix + metric` with characters Prometheus forbids replaced by "_".

    "DCGM_FI_DEV_GPU_UTIL/gpu0" -> "jaxopt_train_DCGM_FI_DEV_GPU_UTIL_gpu0".
    """
    return prefix + _PROMETHEUS_NAME.sub("_", metric)


class PrometheusSink:
    """Serves the latest value of each metric as a gauge `jaxopt_train_<metric>`.

    Runs prometheus_client's HTTP server on a daemon thread with a registry of its
    own (so several sinks, or a restarted one, never clash on metric names).
    `jaxopt_train_step` holds the step of the latest write.

    Args:
      port: TCP port; 0 picks a free one (read it back from `.port`).
      addr: address to bind; "0.0.0.0" for scrapers on other hosts.

    Raises:
      ValueError: a port outside [0, 65535], or one that cannot be bound (in use,
        privileged), with the OS's reason.
    """

    def __init__(self, port: int = 9400, addr: str = "0.0.0.0", *, prefix: str = "jaxopt_train_"):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (0 = any free port), got {port=}")
        import prometheus_client

        self._prefix = prefix
        self.registry = prometheus_client.CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        self._gauge_type = prometheus_client.Gauge
        try:
            started = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:  # EADDRINUSE, EACCES (port < 1024), an unknown addr
            reason = err.strerror or str(err)
            raise ValueError(
                f"cannot serve Prometheus metrics on {addr}:{port}: {reason}; pick another "
                "port, or 0 for any free one") from err
        # prometheus_client >= 0.17 returns (server, thread); older ones cannot be stopped.
        self._server, self._thread = started if isinstance(started, tuple) else (None, None)
        self.port = self._server.server_port if self._server is not None else port
        self.addr = addr
        self._closed = False

    def _gauge(self, metric: str):
        gauge = self._gauges.get(metric)
        if gauge is None:
            name = prometheus_name(metric, self._prefix)
            gauge = self._gauge_type(name, f"jaxopt_train metric {metric}", registry=self.registry)
            self._gauges[metric] = gauge
        return gauge

    def check(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """What `write` would set, validated: ValueError for a metric named "step" (the
        `jaxopt_train_step` gauge) or two metrics sharing one gauge name, TypeError for a
        non-scalar value."""
        if self._closed:  # the gauges would be set where no scraper can read them
            raise RuntimeError(f"PrometheusSink(port={self.port}) is closed; its metrics would reach "
                               "no scraper: write before close(), or make a new sink")
        values = _as_floats(step, metrics, reserved=("step",), sink="PrometheusSink")
        # Registering the second of two metrics that sanitise alike fails in
        # prometheus_client after the other sinks (and earlier gauges) were written.
        # Gauges of earlier writes count too: "loss/train" now, "loss_train" later.
        owners = {prometheus_name(metric, self._prefix): metric for metric in ("step", *self._gauges)}
        for metric in values:
            name = prometheus_name(metric, self._prefix)
            owner = owners.setdefault(name, metric)
            if owner != metric:
                raise ValueError(
                    f"PrometheusSink: metrics {owner!r} and {metric!r} would both be the gauge "
                    f"{name!r} (characters outside [a-zA-Z0-9_] become '_'); rename one of them")
        return values

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Sets the gauges (see `check` for what is refused)."""
        values = self.check(step, metrics)
        self._gauge("step").set(int(step))
        for metric, value in values.items():
            self._gauge(metric).set(value)

    def close(self) -> None:
        """Stops the HTTP server and frees its port; unregisters the gauges."""
        self._closed = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5.0)
            self._server = None
        for gauge in self._gauges.values():
            self.registry.unregister(gauge)
        self._gauges.clear()


class MultiSink:
    """Writes to several sinks; `close()` closes all, then re-raises the first error."""

    def __init__(self, sinks: Iterable[Any]):
        self.sinks = list(sinks)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        # Every sink's checks first, so a metric one sink refuses is written by none.
        for sink in self.sinks:
            check = getattr(sink, "check", None)
            if check is not None:
                check(step, metrics)
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # close the rest before reporting
                errors.append(err)
        if errors:
            raise errors[0]

