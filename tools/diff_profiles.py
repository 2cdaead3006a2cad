"""Kernel-by-kernel difference of two `probe_gpt1b.py --profile` (or `probe_layer.py`) results.

    python tools/diff_profiles.py A.json B.json [--top 30] [--by-launch]

Each file holds rows with a "profile" ("all_kernels": name, ms per step, launches per step), as
probe_gpt1b writes, or rows with "kernels", as probe_layer writes; the first row is used unless
--variant picks one. XLA numbers its fusions per compile (`loop_add_fusion_15`), so the same
fusion has other names in two compiles: kernels are grouped by name without that suffix and by
launches per step, and the groups are compared. Prints the busy time of each side and the
groups whose time differs most.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

_SUFFIX = re.compile(r"(_\d+)+$")


def load(path: str, variant: str | None, by_launch: bool = False) -> list:
    with open(path) as f:
        rows = json.load(f)
    rows = rows if isinstance(rows, list) else [rows]
    row = next((r for r in rows if variant is None or r.get("variant") == variant), None)
    if row is None:
        raise SystemExit(f"{path}: no row with variant {variant!r}; "
                         f"have {[r.get('variant') for r in rows]}")
    if by_launch:
        launches = (row.get("profile") or {}).get("by_launch")
        if not launches:
            raise SystemExit(f"{path}: row {row.get('variant')!r} has no profile.by_launch "
                             "(probe_gpt1b.py records it since the fifteenth session)")
        # One entry per launch shape: the details join the name, so two GEMMs that share
        # bound_mosaic_gpu_kernel are told apart.
        return [(f"{_SUFFIX.sub('', name)} [{details}]", ms, calls)
                for name, details, ms, calls, _ in launches]
    kernels = row.get("kernels") or (row.get("profile") or {}).get("all_kernels")
    if not kernels:
        raise SystemExit(f"{path}: row {row.get('variant')!r} has no kernel list "
                         "(expected profile.all_kernels or kernels)")
    return kernels


def grouped(kernels: list) -> dict:
    groups = collections.defaultdict(lambda: [0.0, 0.0, set()])
    for name, ms, calls in kernels:
        key = (_SUFFIX.sub("", name), round(calls, 1))
        groups[key][0] += ms
        groups[key][1] += calls
        groups[key][2].add(name)
    return groups


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--variant", help="the row to use in both files (default: the first)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--by-launch", action="store_true",
                   help="group by kernel name and launch shape (grid, block, shared memory): "
                        "tells apart Mosaic GPU products, which share one name; top 60 per side")
    args = p.parse_args(argv)
    ga = grouped(load(args.a, args.variant, args.by_launch))
    gb = grouped(load(args.b, args.variant, args.by_launch))
    total_a = sum(v[0] for v in ga.values())
    total_b = sum(v[0] for v in gb.values())
    print(f"busy ms per step: A {total_a:.3f}  B {total_b:.3f}  A - B {total_a - total_b:+.3f}")
    rows = []
    for key in set(ga) | set(gb):
        a, b = ga.get(key, [0.0, 0.0, set()]), gb.get(key, [0.0, 0.0, set()])
        rows.append((a[0] - b[0], key, a[0], b[0]))
    rows.sort(key=lambda r: -abs(r[0]))
    print(f"{'A - B':>8} {'A ms':>8} {'B ms':>8} {'calls':>6}  kernel (suffix dropped)")
    width = 200 if args.by_launch else 90
    for delta, (name, calls), a, b in rows[:args.top]:
        print(f"{delta:+8.3f} {a:8.3f} {b:8.3f} {calls:6.1f}  {name[:width]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
