"""Writes the notebooks of this folder (without outputs) from the cell sources below.

    .venv/bin/python notebooks/_build.py          # rewrite every notebook
    .venv/bin/python notebooks/_build.py 03       # only those whose name starts with 03

Edit the cells here, not in the .ipynb files, so the shared setup cell stays
identical across notebooks. CI executes the notebooks with
`pytest --nbmake notebooks` (this file is not collected: it is not test_*.py).
"""

from __future__ import annotations

import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
OWNER = "jaxopt-train"  # placeholder GitHub owner: see README.md in this folder
REPO_URL = f"https://github.com/{OWNER}/jaxopt_train"

SETUP = '''\
# Setup: install on Colab, pick the devices, choose the problem sizes.
import os
import shutil
import subprocess
import sys


def detect_accelerator() -> str:
    """'tpu', 'gpu' or 'cpu', decided *before* JAX starts a backend."""
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return "cpu"
    if os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_ACCELERATOR_TYPE") or any(
            name.startswith("accel") for name in os.listdir("/dev")):
        return "tpu"
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        return "gpu"
    return "cpu"


ACCELERATOR = detect_accelerator()
if "google.colab" in sys.modules:
    # Colab ships a jax build for its runtime; ask for the matching extra so pip
    # does not replace it with a CPU-only jaxlib.
    extra = {"gpu": ["jax[cuda12]>=0.10"], "tpu": ["jax[tpu]>=0.10"]}.get(ACCELERATOR, [])
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "git+REPO_URL.git", *extra], check=True)

import jax

if ACCELERATOR == "cpu":
    # 8 emulated CPU devices so the multi-device code paths run anywhere. This
    # must happen before JAX starts its CPU backend; on a TPU/GPU runtime the
    # real devices are used instead.
    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
        print("JAX already started its backend: restart the kernel to get 8 CPU devices")

# SMALL: tiny problem sizes so the whole notebook runs in seconds on a CPU (and in CI).
SMALL = jax.default_backend() == "cpu"
print(f"jax {jax.__version__}, backend={jax.default_backend()}, {jax.device_count()} devices "
      f"({jax.devices()[0].device_kind}), SMALL={SMALL}")
'''.replace("REPO_URL", REPO_URL)


def badge(name: str) -> str:
    url = f"https://colab.research.google.com/github/{OWNER}/jaxopt_train/blob/main/notebooks/{name}.ipynb"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def build(name: str, title: str, intro: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    # No "accelerator" entry: Colab opens on a CPU runtime (8 emulated devices, SMALL
    # mode); pick a GPU/TPU runtime to run at full size on real devices.
    nb.metadata["colab"] = {"provenance": []}
    nb.cells = [nbformat.v4.new_markdown_cell(f"{badge(name)}\n\n# {title}\n\n{intro.strip()}"),
                nbformat.v4.new_code_cell(SETUP.strip())]
    for kind, source in cells:
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(make(source.strip("\n")))
    # Stable ids keep diffs small when the builder is re-run.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name[:2]}-{i:02d}"
    return nb


def md(text: str) -> tuple[str, str]:
    return ("md", text)


def code(text: str) -> tuple[str, str]:
    return ("code", text)


NOTEBOOKS: dict[str, tuple[str, str, list]] = {}

# ----------------------------------------------------------------------------- 01
NOTEBOOKS["01_mixed_precision"] = ("Mixed precision and loss scaling", """
A precision `Policy` names three dtypes: **param** (the f32 master weights the optimizer
updates), **compute** (what forward and backward run in) and **output** (what the loss
sees). bf16 has f32's exponent range, so it needs no loss scaling; fp16 does: its smallest
normal number is 6.1e-5 (below it precision fades through the subnormals down to 6e-8,
then zero), so small gradients lose their digits or vanish unless the loss is scaled up
before the backward pass and the gradients scaled back down after it.

This notebook uses `jaxopt_train.precision`: presets, casting, and dynamic loss scaling
with a step that is skipped (and the scale backed off) when a gradient is inf/nan.
""", [
    md("## Presets"),
    code('''
import jax.numpy as jnp
import numpy as np
from jaxopt_train import precision

for name in precision.PRESETS:
    p = precision.get_policy(name)
    print(f"{name:10s} param={p.param_dtype.name:9s} compute={p.compute_dtype.name:9s} "
          f"output={p.output_dtype.name:9s} matmul={p.matmul_precision!s:14s} "
          f"loss scale: {type(precision.loss_scale_for(p)).__name__}")

custom = precision.Policy.from_string("p=f32,c=bf16,o=f32")
assert custom == precision.get_policy("bf16")
print("\\nfrom_string('p=f32,c=bf16,o=f32') == the 'bf16' preset:", custom)
'''),
    md("""
## Casting only touches floating-point leaves

Integer leaves (step counters, token ids) pass through unchanged.
"""),
    code('''
tree = {"w": jnp.ones((2, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32),
        "step": jnp.asarray(7, jnp.int32), "tokens": jnp.arange(4, dtype=jnp.int32)}
policy = precision.get_policy("fp16")
for label, cast in [("compute", policy.cast_to_compute), ("output", policy.cast_to_output)]:
    print(label, {k: v.dtype.name for k, v in cast(tree).items()})
assert policy.cast_to_compute(tree)["step"].dtype == jnp.int32
'''),
    md("""
## Why fp16 needs a loss scale

Gradients of a loss are often far below fp16's normal range. Scaling the loss by
2^15 shifts them into range; dividing the (f32) gradients by the same factor afterwards
gives the true values back.
"""),
    code('''
grads_f32 = jnp.asarray([3e-4, 2e-6, 5e-8, 1e-9], jnp.float32)
as_fp16 = grads_f32.astype(jnp.float16).astype(jnp.float32)
scale = precision.StaticLossScale(2.0**15)
scaled_fp16 = scale.scale(grads_f32).astype(jnp.float16)
recovered = scale.unscale(scaled_fp16.astype(jnp.float32))
print("true gradients        ", np.asarray(grads_f32))
print("in fp16, unscaled     ", np.asarray(as_fp16))
print("in fp16, scaled 2^15  ", np.asarray(recovered))
'''),
    md("""
## Dynamic loss scaling on a small fp16 model

A two-layer MLP with f32 master weights computes in fp16 (`policy.cast_to_compute`). One
jitted step scales the loss, takes the gradient, and calls
`precision.apply_updates_if_finite`, which unscales, applies the optimizer only when every
gradient is finite, and adjusts the `DynamicLossScale`. We start the scale absurdly high
(2^24), so the first steps overflow in fp16 and the scale backs off by itself, and we
also *inject* an inf into the gradients at two chosen steps: those steps must leave the
parameters bit-for-bit unchanged and halve the scale.
"""),
    code('''
import optax

policy = precision.get_policy("fp16")
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype(np.float32)
y = np.sin(x @ rng.normal(size=(16, 1))).astype(np.float32)
params = {"w1": jnp.asarray(rng.normal(size=(16, 64)) / 4, jnp.float32), "b1": jnp.zeros((64,), jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(64, 1)) / 8, jnp.float32), "b2": jnp.zeros((1,), jnp.float32)}


def loss_fn(params, x, y):
    p = policy.cast_to_compute(params)                     # f32 master -> fp16 compute
    h = jax.nn.relu(x.astype(policy.compute_dtype) @ p["w1"] + p["b1"])
    pred = policy.cast_to_output(h @ p["w2"] + p["b2"])   # fp16 -> f32 for the loss
    return jnp.mean((pred - y) ** 2)


optimizer = optax.adam(3e-3)


@jax.jit
def train_step(params, opt_state, loss_scale, x, y, inject_inf):
    loss, grads = jax.value_and_grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
    # Simulate an overflow on demand: one gradient entry becomes inf.
    grads["w2"] = grads["w2"].at[0, 0].set(jnp.where(inject_inf, jnp.inf, grads["w2"][0, 0]))
    loss = loss / loss_scale.loss_scale                    # the true loss, for logging
    params, opt_state, loss_scale, finite = precision.apply_updates_if_finite(
        optimizer, grads, opt_state, params, loss_scale)
    return params, opt_state, loss_scale, loss, finite
'''),
    code('''
NUM_STEPS = 60
INJECT_AT = {30, 45}
loss_scale = precision.DynamicLossScale(initial_scale=2.0**24, growth_interval=8, hysteresis=1)
opt_state = optimizer.init(params)
history = []
for step in range(NUM_STEPS):
    before = params
    scale_before = float(loss_scale.loss_scale)
    params, opt_state, loss_scale, loss, finite = train_step(
        params, opt_state, loss_scale, x, y, step in INJECT_AT)
    finite = bool(finite)
    history.append((step, scale_before, float(loss_scale.loss_scale), finite, float(loss)))
    if not finite:
        # A skipped step: parameters unchanged bit for bit, scale backed off.
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)))
        assert float(loss_scale.loss_scale) == max(scale_before / 2, 1.0)

skipped = [s for s, _, _, ok, _ in history if not ok]
print("skipped steps:", skipped, "  loss_scale.skipped_steps =", int(loss_scale.skipped_steps))
assert INJECT_AT <= set(skipped), "the injected infs must be skipped"
assert skipped[0] == 0, "a 2^24 scale overflows fp16 at the start"
print("final loss scale: 2^%d" % np.log2(float(loss_scale.loss_scale)))
for step, before, after, ok, loss in history:
    if not ok or step % 10 == 0:
        print(f"step {step:3d}  scale 2^{np.log2(before):4.1f} -> 2^{np.log2(after):4.1f}  "
              f"{'SKIPPED' if not ok else 'ok     '}  loss {loss:.4f}")
'''),
    code('''
import matplotlib.pyplot as plt

steps = [h[0] for h in history]
fig, (ax_scale, ax_loss) = plt.subplots(1, 2, figsize=(11, 3.5))
ax_scale.step(steps, [h[1] for h in history], where="post")
natural = [s for s in skipped if s not in INJECT_AT]
ax_scale.scatter(natural, [history[s][1] for s in natural], color="red", zorder=3, label="skipped: fp16 overflow")
ax_scale.scatter(sorted(INJECT_AT), [history[s][1] for s in sorted(INJECT_AT)], color="orange", marker="x",
                 s=60, zorder=3, label="skipped: injected inf")
ax_scale.set_yscale("log", base=2)
ax_scale.set(xlabel="step", ylabel="loss scale (before the step)",
             title="DynamicLossScale: back off on overflow, grow every 8 finite steps")
ax_scale.legend()
finite_steps = [h for h in history if h[3]]
ax_loss.plot([h[0] for h in finite_steps], [h[4] for h in finite_steps])
ax_loss.set(xlabel="step", ylabel="loss (unscaled)", title="training loss, fp16 compute")
fig.tight_layout()
plt.show()
'''),
    md("""
`precision.loss_scale_for(policy)` picks the right object for a policy
(`DynamicLossScale()` for fp16, `NoOpLossScale()` otherwise), and the trainer
(`jaxopt_train.train`) threads it through its jitted step the same way as above.
"""),
])

# ----------------------------------------------------------------------------- 02
NOTEBOOKS["02_gradient_accumulation"] = ("Gradient accumulation: scan vs optax.MultiSteps vs full batch", """
A batch too large for memory can be processed as K micro-batches whose gradients are
averaged. `jaxopt_train.accumulation` offers two ways:

* `accumulate_gradients(loss_fn, K)`: one compiled step, a `lax.scan` over the K
  micro-batches with f32 accumulators (the MaxText way);
* `multi_steps(optimizer, K)`: `optax.MultiSteps`, one jit call per micro-batch from the
  host; the inner optimizer steps every K calls.

For a loss that is a mean over examples both give the full-batch gradient. We show that
(max abs difference), time one optimizer step of each, run the data-parallel version
(`data_parallel_value_and_grad`: per-device scan, one `pmean` after it), and weight a
masked loss's micro-batches by the tokens they hold (`weight_fn=`).
""", [
    md("## A small model and a batch"),
    code('''
import time

import jax.numpy as jnp
import numpy as np
import optax
from jaxopt_train import accumulation

BATCH, D_IN, HIDDEN, K = (512, 64, 256, 8) if SMALL else (16384, 1024, 4096, 8)
rng = np.random.default_rng(0)
batch = {"x": rng.normal(size=(BATCH, D_IN)).astype(np.float32)}
batch["y"] = np.tanh(batch["x"] @ rng.normal(size=(D_IN, 1))).astype(np.float32)
params = {"w1": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / np.sqrt(D_IN), jnp.float32),
          "b1": jnp.zeros((HIDDEN,), jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN), jnp.float32),
          "b2": jnp.zeros((1,), jnp.float32)}


def loss_fn(params, batch):
    """Mean squared error: a mean over examples, so micro-batch means average to it."""
    h = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def max_abs_diff(a, b):
    # numpy on the host: op-by-op jnp calls would each compile a tiny kernel
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


print(f"batch {BATCH} = {K} micro-batches of {BATCH // K}; "
      f"{sum(p.size for p in jax.tree.leaves(params)):,} parameters")
'''),
    md("""
## The three gradients

* **full batch**: `jax.value_and_grad(loss_fn)` on all rows;
* **scan**: `accumulate_gradients(loss_fn, K)`; micro-batch k holds rows `k::K`;
* **MultiSteps**: `multi_steps(optax.sgd(1.0), K)` fed one micro-batch gradient per call.
  With SGD at learning rate 1 the update emitted on the K-th call is exactly minus the
  mean gradient, so we can read the accumulated gradient back from it.
"""),
    code('''
full_grad_fn = jax.jit(jax.value_and_grad(loss_fn))
scan_grad_fn = jax.jit(accumulation.accumulate_gradients(loss_fn, K))
micro_grad_fn = jax.jit(jax.value_and_grad(loss_fn))
accumulator = accumulation.multi_steps(optax.sgd(1.0), K)
accumulate_init, accumulate_update = jax.jit(accumulator.init), jax.jit(accumulator.update)

loss_full, g_full = full_grad_fn(params, batch)
loss_scan, g_scan = scan_grad_fn(params, batch)

micro_batches = [jax.tree.map(lambda x: x[k::K], batch) for k in range(K)]
state = accumulate_init(params)
for k, micro in enumerate(micro_batches):
    _, g_micro = micro_grad_fn(params, micro)
    updates, state = accumulate_update(g_micro, state, params)
    if k < K - 1:  # no optimizer step yet: MultiSteps emits zero updates
        assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
g_multi = jax.tree.map(lambda u: -np.asarray(u), updates)

print(f"loss: full {float(loss_full):.6f}  scan {float(loss_scan):.6f}")
print(f"max |scan - full|       = {max_abs_diff(g_scan, g_full):.3e}")
print(f"max |MultiSteps - full| = {max_abs_diff(g_multi, g_full):.3e}")
print(f"max |scan - MultiSteps| = {max_abs_diff(g_scan, g_multi):.3e}")
# Only the f32 summation order differs; allow more on accelerators (TF32 / bf16-pass dots).
scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(g_full))
TOL = (1e-5 if jax.default_backend() == "cpu" else 1e-4) * scale
assert max_abs_diff(g_scan, g_full) <= TOL
assert max_abs_diff(g_multi, g_full) <= TOL
'''),
    md("""
The differences are float32 rounding (summation order), a few ulp of the largest gradient.

## Time to produce the accumulated gradient

Each variant reuses the functions compiled above, so nothing new is compiled here. It is
timed over bursts of back-to-back calls with one `block_until_ready` at the end; medians
are reported. MultiSteps needs K jit calls (gradient + accumulate) per optimizer step.
"""),
    code('''
import statistics


def burst_time(fn, calls=5, repeats=3):
    """Median seconds per fn() over bursts of back-to-back calls."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = [fn() for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def multi_steps_gradient():
    state = accumulate_init(params)
    for micro in micro_batches:
        _, g_micro = micro_grad_fn(params, micro)
        updates, state = accumulate_update(g_micro, state, params)
    return updates


timings = {
    "full batch": burst_time(lambda: full_grad_fn(params, batch)),
    f"scan, K={K}": burst_time(lambda: scan_grad_fn(params, batch)),
    f"MultiSteps, K={K}": burst_time(multi_steps_gradient),
}
base = timings["full batch"]
for name, seconds in timings.items():
    print(f"{name:18s} {seconds * 1e3:8.2f} ms   {seconds / base:5.2f}x full batch")
'''),
    code('''
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 2.8))
ax.barh(list(timings), [t * 1e3 for t in timings.values()])
ax.set(xlabel="ms per accumulated gradient (median)", title=f"batch {BATCH}, {jax.devices()[0].platform}")
fig.tight_layout()
plt.show()
'''),
    md("""
On a CPU the scan costs about the same as the full batch (same FLOPs, smaller
activations); MultiSteps pays K host round trips per optimizer step. On an accelerator
the full batch may simply not fit, which is what accumulation is for.

## Data parallel: scan per device, one all-reduce after it

`data_parallel_value_and_grad(loss_fn, K, "data")` runs inside `jax.shard_map`: each
device scans over its own micro-batches, then a single `pmean` averages loss and gradients
across devices. The result is still the full-batch gradient.
"""),
    code('''
from jax.sharding import NamedSharding, PartitionSpec as P

n = jax.device_count()
mesh = jax.make_mesh((n,), ("data",))
accumulation.check_divisible(BATCH, K, n)  # raises, naming the numbers, if the batch does not split
dp_grad = jax.jit(jax.shard_map(
    accumulation.data_parallel_value_and_grad(loss_fn, K, "data"),
    mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
replicated = jax.device_put(params, NamedSharding(mesh, P()))
loss_dp, g_dp = dp_grad(replicated, sharded_batch)
print(f"{n} devices x {K} micro-batches of {BATCH // (n * K)} rows")
print(f"max |data parallel - full| = {max_abs_diff(g_dp, g_full):.3e}   loss {float(loss_dp):.6f}")
assert max_abs_diff(g_dp, g_full) <= TOL
'''),
    md("""
## A masked loss: micro-batches weighted by what they hold

A loss that is a mean over *tokens that count* (padding masked out) is not a mean over
examples: micro-batches hold different numbers of tokens, and the mean of their means
over-weights the short ones. `weight_fn(batch)` says what the loss is a mean over; each
micro-batch (and, data-parallel, each device) then counts by it, which gives the full
batch's masked mean again. Here each row keeps a random share of its 16 outputs.
"""),
    code('''
T = 16
mask = (np.arange(T)[None] < rng.integers(1, T + 1, (BATCH, 1))).astype(np.float32)
masked = {"x": batch["x"], "y": np.repeat(batch["y"], T, axis=1), "mask": mask}


def masked_loss(params, batch):
    """Squared error over the unmasked outputs only: a mean over tokens, not rows."""
    h = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"])
    err = (h @ params["w2"] + params["b2"] - batch["y"]) ** 2  # [rows, T]
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


_, g_masked = jax.jit(jax.value_and_grad(masked_loss))(params, masked)
_, g_means = jax.jit(accumulation.accumulate_gradients(masked_loss, K))(params, masked)
_, g_weighted = jax.jit(accumulation.accumulate_gradients(
    masked_loss, K, weight_fn=lambda b: b["mask"].sum()))(params, masked)
print(f"mean of micro-batch means: max |diff| = {max_abs_diff(g_means, g_masked):.3e}")
print(f"token-weighted:            max |diff| = {max_abs_diff(g_weighted, g_masked):.3e}")
assert max_abs_diff(g_weighted, g_masked) <= TOL < max_abs_diff(g_means, g_masked)
'''),
])

# ----------------------------------------------------------------------------- 03
NOTEBOOKS["03_ring_reductions"] = ("Ring all-reduce vs lax.psum", """
Data-parallel training sums gradients across devices once per step. XLA's `lax.psum`
hands that to the backend (NCCL on GPUs). `jaxopt_train.collectives` also builds the
reduction explicitly from `lax.ppermute` steps, so its schedule can be inspected and
changed: a ring (reduce-scatter then all-gather), a bidirectional ring (two rings in
opposite directions, each over half the data) and a hierarchical one (rings inside
groups, then across groups: the multi-host layout).

On a CPU runtime this runs on 8 emulated devices (the numbers are memory copies, not a
network); on a multi-GPU or TPU runtime it uses the real devices.
""", [
    md("## The ring"),
    code('''
import functools
import statistics
import time

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxopt_train import collectives

devices = jax.devices()
n = len(devices)
if n < 2:
    print(f"only {n} device: every reduction is a copy. Use a CPU runtime (8 emulated devices), "
          "a TPU runtime or a multi-GPU machine to see rings at work.")
order = collectives.ring_order(devices)  # process, TPU coordinates, NVLink neighbours
print(collectives.describe_ring(devices, order))
mesh = jax.make_mesh((n,), ("data",))
'''),
    md("""
## Every method equals `lax.psum`

`all_reduce_tree(tree, "data", method=...)` runs inside `jax.shard_map`; each device holds
its own shard and gets back the sum over all devices. On integer-valued float32 data every
summation order is exact, so the results must be bit-equal; on random data they differ by
rounding only. (`bucket_mb=0`: one bucket per leaf, here the whole array.)
"""),
    code('''
def peer_runs_here() -> bool:
    """"peer" is one Mosaic GPU kernel for exactly 2 Hopper GPUs driven by this process."""
    try:
        collectives.peer.check_platform()
    except (ValueError, NotImplementedError):
        return False
    return n == 2


METHODS = tuple(m for m in collectives.METHODS if m != "peer" or peer_runs_here())
print("methods:", METHODS)
SIZES = [4096, 32768, 262144] if SMALL else [2**12, 2**16, 2**20, 2**24, 2**26]  # float32 per device


@functools.cache
def all_reduce(method, size):
    """Jitted shard_map all-reduce for one method and per-device size (compiled once)."""
    kwargs = {"group_size": n // 2} if method == "hierarchical" and n >= 4 and n % 2 == 0 else {}
    body = lambda x: collectives.all_reduce_tree(x, "data", method=method, bucket_mb=0, **kwargs)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))


def sharded(values):
    return jax.device_put(values, NamedSharding(mesh, P("data")))


rng = np.random.default_rng(0)
size = SIZES[0]
integers = sharded(rng.integers(-1000, 1000, size=n * size).astype(np.float32))
normals = sharded(rng.normal(size=n * size).astype(np.float32))
reference_int = np.asarray(all_reduce("psum", size)(integers))
reference = np.asarray(all_reduce("psum", size)(normals))
for method in METHODS:
    exact = np.array_equal(np.asarray(all_reduce(method, size)(integers)), reference_int)
    diff = np.max(np.abs(np.asarray(all_reduce(method, size)(normals)) - reference))
    ulp = diff / np.spacing(np.max(np.abs(reference)))
    print(f"{method:13s} integer data bit-equal: {exact}   random data max |diff| = {diff:.2e} ({ulp:.1f} ulp)")
    assert exact, method
'''),
    md("""
## Bandwidth

Bus bandwidth, as NCCL reports it: `2 (n-1)/n * bytes / time`, the traffic each link
carries in an optimal ring, so the figure is comparable across device counts. Each
point is the median of bursts of back-to-back calls. On emulated CPU devices this is
memory bandwidth shared by all "devices"; on GPUs it is the NVLink/PCIe fabric.
"""),
    code('''
def burst_seconds(fn, x, calls, repeats=3):
    jax.block_until_ready(fn(x))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn(x) for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


bus_factor = 2 * (n - 1) / n if n > 1 else 1.0
results = {method: [] for method in METHODS}
for size in SIZES:
    x = sharded(rng.normal(size=n * size).astype(np.float32))
    for method in METHODS:
        seconds = burst_seconds(all_reduce(method, size), x, calls=5 if SMALL else 20)
        results[method].append(bus_factor * size * 4 / seconds / 1e9)

print(f"bus bandwidth, GB/s ({n} x {jax.devices()[0].device_kind})")
print(f"{'bytes/device':>14s}" + "".join(f"{m:>14s}" for m in METHODS))
for i, size in enumerate(SIZES):
    print(f"{size * 4:14,d}" + "".join(f"{results[m][i]:14.2f}" for m in METHODS))
print("ratio to psum at the largest size: " + ", ".join(
    f"{m} {results[m][-1] / results['psum'][-1]:.2f}x" for m in METHODS[1:]))
'''),
    code('''
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
for method in METHODS:
    ax.plot([s * 4 for s in SIZES], results[method], marker="o", label=method)
ax.set(xscale="log", xlabel="bytes per device", ylabel="bus bandwidth (GB/s)",
       title=f"all-reduce over {n} {jax.devices()[0].platform.upper()} devices")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()
'''),
    md("""
Use the winner in training with `Trainer(..., grad_sync="ring")` or
`jaxopt-train train --grad-sync ring`; `jaxopt-train bench collectives` runs the full sweep
(sizes up to 1 GiB, f32 and bf16, ring chunks, the bf16-wire variants, and with `--gpt` a
data-parallel GPT step per grad-sync method) and writes JSON with `--json`.
"""),
])

# ----------------------------------------------------------------------------- 04
NOTEBOOKS["04_tiled_matmul"] = ("The tiled matmul kernel", """
`jaxopt_train.kernels.matmul(a, b, bias=, activation=, out_dtype=, backend=)` computes
`activation(a @ b + bias)` with f32 accumulation behind one differentiable API, over
several kernel backends: a warp-specialised Pallas **Mosaic GPU** kernel (Hopper), a
**Triton** kernel through jax-triton, a Pallas BlockSpec kernel on **TPU**, that same
BlockSpec kernel in **interpret** mode (any platform, slow: for checking), and plain
**XLA** `jnp.dot`. Precision rule: inputs share one dtype (bf16, f16 or f32; f32 is
rounded to bf16, the tensor-core input type), products accumulate in f32, the epilogue
runs in f32, the result is cast to `out_dtype`.

On a CPU runtime the kernel runs in interpret mode on small matrices; on a GPU/TPU
runtime the fastest available backend runs at real sizes.
""", [
    md("## Backends available here"),
    code('''
import functools
import statistics
import time

import jax.numpy as jnp
import numpy as np
from jaxopt_train import kernels

available = kernels.available_backends()  # fastest first; always ends with interpret, xla
BACKEND = available[0]
print("available backends:", available, "-> using", repr(BACKEND))
# The interpreter runs the kernel's grid step by step: keep its problems tiny.
SIZES = [64, 128, 256] if BACKEND == "interpret" else [1024, 2048, 4096, 8192]
# An explicit tiling (powers of two >= 8); the GPU kernels keep their tuned defaults.
TILES = kernels.MatmulConfig(block_m=32, block_n=32, block_k=32, num_stages=1) \\
    if BACKEND in ("interpret", "pallas_tpu") else None


def max_rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))
'''),
    md("""
## Correctness against `jnp.dot`

Two cases: a square bf16 product, and an f32 batched product with awkward sizes
(nothing a multiple of the tile: the wrapper pads) plus a fused bias + GELU epilogue.
References: `jnp.dot` at `Precision.HIGHEST` in f32 on the bf16-rounded inputs (what the
kernel is specified to compute), and `kernels.matmul_reference` (the same rule in plain
`jnp`, with `jax.nn.gelu`).
"""),
    code('''
rng = np.random.default_rng(0)
normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # host data: nothing to compile
highest = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)

# Case 1: bf16 (64, 64) @ (64, 64), bf16 out.
a, b = normal(64, 64).astype(jnp.bfloat16), normal(64, 64).astype(jnp.bfloat16)
plain = jax.jit(functools.partial(kernels.matmul, backend=BACKEND))
out = plain(a, b)
want = highest(a.astype(np.float32), b.astype(np.float32))
err = max_rel_err(out, want)
print(f"bf16 64x64x64             out {out.dtype}  max rel err vs jnp.dot(HIGHEST) {err:.1e}  (bf16 eps 7.8e-3)")
assert err <= 2**-8

# Case 2: f32 (2, 48, 40) @ (40, 24) + bias, GELU, f32 out, explicit 32x32x32 tiles.
a2, b2, bias2 = normal(2, 48, 40), normal(40, 24), normal(24)
fused = jax.jit(functools.partial(kernels.matmul, activation="gelu", out_dtype=jnp.float32,
                                  backend=BACKEND, config=TILES))
out2 = fused(a2, b2, bias=bias2)


@jax.jit
def references(a, b, bias):
    rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    gelu = functools.partial(jax.nn.gelu, approximate=True)
    return (gelu(highest(rounded(a), rounded(b)) + bias),   # what the kernel is specified to compute
            kernels.matmul_reference(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32),
            gelu(highest(a, b) + bias))                     # f32 inputs, no bf16 rounding


want2, ref2, unrounded = references(a2, b2, bias2)
print(f"f32 (2,48,40)x(40,24)+gelu out {out2.dtype} {out2.shape}: max rel err vs jnp.dot(HIGHEST) "
      f"{max_rel_err(out2, want2):.1e}, vs matmul_reference {max_rel_err(out2, ref2):.1e}")
print(f"  (vs the f32 product without bf16 input rounding: {max_rel_err(out2, unrounded):.1e}: "
      "the documented price of tensor-core inputs)")
assert max_rel_err(out2, want2) <= 1e-5 and max_rel_err(out2, ref2) <= 1e-5
'''),
    md("""
## Gradients

`matmul` is a `jax.custom_vjp`: the backward pass runs `dA = dZ @ B^T` and `dB = A^T @ dZ`
through the same kernel (and recomputes the pre-activation rather than storing it).
Compare with autodiff through the reference.
"""),
    code('''
def kernel_loss(a, b, bias):
    return jnp.sum(kernels.matmul(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32,
                                  backend=BACKEND, config=TILES) ** 2)


def reference_loss(a, b, bias):
    return jnp.sum(kernels.matmul_reference(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32) ** 2)


a3 = normal(48, 40)
grads = jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2)))(a3, b2, bias2)
reference_grads = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)))(a3, b2, bias2)
for name, g, r in zip(("dA", "dB", "dbias"), grads, reference_grads):
    print(f"{name:6s} {str(g.shape):9s} max rel err {max_rel_err(g, r):.1e}")
    # The backward matmuls round dZ to bf16 (the kernel's input type): bf16-level agreement.
    assert max_rel_err(g, r) <= 2e-2
'''),
    md("""
## Throughput

TFLOP/s of the kernel next to XLA's `jnp.dot` on the same bf16 operands, both jitted,
timed over bursts of back-to-back calls (median). In interpret mode the kernel is a
correctness tool: expect it to be far slower than XLA. On an H100/H200 `jaxopt-train bench
matmul` runs the full sweep (on an H200 the Mosaic GPU kernel measured 0.96-1.00x XLA at
8192^3, and 1.10-1.18x XLA's dot + bias + GELU at 16384x8192x2048 with its fused epilogue,
depending on the session: `BENCHMARKS.md`).
"""),
    code('''
def burst_seconds(fn, *args, calls, repeats=3):
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


xla = jax.jit(functools.partial(kernels.matmul, backend="xla"))
tflops = {BACKEND: [], "xla": []}
for size in SIZES:
    x, y = normal(size, size).astype(jnp.bfloat16), normal(size, size).astype(jnp.bfloat16)
    calls = 3 if BACKEND == "interpret" else 20
    for name, fn in ((BACKEND, plain), ("xla", xla)):
        tflops[name].append(2 * size**3 / burst_seconds(fn, x, y, calls=calls) / 1e12)
    print(f"{size:5d}^3  {BACKEND} {tflops[BACKEND][-1]:9.4f} TFLOP/s   xla {tflops['xla'][-1]:9.4f} TFLOP/s"
          f"   ratio {tflops[BACKEND][-1] / tflops['xla'][-1]:.3f}")
'''),
    code('''
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
for name, values in tflops.items():
    ax.plot(SIZES, values, marker="o", label=name)
ax.set(xscale="log", yscale="log", xlabel="M = N = K (bf16)", ylabel="TFLOP/s",
       title=f"matmul on {jax.devices()[0].device_kind}")
ax.set_xticks(SIZES, [str(s) for s in SIZES])
ax.minorticks_off()
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()
'''),
    md("""
## Tuning the tiling

`kernels.autotune(shapes, backend=...)` runs each candidate tiling once against the
reference, times the ones that pass, and caches the fastest per device kind, jax version,
operand layout and shape, under the exact shape and its bucket (each dim rounded up to a
power of two; a lookup tries the exact shape first) in
`$JAXOPT_TRAIN_CACHE_DIR/matmul_autotune.json`; `matmul` reads that cache before its
shipped defaults. On Mosaic GPU and Triton, `transposed="a"` / `"b"` tunes the A^T @ B and
A @ B^T kernels that a dense layer's backward runs; each layout keeps its own entries.
Here: two tilings of the interpreter on CPU, the quick list on a GPU.
"""),
    code('''
import importlib
import os
import tempfile

autotune_mod = importlib.import_module("jaxopt_train.kernels.autotune")  # the module, not the function
matmul_mod = importlib.import_module("jaxopt_train.kernels.matmul")
os.environ["JAXOPT_TRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxopt_train_nb04_")
if BACKEND == "interpret":
    shape, candidates = (64, 64, 64), [kernels.MatmulConfig(block_m=b, block_n=b, block_k=b,
                                                            num_stages=1) for b in (16, 32)]
else:
    shape, candidates = (4096, 4096, 4096), autotune_mod.default_candidates(BACKEND, quick=True)
winner = kernels.autotune([shape], backend=BACKEND, candidates=candidates, budget_s=60)[shape]
print(f"{BACKEND} {shape}: {winner}")
assert matmul_mod.resolve_config(BACKEND, *shape, jnp.bfloat16) == winner  # what matmul now uses
print("cache:", autotune_mod.cache_path())
'''),
    md("""
To run a Flax model's dense layers through the kernel, pass
`dot_general=kernels.make_dot_general(BACKEND)` to `nnx.Linear` / `linen.Dense`, or set
`GPTConfig.dot_general` (the trainer's `--matmul pallas|triton` does this).
"""),
])

# ----------------------------------------------------------------------------- 05
NOTEBOOKS["05_end_to_end"] = ("End to end: train gpt-tiny, then benchmark the training step", """
The pieces of the previous notebooks meet in the trainer: `jaxopt_train.train.train(config)`
builds a GPT, shards the batch over every device, runs the data-parallel step (precision
policy, loss scaling, scan accumulation, one gradient all-reduce), logs metrics to
`metrics.jsonl`, evaluates and checkpoints. Then `jaxopt_train.bench.train` measures a
baseline training step against the optimised one in the same process and writes a table
and a memory/throughput plot.

On a CPU runtime both run in small mode (a 1-layer gpt-tiny, a few dozen steps, the
benchmark's `--quick` mode); on a GPU/TPU runtime they run at full gpt-tiny size.
""", [
    md("## Train"),
    code('''
import os
import tempfile

from jaxopt_train import runtime
from jaxopt_train import train as jt

work_dir = tempfile.mkdtemp(prefix="jaxopt_train_nb05_")
n = jax.device_count()
if SMALL:
    # One layer and 32-token windows: the shapes of the benchmark's --quick model below, so
    # the second run reuses the small kernels JAX compiled here (CPU compile time dominates).
    sizes = dict(steps=30, batch_size=16, seq_len=32, log_every=3, eval_every=15,
                 model_overrides={"n_layers": 1}, precision="fp32")
else:
    # bf16 needs bf16 tensor cores: a T4 (Colab's default GPU, compute capability 7.5) has
    # fp16 ones only and would run bf16 matmuls in float32; fp16 trains with loss scaling.
    pre_ampere = ACCELERATOR == "gpu" and float(jax.devices()[0].compute_capability) < 8.0
    sizes = dict(steps=300, batch_size=8 * n, log_every=10, eval_every=100,
                 precision="fp16" if pre_ampere else "bf16")
config = jt.TrainConfig(preset="gpt-tiny", lr=3e-3, warmup=5, eval_batches=2, checkpoint_every=0,
                        run_dir=os.path.join(work_dir, "run"), progress="lines", **sizes)
result = jt.train(config)
print(f"\\nstopped at step {result.step}: train loss {result.final_loss:.3f}, eval loss {result.eval_loss:.3f}")
print("run directory:", sorted(os.listdir(result.run_dir)))
'''),
    md("""
## Metrics

Every `log_every` steps the loop appends one JSON line: loss, throughput, step time,
gradient norm, loss scale, skipped steps, learning rate (plus MFU and peak memory on known
accelerators, and NVML GPU fields while a GPU monitor runs). `jaxopt-train plot RUN_DIR`
draws the same curves from the command line.
"""),
    code('''
records = runtime.read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))
print(f"{len(records)} records; fields: {sorted(records[-1])}")
print(f"{'step':>5s} {'loss':>8s} {'eval':>8s} {'tokens/s':>10s} {'grad norm':>10s} {'lr':>9s}")
for r in records:
    eval_loss = f"{r['eval_loss']:8.3f}" if "eval_loss" in r else " " * 8
    print(f"{r['step']:5d} {r['loss']:8.3f} {eval_loss} {r['tokens_per_s']:10,.0f} "
          f"{r['grad_norm']:10.3f} {r['lr']:9.2e}")
assert records[-1]["loss"] < records[0]["loss"], "the loss should go down"
'''),
    code('''
import matplotlib.pyplot as plt

steps = [r["step"] for r in records]
fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 3.5))
ax_loss.plot(steps, [r["loss"] for r in records], marker=".", label="train")
evals = [r for r in records if "eval_loss" in r]
ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", label="eval")
ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="gpt-tiny on the embedded corpus")
ax_loss.legend()
ax_tput.plot(steps, [r["tokens_per_s"] for r in records], marker=".")
ax_tput.set(xlabel="step", ylabel="tokens/s", title=f"throughput on {n} x {jax.devices()[0].device_kind}")
fig.tight_layout()
plt.show()
'''),
    md("""
## Benchmark: baseline vs optimised training step

`jaxopt_train.bench.train` (the `jaxopt-train bench train` command) runs, on the same model
and global batch, a **baseline** (f32, host-loop micro-batches with `optax.MultiSteps`, no
donation, one step per dispatch) and the **optimised** step (bf16 compute with f32 master
weights and their bf16 copy kept in the state, scan accumulation with one all-reduce,
donated state, remat chosen to fit memory, the fastest gradient all-reduce, several steps
per dispatch), and reports step time,
throughput, TFLOP/s, MFU, peak memory, compile time and the cost of an epoch. It writes
`train_bench.md`, `train_bench.json` and `train_bench.png` to `--out`.

On a CPU the figures only show that everything runs: bf16 is emulated there, so the
"optimised" step can be the slower one; the ratios mean something on an accelerator. XLA
flag presets only apply before JAX starts its backend, so here (the backend is already
running) the bench says its preset was not applied; the command line applies it.
"""),
    code('''
from jaxopt_train.bench import train as bench_train

bench_dir = os.path.join(work_dir, "bench")
if SMALL:
    # --quick: 1-layer gpt-tiny, 32 tokens, a few steps. The global batch must split into
    # 2 micro-batches on every device.
    bench_args = ["--quick", "--global-batch", str(2 * n * max(1, 4 // n)), "--no-scaling"]
else:
    bench_args = ["--model", "gpt-tiny", "--global-batch", str(8 * n)]
status = bench_train.main(bench_args + ["--out", bench_dir])
assert status == 0
print("\\nwrote", sorted(os.listdir(bench_dir)))
'''),
    md("The table as Markdown, and the memory-in-use / throughput curve per traced step:"),
    code('''
from IPython.display import Image, Markdown, display

with open(os.path.join(bench_dir, "train_bench.md")) as f:
    display(Markdown(f.read()))
display(Image(filename=os.path.join(bench_dir, "train_bench.png")))
'''),
    md("""
From a shell, the same runs are

    jaxopt-train train --preset gpt-tiny --steps 300
    jaxopt-train bench train --model gpt-124m --out bench_out     # on a GPU
    jaxopt-train plot runs/<run>
"""),
])


def main(argv: list[str]) -> int:
    wanted = [name for name in NOTEBOOKS if not argv or any(name.startswith(a) for a in argv)]
    for name in wanted:
        title, intro, cells = NOTEBOOKS[name]
        path = HERE / f"{name}.ipynb"
        nbformat.write(build(name, title, intro, cells), path)
        print("wrote", path.relative_to(HERE.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
