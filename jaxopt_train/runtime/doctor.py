"""`jaxopt-train doctor [--json]`: is this machine set up to train fast?

Each line is pass, warn or fail, with the fix. Versions of the stack; the JAX backend
and devices; for NVIDIA GPUs (through NVML) the driver against what the installed
JAX CUDA build needs, MIG, ECC double-bit errors, NVLink/PCIe topology, clocks and
power; which of the GPU fast paths (bf16 tensor cores, cuDNN attention, our matmul
kernels) the GPU has; the default matmul precision and the XLA settings in force. Runs
on CPU-only machines (and says there is no GPU). Exits 1 only when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from types import ModuleType

from jaxopt_train.runtime import nvml as nvml_lib
from jaxopt_train.runtime.memory import PREALLOCATE_OFF

PASS, WARN, FAIL = "pass", "warn", "fail"

# Minimum Linux driver per CUDA major version of JAX's CUDA wheels (CUDA toolkit
# release notes, "minor version compatibility"; JAX's install guide quotes the same).
MIN_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}

# The oldest versions jaxopt_train takes (pyproject.toml's dependencies; a test keeps them equal).
MIN_VERSIONS = {"jax": "0.10", "flax": "0.12", "optax": "0.2.5", "orbax-checkpoint": "0.11"}

# Bits of nvmlDeviceGetCurrentClocksEventReasons that mean the GPU is being slowed.
_SLOWDOWN_REASONS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                     0x40: "hardware thermal slowdown", 0x80: "power brake"}
# nvmlDeviceGetTopologyCommonAncestor levels, in nvidia-smi topo -m's words.
_TOPOLOGY = {0: "same board", 10: "PIX (one PCIe switch)", 20: "PXB (several PCIe switches)",
             30: "PHB (PCIe host bridge)", 40: "NODE (across host bridges, same NUMA node)",
             50: "SYS (across NUMA nodes)"}
# The fix for a GPU NVML cannot read (NVMLError "GPU is lost", "Unknown Error").
_GPU_ERROR_FIX = ("check nvidia-smi and the kernel log (dmesg: Xid errors); a lost GPU needs a "
                  "reset (nvidia-smi -r) or a reboot, or the node drained")


@dataclasses.dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: str
    detail: str
    fix: str = ""



# Settings jaxlib's GPU client start-up skips when set to "" (`if value:`).
# PREALLOCATE too: an empty one warned "means preallocate" though jaxlib leaves XLA's default.
_EMPTY_IS_UNSET = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                   "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "XLA_PYTHON_CLIENT_PREALLOCATE")

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _jax_cuda_plugins() -> dict[int, str]:
    """`{cuda_major: version}` of installed JAX CUDA plugin wheels."""
    return {major: v for major in (12, 13) if (v := _version(f"jax-cuda{major}-plugin"))}


def check_packages() -> list[Check]:
    py = sys.version_info
    checks = [Check("python", PASS if py >= (3, 11) else FAIL, sys.version.split()[0],
                    "" if py >= (3, 11) else "jaxopt_train needs Python >= 3.11")]
    for dist in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
        version, minimum = _version(dist), MIN_VERSIONS.get(dist)
        if version is None:
            checks.append(Check(dist, FAIL, "not installed", f"pip install -U {dist}"))
        elif minimum and _release(version) < _release(minimum):
            checks.append(Check(dist, FAIL, f"{version}, below {minimum}, the oldest jaxopt_train takes",
                                f"pip install -U '{dist}>={minimum}'"))
        else:
            checks.append(Check(dist, PASS, version))
    jax_v, jaxlib_v = _version("jax"), _version("jaxlib")
    if jax_v and jaxlib_v and jax_v.split(".")[:2] != jaxlib_v.split(".")[:2]:
        checks.append(Check("jax/jaxlib", FAIL, f"jax {jax_v} with jaxlib {jaxlib_v}",
                            "pip install -U jax jaxlib (matching versions)"))
    for major, version in _jax_cuda_plugins().items():
        ok = version == jaxlib_v
        checks.append(Check(f"jax-cuda{major}-plugin", PASS if ok else WARN,
                            f"{version} (jaxlib {jaxlib_v})",
                            "" if ok else f"pip install -U 'jax[cuda{major}]' so plugin and jaxlib match"))
    for dist, why in (("jax-triton", "the jax-triton matmul kernel"),
                      ("triton", "Pallas' Triton lowering and jax-triton")):
        version = _version(dist)
        checks.append(Check(dist, PASS, version or f"not installed (optional: only {why} needs it)"))
    return checks


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: "0.11.0rc1" -> (0, 11, 0).

    More lenient than PEP 440 on purpose: a release candidate or nightly of the minimum
    itself is not failed.
    """
    match = re.match(r"\d+(\.\d+)*", version)
    parts = tuple(int(part) for part in match.group().split(".")) if match else ()
    while parts and parts[-1] == 0:  # (0, 10, 0) == (0, 10)
        parts = parts[:-1]
    return parts


def _xla_flags_parse_error() -> str | None:
    """XLA aborts the process on a bad XLA_FLAGS entry; try it in a child first."""
    if not os.environ.get("XLA_FLAGS", "").strip():
        return None
    probe = "import jax; jax.devices('cpu')"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.splitlines() if "flag" in line.lower()]
    lines = lines or result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
    # Drop glog's "F1130 02:13:12.473174 10179 file.cc:234] " prefix.
    return lines[0].split("] ", 1)[-1][-300:]


def check_xla_env() -> tuple[list[Check], bool]:
    """XLA_FLAGS and the client memory settings; second value: safe to start the backend."""
    from jaxopt_train.runtime.memory import ALLOCATORS
    from jaxopt_train.runtime.xla_flags import parse_xla_flags

    checks = []
    try:
        flags = parse_xla_flags()
        error = _xla_flags_parse_error()
    except ValueError as err:
        flags, error = {}, str(err)
    if error:
        checks.append(Check("XLA_FLAGS", FAIL, f"XLA rejects XLA_FLAGS: {error}",
                            "remove or correct the flag (XLA aborts at start-up on unknown flags)"))
    else:
        shown = " ".join(f"--{k}={v}" for k, v in flags.items()) or "(none: XLA defaults)"
        checks.append(Check("XLA_FLAGS", PASS, shown))
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("XLA_PYTHON_CLIENT_") or k == "XLA_CLIENT_MEM_FRACTION"}
    # jaxlib reads an empty fraction or collective size as unset (`if value:`), as containers
    # often pass them; the int() settings below it does read, and fails on "".
    env = {k: v for k, v in env.items() if v or k not in _EMPTY_IS_UNSET}
    problems = []
    if "XLA_CLIENT_MEM_FRACTION" in env and "XLA_PYTHON_CLIENT_MEM_FRACTION" in env:
        problems.append(("both XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are set "
                         "(jaxlib refuses to start a GPU backend)",
                         "unset XLA_PYTHON_CLIENT_MEM_FRACTION (the deprecated name)"))
    for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        if var in env:
            try:
                ok = 0 < float(env[var]) <= 1
            except ValueError:
                ok = False
            if not ok:
                problems.append((f"{var}={env[var]!r} is not a number in (0, 1]", f"export {var}=0.9"))
    allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR")
    if allocator is not None and allocator.lower() not in ALLOCATORS:
        problems.append((f"XLA_PYTHON_CLIENT_ALLOCATOR={allocator!r} is not one of {ALLOCATORS}",
                         "unset it or use one of those"))
    # jaxlib's GPU client start-up reads these with int() and raises on anything else.
    integer_settings = {"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": ("a whole number of MiB", "1024"),
                        "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": ("an integer such as 0 or 1", "1"),
                        "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": ("an integer such as 0 or 1", "1")}
    for var, (expected, example) in integer_settings.items():
        if var in env:
            try:
                int(env[var])
            except ValueError:
                problems.append((f"{var}={env[var]!r} is not {expected} (jaxlib's GPU start-up "
                                 "reads it with int() and fails)", f"export {var}={example}"))
    shown = " ".join(f"{k}={v}" for k, v in env.items()) or "(none: XLA preallocates 75% of each GPU)"
    if problems:
        checks += [Check("memory settings", FAIL, what, fix) for what, fix in problems]
    else:
        checks.append(Check("memory settings", PASS, shown))
    preallocate = env.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    # jaxlib turns preallocation off only for PREALLOCATE_OFF's spellings; "no" or "FALSE" turn it on.
    if preallocate is not None and preallocate not in PREALLOCATE_OFF + ("true", "True", "1"):
        checks.append(Check("memory preallocation", WARN,
                            f"XLA_PYTHON_CLIENT_PREALLOCATE={preallocate!r} means preallocate: jaxlib "
                            "turns preallocation off only for 'false', 'False' or '0'",
                            "export XLA_PYTHON_CLIENT_PREALLOCATE=false (or true)"))
    return checks, error is None and not problems


def check_backend() -> tuple[list[Check], list]:
    """Starts the JAX backend; returns the checks and the devices."""
    import jax

    from jaxopt_train.runtime._backend import backend_start_failure  # noqa: PLC0415

    detail = backend_start_failure()  # the doctor must report a failed start, not crash
    if detail is not None:
        return [Check("backend", FAIL, f"JAX could not start a backend: {detail}",
                      "check JAX_PLATFORMS and the jax[cuda] install")], []
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    detail = f"{jax.default_backend()}: {len(devices)} x {', '.join(kinds)}"
    checks = []
    if jax.default_backend() == "gpu":
        checks.append(Check("backend", PASS, detail))
    else:
        checks.append(Check("backend", WARN, f"no GPU: JAX runs on {detail}",
                            "on an NVIDIA machine: pip install -U 'jax[cuda13]' (or cuda12 for "
                            "drivers < 580); check JAX_PLATFORMS is not set to cpu"))
    if jax.default_backend() == "gpu":
        checks.append(check_fast_paths())
    precision = jax.config.jax_default_matmul_precision
    if precision is None and jax.default_backend() == "gpu":
        checks.append(Check("matmul precision", PASS,
                            "default: float32 matmuls run as TF32 on Ampere and newer GPUs",
                            "for full float32: jax.config.update('jax_default_matmul_precision', 'highest')"))
    else:
        checks.append(Check("matmul precision", PASS, f"jax_default_matmul_precision={precision}"))
    return checks, devices


def check_fast_paths() -> Check:
    """Which of the library's GPU fast paths this process's GPUs have (the oldest decides).

    Colab hands out T4s (sm_75), L4s (sm_89) and A100s (sm_80) as well as Hopper parts, and
    each path needs its own generation: bf16 tensor cores and cuDNN's fused attention come
    with Ampere (sm_80), the Triton matmul too (plus jax-triton), the Mosaic GPU kernel with
    Hopper (sm_90). What is missing falls back slower, so say so before a run does.
    """
    import jax

    from jaxopt_train.kernels.matmul import available_backends  # noqa: PLC0415
    from jaxopt_train.models.gpt import cudnn_attention_unavailable  # noqa: PLC0415
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    oldest = min(jax.local_devices(), key=compute_capability)
    major, minor = compute_capability(oldest)
    kernels = [b for b in available_backends() if b in ("mosaic_gpu", "triton")]
    have = [name for name, ok in (("bf16 tensor cores", (major, minor) >= (8, 0)),
                                  ("cuDNN attention", cudnn_attention_unavailable() is None)) if ok]
    have.append(f"matmul kernels: {', '.join(kernels) or 'none (--matmul xla)'}")
    detail = f"{oldest.device_kind} (sm_{major}{minor}): {'; '.join(have)}"
    if (major, minor) >= (8, 0):
        return Check("fast paths", PASS, detail)
    return Check("fast paths", WARN, f"{detail}; no bf16 tensor cores or cuDNN attention before "
                 "Ampere (sm_80): bf16 matmuls run in float32 and attention='auto' uses XLA's",
                 "train with --precision fp16 (its tensor cores, with loss scaling); or take an "
                 "Ampere or newer GPU")


def _parse_driver(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _check_driver(nvml: ModuleType, plugins: dict[int, str]) -> list[Check]:
    driver = nvml_lib.as_text(nvml.nvmlSystemGetDriverVersion())
    cuda = nvml_lib.try_call(nvml.nvmlSystemGetCudaDriverVersion)
    checks = []
    needed_major = max(plugins) if plugins else None
    if needed_major is None:
        checks.append(Check("driver", WARN, f"{driver}, but no JAX CUDA plugin is installed",
                            "pip install -U 'jax[cuda13]' (driver >= 580) or 'jax[cuda12]'"))
    else:
        minimum = MIN_DRIVER[needed_major]
        ok = _parse_driver(driver) >= minimum
        min_text = ".".join(map(str, minimum))
        checks.append(Check("driver", PASS if ok else FAIL,
                            f"{driver} (JAX CUDA {needed_major} needs >= {min_text})",
                            "" if ok else f"upgrade the NVIDIA driver to >= {min_text}, or install "
                            "a JAX CUDA build for an older CUDA (jax[cuda12] needs >= 525.60.13)"))
    if cuda is not None:
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}"
        ok = needed_major is None or cuda // 1000 >= needed_major
        checks.append(Check("cuda", PASS if ok else FAIL, f"driver supports CUDA up to {cuda_text}",
                            "" if ok else f"JAX's CUDA {needed_major} build needs a newer driver"))
    return checks


def _check_gpu(nvml: ModuleType, index: int, handle) -> list[Check]:
    call = nvml_lib.try_call
    name = nvml_lib.as_text(nvml.nvmlDeviceGetName(handle))
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    prefix = f"gpu{index}"
    checks = [Check(prefix, PASS, f"{name}, {memory.total / 2**30:.1f} GiB "
                                  f"({memory.used / 2**30:.1f} GiB in use)")]
    mig = call(nvml.nvmlDeviceGetMigMode, handle)
    if mig is not None and mig[0]:
        checks.append(Check(f"{prefix} MIG", WARN, "MIG mode is on: JAX sees only the MIG instance "
                            "CUDA_VISIBLE_DEVICES selects, with its slice of memory and SMs",
                            "size batches with jaxopt_train.runtime.fits(); an admin turns MIG off "
                            "with nvidia-smi -mig 0"))
    else:
        checks.append(Check(f"{prefix} MIG", PASS, "off" if mig is not None else "not supported"))
    checks.append(_check_ecc(nvml, prefix, handle))
    checks.append(_check_clocks(nvml, prefix, handle))
    power = call(nvml.nvmlDeviceGetPowerUsage, handle)
    limit = call(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    default = call(nvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
    if power is not None and limit is not None:
        capped = default is not None and limit < 0.9 * default
        detail = f"{power / 1000:.0f} W of {limit / 1000:.0f} W limit"
        if capped:
            detail += f" (default limit {default / 1000:.0f} W)"
        checks.append(Check(f"{prefix} power", WARN if capped else PASS, detail,
                            "an admin restores the default with nvidia-smi -pl" if capped else ""))
    return checks


def _check_ecc(nvml: ModuleType, prefix: str, handle) -> Check:
    call = nvml_lib.try_call
    mode = call(nvml.nvmlDeviceGetEccMode, handle)
    if mode is None:
        return Check(f"{prefix} ECC", PASS, "not supported on this GPU")
    if not mode[0]:
        return Check(f"{prefix} ECC", WARN, "ECC is off: memory errors go undetected",
                     "an admin enables it with nvidia-smi -e 1 (and a reboot)")
    uncorrected = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    volatile = call(nvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected, nvml.NVML_VOLATILE_ECC)
    aggregate = call(nvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected, nvml.NVML_AGGREGATE_ECC)
    detail = f"double-bit errors: volatile {volatile}, aggregate {aggregate}"
    if volatile:
        return Check(f"{prefix} ECC", FAIL, detail,
                     "uncorrectable memory errors since the last reset: stop jobs on this GPU and "
                     "have it reset (nvidia-smi -r) or the node drained; see nvidia-smi -q -d ECC")
    if aggregate:
        return Check(f"{prefix} ECC", WARN, detail,
                     "past uncorrectable errors: check row remapping (nvidia-smi -q -d ROW_REMAPPER)")
    return Check(f"{prefix} ECC", PASS, detail)


def _check_clocks(nvml: ModuleType, prefix: str, handle) -> Check:
    call = nvml_lib.try_call
    sm, sm_max = (call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                  call(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM))
    mem, mem_max = (call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
                    call(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_MEM))
    temp = call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
    reasons = call(nvml_lib.clocks_event_reasons, nvml, handle)
    detail = f"SM {sm}/{sm_max} MHz, memory {mem}/{mem_max} MHz, {temp} C (idle GPUs clock low)"
    slowed = [text for bit, text in _SLOWDOWN_REASONS.items() if reasons and reasons & bit]
    if slowed:
        return Check(f"{prefix} clocks", WARN, f"{detail}; slowed by {', '.join(slowed)}",
                     "check cooling and power delivery (nvidia-smi -q -d PERFORMANCE)")
    return Check(f"{prefix} clocks", PASS, detail)


def _bus_id(text) -> tuple[int, str]:
    domain, _, rest = nvml_lib.as_text(text).lower().partition(":")
    return int(domain, 16), rest


def _nvlink_p2p(nvml: ModuleType, handle_a, handle_b) -> bool:
    get = getattr(nvml, "nvmlDeviceGetP2PStatus", None)
    index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    if get is None or index is None:
        return False
    return nvml_lib.try_call(get, handle_a, handle_b, index) == getattr(nvml, "NVML_P2P_STATUS_OK", 0)


def _check_topology(nvml: ModuleType, handles: list) -> list[Check]:
    if len(handles) < 2:
        return []
    call = nvml_lib.try_call
    bus = {i: _bus_id(nvml.nvmlDeviceGetPciInfo(h).busId) for i, h in handles}
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    checks = []
    for a, (i, handle_i) in enumerate(handles):
        links_to: dict[int, int] = {}
        active = 0
        for link in range(max_links):
            if call(nvml.nvmlDeviceGetNvLinkState, handle_i, link) != 1:
                continue
            active += 1
            remote = call(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle_i, link)
            if remote is None:
                continue
            for j, bus_j in bus.items():
                if j != i and _bus_id(remote.busId) == bus_j:
                    links_to[j] = links_to.get(j, 0) + 1
        for j, handle_j in handles[a + 1:]:
            pair = f"gpu{i}-gpu{j}"
            if links_to.get(j):
                checks.append(Check(f"topology {pair}", PASS, f"NVLink x{links_to[j]} (NV{links_to[j]})"))
                continue
            if active and _nvlink_p2p(nvml, handle_i, handle_j):
                # HGX boards: every link ends at an NVSwitch, so no link names the
                # peer GPU's PCI id, yet the pair talks over all of them.
                checks.append(Check(f"topology {pair}", PASS,
                                    f"NVLink through NVSwitch ({active} active links on gpu{i})"))
                continue
            level = call(nvml.nvmlDeviceGetTopologyCommonAncestor, handle_i, handle_j)
            where = _TOPOLOGY.get(level, f"level {level}")
            checks.append(Check(f"topology {pair}", WARN, f"no NVLink: PCIe, {where}",
                                "gradient all-reduce runs at PCIe speed: use larger combine thresholds "
                                "(xla_flags('gpu-throughput')) and more accumulation per sync"))
    return checks


def check_gpus(jax_cuda_plugins: dict[int, str] | None = None) -> list[Check]:
    """The NVML checks; one warn line where there is no NVML.

    Args:
      jax_cuda_plugins: `{cuda_major: version}` of JAX's CUDA plugins (default: the
        installed ones), which sets the driver the installed JAX needs.
    """
    if jax_cuda_plugins is None:
        jax_cuda_plugins = _jax_cuda_plugins()
    with nvml_lib.nvml_session() as (nvml, reason):
        if nvml is None:
            return [Check("nvidia", WARN, f"no NVIDIA GPU checks: {reason}",
                          "on an NVIDIA machine: install the driver and nvidia-ml-py")]
        checks = _check_driver(nvml, jax_cuda_plugins)
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as err:  # noqa: BLE001
            return checks + [Check("nvidia", FAIL, f"NVML could not count the GPUs: {err}",
                                   _GPU_ERROR_FIX)]
        if not count:
            return checks + [Check("nvidia", WARN, "NVML runs but sees no GPU")]
        handles = []
        for index in range(count):
            # One lost or wedged GPU (NVMLError "GPU is lost") is a finding about that
            # GPU: report it and keep checking the others.
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                checks += _check_gpu(nvml, index, handle)
            except Exception as err:  # noqa: BLE001
                checks.append(Check(f"gpu{index}", FAIL, f"NVML error: {err or type(err).__name__}",
                                    _GPU_ERROR_FIX))
            else:
                handles.append((index, handle))
        try:
            checks += _check_topology(nvml, handles)
        except Exception as err:  # noqa: BLE001
            checks.append(Check("topology", WARN, f"NVML could not read the topology: {err}"))
        return checks


def run_checks() -> list[Check]:
    """All checks, in report order."""
    checks = check_packages()
    env_checks, backend_safe = check_xla_env()
    if backend_safe:
        backend_checks, _ = check_backend()
    else:
        backend_checks = [Check("backend", FAIL, "not started: the XLA settings above would abort it",
                                "fix the failing XLA settings first")]
    return checks + env_checks + backend_checks + check_gpus()


def format_report(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        lines.append(f"[{check.status.upper()}] {check.name}: {check.detail}")
        if check.fix and check.status != PASS:
            lines.append(f"       fix: {check.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
    lines.append(f"{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxopt-train doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    checks = run_checks()
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
        print(json.dumps({"ok": not failed, "counts": counts,
                          "checks": [dataclasses.asdict(c) for c in checks]}, indent=2))
    else:
        print(format_report(checks))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
