"""`train(config)`: the training loop around `Trainer`.

The loop owns what a long run needs: the run directory (config.json,
metrics.jsonl, checkpoints), resume, evaluation, metrics every `log_every`
steps, checkpoints every `checkpoint_every`, SIGTERM/SIGINT (save and exit
cleanly; on several processes at one agreed step: `stop.py`), and the
non-finite guard. The device is only synchronised at log,
eval and checkpoint points, so steps dispatch back to back in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import signal
import sys
import time
from typing import Any, TextIO

import jax
import numpy as np

from jaxopt_train._replace import replace_text
from jaxopt_train.precision import get_policy
import jaxopt_train.train.mfu as mfu_lib
from jaxopt_train.train.checkpoint import (Checkpointer, RunDirError, clear_run_dir,
                                           prepare_run_dir)
from jaxopt_train.train import resume
from jaxopt_train.runtime.collector import frozen_collector
from jaxopt_train.train.config import TrainConfig, shape_overrides
from jaxopt_train.train.metrics import MetricsLogger, open_prometheus_sink, peak_memory_bytes
from jaxopt_train.train.remat_search import build_fitting_run
from jaxopt_train.train.state import param_count
from jaxopt_train.train.stop import StopAgreement, StopSignal
from jaxopt_train.train.task import Task, build_task
from jaxopt_train.train.trainer import Trainer, build_optimizer


class NonFiniteError(RuntimeError):
    """Training stopped after too many consecutive non-finite steps."""


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    step: int                       # steps completed
    final_loss: float | None        # mean train loss of the last log interval
    eval_loss: float | None         # last evaluation
    interrupted: bool               # stopped by SIGTERM/SIGINT (checkpoint saved)
    trainer: Trainer
    # A resume whose checkpoint was already at the last step asked for: nothing was
    # compiled, trained or written; `trainer` holds the checkpoint's state.
    already_complete: bool = False


def _default_run_dir(cfg: TrainConfig) -> str:
    """runs/<preset>-<date>-<time> (UTC), claimed by creating it: a second run started in the
    same second gets a `-2` suffix instead of writing into the first one's directory. UTC,
    not local time: the processes of one job share the stamp, and hosts in different time
    zones formatted it into different directories."""
    stamp = int(time.time())
    if jax.process_count() > 1:  # every process must agree on the directory
        from jax.experimental import multihost_utils  # noqa: PLC0415

        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    base = os.path.join("runs", f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(stamp))}")
    if jax.process_count() > 1:  # the processes of one job share the directory
        return base
    for n in itertools.count(1):
        candidate = base if n == 1 else f"{base}-{n}"
        try:
            os.makedirs(candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as err:  # ./runs a file, or not writable: refused as a bad --run-dir is
            raise RunDirError(
                f"cannot create the default run directory {candidate!r}: {err.strerror or err}; "
                f"expected {os.path.abspath('runs')!r} to be a writable folder (or missing): "
                "move what is there, or pass --run-dir") from err
    raise AssertionError("unreachable")


def _write_config(run_dir: str, cfg: TrainConfig, task: Task) -> None:
    """run_dir/config.json, replaced whole (a crash mid-write leaves the old file)."""
    if jax.process_index() != 0:
        return
    config = cfg.to_dict()
    if isinstance(config["data"], str) and config["data"]:
        # A relative path is the writer's working directory's: `--resume --run-dir /abs/run`
        # from another folder read it as another file, or as none.
        config["data"] = os.path.abspath(config["data"])
    record = {"config": config, "model_shape": cfg.model_shape(task.classes),
              "task": task.description}
    replace_text(os.path.join(run_dir, "config.json"),
                 json.dumps(record, indent=2, sort_keys=True, default=str))


# What the run writes where a flag says, and whether it is a folder there: found in the way
# (a file where the trace goes), it must stop the run before the run dir is touched.
_OUTPUT_PATHS = {"metrics.jsonl": ("metrics", False), "config.json": ("settings", False),
                 "tb": ("TensorBoard events (--tensorboard)", True),
                 "profile": ("profiler trace (--profile-steps)", True)}


@dataclasses.dataclass
class _FlagOutputs:
    """The outputs that flags ask for, opened before anything is written or deleted in the
    run directory (`train`).

    A busy --prometheus-port or a RUN_DIR/profile that is a file used to fail after
    --overwrite had deleted the old run, or after a new run had written config.json, an
    empty metrics.jsonl and checkpoints/, which a rerun then refused as a run.
    """
    prometheus: Any = None  # a bound runtime.sinks.PrometheusSink (process 0 only)
    profiler: Any = None    # a runtime.profiling.StepProfiler: writes nothing before START

    def close(self) -> None:
        """Frees the port; a no-op once the logger that was handed the sink closed it."""
        if self.prometheus is not None:
            self.prometheus.close()


def _open_flag_outputs(cfg: TrainConfig, run_dir: str) -> _FlagOutputs:
    """Checks the paths the run will write and binds the Prometheus port, writing nothing.

    Raises:
      RunDirError: a path the run writes is in the way (`_check_output_paths`).
      ValueError: the Prometheus port cannot be bound (in use, privileged).
    """
    _check_output_paths(cfg, run_dir)
    outputs = _FlagOutputs(profiler=_make_profiler(cfg, run_dir))
    if cfg.prometheus_port is not None and jax.process_index() == 0:  # as MetricsLogger
        outputs.prometheus = open_prometheus_sink(cfg.prometheus_port)
    return outputs


def _check_output_paths(cfg: TrainConfig, run_dir: str) -> None:
    """Refuses a file where the run writes a folder, or the reverse: found only when the
    run opened it, after the old run's deletion. --overwrite clears what a run wrote
    (`RUN_FILES` of their kind), so only a path of the other kind is in the way then."""
    used = {"metrics.jsonl": True, "config.json": True, "tb": cfg.tensorboard,
            "profile": cfg.profile_steps is not None}
    for name, (what, folder) in _OUTPUT_PATHS.items():
        path = os.path.join(run_dir, name)
        if not used[name] or not os.path.exists(path) or os.path.isdir(path) == folder:
            continue
        found, expected = ("a file", "a folder") if folder else ("a folder", "a file")
        raise RunDirError(f"{path!r} is {found}, but the run writes its {what} there as "
                          f"{expected}; move it away, or use another --run-dir")


def dispatch_batch(task: Task, step: int, steps_per_dispatch: int) -> dict[str, np.ndarray]:
    """The host batch of one dispatch from `step`: [B, ...], or [k, B, ...] stacked for k > 1."""
    if steps_per_dispatch == 1:
        return task.train_batch(step)
    batches = [task.train_batch(step + i) for i in range(steps_per_dispatch)]
    return {key: np.stack([b[key] for b in batches]) for key in batches[0]}


def _check_same_data(task: Task, step: int) -> None:
    """Raises ValueError on every process when the processes of a job build different
    global batches at `step` (another --data file, its contents, or --seed on one host).

    Each process builds the whole global batch and puts its own rows on its devices, so
    such a job trained without an error on rows no single data set holds. A digest of the
    batch is gathered from every process, so all of them stop, not only the odd one out
    (which would leave the others waiting in the first all-reduce)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils  # noqa: PLC0415

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(task.train_batch(step)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    digests = np.asarray(multihost_utils.process_allgather(
        np.frombuffer(digest.digest(), np.uint8)))
    differ = [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]
    if differ:
        raise ValueError(
            f"process(es) {differ} built another batch {step} than process 0: every process "
            "must read the same data (the same --data file and contents, the same "
            "--token-dtype) with the same --seed")


def _evaluate(trainer: Trainer, task: Task, batches: int) -> float:
    """Mean loss over `batches` eval batches (equal sizes, so the mean of their means).

    `Trainer.evaluate` runs each in the train step's micro-batches: the whole global batch
    in one forward pass needed 2.5x the train step's temporaries at 8 micro-batches (GPT,
    vocab 16k), and only the train step is checked against the memory pool, so a run
    fitted with --microbatches failed at its first evaluation.
    """
    return float(np.mean([trainer.evaluate(task.eval_batch(i)) for i in range(batches)]))


class _Interval:
    """Accumulates per-step metrics between two log points."""

    def __init__(self):
        self.start: float | None = None
        self.steps = 0
        self.metrics: list[dict[str, jax.Array]] = []

    def begin(self):
        # Timing starts at the interval's first dispatch: evaluation and
        # checkpointing after the previous log point are not step time.
        if self.start is None:
            self.start = time.perf_counter()

    def add(self, metrics, steps: int):
        self.metrics.append(metrics)
        self.steps += steps

    def summary(self) -> tuple[dict[str, np.ndarray], float]:
        """(metrics per step, seconds per step); waits for the interval's last step."""
        host = jax.device_get(self.metrics)  # the one sync of the interval
        step_time = (time.perf_counter() - self.start) / self.steps
        return {k: np.concatenate([np.atleast_1d(m[k]) for m in host]) for k in host[0]}, step_time


def train(config: TrainConfig, *, until_step: int | None = None, devices=None,
          stream: TextIO | None = None) -> TrainResult:
    """Trains `config` and returns a `TrainResult`.

    Args:
      config: the run.
      until_step: stop (with a checkpoint) at this step instead of `config.steps`;
        the schedule still spans `config.steps`, so `--resume` later continues
        the same run (used to test resume equivalence).
      devices: devices of the data mesh (default: all).
      stream: where metric lines go (default stdout).

    Raises:
      RunDirError: the run directory conflicts with resume/overwrite or the model shape.
      NonFiniteError: `max_nonfinite_steps` consecutive non-finite steps.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    cfg = config
    k = cfg.steps_per_dispatch
    if until_step is not None and (isinstance(until_step, bool) or not isinstance(until_step, int)
                                   or until_step < 1 or until_step % k):
        raise ValueError(f"until_step={until_step!r} must be a positive multiple of "
                         f"steps_per_dispatch={k}")
    target = cfg.steps if until_step is None else min(until_step, cfg.steps)
    created = cfg.run_dir is None or not os.path.exists(cfg.run_dir)
    run_dir = cfg.run_dir or _default_run_dir(cfg)
    ckpt = outputs = None
    try:
        prepare_run_dir(run_dir, resume=cfg.resume, overwrite=cfg.overwrite)
        if cfg.resume:  # before building anything: a mismatch fails in milliseconds
            ckpt = Checkpointer(run_dir, keep=cfg.keep_checkpoints)
            resume.check_resume_shape(run_dir, cfg, ckpt)
            resume.check_resume_data_order(run_dir, cfg, ckpt)
            resume.check_dispatch_alignment(ckpt.latest_step(), k, ckpt.directory)
            resume.check_steps_left(ckpt.latest_step(), target, cfg.steps, ckpt.directory)
            if ckpt.latest_step() == target:
                return _already_complete(cfg, ckpt, run_dir, target, devices, stream)
        outputs = _open_flag_outputs(cfg, run_dir)  # as fast, and before anything is written
        cfg, task, trainer, _ = build_fitting_run(cfg, devices)  # resolves remat="auto"
        _check_same_data(task, 0)
        if cfg.resume:  # the classifier's width is known once the data is read
            resume.check_resume_shape(run_dir, cfg, ckpt, classes=task.classes)
        if not cfg.resume and not trainer.compiled:
            # Before the run dir is touched: a step that cannot compile (too large for the
            # device, --grad-sync peer on other than 2 GPUs) must cost an --overwrite's old
            # run nothing and leave no half-made run. (A resume compiles its restored state.)
            trainer.compile(dispatch_batch(task, 0, k))
        if cfg.overwrite:  # only now: a bad flag above has cost the old run nothing
            clear_run_dir(run_dir)
            if jax.process_count() > 1:  # no process writes before process 0 has cleared
                from jax.experimental import multihost_utils  # noqa: PLC0415

                multihost_utils.sync_global_devices("jaxopt_train.clear_run_dir")
        if ckpt is None:
            ckpt = Checkpointer(run_dir, keep=cfg.keep_checkpoints)
        if cfg.resume:
            trainer.state = resume.restore(ckpt, trainer.state)
        else:  # a resume's settings are written with its first checkpoint (_run)
            _write_config(run_dir, cfg, task)
        return _run(cfg, task, trainer, ckpt, run_dir, target, stream, outputs)
    except BaseException:
        if created:  # a run refused before it wrote anything leaves no empty folder behind
            with contextlib.suppress(OSError):
                os.rmdir(run_dir)  # only if empty
        raise
    finally:
        if outputs is not None:  # a port bound for a run that never started is freed
            outputs.close()
        if ckpt is not None:
            ckpt.close()


def build_run(cfg: TrainConfig, devices=None) -> tuple[Task, Trainer]:
    """The task (model and data) and the Trainer of `cfg`, as `train` runs them
    (`remat="auto"` is resolved first: `remat_search.build_fitting_run`)."""
    if cfg.remat == "auto":
        raise ValueError("build_run() takes a fixed remat; remat='auto' is chosen by "
                         "jaxopt_train.train.remat_search.build_fitting_run(cfg)")
    policy = get_policy(cfg.precision)
    task = build_task(cfg, policy)
    optimizer, zero_clip_norm = build_optimizer(
        cfg.zero, cfg.opt_state_dtype, clip_norm=cfg.clip_norm, lr=cfg.lr,
        total_steps=cfg.steps, warmup=cfg.warmup, weight_decay=cfg.weight_decay)
    # The task's model was built for this run alone: the state takes its arrays
    # (no second copy of the model on the device), and the task keeps only shapes.
    trainer = Trainer.from_model_fns(
        task.fns, optimizer, policy, microbatches=cfg.microbatches, grad_sync=cfg.grad_sync,
        grad_compression=cfg.grad_compression, steps_per_dispatch=cfg.steps_per_dispatch,
        zero=cfg.zero, grad_dtype=cfg.grad_dtype, zero_clip_norm=zero_clip_norm, devices=devices,
        owns_params=True)
    return dataclasses.replace(task, fns=trainer.fns), trainer


def _already_complete(cfg: TrainConfig, ckpt: Checkpointer, run_dir: str, target: int, devices,
                      stream: TextIO | None) -> TrainResult:
    """A resume whose checkpoint is at `target`: says so and returns the checkpoint's state,
    as a finished run returns its own, with no step compiled and nothing written (no
    metrics line, config.json or checkpoint). It used to compile the step (minutes for a
    large model) to train nothing, then report "done"."""
    if cfg.remat == "auto":  # no step to fit: the search would compile candidates for nothing
        cfg = dataclasses.replace(cfg, remat="none",
                                  model_overrides=shape_overrides(cfg.model_overrides))
    task, trainer = build_run(cfg, devices)
    resume.check_resume_shape(run_dir, cfg, ckpt, classes=task.classes)
    trainer.state = resume.restore(ckpt, trainer.state)
    if jax.process_index() == 0:
        print(f"run_dir {run_dir}: {resume.nothing_left(target, cfg.steps)}",
              file=stream or sys.stdout, flush=True)
    return TrainResult(run_dir=run_dir, step=target, final_loss=None, eval_loss=None,
                       interrupted=False, trainer=trainer, already_complete=True)


def _run(cfg: TrainConfig, task: Task, trainer: Trainer, ckpt: Checkpointer, run_dir: str,
         target: int, stream: TextIO | None, outputs: _FlagOutputs) -> TrainResult:
    k = cfg.steps_per_dispatch
    step = int(trainer.state.step)
    meta = {"model_shape": json.loads(json.dumps(cfg.model_shape(task.classes))),
            "preset": cfg.preset, "data_order": resume.data_order(cfg, task.data_size)}
    # The Prometheus sink was bound before the run dir was touched (_open_flag_outputs).
    logger = MetricsLogger(run_dir, total_steps=target, start_step=step,
                           tensorboard=cfg.tensorboard, prometheus_sink=outputs.prometheus,
                           progress=cfg.progress, stream=stream)
    if cfg.resume:
        note = resume.data_size_change(ckpt, task.data_size, task.unit)
        if note:
            logger.message(note)
    device = jax.devices()[0]
    peak = mfu_lib.resolve_peak_tflops(
        device.device_kind, mfu_lib.matmul_dtype_name(trainer.policy.compute_dtype,
                                                      trainer.policy.matmul_precision),
        cfg.peak_tflops)
    # The state's own params, not trainer.params: that is a copy (gpt-1b: 4 GiB more, in the peak).
    logger.message(f"run_dir {run_dir}: {task.description}; {param_count(trainer.state.params):,} params; "
                   f"{trainer.num_devices} x {device.device_kind}; precision {cfg.precision}; "
                   f"global batch {cfg.batch_size} x {cfg.microbatches} micro-batch(es)"
                   + (f"; resuming at step {step}" if cfg.resume else ""))
    note = warmup_note(cfg)
    if note:
        logger.message(note)
    try:
        if not trainer.compiled:  # remat="auto" compiled it while choosing
            trainer.compile(dispatch_batch(task, step, k))
    except BaseException:  # e.g. StepTooLargeError: the logger's files and port are released
        logger.close()
        raise
    logger.message(f"compiled train step in {trainer.compile_seconds:.1f} s; {trainer.memory_report}")
    monitor = _start_monitor()
    profiler = outputs.profiler
    last_loss = eval_loss = None
    interrupted = False
    config_written = not cfg.resume  # a resume's settings go to config.json with its first save

    def save():
        """A checkpoint at `step` (a no-op if saved already); then, on a resume's first save,
        config.json. Only then: a resume that dies before its first checkpoint must leave
        the settings of the checkpoints on disk, not its own."""
        nonlocal config_written
        if int(trainer.state.nonfinite_streak) >= cfg.max_nonfinite_steps:
            # The run stops at this step (_log raises): its state is the failing streak's, and
            # saving it could push the last good checkpoint out of keep_checkpoints.
            return
        ckpt.save(step, trainer.state, meta)
        if not config_written:
            ckpt.wait()  # once per resume: the checkpoint is on disk before the settings change
            _write_config(run_dir, cfg, task)
            config_written = True

    try:
        # After compiling: the collector skips the compiled step's objects (runtime/collector.py).
        with StopSignal() as stop, frozen_collector():
            agreement = StopAgreement(list(trainer.mesh.devices.flat))
            interval = _Interval()
            while step < target:
                if profiler is not None:
                    profiler.step(step, trainer.state.step)
                batch = dispatch_batch(task, step, k)
                interval.begin()
                interval.add(trainer.step(batch), k)
                step += k
                logger.advance(k)
                # One process's signal stops every process, at the same step (stop.py).
                stopping = agreement.update(stop.received)
                finished = step >= target
                if stopping:  # the checkpoint first: a second signal or SIGKILL may follow soon
                    check_streak(cfg, trainer, step)
                    save()
                evaluate = not stopping and (finished or (cfg.eval_every and step % cfg.eval_every == 0))
                checkpoint = finished or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                if finished or stopping or step % cfg.log_every == 0 or evaluate:
                    summary = interval.summary()  # the step time, before the save's copy
                    if checkpoint:  # before the eval: an eval that fails keeps these steps
                        save()
                    if evaluate:
                        eval_loss = _evaluate(trainer, task, cfg.eval_batches)
                    last_loss = _log(cfg, task, trainer, logger, summary, step, peak,
                                     eval_loss if evaluate else None, monitor)
                    interval = _Interval()
                if checkpoint:
                    check_streak(cfg, trainer, step)  # between log lines too: not past the limit
                    save()  # a no-op if saved above
                # One process acts on a signal that came during the log or the eval at once;
                # several act only on what they agreed after the dispatch.
                stopping = stopping or (agreement.local_only and stop.received is not None)
                if stopping:
                    check_streak(cfg, trainer, step)
                    save()  # a no-op if saved above
                    interrupted = True
                    name = signal.Signals(agreement.signal or stop.received).name
                    logger.message(f"{name} received: saved a checkpoint at step {step} in "
                                   f"{ckpt.directory}; continue with --resume --run-dir {run_dir}")
                    break
    finally:
        # Each release runs even if the one before it raises: a profiler that fails to
        # close must not leave the monitor's thread running or the metrics files open.
        try:
            if profiler is not None:
                profiler.close(trainer.state.step)
        finally:
            try:
                if monitor is not None:
                    monitor.stop()
            finally:
                logger.close()
    return TrainResult(run_dir=run_dir, step=step, final_loss=last_loss, eval_loss=eval_loss,
                       interrupted=interrupted, trainer=trainer)


def _log(cfg: TrainConfig, task: Task, trainer: Trainer, logger: MetricsLogger,
         summary: tuple[dict[str, np.ndarray], float], step: int, peak: float | None,
         eval_loss: float | None, monitor) -> float:
    summary, step_time = summary
    examples_per_s = cfg.batch_size / step_time
    metrics: dict[str, Any] = {"loss": float(np.mean(summary["loss"]))}
    if eval_loss is not None:
        metrics["eval_loss"] = eval_loss
    metrics[f"{task.unit}_per_s"] = examples_per_s * task.units_per_example
    metrics["step_time_s"] = step_time
    utilisation = mfu_lib.mfu(task.flops_per_example * cfg.batch_size, step_time, peak,
                              trainer.num_devices)
    if utilisation is not None and np.isfinite(utilisation):
        metrics["mfu"] = utilisation
    memory = peak_memory_bytes()
    if memory is not None:
        metrics["peak_memory_gib"] = memory / 1024**3
    metrics["grad_norm"] = float(summary["grad_norm"][-1])
    metrics["loss_scale"] = float(summary["loss_scale"][-1])
    metrics["skipped_steps"] = int(trainer.state.loss_scale.skipped_steps)
    # The rate of the interval's last update: a skipped (non-finite) step leaves the optimizer's
    # count, and so its schedule, where it was, so that count is now step - skipped_steps.
    metrics["lr"] = _current_lr(cfg, max(step - metrics["skipped_steps"] - 1, 0))
    if monitor is not None:
        metrics.update(monitor.latest())
    logger.log(step, metrics)
    check_streak(cfg, trainer, step)
    return metrics["loss"]


def check_streak(cfg: TrainConfig, trainer: Trainer, step: int) -> None:
    """Raises NonFiniteError once `max_nonfinite_steps` consecutive steps were non-finite.

    Checked wherever the loop reads the device anyway (a log line, a checkpoint, a signal's
    save): a checkpoint step between log lines used to skip its save without a word and
    run on past the limit."""
    streak = int(trainer.state.nonfinite_streak)
    if streak >= cfg.max_nonfinite_steps:
        # fp16's loss scale already halves itself after each such step: the advice to use a
        # loss scaler was given to runs that had one. bf16 and fp32 share one range.
        fp16 = np.dtype(trainer.policy.compute_dtype) == np.float16
        other = ("or a precision with more range than fp16 (bf16, fp32)" if fp16 else
                 "or look for inputs or labels that make the loss overflow")
        raise NonFiniteError(
            f"stopping at step {step}: {streak} consecutive steps had non-finite gradients "
            f"(max_nonfinite_steps={cfg.max_nonfinite_steps}); params were left unchanged on those "
            "steps and no checkpoint was written once the streak reached that limit. Lower --lr, "
            f"clip harder (a lower --clip-norm; 0 turns clipping off), {other}.")


def warmup_note(cfg: TrainConfig) -> str | None:
    """What the run says when `default_optimizer` cuts its warmup to `steps - 1`, else None.

    Not an error: the default warmup (20) is longer than a short smoke run, and
    refusing it would refuse every one. But such a run never decays its lr.
    """
    if cfg.warmup < cfg.steps or cfg.steps == 1:
        return None
    return (f"note: warmup={cfg.warmup} >= steps={cfg.steps}, so the lr warms up over {cfg.steps - 1} "
            f"step(s) and the run ends at its peak {cfg.lr:g} with no cosine decay; pass a "
            f"warmup below {cfg.steps} (--warmup) for one")


def _current_lr(cfg: TrainConfig, step: int) -> float:
    """`default_optimizer`'s warmup-cosine schedule at `step`, in plain Python.

    (Evaluating the optax schedule eagerly costs a dozen device dispatches per
    log line; tests/test_train.py checks this equals it.)
    """
    warmup = min(cfg.warmup, cfg.steps - 1) if cfg.steps > 1 else 0
    end = cfg.lr / 10
    if step < warmup:
        return cfg.lr * step / warmup
    decay = max(cfg.steps - warmup, 1)
    progress = min(step - warmup, decay) / decay
    return end + (cfg.lr - end) * 0.5 * (1 + math.cos(math.pi * progress))


def _start_monitor():
    if jax.default_backend() != "gpu":
        return None
    try:
        from jaxopt_train.runtime.monitor import GPUMonitor  # noqa: PLC0415
    except ImportError:
        return None
    monitor = GPUMonitor(interval_s=1.0)
    monitor.start()
    return monitor if monitor.enabled else None


def _make_profiler(cfg: TrainConfig, run_dir: str):
    if cfg.profile_steps is None:
        return None
    from jaxopt_train.runtime.profiling import StepProfiler  # noqa: PLC0415

    # One folder per process: the processes of a job share the run directory, and their
    # traces would land in the same one.
    folder = os.path.join(run_dir, "profile")
    if jax.process_count() > 1:
        folder = os.path.join(folder, f"process{jax.process_index()}")
    return StepProfiler(cfg.profile_steps, folder, steps_per_dispatch=cfg.steps_per_dispatch)


__all__ = ["NonFiniteError", "RunDirError", "TrainResult", "train"]
