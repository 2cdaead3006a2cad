"""The training steps the benchmark compares, built from one `RunConfig` each.

Two ways to run an optimizer step over `global_batch` examples split in K
micro-batches, on a 1-D "data" mesh (params and optimizer state replicated):

- host loop (the baseline): one jitted call per micro-batch, gradients
  all-reduced with `lax.psum` in every call, the optimizer wrapped in
  `multi_steps` (optax.MultiSteps) so it steps every K calls;
- in-graph: one compiled call runs `steps_per_dispatch` optimizer steps
  (`lax.scan` over pre-staged batches), each accumulating its K micro-batches
  with `accumulate_gradients` (`lax.scan`) and reducing gradients across
  devices once, after the scan, with `all_reduce_tree(method=grad_sync)`.

In-graph with `zero=1` (per-leaf ZeRO-1, `jaxopt_train.zero`): the f32 master
params and AdamW's moments are split per leaf over the devices instead of
replicated. The step all-gathers the params (in the compute dtype with
`grad_dtype="compute"`) at its start, takes the gradient w.r.t. the gathered
copy, reduce-scatters each gradient back to its shard after the scan, and
each device updates only its shards. One collective per leaf lets XLA overlap
the all-gathers with the forward and the reduce-scatters with the backward;
with micro-batches (K > 1) they sit before and after the accumulation
`lax.scan`, and XLA's scheduler does not move them into its loop, so that
overlap needs K = 1.

With `compute_copy=True` the state also carries the compute-dtype copy of the
params, written by the optimizer update (the cast of the new params fuses into
the update's pass, which already reads and writes every param) and read by the
next step's forward. Without it, each step starts with a separate cast pass over
the f32 params: about 1.5 ms of gpt-1b's 87 ms step on an H200 (BENCHMARKS.md).
The copy costs its bytes in memory (2 per param in bf16).

A float16 policy ("fp16": f32 master weights, f16 compute) also carries a
`DynamicLossScale` at the end of the state: the loss is scaled before
differentiation, the gradients unscaled after the reduction (in the params'
f32), and a step whose gradients are not all finite leaves params, optimizer
and model state unchanged and backs the scale off, as the trainer's step does.
Those selects are passes over the state that a bf16 step does not pay; they are
what float16 costs, so the bench keeps them.

The bench writes its own lean step instead of the trainer's
(`jaxopt_train.train.step`): the trainer also checks finiteness, selects
between old and new state, clips and reports the gradient norm, which cost
full passes over the parameters that a speed benchmark of the techniques
should not carry. The techniques themselves come from the library.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train._checks import is_int
from jaxopt_train.accumulation import accumulate_gradients, check_divisible, multi_steps
from jaxopt_train.collectives import all_reduce_tree
from jaxopt_train.data import corpus_lm_batch, synthetic_image_batch, synthetic_lm_batch
from jaxopt_train.models import (GPT, GPT_PRESETS, VISION_PRESETS, classification_loss,
                                 create_vision_model, get_gpt_config, gpt_loss,
                                 resnet_flops_per_image)
from jaxopt_train.models.flops import gpt_flops_per_token
from jaxopt_train.models.gpt import cudnn_attention_unavailable, warn_if_cudnn_unavailable
from jaxopt_train.precision import all_finite, get_policy, loss_scale_for, select_tree
from jaxopt_train.train.config import GRAD_DTYPES, MATMULS, matmul_dot_general
from jaxopt_train.train.optim import low_precision_state, state_dtype
from jaxopt_train.zero import (gather_leaves, leaf_specs, opt_state_leaf_specs, place_leaves,
                               reduce_scatter_leaves)

AXIS = "data"
ACCUMULATIONS = ("host", "scan")
ZERO_STAGES = (0, 1)
# The optimised row's policy (`bench train --precision`); "auto" is resolved per GPU.
HALF_POLICIES = ("bf16", "fp16")
PRECISIONS = ("auto",) + HALF_POLICIES
# bf16 tensor cores came with Ampere: below it XLA runs bf16 matmuls in float32.
BF16_TENSOR_CORE_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained: a model preset and the batch shape (same for every config)."""

    model: str
    global_batch: int
    microbatches: int = 1
    seq_len: int | None = None  # GPT: override the preset's sequence length
    n_layers: int | None = None  # GPT: override the depth (small CPU mode)
    image_size: int | None = None  # vision: override the input side
    num_classes: int = 1000
    text: bool = False  # GPT: windows of the embedded byte corpus instead of uniform random ids

    def __post_init__(self):
        if self.model not in GPT_PRESETS + VISION_PRESETS:
            raise ValueError(f"model={self.model!r}; legal values: {GPT_PRESETS + VISION_PRESETS}")
        if self.text and not self.is_gpt:
            raise ValueError(f"text=True feeds GPT token ids; model={self.model!r} takes images")

    @property
    def is_gpt(self) -> bool:
        return self.model in GPT_PRESETS

    @property
    def unit(self) -> str:
        return "tokens" if self.is_gpt else "images"

    def gpt_config(self, **overrides):
        extra = {k: v for k, v in (("seq_len", self.seq_len), ("n_layers", self.n_layers))
                 if v is not None}
        return get_gpt_config(self.model, **extra, **overrides)

    @property
    def image_side(self) -> int:
        if self.image_size is not None:
            return self.image_size
        return 32 if self.model == "cnn-small" else 224

    @property
    def items_per_step(self) -> int:
        """Tokens (GPT) or images (vision) per optimizer step."""
        if self.is_gpt:
            return self.global_batch * self.gpt_config().seq_len
        return self.global_batch

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of one optimizer step (`jaxopt_train.models.flops`)."""
        if self.is_gpt:
            return float(gpt_flops_per_token(self.gpt_config())) * self.items_per_step
        per_image = resnet_flops_per_image(self.model, image_size=self.image_side,
                                           num_classes=self.num_classes)
        return float(per_image) * self.global_batch


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One column of the comparison: which techniques are on."""

    name: str
    policy: str = "fp32"
    attention: str = "xla"
    accumulation: str = "host"
    donate: bool = False
    remat: str = "none"
    remat_layers: int | None = None  # GPT: `remat` on the first k blocks only (None: all)
    remat_rest: str = "none"  # GPT: the policy of the blocks past remat_layers
    grad_sync: str = "psum"
    steps_per_dispatch: int = 1
    opt_state: str = "f32"  # AdamW moments' storage dtype (jaxopt_train.train.optim)
    grad_dtype: str = "param"  # "compute": differentiate w.r.t. the compute-dtype params
    matmul: str = "xla"  # GPT dense layers: "xla", or our "pallas" / "triton" kernel
    zero: int = 0  # 1: master params + optimizer state sharded per leaf (a no-op on 1 device)
    compute_copy: bool = False  # keep the params' compute-dtype copy in the state (see above)
    split_qkv: bool = False  # GPT: q, k, v from three products (GPTConfig.split_qkv)
    # GPT with a kernel matmul: fc + bias + GELU as one launch (GPTConfig.fuse_mlp_activation;
    # None, its default: where the kernel applies the GELU itself); no effect with XLA's matmul
    fuse_mlp_activation: bool | None = None

    def __post_init__(self):
        get_policy(self.policy)  # validates: a preset name or a Policy
        if self.accumulation not in ACCUMULATIONS:
            raise ValueError(f"accumulation={self.accumulation!r}; legal values: {ACCUMULATIONS}")
        # A float (2.0) failed deep in the batch staging; True ran as 1 step.
        if not is_int(self.steps_per_dispatch) or self.steps_per_dispatch < 1:
            raise ValueError(f"steps_per_dispatch={self.steps_per_dispatch!r} must be an int >= 1")
        state_dtype(self.opt_state)  # validates: "f32" or "bf16"
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype={self.grad_dtype!r}; legal values: {GRAD_DTYPES}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul={self.matmul!r}; legal values: {MATMULS}")
        if self.grad_dtype == "compute" and self.accumulation == "host":
            raise ValueError("grad_dtype='compute' is implemented by the in-graph step: it needs "
                             "accumulation='scan', got accumulation='host'")
        # True == 1 and 1.0 == 1 passed `in`: a stage is an int.
        if not is_int(self.zero) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero!r}; legal values: {ZERO_STAGES} (0: replicated, "
                             "1: master params and optimizer state sharded per leaf)")
        if self.zero and self.accumulation != "scan":
            raise ValueError(f"zero={self.zero} is implemented by the in-graph step: it needs "
                             f"accumulation='scan', got accumulation={self.accumulation!r}")
        # (grad_dtype="compute" already needs scan accumulation, checked above.)
        if self.compute_copy and self.grad_dtype != "compute":
            raise ValueError("compute_copy=True is the copy the step differentiates: it needs "
                             f"grad_dtype='compute' and accumulation='scan', got "
                             f"grad_dtype={self.grad_dtype!r}, accumulation={self.accumulation!r}")
        if self.compute_copy:
            policy = get_policy(self.policy)
            if np.dtype(policy.compute_dtype) == np.dtype(policy.param_dtype):
                raise ValueError(f"compute_copy=True needs a compute dtype narrower than the "
                                 f"params'; policy {self.policy!r} computes in "
                                 f"{np.dtype(policy.compute_dtype).name}, as its params are stored")
        if self.accumulation == "host" and self.steps_per_dispatch > 1:
            raise ValueError("steps_per_dispatch > 1 runs the step in-graph: it needs "
                             "accumulation='scan', got accumulation='host'")

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def loss_scaled(self) -> bool:
        """True when gradients pass through float16: the state then ends with a loss scale."""
        return get_policy(self.policy).needs_loss_scale


def optimised_policy(precision: str, devices) -> str:
    """--precision for the optimised row: "auto" is bf16, except fp16 where a GPU has no
    bf16 tensor cores (compute capability below 8.0, such as a T4: XLA runs bf16 matmuls
    there in float32, while its fp16 tensor cores are idle); an explicit choice is kept."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; legal values: {PRECISIONS}")
    if precision != "auto":
        return precision
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    gpus = [d for d in devices if d.platform == "gpu"]
    # An unreadable capability is (0, 0): bf16 is the safe default there, as on CPU and TPU.
    old = [d for d in gpus if (0, 0) < compute_capability(d) < BF16_TENSOR_CORE_CAPABILITY]
    return "fp16" if old else "bf16"


def default_optimizer(opt_state: str = "f32") -> optax.GradientTransformation:
    """AdamW (GPT-2 betas), identical for every config so only the techniques differ;
    `opt_state="bf16"` stores its moments in bf16 (`low_precision_state`)."""
    return low_precision_state(optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1), opt_state)


def data_mesh(devices) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def build_model(workload: Workload, run: RunConfig, axis_name: str | None, seed: int = 0):
    policy = get_policy(run.policy)
    rngs = nnx.Rngs(seed)
    for name, value, off in (("matmul", run.matmul, "xla"), ("split_qkv", run.split_qkv, False),
                             ("fuse_mlp_activation", run.fuse_mlp_activation, None)):
        if value != off and not workload.is_gpt:
            raise ValueError(f"{name}={value!r} applies to GPT models {GPT_PRESETS}, "
                             f"not {workload.model!r}")
    if workload.is_gpt:
        if run.matmul != "xla" and np.dtype(policy.compute_dtype) == np.float32:
            raise ValueError(f"matmul={run.matmul!r} needs a bf16/fp16 compute dtype; policy "
                             f"{run.policy!r} computes in float32")
        cfg = workload.gpt_config(dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
                                  attention=_attention_for(run.attention, policy), remat=run.remat,
                                  remat_layers=run.remat_layers, remat_rest=run.remat_rest,
                                  split_qkv=run.split_qkv,
                                  fuse_mlp_activation=run.fuse_mlp_activation,
                                  dot_general=None if run.matmul == "xla" else matmul_dot_general(run.matmul))
        return GPT(warn_if_cudnn_unavailable(cfg), rngs=rngs)
    return create_vision_model(workload.model, num_classes=workload.num_classes,
                               dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
                               rngs=rngs, axis_name=axis_name)


def _attention_for(attention: str, policy) -> str:
    # cuDNN flash attention has no float32 kernel: an f32 policy keeps XLA's.
    if attention == "cudnn" and np.dtype(policy.compute_dtype) == np.float32:
        return "xla"
    return attention


def optimised_attention(attention: str) -> str:
    """--attention for the optimised row: "auto" is cuDNN where it runs (an Ampere or newer
    GPU), else XLA; an explicit choice is kept."""
    if attention != "auto":
        return attention
    return "xla" if cudnn_attention_unavailable() else "cudnn"


def resolved_attention(workload: Workload, run: RunConfig) -> str:
    """The attention implementation the model really runs (after fallbacks)."""
    if not workload.is_gpt:
        return "n/a"
    attention = _attention_for(run.attention, get_policy(run.policy))
    if attention == "cudnn" and cudnn_attention_unavailable():
        return "xla"
    return attention


def make_loss(graphdef, workload: Workload, run: RunConfig) -> Callable:
    """`loss(params, batch, model_state) -> (f32 loss, new_model_state)` under the policy."""
    policy = get_policy(run.policy)

    def loss(params, batch, model_state):
        # copy=True: fresh Variables at this trace level, so BatchNorm may
        # update its statistics inside jax.value_and_grad (flax 0.12 refuses otherwise).
        model = nnx.merge(graphdef, policy.cast_to_compute(params), model_state, copy=True)
        if workload.is_gpt:
            return gpt_loss(model(batch["inputs"]), batch["targets"]), model_state
        logits = model(batch["images"], train=True)
        _, _, new_state = nnx.split(model, nnx.Param, ...)
        new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, model_state)
        return classification_loss(logits, batch["labels"]), new_state

    return loss


def init_state(workload: Workload, run: RunConfig, mesh, optimizer, seed: int = 0):
    """(graphdef, state) with state = (params, model_state, opt_state), plus the params'
    compute-dtype copy with `run.compute_copy`, then the loss scale of a float16 policy,
    replicated on `mesh` (`split_state` names the parts)."""
    axis = AXIS if not workload.is_gpt else None
    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: build_model(workload, run, axis, seed)),
                               nnx.Param, ...)

    def init():
        _, params, model_state = nnx.split(build_model(workload, run, axis, seed), nnx.Param, ...)
        with jax.numpy_dtype_promotion("standard"):
            state = (params, model_state, optimizer.init(params))
        if run.compute_copy:
            state += (get_policy(run.policy).cast_to_compute(params),)
        if run.loss_scaled:
            state += (loss_scale_for(run.policy),)
        return state

    state = jax.jit(init, out_shardings=NamedSharding(mesh, P()))()
    return graphdef, state


def split_state(state, run: RunConfig):
    """(params, model_state, opt_state, copy, loss_scale); copy and loss_scale are None
    where `run` keeps none (see `init_state`)."""
    params, model_state, opt_state, *rest = state
    expected = 3 + run.compute_copy + run.loss_scaled
    if len(state) != expected:  # a state from another RunConfig: never guess which part is which
        raise ValueError(f"run {run.name!r} expects a state of {expected} parts (compute_copy="
                         f"{run.compute_copy}, loss scale: {run.loss_scaled}); got {len(state)}")
    copy = rest.pop(0) if run.compute_copy else None
    scale = rest.pop(0) if run.loss_scaled else None
    return params, model_state, opt_state, copy, scale


def join_state(params, model_state, opt_state, copy=None, scale=None) -> tuple:
    """The inverse of `split_state`."""
    return ((params, model_state, opt_state) + (() if copy is None else (copy,))
            + (() if scale is None else (scale,)))


def lm_batch(cfg, size: int, *, text: bool, seed: int = 0) -> dict:
    """GPT inputs and targets [size, seq_len]: uniform random ids, or (``text``) byte
    windows of the embedded corpus, whose frequent ids a random batch never has."""
    if text:
        return corpus_lm_batch(size, cfg.seq_len, seed=seed)
    return synthetic_lm_batch(size, cfg.seq_len, cfg.vocab_size, seed=seed)


def host_batches(workload: Workload, count: int, run: RunConfig, seed: int = 0):
    """`count` global batches stacked on a leading axis, inputs in the compute dtype."""
    size = count * workload.global_batch
    if workload.is_gpt:
        batch = lm_batch(workload.gpt_config(), size, text=workload.text, seed=seed)
    else:
        batch = synthetic_image_batch(size, image_size=workload.image_side,
                                      num_classes=workload.num_classes, seed=seed)
        # Stage images in the compute dtype: the cast happens once, on the host.
        batch["images"] = batch["images"].astype(get_policy(run.policy).compute_dtype)
    return {k: v.reshape((count, workload.global_batch) + v.shape[1:]) for k, v in batch.items()}


def zero_state_specs(state, optimizer, num_devices: int, run: RunConfig):
    """PartitionSpecs of the state for per-leaf ZeRO-1 over AXIS: (params, model_state,
    opt_state), a compute copy sharded like the params and a replicated loss scale where
    the state has them."""
    params, model_state, opt_state, copy, scale = split_state(state, run)
    param_specs = leaf_specs(params, num_devices, AXIS)
    return join_state(param_specs, jax.tree.map(lambda _: P(), model_state),
                      opt_state_leaf_specs(optimizer, opt_state, params, param_specs),
                      None if copy is None else param_specs,
                      None if scale is None else jax.tree.map(lambda _: P(), scale))


def _sync_grads(grads, params, run: RunConfig, num_devices: int, param_specs=None):
    """One all-reduce (skipped on one device), or with `param_specs` (ZeRO-1) a reduce-scatter
    per leaf to this device's shard; then widened to the params' dtype and averaged."""
    if param_specs is not None:
        grads = reduce_scatter_leaves(grads, param_specs, AXIS, method=run.grad_sync)
    elif num_devices > 1:
        grads = all_reduce_tree(grads, AXIS, method=run.grad_sync)
    return jax.tree.map(lambda g, p: g.astype(p.dtype) / num_devices, grads, params)


def _pmean_floating(tree, num_devices: int):
    if num_devices == 1:
        return tree
    return jax.tree.map(lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)


def _scaled_loss(loss, scale):
    """`loss` with its value multiplied by the loss scale (the aux passes through)."""
    if scale is None:
        return loss

    def scaled(params, batch, model_state):
        value, aux = loss(params, batch, model_state)
        return scale.scale(value), aux

    return scaled


def _apply_update(optimizer, grads, opt_state, params, model_state, new_model_state, scale,
                  sharded: bool):
    """One optax step on f32 `grads` (already reduced); with a loss scale, `grads` are
    unscaled first and a step with any non-finite gradient changes nothing but the scale.

    Returns (params, opt_state, model_state, scale)."""
    if scale is not None:
        grads = scale.unscale(grads)
    # optax mixes Python floats with int32 counts, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
    if scale is None:
        return new_params, new_opt_state, new_model_state, None
    finite = all_finite(grads)
    if sharded:  # ZeRO-1: each device sees its shards only, and all must skip together
        finite = lax.psum(jnp.logical_not(finite).astype(jnp.int32), AXIS) == 0
    return (select_tree(finite, new_params, params), select_tree(finite, new_opt_state, opt_state),
            select_tree(finite, new_model_state, model_state), scale.adjust(finite))


def _in_graph_step(loss, optimizer, workload: Workload, run: RunConfig, num_devices: int,
                   param_specs=None):
    """The per-device step; `param_specs` (ZeRO-1) means params and state arrive as shards."""
    policy = get_policy(run.policy)

    def one_step(state, batch):
        params, model_state, opt_state, copy, scale = split_state(state, run)
        # grad_dtype="compute": gradients w.r.t. the bf16 copy stay bf16 (half the
        # bytes to write, reduce and read); the loss's own cast is then a no-op.
        if copy is not None:  # compute_copy: the previous update already wrote it
            grad_params = copy
        else:
            grad_params = policy.cast_to_compute(params) if run.grad_dtype == "compute" else params
        if param_specs is not None:  # cast first: the all-gathers then move bf16
            grad_params = gather_leaves(grad_params, param_specs, AXIS)
        grad_fn = accumulate_gradients(_scaled_loss(loss, scale), workload.microbatches,
                                       has_aux=True)
        (value, new_model_state), grads = grad_fn(grad_params, batch, model_state)
        if scale is not None:
            value = scale.unscale(value)
        grads = _sync_grads(grads, params, run, num_devices, param_specs)
        new_model_state = _pmean_floating(new_model_state, num_devices)
        params, opt_state, new_model_state, scale = _apply_update(
            optimizer, grads, opt_state, params, model_state, new_model_state, scale,
            sharded=param_specs is not None)
        loss_value = value if num_devices == 1 else lax.pmean(value, AXIS)
        new_copy = None if copy is None else policy.cast_to_compute(params)
        return join_state(params, new_model_state, opt_state, new_copy, scale), loss_value

    def per_device(state, batches):
        if run.steps_per_dispatch == 1:
            state, value = one_step(state, jax.tree.map(lambda x: x[0], batches))
            return state, value[None]
        return lax.scan(one_step, state, batches)

    return per_device


def _host_micro_step(loss, optimizer, run: RunConfig, num_devices: int):
    def per_device(state, micro_batch):
        params, model_state, opt_state, _, scale = split_state(state, run)
        value_and_grad = jax.value_and_grad(_scaled_loss(loss, scale), has_aux=True)
        (value, new_model_state), grads = value_and_grad(params, micro_batch, model_state)
        if scale is not None:
            value = scale.unscale(value)
        if num_devices > 1:  # the baseline syncs every micro-batch, with psum
            grads = jax.tree.map(lambda g: lax.psum(g, AXIS) / num_devices, grads)
        new_model_state = _pmean_floating(new_model_state, num_devices)
        # A skipped micro-batch leaves optax.MultiSteps' count as it was: the optimizer
        # step then waits for K finite ones, as the trainer's would.
        params, opt_state, new_model_state, scale = _apply_update(
            optimizer, grads, opt_state, params, model_state, new_model_state, scale,
            sharded=False)
        loss_value = value if num_devices == 1 else lax.pmean(value, AXIS)
        return join_state(params, new_model_state, opt_state, None, scale), loss_value[None]

    return per_device


def _compile(jitted, *args):
    # Traced under standard promotion: the backward pass of jax.nn's bf16
    # attention mixes bf16 with f32 constants outside the model's own
    # promotion scope, which a caller's strict setting (our tests') rejects.
    with jax.numpy_dtype_promotion("standard"):
        return jitted.lower(*args).compile()


@dataclasses.dataclass
class Runner:
    """A compiled config, ready to time: `step(state) -> (state, losses)`."""

    step: Callable[[Any], tuple[Any, Any]]
    state: Any
    compiled: list[Any]
    compile_s: float
    steps_per_call: int


def build_runner(workload: Workload, run: RunConfig, mesh, *, seed: int = 0) -> Runner:
    """Initialises, stages data for and compiles `run` on `mesh` (nothing is executed)."""
    num_devices = mesh.devices.size
    check_divisible(workload.global_batch, workload.microbatches, num_devices)
    host_accumulation = run.accumulation == "host" and workload.microbatches > 1
    optimizer = default_optimizer(run.opt_state)
    if host_accumulation:
        optimizer = multi_steps(optimizer, workload.microbatches)
    graphdef, state = init_state(workload, run, mesh, optimizer, seed)
    loss = make_loss(graphdef, workload, run)
    donate = (0,) if run.donate else ()
    if host_accumulation:
        return _host_runner(workload, run, mesh, loss, optimizer, state, donate)
    batches = jax.device_put(host_batches(workload, run.steps_per_dispatch, run, seed),
                             NamedSharding(mesh, P(None, AXIS)))
    # zero=1 on one device has nothing to shard: it runs the zero=0 step.
    state_specs, param_specs = P(), None
    if run.zero and num_devices > 1:
        state_specs = zero_state_specs(state, optimizer, num_devices, run)
        param_specs = state_specs[0]
        state = place_leaves(state, state_specs, mesh)
    per_device = _in_graph_step(loss, optimizer, workload, run, num_devices, param_specs)
    # check_vma=False: ring reductions built from ppermute give values that are
    # equal on every device but typed varying, and the params' gradients must
    # stay per-device until our single all-reduce.
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(state_specs, P(None, AXIS)),
                            out_specs=(state_specs, P()), check_vma=False)
    start = time.perf_counter()
    compiled = _compile(jax.jit(sharded, donate_argnums=donate), state, batches)
    compile_s = time.perf_counter() - start
    return Runner(lambda s: compiled(s, batches), state, [compiled], compile_s,
                  run.steps_per_dispatch)


def _host_runner(workload, run, mesh, loss, optimizer, state, donate) -> Runner:
    num_devices = mesh.devices.size
    k = workload.microbatches
    full = host_batches(workload, 1, run)
    micro = [jax.device_put({n: v[0, i::k] for n, v in full.items()}, NamedSharding(mesh, P(AXIS)))
             for i in range(k)]
    sharded = jax.shard_map(_host_micro_step(loss, optimizer, run, num_devices), mesh=mesh,
                            in_specs=(P(), P(AXIS)), out_specs=(P(), P()), check_vma=False)
    start = time.perf_counter()
    compiled = _compile(jax.jit(sharded, donate_argnums=donate), state, micro[0])
    compile_s = time.perf_counter() - start

    def step(state):
        losses = None
        for micro_batch in micro:  # one dispatch per micro-batch, as optax.MultiSteps users do
            state, losses = compiled(state, micro_batch)
        return state, losses

    return Runner(step, state, [compiled], compile_s, 1)
