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
    nb.metadata["colab"] = {"provenance": []}
    nb.metadata["accelerator"] = "GPU"
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
normal number is 6e-5, so small gradients underflow to zero unless the loss is scaled up
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
