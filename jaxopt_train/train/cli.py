"""`jaxopt-train train`: the command-line face of `train(TrainConfig(...))`.

With no arguments it trains gpt-tiny on the embedded corpus (the Python
standard library's sources) on every device there is. Bad flags and bad
values exit with status 2 and a message naming the flag and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

from jaxopt_train.train import config as config_lib
from jaxopt_train.train.config import TrainConfig
from jaxopt_train.train.optim import STATE_DTYPES

_DEFAULTS = TrainConfig()

# TrainConfig field -> flag spelling where they differ from `--field-name`.
_FIELD_FLAGS = {"steps_per_dispatch": "--steps-per-dispatch", "keep_checkpoints": "--keep-checkpoints",
                "model_overrides": "--model"}


def _bool_flag(parser, name: str, help_: str) -> None:
    parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction,
                        default=getattr(_DEFAULTS, name.replace("-", "_")), help=help_)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not state its default itself: a flag
    whose default is None says in words what it falls back to ("default: preset's")."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="jaxopt-train train",
        description="Train a GPT or vision preset data-parallel over all devices. With no "
                    "arguments: gpt-tiny on the embedded corpus (Python stdlib sources).",
        formatter_class=_DefaultsHelp, allow_abbrev=False)
    m = p.add_argument_group("model and data")
    m.add_argument("--preset", choices=config_lib.PRESETS, default=d.preset, help="model preset")
    m.add_argument("--data", default=None,
                   help="text file/folder, .bin token file (ids as --token-dtype), or .npz images "
                        "(default: embedded corpus for GPT, synthetic images for vision)")
    m.add_argument("--token-dtype", choices=config_lib.TOKEN_DTYPES, default=d.token_dtype,
                   help="width of the ids in a .bin token file (default %(default)s, nanoGPT's)")
    m.add_argument("--seq-len", type=int, default=None, help="GPT sequence length (default: preset's)")
    m.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a GPT config field, e.g. --model d_model=64 (repeatable)")
    m.add_argument("--num-classes", type=int, default=d.num_classes, help="vision classes")
    m.add_argument("--image-size", type=int, default=d.image_size, help="synthetic image side")
    m.add_argument("--attention", choices=config_lib.ATTENTIONS, default=d.attention)
    m.add_argument("--remat", choices=config_lib.REMATS + ("auto",), default=d.remat,
                   help="per-block rematerialisation policy (on the first k blocks only: "
                        "--model remat_layers=k, with --model remat_rest=POLICY on the others); "
                        "auto: the least recompute whose compiled step fits the GPU's memory "
                        "pool (e.g. under --memory-limit)")
    _bool_flag(m, "scan-layers", "scan over stacked GPT layers (faster compile, slower steps on GPU)")
    m.add_argument("--matmul", choices=config_lib.MATMULS, default=d.matmul,
                   help="dense-layer matmul of GPT presets: xla, or our Pallas (Mosaic GPU; "
                        "interpret mode on CPU: slow) / Triton kernels (need --precision bf16/fp16)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps")
    # A setting of this invocation, not of the run (not in config.json): the schedule still
    # spans --steps, so a later --resume continues the same run.
    o.add_argument("--until-step", type=int, default=None, metavar="STEP",
                   help="stop with a checkpoint at this step (a multiple of --steps-per-dispatch) "
                        "and leave the rest of --steps to a later --resume")
    o.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size")
    o.add_argument("--microbatches", type=int, default=d.microbatches,
                   help="micro-batches accumulated per optimizer step")
    o.add_argument("--precision", default=d.precision,
                   help=f"policy: one of {list(config_lib.PRECISIONS)} or 'p=f32,c=bf16,o=f32'")
    o.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    o.add_argument("--warmup", type=int, default=d.warmup,
                   help="linear warmup steps (cut to steps - 1 when longer; the run then says so)")
    o.add_argument("--weight-decay", type=float, default=d.weight_decay)
    o.add_argument("--clip-norm", type=float, default=d.clip_norm, help="0 disables clipping")
    o.add_argument("--seed", type=int, default=d.seed)
    o.add_argument("--max-nonfinite-steps", type=int, default=d.max_nonfinite_steps,
                   help="stop after this many consecutive non-finite steps")
    x = p.add_argument_group("parallelism and execution")
    x.add_argument("--grad-sync", choices=config_lib.GRAD_SYNCS, default=d.grad_sync)
    x.add_argument("--grad-compression", choices=config_lib.GRAD_COMPRESSIONS,
                   default=d.grad_compression)
    x.add_argument("--grad-dtype", choices=config_lib.GRAD_DTYPES, default=d.grad_dtype,
                   help="gradients in the params' dtype, or in the compute dtype (bf16: half "
                   "the gradient memory and all-reduce bytes; at --zero 3 also the param all-gathers)")
    x.add_argument("--opt-state-dtype", choices=STATE_DTYPES,
                   default=d.opt_state_dtype, help="storage dtype of AdamW's moments")
    x.add_argument("--zero", type=int, default=d.zero,
                   help="ZeRO stage: 0 replicated; 1 optimizer state sharded per leaf (each "
                   "gradient leaf reduce-scattered as soon as the backward makes it, overlapping "
                   "the rest of the backward); 3 parameters sharded per leaf too (FSDP-style: "
                   "each leaf all-gathered at the step's start, in the compute dtype under "
                   "--grad-dtype compute, overlapping the forward)")
    x.add_argument("--steps-per-dispatch", type=int, default=d.steps_per_dispatch,
                   help="optimizer steps per compiled call")
    x.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak TFLOP/s for MFU (default: table by device kind)")
    # A setting of this process, not of the run (not saved, like --memory-limit): a run may
    # resume on more or fewer devices.
    x.add_argument("--devices", type=int, default=None, metavar="N",
                   help="train data-parallel on the first N devices (default: all); one "
                        "process only (a multi-host job uses each process's visible devices)")
    r = p.add_argument_group("run directory, logging, checkpoints")
    r.add_argument("--run-dir", default=None, help="default: runs/<preset>-<date>-<time>")
    res = r.add_mutually_exclusive_group()
    res.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    res.add_argument("--overwrite", action="store_true",
                     help="delete an existing run in --run-dir and start over")
    r.add_argument("--log-every", type=int, default=d.log_every)
    r.add_argument("--eval-every", type=int, default=d.eval_every, help="0: only at the end")
    r.add_argument("--eval-batches", type=int, default=d.eval_batches)
    r.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="0: only at the end")
    r.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    _bool_flag(r, "tensorboard", "also write TensorBoard events to RUN_DIR/tb")
    r.add_argument("--prometheus-port", type=int, default=None,
                   help="serve metrics for Prometheus on this port (0: any free port)")
    r.add_argument("--profile-steps", default=None, metavar="START:STOP",
                   help="trace these steps with jax.profiler into RUN_DIR/profile")
    r.add_argument("--progress", choices=("auto", "bar", "lines"), default=d.progress)
    # A setting of this process, not of the run: not saved in config.json, so a resumed run on
    # a bigger or shared GPU is not bound by it.
    r.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="cap each GPU's memory pool at SIZE (e.g. 16GiB, or 0.5 for half the "
                        "GPU), reserved at start-up as one region, as on a GPU of that size "
                        "(runtime.limit_memory)")
    # Settings of this process too (not saved): which process of a multi-host job it is.
    h = p.add_argument_group(
        "multi-host (jax.distributed)",
        "start one process per host (or per GPU); every process gets the same flags but its "
        "own --process-id")
    h.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first; alone, JAX detects the job "
                        "(SLURM srun, Open MPI mpirun, ...)")
    h.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address; with --num-processes and --process-id (implies "
                        "--distributed)")
    h.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="how many processes the job has")
    h.add_argument("--process-id", type=int, default=None, metavar="I", help="0 .. N-1")
    h.add_argument("--distributed-timeout", type=int, default=300, metavar="SECONDS",
                   help="how long to wait for every process to join (default %(default)s)")
    return p


def _parse_overrides(parser, items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            parser.error(f"argument --model: {item!r} must look like FIELD=VALUE, e.g. d_model=64")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text  # strings such as remat=dots need no quotes
    return overrides


# argparse dest -> flag, for naming the flag in validation errors.
def _flag_for_field(field: str) -> str:
    return _FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def _given_fields(argv: list[str] | None) -> set[str]:
    """The TrainConfig fields whose flags appear in argv: argv parsed again with every
    default suppressed, so that only what the user typed is left."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv)))
    return {"model_overrides" if name == "model" else name for name in given}


def _resumed_values(parser, values: dict, given: set[str]) -> dict:
    """--resume: the run's own settings from RUN_DIR/config.json, with only the flags given
    on this command line changed (e.g. --steps to extend it), so that a resumed run keeps
    its data, precision, batch and seed. The changes are printed."""
    path = os.path.join(values["run_dir"], "config.json")
    if not os.path.isdir(values["run_dir"]):  # nothing to resume: the run dir check says so
        return values
    if not os.path.exists(path):
        print(f"jaxopt-train train: warning: {path} is missing, so the run's own settings are "
              "unknown; resuming with this command line's flags and defaults", file=sys.stderr)
        return values
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not isinstance(record, dict):  # a list said "list indices must be integers"
            raise TypeError(f"expected a JSON object with a 'config' key, got a "
                            f"{type(record).__name__}")
        saved = record["config"]
        if not isinstance(saved, dict):
            raise TypeError(f"expected an object under 'config', got {type(saved).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"--resume: cannot read the run's settings from {path} "
                     f"({type(err).__name__}: {err}); restore the file, or start a new --run-dir")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    merged = {k: v for k, v in saved.items() if k in fields}  # a newer version's extra keys
    _move_owned_overrides(merged, given)
    if "remat" in given and isinstance(merged.get("model_overrides"), dict):
        # The saved run's remat_layers / remat_rest (e.g. an auto search's) belong to its
        # remat: kept under another --remat, "full" ran on 13 of 16 blocks only. A --model
        # remat_layers=k on this line still applies (merged below).
        merged["model_overrides"] = {k: v for k, v in merged["model_overrides"].items()
                                     if k not in ("remat_layers", "remat_rest")}
    for name in given & fields:
        merged[name] = ({**merged.get(name, {}), **values[name]} if name == "model_overrides"
                        else values[name])
    merged.update(resume=True, overwrite=False, run_dir=values["run_dir"])
    changed = [f"{_flag_for_field(name)} {_shown(name, saved.get(name))} -> "
               f"{_shown(name, merged[name])}"
               for name in sorted(given & fields - {"resume", "run_dir"})
               if saved.get(name) != merged[name]]
    print(f"jaxopt-train train: resuming with the settings in {path}"
          + (f"; changed by this command line: {', '.join(changed)}" if changed else ""),
          file=sys.stderr)
    return merged


def _shown(name: str, value) -> str:
    """A setting's value as the resume line prints it: `--data None` meant the corpus."""
    return "(the embedded corpus)" if name == "data" and value is None else repr(value)


def _move_owned_overrides(saved: dict, given: set[str]) -> None:
    """A run saved before `--model remat=...` and the like were refused (config.OWNED_OVERRIDES)
    resumes: each such override moves to its own field, unless this command line sets that
    field (its flag then wins, as the override did not)."""
    if not isinstance(saved.get("model_overrides"), dict):
        return
    overrides = saved["model_overrides"] = dict(saved["model_overrides"])
    for key in [k for k in overrides if k in config_lib.OWNED_OVERRIDES and k in saved]:
        value = overrides.pop(key)
        if key not in given:
            saved[key] = value


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """Parses argv into a validated TrainConfig (exits 2 naming the flag on a bad value).

    With --resume (and --run-dir), the run's saved settings are the starting point and
    only the flags given here change them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = vars(args)
    values["model_overrides"] = _parse_overrides(parser, values.pop("model"))
    if values["run_dir"] == "":  # TrainConfig's "or None" is no flag value: None is leaving it out
        parser.error("--run-dir: expected a folder path, got ''; leave --run-dir out for the "
                     "default runs/<preset>-<date>-<time>")
    if values["data"]:  # as config.json records it (loop._write_config): a resume compares alike
        values["data"] = os.path.abspath(values["data"])
    resumed = values["resume"] and values["run_dir"] is not None
    given = _given_fields(argv) if resumed else set()  # argv parsed again: only a resume asks
    if resumed:
        values = _resumed_values(parser, values, given)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(**{k: v for k, v in values.items() if k in fields})
    except (TypeError, ValueError) as err:
        message = str(err)
        field = message.split("=", 1)[0].strip() if "=" in message else ""
        if resumed:
            # The values are the saved run's but for the flags given: "--precision:
            # precision=None" named a flag never passed, and a --preset that clashes with the
            # saved model was blamed on the saved model.
            saved = os.path.join(values["run_dir"], "config.json")
            named = [name for name in fields if re.search(rf"\b{name}=", message)]
            flagged = [name for name in named if name in given]
            if flagged:
                parser.error(f"{_flag_for_field(flagged[0])}: {message} (the other settings "
                             f"are the resumed run's, from {saved})")
            if field in fields:
                parser.error(f"--resume: the run's settings in {saved} hold {message}; restore "
                             "the file, pass the setting's flag, or start a new --run-dir")
        flag = _flag_for_field(field) if field in fields else "a flag"
        parser.error(f"{flag}: {message}")
    raise AssertionError("unreachable")  # parser.error exits


def apply_memory_limit(argv: list[str] | None = None) -> None:
    """--memory-limit in argv: the cap set before the backend starts, or exit 2 saying why not.

    Call it before anything that starts the backend (config_from_args may: e.g. --matmul
    triton looks for a GPU)."""
    value = build_parser().parse_args(argv).memory_limit
    if value is None:
        return
    from jaxopt_train.runtime.memory import limit_memory, parse_bytes  # noqa: PLC0415

    try:
        share = float(value)
    except ValueError:
        share = None  # a size such as 16GiB
    if share is not None and share <= 1:
        amount = {"fraction": share}
    else:
        try:  # here, so that the message names the flag, not limit_memory's bytes=
            amount = {"bytes": parse_bytes(value, name="--memory-limit")}
        except ValueError as err:
            build_parser().error(str(err))
    try:
        # Preallocated: a pool that grows on demand is made of regions, and no buffer spans
        # two of them, so a step whose temporaries fill most of the cap would not fit in it
        # (gpt-1b under 16 GiB: 8.6 GiB of temporaries refused with 8.85 GiB free).
        env = limit_memory(**amount, preallocate=True)
    except (RuntimeError, TypeError, ValueError) as err:
        hint = (" (Here: a share of the GPU's memory, e.g. --memory-limit 0.5 for half.)"
                if "bytes" in amount and "NVML" in str(err) else "")
        build_parser().error(f"--memory-limit {value}: {err}{hint}")
    print(f"jaxopt-train train: GPU memory capped at {value}: "
          + " ".join(f"{k}={v}" for k, v in sorted(env.items())) + _no_gpu_note(), file=sys.stderr)


def _no_gpu_note() -> str:
    """Said after the cap where NVML sees no NVIDIA GPU: XLA's CPU client takes no pool cap."""
    from jaxopt_train.runtime.nvml import nvml_session, try_call  # noqa: PLC0415

    with nvml_session() as (nvml, _):
        if nvml is not None and (try_call(nvml.nvmlDeviceGetCount, default=0) or 0) > 0:
            return ""
    return " (no NVIDIA GPU found: the cap has no effect on this machine)"


def selected_devices(argv: list[str] | None = None) -> list | None:
    """--devices N in argv: the first N devices (None without the flag: the trainer takes all),
    or exit 2 saying why not. Starts the backend: call it after apply_distributed."""
    parser = build_parser()
    count = parser.parse_args(argv).devices
    if count is None:
        return None
    if count < 1:
        parser.error(f"--devices {count}: expected a count >= 1")
    import jax  # noqa: PLC0415

    if jax.process_count() > 1:
        # jax.devices() is the whole job's: its first N could all be another host's.
        parser.error(f"--devices {count}: picks devices within one process, but this job has "
                     f"{jax.process_count()} processes; each trains on the devices it sees "
                     "(choose them per process with CUDA_VISIBLE_DEVICES)")
    visible = jax.devices()
    if count > len(visible):
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={count} before "
                "the command emulates more" if jax.default_backend() == "cpu" else "")
        parser.error(f"--devices {count}: only {len(visible)} {jax.default_backend()} "
                     f"device(s) are visible{hint}")
    return visible[:count]


def refuse_unusable_peer_sync(parser: argparse.ArgumentParser, devices: list) -> None:
    """Exits 2 (`parser.error`) unless `--grad-sync peer` can run on `devices`: exactly two
    Hopper GPUs driven by this process. Before the run folder or the model is built; shared
    with `bench train`, whose flags are the same."""
    from jaxopt_train.collectives.peer import check_platform  # noqa: PLC0415

    try:
        check_platform(instead="--grad-sync ring or psum")
    except (ValueError, NotImplementedError) as err:
        parser.error(f"--grad-sync peer: {err}")
    if len(devices) != 2:
        parser.error(f"--grad-sync peer exchanges between exactly 2 devices; this run has "
                     f"{len(devices)} (pass --devices 2, or another --grad-sync)")


def apply_distributed(argv: list[str] | None = None) -> None:
    """--distributed (or --coordinator, --num-processes and --process-id) in argv: joins the
    job with jax.distributed.initialize() before the backend starts, or exits 2 saying why
    not. Call it before anything that starts the backend, after apply_memory_limit."""
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
                "--process-id": args.process_id}
    given = [flag for flag, value in explicit.items() if value is not None]
    if not given and not args.distributed:
        return
    if given and len(given) < len(explicit):
        missing = [flag for flag in explicit if flag not in given]
        parser.error(f"{', '.join(given)} given without {', '.join(missing)}: give all three, or "
                     "none with --distributed (JAX then detects the job: SLURM, Open MPI)")
    kwargs: dict = {"initialization_timeout": args.distributed_timeout}
    if args.distributed_timeout < 1:
        parser.error(f"--distributed-timeout {args.distributed_timeout}: expected seconds >= 1")
    if given:
        host, sep, port = args.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--coordinator {args.coordinator}: expected HOST:PORT, e.g. "
                         "10.0.0.1:1234")
        if args.num_processes < 1:
            parser.error(f"--num-processes {args.num_processes}: expected a count >= 1")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(f"--process-id {args.process_id}: expected 0 .. {args.num_processes - 1} "
                         f"(--num-processes {args.num_processes})")
        kwargs.update(coordinator_address=args.coordinator, num_processes=args.num_processes,
                      process_id=args.process_id)
    import jax  # noqa: PLC0415

    # Said before joining: a process that never joins makes JAX abort this one (SIGABRT, exit
    # 134) from C++ with a stack trace and not a word of ours.
    job = (f"as process {args.process_id} of {args.num_processes} via {args.coordinator}" if given
           else "that JAX detects (SLURM, Open MPI)")
    print(f"jaxopt-train train: joining the job {job}; waiting up to {args.distributed_timeout} s "
          "for every process (if one never joins, JAX aborts this process)",
          file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as err:  # no job detected, started backend, bad address
        hint = ("" if given else "; no SLURM or Open MPI job was detected: pass --coordinator, "
                "--num-processes and --process-id")
        parser.error(f"--distributed: jax.distributed.initialize() failed: {err}{hint}")
    print(f"jaxopt-train train: process {jax.process_index()} of {jax.process_count()} "
          "(jax.distributed)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `jaxopt-train train`; returns the exit status."""
    apply_memory_limit(argv)
    apply_distributed(argv)
    cfg = config_from_args(argv)
    devices = selected_devices(argv)
    import jax  # noqa: PLC0415

    # The backend starts here, before train() makes the run folder: XLA aborts the process
    # on an unknown flag in XLA_FLAGS, which left an empty run folder behind.
    visible = jax.devices()
    if cfg.grad_sync == "peer":  # the collective's own error named method='ring', no flag
        refuse_unusable_peer_sync(build_parser(), devices or visible)
    from jaxopt_train.train.checkpoint import RunDirError  # noqa: PLC0415
    from jaxopt_train.train.loop import NonFiniteError, train  # noqa: PLC0415

    until_step = build_parser().parse_args(argv).until_step
    if until_step is not None and (until_step < 1 or until_step % cfg.steps_per_dispatch):
        build_parser().error(f"--until-step {until_step}: expected a positive multiple of "
                             f"--steps-per-dispatch ({cfg.steps_per_dispatch})")
    if until_step is not None and until_step > cfg.steps:  # it was dropped without a word
        print(f"jaxopt-train train: note: --until-step {until_step} is past --steps {cfg.steps}; "
              f"the run ends at step {cfg.steps}", file=sys.stderr)
    try:
        result = train(cfg, until_step=until_step, devices=devices)
    except RunDirError as err:
        print(f"jaxopt-train train: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"jaxopt-train train: error: {err}", file=sys.stderr)
        return 2
    except (IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError) as err:
        # A path in the way or not writable is the user's to fix: one line, not a traceback.
        print(f"jaxopt-train train: error: {_os_error_line(err)}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"jaxopt-train train: {err}", file=sys.stderr)
        return 1
    if result.already_complete:  # train() said so (nothing to do): not "done", as if it trained
        return 0
    summary = f"done: {result.step} steps in {result.run_dir}"
    if result.eval_loss is not None:
        summary += f"; eval loss {result.eval_loss:.4f}"
    if result.step < cfg.steps and not result.interrupted:  # --until-step
        summary = (f"stopped at step {result.step} of {cfg.steps} (--until-step); checkpoint saved "
                   f"in {result.run_dir}; continue with --resume --run-dir {result.run_dir}")
    if result.interrupted:
        summary = f"interrupted at step {result.step}; checkpoint saved in {result.run_dir}"
    print(summary, flush=True)
    return 0


def _os_error_line(err: OSError) -> str:
    """A file-system error in one line: the path, the OS's reason and what was expected."""
    if err.filename is None:
        return str(err)
    hint = {IsADirectoryError: "a file was expected there, found a folder",
            NotADirectoryError: "a folder was expected there (or on the way to it), found a file",
            FileExistsError: "something is already there",
            PermissionError: "this user lacks the permission there"}.get(type(err), "")
    return f"cannot use {err.filename!r}: {err.strerror or err}" + (f" ({hint})" if hint else "")


if __name__ == "__main__":
    raise SystemExit(main())
