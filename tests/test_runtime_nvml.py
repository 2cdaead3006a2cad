"""A fake `pynvml` module (the NVML boundary) and tests of jaxopt_train.runtime.nvml.

The fake is shared by test_doctor.py and test_monitor.py. It copies every constant
from the real nvidia-ml-py bindings and only defines functions the real module has
(checked below), so code that passes against it calls NVML the way the real one wants.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from jaxopt_train.runtime import nvml as nvml_lib


@dataclasses.dataclass
class FakeGPU:
    name: str = "NVIDIA H200"
    total: int = 141 * 2**30
    used: int = 2 * 2**30
    util_gpu: int = 87
    util_memory: int = 42
    power_mw: int = 350_000
    power_limit_mw: int = 700_000
    default_power_limit_mw: int = 700_000
    temperature: int = 45
    sm_clock: int = 1980
    sm_clock_max: int = 1980
    mem_clock: int = 3201
    mem_clock_max: int = 3201
    clock_reasons: int = 0
    ecc_on: bool = True
    dbe_volatile: int = 0
    dbe_aggregate: int = 0
    sbe_volatile: int = 3
    mig: int | None = 0  # None: MIG not supported
    bus_id: str = "00000000:07:00.0"


def make_fake_nvml(gpus: list[FakeGPU], *, driver: str = "580.95.05", cuda: int = 13000,
                   nvlinks: dict[tuple[int, int], int] | None = None, topology_level: int = 30,
                   init_error: bool = False, nvswitch_links: int = 0) -> types.ModuleType:
    """A module object standing in for pynvml, describing `gpus`.

    Args:
      nvlinks: `{(i, j): number of links}` from GPU i to GPU j (both directions).
      topology_level: nvmlDeviceGetTopologyCommonAncestor's answer for pairs without NVLink.
      nvswitch_links: links from every GPU to an NVSwitch (HGX boards): the remote PCI id
        of each link is the switch's, and NVLink P2P between all GPUs reports OK.
    """
    import pynvml as real

    fake = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith("NVML_") or name.startswith("nvmlClocks"):
            setattr(fake, name, getattr(real, name))

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - the real name
        pass

    fake.NVMLError, fake.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    fake.calls = {"init": 0, "shutdown": 0}
    links: dict[int, list[int]] = {i: [] for i in range(len(gpus))}  # gpu -> remote gpu per link
    for (i, j), count in (nvlinks or {}).items():
        links[i] += [j] * count
        links[j] += [i] * count

    def nvmlInit():
        if init_error:
            raise NVMLError("Driver Not Loaded")
        fake.calls["init"] += 1

    def nvmlShutdown():
        fake.calls["shutdown"] += 1

    def handle(i):
        if not 0 <= i < len(gpus):
            raise NVMLError("Invalid Argument")
        return ("handle", i)

    def gpu(h):
        return gpus[h[1]]

    def ecc(h, error_type, counter):
        g = gpu(h)
        if error_type == real.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return g.sbe_volatile
        return g.dbe_volatile if counter == real.NVML_VOLATILE_ECC else g.dbe_aggregate

    def mig(h):
        if gpu(h).mig is None:
            raise NVMLError_NotSupported("Not Supported")
        return (gpu(h).mig, gpu(h).mig)

    def nvlink_state(h, link):
        if link >= real.NVML_NVLINK_MAX_LINKS:
            raise NVMLError("Invalid Argument")
        return 1 if link < len(links[h[1]]) + nvswitch_links else 0

    def nvlink_remote(h, link):
        if link >= len(links[h[1]]):
            return types.SimpleNamespace(busId=b"00000000:A1:00.0")  # an NVSwitch
        return types.SimpleNamespace(busId=gpus[links[h[1]][link]].bus_id.encode())

    def p2p_status(a, b, index):
        nvlink_p2p = nvswitch_links or any(b[1] == j for j in links[a[1]])
        if index == real.NVML_P2P_CAPS_INDEX_NVLINK and nvlink_p2p:
            return real.NVML_P2P_STATUS_OK
        return real.NVML_P2P_STATUS_NOT_SUPPORTED

    functions = {
        "nvmlInit": nvmlInit,
        "nvmlShutdown": nvmlShutdown,
        "nvmlSystemGetDriverVersion": lambda: driver,
        "nvmlSystemGetCudaDriverVersion": lambda: cuda,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": handle,
        "nvmlDeviceGetName": lambda h: gpu(h).name.encode(),  # old bindings return bytes
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            total=gpu(h).total, used=gpu(h).used, free=gpu(h).total - gpu(h).used),
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(
            gpu=gpu(h).util_gpu, memory=gpu(h).util_memory),
        "nvmlDeviceGetPowerUsage": lambda h: gpu(h).power_mw,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: gpu(h).power_limit_mw,
        "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: gpu(h).default_power_limit_mw,
        "nvmlDeviceGetTemperature": lambda h, sensor: gpu(h).temperature,
        "nvmlDeviceGetClockInfo": lambda h, kind: (
            gpu(h).sm_clock if kind == real.NVML_CLOCK_SM else gpu(h).mem_clock),
        "nvmlDeviceGetMaxClockInfo": lambda h, kind: (
            gpu(h).sm_clock_max if kind == real.NVML_CLOCK_SM else gpu(h).mem_clock_max),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: gpu(h).clock_reasons,
        "nvmlDeviceGetTotalEccErrors": ecc,
        "nvmlDeviceGetEccMode": lambda h: (int(gpu(h).ecc_on), int(gpu(h).ecc_on)),
        "nvmlDeviceGetMigMode": mig,
        "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(busId=gpu(h).bus_id),
        "nvmlDeviceGetNvLinkState": nvlink_state,
        "nvmlDeviceGetNvLinkRemotePciInfo": nvlink_remote,
        "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: topology_level,
        "nvmlDeviceGetP2PStatus": p2p_status,
    }
    for name, fn in functions.items():
        setattr(fake, name, fn)
    fake.function_names = sorted(functions)
    return fake


def install_fake_nvml(monkeypatch, fake: types.ModuleType) -> types.ModuleType:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def two_gpus() -> list[FakeGPU]:
    return [FakeGPU(), FakeGPU(bus_id="00000000:0F:00.0", util_gpu=55, temperature=51)]


def test_fake_only_uses_real_pynvml_functions():
    import pynvml as real

    fake = make_fake_nvml(two_gpus())
    missing = [name for name in fake.function_names if not callable(getattr(real, name, None))]
    assert not missing, f"the fake defines functions real pynvml lacks: {missing}"


def test_load_nvml_reports_why_not(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml([], init_error=True))
    nvml, reason = nvml_lib.load_nvml()
    assert nvml is None and "Driver Not Loaded" in reason
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    nvml, reason = nvml_lib.load_nvml()
    assert nvml is None and "not installed" in reason


def test_session_shuts_down(monkeypatch):
    fake = install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus()))
    with nvml_lib.nvml_session() as (nvml, reason):
        assert nvml is fake and reason == ""
    assert fake.calls == {"init": 1, "shutdown": 1}


def test_read_dcgm_fields_units():
    gpu = FakeGPU(used=3 * 2**30, power_mw=412_500, dbe_volatile=2)
    fake = make_fake_nvml([gpu])
    sample = nvml_lib.read_dcgm_fields(fake, fake.nvmlDeviceGetHandleByIndex(0))
    assert sample["DCGM_FI_DEV_GPU_UTIL"] == 87
    assert sample["DCGM_FI_DEV_MEM_COPY_UTIL"] == 42
    assert sample["DCGM_FI_DEV_FB_USED"] == 3 * 1024  # MiB, as DCGM reports it
    assert sample["DCGM_FI_DEV_FB_FREE"] == (141 - 3) * 1024
    assert sample["DCGM_FI_DEV_POWER_USAGE"] == 412.5  # W
    assert sample["DCGM_FI_DEV_GPU_TEMP"] == 45
    assert sample["DCGM_FI_DEV_SM_CLOCK"] == 1980
    assert sample["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == 2
    assert sample["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] == 3


def test_unsupported_fields_are_left_out():
    fake = make_fake_nvml([FakeGPU()])

    def not_supported(*args):
        raise fake.NVMLError_NotSupported("Not Supported")

    fake.nvmlDeviceGetTotalEccErrors = not_supported
    sample = nvml_lib.read_dcgm_fields(fake, fake.nvmlDeviceGetHandleByIndex(0))
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" not in sample
    assert sample["DCGM_FI_DEV_GPU_UTIL"] == 87


def test_device_handles_validates_indices():
    fake = make_fake_nvml(two_gpus())
    assert [i for i, _ in nvml_lib.device_handles(fake)] == [0, 1]
    assert [i for i, _ in nvml_lib.device_handles(fake, [1])] == [1]
    with pytest.raises(ValueError, match=r"out of range.*count=2"):
        nvml_lib.device_handles(fake, [2])
