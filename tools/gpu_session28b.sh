#!/usr/bin/env bash
# Twenty-eighth session, call C (~6 min on nvidia-h200), on the tree after this session's
# review fixes: jax 0.11's AbstractMesh.manual_axes (to_varying reads it) inside and outside
# shard_map; gpt-tiny in fp16 with gradients in fp16 (--grad-dtype compute) over 2 micro-batches
# (the fp16 means now divide before they sum); fp16 matmul gradients with a wider output on
# each kernel (the bias gradient was inf); the gpt-1b trainer step with its bf16 AdamW
# moments now rounded stochastically (call A: 0.087 s, 55.5-55.8% MFU, eval 3.0927); then every
# GPU test outside tests/test_kernels_gpu.py.
#   bash tools/gpu_session28b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s28b_out}; R=/tmp/s28b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
cat > "$R/varying.py" <<'PYEOF'
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jaxopt_train.accumulation import data_parallel_value_and_grad
print("jax", jax.__version__, "manual_axes" , hasattr(jax.sharding.get_abstract_mesh(), "manual_axes"))
mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
params = {"w": jnp.ones((4, 2), jnp.float32)}
batch = {"x": jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4)}
fn = data_parallel_value_and_grad(loss, 2, axis_name="data")
sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
l, g = sharded(params, batch)
l_ref, g_ref = jax.value_and_grad(loss)(params, batch)
np.testing.assert_allclose(l, l_ref, rtol=1e-5); np.testing.assert_allclose(g["w"], g_ref["w"], rtol=1e-5)
vm = jax.vmap(fn, in_axes=(None, 0), axis_name="data")(params, jax.tree.map(lambda x: x[None], batch))
np.testing.assert_allclose(vm[0][0], l_ref, rtol=1e-5)
print("to_varying under shard_map and vmap: OK")
PYEOF
STEP_TAIL=4 step varying 60 $PY "$R/varying.py"
cat > "$R/f16_dbias.py" <<'PYEOF'
import jax, jax.numpy as jnp, numpy as np
from jaxopt_train.kernels import matmul
from jaxopt_train.kernels.matmul import available_backends
rng = np.random.default_rng(0)
a = jnp.asarray(rng.normal(size=(512, 256)), jnp.float16)
b = jnp.asarray(rng.normal(size=(256, 384)) / 16, jnp.float16)
bias = jnp.asarray(rng.normal(size=(384,)), jnp.float16)
def ref(a, b, bias):
    z = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest") + bias.astype(jnp.float32)
    return jnp.sum(jax.nn.silu(z) * 3.0)
want = jax.grad(ref, argnums=(0, 1, 2))(a, b, bias)
for backend in [x for x in ("mosaic_gpu", "triton", "xla") if x in available_backends()]:
    got = jax.grad(lambda a, b, c: jnp.sum(matmul(a, b, bias=c, activation="silu", out_dtype=jnp.float32,
                                                  backend=backend) * 3.0), argnums=(0, 1, 2))(a, b, bias)
    errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / float(jnp.max(jnp.abs(w)))) for g, w in zip(got, want)]
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    print(backend, "finite", finite, "rel err dA dB dbias", ["%.2e" % e for e in errs])
    assert finite and max(errs) < 2e-2, backend
print("fp16 dbias under f32 out: OK")
PYEOF
STEP_TAIL=5 step f16_dbias 90 $PY "$R/f16_dbias.py"
TINY="-m jaxopt_train.train.cli --preset gpt-tiny --batch-size 16 --microbatches 2 --precision fp16 \
  --grad-dtype compute --log-every 10 --eval-every 30 --checkpoint-every 0 --progress lines --overwrite"
STEP_TAIL=6 step tiny_fp16 90 $PY $TINY --steps 30 --run-dir /tmp/s28b_tiny
STEP_TAIL=5 step gpt1b_sr 130 $PY $GPT1B_TRAIN --run-dir /tmp/s28b_x
STEP_TAIL=8 step others 200 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests --ignore=tests/test_kernels_gpu.py
finish s28b 30
