"""`jaxopt-train bench collectives`'s flags: the parser, the checks that refuse a run this
machine or these values cannot do (before anything is measured: exit 2 naming the flag),
and the defaults, normal or `--quick`, that fill the flags left unset.

The sweep itself and the command are `jaxopt_train.bench.collectives`.
"""

from __future__ import annotations

import argparse
import decimal
import fractions
import math
import os
from typing import Callable

DTYPES = {"f32": "float32", "bf16": "bfloat16"}
# The `--methods` names: the ring variants that `collectives.variants` builds besides psum.
RING_VARIANTS = ("ring", "ring_bidir", "ring_wire_bf16", "hierarchical", "peer", "peer_wire_bf16")


def parse_size(text: str) -> int:
    """'64K', '1M', '1.5G' (KiB/MiB/GiB) or plain bytes -> bytes (> 0), exactly.

    A size that is not a whole number of bytes ('0.3K' is 307.2) is refused: truncating it
    would time fewer bytes than the flag names."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    given, text = text, text.strip().upper().removesuffix("IB").removesuffix("B")
    number, scale = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        amount = decimal.Decimal(number)  # not Fraction: that would also read "1/2K"
        if not math.isfinite(float(amount) * scale):  # "infK", "nanK", "1e400K"
            raise ValueError(number)
    except (ValueError, decimal.InvalidOperation):
        raise ValueError(f"cannot read a size from {given!r}; expected bytes or a K/M/G "
                         "suffix, e.g. 4096, 64K, 1M, 1G") from None
    size = fractions.Fraction(amount) * scale  # exact: float(0.3) * 1024 is not 307.2
    if size <= 0:
        raise ValueError(f"size {given!r} must be more than 0 bytes")
    if size.denominator != 1:
        raise ValueError(f"size {given!r} comes to {float(size)} bytes; expected a whole number "
                         "of bytes, e.g. 0.5K (512) or 1.5M")
    return int(size)


def _csv(kind, example: str):
    """An argparse type: a comma list of `kind`; a bad item names itself and an example.

    An item given twice is refused: every list here names things to run, and a repeat
    would time the same thing again (or, for sizes, "1M,1024K" the same size)."""
    def parse(text):
        texts = [t for t in text.split(",") if t]
        try:
            items = [kind(t) for t in texts]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}; the flag takes a comma list like {example}") from None
        if not items:
            raise argparse.ArgumentTypeError(f"empty list; expected e.g. {example}")
        repeats = [t for i, t in enumerate(texts) if items[i] in items[:i]]
        if repeats:
            raise argparse.ArgumentTypeError(f"{text!r} repeats {repeats} (an earlier item's value); "
                                             f"give each item once, e.g. {example}")
        return items
    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not >= 1")
    return value


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxopt-train bench collectives", description=description)
    p.add_argument("--sizes", type=_csv(parse_size, "1M,16M,256M,1G"), default=None,
                   help="bytes per device, e.g. 1M,16M,256M,1G (default 1M..1G by 4x; --quick: 64K,1M)")
    p.add_argument("--dtypes", type=_csv(str, "f32,bf16"), default=["f32", "bf16"], help="f32,bf16")
    p.add_argument("--chunks", type=_csv(_positive_int, "1,4"), default=None, help="ring pipeline chunks to try (default 1,4; --quick: 1,2)")
    p.add_argument("--methods", type=_csv(str, "ring,ring_bidir"), default=None,
                   help="variants besides psum: ring,ring_bidir,ring_wire_bf16,hierarchical,peer,peer_wire_bf16 "
                        "(default all; peer ones on 2 Hopper GPUs only)")
    # None: unset, so --quick can pick smaller defaults without overriding a given value.
    p.add_argument("--warmup", type=int, default=None, help="untimed calls after the one that compiles "
                   "(default 3; --quick: 1)")
    p.add_argument("--iters", type=int, default=None, help="calls per timed burst (default 10; --quick: 3)")
    p.add_argument("--bursts", type=int, default=None, help="timed bursts (default 5; --quick: 3)")
    p.add_argument("--peak", type=float, default=None, help="link peak GB/s per direction (default: NVML/table)")
    p.add_argument("--gpt", action="store_true", help="also time a data-parallel GPT step per grad-sync method")
    p.add_argument("--gpt-config", default=None, help="GPT preset (default gpt-tiny)")
    p.add_argument("--gpt-overrides", default=None,
                   help="GPTConfig overrides FIELD=VALUE,..., values read as JSON else as strings, "
                        "e.g. n_layers=4,dtype=bfloat16,use_bias=false (--quick default: n_layers=1)")
    p.add_argument("--gpt-batch", type=int, default=None, help="sequences per device (default 4; --quick: 2)")
    p.add_argument("--gpt-iters", type=int, default=None, help="calls per timed burst of the step "
                                                                   "(default 5; --quick: 2)")
    p.add_argument("--gpt-methods", type=_csv(str, "psum,ring"), default=None,
                   help="grad-sync methods to time besides psum, the baseline (default psum,ring)")
    p.add_argument("--gpt-grad-dtype", choices=("param", "compute"), default=None,
                   help="gradients in the params' dtype (default) or the model's compute dtype")
    p.add_argument("--gpt-embedding-exchange", action="store_true",
                   help="also time each method with the embedding lookup's gradient exchanged as "
                        "gathered rows (collectives.embedding_grad_exchange) instead of a dense table")
    p.add_argument("--gpt-zero1", action="store_true",
                   help="also time the step with per-leaf ZeRO-1 (params sharded, gathered at the "
                        "step's start; gradients reduce-scattered per leaf: jaxopt_train.zero)")
    p.add_argument("--gpt-trace", default=None, metavar="DIR",
                   help="also profile each DP step into DIR/<method> and report the reduction time "
                        "concurrent with compute, exposed, and the compute slowdown (GPU traces)")
    p.add_argument("--bucket-mb", type=float, default=None, help="gradient bucket MiB of the GPT step (default 25)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few calls (CPU smoke run)")
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    return p


# Unset counts: (default, --quick default); checked against the minimum before either applies.
_COUNT_DEFAULTS = {"warmup": (3, 1), "iters": (10, 3), "bursts": (5, 3), "gpt_batch": (4, 2), "gpt_iters": (5, 2)}


# Flags that only the --gpt step reads, with their defaults (None: filled elsewhere).
_GPT_FLAGS = {"gpt_config": "gpt-tiny", "gpt_overrides": None, "gpt_batch": None, "gpt_iters": None,
              "gpt_methods": ("psum", "ring"), "gpt_grad_dtype": "param", "gpt_embedding_exchange": None,
              "gpt_zero1": None, "gpt_trace": None, "bucket_mb": 25.0}


def value_problem(args) -> str | None:
    """What is wrong with a flag's value that argparse's types let through, or None."""
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        return f"--dtypes {bad} unknown; expected some of {sorted(DTYPES)}"
    from jaxopt_train.collectives import METHODS  # noqa: PLC0415

    for flag, given, legal in (("--methods", args.methods, RING_VARIANTS),
                               ("--gpt-methods", args.gpt_methods, METHODS)):
        bad = [m for m in given or () if m not in legal]
        if bad:
            return f"{flag} {bad} unknown; expected some of {list(legal)}"
    for flag in ("peak", "bucket_mb"):  # inf would reach the JSON as Infinity
        value = getattr(args, flag)
        if value is not None and not (value > 0 and math.isfinite(value)):
            return f"--{flag.replace('_', '-')}={value} must be > 0 and finite"
    for flag in _COUNT_DEFAULTS:
        value, least = getattr(args, flag), 0 if flag == "warmup" else 1
        if value is not None and value < least:  # before the defaults: 0 is not "unset"
            return f"--{flag.replace('_', '-')}={value} must be >= {least}"
    return None


def check_gpt_flags(parser: argparse.ArgumentParser, args) -> None:
    """A GPT-step flag without --gpt would be silently ignored: refuse it."""
    given = [f"--{k.replace('_', '-')}" for k in _GPT_FLAGS if getattr(args, k) not in (None, False)]
    if given and not args.gpt:
        parser.error(f"{', '.join(given)} only apply to the GPT step; add --gpt or drop them")


# What each --methods name needs to be built by `variants` (those not listed: any run).
_METHOD_NEEDS = {"hierarchical": "an even number of devices, at least 4",
                 "peer": "2 Hopper GPUs in one process", "peer_wire_bf16": "2 Hopper GPUs in one process "
                 "and f32 in --dtypes", "ring_wire_bf16": "f32 in --dtypes (it sends f32 data as bf16)"}


def check_methods_run(parser: argparse.ArgumentParser, args, n: int, platform_name: str,
                      variants: Callable[[int, str, list[int]], dict]) -> None:
    """Refuses --methods / --gpt-methods that this run cannot time, before any timing.

    `variants(n, dtype, chunks)` is the sweep's builder (`collectives.variants`): what it
    builds here is what the run can time."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    with contextlib.redirect_stderr(io.StringIO()):  # variants' own "skipped" note
        built = {k.split("/")[0] for d in args.dtypes for k in variants(n, d, args.chunks)}
    missing = [m for m in args.methods or () if m not in built]
    if missing:
        parser.error(f"argument --methods: {missing} cannot run here ({n} {platform_name} devices, "
                     f"--dtypes {','.join(args.dtypes)}); "
                     + "; ".join(f"{m} needs {_METHOD_NEEDS.get(m, 'other devices')}" for m in missing))
    if args.gpt and "hierarchical" in args.gpt_methods and (n < 4 or n % 2):
        # One process is one group: the bench splits the axis in two, which needs >= 2 per group.
        parser.error(f"argument --gpt-methods: 'hierarchical' cannot run here ({n} {platform_name} devices): "
                     f"it needs {_METHOD_NEEDS['hierarchical']}")
    if args.gpt and "peer" in args.gpt_methods:
        from jaxopt_train.collectives.peer import check_platform  # noqa: PLC0415

        try:
            if n != 2:
                raise ValueError(f"it exchanges between exactly 2 devices; this run has {n}")
            check_platform()
        except (ValueError, NotImplementedError) as err:
            parser.error(f"argument --gpt-methods: 'peer' cannot run here: {err}")


def check_json_apart(parser: argparse.ArgumentParser, path: str | None, trace: str | None) -> None:
    """`--json` naming the `--gpt-trace` folder: the folder is made first, and every write of
    the JSON (the first after the first row) then fails. Creates nothing, so it runs first."""
    if path and trace and os.path.realpath(path) == os.path.realpath(trace):
        parser.error(f"argument --json: {path!r} is also the --gpt-trace folder; expected a file "
                     f"path apart from it, e.g. {os.path.join(trace, 'collectives.json')!r}")


def check_json(parser: argparse.ArgumentParser, path: str | None, overwrite: bool) -> None:
    """Checked (and its folder created) before the sweep, not at its first row."""
    if path:
        from jaxopt_train.bench.train_report import output_file_problem  # noqa: PLC0415

        problem = output_file_problem(path, overwrite=overwrite)
        if problem:
            parser.error(f"argument --json: expected a writable file path; {problem}")


def check_gpt_trace(parser: argparse.ArgumentParser, folder: str | None) -> None:
    """`--gpt-trace DIR` is first written after the sweep: checked (and created) before it."""
    if folder:
        from jaxopt_train.bench.train_report import output_dir_problem  # noqa: PLC0415

        problem = output_dir_problem(folder)
        if problem:
            parser.error(f"argument --gpt-trace: expected a writable folder; {problem}")


def check_sizes(parser: argparse.ArgumentParser, sizes: list[int] | None, dtypes: list[str]) -> None:
    """Each size must be whole elements of every dtype, else fewer bytes are timed than reported."""
    import jax.numpy as jnp  # noqa: PLC0415

    for dtype in dtypes:
        itemsize = jnp.dtype(DTYPES[dtype]).itemsize
        bad = [size for size in sizes or () if size % itemsize]
        if bad:
            parser.error(f"argument --sizes: {bad} bytes must each be a positive multiple of the "
                         f"{itemsize}-byte item size of --dtypes {dtype}")


def apply_defaults(args) -> None:
    """Fills flags left unset with the normal or the --quick defaults."""
    for flag, (normal, quick) in _COUNT_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, quick if args.quick else normal)
    if args.gpt_overrides is None:
        args.gpt_overrides = "n_layers=1" if args.quick else ""
    for flag, default in _GPT_FLAGS.items():
        if getattr(args, flag) is None and default is not None:
            setattr(args, flag, list(default) if isinstance(default, tuple) else default)
    if args.quick:
        args.sizes = args.sizes or [64 << 10, 1 << 20]
    args.sizes = args.sizes or [1 << s for s in range(20, 31, 2)]
    args.chunks = args.chunks or ([1, 2] if args.quick else [1, 4])

