"""GPU kernel time by name in a `jax.profiler` trace, and what changed between two traces.

    jaxopt-train kernels RUN_DIR/profile --steps 3                  # where a step's time goes
    jaxopt-train kernels EARLY/profile --against LATE/profile --steps 3   # which kernels grew

The trainer's `--profile-steps` (and `jax.profiler.trace`) writes an XSpace file
(`*.xplane.pb`); this reads it with `jax.profiler.ProfileData`, no TensorBoard or
Perfetto needed. Each GPU plane's stream lines hold one event per kernel launch
or memset/memcpy; their durations are summed by (stream, name) and divided by the
traced steps. XLA numbers its fusions per compile (`loop_add_fusion_15`), so a
trailing `_N` / `.N` is stripped: two compiles of the same program then line up.
This is how the twenty-ninth session's growing gpt-124m step was traced to one
kernel, the embedding gradient's bf16 scatter-add (BENCHMARKS.md, thirtieth session).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import numbers
import os
import re
import sys

from jaxopt_train._replace import replace_text
from jaxopt_train.runtime._trace_files import newest_file_below

_SUFFIX = re.compile(r"(?:[._]\d+)+$")


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel name's time on one stream, per traced step."""

    name: str
    stream: str
    launches_per_step: float
    ms_per_step: float


def find_xplane(trace: str | os.PathLike) -> str:
    """The trace file: ``trace`` itself, or the newest ``*.xplane.pb`` below a directory.

    Raises:
      FileNotFoundError: no such path, or a directory without a trace.
      ValueError: the trace file (the newest, in a directory) is empty.
    """
    trace = os.fspath(trace)
    if os.path.isfile(trace):
        return _non_empty(trace)
    if not os.path.isdir(trace):
        raise FileNotFoundError(f"no trace at {trace!r}: expected a jax.profiler log directory "
                                f"or an .xplane.pb file")
    return _non_empty(newest_file_below(trace, ".xplane.pb"))


def _non_empty(path: str) -> str:
    # An empty file parses as a trace with no planes: it was reported as "no GPU kernels
    # (a trace of a CPU run?)".
    if os.path.getsize(path) == 0:
        raise ValueError(f"trace {path!r} is empty (0 bytes): a profile cut off before it was "
                         "written? Trace the steps again")
    return path


def kernel_times(trace: str | os.PathLike, *, steps: int = 1,
                 device_prefix: str = "/device:GPU") -> list[KernelTime]:
    """Kernel time per step by (stream, name), longest first.

    Args:
      trace: a `jax.profiler` log directory (its newest trace) or an ``.xplane.pb`` file.
      steps: training steps inside the traced window (the sums are divided by it).
      device_prefix: planes whose name starts with it are read (all GPUs by default).

    Returns:
      One `KernelTime` per (stream, name); empty if the trace has no such plane
      (a CPU run). With more than one GPU plane the stream names carry the device
      ("GPU:1 Stream #13"): streams of two GPUs may share a number.

    Raises:
      FileNotFoundError: see `find_xplane`.
      ValueError: ``steps`` is not a positive int, or the file is not an XSpace trace.
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be a positive int (training steps in the traced window); got {steps!r}")
    from jax.profiler import ProfileData  # noqa: PLC0415

    totals: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0.0])
    path = find_xplane(trace)
    try:
        data = ProfileData.from_file(path)
    except RuntimeError as err:  # was only "Failed to parse XSpace from array", no path
        raise ValueError(f"cannot read {path!r} as a jax.profiler trace: expected an XSpace "
                         f"file (*.xplane.pb, not the *.trace.json.gz beside it); {err}") from None
    planes = [plane for plane in data.planes if plane.name.startswith(device_prefix)]
    for plane in planes:
        device = f"{plane.name.removeprefix('/device:')} " if len(planes) > 1 else ""
        lines = list(plane.lines)
        # The stream lines hold the launches; other lines ("XLA Ops", "XLA Modules" in
        # some versions) span the same time again and would count it twice.
        streams = [line for line in lines if line.name.startswith("Stream")] or lines
        for line in streams:
            for event in line.events:
                total = totals[(device + line.name, _SUFFIX.sub("", event.name))]
                total[0] += 1
                total[1] += event.duration_ns
    rows = [KernelTime(name, stream, count / steps, ns / 1e6 / steps)
            for (stream, name), (count, ns) in totals.items()]
    return sorted(rows, key=lambda r: (-r.ms_per_step, r.stream, r.name))


def compare(before: list[KernelTime], after: list[KernelTime]) -> list[tuple[KernelTime | None, KernelTime | None]]:
    """Pairs of the same (stream, name) in two results, the largest change in time first;
    a kernel found in only one of them is paired with None."""
    a = {(r.stream, r.name): r for r in before}
    b = {(r.stream, r.name): r for r in after}

    def change(key):
        return abs((b[key].ms_per_step if key in b else 0.0) - (a[key].ms_per_step if key in a else 0.0))

    return [(a.get(key), b.get(key)) for key in sorted(set(a) | set(b), key=lambda k: (-change(k), k))]


def _stream_totals(rows: list[KernelTime]) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        totals[r.stream] += r.ms_per_step
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxopt-train kernels",
                                description="GPU kernel time per step by name in a jax.profiler trace "
                                            "(e.g. a run's --profile-steps RUN_DIR/profile)")
    p.add_argument("trace", help="jax.profiler log directory (its newest trace) or an .xplane.pb file")
    p.add_argument("--steps", type=int, default=1, help="training steps in the traced window (default 1)")
    p.add_argument("--against", metavar="TRACE",
                   help="a second, later trace (same --steps): print what changed from this one "
                        "(the before column) to TRACE (after)")
    p.add_argument("--top", type=int, default=20, help="rows to print (default 20)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top must be at least 1, got {args.top}")
    if args.json:  # before the traces are read: a bad path fails in a moment, nothing replaced
        from jaxopt_train.bench.train_report import output_file_problem  # noqa: PLC0415

        problem = output_file_problem(args.json, overwrite=args.overwrite)
        if problem:
            p.error(f"--json {args.json}: {problem}")
    try:
        trace = find_xplane(args.trace)  # once: the header names the file read
        against = None if args.against is None else find_xplane(args.against)
        # With --overwrite, --json naming a trace replaced the trace read with its table.
        read = [t for t in (trace, against) if t is not None and args.json
                and os.path.exists(args.json) and os.path.samefile(t, args.json)]
        if read:
            p.error(f"--json {args.json}: is the trace {read[0]!r} being read; write the table elsewhere")
        first = kernel_times(trace, steps=args.steps)
        second = None if against is None else kernel_times(against, steps=args.steps)
    except (FileNotFoundError, ValueError) as err:
        p.error(str(err))
    empty = [t for t, rows in ((args.trace, first), (args.against, second)) if rows == []]
    if empty:
        print(f"jaxopt-train kernels: no GPU kernels in {', '.join(empty)} (a trace of a CPU run?)",
              file=sys.stderr)
        return 1
    if second is None:
        out = [dataclasses.asdict(r) for r in first]
        total = sum(r.ms_per_step for r in first)
        print(f"{trace}: {total:.3f} ms of GPU time per step over "
              f"{len(_stream_totals(first))} stream(s) (summed over the GPUs traced)")
        print(f"{'ms/step':>9} {'share':>6} {'launches':>8}  stream | kernel")
        for r in first[:args.top]:
            share = r.ms_per_step / total if total > 0 else 0.0  # all-zero durations: no division
            print(f"{r.ms_per_step:9.3f} {share:6.1%} {r.launches_per_step:8.1f}  "
                  f"{r.stream} | {r.name}")
    else:
        pairs = compare(first, second)
        out = [{"stream": (a or b).stream, "name": (a or b).name,
                "before_ms_per_step": a.ms_per_step if a else 0.0,
                "after_ms_per_step": b.ms_per_step if b else 0.0} for a, b in pairs]
        ta, tb = _stream_totals(first), _stream_totals(second)
        for stream in sorted(set(ta) | set(tb)):
            print(f"{stream}: {ta.get(stream, 0.0):.3f} -> {tb.get(stream, 0.0):.3f} ms/step")
        print(f"{'change':>9} {'before':>9} {'after':>9}  stream | kernel")
        for row in out[:args.top]:
            before, after = row["before_ms_per_step"], row["after_ms_per_step"]
            print(f"{after - before:+9.3f} {before:9.3f} {after:9.3f}  {row['stream']} | {row['name']}")
    if args.json:
        # Staged and renamed over: a failed write left a truncated file where the
        # --overwrite'n table had been.
        replace_text(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
