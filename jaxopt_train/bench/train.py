"""`jaxopt-train bench train`: baseline vs optimised training, measured in one process.

Configs run one after the other on the same model and global batch:

- baseline: f32 params and compute, XLA attention, no remat, micro-batches fed
  from a host loop (one jit call each, optax.MultiSteps), psum every call, no
  donation, one optimizer step per dispatch;
- optimised: bf16 compute with f32 master weights (`--precision`: fp16 with a
  dynamic loss scale on a GPU without bf16 tensor cores, such as a T4; gradients
  kept in the compute dtype and widened after the all-reduce, AdamW moments
  stored in bf16: `--grad-dtype`, `--opt-state-dtype`), cuDNN attention on an
  Ampere or newer GPU,
  `lax.scan` accumulation with one all-reduce after it, donated state, the
  first remat policy ("none", "dots_attention", "dots", "full") whose compiled step fits
  `--memory-budget`, on only as many blocks as the budget needs, the policy before
  it on the others (`bench/train_remat.py`), the fastest grad-sync method (under `--zero 0`;
  ZeRO-1 reduce-scatters the gradients per leaf), `--steps-per-dispatch` steps
  per compiled call, and the `--xla-preset` XLA flags; on more than one device
  its f32 master params and AdamW state are sharded per leaf over the devices
  (`--zero 1`, the default; ZeRO-1: all-gather params, reduce-scatter gradients;
  on 2 H200s it lifted gpt-1b's scaling from 90.8% to 95.1%);
- with `--ablate`, each technique alone over the baseline;
- with `--compare-plain` (GPT), a careful plain Flax NNX + optax loop with f32
  master weights and with pure bf16 params (`jaxopt_train.bench.plain`): the
  yardstick issue 6 says the optimised row must beat, not only the baseline.

Timing: warm up (`--warmup` dispatches, then on until `--warmup-s` seconds
have passed: 15 by default, because a power-capped GPU slows for its first
seconds under load and bursts timed then run a few percent fast), then bursts
of back-to-back dispatches with one sync per burst (median burst),
compilation excluded, the garbage collector frozen after compiling
(`runtime.frozen_collector`). A separate trace pass syncs per
dispatch for the per-step memory/throughput plot. XLA flags are process-wide:
every config here runs under them (compare runs with `--xla-preset none`).
With more than one device the configs run data-parallel and the optimised one
is rerun on one device at the same per-device batch for scaling efficiency.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
import warnings

from jaxopt_train.bench import train_checks
from jaxopt_train.bench.train_ablation import ablation_runs
from jaxopt_train.bench.train_remat import REMAT_ORDER, choose_remat, memory_budget

QUICK = dict(model="gpt-tiny", global_batch=8, microbatches=2, steps=4, warmup=1, warmup_s=0.0, bursts=2,
             seq_len=32, layers=1, image_size=16, steps_per_dispatch=2, trace_steps=3)
DEFAULTS = dict(model="gpt-124m", global_batch=8, microbatches=1, steps=40, warmup=5, warmup_s=15.0, bursts=5,
                seq_len=None, layers=None, image_size=None, steps_per_dispatch=4, trace_steps=10)


def _parser() -> argparse.ArgumentParser:
    from jaxopt_train.bench.train_steps import PRECISIONS, ZERO_STAGES  # noqa: PLC0415
    from jaxopt_train.collectives import METHODS  # noqa: PLC0415
    from jaxopt_train.models import GPT_PRESETS, VISION_PRESETS  # noqa: PLC0415
    from jaxopt_train.runtime.xla_flags import PRESETS  # noqa: PLC0415
    from jaxopt_train.train.config import GRAD_DTYPES  # noqa: PLC0415
    from jaxopt_train.train.optim import STATE_DTYPES  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="jaxopt-train bench train", description=__doc__,
                                formatter_class=_Help)
    p.add_argument("--model", choices=GPT_PRESETS + VISION_PRESETS)
    p.add_argument("--global-batch", type=int, help="sequences or images per optimizer step")
    p.add_argument("--microbatches", type=int, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, help="timed optimizer steps over all bursts, at least: "
                   "rounded up to whole bursts of whole k-step calls")
    p.add_argument("--warmup", type=int, help="untimed warm-up dispatches")
    p.add_argument("--warmup-s", type=float, help="then keep warming up until this many seconds "
                   "have passed (a power-capped GPU slows as it heats: time its steady state)")
    p.add_argument("--bursts", type=int, help="timed bursts (the median is reported)")
    p.add_argument("--trace-steps", type=int, help="synced dispatches traced for the plot/swing")
    p.add_argument("--seq-len", type=int, help="GPT sequence length override (small mode)")
    p.add_argument("--layers", type=int, help="GPT depth override (small mode)")
    p.add_argument("--image-size", type=int, help="vision input side override (small mode)")
    p.add_argument("--steps-per-dispatch", type=int, help="optimizer steps per compiled call (k)")
    p.add_argument("--compare-dispatch", help="comma list of k, e.g. 1,16: rerun the optimised "
                   "config at each k and report host dispatch vs wall time per step")
    p.add_argument("--compare-matmul", help="comma list of GPT dense-layer kernels (pallas, "
                   "triton): rerun the optimised config with each and report it against XLA's dot")
    p.add_argument("--compare-plain", action="store_true",
                   help="GPT: add rows for a careful plain Flax NNX + optax loop (f32 master and "
                   "pure bf16; jaxopt_train.bench.plain), the yardstick the optimised row must beat")
    p.add_argument("--text", action="store_true",
                   help="GPT: feed byte windows of the embedded text corpus instead of uniform "
                   "random ids (real id frequencies: a cost that follows them, such as a frequent "
                   "token's embedding gradient, shows only then)")
    p.add_argument("--remat", choices=("auto",) + REMAT_ORDER, default="auto",
                   help="optimised config's remat policy; auto: the least that fits --memory-budget")
    p.add_argument("--memory-budget", help="per-device bytes for remat choice, e.g. 16GiB "
                   "(default: the allocator's limit where known, else no remat)")
    p.add_argument("--grad-sync", choices=("auto",) + METHODS, default="auto",
                   help="optimised config's gradient all-reduce; auto: the fastest on gradient-shaped data "
                   "here (psum on one device and under --zero 1)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="optimised config's compute dtype (f32 master weights either way); "
                   "auto = bf16, except fp16 on a GPU without bf16 tensor cores (compute "
                   "capability < 8.0, e.g. a T4), where XLA runs bf16 matmuls in float32. "
                   "fp16 adds a dynamic loss scale and skips non-finite steps")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                   help="optimised attention; auto = cudnn on an Ampere or newer GPU, else xla")
    p.add_argument("--opt-state-dtype", choices=STATE_DTYPES, default="bf16",
                   help="optimised config: storage dtype of AdamW's moments")
    p.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="compute",
                   help="optimised config: gradients in the f32 params' dtype or the bf16 "
                   "compute dtype (widened after the all-reduce)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=1,
                   help="optimised config: 1 (default) shards the f32 master params and AdamW "
                   "state per leaf over the devices (ZeRO-1; a no-op on one device); 0 "
                   "replicates them")
    p.add_argument("--compute-copy", action=argparse.BooleanOptionalAction, default=None,
                   help="optimised config: keep the params' bf16 copy in the state, written by "
                   "the optimizer update, instead of casting the f32 params at each step's start "
                   "(costs 2 bytes per param; ~1 ms of gpt-1b's 87 ms step on an H200). Default: "
                   "on with --grad-dtype compute, which it needs")
    p.add_argument("--split-qkv", action="store_true",
                   help="optimised config (GPT): q, k and v from three products of the fused "
                   "weight's column blocks, so cuDNN attention reads them without slice copies "
                   "(off by default: 1.5%% slower on gpt-1b on an H200)")
    p.add_argument("--fuse-mlp-activation", action=argparse.BooleanOptionalAction, default=None,
                   help="optimised config (GPT), in its rows with a kernel matmul "
                   "(--compare-matmul pallas|triton): the MLP's fc + bias + GELU as one kernel "
                   "launch that also writes the pre-activation for the backward. Default: where "
                   "the kernel applies the GELU itself (Mosaic GPU and Triton; on gpt-1b on an "
                   "H200 2.0 GiB less memory and an equal or slightly faster step); "
                   "--fuse-mlp-activation also on the other kernels, --no-fuse-mlp-activation "
                   "nowhere")
    p.add_argument("--xla-preset", choices=sorted(PRESETS), default="gpu-throughput",
                   help="XLA flags every config runs under (runtime.xla_flags; compare with none)")
    p.add_argument("--xla-extra", default=None, help="more XLA flags, '--name=value ...'")
    p.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1-device scaling run")
    p.add_argument("--ablate", action="store_true", help="each technique alone over the baseline")
    p.add_argument("--dataset-tokens", type=float, help="epoch size: tokens (GPT) or images "
                   "(vision); default 10e9 tokens / 1,281,167 images")
    p.add_argument("--gpu-hour-usd", type=float, default=2.50, help="price per device-hour")
    p.add_argument("--peak-tflops", type=float, help="dense peak per device (MFU denominator)")
    p.add_argument("--out", help="directory for train_bench.md, train_bench.json, train_bench.png")
    p.add_argument("--json", help="write the raw figures as JSON to this path")
    p.add_argument("--overwrite", action="store_true",
                   help="replace report files that already exist (--out's, --json's)")
    p.add_argument("--quick", action="store_true", help="CPU small mode (tiny shapes and steps)")
    for action in p._actions:  # defaults that depend on --quick are filled in after parsing (_parse)
        if action.dest in DEFAULTS and action.default is None:
            full = "the model's own" if DEFAULTS[action.dest] is None else DEFAULTS[action.dest]
            action.help = (f"{action.help or ''} (default: {full}; "
                           f"with --quick: {QUICK.get(action.dest, DEFAULTS[action.dest])})").lstrip()
    return p


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and "(default: X)" after a flag that has one and does
    not say it itself. The optimised config's --opt-state-dtype bf16 and --grad-dtype compute
    are the opposite of `jaxopt-train train`'s: a help without them misled."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parse(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULTS
    args.defaulted = set()
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            args.defaulted.add(name)
    train_checks.check_shape_flags(parser, args)
    train_checks.check_grad_sync(parser, args)
    if args.xla_extra is not None:
        from jaxopt_train.runtime.xla_flags import parse_xla_flags  # noqa: PLC0415

        try:
            parse_xla_flags(args.xla_extra)
        except ValueError as err:
            parser.error(f"--xla-extra {args.xla_extra!r}: expected XLA flags such as "
                         f"'--xla_gpu_enable_latency_hiding_scheduler=true ...' ({err})")
    for name in ("global_batch", "microbatches", "steps", "warmup", "bursts", "trace_steps",
                 "steps_per_dispatch"):
        low = 0 if name == "warmup" else 1
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    if not 0 <= args.warmup_s < math.inf:
        parser.error(f"--warmup-s={args.warmup_s} must be a finite number of seconds >= 0")
    try:
        args.compare = [int(k) for k in args.compare_dispatch.split(",")] if args.compare_dispatch else []
    except ValueError:
        parser.error(f"--compare-dispatch {args.compare_dispatch!r}: expected a comma list of "
                     "steps per dispatch, e.g. 1,4,16")
    if any(k < 1 for k in args.compare):
        parser.error(f"--compare-dispatch {args.compare_dispatch!r}: every k must be >= 1")
    _refuse_repeats(parser, "--compare-dispatch", args.compare_dispatch, args.compare)
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices={args.devices} must be >= 1")
    for name in ("peak_tflops", "dataset_tokens"):  # inf would reach the JSON as Infinity
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            parser.error(f"--{name.replace('_', '-')}={value} must be > 0 and finite")
    if not (args.gpu_hour_usd >= 0 and math.isfinite(args.gpu_hour_usd)):
        parser.error(f"--gpu-hour-usd={args.gpu_hour_usd} must be >= 0 and finite")
    if args.memory_budget:
        from jaxopt_train.runtime import parse_bytes  # noqa: PLC0415

        try:
            budget = parse_bytes(args.memory_budget, name="--memory-budget")
        except ValueError as err:
            parser.error(str(err))
        if budget <= 0:
            parser.error(f"--memory-budget {args.memory_budget!r} must be more than 0 bytes")
    args.matmuls = [m.strip() for m in args.compare_matmul.split(",")] if args.compare_matmul else []
    from jaxopt_train.train.config import MATMULS  # noqa: PLC0415

    bad = [m for m in args.matmuls if m not in MATMULS or m == "xla"]
    if bad:
        parser.error(f"--compare-matmul {args.compare_matmul!r}: expected a comma list of "
                     f"{[m for m in MATMULS if m != 'xla']} (xla is the optimised row itself)")
    _refuse_repeats(parser, "--compare-matmul", args.compare_matmul, args.matmuls)
    if args.matmuls and not args.model.startswith("gpt"):
        parser.error(f"--compare-matmul applies to GPT models, not --model {args.model}")
    if args.compare_plain and not args.model.startswith("gpt"):
        parser.error(f"--compare-plain applies to GPT models, not --model {args.model}")
    if args.memory_budget and not (args.model.startswith("gpt") and args.remat == "auto"):
        # choose_remat only reads it to pick a GPT remat policy: elsewhere it was ignored.
        why = (f"--remat {args.remat} is fixed" if args.model.startswith("gpt")
               else f"--model {args.model} has no remat policies")
        parser.error(f"--memory-budget picks a GPT model's remat policy under --remat auto; {why}, "
                     "so it would be ignored: drop it")
    if args.text and not args.model.startswith("gpt"):
        parser.error(f"--text applies to GPT models (token ids), not --model {args.model}")
    for flag in ("split_qkv", "fuse_mlp_activation"):
        if getattr(args, flag) and not args.model.startswith("gpt"):  # None, False: nothing asked
            parser.error(f"--{flag.replace('_', '-')} applies to GPT models, not --model {args.model}")
    if args.fuse_mlp_activation is not None and not args.matmuls:
        given = "--fuse-mlp-activation" if args.fuse_mlp_activation else "--no-fuse-mlp-activation"
        parser.error(f"{given} sets the GPT rows of --compare-matmul pallas|triton and does "
                     "nothing without them (the optimised row uses XLA's dot): add "
                     f"--compare-matmul or drop {given}")
    if args.compute_copy and args.grad_dtype != "compute":
        parser.error(f"--compute-copy is the copy the step differentiates: it needs "
                     f"--grad-dtype compute, got --grad-dtype {args.grad_dtype}")
    if args.compute_copy is None:
        args.compute_copy = args.grad_dtype == "compute"
    return args


def _refuse_repeats(parser, flag: str, text: str | None, items: list) -> None:
    """A repeated item would measure the same config again, as one more row."""
    repeats = sorted({str(item) for i, item in enumerate(items) if item in items[:i]})
    if repeats:
        parser.error(f"{flag} {text!r} repeats {', '.join(repeats)}: give each item once")


def _set_xla_flags(args) -> dict:
    """Applies the preset if the backend has not started; returns what is in force."""
    from jaxopt_train.runtime import backend_started, flags_in_force, xla_flags  # noqa: PLC0415

    started = backend_started()
    report = xla_flags(args.xla_preset, extra=args.xla_extra, apply=not started)
    return {"preset": args.xla_preset, "applied": not started, "requested": report.added,
            "in_force": flags_in_force(),
            "note": "" if not started else "backend already running: preset NOT applied"}


class Bench:
    """Holds the shared settings and measures one config at a time."""

    def __init__(self, args, workload, devices, peak_tflops):
        self.args, self.workload, self.devices, self.peak = args, workload, devices, peak_tflops
        unit_default = 10e9 if workload.is_gpt else 1_281_167
        self.dataset_items = args.dataset_tokens or unit_default

    def measure(self, run, workload=None, devices=None, runner=None, peak_window=None):
        from jaxopt_train.bench import _timing, train_report, train_steps  # noqa: PLC0415
        from jaxopt_train.bench.plain import PlainRun  # noqa: PLC0415
        from jaxopt_train.runtime.collector import frozen_collector  # noqa: PLC0415

        workload = workload or self.workload
        devices = devices or self.devices
        device = devices[0]
        gc.collect()
        peak_before, in_use_before = peak_window or (_timing.peak_bytes_in_use(device),
                                                     _timing.bytes_in_use(device))
        if runner is None:
            runner = train_steps.build_runner(workload, run, train_steps.data_mesh(devices))
        k, bursts = runner.steps_per_call, self.args.bursts
        calls = max(1, math.ceil(self.args.steps / bursts / k))
        # Hand the state over: a reference kept here (or in the runner) would keep the
        # state entering each timing call alive, one more copy of a non-donated state
        # in every memory sample, the swing and the peak.
        state = _timing.Handoff(runner.state)
        runner.state = None
        # The collector frozen as in the trainer's loop (runtime/collector.py): a generation-2
        # pass over what the compiled step keeps alive took a gpt-1b step from 0.09 to
        # 0.28-0.40 s; landing in a burst it skews that burst, in the trace the plot.
        with frozen_collector():
            state = _timing.warm_up(runner.step, state, self.args.warmup, self.args.warmup_s)
            with _timing.gpu_clocks(devices) as clocks:
                state, timing = _timing.time_bursts(runner.step, state, bursts=bursts,
                                                    calls_per_burst=calls, steps_per_call=k)
            state, trace = _timing.trace_steps(runner.step, state, calls=self.args.trace_steps,
                                               steps_per_call=k, device=device)
        peak = _peak_memory(device, peak_before, in_use_before, runner.compiled)
        scale = _loss_scale_figures(run, state.state)
        del state
        row = train_report.row_figures(
            name=run.name, timing=timing, trace=trace, compile_s=runner.compile_s,
            items_per_step=workload.items_per_step, flops_per_step=workload.flops_per_step,
            unit=workload.unit, num_devices=len(devices), peak_tflops=self.peak,
            peak_memory=peak, dataset_items=self.dataset_items,
            gpu_hour_usd=self.args.gpu_hour_usd, steps_per_call=k)
        row["config"] = run.describe()
        row["clocks"] = clocks
        row["attention_resolved"] = (run.attention if isinstance(run, PlainRun)
                                     else train_steps.resolved_attention(workload, run))
        row["global_batch"] = workload.global_batch
        row.update(scale)
        print(f"[bench train] {run.name}: {row['step_ms']:.2f} ms/step, "
              f"{row['throughput']:,.0f} {workload.unit}/s, compile {runner.compile_s:.1f} s",
              file=sys.stderr, flush=True)
        return row


def _loss_scale_figures(run, state) -> dict:
    """A float16 row's loss scale after its last step and the updates it skipped (warm-up
    and timed steps together). A row whose every step overflowed would time updates that
    change nothing: the report says so instead of leaving it to the reader's trust."""
    from jaxopt_train.bench import train_steps  # noqa: PLC0415

    if not isinstance(run, train_steps.RunConfig) or not run.loss_scaled:
        return {}
    scale = train_steps.split_state(state, run)[4]
    return {"loss_scale": float(scale.loss_scale), "skipped_updates": int(scale.skipped_steps)}


def _analysis_bytes(compiled) -> int | None:
    from jaxopt_train.runtime import fits  # noqa: PLC0415

    try:
        return fits(compiled, budget=2**60).needed_bytes
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _peak_memory(device, peak_before, in_use_before, compiled) -> tuple[int | None, str]:
    """The allocator's peak if this config raised the process-wide mark, else XLA's estimate."""
    from jaxopt_train.bench import _timing  # noqa: PLC0415

    peak_after = _timing.peak_bytes_in_use(device)
    if peak_after is not None and peak_before is not None and peak_after > peak_before:
        return peak_after, "allocator"
    estimates = [b for b in (_analysis_bytes(c) for c in compiled) if b is not None]
    if not estimates:
        return None, "unavailable"
    return max(estimates) + (in_use_before or 0), "xla-estimate"


def choose_grad_sync(args, workload, run, devices):
    """The fastest `all_reduce_tree` method on gradients shaped like the params (psum on 1 device)."""
    if args.grad_sync != "auto":
        return args.grad_sync, {}
    if len(devices) == 1 or run.zero:  # ZeRO-1 reduce-scatters per leaf instead
        return "psum", {}
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from jaxopt_train.bench import _timing, train_steps  # noqa: PLC0415
    from jaxopt_train.collectives import all_reduce_tree  # noqa: PLC0415
    from jaxopt_train.precision import get_policy  # noqa: PLC0415

    mesh = train_steps.data_mesh(devices)
    shapes = jax.eval_shape(lambda: nnx.state(train_steps.build_model(workload, run, None), nnx.Param))

    def zero_grads():
        grads = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)
        # In the dtype the step reduces: with grad_dtype="compute" its gradients are bf16,
        # half the bytes of the f32 params (and the ring accumulates them differently).
        return get_policy(run.policy).cast_to_compute(grads) if run.grad_dtype == "compute" else grads
    grads = jax.jit(zero_grads, out_shardings=NamedSharding(mesh, P()))()
    # hierarchical groups by host: in one process it is one group, the plain ring timed twice
    # (and possibly reported as the winner under another name).
    multi_host = len({d.process_index for d in devices}) > 1
    methods = ["psum", "ring", "ring_bidir"] + (["hierarchical"] if multi_host and len(devices) >= 4 else [])
    times = {}
    for method in methods:
        fn = jax.jit(jax.shard_map(lambda g, m=method: all_reduce_tree(g, "data", method=m),
                                   mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        step = lambda g, f=fn: (g, f(g))  # noqa: E731 - (state, out) shape _timing expects
        _timing.warm_up(step, grads, 1)
        _, timing = _timing.time_bursts(step, grads, bursts=3, calls_per_burst=3, steps_per_call=1)
        times[method] = timing.step_s * 1e3
    return min(times, key=times.get), times


def run_devices(args) -> list:
    """The devices to run on, after the checks that need them; then the output folders.

    Refuses, before anything compiles, what these devices cannot run. The `--out` and
    `--json` folders are created last, once nothing is left to refuse, so a refused
    run leaves no folder behind."""
    import jax  # noqa: PLC0415

    parser = _parser()  # usage errors (exit 2), like the flag checks before the backend
    if args.devices and args.devices > jax.device_count():
        parser.error(f"--devices={args.devices}, but only {jax.device_count()} "
                     f"{jax.default_backend()} device(s) are visible")
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    train_checks.check_backends(parser, args, devices)
    from jaxopt_train.bench.train_steps import optimised_policy  # noqa: PLC0415

    args.policy = optimised_policy(args.precision, devices)
    if args.compare_plain and args.policy != "bf16":
        why = "" if args.precision != "auto" else " (--precision auto chose it for this GPU)"
        parser.error(f"--compare-plain's plain loops train in bf16, so they compare with a bf16 "
                     f"optimised row; this one runs in {args.policy}{why}: add --precision bf16 "
                     "or drop --compare-plain")
    if "global_batch" in args.defaulted:
        # A defaulted batch must still split over every device and micro-batch
        # (e.g. --quick on 8 emulated devices); an explicit one is validated as given.
        unit = len(devices) * args.microbatches
        args.global_batch = -(-args.global_batch // unit) * unit
    from jaxopt_train.accumulation import check_divisible  # noqa: PLC0415

    try:
        check_divisible(args.global_batch, args.microbatches, len(devices))
    except ValueError as err:
        parser.error(f"--global-batch {args.global_batch} / --microbatches "
                     f"{args.microbatches} on {len(devices)} device(s): {err}")
    train_checks.check_outputs(parser, args)
    return devices


def run_bench(args, xla_report) -> dict:
    import jax  # noqa: PLC0415

    from jaxopt_train.bench import train_report, train_steps  # noqa: PLC0415
    from jaxopt_train.precision import get_policy  # noqa: PLC0415
    from jaxopt_train.runtime.memory import allocator_env  # noqa: PLC0415
    from jaxopt_train.train.mfu import matmul_dtype_name, resolve_peak_tflops  # noqa: PLC0415

    devices = run_devices(args)
    workload = train_steps.Workload(args.model, args.global_batch, args.microbatches,
                                    seq_len=args.seq_len if args.model.startswith("gpt") else None,
                                    n_layers=args.layers if args.model.startswith("gpt") else None,
                                    image_size=None if args.model.startswith("gpt") else args.image_size,
                                    text=args.text)
    kind = devices[0].device_kind
    optimised = train_steps.RunConfig("optimised", policy=args.policy,
                                      attention=train_steps.optimised_attention(args.attention),
                                      accumulation="scan", donate=True,
                                      steps_per_dispatch=args.steps_per_dispatch,
                                      opt_state=args.opt_state_dtype, grad_dtype=args.grad_dtype,
                                      zero=args.zero, compute_copy=args.compute_copy,
                                      split_qkv=args.split_qkv,
                                      fuse_mlp_activation=args.fuse_mlp_activation)
    baseline = train_steps.RunConfig("baseline")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "MFU omitted" is said in the table's header instead
        # The optimised row's matmul dtype: MFU measures every row against what it could reach.
        matmul_dtype = matmul_dtype_name(get_policy(optimised.policy).compute_dtype)
        peak = resolve_peak_tflops(kind, matmul_dtype, args.peak_tflops)
    bench = Bench(args, workload, devices, peak)
    grad_sync, sync_times = choose_grad_sync(args, workload, optimised, devices)
    optimised = dataclasses.replace(optimised, grad_sync=grad_sync)
    budget = memory_budget(args, devices[0])
    optimised, runner, remat_trials, window = choose_remat(bench, optimised, budget)
    opt_row = bench.measure(optimised, runner=runner, peak_window=window)
    del runner
    # The baseline runs second and without remat or a half-precision state, so it is the row
    # that runs out of memory (gpt-1b at batch 8 on an 80 GB H100): that costs its row and
    # the ratios, never the optimised row measured minutes before.
    failed: list[dict] = []
    rows = [row for row in (_measure_or_note(bench, baseline, failed), opt_row) if row is not None]
    baseline_row = rows[0] if rows[0]["name"] == "baseline" else None
    skipped = []
    if args.ablate:
        runs, skipped = ablation_runs(baseline, optimised, workload, len(devices))
        rows += [row for row in (_measure_or_note(bench, run, failed) for run in runs) if row is not None]
    plain_failed = []
    if args.compare_plain:
        plain_rows, plain_failed = _plain_rows(bench, opt_row["attention_resolved"])
        rows += plain_rows
    train_report.add_ratios(rows, baseline_row)
    result = {
        "device_kind": kind, "platform": devices[0].platform, "num_devices": len(devices),
        "jax": jax.__version__, "model": args.model, "unit": workload.unit,
        "global_batch": workload.global_batch, "microbatches": workload.microbatches,
        "items_per_step": workload.items_per_step, "flops_per_step": workload.flops_per_step,
        "peak_tflops_per_device": peak,
        "mfu_denominator": None if peak is None else
        f"{peak:g} TFLOP/s x {len(devices)} device(s) ("
        + ("--peak-tflops" if args.peak_tflops else f"dense {matmul_dtype} peak of {kind}") + ")",
        "matmul_dtype": matmul_dtype,
        "grad_sync_collective": _grad_sync_collective(optimised, len(devices)),
        "dataset_items": bench.dataset_items, "gpu_hour_usd": args.gpu_hour_usd,
        "xla_flags": xla_report, "allocator_env": allocator_env(),
        "memory_budget_bytes": budget, "remat_trials": remat_trials,
        "grad_sync_ms": sync_times, "rows": rows, "ablations_skipped": skipped,
        "plain_failed": plain_failed, "rows_failed": failed,
        "args": {**vars(args), "defaulted": sorted(args.defaulted)},  # a set has no JSON form
    }
    if workload.is_gpt:
        cfg = workload.gpt_config()
        result["gpt"] = {"seq_len": cfg.seq_len, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                         "data": "embedded text corpus (byte ids)" if workload.text
                         else "uniform random ids"}
    else:
        result["vision"] = {"image_size": workload.image_side}
    if len(devices) > 1 and not args.no_scaling:
        try:  # one device holds what n shared (ZeRO): an OOM there costs this table only
            result["scaling"] = _scaling(bench, optimised, opt_row)
        except Exception as err:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED; reported in the text
            result["scaling_failed"] = _failure(err)
            print(f"[bench train] the 1-device scaling run failed: {result['scaling_failed']}",
                  file=sys.stderr, flush=True)
    # A comparison row can fail too (a large k stages k batches; a kernel may not build):
    # it costs its own row, listed in rows_failed, never the report of the rows above.
    if args.compare:
        runs = [dataclasses.replace(optimised, name=f"optimised k={k}", steps_per_dispatch=k)
                for k in args.compare]
        result["dispatch"] = [row for row in (_measure_or_note(bench, run, failed) for run in runs)
                              if row is not None]
        for row in result["dispatch"]:  # the ratio the table prints, kept in the JSON too
            row["steps_per_s_vs_first_k"] = row["steps_per_s"] / result["dispatch"][0]["steps_per_s"]
    if args.matmuls:
        runs = [dataclasses.replace(optimised, name=f"optimised, matmul={m}", matmul=m)
                for m in args.matmuls]
        result["matmul"] = [opt_row] + [row for row in (_measure_or_note(bench, run, failed)
                                                        for run in runs) if row is not None]
        for row in result["matmul"]:
            row["step_ms_vs_xla"] = row["step_ms"] / opt_row["step_ms"]
    return result


def _grad_sync_collective(optimised, num_devices: int) -> str:
    """The collective the optimised step's gradients actually go through."""
    if num_devices == 1:
        return "none (1 device)"
    if optimised.zero:
        return "reduce-scatter per leaf (ZeRO-1; --grad-sync applies under --zero 0)"
    return optimised.grad_sync


def _plain_rows(bench, attention: str) -> tuple[list[dict], list[dict]]:
    """The `--compare-plain` rows, and {name, reason} for each plain loop that failed.

    The plain loop has no remat and no accumulation, so on a model that needs them it
    can run out of memory: that costs its row, never the rows already measured."""
    from jaxopt_train.bench import _timing, plain, train_steps  # noqa: PLC0415

    workload, mesh = bench.workload, train_steps.data_mesh(bench.devices)
    device = bench.devices[0]
    rows, failed = [], []
    for variant in plain.VARIANTS:
        run = plain.plain_run(variant, attention)
        # The memory window opens before the runner holds its state, as for the other rows:
        # the XLA estimate already counts the state among the step's arguments.
        gc.collect()
        window = (_timing.peak_bytes_in_use(device), _timing.bytes_in_use(device))
        try:
            runner = plain.build_plain_runner(workload.gpt_config(), workload.global_batch, run, mesh,
                                              text=workload.text)
            rows.append(bench.measure(run, runner=runner, peak_window=window))
            del runner
        except Exception as err:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED; reported in the table
            reason = _failure(err)
            print(f"[bench train] {run.name} failed: {reason}", file=sys.stderr, flush=True)
            failed.append({"name": run.name, "reason": reason})
        gc.collect()
    return rows, failed


def _measure_or_note(bench, run, failed: list[dict]) -> dict | None:
    """`run`'s row, or None with {name, reason} appended to `failed` when it could not run
    (e.g. RESOURCE_EXHAUSTED); the reason is printed at once, before the next row starts."""
    try:
        return bench.measure(run)
    except Exception as err:  # noqa: BLE001 - reported in the table and the JSON
        reason = _failure(err)
        print(f"[bench train] {run.name} failed: {reason}", file=sys.stderr, flush=True)
        failed.append({"name": run.name, "reason": reason})
        gc.collect()  # the failed run's buffers, before the next row's memory window opens
        return None


def _failure(err: Exception) -> str:
    """An exception as one short line for the report."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def _scaling(bench, optimised, row_n) -> dict:
    n, workload = len(bench.devices), bench.workload
    one = dataclasses.replace(workload, global_batch=workload.global_batch // n)
    row_1 = bench.measure(dataclasses.replace(optimised, name="optimised, 1 device"),
                          workload=one, devices=bench.devices[:1])
    return {"num_devices": n, "global_batch": workload.global_batch,
            "one_device_global_batch": one.global_batch, "throughput": row_n["throughput"],
            "one_device_throughput": row_1["throughput"],
            "efficiency": row_n["throughput"] / (n * row_1["throughput"]), "one_device_row": row_1}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # XLA reads its flags once, when the backend starts: set them before any device use.
    xla_report = _set_xla_flags(args)
    start = time.perf_counter()
    result = run_bench(args, xla_report)
    result["bench_wall_s"] = time.perf_counter() - start
    from jaxopt_train.bench import train_report  # noqa: PLC0415

    text = train_report.render(result)
    print(text)
    train_report.write_outputs(args, result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
