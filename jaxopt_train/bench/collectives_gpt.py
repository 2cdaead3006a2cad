"""The data-parallel GPT step of `jaxopt-train bench collectives --gpt`.

For each grad-sync method it times the whole step, a compute-only step (no
reduction) and the reduction alone, and reports the hidden-communication
fraction 1 - (step - compute_only) / comm_only (clamped to [0, 1]: timing noise
takes it past either end, and the table marks such rows), the speed against the psum
step of the same run (psum is always timed, first) and the throughput against
one device at equal per-device batch. `--gpt-zero1` adds per-leaf ZeRO-1 and
`--gpt-embedding-exchange` the embedding gradient exchanged as rows;
`--gpt-trace` profiles each step and reads the overlap from the trace.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

from jaxopt_train.bench.collectives import time_burst, trace_overlap


def parse_gpt_overrides(parser: argparse.ArgumentParser, text: str) -> dict:
    """`--gpt-overrides` ("n_layers=4,dtype=bfloat16,use_bias=false") as GPTConfig overrides.

    Values are read as JSON (ints, floats, true/false), else kept as strings, as
    `jaxopt-train train --model` reads them. A malformed item exits 2 naming the flag.
    """
    items = [item for item in text.split(",") if item]
    if not items:  # skip importing the trainer for nothing
        return {}
    from jaxopt_train.train.cli import _parse_overrides  # noqa: PLC0415 (pulls in the trainer)

    for item in items:  # checked here: _parse_overrides' own message names --model
        key, sep, _ = item.partition("=")
        if not sep or not key:
            parser.error(f"argument --gpt-overrides: {item!r} must look like FIELD=VALUE, e.g. n_layers=4")
    return _parse_overrides(parser, items)


def check_gpt_config(parser: argparse.ArgumentParser, name: str, overrides: dict) -> None:
    """Builds the GPTConfig once so a bad preset or override exits 2 naming its flag."""
    from jaxopt_train.models import GPT_PRESETS, get_gpt_config  # noqa: PLC0415

    if name not in GPT_PRESETS:
        parser.error(f"argument --gpt-config: {name!r} is not a GPT preset; expected one of {GPT_PRESETS}")
    try:
        get_gpt_config(name, **overrides)
    except (TypeError, ValueError) as err:
        parser.error(f"argument --gpt-overrides: {err}")


def bench_gpt(args, record: Callable[[dict], None]) -> list[dict]:
    """Data-parallel GPT step per grad-sync method, vs compute-only, comm-only and one device.

    `args.gpt_overrides` is the dict from `parse_gpt_overrides`.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from jaxopt_train.collectives import all_reduce_tree  # noqa: PLC0415
    from jaxopt_train.models import GPT, get_gpt_config, gpt_loss  # noqa: PLC0415
    from jaxopt_train.zero import gather_leaves, leaf_specs, place_leaves, reduce_scatter_leaves  # noqa: PLC0415

    overrides = dict(args.gpt_overrides)
    cfg = get_gpt_config(args.gpt_config, **overrides)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    devices = jax.devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(devices, ("data",))
    batch, seq = args.gpt_batch, cfg.seq_len
    tokens = jax.random.randint(jax.random.key(1), (n * batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    sharded = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))

    # --gpt-grad-dtype compute: differentiate w.r.t. the compute-dtype copy of the
    # params, so the gradients (and the bytes each method reduces) are bf16.
    grad_dtype = cfg.dtype if args.gpt_grad_dtype == "compute" else None

    def narrow(tree):
        return tree if grad_dtype is None else jax.tree.map(lambda x: x.astype(grad_dtype), tree)

    def grads_of(p, toks):
        loss = lambda q: gpt_loss(nnx.merge(graphdef, q)(toks[:, :-1]), toks[:, 1:])  # noqa: E731
        return jax.value_and_grad(loss)(narrow(p))

    def step_body(method, exchange=False):
        options = sync_options(method, n, jax.local_device_count(), jax.process_count())

        def body(p, toks):
            if exchange:  # --gpt-embedding-exchange
                loss, g = exchange_gradients(graphdef, narrow(p), toks, method=method, bucket_mb=args.bucket_mb,
                                             group_size=options.get("group_size"))
            else:
                loss, g = grads_of(p, toks)
                if method is not None:
                    g = all_reduce_tree(g, "data", method=method, bucket_mb=args.bucket_mb, **options)
            return _sgd_update(p, g), lax.pmean(loss, "data")
        return body

    smap = lambda f, ins, outs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs,  # noqa: E731
                                                      check_vma=False))
    timing = dict(warmup=args.warmup, iters=args.gpt_iters, bursts=args.bursts)
    compute_fn = smap(step_body(None), (P(), P("data")), (P(), P()))
    compute_only = time_burst(compute_fn, (replicated, sharded), **timing)
    traced_compute = (trace_overlap(compute_fn, (replicated, sharded), os.path.join(args.gpt_trace, "compute_only"),
                                    iters=args.gpt_iters) if args.gpt_trace else None)
    single = jax.jit(step_body_single(grads_of))
    one = time_burst(single, (jax.device_put(params, devices[0]), jax.device_put(tokens[:batch], devices[0])),
                     **timing)
    rows = []
    # (row name, all-reduce method, step body, params' specs, params as the step takes them)
    # psum first: every row's step_vs_psum needs the baseline from this same run.
    methods = ["psum", *(m for m in dict.fromkeys(args.gpt_methods) if m != "psum")]
    label = {m: method_label(m, n, jax.local_device_count(), jax.process_count()) for m in methods}
    runs = [(label[m], m, step_body(m), P(), replicated) for m in methods]
    if args.gpt_embedding_exchange:
        runs += [(label[m] + "+embx", m, step_body(m, exchange=True), P(), replicated) for m in methods]
    if args.gpt_zero1:
        specs = leaf_specs(params, n)
        runs.append(("zero1", "psum", zero1_step_body(graphdef, specs, grad_dtype), specs,
                     place_leaves(params, specs, mesh)))

    def comm_fn(method, specs):  # the step's collectives alone, on gradient-sized data
        if specs == P():
            options = sync_options(method, n, jax.local_device_count(), jax.process_count())
            return lambda g: all_reduce_tree(g, "data", method=method, bucket_mb=args.bucket_mb, **options)
        return lambda g: gather_leaves(reduce_scatter_leaves(g, specs, "data", method=method), specs)

    psum_step = None
    for name, method, body, specs, state in runs:
        step_fn = smap(body, (specs, P("data")), (specs, P()))
        step = time_burst(step_fn, (state, sharded), **timing)
        psum_step = step if name == "psum" else psum_step
        comm = time_burst(smap(comm_fn(method, specs), P(), P()), (narrow(replicated),), **timing)
        # An +embx step exchanges the embedding's gradient as rows, which the dense
        # all-reduce timed as `comm` does not model: no hidden fraction for it.
        hidden, clamped_from = (hidden_fraction(step, compute_only, comm)
                                if comm > 0 and "+embx" not in name else (None, None))
        row = {"kind": "gpt_step", "config": args.gpt_config, "overrides": overrides,
               "grad_dtype": str(jnp.dtype(grad_dtype or cfg.param_dtype)),
               "devices": n, "per_device_batch": batch, "seq_len": seq, "method": name,
               "step_s": step, "step_vs_psum": psum_step / step, "compute_only_s": compute_only,
               "comm_only_s": comm, "hidden_comm_fraction": hidden,
               "hidden_comm_fraction_clamped_from": clamped_from,
               "one_device_step_s": one, "throughput_vs_one_device": n * one / step}
        if args.gpt_trace:
            # From the profile: how much reduction time ran alongside compute, how much was
            # exposed, and how much slower the compute itself got next to the collectives.
            traced = trace_overlap(step_fn, (state, sharded), os.path.join(args.gpt_trace, name),
                                   iters=args.gpt_iters)
            slowdown = (None if traced["compute_ms"] is None
                        else traced["compute_ms"] - traced_compute["compute_ms"])
            row["trace"] = {**traced, "compute_only_compute_ms": traced_compute["compute_ms"],
                            "compute_slowdown_ms": slowdown}
        rows.append(row)
        record(row)
    return rows


def sync_options(method: str, n: int, local: int, processes: int) -> dict:
    """`all_reduce_tree` options of a `--gpt-methods` name on `n` devices.

    "hierarchical" groups by process by default; in one process that is a single
    group, i.e. the flat ring timed a second time under another name. The bench
    then splits the axis in two groups of n // 2 (as the sweep's variant does)."""
    if method != "hierarchical":
        return {}
    if processes > 1 and n % local == 0 and local < n:
        return {"group_size": local}
    return {"group_size": n // 2}


def method_label(method: str, n: int, local: int, processes: int) -> str:
    """The row name: "hierarchical/<group>x<groups>" says which hierarchy was timed."""
    group = sync_options(method, n, local, processes).get("group_size")
    return method if group is None else f"{method}/{group}x{n // group}"


def hidden_fraction(step: float, compute_only: float, comm: float) -> tuple[float, float | None]:
    """(1 - (step - compute_only) / comm clamped to [0, 1], the unclamped value or None).

    Outside [0, 1] the three timings disagree by more than they measure (a step faster
    than its compute alone, or slower than compute plus comm): noise, not overlap, so
    the clamped value is kept with what it was clamped from."""
    raw = 1.0 - (step - compute_only) / comm
    hidden = min(1.0, max(0.0, raw))
    return hidden, None if hidden == raw else raw


def zero1_step_body(graphdef, specs, grad_dtype=None, axis_name="data"):
    """The `--gpt-zero1` DP step: per-leaf ZeRO-1 (`jaxopt_train.zero`) inside shard_map.

    `p` holds this device's shards of the params (`specs`, from `leaf_specs`). The
    step gathers them (in `grad_dtype` when given, so the all-gathers move bf16) at
    its start, where XLA can overlap the gathers with the forward; reduce-scatters
    each leaf's gradient as the backward produces it; and updates only its shards.
    """
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    from jaxopt_train.models import gpt_loss  # noqa: PLC0415
    from jaxopt_train.zero import gather_leaves, reduce_scatter_leaves  # noqa: PLC0415

    def body(p, toks):
        narrow = p if grad_dtype is None else jax.tree.map(lambda x: x.astype(grad_dtype), p)
        full = gather_leaves(narrow, specs, axis_name)
        loss, g = jax.value_and_grad(
            lambda q: gpt_loss(nnx.merge(graphdef, q)(toks[:, :-1]), toks[:, 1:]))(full)
        g = reduce_scatter_leaves(g, specs, axis_name, method="psum")
        return _sgd_update(p, g), lax.pmean(loss, axis_name)
    return body


def exchange_gradients(graphdef, params, tokens, *, method: str, bucket_mb: float, axis_name="data",
                       group_size: int | None = None):
    """Loss and summed-over-devices gradients of a GPT data-parallel step, with the
    embedding lookup's gradient exchanged as rows (`embedding_grad_exchange`).

    The lookup is taken out of the differentiated function: the table's gradient
    from the tied head is then complete early in the backward (its all-reduce can
    overlap the rest), and the lookup's part (token and position tables) follows
    from the gathered cotangent of the embeddings. Equal to differentiating the
    whole model and all-reducing every gradient, up to summation order.
    Runs inside `shard_map` over `axis_name`; `tokens` is [B, T + 1] (inputs, targets);
    `group_size` is "hierarchical"'s (see `all_reduce_tree`).
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    from jaxopt_train.collectives import all_reduce_tree, embedding_grad_exchange  # noqa: PLC0415
    from jaxopt_train.models import gpt_loss  # noqa: PLC0415

    model = nnx.merge(graphdef, params)
    cfg, ids = model.config, tokens[:, :-1]

    def loss_fn(q, x0):
        return gpt_loss(nnx.merge(graphdef, q).logits_from_embeddings(x0), tokens[:, 1:])

    loss, (grads, dx0) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, model.embed(ids))
    options = {} if group_size is None else {"group_size": group_size}
    grads = all_reduce_tree(grads, axis_name, method=method, bucket_mb=bucket_mb, **options)
    table = embedding_grad_exchange(ids, dx0, axis_name, cfg.vocab_size)
    positions = lax.psum(jnp.sum(dx0.astype(jnp.float32), axis=0), axis_name)
    grads = _add_to_leaf(grads, "wte", table)
    grads = _add_to_leaf(grads, "wpe", jnp.pad(positions, ((0, cfg.seq_len - positions.shape[0]), (0, 0))))
    return loss, grads


def _add_to_leaf(tree, module: str, value):
    """Adds `value` to the one leaf whose path starts at attribute `module` (e.g. "wte")."""
    import jax  # noqa: PLC0415

    hits = []

    def add(path, leaf):
        if path and getattr(path[0], "key", getattr(path[0], "name", None)) == module:
            hits.append(path)
            return leaf + value.astype(leaf.dtype)
        return leaf

    out = jax.tree_util.tree_map_with_path(add, tree)
    if len(hits) != 1:
        raise ValueError(f"expected one gradient leaf under {module!r}; found {len(hits)}")
    return out


def _sgd_update(params, grads):
    """Plain SGD (lr 1e-4) in the params' dtypes: the DP steps time gradients, not an optimizer."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    return jax.tree.map(lambda w, d: w - jnp.asarray(1e-4, w.dtype) * d.astype(w.dtype), params, grads)


def step_body_single(grads_of):
    def body(p, toks):
        loss, g = grads_of(p, toks)
        return _sgd_update(p, g), loss
    return body


def print_gpt(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\ndata-parallel GPT step ({r0['config']} {r0['overrides']}, {r0['devices']} devices, "
          f"batch {r0['per_device_batch']}x{r0['seq_len']} per device, {r0['grad_dtype']} gradients)")
    print(f"{'method':<13} {'step_ms':>8} {'x psum':>7} {'compute_ms':>10} {'comm_ms':>8} {'hidden':>7} "
          f"{'x 1 dev':>8}")
    for r in rows:
        hidden = f"{r['hidden_comm_fraction']:.2f}" if r["hidden_comm_fraction"] is not None else "-"
        hidden += "*" if r.get("hidden_comm_fraction_clamped_from") is not None else ""
        print(f"{r['method']:<13} {r['step_s'] * 1e3:>8.2f} {r['step_vs_psum']:>7.3f} "
              f"{r['compute_only_s'] * 1e3:>10.2f} {r['comm_only_s'] * 1e3:>8.2f} {hidden:>7} "
              f"{r['throughput_vs_one_device']:>8.2f}")
    clamped = [f"{r['method']} {r['hidden_comm_fraction_clamped_from']:.2f}" for r in rows
               if r.get("hidden_comm_fraction_clamped_from") is not None]
    if clamped:
        print(f"* clamped to [0, 1] from {', '.join(clamped)}: the step, compute-only and comm-only "
              "timings disagree by more than the overlap (noise; time more --gpt-iters)")
    traced = [r for r in rows if r.get("trace")]
    if traced:
        print("\nfrom the profile (ms per step, mean over devices; slowdown = compute time next to the "
              "reductions minus the compute-only step's):")
        print(f"{'method':<13} {'collective':>10} {'concurrent':>10} {'exposed':>8} {'compute':>8} "
              f"{'slowdown':>8} {'idle':>6}")
        for r in traced:
            t = r["trace"]
            if t["compute_ms"] is None:
                print(f"{r['method']:<13} (no GPU streams in the trace)")
                continue
            print(f"{r['method']:<13} {t['collective_ms']:>10.2f} {t['concurrent_ms']:>10.2f} "
                  f"{t['exposed_ms']:>8.2f} {t['compute_ms']:>8.2f} {t['compute_slowdown_ms']:>8.2f} "
                  f"{t['idle_ms']:>6.2f}")
