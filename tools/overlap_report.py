"""Did the gradient all-reduce overlap the backward? Read it from a profile and the HLO schedule.

    from tools.overlap_report import trace_overlap, schedule_overlap
    trace_overlap(logdir)            # from a jax.profiler trace (GPU kernels per stream)
    schedule_overlap(compiled_text)  # from `compiled.as_text()` (XLA's final schedule)

`trace_overlap`: per GPU, the time NCCL kernels ran, how much of it coincided with a
compute kernel on another stream of the same GPU, and when the collectives ran within
the traced span (so "all at the end" is visible).
`schedule_overlap`: for every async collective (`*-start` ... `*-done`) in the scheduled
HLO, how many instructions and how many GEMM/attention calls XLA placed between its
start and its done: zero means XLA gave the collective nothing to hide behind.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re


def _load_events(logdir: str):
    paths = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
    paths += glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no trace json under {logdir}")
    with gzip.open(paths[0], "rt") as f:
        data = json.load(f)
    return paths[0], data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals):
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _intersection_length(a, b) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _largest_gaps(busy, span0: float, span1: float, top: int = 6) -> list[tuple[float, float]]:
    """(position as a fraction of the span, length in ms) of the longest idle stretches."""
    gaps = [(busy[i][1], busy[i + 1][0] - busy[i][1]) for i in range(len(busy) - 1)]
    gaps.sort(key=lambda g: -g[1])
    return [(round((at - span0) / (span1 - span0), 3), round(length / 1e3, 3)) for at, length in gaps[:top]]


def trace_overlap(logdir: str, steps: int = 1) -> dict:
    """NCCL kernel time, the part of it concurrent with compute, and where it falls, per GPU."""
    path, events = _load_events(logdir)
    pnames = {e["pid"]: e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    tnames = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu_pids = {p for p, n in pnames.items() if "gpu" in n.lower() or "device" in n.lower()}
    streams = {key for key, n in tnames.items() if key[0] in gpu_pids and "stream" in n.lower()}
    per_gpu = collections.defaultdict(lambda: {"nccl": [], "compute": [], "names": collections.Counter()})
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") != "X" or key not in streams:
            continue
        start = float(e.get("ts", 0.0))
        end = start + float(e.get("dur", 0.0))
        name = e.get("name", "?")
        slot = per_gpu[pnames.get(key[0], str(key[0]))]
        if "nccl" in name.lower() or "memcpy" in name.lower() and "peer" in name.lower():
            slot["nccl"].append((start, end))
            slot["names"][name[:60]] += end - start
        elif "memset" not in name.lower():
            slot["compute"].append((start, end))
    out = {"trace": path, "steps": steps, "gpus": {}}
    for gpu, slot in sorted(per_gpu.items()):
        nccl, compute = _union(slot["nccl"]), _union(slot["compute"])
        if not compute:
            continue
        span0, span1 = compute[0][0], max(compute[-1][1], nccl[-1][1] if nccl else 0.0)
        nccl_us = sum(b - a for a, b in nccl)
        hidden_us = _intersection_length(nccl, compute)
        exposed_us = nccl_us - hidden_us
        out["gpus"][gpu] = {
            "span_ms_per_step": (span1 - span0) / 1e3 / steps,
            "compute_ms_per_step": sum(b - a for a, b in compute) / 1e3 / steps,
            "nccl_ms_per_step": nccl_us / 1e3 / steps,
            "nccl_concurrent_with_compute_ms_per_step": hidden_us / 1e3 / steps,
            "nccl_exposed_ms_per_step": exposed_us / 1e3 / steps,
            "hidden_fraction": hidden_us / nccl_us if nccl_us else None,
            # where the collectives ran: (start, end) as fractions of the traced span
            "nccl_windows": [(round((a - span0) / (span1 - span0), 3), round((b - span0) / (span1 - span0), 3))
                             for a, b in nccl[:40]],
            "nccl_kernels": slot["names"].most_common(6),
            # idle stretches of the whole GPU (no kernel on any stream): host or sync gaps
            "largest_gaps": _largest_gaps(_union(nccl + compute), span0, span1),
        }
    return out


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\b([a-z][\w\-]*)\(")
_HEAVY = ("custom-call", "fusion")


def schedule_overlap(hlo_text: str) -> dict:
    """Instructions XLA scheduled between each async collective's start and done."""
    rows, counts = [], collections.Counter()
    computation = None
    body: list[tuple[str, str, str]] = []

    def flush():
        open_at = {}
        for idx, (name, op, line) in enumerate(body):
            if op.endswith("-start") and any(c in op for c in ("all-reduce", "collective-permute",
                                                                 "all-gather", "reduce-scatter")):
                open_at[name] = (idx, op)
            elif op.endswith("-done"):
                for started, (at, start_op) in list(open_at.items()):
                    if f"%{started}" in line or f" {started})" in line or f"({started}" in line:
                        between = body[at + 1:idx]
                        gemms = sum(1 for _, o, ln in between if o == "custom-call" and (
                            "cublas" in ln or "cudnn" in ln or "gemm" in ln))
                        gemms += sum(1 for _, o, ln in between if o == "fusion" and "gemm" in ln.lower())
                        rows.append({"computation": computation, "op": start_op, "start": started,
                                     "between": len(between), "gemm_or_attention_between": gemms})
                        del open_at[started]
                        break

    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("{")[0]:
            if body:
                flush()
            computation, body = line.split("(")[0].strip().replace("ENTRY ", ""), []
            continue
        m = _INSTR.match(line)
        if m:
            body.append((m.group(2), m.group(3), line))
            counts[m.group(3)] += 1
    if body:
        flush()
    collectives = {op: n for op, n in counts.items() if any(
        c in op for c in ("all-reduce", "collective-permute", "all-gather", "reduce-scatter"))}
    return {"collective_ops": collectives, "async_pairs": rows[:60],
            "pairs_with_nothing_between": sum(1 for r in rows if r["between"] == 0),
            "pairs_with_gemm_between": sum(1 for r in rows if r["gemm_or_attention_between"] > 0)}
