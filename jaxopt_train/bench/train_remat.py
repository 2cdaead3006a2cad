"""Which remat the optimised `bench train` row runs: the least that fits the memory budget.

Each candidate step is compiled ahead of time and its memory analysed
(`runtime.fits`), nothing is run: the search of `train.remat_search`, which
`jaxopt-train train --remat auto` runs too, over the bench's own step builders.
"""

from __future__ import annotations

import dataclasses
import sys

from jaxopt_train.train.remat_search import (REMAT_ORDER, allocator_reserve, next_remat_layers,
                                             remat_label, search_remat)

__all__ = ["REMAT_ORDER", "allocator_reserve", "choose_remat", "memory_budget",
           "next_remat_layers", "remat_label"]


def memory_budget(args, device) -> int | None:
    """Bytes the optimised step must fit per device: --memory-budget, else the allocator's limit."""
    from jaxopt_train.runtime import parse_bytes  # noqa: PLC0415
    from jaxopt_train.train.step import device_pool_limit  # noqa: PLC0415

    if args.memory_budget:
        return parse_bytes(args.memory_budget)
    return device_pool_limit(device)


def choose_remat(bench, run, budget, reserve=None):
    """The least remat whose compiled step fits `budget`: (run, runner or None, trials, window).

    Policies are tried in REMAT_ORDER against `budget - reserve` (default
    `allocator_reserve(budget)`). When one fits and the one before it did not, the
    fitting policy on only the first k blocks (`remat_layers`, GPT blocks unrolled),
    with the one before it on the rest (`remat_rest`), is tried too, k from the two
    estimates (memory grows about linearly with the blocks moved to the lighter
    policy), so only as much is recomputed as the budget needs.
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

    def attempt(remat, remat_layers, remat_rest):
        candidate = dataclasses.replace(run, remat=remat, remat_layers=remat_layers,
                                        remat_rest=remat_rest)
        runner = train_steps.build_runner(workload, candidate, mesh)
        report = fits(runner.compiled[0], budget=budget - reserve)
        trials.append({"remat": candidate.remat, "remat_layers": candidate.remat_layers,
                       "remat_rest": candidate.remat_rest,
                       "needed_bytes": report.needed_bytes, "budget_bytes": budget,
                       "reserve_bytes": reserve, "fits": report.fits})
        print(f"[bench train] remat={remat_label(candidate.remat, candidate.remat_layers, remat_rest)} "
              f"(budget less a {reserve / 2**30:.3f} GiB reserve): {report}", file=sys.stderr, flush=True)
        return report.needed_bytes, report.fits, (candidate, runner)

    def rebuild(remat):
        candidate = dataclasses.replace(run, remat=remat)
        return candidate, train_steps.build_runner(workload, candidate, mesh)

    gpt = workload.gpt_config()
    candidate, runner = search_remat(attempt, rebuild, None if gpt.scan_layers else gpt.n_layers,
                                     budget - reserve)
    return candidate, runner, trials, window


