"""XLA flag presets, the command-buffer (CUDA Graph) switch, and the flags in force.

XLA reads `XLA_FLAGS` once, when the backend starts, and aborts the process on an
unknown flag name or value. Every flag below was checked to parse in the XLA of
jaxlib 0.10 (the test suite starts a fresh interpreter per preset to keep it so).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
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


# XLA's own separators (xla/parse_flags_from_env.cc, kWS).
_XLA_WHITESPACE = " \t\r\n"
# An entry whose value XLA reads quoted: the name's characters, "=", then a quote.
_QUOTED_VALUE = re.compile(r"-[-_A-Za-z0-9]*=([\"'])")


def _split_like_xla(text: str, source: str) -> list[str]:
    """The entries of a flags string, split as XLA's ParseArgvFromString splits them.

    Entries are separated by whitespace. Quotes count only right after "=", around a
    whole value (`--name="a b"` or `--name='a b'`), and only inside double quotes does
    a backslash escape the next character; elsewhere both are literal, so
    `--re=jit_train\\.step|it's` is one entry with its backslash and apostrophe.
    """
    entries, i = [], 0
    while True:
        while i < len(text) and text[i] in _XLA_WHITESPACE:
            i += 1
        if i == len(text):
            return entries
        quoted = _QUOTED_VALUE.match(text, i) if text[i] == "-" else None
        if quoted is None:
            end = i
            while end < len(text) and text[end] not in _XLA_WHITESPACE:
                end += 1
            entries.append(text[i:end])
            i = end
            continue
        quote, value, end = quoted.group(1), [], quoted.end()
        while end < len(text) and text[end] != quote:
            if quote == '"' and text[end] == "\\" and end + 1 < len(text):
                end += 1
            value.append(text[end])
            end += 1
        if end == len(text):  # XLA would take every flag after it as part of this value
            raise ValueError(f"cannot read {source}: the {quote} opened at {text[i:quoted.end()]!r} is "
                             f"never closed: {text=}; quote a value with spaces whole, e.g. "
                             '--xla_dump_to="/tmp/my dir"')
        entries.append(text[i:quoted.end() - 1] + "".join(value))
        i = end + 1


def _read_env_flags() -> tuple[str, str, str | None]:
    """`(flags text, where it came from, flags file or None)` of the XLA_FLAGS variable.

    XLA reads a non-empty XLA_FLAGS that does not start with "-" (after whitespace)
    as the path of a file holding the flags, and aborts if it cannot open it.
    """
    value = os.environ.get("XLA_FLAGS", "")
    if not value or value.lstrip(_XLA_WHITESPACE).startswith("-"):
        return value, "the XLA_FLAGS environment variable", None
    try:
        with open(value, encoding="utf-8") as file:
            return file.read(), f"the flags file {value!r} named by XLA_FLAGS", value
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ValueError(f"XLA_FLAGS={value!r} does not start with '-', so XLA reads it as the path of "
                         f"a file of flags, and that file cannot be read ({reason}): XLA would abort at "
                         "start-up. Set XLA_FLAGS to flags such as '--xla_gpu_autotune_level=0' or to "
                         "the path of a readable flags file") from None


def parse_xla_flags(text: str | None = None) -> dict[str, str]:
    """`{name: value}` of an XLA_FLAGS string (default: the environment's), later wins.

    Read as XLA reads it (see `_split_like_xla`). Bare `--flag` (no value) is recorded
    as "true", as XLA reads it. An XLA_FLAGS variable holding a file path (XLA accepts
    that) is read from the file.

    Raises:
      TypeError: if `text` is not a string.
      ValueError: for an entry that is not `--name[=value]`, an unclosed quote, or an
        XLA_FLAGS file that cannot be read.
    """
    if text is None:
        text, source, _ = _read_env_flags()
        return _parse(text, source)
    if not isinstance(text, str):
        raise TypeError(f"XLA flags must be a string such as '--xla_foo=1 --xla_bar'; "
                        f"got {type(text).__name__}: {text!r}")
    return _parse(text, "the flags given")


def _parse(text: str, source: str) -> dict[str, str]:
    flags: dict[str, str] = {}
    for token in _split_like_xla(text, source):
        name, sep, value = token[2:].partition("=")
        if not token.startswith("--") or not name:
            ignored = "" if token.startswith("-") else " (XLA stops reading there, ignoring the rest)"
            raise ValueError(f"XLA_FLAGS entries must look like --name=value, got {token=} in "
                             f"{source}{ignored}: {text=}")
        flags[name] = value if sep else "true"
    return flags


def format_xla_flags(flags: dict[str, str]) -> str:
    """The XLA_FLAGS string for `{name: value}`, quoted where XLA needs it.

    A value with whitespace, or one starting with a quote (which XLA would take as an
    opening quote), is double-quoted with backslashes before `"` and `\\`.
    """
    def entry(name: str, value: str) -> str:
        if not value.startswith(("'", '"')) and not any(c in _XLA_WHITESPACE for c in value):
            return f"--{name}={value}"
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'--{name}="{escaped}"'

    return " ".join(entry(name, value) for name, value in flags.items())


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
    if (not isinstance(mode, (list, tuple)) or not mode
            or not all(isinstance(kind, str) and kind in COMMAND_BUFFER_TYPES for kind in mode)):
        raise ValueError(f"command_buffer must be None, 'off' or a non-empty list drawn from "
                         f"{COMMAND_BUFFER_TYPES}; got {mode=}")
    return {_COMMAND_BUFFER_FLAG: ",".join(mode)}


@dataclasses.dataclass(frozen=True)
class XlaFlagsReport:
    """What `xla_flags` changed and what XLA_FLAGS now holds."""

    preset: str
    added: dict[str, str]  # what the call asked for: preset, then command_buffer, then extra
    in_force: dict[str, str]
    backend_started: bool
    # Flags already in XLA_FLAGS that the preset would have changed: {name: (kept, preset's)}.
    kept: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # Flags in XLA_FLAGS that `extra` / `command_buffer` replaced: {name: (old, new)}.
    replaced: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # The flags file XLA_FLAGS named (XLA reads flags from it), whose flags `in_force` holds;
    # `inlined`: XLA_FLAGS was (with apply=False: would be) set to `in_force` in its place.
    flags_file: str | None = None
    inlined: bool = False

    def __str__(self) -> str:
        shown = format_xla_flags(self.in_force) or "(none)"
        note = " [backend already running: these apply to new processes only]" if self.backend_started else ""
        for name, (mine, preset) in self.kept.items():
            note += f"; kept XLA_FLAGS' --{name}={mine} over the preset's {preset}"
        for name, (old, new) in self.replaced.items():
            note += f"; --{name}={new} from the arguments replaced XLA_FLAGS' {old}"
        if self.flags_file is not None:
            note += (f"; read XLA_FLAGS' flags file {self.flags_file!r}: "
                     + ("its flags are kept, written into XLA_FLAGS with the new ones in place "
                        "of the file's path" if self.inlined else "XLA_FLAGS still names it"))
        return f"XLA flags (preset {self.preset}): {shown}{note}"


def preset_flags(preset: str) -> dict[str, str]:
    """The flags of a named preset (a copy)."""
    if not isinstance(preset, str) or preset not in PRESETS:
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
    # XLA splits entries at whitespace and reads quotes: such a name would corrupt XLA_FLAGS.
    bad = [name for name in extra if any(c in _XLA_WHITESPACE + "'\"" for c in name)]
    if bad:
        raise ValueError(f"extra flag names must not contain whitespace or quotes, e.g. "
                         f"{{'xla_gpu_enable_triton_gemm': 'false'}}; got {bad}")
    # None (or any other object) would be written as its repr, which XLA rejects at start-up.
    bad_values = {name: value for name, value in extra.items() if _flag_text(value) is None}
    if bad_values:
        raise TypeError(f"extra flag values must be str, bool, int or float; got {bad_values} "
                        "(to leave a flag at XLA's default, leave it out)")
    return {name: _flag_text(value) for name, value in extra.items()}


def _flag_text(value: object) -> str | None:
    """A flag value as XLA reads it, or None for a value of no flag type.

    numpy scalars count as the Python types they stand for: np.int64(2**28), say from a
    size computed with numpy, was refused as "not an int", and np.True_ is no bool.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or (getattr(value, "shape", None) == ()
                                   and getattr(getattr(value, "dtype", None), "kind", "") == "b"):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, float) or (isinstance(value, numbers.Real) and hasattr(value, "dtype")):
        return str(value)  # a numpy float's own shortest form: np.float32(0.1) is "0.1"
    return None


def xla_flags(preset: str = "gpu-throughput", *, extra: dict[str, str] | str | None = None,
              command_buffer: str | list[str] | None = None, apply: bool = True) -> XlaFlagsReport:
    """Adds a flag preset to XLA_FLAGS. Call before any JAX computation.

    Flags already in XLA_FLAGS keep their position and their value: a preset is a
    default, so a flag you set yourself wins over it (the report's `kept` lists them).
    An XLA_FLAGS naming a flags file (XLA reads those) is read the same way; if the
    call adds to it, XLA_FLAGS is set to the file's flags plus the new ones (the
    report's `flags_file` and `inlined` say so).
    `command_buffer` and `extra` are explicit requests, so they win over both (the
    report's `replaced` lists what they changed in XLA_FLAGS). GPU flags are harmless
    on CPU: XLA parses them and the CPU compiler ignores them.

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
      ValueError: for an unknown preset, malformed flags, or an `extra` flag that
        `command_buffer` also sets, to another value.
    """
    defaults = preset_flags(preset)
    explicit = command_buffer_flags(command_buffer)
    asked = {} if extra is None else (
        parse_xla_flags(extra) if isinstance(extra, str) else _extra_flags(extra))
    for name, value in explicit.items():  # two explicit requests: neither may silently lose
        if name in asked and asked[name] != value:
            raise ValueError(f"{command_buffer=} asks for --{name}={value} but extra for "
                             f"{asked[name]}; drop one of them")
    explicit.update(asked)
    if not isinstance(apply, bool):
        raise TypeError(f"apply must be True or False, got {apply=}")
    if apply:
        require_backend_not_started(f"xla_flags(preset={preset!r})")
    env_text, source, flags_file = _read_env_flags()
    env_flags = _parse(env_text, source)
    in_force = dict(env_flags)
    kept = {name: (in_force[name], value) for name, value in defaults.items()
            if name in in_force and in_force[name] != value and name not in explicit}
    replaced = {name: (in_force[name], value) for name, value in explicit.items()
                if name in in_force and in_force[name] != value}
    in_force.update({name: value for name, value in defaults.items() if name not in in_force})
    in_force.update(explicit)
    text = format_xla_flags(in_force)  # before touching the environment: it may raise
    # A flags file the call adds nothing to stays named as the user set it; otherwise
    # its flags go into XLA_FLAGS with the new ones (XLA_FLAGS holds a file or flags).
    inlined = flags_file is not None and in_force != env_flags
    if apply and (flags_file is None or inlined):
        os.environ["XLA_FLAGS"] = text
    return XlaFlagsReport(preset=preset, added={**defaults, **explicit}, in_force=in_force,
                          backend_started=backend_started(), kept=kept, replaced=replaced,
                          flags_file=flags_file, inlined=inlined)


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
