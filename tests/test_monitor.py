"""GPUMonitor: the background sampler against a fake NVML, and its off switch."""

from __future__ import annotations

import io
import time

import pytest

from jaxopt_train.runtime import GPUMonitor
from test_runtime_nvml import FakeGPU, install_fake_nvml, make_fake_nvml, two_gpus


def _wait_for_samples(monitor, count, timeout=5.0):
    deadline = time.monotonic() + timeout
    while min(len(s) for s in monitor.samples.values()) < count:
        assert time.monotonic() < deadline, "the sampler thread produced too few samples"
        time.sleep(0.005)


def test_samples_dcgm_fields_in_background(monkeypatch):
    gpus = two_gpus()
    fake = install_fake_nvml(monkeypatch, make_fake_nvml(gpus))
    with GPUMonitor(interval_s=0.01) as monitor:
        assert monitor.enabled
        latest = monitor.latest()  # available right after start
        assert latest["DCGM_FI_DEV_GPU_UTIL/gpu0"] == 87
        assert latest["DCGM_FI_DEV_GPU_UTIL/gpu1"] == 55
        assert latest["DCGM_FI_DEV_GPU_TEMP/gpu1"] == 51
        assert latest["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL/gpu0"] == 0
        gpus[0].util_gpu = 10  # the GPU changes; the thread must notice
        gpus[0].dbe_volatile = 1
        _wait_for_samples(monitor, 3)
        deadline = time.monotonic() + 5
        while monitor.latest()["DCGM_FI_DEV_GPU_UTIL/gpu0"] != 10:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert monitor.latest()["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL/gpu0"] == 1
    assert fake.calls["shutdown"] == 1
    summary = monitor.summary()
    util = summary["DCGM_FI_DEV_GPU_UTIL/gpu0"]
    assert util["max"] == 87 and util["min"] == 10 and util["last"] == 10
    assert 10 <= util["mean"] <= 87 and util["count"] >= 3
    assert summary["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL/gpu0"]["max"] == 1
    frozen = len(monitor.samples[0])
    time.sleep(0.05)
    assert len(monitor.samples[0]) == frozen, "sampling continued after stop()"
    times = [t for t, _ in monitor.samples[0]]
    assert times == sorted(times)


def test_selected_devices_and_bounded_history(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    with GPUMonitor(interval_s=0.005, devices=[1], max_samples=4) as monitor:
        deadline = time.monotonic() + 5
        while len(monitor.samples[1]) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.05)
    assert list(monitor.samples) == [1] and len(monitor.samples[1]) == 4
    assert all(key.endswith("/gpu1") for key in monitor.latest())


def test_off_without_nvml_says_so_once(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU()], init_error=True))
    log = io.StringIO()
    with GPUMonitor(interval_s=0.01, log=log) as monitor:
        assert not monitor.enabled
        assert monitor.latest() == {} and monitor.summary() == {}
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("GPU monitoring off:") and "Driver Not Loaded" in lines[0]


def test_off_on_this_machine_without_pynvml(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    log = io.StringIO()
    monitor = GPUMonitor(log=log).start()
    monitor.stop()
    assert not monitor.enabled and "not installed" in monitor.reason


@pytest.mark.parametrize("kwargs, error, match", [
    ({"interval_s": 0}, ValueError, "interval_s must be a positive"),
    ({"interval_s": "1"}, ValueError, "interval_s must be a positive"),
    # nan busy-polled NVML; inf (and huge values) killed the sampler thread with OverflowError.
    ({"interval_s": float("nan")}, ValueError, "finite and at most 3600, got interval_s=nan"),
    ({"interval_s": float("inf")}, ValueError, "finite and at most 3600, got interval_s=inf"),
    ({"interval_s": 1e300}, ValueError, "at most 3600, got interval_s=1e"),
    ({"interval_s": -1.0}, ValueError, "interval_s=-1.0"),
    ({"max_samples": 0}, ValueError, "max_samples must be >= 1"),
    ({"max_samples": None}, TypeError, "max_samples must be an int >= 1, got max_samples=None"),
    ({"max_samples": 2.5}, TypeError, "max_samples must be an int >= 1, got max_samples=2.5"),
    ({"max_samples": True}, TypeError, "max_samples must be an int >= 1, got max_samples=True"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GPUMonitor(**kwargs)


def test_edge_arguments_are_accepted():
    import numpy as np

    monitor = GPUMonitor(interval_s=3600, max_samples=np.int64(1))
    assert monitor.interval_s == 3600.0 and monitor._max_samples == 1
    assert type(monitor._max_samples) is int


def test_bad_device_index(monkeypatch):
    fake = install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    with pytest.raises(ValueError, match="out of range"):
        GPUMonitor(devices=[5]).start()
    assert fake.calls["shutdown"] == 1


@pytest.mark.gpu
def test_real_gpu_sampling():
    with GPUMonitor(interval_s=0.05) as monitor:
        time.sleep(0.2)
    assert monitor.enabled
    assert "DCGM_FI_DEV_FB_USED/gpu0" in monitor.latest()
    assert monitor.summary()["DCGM_FI_DEV_GPU_TEMP/gpu0"]["count"] >= 2


def test_demo_prints_summary_and_writes_json(monkeypatch, tmp_path, capsys):
    import json

    from jaxopt_train.runtime import monitor_demo

    install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    path = tmp_path / "monitor.json"
    assert monitor_demo.main(["--seconds", "0.1", "--interval", "0.02", "--load", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DCGM_FI_DEV_GPU_UTIL/gpu1" in out and "matmul calls" in out
    saved = json.loads(path.read_text())
    assert saved["gpu_found"] is True
    assert saved["summary"]["DCGM_FI_DEV_POWER_USAGE/gpu0"]["max"] == 350.0
    assert len(saved["samples"]["gpu0"]) >= 2 and "time" in saved["samples"]["gpu0"][0]


@pytest.mark.parametrize("argv, match", [
    (["--seconds", "-1"], "--seconds must be a finite number >= 0; got -1.0"),  # was time.sleep's
    (["--seconds", "nan"], "--seconds must be a finite number >= 0; got nan"),
    (["--interval", "0"], "--interval: interval_s must be a positive"),
])
def test_demo_refuses_bad_durations_as_usage_errors(argv, match, capsys):
    from jaxopt_train.runtime import monitor_demo

    with pytest.raises(SystemExit) as exit_info:
        monitor_demo.main(argv)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def test_demo_without_a_gpu_writes_json_saying_why(monkeypatch, tmp_path):
    """--json PATH wrote nothing on a machine without a GPU: a script reading PATH failed."""
    import json

    from jaxopt_train.runtime import monitor_demo

    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU()], init_error=True))
    path = tmp_path / "monitor.json"
    assert monitor_demo.main(["--seconds", "0", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert saved["gpu_found"] is False and "Driver Not Loaded" in saved["reason"]
    assert saved["summary"] == {} and saved["samples"] == {}


@pytest.mark.parametrize("devices, error, match", [
    # Was: a wrong type read as "NVML could not list GPUs", and [0, 0] sampled GPU 0 twice.
    (1, TypeError, "GPU indices must be a list of distinct ints >= 0 .*got int: 1"),
    ("01", TypeError, "got str: '01'"),
    ([True], TypeError, r"got \[True\]"),
    ([0.0], TypeError, r"got \[0.0\]"),
    ([0, 0], ValueError, r"distinct ints >= 0 .*got \[0, 0\]"),
    ([-1], ValueError, r"got \[-1\]"),
])
def test_devices_are_checked_when_the_monitor_is_made(monkeypatch, devices, error, match):
    fake = install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    with pytest.raises(error, match=match):
        GPUMonitor(devices=devices)
    assert fake.calls.get("init", 0) == 0  # refused before NVML was touched


def test_numpy_device_indices_are_accepted(monkeypatch):
    import numpy as np

    install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    for devices in ([np.int64(1)], np.array([1])):
        with GPUMonitor(interval_s=3600, devices=devices) as monitor:
            assert list(monitor.samples) == [1] and type(next(iter(monitor.samples))) is int


def test_a_stopped_monitor_says_it_cannot_restart(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    monitor = GPUMonitor(interval_s=3600).start()
    with pytest.raises(RuntimeError, match="already started"):
        monitor.start()
    monitor.stop()
    with pytest.raises(RuntimeError, match="was stopped and cannot restart; create a new GPUMonitor"):
        monitor.start()
    assert monitor.latest()  # the samples stay readable
