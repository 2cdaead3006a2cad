"""Figures, Markdown table and PNG of the training benchmark.

MFU uses one denominator for every row: the dense peak of the *optimised*
config's matmul dtype (bf16 on an H200: 989 TFLOP/s per device, from
`jaxopt_train.train.mfu.PEAK_TFLOPS`), so a baseline running f32/TF32
matmuls is measured against the same hardware ceiling as the optimised one.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from typing import Any

from jaxopt_train._replace import replace_all_or_none
from jaxopt_train.bench._timing import BurstTiming, Trace
from jaxopt_train.bench.train_remat import remat_label
from jaxopt_train.train.mfu import mfu

GIB = 2**30
REPORT_FILES = ("train_bench.md", "train_bench.json", "train_bench.png")  # what --out holds
# A T4 is a known device without a bf16 peak (no bf16 tensor cores): not an "unknown device".
_NO_PEAK = "n/a (no dense {} peak known for this device; pass --peak-tflops)"


def output_dir_problem(folder: str) -> str | None:
    """Why files cannot be written in `folder`, or None; creates it (and its parents) if missing.

    Checked when the flags are read, so a bad path costs nothing rather than the whole run."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder!r} exists and is not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"cannot write in {folder!r}: {err.strerror or err}"
    return None


def output_file_problem(path: str, *, overwrite: bool = True) -> str | None:
    """Why a report cannot be written to `path`, or None; creates its missing folders."""
    if os.path.isdir(path):
        return f"{path!r} is a folder"
    if os.path.exists(path) and not overwrite:
        return f"{path!r} already exists (pass --overwrite to replace it)"
    problem = output_dir_problem(os.path.dirname(os.path.abspath(path)))
    if problem is None and os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path!r} is not writable"
    return problem


def row_figures(*, name: str, timing: BurstTiming, trace: Trace, compile_s: float,
                items_per_step: int, flops_per_step: float, unit: str, num_devices: int,
                peak_tflops: float | None, peak_memory: tuple[int | None, str],
                dataset_items: float, gpu_hour_usd: float, steps_per_call: int) -> dict[str, Any]:
    """The table row (a flat dict of floats/strings) for one measured config."""
    step_s = timing.step_s
    tflops = flops_per_step / step_s / 1e12
    epoch_s = dataset_items / (items_per_step / step_s)
    peak_bytes, peak_source = peak_memory
    return {
        "name": name,
        "step_ms": step_s * 1e3,
        "step_ms_bursts": [s * 1e3 for s in timing.wall_s],
        "steps_per_s": 1.0 / step_s,
        f"{unit}_per_s": items_per_step / step_s,
        "throughput": items_per_step / step_s,
        "tflops": tflops,
        "mfu": mfu(flops_per_step, step_s, peak_tflops, num_devices),
        "peak_memory_bytes": peak_bytes,
        "peak_memory_source": peak_source,
        "memory_swing_bytes": trace.swing_bytes,
        "memory_source": trace.source,
        "compile_s": compile_s,
        "host_dispatch_ms_per_step": timing.dispatch_step_s * 1e3,
        "host_in_calls_ms_per_step": (statistics.median(timing.in_calls_s) * 1e3
                                      if timing.in_calls_s else None),
        "wall_ms_per_step": step_s * 1e3,
        "steps_per_dispatch": steps_per_call,
        "epoch_hours": epoch_s / 3600,
        "epoch_cost_usd": epoch_s / 3600 * num_devices * gpu_hour_usd,
        "trace_step_ms": [s * 1e3 for s in trace.step_s],
        "trace_bytes_in_flight": trace.bytes_in_flight,
        "trace_bytes_at_rest": trace.bytes_at_rest,
        "num_devices": num_devices,
    }


def add_ratios(rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> None:
    """Adds speed-up (baseline step time / row's) and memory ratio (row's / baseline peak);
    both None where the baseline has no row (it failed, e.g. out of memory)."""
    for row in rows:
        if baseline is None:
            row["speedup_vs_baseline"] = row["memory_ratio_vs_baseline"] = None
            continue
        row["speedup_vs_baseline"] = baseline["step_ms"] / row["step_ms"]
        a, b = row["peak_memory_bytes"], baseline["peak_memory_bytes"]
        row["memory_ratio_vs_baseline"] = a / b if a and b else None


def _fmt(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value * scale:{spec}}{suffix}"


def _hours(h: float) -> str:
    return f"{h * 60:.1f} min" if h < 1 else f"{h:.2f} h"


def _tflops(value: float) -> str:
    """Three figures without an exponent: two H200s' ~1,059 TFLOP/s printed as 1.06e+03."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown_table(rows: list[dict[str, Any]], unit: str) -> str:
    header = (f"| config | step ms | {unit}/s | TFLOP/s | MFU | peak mem GiB | swing GiB | "
              "compile s | dispatch ms/step | epoch | cost USD | speed-up | mem ratio |")
    lines = [header, "|" + "|".join(["---"] * 13) + "|"]
    for r in rows:
        src = {"allocator": "", "xla-estimate": "*", "live-arrays": "+"}.get(r["peak_memory_source"], "?")
        lines.append(
            f"| {r['name']} | {r['step_ms']:.2f} | {r['throughput']:,.0f} | {_tflops(r['tflops'])} | "
            f"{_fmt(r['mfu'], '.1f', 100, '%')} | {_fmt(r['peak_memory_bytes'], '.3f', 1 / GIB)}{src} | "
            f"{_fmt(r['memory_swing_bytes'], '.3f', 1 / GIB)} | {r['compile_s']:.1f} | "
            f"{r['host_dispatch_ms_per_step']:.2f} | {_hours(r['epoch_hours'])} | "
            f"{r['epoch_cost_usd']:,.2f} | {_fmt(r.get('speedup_vs_baseline'), '.2f', 1, 'x')} | "
            f"{_fmt(r.get('memory_ratio_vs_baseline'), '.2f', 1, 'x')} |")
    return "\n".join(lines)


def scaling_table(scaling: dict[str, Any], unit: str) -> str:
    return "\n".join([
        f"| devices | global batch | {unit}/s | per device | scaling efficiency |",
        "|---|---|---|---|---|",
        f"| 1 | {scaling['one_device_global_batch']} | {scaling['one_device_throughput']:,.0f} | "
        f"{scaling['one_device_throughput']:,.0f} | 100% |",
        f"| {scaling['num_devices']} | {scaling['global_batch']} | {scaling['throughput']:,.0f} | "
        f"{scaling['throughput'] / scaling['num_devices']:,.0f} | {100 * scaling['efficiency']:.1f}% |",
    ])


def dispatch_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| steps_per_dispatch | steps/s | wall ms/step | host dispatch ms/step | vs k=first |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['steps_per_dispatch']} | {r['steps_per_s']:.1f} | {r['wall_ms_per_step']:.3f} | "
                     f"{r['host_dispatch_ms_per_step']:.3f} | {r['steps_per_s_vs_first_k']:.2f}x |")
    return "\n".join(lines)


def matmul_table(rows: list[dict[str, Any]], unit: str) -> str:
    """The optimised config with each dense-layer kernel; the first row is XLA's dot."""
    lines = [f"| matmul | step ms | {unit}/s | MFU | compile s | step vs xla |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']['matmul']} | {r['step_ms']:.2f} | {r['throughput']:,.0f} | "
                     f"{_fmt(r['mfu'], '.1f', 100, '%')} | {r['compile_s']:.1f} | "
                     f"{r['step_ms_vs_xla']:.3f}x |")
    return "\n".join(lines)


def save_plot(rows: list[dict[str, Any]], path: str, unit: str) -> None:
    """PNG: memory in use and throughput per traced step, one line per config."""
    import matplotlib  # noqa: PLC0415 - optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_mem, ax_tput) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for row in rows:
        samples = [b for pair in zip(row["trace_bytes_at_rest"], row["trace_bytes_in_flight"])
                   for b in pair] + row["trace_bytes_at_rest"][-1:]
        ax_mem.plot([i / 2 for i in range(len(samples))], [b / GIB for b in samples],
                    marker=".", label=row["name"])
        items = row["throughput"] * row["step_ms"] / 1e3
        ax_tput.plot(range(1, len(row["trace_step_ms"]) + 1),
                     [items / (ms / 1e3) for ms in row["trace_step_ms"]], marker=".",
                     label=row["name"])
    ax_mem.set_ylabel(f"memory in use, GiB ({rows[0]['memory_source']})")
    ax_mem.legend()
    ax_tput.set_ylabel(f"{unit}/s (synced per dispatch)")
    ax_tput.set_xlabel("traced dispatch")
    fig.suptitle("memory in use and throughput per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fuse_note(fuse: bool | None) -> str:
    """What the kernel-matmul rows did with the MLP's GELU (GPTConfig.fuse_mlp_activation)."""
    if fuse is None:
        return ", the MLP's GELU in the kernel's epilogue in the Mosaic GPU kernel-matmul rows"
    if fuse:
        return ", the MLP's fc + bias + GELU in one launch in the kernel-matmul rows"
    return ", the MLP's GELU by XLA in the kernel-matmul rows"


def render(result) -> str:
    """The printed report: header, table, notes and the optional scaling/matmul/dispatch tables."""
    unit = result["unit"]
    flags = result["xla_flags"]
    lines = [f"device: {result['device_kind']} x {result['num_devices']} ({result['platform']}), "
             f"jax {result['jax']}; model {model_label(result)}, global batch {result['global_batch']}, "
             f"{result['microbatches']} micro-batch(es), {result['items_per_step']:,} {unit}/step",
             f"MFU denominator: "
             f"{result['mfu_denominator'] or _NO_PEAK.format(result.get('matmul_dtype', 'bf16'))}",
             f"XLA flags (preset {flags['preset']}{', ' + flags['note'] if flags['note'] else ''}): "
             f"{' '.join(f'{k}={v}' for k, v in flags['in_force'].items()) or '(none)'}",
             f"epoch = {result['dataset_items']:,.0f} {unit}; cost at ${result['gpu_hour_usd']}/device-hour",
             "", markdown_table(result["rows"], unit),
             "peak mem: allocator high-water mark; * = XLA memory-analysis estimate (args + outputs "
             f"+ temps; the process-wide mark was not raised); swing source: {result['rows'][0]['memory_source']}",
             f"peak mem and swing are one device's (the first of {result['num_devices']}); {unit}/s "
             f"and TFLOP/s are all {result['num_devices']} devices' together",
             "dispatch: host time of a burst's fastest dispatch call, per step (the other calls also "
             "wait for the device's queue; all in-call time is host_in_calls_ms_per_step in the JSON)"]
    opt = next(r for r in result["rows"] if r["name"] == "optimised")
    grad_sync = result.get("grad_sync_collective", opt["config"]["grad_sync"])
    remat = remat_label(opt["config"]["remat"], opt["config"].get("remat_layers"),
                        opt["config"].get("remat_rest", "none"))
    from jaxopt_train.precision import get_policy  # noqa: PLC0415 - imports jax

    policy = opt["config"]["policy"]
    scaled = " with a dynamic loss scale" if get_policy(policy).needs_loss_scale else ""
    lines.append(f"optimised: precision {policy}{scaled}, remat={remat}, grad_sync={grad_sync}, "
                 f"attention={opt['attention_resolved']}, steps_per_dispatch={opt['steps_per_dispatch']}, "
                 f"optimizer state {opt['config']['opt_state']}, gradients in the "
                 f"{opt['config']['grad_dtype']} dtype, {_zero_note(opt)}"
                 + (f", {policy} weight copy kept in the state" if opt["config"]["compute_copy"] else "")
                 + (", q/k/v from three products" if opt["config"]["split_qkv"] else "")
                 + (_fuse_note(opt["config"]["fuse_mlp_activation"]) if result.get("matmul") else ""))
    for row in result["rows"]:
        if row["config"].get("plain"):  # the yardstick rows of --compare-plain
            lines.append(f"optimised vs {row['name']}: {row['step_ms'] / opt['step_ms']:.3f}x "
                         "the throughput (same model, batch and devices; plain loop: "
                         "jaxopt_train.bench.plain)")
    for row in result["rows"]:
        if "loss_scale" in row:  # the host loop checks each micro-batch's update on its own
            lines.append(f"{row['name']}: loss scale {row['loss_scale']:g} after its last step; "
                         f"{row['skipped_updates']} update(s) skipped for non-finite gradients "
                         "(warm-up and timed steps)")
    names = {row["name"] for row in result["rows"]}
    lines += clock_notes(result["rows"] + [r for r in result.get("matmul", []) if r["name"] not in names])
    for skip in result["ablations_skipped"]:
        lines.append(f"ablation {skip['name']} skipped: {skip['reason']}")
    for fail in result.get("rows_failed", ()):
        lines.append(f"{fail['name']}: no row, the run failed ({fail['reason']})"
                     + (_baseline_hint(result, fail["reason"]) if fail["name"] == "baseline" else ""))
    for fail in result.get("plain_failed", ()):
        lines.append(f"{fail['name']}: no row, the run failed ({fail['reason']})")
    if "scaling" in result:
        lines += ["", "data parallel (weak scaling: same per-device batch):",
                  scaling_table(result["scaling"], unit)]
    if "scaling_failed" in result:
        lines.append(f"data parallel scaling: no table, the 1-device run failed "
                     f"({result['scaling_failed']})")
    if "matmul" in result:
        lines += ["", "dense-layer matmul (optimised config):",
                  matmul_table(result["matmul"], result["unit"])]
    if result.get("dispatch"):  # every --compare-dispatch row may have failed (rows_failed)
        lines += ["", "steps_per_dispatch (optimised config):",
                  dispatch_table(result["dispatch"])]
    return "\n".join(lines)


def _out_of_memory(reason: str) -> bool:
    """Whether a failure's one-line reason is the allocator's (XLA says RESOURCE_EXHAUSTED)."""
    return "RESOURCE_EXHAUSTED" in reason or "out of memory" in reason.lower()


def _baseline_hint(result, reason: str) -> str:
    """What may let a baseline that failed run: the ratios need its row. The memory advice only
    for a failure that was out of memory; any other says what is missing, and nothing more."""
    from jaxopt_train.runtime.memory import grows_on_demand  # noqa: PLC0415

    if not _out_of_memory(reason):
        return "; speed-up and mem ratio need it"
    hint = ("; speed-up and mem ratio need it: a smaller --global-batch, or a larger allocator "
            "pool (XLA_CLIENT_MEM_FRACTION, 0.75 of the GPU unless set), may let it fit")
    env = result.get("allocator_env", {})  # older JSON has none
    if grows_on_demand(env):
        # gpt-1b's f32 baseline on an 80 GB H100 (forty-fourth session) failed on one 28.7 GiB
        # buffer so; preallocated at 0.95 of the card, it ran (forty-fifth).
        hint += ("; this run grew its pool on demand (XLA_PYTHON_CLIENT_PREALLOCATE="
                 f"{env['XLA_PYTHON_CLIENT_PREALLOCATE']}), in regions no buffer spans two of: "
                 "unset it (or set true) to reserve the pool as one")
    return hint


def model_label(result) -> str:
    """The preset, shape and (GPT) data that actually ran, e.g.
    "gpt-124m (quick: layers=1, seq_len=32; uniform random ids)"."""
    args = result.get("args", {})
    if "gpt" in result:
        shape = f"layers={result['gpt']['n_layers']}, seq_len={result['gpt']['seq_len']}"
        if result["gpt"].get("data"):  # results written before --text have no "data"
            shape += f"; {result['gpt']['data']}"
    elif "vision" in result:
        shape = f"image_size={result['vision']['image_size']}"
    else:
        return result["model"]
    return f"{result['model']} ({'quick: ' if args.get('quick') else ''}{shape})"


def clock_notes(rows) -> list[str]:
    """One line of the GPUs' SM clock and power while the rows were timed (NVML), if sampled."""
    parts = []
    for row in rows:
        clocks = row.get("clocks") or {}
        if clocks.get("sm_clock_mhz") is None:
            continue
        low, high = clocks["sm_clock_mhz_range"]
        text = f"{row['name']} {clocks['sm_clock_mhz']:.0f} MHz ({low:.0f}-{high:.0f})"
        if clocks.get("power_w") is not None:
            text += f", {clocks['power_w']:.0f} W"
        if clocks.get("power_capped"):
            text += f", power-capped in {100 * clocks['power_capped']:.0f}% of samples"
        parts.append(text)
    if not parts:
        return []
    return ["SM clock while timed (median over GPUs and samples; the MFU denominator assumes the "
            "datasheet clock): " + "; ".join(parts)]


def _zero_note(row) -> str:
    if not row["config"]["zero"]:
        return "zero=0 (params and optimizer state replicated)"
    if row["num_devices"] == 1:
        return "zero=1 (a no-op on 1 device: nothing to shard)"
    return "zero=1 (master params and optimizer state sharded per leaf)"


def write_outputs(args, result, text) -> None:
    """`--json` and `--out` (train_bench.md, .json, and the .png of baseline, optimised and
    the plain rows of `--compare-plain`), all of them or none.

    Strict JSON: every figure is finite once the flags are (`bench train` refuses inf and
    nan), so a NaN or Infinity here is a bug, raised before any file is opened rather
    than written where a strict parser would refuse the whole report."""
    raw = json.dumps(result, indent=1, default=str, allow_nan=False)
    writers = {}  # final path -> writes that file's content to the path it is given
    if args.json:
        writers[args.json] = lambda path: _write_text(path, raw)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        rows = [r for r in result["rows"]
                if r["name"] in ("baseline", "optimised") or r["config"].get("plain")]
        # The plot first: it is what fails most (matplotlib, odd data), and costs the least then.
        writers[os.path.join(args.out, "train_bench.png")] = (
            lambda path: save_plot(rows, path, result["unit"]))
        writers[os.path.join(args.out, "train_bench.md")] = lambda path: _write_text(path, text + "\n")
        writers[os.path.join(args.out, "train_bench.json")] = lambda path: _write_text(path, raw)
    # All written beside their places first: a failure while writing (the plot's, a full
    # disk) leaves an earlier run's files as they were, not a new .md beside an old .png.
    replace_all_or_none(writers)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
