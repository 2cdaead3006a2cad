"""XLA flag presets, the command-buffer (CUDA Graph) switch, and the flags in force.

XLA reads `XLA_FLAGS` once, when the backend starts, and aborts the process on an
unknown flag name or value. Every flag below was checked to parse in the XLA of
jaxlib 0.10 (the test suite starts a fresh interpreter per preset to keep it so).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping

from jaxopt_train.runtime._backend import backend_started, require_backend_not_started

_MIB = 2**20

PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    # Large data-parallel / FSDP steps: overlap collectives with compute, combine small
    # gradient all-reduces into few large ones, pipeline collectives out of scanned
    # layers and double-buffer loop bodies so the next layer's collective can start.
    # The per-leaf ZeRO gathers and reduce-scatters combine up to 1 GiB / 256 MiB: on
    # 2 H200s gpt-1b's ZeRO-1 step took 91.1-91.2 ms with these against 91.7-91.8 ms at
    # 256 / 64 MiB and 93.8 ms at 32 / 16 MiB (BENCHMARKS.md, tenth session; not
    # profiled: presumably fewer NCCL launches next to the GEMMs).
    "gpu-throughput": {
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_all_reduce_combine_threshold_bytes": str(256 * _MIB),
        "xla_gpu_all_gather_combine_threshold_bytes": str(1024 * _MIB),
        "xla_gpu_reduce_scatter_combine_threshold_bytes": str(256 * _MIB),
        "xla_gpu_enable_pipelined_all_gather": "true",
        "xla_gpu_enable_pipelined_reduce_scatter": "true",
        "xla_gpu_enable_pipelined_all_reduce": "true",
        "xla_gpu_enable_while_loop_double_buffering": "true",
    },
    # Small, launch-bound steps: record as much as possible into command buffers (CUDA
    # Graphs), including loops and conditionals, so one graph launch replaces many
    # kernel launches; graphs of any size are worth it here.
    "gpu-latency": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
        "xla_gpu_graph_min_graph_size": "1",
    },
    # Bit-reproducible runs (slower): deterministic reductions and scatter.
    "gpu-deterministic": {
        "xla_gpu_deterministic_ops": "true",
    },
}

# Op kinds XLA may record into command buffers (DebugOptions.CommandBufferCmdType).
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "COLLECTIVES",
                        "CONDITIONAL", "WHILE", "DYNAMIC_SLICE_FUSION")
_COMMAND_BUFFER_FLAG = "xla_gpu_enable_command_buffer"


def parse_xla_flags(text: str | None = None) -> dict[str, str]:
    """`{name: value}` of an XLA_FLAGS string (default: the environment's), later wins.

    Bare `--flag` (no value) is recorded as "true", as XLA reads it.
    """
    text = os.environ.get("XLA_FLAGS", "") if text is None else text
    flags: dict[str, str] = {}
    for token in shlex.split(text):
        if not token.startswith("--"):
            raise ValueError(f"XLA_FLAGS entries must look like --name=value, got {token=} in {text=}")
        name, sep, value = token[2:].partition("=")
        flags[name] = value if sep else "true"
    return flags


def format_xla_flags(flags: dict[str, str]) -> str:
    """The XLA_FLAGS string for `{name: value}`."""
    return " ".join(f"--{name}={value}" for name, value in flags.items())


def command_buffer_flags(mode: str | list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """Flags for XLA's command buffers, XLA's CUDA Graph capture.

    Args:
      mode: None (leave XLA's default, which records fusions and library calls),
        "off" (launch every kernel separately: easier profiles, no graph memory), or a
        list of op kinds from `COMMAND_BUFFER_TYPES` to record.
    """
    if mode is None:
        return {}
    if mode == "off":
        return {_COMMAND_BUFFER_FLAG: ""}
    if isinstance(mode, str) or not all(kind in COMMAND_BUFFER_TYPES for kind in mode) or not mode:
        raise ValueError(f"command_buffer must be None, 'off' or a non-empty list drawn from "
                         f"{COMMAND_BUFFER_TYPES}; got {mode=}")
    return {_COMMAND_BUFFER_FLAG: ",".join(mode)}


@dataclasses.dataclass(frozen=True)
class XlaFlagsReport:
    """What `xla_flags` changed and what XLA_FLAGS now holds."""

    preset: str
    added: dict[str, str]
    in_force: dict[str, str]
    backend_started: bool

    def __str__(self) -> str:
        shown = format_xla_flags(self.in_force) or "(none)"
        note = " [backend already running: these apply to new processes only]" if self.backend_started else ""
        return f"XLA flags (preset {self.preset}): {shown}{note}"


def preset_flags(preset: str) -> dict[str, str]:
    """The flags of a named preset (a copy)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown XLA flag preset {preset=}; expected one of {sorted(PRESETS)}")
    return dict(PRESETS[preset])


def _extra_flags(extra: Mapping[str, str | bool | int | float]) -> dict[str, str]:
    """`extra` as `{name: value}` strings; bools as XLA writes them ("true"/"false")."""
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict {{name: value}} or an XLA_FLAGS string, "
                        f"got {type(extra).__name__}: {extra!r}")
    bad_names = [name for name in extra if not isinstance(name, str) or not name]
    if bad_names:
        raise TypeError(f"extra flag names must be non-empty strings such as "
                        f"'xla_gpu_enable_triton_gemm'; got {bad_names} in {extra=}")
    bad = [name for name in extra if name.startswith("-") or "=" in name]
    if bad:
        raise ValueError(f"extra flag names go without dashes or '=', e.g. "
                         f"{{'xla_gpu_enable_triton_gemm': 'false'}}; got {bad}")
    # None (or any other object) would be written as its repr, which XLA rejects at start-up.
    bad_values = {name: value for name, value in extra.items()
                  if not isinstance(value, (str, bool, int, float))}
    if bad_values:
        raise TypeError(f"extra flag values must be str, bool, int or float; got {bad_values} "
                        "(to leave a flag at XLA's default, leave it out)")
    return {name: (str(value).lower() if isinstance(value, bool) else str(value))
            for name, value in extra.items()}


def xla_flags(preset: str = "gpu-throughput", *, extra: dict[str, str] | str | None = None,
              command_buffer: str | list[str] | None = None, apply: bool = True) -> XlaFlagsReport:
    """Adds a flag preset to XLA_FLAGS. Call before any JAX computation.

    Flags already in XLA_FLAGS keep their position; a flag the preset also names takes
    the preset's value (then `command_buffer`'s, then `extra`'s). GPU flags are
    harmless on CPU: XLA parses them and the CPU compiler ignores them.

    Args:
      preset: one of `PRESETS` ("gpu-throughput", "gpu-latency", "gpu-deterministic", "none").
      extra: more flags, as `{name: value}` (no leading dashes; values str, bool, int or
        float) or an XLA_FLAGS string.
      command_buffer: see `command_buffer_flags`.
      apply: False to compute the report without touching the environment.

    Returns:
      An XlaFlagsReport with the added flags and the resulting XLA_FLAGS.

    Raises:
      RuntimeError: if `apply` and the JAX backend has already started.
      TypeError: for `extra` names or values of the wrong type, or a non-bool `apply`.
      ValueError: for an unknown preset or malformed flags.
    """
    added = preset_flags(preset)
    added.update(command_buffer_flags(command_buffer))
    if isinstance(extra, str):
        added.update(parse_xla_flags(extra))
    elif extra is not None:
        added.update(_extra_flags(extra))
    if not isinstance(apply, bool):
        raise TypeError(f"apply must be True or False, got {apply=}")
    if apply:
        require_backend_not_started(f"xla_flags(preset={preset!r})")
    in_force = parse_xla_flags()
    in_force.update(added)
    if apply:
        os.environ["XLA_FLAGS"] = format_xla_flags(in_force)
    return XlaFlagsReport(preset=preset, added=added, in_force=in_force,
                          backend_started=backend_started())


def flags_in_force() -> dict[str, str]:
    """The XLA flags and XLA client memory settings of this process's environment.

    Meant for benchmark reports. If the environment changed after the backend started,
    these are not what the running backend uses (`backend_started()` tells).
    """
    report = {f"--{name}": value for name, value in parse_xla_flags().items()}
    for var in sorted(os.environ):
        if var.startswith("XLA_PYTHON_CLIENT_") or var == "XLA_CLIENT_MEM_FRACTION":
            report[var] = os.environ[var]
    return report
