"""The least rematerialisation whose compiled train step fits a memory budget.

`bench train --remat auto` and `jaxopt-train train --remat auto` both search the
same way: compile each candidate ahead of time, compare XLA's memory analysis
(`runtime.fits`) with the budget less a reserve, run nothing. Policies go in
REMAT_ORDER, least recomputed first; once one fits and the one before it did not,
the fitting policy on only the first k blocks, with the one before it on the rest
(`GPTConfig.remat_rest`), is tried, so only as much is recomputed as the budget
needs: k from a straight line between the two measured steps, redrawn through each
k that misses (`next_remat_layers`), for at most PARTIAL_TRIES compiles. gpt-1b in
16 GiB on an H200: "dots_attention" on 15 of 16 blocks (none on the rest), in bench
train and in the trainer under a hard 16 GiB cap; there XLA's compiler, knowing the
pool, rematerialises some of the rest itself, so the line's first count (10) missed.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
from typing import Callable

# Least recomputed (most memory) first: "dots_attention" keeps cuDNN attention's
# forward results, so only the LayerNorms, GELU and q/k/v slices are recomputed.
REMAT_ORDER = ("none", "dots_attention", "dots", "full")


def allocator_reserve(budget: int) -> int:
    """Bytes of `budget` kept back from XLA's estimate: cuBLAS and cuDNN workspaces and
    allocator rounding, which the memory analysis does not count. On gpt-1b on an H200
    the allocator's peak ran 0.28-0.31 GiB above the estimate; 1/32 of the budget, at
    most 512 MiB, covers that at 16 GiB and shrinks with small budgets."""
    return min(budget // 32, 512 << 20)


# Compiles the partial search may spend after the policy on every block fits and the
# lighter one does not; each is a full AOT compile of the step (~10-20 s for gpt-1b).
PARTIAL_TRIES = 4


def next_remat_layers(k_lo: int, needed_lo: float, k_hi: int, needed_hi: float,
                      budget: float) -> int:
    """The block count to compile next, in (k_lo, k_hi]; k_hi means none in between.

    `needed_lo` is what the step needs with the policy on its first `k_lo` blocks
    (which did not fit), `needed_hi` with it on the first `k_hi` (which did). Each
    block moved to the policy is taken to save an equal share of the difference, so
    the answer is the fewest blocks the straight line between the two says fit. Where
    XLA's layout is less linear and that count does not fit, its own measurement
    becomes the new `k_lo` and the line is drawn again.
    """
    if not k_lo < k_hi:
        raise ValueError(f"the block counts must rise: {k_lo=} is not below {k_hi=}")
    saved_per_layer = (needed_lo - needed_hi) / (k_hi - k_lo)
    if saved_per_layer <= 0:  # the measurements do not fall: step one block at a time
        return k_lo + 1
    k = k_lo + math.ceil((needed_lo - budget) / saved_per_layer)
    return min(max(k, k_lo + 1), k_hi)


def remat_label(remat: str, layers: int | None = None, rest: str = "none") -> str:
    """`dots`, `dots (first 12 blocks)` when the policy covers only some blocks, or
    `full (first 3 blocks, dots on the rest)` when the others run a lighter one."""
    if layers is None:
        return remat
    return f"{remat} (first {layers} blocks{'' if rest == 'none' else f', {rest} on the rest'})"


def search_remat(attempt: Callable, rebuild: Callable, layers: int | None, budget: int):
    """The search, over runs that `attempt` and `rebuild` build.

    Args:
      attempt: `attempt(remat, remat_layers, remat_rest) -> (needed_bytes or None, fits,
        result)`: builds and compiles one candidate (`remat` on the first
        `remat_layers` blocks, None: all; `remat_rest` on the others), reports it, and
        returns its run.
      rebuild: `rebuild(remat) -> result`: the run of `remat` on every block again,
        for when its first build was released to try fewer blocks and none of those fit.
      layers: the model's block count; None where remat on only some blocks is not
        possible (scanned layers).
      budget: the bytes the step must fit (any reserve already taken off).

    Returns:
      The result of the first policy in REMAT_ORDER that fits, on the fewest blocks
      that fit with the policy before it (which did not fit alone) on the others; if
      nothing fits, the last attempt's result.
    """
    lighter = needed_lighter = None
    for policy in REMAT_ORDER:
        needed, fits, result = attempt(policy, None, "none")
        if fits or policy == REMAT_ORDER[-1]:
            break
        lighter, needed_lighter = policy, needed
        result = None  # its state and compiled step go before the next build
        gc.collect()
    if not fits or policy == "none" or layers is None or None in (needed_lighter, needed):
        return result
    if layers < 2 or needed_lighter <= needed:  # no partial count, or it would save nothing
        return result
    k = next_remat_layers(0, needed_lighter, layers, needed, budget)
    if k >= layers:  # the line says every block: the run in hand is the one
        return result
    result = None  # one state on the device at a time while the partial ones compile
    gc.collect()
    for _ in range(PARTIAL_TRIES):
        needed_k, fits_k, result_k = attempt(policy, k, lighter)
        if fits_k:
            return result_k
        result_k = None
        gc.collect()
        if needed_k is None:
            break
        k = next_remat_layers(k, needed_k, layers, needed, budget)
        if k >= layers:
            break
    return rebuild(policy)


# The trainer's search ---------------------------------------------------------------------


def build_fitting_run(cfg, devices=None, *, stream=None):
    """`loop.build_run(cfg)`, with `remat="auto"` resolved to the least remat that fits.

    The budget is the smallest memory pool of the devices, over every process
    (`step.smallest_pool`, after any `--memory-limit`), less `allocator_reserve`; a
    candidate fits if the most any process's compile of it needs is within it
    (`agreed_needed_bytes`), so every process picks alike. Where remat cannot apply
    (vision presets), no pool is known (CPU) or XLA gives no memory analysis, "auto"
    means "none". Each candidate's run is built and compiled once; the chosen one is
    returned as it is, with no rebuild.

    Returns:
      (cfg with `remat` and `model_overrides["remat_layers"]` and `["remat_rest"]` as
      chosen, task, trainer,
      trials): the trials list what each candidate needed (empty unless "auto").

    Raises:
      StepTooLargeError: if even remat "full" on every block does not fit.
    """
    import jax  # noqa: PLC0415

    from jaxopt_train.train.config import shape_overrides  # noqa: PLC0415
    from jaxopt_train.train.loop import build_run, dispatch_batch  # noqa: PLC0415
    from jaxopt_train.train.step import agreed_needed_bytes, smallest_pool  # noqa: PLC0415
    from jaxopt_train.train.trainer import StepTooLargeError  # noqa: PLC0415

    if cfg.remat != "auto":
        return (cfg, *build_run(cfg, devices), [])
    stream = sys.stderr if stream is None else stream
    # Read more than once (the pool, then each build): a one-pass iterator (mesh.devices.flat)
    # would reach the builds empty.
    devices = list(jax.devices() if devices is None else devices)
    overrides = shape_overrides(cfg.model_overrides)

    def with_remat(remat, remat_layers=None, remat_rest="none"):
        extra = {} if remat_layers is None else {"remat_layers": remat_layers}
        if remat_rest != "none":
            extra["remat_rest"] = remat_rest
        return dataclasses.replace(cfg, remat=remat, model_overrides={**overrides, **extra})

    pool = None if cfg.is_vision else smallest_pool(devices)
    reason = ("remat applies to GPT presets only" if cfg.is_vision else
              "no device reports a memory pool (CPU)" if pool is None else None)
    if reason is not None:
        print(f"jaxopt-train train: remat auto -> none: {reason}", file=stream, flush=True)
        chosen = with_remat("none")
        return (chosen, *build_run(chosen, devices), [])
    budget = pool - allocator_reserve(pool)

    trials: list[dict] = []

    def build(remat, remat_layers, remat_rest="none"):
        candidate = with_remat(remat, remat_layers, remat_rest)
        task, trainer = build_run(candidate, devices)
        try:
            trainer.compile(dispatch_batch(task, 0, cfg.steps_per_dispatch))
            report = trainer.memory_fit(budget)
        except StepTooLargeError as err:  # over the whole pool, let alone the budget
            report = err.report
        return candidate, task, trainer, report

    def attempt(remat, remat_layers, remat_rest):
        candidate, task, trainer, report = build(remat, remat_layers, remat_rest)
        mine = None if report is None else report.needed_bytes
        needed = agreed_needed_bytes(mine)
        # No analysis: nothing to measure the candidate by, so it is taken as it is.
        fits = needed is None or needed <= budget
        trials.append({"remat": remat, "remat_layers": remat_layers, "remat_rest": remat_rest,
                       "budget_bytes": budget, "needed_bytes": needed, "fits": fits})
        others = ("" if needed in (None, mine) else
                  f"; another process needs {needed / 2**30:.3f} GiB: "
                  f"{'fits' if fits else 'does NOT fit'}")
        print(f"jaxopt-train train: remat {remat_label(remat, remat_layers, remat_rest)}: "
              f"{'no memory analysis' if needed is None else report}{others} (the smallest "
              f"pool, {pool / 2**30:.3f} GiB, less a {(pool - budget) / 2**30:.3f} GiB reserve)",
              file=stream, flush=True)
        return needed, fits, (candidate, task, trainer) if fits else None

    layers = None
    if not cfg.scan_layers:
        from jaxopt_train.precision import get_policy  # noqa: PLC0415
        from jaxopt_train.train.task import gpt_model_config  # noqa: PLC0415

        layers = gpt_model_config(with_remat("none"), get_policy(cfg.precision)).n_layers
    result = search_remat(attempt, lambda remat: build(remat, None)[:3], layers, budget)
    if result is None:
        tried = "; ".join(f"{remat_label(t['remat'], t['remat_layers'], t['remat_rest'])} needs "
                          f"{t['needed_bytes'] / 2**30:.3f} GiB" for t in trials
                          if t["needed_bytes"] is not None)
        raise StepTooLargeError(
            f"remat auto: no remat fits {budget / 2**30:.3f} GiB per device (the smallest "
            f"memory pool less its reserve): {tried}. Use more micro-batches (--microbatches), "
            "bf16 gradients and AdamW moments (--grad-dtype compute --opt-state-dtype bf16), "
            "--zero 3 on several GPUs, or a larger pool (--memory-limit)")
    chosen, task, trainer = result
    picked = chosen.model_overrides
    label = remat_label(chosen.remat, picked.get("remat_layers"), picked.get("remat_rest", "none"))
    if trials[-1]["needed_bytes"] is None:
        label += (": no memory analysis from XLA on this backend, so nothing to compare with "
                  "the pool; pick --remat yourself if the step does not fit")
    print(f"jaxopt-train train: remat auto -> {label}", file=stream, flush=True)
    return chosen, task, trainer, trials
