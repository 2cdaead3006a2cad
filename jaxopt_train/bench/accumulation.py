"""Benchmark: one optimizer step at equal tokens, full batch vs scan accumulation vs MultiSteps.

    python -m jaxopt_train.bench.accumulation --quick            # CPU, MLP
    python -m jaxopt_train.bench.accumulation --model gpt-124m --batch 32 --microbatches 4

All three variants consume the same global batch per optimizer step:
- full: one jit call, `value_and_grad` over the whole batch, then AdamW.
- scan: one jit call, `accumulate_gradients(loss, K)` (lax.scan, f32 accumulators), then AdamW.
- multisteps: K jit calls of `multi_steps(adamw, K)`, one micro-batch each (host-fed).
Every variant's `final_loss` is the whole batch's loss at its last optimizer step (for
multisteps, the mean of that step's K micro-batch losses, as scan takes it).
Each variant is warmed up, then timed in bursts of back-to-back optimizer steps with one
`block_until_ready` per burst; the median per-step time is reported with its ratio to full.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxopt_train._replace import replace_text

VARIANTS = ("full", "scan", "multisteps")


def _gpt_presets() -> tuple[str, ...]:
    try:
        from jaxopt_train.models import GPT_PRESETS  # noqa: PLC0415
    except ImportError:
        return ()
    return tuple(GPT_PRESETS)


def _mlp_problem(batch: int, width: int, dtype: str):
    from flax import nnx  # noqa: PLC0415

    from jaxopt_train.precision import get_policy  # noqa: PLC0415

    policy = get_policy(dtype)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(width, width, param_dtype=policy.param_dtype,
                                               dtype=policy.compute_dtype, rngs=rngs)
                                    for _ in range(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.gelu(layer(x))
            return x

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))

    def loss_fn(params, batch):
        out = nnx.merge(graphdef, params)(batch["x"]).astype(jnp.float32)
        return jnp.mean((out - batch["y"]) ** 2)
    kx, ky = jax.random.split(jax.random.key(0))
    data = {"x": jax.random.normal(kx, (batch, width), policy.compute_dtype),
            "y": jax.random.normal(ky, (batch, width), jnp.float32)}
    return loss_fn, params, data, batch


def _gpt_problem(name: str, batch: int, dtype: str, seq_len: int | None):
    from flax import nnx  # noqa: PLC0415

    from jaxopt_train.models import GPT, get_gpt_config, gpt_loss  # noqa: PLC0415
    from jaxopt_train.precision import get_policy  # noqa: PLC0415

    policy = get_policy(dtype)
    overrides: dict[str, Any] = dict(dtype=policy.compute_dtype, param_dtype=policy.param_dtype)
    if seq_len:
        overrides["seq_len"] = seq_len
    cfg = get_gpt_config(name, **overrides)
    graphdef, params, rest = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        return gpt_loss(model(batch["inputs"]), batch["targets"])
    tokens = jax.random.randint(jax.random.key(0), (batch, cfg.seq_len + 1), 0, cfg.vocab_size,
                                dtype=jnp.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return loss_fn, params, data, batch * cfg.seq_len


def _steps(loss_fn, optimizer, num_microbatches: int) -> tuple[dict[str, Callable], Callable]:
    """Returns ({variant: step}, the MultiSteps micro step); each step maps (params, opt_state, batch) -> (params, opt_state, loss) for ONE optimizer step."""
    import optax  # noqa: PLC0415

    from jaxopt_train.accumulation import accumulate_gradients, multi_steps  # noqa: PLC0415

    def make(grad_fn, tx):
        def step(params, opt_state, batch):
            loss, grads = grad_fn(params, batch)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
                updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return jax.jit(step, donate_argnums=(0, 1))

    full = make(jax.value_and_grad(loss_fn), optimizer)
    scan = make(accumulate_gradients(loss_fn, num_microbatches), optimizer)
    micro = make(jax.value_and_grad(loss_fn), multi_steps(optimizer, num_microbatches))

    def multisteps(params, opt_state, micro_batches):
        losses = []
        for mb in micro_batches:  # K host-driven jit calls = one optimizer step
            params, opt_state, loss = micro(params, opt_state, mb)
            losses.append(loss)
        # The K micro-batch losses, averaged by `final_loss` only once timing is over: a
        # mean taken here was one more dispatch per optimizer step, timed in this row alone.
        return params, opt_state, tuple(losses)
    return {"full": full, "scan": scan, "multisteps": multisteps}, micro


def final_loss(loss) -> float:
    """A step's loss as a float: for multisteps (a tuple of its K micro-batch losses) the
    whole batch's, as full and scan report it (the same f32 mean of the micro-batch losses
    that `accumulate_gradients` takes), not the last micro-batch's."""
    return float(_mean_loss(*loss) if isinstance(loss, tuple) else loss)


@jax.jit
def _mean_loss(*losses):
    stacked = jnp.stack(losses)
    return jnp.mean(stacked.astype(jnp.float32)).astype(stacked.dtype)


def _time(step, params, opt_state, batch, *, warmup: int, steps: int, repeats: int):
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    first = time.perf_counter() - start  # includes compilation
    for _ in range(warmup):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready((params, loss))
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, loss))
        per_step.append((time.perf_counter() - start) / steps)
    return per_step, first, final_loss(loss)


def _temp_bytes(jitted, *args) -> int | None:
    try:
        analysis = jitted.lower(*args).compile().memory_analysis()
        return int(analysis.temp_size_in_bytes) if analysis is not None else None
    except Exception:  # noqa: BLE001 - memory analysis is optional per backend
        return None


def _parse(argv):
    parser = argparse.ArgumentParser(prog="jaxopt-train bench accumulation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = ("mlp",) + _gpt_presets()
    parser.add_argument("--model", default="mlp", choices=models)
    parser.add_argument("--batch", type=int, default=None, help="global batch (sequences for GPT)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=None, help="MLP width")
    parser.add_argument("--seq-len", type=int, default=None, help="GPT sequence length override")
    parser.add_argument("--precision", default=None, help="policy name (fp32, bf16, ...); "
                        "default fp32 for mlp, bf16 for GPT")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per burst")
    parser.add_argument("--repeats", type=int, default=None, help="timed bursts (median reported)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a CPU smoke run")
    parser.add_argument("--json", type=str, default=None, help="write raw figures to this path")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    args = parser.parse_args(argv)
    gpt = args.model != "mlp"
    for name in ("batch", "microbatches", "width", "seq_len", "steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:  # checked before the defaults: 0 is not "unset"
            parser.error(f"--{name.replace('_', '-')}={value} must be >= 1")
    # Each model reads only its own size flag: the other would be silently ignored.
    if gpt and args.width is not None:
        parser.error(f"--width={args.width} applies to --model mlp only; got --model {args.model} (drop --width)")
    if not gpt and args.seq_len is not None:
        parser.error(f"--seq-len={args.seq_len} applies to GPT models only; got --model mlp (drop --seq-len)")
    if args.batch is None:
        args.batch = (8 if args.quick else 32) if gpt else (128 if args.quick else 512)
    if not gpt:
        args.width = args.width or (256 if args.quick else 1024)
    args.precision = args.precision or ("bf16" if gpt else "fp32")
    from jaxopt_train.precision import get_policy  # noqa: PLC0415

    try:
        get_policy(args.precision)
    except ValueError as err:
        parser.error(f"--precision: {err}")
    args.steps = args.steps or (3 if args.quick else 10)
    args.repeats = args.repeats or (3 if args.quick else 7)
    if args.batch % args.microbatches:
        parser.error(f"--batch={args.batch} must be divisible by --microbatches="
                     f"{args.microbatches} (equal micro-batches), e.g. --batch "
                     f"{-(-args.batch // args.microbatches) * args.microbatches}")
    if args.json:  # checked (and its folder created) last, once nothing else is refused
        from jaxopt_train.bench.train_report import output_file_problem  # noqa: PLC0415

        problem = output_file_problem(args.json, overwrite=args.overwrite)
        if problem:
            parser.error(f"--json {args.json!r}: expected a writable file path; {problem}")
    return args


def main(argv: list[str] | None = None) -> int:
    import optax  # noqa: PLC0415

    from jaxopt_train.accumulation import multi_steps  # noqa: PLC0415

    args = _parse(argv)
    if args.model == "mlp":
        loss_fn, params, batch, tokens = _mlp_problem(args.batch, args.width, args.precision)
    else:
        loss_fn, params, batch, tokens = _gpt_problem(args.model, args.batch, args.precision,
                                                      args.seq_len)
    optimizer = optax.adamw(1e-4)
    steps, micro = _steps(loss_fn, optimizer, args.microbatches)
    k = args.microbatches
    micro_batches = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
    results: dict[str, Any] = {}
    for name in VARIANTS:
        # Fresh copies: the steps donate params and optimizer state.
        p = jax.tree.map(jnp.array, params)
        state = (multi_steps(optimizer, k) if name == "multisteps" else optimizer).init(p)
        data = micro_batches if name == "multisteps" else batch
        temp = (_temp_bytes(micro, p, state, micro_batches[0]) if name == "multisteps"
                else _temp_bytes(steps[name], p, state, batch))
        per_step, first, loss = _time(steps[name], p, state, data, warmup=2, steps=args.steps,
                                      repeats=args.repeats)
        # A diverged run's loss is nan/inf, which strict JSON cannot hold: null there.
        results[name] = {"median_s": statistics.median(per_step), "per_step_s": per_step,
                         "first_call_s": first, "temp_bytes": temp,
                         "final_loss": loss if math.isfinite(loss) else None}
    base = results["full"]["median_s"]
    print(f"model={args.model} batch={args.batch} microbatches={k} precision={args.precision} "
          f"tokens/step={tokens} device={jax.devices()[0].device_kind} jax={jax.__version__}")
    print(f"{'variant':<11} {'ms/step':>9} {'vs full':>8} {'tokens/s':>12} {'temp MiB':>9}")
    for name in VARIANTS:
        r = results[name]
        temp = f"{r['temp_bytes'] / 2**20:.1f}" if r["temp_bytes"] is not None else "n/a"
        print(f"{name:<11} {r['median_s'] * 1e3:>9.2f} {r['median_s'] / base:>7.3f}x "
              f"{tokens / r['median_s']:>12.0f} {temp:>9}")
    if args.json:
        record = {"args": vars(args), "tokens_per_step": tokens, "jax": jax.__version__,
                  "device": jax.devices()[0].device_kind, "results": results}
        # Whole or not at all (see bench/matmul.py): never an emptied --overwrite'd file.
        replace_text(args.json, json.dumps(record, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
