"""`Trainer`: train your own Flax model data-parallel under a precision policy.

    from flax import nnx
    import jaxopt_train.train as jt

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 1, rngs=rngs)
        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    trainer = jt.Trainer(MLP(nnx.Rngs(0)), loss_fn, precision="bf16", lr=1e-2, total_steps=100)
    for step in range(100):
        metrics = trainer.step({"x": x[step], "y": y[step]})   # numpy global batch
    model = trainer.model                                       # the trained nnx.Module

Linen: `Trainer(module, loss_fn, init_args=(example_x,))` with
`loss_fn(apply, batch)` where `apply(*args, **kw)` calls `module.apply`.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import check_divisible, check_weight_fn
from jaxopt_train.precision import Policy, check_trainable, get_policy, loss_scale_for
from jaxopt_train.runtime.memory import fits
from jaxopt_train.train import config as config_lib
from jaxopt_train.train.checkpoint import as_abstract
from jaxopt_train.train.model import ModelFns, linen_model_fns, nnx_model_fns
from jaxopt_train.train.optim import low_precision_state
from jaxopt_train.train.state import (TrainState, clip_by_global_norm_f32, default_optimizer,
                                      init_train_state)
from jaxopt_train.train.step import (AXIS, agreed_needed_bytes, build_eval_step, build_train_step,
                                     init_sharded_error_feedback, jit_steps, make_data_mesh,
                                     memory_summary, place_batch, replicate, smallest_pool)
from jaxopt_train.train.zero_step import (check_elementwise_optimizer, check_zero, init_zero_state,
                                          make_zero_step_body, replicated_params, zero3_gather,
                                          zero_specs, zero_state_specs)

GRAD_SYNCS = config_lib.GRAD_SYNCS
GRAD_COMPRESSIONS = (None, *config_lib.GRAD_COMPRESSIONS)


def check_clip_norm(clip_norm: Any) -> float:
    """`clip_norm` as a float; ValueError unless it is a finite real number >= 0.

    The one check of every clip a Trainer applies, as `default_optimizer` checks its own:
    before the optimizer, or by the ZeRO step (at zero > 0 `default_optimizer` gets 0).
    optax takes any value: -1 scaled each clipped gradient by -1/|g| (gradient ascent),
    NaN passed the non-finite guard, and '1' failed inside the traced step.
    """
    real = not isinstance(clip_norm, bool) and isinstance(clip_norm, numbers.Real)
    if not (real and 0 <= clip_norm < math.inf):
        raise ValueError(f"clip_norm={clip_norm!r} must be a finite real number >= 0 (0 "
                         "disables clipping)")
    return float(clip_norm)


def check_seed(seed: Any) -> int:
    """`seed` as an int; ValueError unless it is an integer that `jax.random.key` takes (int64).

    jax.random.key took seed=True as 1, and failed on 1.5, "3" or 2**64 with a tracer's
    TypeError or an OverflowError from inside the Linen init.
    """
    if (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
            or not -config_lib.MAX_SEED - 1 <= seed <= config_lib.MAX_SEED):
        raise ValueError(f"seed={seed!r} must be an int in [-2**63, 2**63 - 1] (the Linen "
                         "init's PRNG key takes an int64)")
    return int(seed)


def _refuse_clip_before_micro_steps(optimizer, params, clip: float) -> None:
    """Refuses `clip_norm` with an optimizer that accumulates micro-steps (optax.MultiSteps,
    `accumulation.multi_steps`): the trainer's clip goes before that optimizer, so it would
    clip each micro-batch's gradient, not the accumulated one that the step applies."""
    is_multi = lambda node: isinstance(node, optax.MultiStepsState)  # noqa: E731
    state = jax.eval_shape(optimizer.init, params)  # shapes only: nothing is allocated
    if any(is_multi(node) for node in jax.tree.leaves(state, is_leaf=is_multi)):
        raise ValueError(
            f"clip_norm={clip!r} with an optimizer that accumulates micro-steps (optax.MultiSteps, "
            "multi_steps) would clip each micro-batch's gradient, not the accumulated one; put "
            "the clip inside it: multi_steps(optax.chain(optax.clip_by_global_norm(c), opt), k), "
            "or pass the plain optimizer with Trainer(microbatches=k), whose step clips the "
            "whole batch's gradient")


def build_optimizer(zero: int, opt_state_dtype: str, *, clip_norm: float, **schedule):
    """`default_optimizer(**schedule)` with `opt_state_dtype` moments, and where it clips.

    At ZeRO stages 1 and 3 the optimizer sees one slice of the gradient, so it must
    not clip by global norm: the step clips with the whole gradient's norm instead.

    Returns:
      (optimizer, zero_clip_norm): the latter is the step's clip (0.0 at zero=0).
    """
    clip_norm = check_clip_norm(clip_norm)
    optimizer = default_optimizer(clip_norm=0.0 if zero else clip_norm, **schedule)
    return low_precision_state(optimizer, opt_state_dtype), (clip_norm if zero else 0.0)


def check_grad_dtype(grad_dtype: str, grad_compression: str | None) -> None:
    """Raises ValueError for an unknown `grad_dtype` or one the other options exclude."""
    if grad_dtype not in config_lib.GRAD_DTYPES:
        raise ValueError(f"grad_dtype={grad_dtype!r}; expected one of {list(config_lib.GRAD_DTYPES)}")
    if grad_dtype == "compute" and grad_compression not in (None, "none"):
        raise ValueError(f"grad_dtype='compute' needs no grad compression (the gradients are "
                         f"already narrow), got {grad_compression=}; use grad_compression='none'")


class StepTooLargeError(ValueError):
    """The compiled train step needs more memory per device than the device's pool holds.

    `report`: the step's `runtime.FitReport` against that pool (None where not one step's).
    """

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class Trainer:
    """Data-parallel training of one model over all devices (or `devices`).

    Args:
      model: an `nnx.Module` or a `linen.Module`. The train state starts from a
        copy of an nnx module's weights (each step donates, and so deletes, the
        state's arrays; yours stay intact) and keeps no reference to the module:
        drop it after building the Trainer and its weights leave the device.
      loss_fn: `loss_fn(model, batch) -> scalar` (NNX: the module; Linen: an
        `apply` callable); a `train` keyword, if it has one, is passed too.
      optimizer: any optax GradientTransformation; default AdamW with a
        warmup-cosine schedule over `total_steps` and global-norm clipping.
      precision: policy name or `Policy` (see `jaxopt_train.precision`).
      microbatches: micro-batches accumulated per device per step.
      grad_sync: "psum", "ring", "ring_bidir", "hierarchical" or "peer" (2 Hopper
        GPUs driven by one process: `collectives.peer_all_reduce`).
      grad_compression: None/"none", "bf16" or "int8" on the wire; the error
        feedback state is then carried in `state.grad_error` across steps.
      steps_per_dispatch: optimizer steps per compiled call; `step()` then
        takes batches with a leading axis of this size.
      zero: ZeRO stage: 0 (replicated), 1 (optimizer state sharded over the
        data axis, per leaf) or 3 (parameters too, per leaf, FSDP-style).
        Both split each leaf (and its Adam moments) along its first
        dimension divisible by the device count, leaves without one stay
        replicated, and reduce-scatter each gradient leaf on its own, so XLA
        can overlap the reductions with the rest of the backward. At stage 1 the params
        stay replicated; at stage 3 `state.params` holds the shards, each
        leaf all-gathered at the step's start (in the compute dtype with
        grad_dtype="compute": half the gather bytes in bf16) so the gathers
        can overlap the forward; `params` returns a replicated copy. The
        optimizer then updates shards, so it must be elementwise apart from
        per-leaf masks; global-norm clipping is done by the step over the
        whole gradient (`clip_norm`, default optimizer only: a user
        optimizer must not clip by global norm itself). A user optimizer
        whose shard updates differ from its whole-tree update (global-norm
        clipping, trust ratios as in optax.lamb) raises ValueError here.
      grad_dtype: "param" (gradients in the params' dtype, e.g. f32 master
        weights) or "compute" (gradients in the policy's compute dtype, e.g.
        bf16, widened after the cross-device reduction: half the gradient
        memory and reduction bytes; at zero=3 the params are gathered in it
        too; without compression).
      opt_state_dtype: "f32" or "bf16": storage dtype of the optimizer's
        floating state (`jaxopt_train.train.optim.low_precision_state`).
      devices: devices of the data mesh (default: all).
      init_args: example inputs for a Linen module's `init`.
      seed: PRNG seed for Linen init.
      lr, total_steps, warmup, weight_decay: the default optimizer (defaults
        1e-3, 1000, 0, 0.0); given with `optimizer=` they are refused, since that
        optimizer would silently ignore them.
      clip_norm: global-norm clip of the gradients, a finite number >= 0 (0: none;
        default 1.0 for the default optimizer). With `optimizer=` it is off unless
        given: then it is applied before that optimizer (at zero > 0 by the step,
        over the whole gradient). Refused with an optimizer that accumulates
        micro-steps (optax.MultiSteps): it would clip each micro-batch's gradient.
      weight_fn: `weight_fn(batch) -> scalar`, what `loss_fn` is a mean over, summed
        over the batch (e.g. `lambda b: b["mask"].sum()`: the tokens that count).
        Micro-batches and devices then count in proportion to it, so the step's
        loss and gradients are the whole batch's token mean, as without
        accumulation on one device; by default each micro-batch's mean counts
        alike (a mean of means). A micro-batch or device with weight 0 adds
        nothing; a step with none at all has NaN gradients and is skipped, counted in
        `skipped_steps` only: under fp16 the loss scale and the non-finite streak stay as
        they were (an empty batch says nothing about overflow).
        Evaluation weights the same way.
      verbose: print the compiled step's memory analysis.
    """

    def __init__(self, model, loss_fn: Callable, *, optimizer: optax.GradientTransformation | None = None,
                 precision: str | Policy = "fp32", microbatches: int = 1, grad_sync: str = "psum",
                 grad_compression: str | None = None, steps_per_dispatch: int = 1, zero: int = 0,
                 grad_dtype: str = "param", opt_state_dtype: str = "f32",
                 devices=None, init_args: tuple | None = None, seed: int = 0,
                 lr: float | None = None, total_steps: int | None = None, warmup: int | None = None,
                 weight_decay: float | None = None, clip_norm: float | None = None,
                 weight_fn: Callable | None = None, verbose: bool = False):
        import flax.linen as nn  # noqa: PLC0415

        policy = get_policy(precision)
        check_trainable(policy)
        seed = check_seed(seed)
        if isinstance(model, nn.Module):
            if init_args is None:
                raise ValueError("a linen.Module needs init_args=(example inputs,) for module.init")
            fns = linen_model_fns(model, loss_fn, policy, init_args, jax.random.key(seed))
        else:
            fns = nnx_model_fns(model, loss_fn, policy)
        if weight_fn is not None:
            check_weight_fn(weight_fn)
            fns = fns._replace(weight=weight_fn)
        check_zero(zero, grad_sync, grad_compression)
        schedule = {"lr": lr, "total_steps": total_steps, "warmup": warmup,
                    "weight_decay": weight_decay}
        if optimizer is None:
            defaults = {"lr": 1e-3, "total_steps": 1000, "warmup": 0, "weight_decay": 0.0}
            optimizer, zero_clip_norm = build_optimizer(
                zero, opt_state_dtype, clip_norm=1.0 if clip_norm is None else clip_norm,
                **{k: defaults[k] if v is None else v for k, v in schedule.items()})
        else:
            given = {k: v for k, v in schedule.items() if v is not None}
            if given:
                raise ValueError(
                    f"{', '.join(f'{k}={v!r}' for k, v in given.items())} configure the default "
                    "optimizer, but optimizer= was given and would ignore them; put them in "
                    "that optimizer (e.g. optax.adamw(optax.warmup_cosine_decay_schedule(...)))")
            # A clip the user asked for is kept: before their optimizer, or by the ZeRO step
            # over the whole gradient (a clip inside a sharded optimizer would see one shard).
            clip = 0.0 if clip_norm is None else check_clip_norm(clip_norm)
            if clip:
                _refuse_clip_before_micro_steps(optimizer, fns.params, clip)
            if clip and not zero:
                optimizer = optax.chain(clip_by_global_norm_f32(clip), optimizer)
            optimizer = low_precision_state(optimizer, opt_state_dtype)
            zero_clip_norm = clip if zero else 0.0
        # Linen's variables are created here, by module.init: the state can own them.
        self._setup(fns, optimizer, policy, microbatches=microbatches, grad_sync=grad_sync,
                    grad_compression=grad_compression, steps_per_dispatch=steps_per_dispatch,
                    zero=zero, zero_clip_norm=zero_clip_norm, grad_dtype=grad_dtype,
                    devices=devices, verbose=verbose, owns_params=isinstance(model, nn.Module))

    @classmethod
    def from_model_fns(cls, fns: ModelFns, optimizer: optax.GradientTransformation, policy: Policy,
                       **kwargs) -> Trainer:
        """A Trainer over an already-wrapped model (what `train(config)` uses)."""
        self = cls.__new__(cls)
        self._setup(fns, optimizer, policy, **kwargs)
        return self

    def _setup(self, fns: ModelFns, optimizer, policy: Policy, *, microbatches: int = 1,
               grad_sync: str = "psum", grad_compression: str | None = None,
               steps_per_dispatch: int = 1, zero: int = 0, zero_clip_norm: float = 0.0,
               grad_dtype: str = "param", devices=None, verbose: bool = False,
               owns_params: bool = False) -> None:
        """`zero_clip_norm`: global-norm clip applied by the ZeRO step (zero > 0; the
        optimizer must then not clip by global norm itself). `owns_params`: nobody
        else reads `fns.params` / `fns.model_state` again (a model built for the run),
        so the state takes their buffers instead of copies, and the first step's
        donation deletes them."""
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync={grad_sync!r}; expected one of {list(GRAD_SYNCS)}")
        if grad_compression not in GRAD_COMPRESSIONS:
            raise ValueError(f"grad_compression={grad_compression!r}; expected one of "
                             f"{list(GRAD_COMPRESSIONS)}")
        check_zero(zero, grad_sync, grad_compression)
        check_grad_dtype(grad_dtype, grad_compression)
        if zero_clip_norm and not zero:
            raise ValueError(f"{zero_clip_norm=} applies to zero=1|3 only; at zero=0 clip in the optimizer")
        for name, value in (("microbatches", microbatches), ("steps_per_dispatch", steps_per_dispatch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        # The trainer keeps only the shapes of the initial weights: a reference to the
        # arrays themselves would hold one more copy of the model on the device for
        # the whole run (gpt-1b: 3.4 GiB; the state has its own copy).
        self.fns = fns._replace(params=jax.tree.map(as_abstract, fns.params),
                                model_state=jax.tree.map(as_abstract, fns.model_state))
        self.optimizer, self.policy = optimizer, policy
        self.microbatches, self.steps_per_dispatch, self.verbose = microbatches, steps_per_dispatch, verbose
        self.mesh = make_data_mesh(devices)
        self.num_devices = self.mesh.shape[AXIS]
        if not owns_params:  # the user's model keeps its arrays; the state gets copies
            fns = fns._replace(params=_copy_arrays(fns.params),
                               model_state=_copy_arrays(fns.model_state))
        # At zero > 0 the optimizer state is built sharded below, never in full.
        state = init_train_state(fns.params, fns.model_state, optax.identity() if zero else optimizer,
                                 loss_scale_for(policy))
        self.state: TrainState = replicate(state, self.mesh)
        self.zero = zero
        grad_cast = policy.cast_to_compute if grad_dtype == "compute" else None
        if zero:
            self._setup_zero(fns, optimizer, grad_sync, zero_clip_norm, grad_cast=grad_cast)
            return
        error_feedback = grad_compression not in (None, "none")
        if error_feedback:
            # Compressed reductions carry their rounding error into the next step.
            self.state = self.state._replace(
                grad_error=init_sharded_error_feedback(self.state.params, self.mesh))
        self._train_step = build_train_step(
            fns.loss, optimizer, self.mesh, microbatches=microbatches, grad_sync=grad_sync,
            grad_compression=grad_compression, steps_per_dispatch=steps_per_dispatch,
            error_feedback=error_feedback, grad_cast=grad_cast, weight_fn=fns.weight)
        self._finish_setup()

    def _setup_zero(self, fns: ModelFns, optimizer, grad_sync: str, clip_norm: float,
                    grad_cast: Callable | None) -> None:
        param_specs, opt_specs = zero_specs(optimizer, fns.params, self.num_devices)
        check_elementwise_optimizer(optimizer, fns.params, param_specs, zero=self.zero,
                                    num_devices=self.num_devices)
        self.state = init_zero_state(self.state, optimizer, param_specs, opt_specs, self.mesh,
                                     zero=self.zero)
        one_step = make_zero_step_body(fns.loss, optimizer, param_specs, zero=self.zero,
                                       microbatches=self.microbatches,
                                       num_devices=self.num_devices, grad_sync=grad_sync,
                                       clip_norm=clip_norm, grad_cast=grad_cast,
                                       weight_fn=fns.weight)
        specs = zero_state_specs(opt_specs, param_specs if self.zero == 3 else P())
        self._train_step = jit_steps(one_step, specs, self.mesh, self.steps_per_dispatch)
        if self.zero == 3:
            self._finish_setup(params_spec=param_specs, gather=zero3_gather(param_specs, grad_cast))
        else:
            self._finish_setup()

    def _finish_setup(self, **eval_params) -> None:
        # eval_params: at zero=3 the per-leaf specs and the gather the eval step does itself
        # (a replicated f32 copy per eval batch would need more memory than a train step).
        self._eval_step = build_eval_step(self.fns.loss, self.mesh, weight_fn=self.fns.weight,
                                          **eval_params)
        self._compiled = None
        self._compiled_shapes = None
        self.compile_seconds: float | None = None
        self.memory_report: str | None = None

    # ------------------------------------------------------------------ batches

    def _stage(self, batch) -> Any:
        """Host batch -> device batches [k, B, ...] sharded over the data axis."""
        batch = _host_batch(batch)
        k = self.steps_per_dispatch
        if k == 1:
            batch = jax.tree.map(lambda x: x[None], batch)
        elif any(x.ndim < 2 or x.shape[0] != k for x in jax.tree.leaves(batch)):
            shapes = [x.shape for x in jax.tree.leaves(batch)]
            raise ValueError(f"with steps_per_dispatch={k} every batch leaf needs a leading axis "
                             f"of size {k} (then the batch axis); got shapes {shapes}")
        check_divisible(_batch_size(batch, axis=1), self.microbatches, self.num_devices)
        return place_batch(batch, self.mesh, P(None, AXIS))

    def compile(self, batch) -> None:
        """Compiles the step ahead of time for `batch`'s shapes and records its memory analysis."""
        staged = self._stage(batch)
        self._compile_staged(staged)

    def _compile_staged(self, staged) -> None:
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), staged)
        start = time.perf_counter()
        compiled = self._train_step.lower(self.state, staged).compile()
        self.compile_seconds = time.perf_counter() - start
        self.memory_report = memory_summary(compiled)
        if self.verbose and jax.process_index() == 0:
            print(f"compiled train step in {self.compile_seconds:.1f} s; {self.memory_report}",
                  flush=True)
        self._check_fits(compiled)
        self._compiled, self._compiled_shapes = compiled, shapes

    def _check_fits(self, compiled) -> None:
        """Raises StepTooLargeError if the step cannot fit the mesh's smallest memory pool.

        The arguments stay resident and XLA allocates the temporaries as one buffer, so a
        step whose total exceeds the pool fails at its first run: say so now, with the ways
        out, rather than as an allocator error after the run has started.
        """
        limit = smallest_pool(self.mesh.devices.flat)
        if limit is None:  # the backend reports no pool (CPU)
            return
        report = _fit_report(compiled, limit)
        # Every process decides on the most any of them needs: a refusal on one host only
        # would leave the others waiting in the step's collectives.
        needed = agreed_needed_bytes(None if report is None else report.needed_bytes)
        if needed is None or needed <= limit:
            return
        where = ("" if needed == report.needed_bytes else
                 f"; another process's compile needs {needed / 2**30:.3f} GiB")
        raise StepTooLargeError(
            f"the compiled train step does not fit the smallest device memory pool of its "
            f"mesh: it {report}{where}, so its first run would fail. To fit: rematerialise "
            "blocks (GPTConfig.remat, --remat auto|dots_attention|dots|full), more micro-batches "
            "(microbatches=), gradients and AdamW moments in bf16 (grad_dtype='compute', "
            "opt_state_dtype='bf16'), the state sharded over several GPUs (zero=3), or a "
            "larger pool (runtime.limit_memory, --memory-limit)",
            report=report)

    @property
    def compiled(self) -> bool:
        """Whether the step is compiled (by `compile(batch)` or the first `step`)."""
        return self._compiled is not None

    def memory_fit(self, budget: int | str):
        """The compiled step's memory per device against `budget` (bytes or "16GiB"): a
        `runtime.FitReport`, true when it fits; None where the backend gives no analysis.

        Raises:
          RuntimeError: if the step is not compiled yet (`compile(batch)` first).
        """
        if self._compiled is None:
            raise RuntimeError("memory_fit() needs the compiled step: call compile(batch) first")
        return _fit_report(self._compiled, budget)

    # ------------------------------------------------------------------ steps

    def step(self, batch) -> dict[str, jax.Array]:
        """Runs `steps_per_dispatch` optimizer steps; returns per-step metrics (device arrays).

        `batch` is the host (numpy) global batch: leaves [B, ...], or
        [steps_per_dispatch, B, ...] when steps_per_dispatch > 1. Metrics
        ("loss", "grad_norm", "finite", "loss_scale") have shape [k]; reading
        them waits for the device.
        """
        staged = self._stage(batch)
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), staged)
        if self._compiled is None:
            self._compile_staged(staged)
        elif shapes != self._compiled_shapes:
            raise ValueError(f"batch shapes {shapes} differ from the compiled step's "
                             f"{self._compiled_shapes}; keep the global batch shape fixed")
        self.state, metrics = self._compiled(self.state, staged)
        return metrics

    def evaluate(self, batch, *, microbatches: int | None = None) -> float:
        """Mean loss of the current params on a host global batch [B, ...] (eval mode).

        The batch runs in `microbatches` equal chunks (default: the train step's
        `microbatches`), one forward pass each: the whole batch at once needs that many
        times the step's activation memory, which a step fitted by micro-batching may not
        have. The chunks' means are combined by their weight (`weight_fn`, else their
        size), so the result is the whole batch's mean. B must be divisible by
        `microbatches` times the number of devices.
        """
        batch = _host_batch(batch)
        chunks = self.microbatches if microbatches is None else microbatches
        size = check_divisible(_batch_size(batch, axis=0), chunks, self.num_devices) * self.num_devices
        results = [self._eval_step(self.state.params, self.state.model_state,
                                   place_batch(jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch),
                                               self.mesh, P(AXIS)))
                   for i in range(chunks)]
        means, weights = (np.array([float(r[k]) for r in results], np.float64) for k in (0, 1))
        if chunks == 1:
            return float(means[0])
        # A chunk of weight 0 adds nothing (its own mean is NaN); all of weight 0 is NaN, as
        # for the whole batch in one pass.
        total = weights.sum()
        if total == 0:
            return float("nan")
        return float(np.sum(np.where(weights > 0, means, 0.0) * weights) / total)

    # ------------------------------------------------------------------ results

    @property
    def params(self):
        """A copy of the current parameter tree (at zero=3 gathered from the per-leaf shards).

        A copy, so it survives later `step()` calls (which donate, and so
        delete, the train state's own arrays): keep it as a snapshot.
        """
        if self.zero != 3:
            return _copy_arrays(self.state.params)
        # The gather makes new arrays, except for leaves that were replicated already (no
        # dimension divides the device count): device_put hands back the state's own.
        return jax.tree.map(
            lambda full, own: full.copy() if own.sharding.is_fully_replicated else full,
            replicated_params(self.state.params, self.mesh), self.state.params)

    @property
    def model(self):
        """The user's model with a copy of the current weights (an nnx.Module, or Linen variables).

        Like `params`, a snapshot that later `step()` calls leave intact.
        """
        return self.fns.merge(self.params, _copy_arrays(self.state.model_state))


def _fit_report(compiled, budget):
    """`runtime.fits` of a compiled step against `budget`; None where the backend gives no
    memory analysis."""
    try:
        return fits(compiled, (), budget)
    except RuntimeError:
        return None


def _copy_arrays(tree):
    """`tree` with every jax.Array copied (same sharding), so donating the originals spares it."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def _host_batch(batch):
    """`batch` as numpy leaves; raises ValueError if it has none or a leaf has no batch axis."""
    batch = jax.tree.map(np.asarray, batch)
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError("batch has no array leaves")
    for path, x in leaves:
        if x.ndim == 0:
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ValueError(f"every batch leaf needs a batch axis; leaf {name!r} has shape () "
                             "(give per-example values a batch axis, e.g. np.full(batch_size, value))")
    return batch


def _batch_size(batch, axis: int) -> int:
    """The size of dimension `axis` of every leaf; raises ValueError if the leaves disagree."""
    sizes = {x.shape[axis] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()
