"""Metric sinks: JSONL round trip, TensorBoard read back by tensorboard, a real Prometheus scrape."""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest

from jaxopt_train.runtime import JsonlSink, MultiSink, PrometheusSink, TensorBoardSink, read_jsonl
from jaxopt_train.runtime.sinks import prometheus_name

METRICS = [
    {"loss": 2.5, "tokens_per_s": 1000.0, "mfu": 0.41},
    {"loss": np.float32(2.25), "tokens_per_s": 1100, "mfu": 0.45},
    {"loss": 2.0, "tokens_per_s": 1200.0, "mfu": 0.5, "loss_scale": float("inf")},
]


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    for step, metrics in enumerate(METRICS):
        sink.write(step * 10, metrics)
    sink.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 10, 20]
    assert records[1]["loss"] == 2.25 and isinstance(records[1]["tokens_per_s"], float)
    assert math.isinf(records[2]["loss_scale"])
    assert all(r["time"] > 0 for r in records)


def test_jsonl_appends_and_skips_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlSink(path).write(0, {"loss": 1.0})  # flushed per line, even unclosed
    with open(path, "a") as f:
        f.write('{"step": 1, "lo')  # a crash mid-line
    assert [r["step"] for r in read_jsonl(path)] == [0]


def test_jsonl_rejects_non_scalars(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match="convertible to float"):
        sink.write(0, {"loss": [1.0, 2.0]})
    with pytest.raises(TypeError, match="step must be an int"):
        sink.write(1.5, {"loss": 1.0})
    for text in ("1.5", b"2"):  # float() would parse them
        with pytest.raises(TypeError, match="must be numbers, not text; got {'lr': "):
            sink.write(2, {"loss": 1.0, "lr": text})
    sink.close()
    assert read_jsonl(tmp_path / "m.jsonl") == []  # nothing half-written


@pytest.mark.parametrize("reserved", ["step", "time"])
def test_jsonl_rejects_reserved_metric_names(tmp_path, reserved):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match=rf"JsonlSink writes \['step', 'time'\] itself; "
                                         rf"metric names \['{reserved}'\] are reserved"):
        sink.write(1, {reserved: 99, "loss": 1.0})
    sink.write(1, {"step_time_s": 0.5})  # names that merely contain them are fine
    sink.close()
    (record,) = read_jsonl(tmp_path / "m.jsonl")  # the rejected write left no line
    assert record["step"] == 1 and record["step_time_s"] == 0.5


def test_tensorboard_scalars_read_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step, metrics in enumerate(METRICS):
        sink.write(step, metrics)
    sink.write(3, {"DCGM_FI_DEV_GPU_UTIL/gpu0": 87})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "tokens_per_s", "mfu", "loss_scale", "DCGM_FI_DEV_GPU_UTIL/gpu0"} <= set(
        events.Tags()["scalars"])
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in loss], [2.5, 2.25, 2.0])
    assert [e.value for e in events.Scalars("DCGM_FI_DEV_GPU_UTIL/gpu0")] == [87.0]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_prometheus_real_scrape_and_close(tmp_path):
    sink = PrometheusSink(0, addr="127.0.0.1")
    port = sink.port
    assert port > 0
    sink.write(7, {"loss": 2.5, "mfu": 0.41, "DCGM_FI_DEV_GPU_UTIL/gpu0": 87})
    scraped = _scrape(port)
    assert scraped["jaxopt_train_step"] == 7
    assert scraped["jaxopt_train_loss"] == 2.5 and scraped["jaxopt_train_mfu"] == 0.41
    assert scraped["jaxopt_train_DCGM_FI_DEV_GPU_UTIL_gpu0"] == 87
    sink.write(8, {"loss": 2.0})
    scraped = _scrape(port)
    assert scraped["jaxopt_train_step"] == 8 and scraped["jaxopt_train_loss"] == 2.0
    sink.close()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _scrape(port)
    # The port is free again and a new sink may register the same metric names.
    again = PrometheusSink(port, addr="127.0.0.1")
    again.write(0, {"loss": 1.0})
    assert _scrape(port)["jaxopt_train_loss"] == 1.0
    again.close()
    # Was: a write after close() set gauges nobody could scrape, silently.
    with pytest.raises(RuntimeError, match=r"PrometheusSink\(port=\d+\) is closed; its metrics "
                                           "would reach no scraper"):
        again.write(1, {"loss": 0.5})
    again.close()  # closing twice is harmless


def test_prometheus_rejects_a_metric_named_step():
    sink = PrometheusSink(0, addr="127.0.0.1")
    try:
        with pytest.raises(ValueError, match=r"PrometheusSink writes \['step'\] itself"):
            sink.write(7, {"step": 99, "loss": 1.0})
        sink.write(7, {"time": 5.0})  # only "step" is its own gauge
        assert _scrape(sink.port)["jaxopt_train_step"] == 7
    finally:
        sink.close()


def test_prometheus_names_and_bad_port():
    assert prometheus_name("DCGM_FI_DEV_GPU_UTIL/gpu0") == "jaxopt_train_DCGM_FI_DEV_GPU_UTIL_gpu0"
    assert prometheus_name("step-time.s") == "jaxopt_train_step_time_s"
    with pytest.raises(ValueError, match="port must be an int"):
        PrometheusSink(70000)


def test_prometheus_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A ValueError with the OS's reason, not a bare OSError traceback from the server.
        with pytest.raises(ValueError, match=rf"cannot serve Prometheus metrics on 127.0.0.1:{port}: "
                                             r"Address already in use; pick another port, or 0"):
            PrometheusSink(port, addr="127.0.0.1")


def test_multisink_fans_out_and_closes_all(tmp_path):
    class Broken:
        closed = False

        def write(self, step, metrics):
            pass

        def close(self):
            raise RuntimeError("broken close")

    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    tb = TensorBoardSink(tmp_path / "tb")
    multi = MultiSink([Broken(), jsonl, tb])
    multi.write(0, {"loss": 1.0})
    with pytest.raises(RuntimeError, match="broken close"):
        multi.close()
    assert jsonl._file.closed
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_multisink_checks_every_sink_before_any_writes(tmp_path):
    """A metric one sink refuses is written by none (the JSONL log must not get a half step)."""
    written = []

    class Recorder:
        def write(self, step, metrics):
            written.append((step, dict(metrics)))

        def close(self):
            pass

    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    multi = MultiSink([Recorder(), jsonl])
    with pytest.raises(ValueError, match="metric names \\['time'\\] are reserved"):
        multi.write(0, {"loss": 1.0, "time": 3.0})
    multi.close()
    assert written == [] and (tmp_path / "metrics.jsonl").read_text() == ""


def test_metric_names_must_stay_distinct_as_strings(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match="distinct as strings"):
        sink.write(0, {1: 1.0, "1": 2.0})
    sink.close()


def _jsonl_writers():
    from jaxopt_train.train.metrics import JsonlWriter

    return [JsonlSink, JsonlWriter]


@pytest.mark.parametrize("writer", _jsonl_writers(), ids=lambda w: w.__name__)
def test_append_after_a_torn_line_keeps_the_next_record(tmp_path, writer):
    # Was: the resumed run's first record was glued onto the torn line and lost with it.
    path = tmp_path / "metrics.jsonl"
    first = writer(path)
    first.write(1, {"loss": 2.0})
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 2, "time": 1.0, "lo')  # killed mid-write
    resumed = writer(path)
    resumed.write(3, {"loss": 1.5})
    resumed.write(4, {"loss": 1.4})
    resumed.close()
    skipped = []
    records = read_jsonl(path, on_skip=lambda number, line: skipped.append((number, line)))
    assert [r["step"] for r in records] == [1, 3, 4]
    assert skipped == [(2, b'{"step": 2, "time": 1.0, "lo')]  # the torn line stays, reported


@pytest.mark.parametrize("content", [b"", b'{"step": 1}\n', "{\"step\": 1, \"é".encode()[:-1]])
def test_open_for_append_adds_a_newline_only_after_a_torn_line(tmp_path, content):
    from jaxopt_train.runtime.sinks import open_for_append

    path = tmp_path / "sub" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_bytes(content)
    open_for_append(path).close()
    open_for_append(path).close()  # idempotent: no blank lines pile up
    torn = content and not content.endswith(b"\n")
    assert path.read_bytes() == content + (b"\n" if torn else b"")
    open_for_append(tmp_path / "new" / "m.jsonl").close()  # makes the directory
    assert (tmp_path / "new" / "m.jsonl").read_bytes() == b""


@pytest.mark.parametrize("writer", _jsonl_writers(), ids=lambda w: w.__name__)
def test_jsonl_writes_into_a_pipe(tmp_path, writer):
    """Before: "File or stream is not seekable" for /dev/stdout piped on, or a FIFO that a
    log shipper reads: the torn-line check read the last byte of what is not a file."""
    import os
    import threading

    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    received = []

    def read():
        with open(fifo, "rb") as f:  # the writer's open waits for this one
            received.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sink = writer(fifo)
    sink.write(1, {"loss": 2.0})
    sink.close()
    reader.join(timeout=10)
    assert [json.loads(line)["loss"] for line in received[0].splitlines()] == [2.0]


@pytest.mark.parametrize("earlier, refused, pair", [
    ({}, {"loss/train": 1.0, "loss_train": 2.0}, "'loss/train' and 'loss_train'"),  # in one write
    ({"loss/train": 1.0}, {"loss_train": 2.0}, "'loss/train' and 'loss_train'"),  # a later write
    ({}, {"a.b": 1.0, "a-b": 2.0}, "'a.b' and 'a-b'"),
])
def test_prometheus_rejects_names_that_share_a_gauge_before_writing(tmp_path, earlier, refused, pair):
    # Was: prometheus_client's DuplicateTimeseries after the JSONL line (and some gauges) were written.
    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    prometheus = PrometheusSink(0, addr="127.0.0.1")
    multi = MultiSink([jsonl, prometheus])
    try:
        if earlier:
            multi.write(1, earlier)
        with pytest.raises(ValueError, match=rf"PrometheusSink: metrics {pair} would both be the "
                                             r"gauge 'jaxopt_train_\w+' .*rename one"):
            multi.write(2, refused)
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == ([1] if earlier else [])
        assert _scrape(prometheus.port).get("jaxopt_train_step") == (1 if earlier else None)
        multi.write(3, {"loss": 0.5})  # the sink still works after refusing
        assert _scrape(prometheus.port)["jaxopt_train_loss"] == 0.5
    finally:
        multi.close()


def test_metrics_logger_checks_its_sinks_before_the_jsonl_line(tmp_path):
    import io

    from jaxopt_train.train.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), total_steps=4, prometheus_port=0, progress="lines",
                           stream=io.StringIO())
    try:
        with pytest.raises(ValueError, match="'loss/train' and 'loss_train' would both be"):
            logger.log(1, {"loss/train": 1.0, "loss_train": 2.0})
        logger.log(2, {"loss": 1.0})
    finally:
        logger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2]


def test_metrics_logger_passes_numpy_and_jax_scalars_to_its_sinks(tmp_path):
    # Was: only Python int/float reached TensorBoard and Prometheus, so a loss given as
    # np.float32 or a 0-d jax array was in metrics.jsonl but silently missing there.
    import io

    import jax.numpy as jnp
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxopt_train.train.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), total_steps=4, tensorboard=True, prometheus_port=0,
                           progress="lines", stream=io.StringIO())
    try:
        logger.log(1, {"loss": np.float32(2.5), "acc": jnp.asarray(0.5, jnp.float32),
                       "tokens": np.int64(7), "lr": 0.1, "note": "warmup", "flag": np.bool_(True)})
        scraped = _scrape(logger.prometheus_port)
    finally:
        logger.close()
    assert scraped["jaxopt_train_loss"] == 2.5 and scraped["jaxopt_train_acc"] == 0.5
    assert scraped["jaxopt_train_tokens"] == 7.0 and "jaxopt_train_note" not in scraped
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["acc", "loss", "lr", "tokens"]


@pytest.mark.parametrize("name", ["step", "time"])
def test_metrics_logger_refuses_metrics_named_like_the_record_fields(tmp_path, name):
    # Was: {"step": 3} replaced the record's step, and a plot then read the later record
    # as a resume from step 3 and dropped the earlier steps.
    import io

    from jaxopt_train.train.metrics import JsonlWriter, MetricsLogger

    logger = MetricsLogger(str(tmp_path), total_steps=4, progress="lines", stream=io.StringIO())
    try:
        logger.log(10, {"loss": 1.0})
        with pytest.raises(ValueError, match=rf"metric names \['{name}'\] are reserved"):
            logger.log(20, {"loss": 0.9, name: 3})
        logger.log(30, {"loss": 0.8})
    finally:
        logger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [10, 30]
    writer = JsonlWriter(tmp_path / "other.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        writer.write(1, {name: 1.0})
    writer.close()
    assert (tmp_path / "other.jsonl").read_text() == ""


def test_tensorboard_hides_the_steps_a_resumed_run_logs_again(tmp_path):
    # Was: a run resumed from a checkpoint older than its last log line left the crashed
    # run's later points in TensorBoard, so each curve went back and repeated its steps.
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxopt_train.train.metrics import MetricsLogger

    for start, steps, loss in ((0, (10, 20, 30, 40), 1.0), (20, (30, 40), 2.0)):
        logger = MetricsLogger(str(tmp_path), total_steps=40, start_step=start, tensorboard=True,
                               progress="lines", stream=io.StringIO())
        for step in steps:
            logger.log(step, {"loss": loss})
        logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]
    sink = TensorBoardSink(tmp_path / "direct", purge_step=3)  # the sink alone takes it too
    sink.close()
    with pytest.raises(ValueError, match="purge_step=-1 must be a non-negative int"):
        TensorBoardSink(tmp_path / "bad", purge_step=-1)
