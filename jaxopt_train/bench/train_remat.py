"""Which remat the optimised `bench train` row runs: the least that fits the memory budget.

Each candidate step is compiled ahead of time and its memory analysed
(`runtime.fits`), nothing is run: policies in REMAT_ORDER, then the first
fitting policy on only the first k blocks, so only as much is recomputed as the
budget needs (on gpt-1b within 16 GiB, "dots" on every block cost ~6 ms/step).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys

# Least recomputed (most memory) first: "dots_attention" keeps cuDNN attention's
# forward results, so only the LayerNorms, GELU and q/k/v slices are recomputed.
REMAT_ORDER = ("none", "dots_attention", "dots", "full")


def memory_budget(args, device) -> int | None:
    """Bytes the optimised step must fit per device: --memory-budget, else the allocator's limit."""
    from jaxopt_train.runtime import parse_bytes  # noqa: PLC0415

    if args.memory_budget:
        return parse_bytes(args.memory_budget)
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU and some plugins raise
        stats = {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def allocator_reserve(budget: int) -> int:
    """Bytes of `budget` kept back from XLA's estimate: cuBLAS and cuDNN workspaces and
    allocator rounding, which the memory analysis does not count. On gpt-1b on an H200
    the allocator's peak ran 0.28-0.31 GiB above the estimate; 1/32 of the budget, at
    most 512 MiB, covers that at 16 GiB and shrinks with small budgets."""
    return min(budget // 32, 512 << 20)


def choose_remat(bench, run, budget, reserve=None):
    """The least remat whose compiled step fits `budget`: (run, runner or None, trials, window).

    Policies are tried in REMAT_ORDER against `budget - reserve` (default
    `allocator_reserve(budget)`). When one fits and "none" did not, the same policy
    on only the first k blocks (`remat_layers`, GPT blocks unrolled) is tried too, k
    from the two estimates (memory grows about linearly with the blocks left without
    remat), so only as much is recomputed as the budget needs.
    """
    from jaxopt_train.bench import _timing, train_steps  # noqa: PLC0415
    from jaxopt_train.runtime import fits  # noqa: PLC0415

    args, workload = bench.args, bench.workload
    device = bench.devices[0]
    window = (_timing.peak_bytes_in_use(device), _timing.bytes_in_use(device))
    if not workload.is_gpt or args.remat != "auto" or budget is None:
        chosen = args.remat if args.remat != "auto" and workload.is_gpt else "none"
        reason = ("remat applies to GPT models only" if not workload.is_gpt else
                  "fixed by --remat" if args.remat != "auto" else "no memory budget known")
        return dataclasses.replace(run, remat=chosen), None, [{"remat": chosen, "reason": reason}], window
    reserve = allocator_reserve(budget) if reserve is None else reserve
    trials, mesh = [], train_steps.data_mesh(bench.devices)

    def attempt(candidate):
        runner = train_steps.build_runner(workload, candidate, mesh)
        report = fits(runner.compiled[0], budget=budget - reserve)
        trials.append({"remat": candidate.remat, "remat_layers": candidate.remat_layers,
                       "needed_bytes": report.needed_bytes, "budget_bytes": budget,
                       "reserve_bytes": reserve, "fits": report.fits})
        print(f"[bench train] remat={remat_label(candidate.remat, candidate.remat_layers)} "
              f"(budget less a {reserve / 2**30:.3f} GiB reserve): {report}", file=sys.stderr, flush=True)
        return runner, report

    needed_none = None
    for policy in REMAT_ORDER:
        candidate = dataclasses.replace(run, remat=policy)
        runner, report = attempt(candidate)
        if policy == "none":
            needed_none = report.needed_bytes
        if report.fits or policy == REMAT_ORDER[-1]:
            break
        runner = None  # its state and compiled step go before the next build
        gc.collect()
    if not report.fits or policy == "none" or workload.gpt_config().scan_layers:
        return candidate, runner, trials, window
    # One runner's state on the device at a time: the window above is the optimised
    # row's peak, and two states side by side would count in it (a whole state copy).
    runner = None
    gc.collect()
    layers = workload.gpt_config().n_layers
    for k in partial_remat_layers(needed_none, report.needed_bytes, budget - reserve, layers):
        partial = dataclasses.replace(candidate, remat_layers=k)
        partial_runner, partial_report = attempt(partial)
        if partial_report.fits:
            return partial, partial_runner, trials, window
        partial_runner = None
        gc.collect()
    return candidate, train_steps.build_runner(workload, candidate, mesh), trials, window


def partial_remat_layers(needed_none: int, needed_all: int, budget: int, layers: int) -> list[int]:
    """Block counts k < layers worth compiling for remat on the first k blocks only.

    The estimate k assumes each block left without remat adds an equal share of
    (needed_none - needed_all); k + 1 is the fallback when XLA's layout is less linear.
    """
    saved_per_layer = (needed_none - needed_all) / layers
    if saved_per_layer <= 0:  # remat saved nothing: no k helps
        return []
    k = max(1, math.ceil((needed_none - budget) / saved_per_layer))
    return [n for n in (k, k + 1) if n < layers]


def remat_label(remat: str, layers: int | None = None) -> str:
    """`dots`, or `dots (first 12 blocks)` when the policy covers only some blocks."""
    return remat if layers is None else f"{remat} (first {layers} blocks)"
