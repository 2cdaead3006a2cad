"""Print the HLO of a profiled step's costliest non-matmul kernels (a one-GPU diagnostic).

    python tools/extract_fusions.py PROBE_JSON DUMP_DIR [--top 14] > fusions.txt

PROBE_JSON is `tools/probe_gpt1b.py --profile`'s output (its first row's profile names the
kernels and their ms per step); DUMP_DIR is the `--xla_dump_to` folder of the same run. For
each of the `--top` costliest kernels that are XLA fusions (not Mosaic GPU, cuDNN or cuBLAS
kernels) it prints the fusion's instruction in the optimised step module (output shape and
operands) and the first lines of its fused computation: what each costly pass reads, writes
and computes. The dump itself is too large to bring back from the device machine
(fifteenth session), this extract is small.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re


def _step_module(dump_dir: str, names: list[str]) -> str:
    """The optimised module in the dump that defines the most of the profiled kernels."""
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not files:
        raise SystemExit(f"no *after_optimizations.txt in {dump_dir!r}: was XLA_FLAGS "
                         "--xla_dump_to=... --xla_dump_hlo_as_text set for the run?")

    def defined(path):
        with open(path) as f:
            text = f.read()
        return (sum(any(f"%{n} = " in text for n in _hlo_names(name)) for name in names),
                os.path.getsize(path))

    return max(files, key=defined)


def _hlo_names(name: str) -> list[str]:
    """A profiled kernel's possible HLO names: the profiler writes HLO's `fusion.16` as
    `fusion_16` (sixteenth session's extract found only the fusions without a number)."""
    dotted = re.sub(r"_(\d+)$", r".\1", name)
    return [name] if dotted == name else [name, dotted]


def _short(line: str) -> str:
    """An HLO line without its backend config and with only the op_name of its metadata."""
    line = re.sub(r", backend_config=.*$", "", line.strip())
    op = re.search(r'op_name="([^"]*)"', line)
    line = re.sub(r", metadata=\{.*?\}", "", line)
    return line + (f"  # {op.group(1)}" if op else "")


def _computations(text: str) -> dict[str, list[str]]:
    """HLO computation name -> its lines."""
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe_json")
    p.add_argument("dump_dir")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--lines", type=int, default=30, help="fused-computation lines per kernel")
    args = p.parse_args()
    with open(args.probe_json) as f:
        rows = json.load(f)
    if not rows or "profile" not in rows[0]:
        raise SystemExit(f"{args.probe_json!r} has no profile: run probe_gpt1b.py with --profile")
    kernels = rows[0]["profile"]["top_kernels_ms_per_step"]
    path = _step_module(args.dump_dir, [name for name, _ in kernels])
    with open(path) as f:
        text = f.read()
    comps = _computations(text)
    lines = text.splitlines()
    print(f"# module {os.path.basename(path)} ({len(text) / 1e6:.1f} MB)")
    shown = 0
    for name, ms in kernels:
        if shown >= args.top:
            break
        if not re.fullmatch(r"[\w.\-]+", name) or name.startswith(("bound_mosaic", "cudnn", "Memset")):
            continue
        pattern = "|".join(re.escape(n) for n in _hlo_names(name))
        uses = [line.strip() for line in lines if re.search(rf"%(?:{pattern}) = ", line)]
        print(f"\n## {name}: {ms:.3f} ms per step")
        for use in uses[:2]:
            print(_short(use)[:700])
        called = re.search(r"calls=%?([\w.\-]+)", uses[0]) if uses else None
        if called and called.group(1) in comps:
            body = comps[called.group(1)]
            for line in body[:args.lines]:
                print("   ", _short(line)[:300])
            if len(body) > args.lines:
                print(f"    ... {len(body) - args.lines} more lines")
        shown += 1


if __name__ == "__main__":
    main()
