"""`jaxopt-train plot RUN_DIR [RUN_DIR ...] [--out DIR]`: curves of training runs.

Reads `RUN_DIR/metrics.jsonl` (written by `JsonlSink`) and draws one PNG per panel,
every run overlaid: loss, throughput, MFU and memory. A panel shows every metric whose
name matches its pattern (e.g. `tokens_per_s` and `images_per_s` both go under
throughput); panels no run has are skipped, with a line saying so.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from jaxopt_train._replace import replace_file
from jaxopt_train.runtime.sinks import read_jsonl

_RATE = r"(_per_s(ec)?|_per_second|/s)$"  # a metric per second: the throughput panel's, never memory's
# panel -> (y-axis label, metric-name pattern, scale applied to values)
PANELS: dict[str, tuple[str, str, float]] = {
    "loss": ("loss", r"(^|/)(train_|val_|eval_)?loss$", 1.0),
    "throughput": ("per second", _RATE, 1.0),
    "mfu": ("MFU (%)", r"(^|/)mfu$", 100.0),
    # Not a rate (hbm_bytes_per_s): it was drawn here too, in "GiB", besides under throughput.
    "memory": ("GiB", rf"^(?!.*{_RATE}).*(bytes|memory|DCGM_FI_DEV_FB_USED)", 1.0),
}


def _metric_scale(panel: str, name: str) -> float:
    if panel == "memory":
        return _memory_scale_to_gib(name)
    return PANELS[panel][2]


def _memory_scale_to_gib(name: str) -> float:
    """The factor taking memory metric `name` to GiB, read from the unit its name carries.

    The loop logs `peak_memory_gib` already in GiB; dividing every memory metric
    by 2**30 drew it in billionths of a GiB. A name with no recognised unit is
    drawn as logged rather than guessed at.
    """
    lowered = name.lower()
    if lowered.startswith("dcgm_fi_dev_fb") or re.search(r"(^|[_/])mib($|[_/])", lowered):
        return 1 / 1024  # DCGM frame-buffer fields are MiB
    if re.search(r"(^|[_/])gib($|[_/])", lowered):
        return 1.0
    if "bytes" in lowered:
        return 1 / 2**30
    return 1.0


def load_run(run_dir: str) -> list[dict[str, float]]:
    """The records of `run_dir/metrics.jsonl`; ValueError if there are none to read.

    A line that is not a JSON object (the torn last line of a killed run, or that
    line with the resumed run's first record appended to it) is skipped with a
    warning on stderr (`runtime.sinks.read_jsonl` reads the file).
    """
    if not os.path.exists(run_dir):
        raise ValueError(f"run directory {run_dir!r} does not exist")
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir!r} is not a directory; expected a run directory holding metrics.jsonl")
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path) and not os.path.isfile(path):  # it said "no metrics.jsonl"
        raise ValueError(f"{path!r} is not a file (a folder?); expected the run's metrics.jsonl, "
                         "one JSON object per line")
    if not os.path.isfile(path):
        raise ValueError(f"no metrics.jsonl in run directory {run_dir!r}; expected {path} "
                         f"(written by `jaxopt-train train --run-dir`)")

    def warn(number: int, line: bytes) -> None:
        print(f"jaxopt-train plot: warning: skipped line {number} of {path}, which is not a JSON "
              f"object (a run killed while writing it?): {line[:60]!r}", file=sys.stderr)

    try:
        records = read_jsonl(path, on_skip=warn)
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    if not records:
        raise ValueError(f"{path} holds no records (expected one JSON object per line, as JsonlSink writes)")
    if not any(_is_number(record.get("step")) for record in records):
        # Every record is left out of the curves without one, and the run was then reported
        # as "its metrics hold no finite numbers", true of none of them.
        raise ValueError(f"{path}: none of its {len(records)} records has a numeric \"step\" (first "
                         f"record's keys: {', '.join(sorted(records[0]))[:200]}); expected records "
                         "like {\"step\": 10, \"loss\": 2.5}, as JsonlSink writes")
    return records


def _series(records: list[dict[str, float]], name: str) -> tuple[list[float], list[float]]:
    """`name`'s (steps, values) in step order, as the run's latest history has them."""
    points: dict[float, float] = {}  # step -> value; a later record of a step replaces it
    for record in _latest_history(records):
        value, step = _as_float(record.get(name)), _as_float(record["step"])
        if value is not None and math.isfinite(value) and math.isfinite(step):
            points[step] = value
    steps = sorted(points)
    return steps, [points[step] for step in steps]


def _latest_history(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """The records (with a numeric step) that a resumed run did not log again.

    A run resumed from a checkpoint older than its last log line logs those steps
    again, maybe differently: a record whose step is below the one before it starts
    over from that step, so the earlier records at or after it are dropped. (Dropping
    by step alone would keep the crashed run's steps the resumed one logs no more.)
    """
    kept: list[dict[str, float]] = []
    for record in records:
        step = record.get("step")
        if not _is_number(step):
            continue
        if kept and step < kept[-1]["step"]:
            kept = [earlier for earlier in kept if earlier["step"] < step]
        kept.append(record)
    return kept


def _report_non_finite(panel: str, label: str, records: list[dict[str, float]], name: str,
                       *, drawn: bool) -> None:
    """Says which records of `name` hold NaN or inf, which `_series` leaves out.

    Without it a diverged run's curve ends without a word, and a run that was NaN from
    the start reads as if it had logged no such metric at all.
    """
    history = [r for r in _latest_history(records) if name in r]
    bad = [r["step"] for r in history if _is_non_finite(r[name])]
    if not bad:
        return
    counts = f"{len(bad)} of {len(history)} records NaN or inf, from step {min(bad)}"
    if drawn:
        print(f"plot: {panel}: {label!r} has {counts}; drawn without them")
    else:
        print(f"plot: {panel}: {label!r} has no finite value ({counts}); not drawn")


def _is_non_finite(value) -> bool:
    # JsonlSink writes NaN as NaN; the training loop's JsonlWriter writes the string "nan".
    if isinstance(value, str):
        return value.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity")
    return _is_number(value) and not math.isfinite(_as_float(value))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_float(value) -> float | None:
    """A number as a float (an int past float's range, which JSON allows, as +-inf), else None.

    float(10**400) raises OverflowError: one such value in metrics.jsonl crashed the plot."""
    if not _is_number(value):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _run_names(run_dirs: list[str]) -> list[str]:
    """Legend names: each directory's base name, or the path as given where two share one."""
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    return [name if names.count(name) == 1 else os.path.normpath(d) for name, d in zip(names, run_dirs)]


def plot_runs(run_dirs: list[str], out_dir: str, *, overwrite: bool = False) -> list[str]:
    """Writes one PNG per panel with data; returns their paths.

    Raises ValueError for a run directory without records, for an `out_dir` that
    cannot be written and, unless `overwrite`, for a PNG it would write that exists
    already, before drawing anything.
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    if len(set(map(os.path.realpath, run_dirs))) != len(run_dirs):
        raise ValueError(f"a run directory is given twice: {run_dirs}")
    runs = dict(zip(_run_names(run_dirs), map(load_run, run_dirs)))
    curves = {panel: _panel_curves(runs, pattern) for panel, (_, pattern, _) in PANELS.items()}
    paths = {panel: os.path.join(out_dir, f"{panel}.png")
             for panel, found in curves.items() if any(steps for _, _, steps, _ in found)}
    if paths:  # with nothing to draw the run ends in an error, leaving no new empty folder
        _make_out_dir(out_dir)
    _refuse_overwrite(out_dir, list(paths.values()), overwrite)
    import matplotlib

    matplotlib.use("Agg")  # files only; set here so importing this module changes nothing
    import matplotlib.pyplot as plt

    for panel, (ylabel, pattern, _) in PANELS.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for run_name, name, steps, values in curves[panel]:
            label = name if len(runs) == 1 else f"{run_name}: {name}"
            _report_non_finite(panel, label, runs[run_name], name, drawn=bool(steps))
            if steps:
                scale = _metric_scale(panel, name)
                # A one-point series (one eval, one log line) is invisible as a line alone.
                ax.plot(steps, [v * scale for v in values], label=label,
                        marker="o" if len(steps) == 1 else None)
        if panel in paths:
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.set_title(panel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            # Saved beside and renamed over: a save that failed part way (a full disk) had
            # truncated the earlier plot, and a viewer refreshing a live run's could read half.
            replace_file(paths[panel], lambda staged: fig.savefig(staged, dpi=100, bbox_inches="tight"))
        elif curves[panel]:  # each metric's line above said why
            print(f"plot: no {panel} curve: its metrics hold no finite numbers; skipped")
        else:
            print(f"plot: no {panel} metrics (names matching {pattern!r}) in any run; skipped")
        plt.close(fig)
    return list(paths.values())


def _panel_curves(runs: dict[str, list[dict[str, float]]], pattern: str) -> list[tuple]:
    """(run name, metric name, steps, values) of every metric matching `pattern`; steps
    is empty where the metric holds no finite number. Read before drawing so the PNGs
    to be written are known before any is."""
    regex = re.compile(pattern)
    curves = []
    for run_name, records in runs.items():
        names = sorted({k for r in records for k in r if k not in ("step", "time") and regex.search(k)})
        curves += [(run_name, name, *_series(records, name)) for name in names]
    return curves


def _refuse_overwrite(out_dir: str, paths: list[str], overwrite: bool) -> None:
    """PNGs already in `out_dir` are kept unless asked."""
    existing = [os.path.basename(p) for p in paths if os.path.lexists(p)]
    if existing and not overwrite:
        raise ValueError(f"--out directory {out_dir!r} already holds {', '.join(existing)}; "
                         "pass --overwrite to replace them, or another --out DIR")


def _make_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir!r} is a file; expected a directory for the PNGs")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --out directory {out_dir!r}: {err.strerror or err}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out directory {out_dir!r} is not writable; pass a writable --out DIR")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxopt-train plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: the first RUN_DIR)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace PNGs already in an --out folder (default: refuse; without "
                             "--out the first run's own plots are redrawn)")
    args = parser.parse_args(argv)
    try:
        # Without --out the PNGs go into the first run's folder, where they are that run's own
        # plots: redrawing them as it trains is the point. A folder named by --out may hold
        # anything, so what is there is kept unless --overwrite says otherwise.
        written = plot_runs(args.run_dirs, args.out or args.run_dirs[0],
                            overwrite=args.overwrite or args.out is None)
    except ValueError as err:
        print(f"jaxopt-train plot: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the disk filled or permissions changed while saving
        print(f"jaxopt-train plot: error: cannot write a PNG: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    if not written:
        print(f"jaxopt-train plot: error: no run has any metric to plot (panels: {', '.join(PANELS)})",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
