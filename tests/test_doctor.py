"""jaxopt-train doctor: on this CPU machine for real, GPU lines through a fake NVML."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from jaxopt_train.runtime import doctor
from test_runtime_nvml import FakeGPU, install_fake_nvml, make_fake_nvml, two_gpus


def _by_name(checks):
    return {c.name: c for c in checks}


CUDA13 = {13: "0.10.2"}  # as if the jax-cuda13 plugin wheel were installed


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                    reason="a GPU machine: its nvidia checks report the GPUs, not their absence")
def test_cli_on_cpu_without_gpu():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, "-m", "jaxopt_train.runtime.doctor", "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True and report["counts"]["fail"] == 0
    assert checks["jax"]["status"] == "pass" and checks["jax"]["detail"][0].isdigit()
    assert checks["backend"]["status"] == "warn" and "no GPU" in checks["backend"]["detail"]
    assert checks["nvidia"]["status"] == "warn"
    assert {"python", "jaxlib", "flax", "optax", "orbax-checkpoint", "jax-triton", "triton",
            "matmul precision", "XLA_FLAGS", "memory settings"} <= set(checks)


def test_text_report_and_exit_code(monkeypatch, capsys):
    install_fake_nvml(monkeypatch, make_fake_nvml([], init_error=True))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "[WARN] nvidia: no NVIDIA GPU checks" in out and "fix:" in out
    assert out.strip().splitlines()[-1].endswith("0 fail")


def test_bad_xla_flags_fail_without_aborting(monkeypatch, capsys):
    install_fake_nvml(monkeypatch, make_fake_nvml([], init_error=True))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_no_such_flag=true")
    assert doctor.main(["--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["XLA_FLAGS"]["status"] == "fail"
    assert "xla_gpu_no_such_flag" in checks["XLA_FLAGS"]["detail"]
    assert checks["backend"]["status"] == "fail"


@pytest.mark.parametrize("env, expected", [
    ({"XLA_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, "both"),
    ({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "not a number in (0, 1]"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "magic"}, "not one of"),
    # Were a pass: jaxlib's int() of them fails when the GPU backend starts.
    ({"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": "1GB"}, "not a whole number of MiB"),
    ({"XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "yes"}, "is not an integer such as 0 or 1"),
    ({"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "true"}, "is not an integer such as 0 or 1"),
])
def test_memory_settings_fail(monkeypatch, env, expected):
    for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    checks, safe = doctor.check_xla_env()
    failed = [c for c in checks if c.status == "fail"]
    assert not safe and failed and expected in failed[0].detail and failed[0].fix


@pytest.mark.parametrize("var, value", [("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "1GB"),
                                        ("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "yes"),
                                        ("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "true")])
def test_jaxlib_refuses_the_integer_settings_the_doctor_fails(monkeypatch, var, value):
    from jaxlib import xla_client

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match="invalid literal for int"):  # the GPU backend's start-up
        xla_client.generate_pjrt_gpu_plugin_options()


@pytest.mark.parametrize("value", ["no", "off", "FALSE"])
def test_preallocate_spellings_jaxlib_reads_as_true_warn(monkeypatch, value):
    # Was a pass: jaxlib turns preallocation off only for "false", "False" and "0".
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", value)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    checks, safe = doctor.check_xla_env()
    (warned,) = [c for c in checks if c.status == "warn"]
    assert safe and f"XLA_PYTHON_CLIENT_PREALLOCATE={value!r} means preallocate" in warned.detail
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in warned.fix


def test_empty_memory_settings_are_unset_as_jaxlib_reads_them(monkeypatch):
    """jaxlib skips an empty fraction or collective size (`if value:`); the doctor failed them,
    and on "" and 0.5 together reported both as set."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    checks, safe = doctor.check_xla_env()
    assert safe and _by_name(checks)["memory settings"].status == "pass"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "")  # jaxlib: int("")
    checks, _ = doctor.check_xla_env()
    assert any(c.status == "fail" and "ABORT_COLLECTIVES_ON_FAILURE=''" in c.detail for c in checks)


def test_memory_settings_pass(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.45")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    checks, safe = doctor.check_xla_env()
    memory = _by_name(checks)["memory settings"]
    assert safe and memory.status == "pass"
    assert "XLA_CLIENT_MEM_FRACTION=0.45" in memory.detail and "PREALLOCATE=false" in memory.detail


def test_healthy_gpus_pass(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus(), nvlinks={(0, 1): 18}))
    checks = _by_name(doctor.check_gpus(CUDA13))
    assert all(c.status == "pass" for c in checks.values()), [c for c in checks.values() if c.status != "pass"]
    assert "580.95.05" in checks["driver"].detail and ">= 580.65.6" in checks["driver"].detail
    assert "13.0" in checks["cuda"].detail
    assert "NVIDIA H200" in checks["gpu0"].detail and "141.0 GiB" in checks["gpu0"].detail
    assert checks["topology gpu0-gpu1"].detail.startswith("NVLink x18")
    assert "volatile 0, aggregate 0" in checks["gpu1 ECC"].detail
    assert "SM 1980/1980 MHz" in checks["gpu0 clocks"].detail
    assert "350 W of 700 W" in checks["gpu0 power"].detail


def test_nvswitch_board_reports_nvlink(monkeypatch):
    # Seen on the H200 machine: links end at NVSwitches, nvidia-smi topo says NV18.
    install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus(), nvswitch_links=18, topology_level=10))
    topo = _by_name(doctor.check_gpus(CUDA13))["topology gpu0-gpu1"]
    assert topo.status == "pass" and "NVSwitch (18 active links" in topo.detail


def test_old_driver_fails(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU()], driver="550.54.14", cuda=12040))
    checks = _by_name(doctor.check_gpus(CUDA13))
    assert checks["driver"].status == "fail" and "580.65.6" in checks["driver"].fix
    assert checks["cuda"].status == "fail" and "12.4" in checks["cuda"].detail


def test_gpu_problems(monkeypatch, capsys):
    gpus = [FakeGPU(dbe_volatile=1, mig=1, clock_reasons=0x40 | 0x1, power_limit_mw=400_000),
            FakeGPU(bus_id="00000000:0F:00.0", dbe_aggregate=4, ecc_on=True, mig=None)]
    install_fake_nvml(monkeypatch, make_fake_nvml(gpus, topology_level=50))
    checks = _by_name(doctor.check_gpus(CUDA13))
    assert checks["gpu0 ECC"].status == "fail" and "nvidia-smi -r" in checks["gpu0 ECC"].fix
    assert checks["gpu1 ECC"].status == "warn" and "aggregate 4" in checks["gpu1 ECC"].detail
    assert checks["gpu0 MIG"].status == "warn"
    assert checks["gpu1 MIG"].status == "pass" and checks["gpu1 MIG"].detail == "not supported"
    assert checks["gpu0 clocks"].status == "warn" and "hardware thermal" in checks["gpu0 clocks"].detail
    assert checks["gpu0 power"].status == "warn"
    topo = checks["topology gpu0-gpu1"]
    assert topo.status == "warn" and "SYS" in topo.detail
    # The whole command fails because of the double-bit error.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert doctor.main([]) == 1
    assert "[FAIL] gpu0 ECC" in capsys.readouterr().out


def test_ecc_off_warns(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU(ecc_on=False)]))
    assert _by_name(doctor.check_gpus(CUDA13))["gpu0 ECC"].status == "warn"


def test_no_cuda_plugin_warns(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU()]))
    driver = _by_name(doctor.check_gpus({}))["driver"]
    assert driver.status == "warn" and "jax[cuda13]" in driver.fix


@pytest.mark.parametrize("lost_in", ["nvmlDeviceGetName", "nvmlDeviceGetHandleByIndex"])
def test_a_lost_gpu_fails_its_line_and_the_others_still_report(monkeypatch, capsys, lost_in):
    fake = install_fake_nvml(monkeypatch, make_fake_nvml(two_gpus(), nvlinks={(0, 1): 18}))
    working = getattr(fake, lost_in)

    def lost_on_gpu1(arg, *rest):
        if arg in (1, ("handle", 1)):
            raise fake.NVMLError("GPU is lost")
        return working(arg, *rest)

    monkeypatch.setattr(fake, lost_in, lost_on_gpu1)
    checks = _by_name(doctor.check_gpus(CUDA13))
    assert checks["gpu1"].status == "fail" and "GPU is lost" in checks["gpu1"].detail
    assert "nvidia-smi" in checks["gpu1"].fix
    assert checks["gpu0"].status == "pass" and checks["gpu0 ECC"].status == "pass"
    assert checks["driver"].status == "pass" and "gpu1 ECC" not in checks
    assert not any(name.startswith("topology") for name in checks)  # one GPU left
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] gpu1: NVML error: GPU is lost" in out and "[PASS] gpu0:" in out
    assert fake.calls["shutdown"] == fake.calls["init"]


@pytest.mark.skipif(bool(doctor._jax_cuda_plugins()), reason="a JAX CUDA plugin is installed here")
def test_cli_with_cuda_platform_but_no_cuda_fails_without_a_traceback():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cuda"
    result = subprocess.run([sys.executable, "-m", "jaxopt_train.runtime.doctor", "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    backend = {c["name"]: c for c in json.loads(result.stdout)["checks"]}["backend"]
    assert backend["status"] == "fail" and "JAX_PLATFORMS" in backend["fix"]


def test_backend_that_fails_with_any_exception_is_a_fail_line(monkeypatch):
    # JAX_PLATFORMS=cuda without CUDA ends in a bare AssertionError from xla_bridge.
    import jax

    def no_cuda(*args, **kwargs):
        raise AssertionError

    monkeypatch.setattr(jax, "devices", no_cuda)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    checks, devices = doctor.check_backend()
    assert devices == [] and [c.name for c in checks] == ["backend"]
    assert checks[0].status == "fail" and "JAX_PLATFORMS" in checks[0].fix
    assert checks[0].detail.endswith("AssertionError with JAX_PLATFORMS='cuda'")


def test_bad_flag():
    with pytest.raises(SystemExit) as err:
        doctor.main(["--no-such-option"])
    assert err.value.code == 2


@pytest.mark.gpu
def test_real_gpu_machine():
    checks = _by_name(doctor.run_checks())
    assert checks["backend"].status == "pass"
    assert checks["gpu0"].status == "pass" and "GiB" in checks["gpu0"].detail
    assert checks["driver"].status == "pass"


@pytest.mark.parametrize("flags", [
    r"--xla_dump_hlo_module_re=jit_train\.step|jit_eval --xla_dump_hlo_pass_re=it's",
    "FILE",  # XLA_FLAGS naming a file of flags, which XLA reads
])
def test_xla_flags_that_xla_accepts_pass(monkeypatch, tmp_path, flags):
    # Was: a false FAIL (shlex lost the backslash, refused the apostrophe, took the path for a flag).
    if flags == "FILE":
        path = tmp_path / "flags.txt"
        path.write_text("--xla_gpu_deterministic_ops=true\n")
        flags = str(path)
    monkeypatch.setenv("XLA_FLAGS", flags)
    checks, backend_safe = doctor.check_xla_env()
    check = _by_name(checks)["XLA_FLAGS"]
    assert check.status == "pass" and backend_safe, check
    assert (r"jit_train\.step" in check.detail if "jit" in flags
            else check.detail == "--xla_gpu_deterministic_ops=true")


def test_missing_xla_flags_file_fails(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "/no/such/flags.txt")
    checks, backend_safe = doctor.check_xla_env()
    check = _by_name(checks)["XLA_FLAGS"]
    assert check.status == "fail" and not backend_safe
    assert "path of a file of flags, and that file cannot be read" in check.detail


def test_versions_below_what_jaxopt_train_requires_fail(monkeypatch):
    # Was: any installed version passed, so jax 0.4.30 read "[PASS] jax: 0.4.30".
    old = {"jax": "0.4.30", "jaxlib": "0.4.30", "flax": "0.12.8", "optax": "0.2.4",
           "orbax-checkpoint": "0.11.0rc1"}
    monkeypatch.setattr(doctor, "_version", old.get)
    checks = _by_name(doctor.check_packages())
    assert checks["jax"].status == doctor.FAIL and "0.4.30, below 0.10" in checks["jax"].detail
    assert checks["jax"].fix == "pip install -U 'jax>=0.10'"
    assert checks["optax"].status == doctor.FAIL and checks["flax"].status == doctor.PASS
    assert checks["orbax-checkpoint"].status == doctor.PASS  # a pre-release of the minimum


def test_doctor_minimum_versions_are_pyproject_dependencies():
    import pathlib
    import tomllib

    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for dist, minimum in doctor.MIN_VERSIONS.items():
        assert f"{dist}>={minimum}" in dependencies


def _fake_gpus(monkeypatch, *capabilities, kind="NVIDIA GPU", triton=True):
    """jax answers GPUs of `capabilities` ("7.5"); jax_triton imports (a stand-in) if `triton`."""
    import types

    gpus = [types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=c)
            for c in capabilities]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: gpus)
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: gpus)
    monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton") if triton else None)


@pytest.mark.parametrize("capabilities, kind, status, parts", [
    (("9.0",), "NVIDIA H200", "pass",
     ["NVIDIA H200 (sm_90)", "bf16 tensor cores", "cuDNN attention", "matmul kernels: mosaic_gpu, triton"]),
    (("8.0",), "NVIDIA A100-SXM4-80GB", "pass",
     ["(sm_80)", "bf16 tensor cores", "cuDNN attention", "matmul kernels: triton"]),
    (("8.9",), "NVIDIA L4", "pass", ["(sm_89)", "cuDNN attention", "matmul kernels: triton"]),
    (("7.5",), "Tesla T4", "warn", ["Tesla T4 (sm_75): matmul kernels: none (--matmul xla)",
                                    "bf16 matmuls run in float32"]),
    (("9.0", "7.5"), "mixed", "warn", ["(sm_75)"]),  # the oldest GPU of the process decides
])
def test_fast_paths_say_what_the_gpu_generation_gives(monkeypatch, capabilities, kind, status,
                                                      parts):
    """A T4 user (Colab's default GPU) learned only from a slow run that bf16 has no tensor
    cores there and that cuDNN attention and our kernels need newer GPUs."""
    _fake_gpus(monkeypatch, *capabilities, kind=kind)
    check = doctor.check_fast_paths()
    assert check.name == "fast paths" and check.status == status, check
    for part in parts:
        assert part in check.detail, (part, check.detail)
    assert ("--precision fp16" in check.fix) == (status == "warn")


def test_fast_paths_name_the_missing_jax_triton(monkeypatch):
    _fake_gpus(monkeypatch, "8.0", kind="NVIDIA A100-SXM4-80GB", triton=False)
    assert doctor.check_fast_paths().detail.endswith("matmul kernels: none (--matmul xla)")


def test_the_backend_checks_hold_the_fast_paths_line_only_on_a_gpu(monkeypatch):
    names = [c.name for c in doctor.check_backend()[0]]
    # No GPU paths to speak of on the CPU machine; the GPU machine's real line (H200):
    # "NVIDIA H200 (sm_90): bf16 tensor cores; cuDNN attention; matmul kernels: mosaic_gpu, triton"
    assert ("fast paths" in names) == (jax.default_backend() == "gpu")
    _fake_gpus(monkeypatch, "8.9", kind="NVIDIA L4")
    checks, _ = doctor.check_backend()
    assert [c.name for c in checks] == ["backend", "fast paths", "matmul precision"]


def test_doctor_empty_preallocate_is_unset_as_jaxlib_reads_it(monkeypatch):
    # jaxlib: `if preallocate:`; an empty value leaves XLA's default. It warned "means preallocate".
    for var in [v for v in os.environ if v.startswith("XLA")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "")
    checks, safe = doctor.check_xla_env()
    assert safe and all(c.status == "pass" for c in checks), checks
    assert "PREALLOCATE" not in " ".join(c.detail for c in checks)
