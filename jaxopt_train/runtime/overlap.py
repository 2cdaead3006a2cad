"""How much of the communication did the compute hide? Read from a profile and from the schedule.

The usual estimate, ``1 - (step - compute_only) / comm_only``, mixes two effects: a
collective that runs *concurrently* with the backward, and the backward running
*slower* because the collective kernels take SMs and memory bandwidth from it. A
profile separates them:

* `collective_overlap(logdir)` reads a `jax.profiler` trace and reports, per GPU, the
  time collective kernels ran (NCCL kernels and peer-to-peer copies), how much of it
  coincided with compute kernels on another stream, how much was exposed (nothing else
  running), the compute time itself (compare it with a one-device trace to see the
  slowdown), and the longest idle stretches of the GPU.
* `async_collective_schedule(hlo_text)` reads the scheduled HLO of a compiled step
  (`compiled.as_text()`) and reports, for every asynchronous collective, how many
  instructions XLA placed between its ``*-start`` and ``*-done``: a collective with
  nothing scheduled in between cannot be hidden whatever the hardware does.

Both work on CPU on saved files (a CPU-only trace has no GPU streams: `collective_overlap`
returns an empty list).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import numbers
import os
import re

from jaxopt_train.runtime._trace_files import newest_file_below

_COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_PEER_COPY = re.compile(r"memcpy.*(p2p|ptop|peer)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class DeviceOverlap:
    """One GPU's collective/compute overlap over the traced window, per step."""

    device: str
    span_ms: float  # first to last kernel
    compute_ms: float  # union of non-collective kernels
    collective_ms: float  # union of collective kernels
    concurrent_ms: float  # collective time with a compute kernel running alongside
    exposed_ms: float  # collective time with nothing else running
    idle_ms: float  # span with no kernel at all
    largest_gaps: tuple[tuple[float, float], ...]  # (position in span 0..1, ms)
    collective_kernels: tuple[tuple[str, float], ...]  # (name, ms per step), longest first

    @property
    def hidden_fraction(self) -> float | None:
        return self.concurrent_ms / self.collective_ms if self.collective_ms else None


def _union(intervals):
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _total(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    """Length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def find_trace_file(logdir: str) -> str:
    """The newest `*.trace.json.gz` under `logdir` (what `jax.profiler.trace` writes)."""
    return newest_file_below(logdir, ".trace.json.gz")


@dataclasses.dataclass(frozen=True)
class Trace:
    """A `jax.profiler` trace: its events and the names of its processes and threads."""

    path: str
    events: list
    processes: dict  # pid -> name ("/device:GPU:0", "/host:CPU")
    threads: dict  # (pid, tid) -> name ("Stream #24(Compute)", "XLA Ops", ...)

    @property
    def gpu_streams(self) -> set:
        """(pid, tid) of the GPU stream rows. A GPU process also has "XLA Ops"/"XLA Modules"
        rows that repeat the same time: only the streams count kernel time once."""
        gpus = {pid for pid, name in self.processes.items() if "gpu" in name.lower()}
        return {key for key, name in self.threads.items() if key[0] in gpus and "stream" in name.lower()}


def read_trace(logdir_or_file: str) -> Trace:
    """Loads the newest trace under a `jax.profiler.trace` directory, or one trace file."""
    path = logdir_or_file if os.path.isfile(logdir_or_file) else find_trace_file(logdir_or_file)
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return Trace(path, events, processes, threads)


def is_collective_kernel(name: str) -> bool:
    """NCCL kernels and peer-to-peer copies (XLA's copy-engine collective-permute)."""
    return "nccl" in name.lower() or _PEER_COPY.search(name) is not None


def collective_overlap(logdir_or_file: str, *, steps: int = 1) -> list[DeviceOverlap]:
    """Per-GPU collective/compute overlap of a trace, in ms per step.

    Args:
      logdir_or_file: a `jax.profiler.trace` directory or one `*.trace.json.gz` file.
      steps: training steps inside the traced window (figures are divided by it).

    Returns:
      One `DeviceOverlap` per GPU found in the trace (empty for a CPU-only trace).
    """
    # numbers.Integral takes numpy ints (np.int64(2)); True is an Integral too, not a count.
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be a positive int (training steps in the traced window); got {steps=}")
    steps = int(steps)
    trace = read_trace(logdir_or_file)
    processes, streams = trace.processes, trace.gpu_streams
    kernels = collections.defaultdict(lambda: ([], [], collections.Counter()))
    for e in trace.events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") != "X" or key not in streams:
            continue
        start = float(e.get("ts", 0.0))
        end = start + float(e.get("dur", 0.0))
        name = e.get("name", "?")
        collective, compute, names = kernels[key[0]]
        if is_collective_kernel(name):
            collective.append((start, end))
            names[name[:80]] += end - start
        elif "memset" not in name.lower():
            compute.append((start, end))
    out = []
    for pid in sorted(kernels):
        raw_collective, raw_compute, names = kernels[pid]
        collective, compute = _union(raw_collective), _union(raw_compute)
        busy = _union(raw_collective + raw_compute)
        if not busy:
            continue
        span = busy[-1][1] - busy[0][0]
        concurrent = _intersection(collective, compute)
        gaps = sorted(((busy[i][1], busy[i + 1][0] - busy[i][1]) for i in range(len(busy) - 1)),
                      key=lambda g: -g[1])[:6]
        per_step = 1e3 * steps  # trace times are microseconds
        out.append(DeviceOverlap(
            device=processes[pid],
            span_ms=span / per_step,
            compute_ms=_total(compute) / per_step,
            collective_ms=_total(collective) / per_step,
            concurrent_ms=concurrent / per_step,
            exposed_ms=(_total(collective) - concurrent) / per_step,
            idle_ms=(span - _total(busy)) / per_step,
            largest_gaps=tuple((round((at - busy[0][0]) / span, 3) if span else 0.0, length / 1e3)
                               for at, length in gaps),
            collective_kernels=tuple((n, t / per_step) for n, t in names.most_common(6)),
        ))
    return out


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """One `*-start` ... `*-done` pair of a scheduled computation."""

    computation: str
    op: str  # e.g. "all-reduce-start"
    name: str
    between: int  # instructions scheduled between start and done
    gemms_between: int  # of which GEMM / attention library calls or GEMM fusions


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _is_gemm(op: str, line: str) -> bool:
    lowered = line.lower()
    return (op == "custom-call" and any(s in lowered for s in ("cublas", "cudnn", "gemm"))) or (
        op == "fusion" and "gemm" in lowered)


def async_collective_schedule(hlo_text: str) -> list[AsyncCollective]:
    """Every asynchronous collective of a scheduled HLO module and what runs under it.

    Args:
      hlo_text: `compiled.as_text()` of a jitted step (the post-optimisation,
        scheduled module; instruction order in each computation is the schedule).
    """
    if not isinstance(hlo_text, str) or "HloModule" not in hlo_text:
        raise ValueError("hlo_text must be the text of a compiled HLO module (jax `compiled.as_text()`, "
                         f"starting with 'HloModule'); got {type(hlo_text).__name__} "
                         f"{str(hlo_text)[:60]!r}")
    pairs: list[AsyncCollective] = []
    computation, body = "", []

    def close(name, lines):
        open_starts: dict[str, tuple[int, str]] = {}
        for index, (instr, op, line) in enumerate(lines):
            if op.endswith("-start") and op[:-6] in _COLLECTIVE_KINDS:
                open_starts[instr] = (index, op)
            elif op.endswith("-done") and op[:-5] in _COLLECTIVE_KINDS:
                operands = line.split(op + "(", 1)[1]
                for started, (at, start_op) in list(open_starts.items()):
                    if re.search(rf"%?{re.escape(started)}\b(?![.\-\w])", operands):
                        between = lines[at + 1:index]
                        pairs.append(AsyncCollective(
                            computation=name, op=start_op, name=started, between=len(between),
                            gemms_between=sum(_is_gemm(o, ln) for _, o, ln in between)))
                        del open_starts[started]
                        break

    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(", 1)[0]:
            close(computation, body)
            computation, body = header.group(1), []
            continue
        match = _INSTRUCTION.match(line)
        if match:
            body.append((match.group(1), match.group(2), line))
    close(computation, body)
    return pairs
