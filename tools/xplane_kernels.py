"""GPU kernel time by name in a `jax.profiler` trace (the `.xplane.pb`, no Perfetto file needed).

    python tools/xplane_kernels.py LOGDIR --steps 3 [--json OUT.json]
    python tools/xplane_kernels.py --diff EARLY.json LATE.json [--top 25]

The trainer's `--profile-steps` writes only the xplane. This reads it with
`jax.profiler.ProfileData`, sums each event's duration on the GPU planes by (line, name),
with XLA's per-compile numeric suffixes stripped (`loop_add_fusion_15` -> `loop_add_fusion`),
and prints ms per step. `--diff` compares two such JSON files: which kernels grew.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

_SUFFIX = re.compile(r"(\.\d+|_\d+)+$")


def summarize(logdir: str, steps: int) -> dict:
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise SystemExit(f"no *.xplane.pb under {logdir}")
    totals = collections.defaultdict(lambda: [0, 0.0])  # (line, name) -> [count, ns]
    for plane in ProfileData.from_file(files[-1]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                key = (line.name, _SUFFIX.sub("", event.name))
                totals[key][0] += 1
                totals[key][1] += event.duration_ns
    return {"file": files[-1], "steps": steps,
            "kernels": [{"line": line, "name": name, "per_step": count / steps,
                         "ms_per_step": ns / 1e6 / steps}
                        for (line, name), (count, ns) in sorted(totals.items(), key=lambda kv: -kv[1][1])]}


def _by_key(summary: dict) -> dict:
    return {(k["line"], k["name"]): k for k in summary["kernels"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logdir", nargs="?")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"))
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    if args.diff:
        with open(args.diff[0]) as f:
            a = _by_key(json.load(f))
        with open(args.diff[1]) as f:
            b = _by_key(json.load(f))
        rows = []
        for key in set(a) | set(b):
            ta = a.get(key, {}).get("ms_per_step", 0.0)
            tb = b.get(key, {}).get("ms_per_step", 0.0)
            rows.append((tb - ta, ta, tb, key))
        rows.sort(key=lambda r: -abs(r[0]))
        for line in sorted({k[0] for k in set(a) | set(b)}):
            sa = sum(v["ms_per_step"] for k, v in a.items() if k[0] == line)
            sb = sum(v["ms_per_step"] for k, v in b.items() if k[0] == line)
            print(f"line {line!r}: {sa:.3f} -> {sb:.3f} ms/step")
        print(f"{'delta ms':>9} {'A ms':>8} {'B ms':>8}  line | name")
        for d, ta, tb, (line, name) in rows[:args.top]:
            print(f"{d:9.3f} {ta:8.3f} {tb:8.3f}  {line} | {name}")
        return 0
    if not args.logdir:
        p.error("give LOGDIR or --diff A B")
    s = summarize(args.logdir, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    print(s["file"])
    for k in s["kernels"][:args.top]:
        print(f"{k['ms_per_step']:9.3f} ms {k['per_step']:7.1f}x  {k['line']} | {k['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
