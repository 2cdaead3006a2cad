"""`bench train --ablate`: the baseline with one of the optimised row's techniques switched on.

A technique the optimised row does not use here (1 device, --microbatches 1, a
flag turned off) is listed as skipped with the reason instead of run, so the
table never shows a row identical to the baseline under another name.
"""

from __future__ import annotations

import dataclasses

from jaxopt_train.bench.train_remat import remat_label


def ablation_runs(baseline, optimised, workload, num_devices):
    """(runs, skipped): each of `optimised`'s techniques alone over `baseline`, and why some are not run."""
    from jaxopt_train.bench.train_steps import resolved_attention  # noqa: PLC0415 - imports jax

    runs, skipped = [], []

    def add(name, reason_to_skip=None, **changes):
        if reason_to_skip:
            skipped.append({"name": name, "reason": reason_to_skip})
        else:
            runs.append(dataclasses.replace(baseline, name=name, **changes))

    # The optimised row's compute dtype ("bf16", or "fp16" with its loss scale) names the
    # rows that switch it on; the optimizer state's dtype is its own flag, named below.
    half = optimised.policy
    add(f"+{half}", policy=optimised.policy)
    # What runs, not what was asked: --attention cudnn off an Ampere or newer GPU runs XLA's.
    fused = dataclasses.replace(baseline, policy=optimised.policy, attention=optimised.attention)
    add(f"+{half}+{optimised.attention} attention",
        None if workload.is_gpt and resolved_attention(workload, fused) != "xla" else
        f"same as +{half}: the fused kernel is unavailable (not an Ampere or newer GPU, or not a GPT)",
        policy=optimised.policy, attention=optimised.attention)
    add("+scan accumulation", None if workload.microbatches > 1 else "no-op with --microbatches 1",
        accumulation="scan")
    add("+donate", donate=True)
    add(f"+remat={remat_label(optimised.remat, optimised.remat_layers, optimised.remat_rest)}",
        None if optimised.remat != "none" else "chosen remat is none",
        remat=optimised.remat, remat_layers=optimised.remat_layers, remat_rest=optimised.remat_rest)
    add(f"+{optimised.opt_state} optimizer state",
        None if optimised.opt_state != "f32" else "--opt-state-dtype f32",
        opt_state=optimised.opt_state)
    add(f"+{half} gradients (+scan accumulation)",
        None if optimised.grad_dtype == "compute" else "--grad-dtype param",
        policy=optimised.policy, grad_dtype="compute", accumulation="scan")
    add(f"+{half} weight copy in the state (+{half} gradients, +scan accumulation)",
        None if optimised.compute_copy else "--no-compute-copy (or --grad-dtype param)",
        policy=optimised.policy, grad_dtype="compute", accumulation="scan", compute_copy=True)
    # The copies it saves are the ones the fused attention kernel's operands need.
    add(f"+q, k, v from three products (+{half}+{optimised.attention} attention)",
        None if optimised.split_qkv else "--split-qkv not given",
        policy=optimised.policy, attention=optimised.attention, split_qkv=True)
    # The host loop always reduces with psum: another method needs the in-graph step.
    add(f"+grad_sync={optimised.grad_sync}"
        + (" (+scan accumulation)" if workload.microbatches > 1 else ""),
        None if num_devices > 1 and optimised.grad_sync != "psum" else
        "psum chosen (or 1 device, or --zero 1: gradients reduce-scattered per leaf)",
        grad_sync=optimised.grad_sync, accumulation="scan")
    add(f"+steps_per_dispatch={optimised.steps_per_dispatch}"
        + (" (+scan accumulation)" if workload.microbatches > 1 else ""),
        None if optimised.steps_per_dispatch > 1 else "k = 1",
        steps_per_dispatch=optimised.steps_per_dispatch, accumulation="scan")
    add("+zero=1" + (" (+scan accumulation)" if workload.microbatches > 1 else ""),
        None if num_devices > 1 and optimised.zero else "--zero 0 (or 1 device: nothing to shard)",
        zero=1, accumulation="scan")
    skipped.append({"name": "+xla flags", "reason": "XLA flags are process-wide; compare a run "
                    "with --xla-preset none"})
    return runs, skipped
