"""`bench train`'s checks of its flags, run before anything is measured: a value that cannot
work (a shape below 1, a flag for another kind of model, an output path that cannot be
written, a kernel or collective this machine lacks) exits 2 naming the flag, instead of a
traceback after the first rows have run."""

from __future__ import annotations

import os


def check_shape_flags(parser, args) -> None:
    """Shape overrides must be >= 1 and apply to the model: GPT's to GPT, vision's to vision."""
    given = {name for name in ("seq_len", "layers", "image_size") if name not in args.defaulted}
    for name in sorted(given):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    gpt = args.model.startswith("gpt")
    gpt_only = sorted(given - {"image_size"}) + [
        name for name in ("attention", "remat") if getattr(args, name) != "auto"]
    if not gpt and gpt_only:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in gpt_only)
        parser.error(f"{flags} applies to GPT models, not --model {args.model} (a vision model: "
                     "its input side is --image-size)")
    if gpt and "image_size" in given:
        parser.error(f"--image-size applies to vision models, not --model {args.model} (GPT "
                     "shapes are --seq-len and --layers)")


def check_grad_sync(parser, args) -> None:
    """Under ZeRO-1 the gradients are reduce-scattered per leaf: no all-reduce method to pick."""
    if args.zero and args.grad_sync not in ("auto", "psum"):
        parser.error(f"--grad-sync {args.grad_sync} does nothing with --zero {args.zero}: its "
                     "per-leaf layout reduces the gradients with a reduce-scatter and gathers "
                     "the params with an all-gather per leaf, not with an all-reduce method "
                     "(use --zero 0 to compare all-reduce methods)")


def check_outputs(parser, args) -> None:
    """Creates the output folders and checks they take files now, not after the run."""
    from jaxopt_train.bench.train_report import REPORT_FILES, output_dir_problem, output_file_problem  # noqa: PLC0415

    # The checks that create nothing first: a run refused for an existing --out report
    # must not leave --json's new folder behind.
    if args.out:
        folders = [name for name in REPORT_FILES if os.path.isdir(os.path.join(args.out, name))]
        if folders:  # found only when the reports were written, after the whole run
            parser.error(f"--out {args.out!r} holds a folder named {folders[0]}, where the report "
                         "writes a file: move it, or choose another --out folder")
        existing = [name for name in REPORT_FILES if os.path.exists(os.path.join(args.out, name))]
        if existing and not args.overwrite:
            parser.error(f"--out {args.out!r} already holds {', '.join(existing)}: pass "
                         "--overwrite to replace them, or choose another --out folder")
    if args.json and args.out:
        _check_json_beside_out(parser, args.json, args.out)
    if args.json:
        problem = output_file_problem(args.json, overwrite=args.overwrite)
        if problem:
            parser.error(f"--json {args.json!r}: expected a writable file path; {problem}")
    if args.out:
        problem = output_dir_problem(args.out)
        if problem:
            parser.error(f"--out {args.out!r}: expected a writable folder; {problem}")


def _check_json_beside_out(parser, json_path: str, out: str) -> None:
    """--json naming the --out folder itself would be made a folder (the JSON then fails to
    write after the whole run); naming its .md or .png, the report written last would
    replace the JSON. --out's own train_bench.json holds the same text: that one is fine."""
    json_real, out_real = os.path.realpath(json_path), os.path.realpath(out)
    if json_real == out_real:
        parser.error(f"--json {json_path!r} is the --out folder; expected a file path, e.g. "
                     f"{os.path.join(out, 'raw.json')!r} (--out also writes train_bench.json)")
    clash = [name for name in ("train_bench.md", "train_bench.png")
             if json_real == os.path.realpath(os.path.join(out, name))]
    if clash:
        parser.error(f"--json {json_path!r} is --out's {clash[0]}, which the report writes: the "
                     "JSON would be lost; choose another --json path (--out also writes "
                     "train_bench.json)")


def check_backends(parser, args, devices) -> None:
    """Refuses, before the first row, a kernel or collective this machine lacks (exit 2)."""
    from jaxopt_train.train.config import matmul_dot_general  # noqa: PLC0415

    for matmul in args.matmuls:
        try:
            matmul_dot_general(matmul)
        except ValueError as err:
            parser.error(f"--compare-matmul {matmul}: {err} (or leave it out of --compare-matmul)")
    if args.grad_sync == "peer":
        from jaxopt_train.train.cli import refuse_unusable_peer_sync  # noqa: PLC0415

        refuse_unusable_peer_sync(parser, devices)
