"""Two processes x 4 CPU devices (jax.distributed on localhost) against one process x 8 devices.

JAX aborts a process whose peer never arrives (SIGABRT, not an exception), so
the workers run as subprocesses, each with a timeout, and a dying peer must
make the other exit non-zero within a bounded time.
"""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

# Shared by the workers and the in-process reference: builds the inputs from
# fixed numbers and runs the ring functions and two data-parallel SGD steps.
SHARED = r'''
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxopt_train.collectives import (all_reduce_tree, ring_all_gather, ring_all_reduce,
                                      ring_reduce_scatter)

def compute():
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    rng = np.random.default_rng(0)
    # Integer-valued f32: every partial sum is exact, so any ring order gives psum's bits.
    host = {"x": rng.integers(-8, 9, (8 * 16, 3)).astype(np.float32),
            "y": rng.integers(-8, 9, (8 * 16,)).astype(np.float32)}
    sharding = NamedSharding(mesh, P("data"))
    glob = {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in host.items()}

    def body(x, y):
        w = jnp.zeros((3,), jnp.float32)
        for _ in range(2):
            g = jax.grad(lambda w: jnp.sum((x @ w - y) ** 2))(w)
            g = all_reduce_tree({"w": g}, "data", method="hierarchical")["w"]
            w = w - jnp.float32(2.0**-12) * g
        rs = ring_reduce_scatter(x, "data")
        return {"ar": ring_all_reduce(x, "data"), "ar_bidir": ring_all_reduce(x, "data", bidirectional=True),
                "psum": lax.psum(x, "data"), "rs": lax.all_gather(rs, "data", axis=0, tiled=True),
                "ag": ring_all_gather(x, "data"), "tree_ring": all_reduce_tree(x, "data", method="ring"),
                "w": w}

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(),
                               check_vma=False))
    out = fn(glob["x"], glob["y"])
    return {k: np.asarray(v.addressable_data(0)).tolist() for k, v in out.items()}
'''

WORKER = r'''
import json, os, sys
process_id, port, mode, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
import jax
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=20, heartbeat_timeout_seconds=5, shutdown_timeout_seconds=5)
assert jax.device_count() == 8 and jax.local_device_count() == 4, (jax.device_count(), jax.local_device_count())
if mode == "die" and process_id == 1:
    os._exit(3)  # a crash: no shutdown handshake
''' + SHARED + r'''
result = compute()
# Unequal pools on the two hosts (1000 and 1010 bytes): both must see the smaller one.
from jaxopt_train.train import step as train_step
train_step.device_pool_limit = lambda device: 1000 + 10 * process_id
# One write: XLA's own logging shares the pipe and may land between print()'s pieces.
sys.stdout.write(f"smallest_pool {train_step.smallest_pool(jax.devices())}\n")
sys.stdout.flush()
# Typed PRNG keys (nnx.Dropout's stream) replicate across processes (np.asarray of a key
# failed), and a batch lands on a mesh whose devices alternate between the processes
# (each process holds rows 0-1, 4-5, ...: not one contiguous range).
from jax.sharding import PartitionSpec as P
by_process = {p: sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in (0, 1)}
interleaved = jax.sharding.Mesh(np.asarray([d for pair in zip(by_process[0], by_process[1]) for d in pair]), ("data",))
key = train_step.replicate({"k": jax.random.key(7)}, interleaved)["k"]
assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(7))
np.testing.assert_array_equal(np.asarray(jax.random.key_data(key).addressable_data(0)),
                              np.asarray(jax.random.key_data(jax.random.key(7))))
host = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
placed = train_step.place_batch({"x": host}, interleaved, P("data"))["x"]
for shard in placed.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
# ZeRO's elementwise check runs on this process's CPU device (it took process 0's everywhere).
from jaxopt_train.zero import elementwise_mismatch
import optax
assert elementwise_mismatch(optax.adam(1e-3), {"w": np.ones((8, 4), np.float32)}, 2) is None
sys.stdout.write("placement ok\n")
sys.stdout.flush()
if process_id == 0:
    with open(out_path, "w") as f:
        json.dump(result, f)
jax.distributed.shutdown()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _communicate_all(procs, timeout: float, what: str) -> list[tuple[str, int]]:
    """[(output, returncode)] of each process; all are killed and the test fails if one runs
    past `timeout` seconds (counted for each in turn, as the processes run together)."""
    outputs = []
    for proc in procs:
        try:
            outputs.append((proc.communicate(timeout=timeout)[0], proc.returncode))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{what} hung")
    return outputs


def _launch(tmp_path, mode: str, timeout: float):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "result.json"
    port = str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, mode, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    start, results = time.monotonic(), []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"multi-process {mode!r} run hung past {timeout} s")
        results.append((proc.returncode, output))
    return results, time.monotonic() - start, out


def test_two_processes_match_one_process_with_eight_devices(tmp_path):
    results, _, out = _launch(tmp_path, "ok", timeout=120)
    for rc, output in results:
        assert rc == 0, output[-3000:]
        assert "smallest_pool 1000" in output  # step.smallest_pool: one value for all hosts
        assert "placement ok" in output
    multi = json.loads(out.read_text())
    namespace: dict = {}
    exec(SHARED, namespace)  # noqa: S102 (our own code, shared with the workers)
    single = namespace["compute"]()
    assert set(multi) == set(single)
    for key in single:
        np.testing.assert_array_equal(np.asarray(multi[key]), np.asarray(single[key]), err_msg=key)
    np.testing.assert_array_equal(np.asarray(single["ar"]), np.asarray(single["psum"]))
    assert np.any(np.asarray(single["w"]) != 0)


def test_dead_peer_makes_the_other_process_exit_nonzero_in_bounded_time(tmp_path):
    results, elapsed, _ = _launch(tmp_path, "die", timeout=90)
    (rc0, output0), (rc1, _) = results
    assert rc1 == 3
    assert rc0 != 0, output0[-3000:]
    assert elapsed < 90


# Two processes x 1 device train one run; SIGTERM reaches them before different steps, as a
# preemption's signals do. A process stopping alone would leave its peer in the next step's
# all-reduce and both would abort with no checkpoint; they must agree on one stop step.
TRAIN_WORKER = r'''
import os, signal, sys
process_id, port, run_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
import jax
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=20, heartbeat_timeout_seconds=5, shutdown_timeout_seconds=5)
from jaxopt_train.train import TrainConfig, loop
real = loop.dispatch_batch
signal_at = 3 + 2 * process_id  # process 0 before step 3, process 1 before step 5

def dispatch(task, step, k):
    if step == signal_at:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(task, step, k)

loop.dispatch_batch = dispatch
cfg = TrainConfig(steps=40, batch_size=4, log_every=4, eval_every=0, checkpoint_every=0, eval_batches=1,
                  run_dir=run_dir, progress="lines", seq_len=16,
                  model_overrides={"d_model": 16, "n_layers": 1, "n_heads": 2})
result = loop.train(cfg, stream=open(os.devnull, "w"))
sys.stdout.write(f"stopped step={result.step} interrupted={result.interrupted}\n")
sys.stdout.flush()
jax.distributed.shutdown()
'''


def test_a_signal_on_one_process_stops_every_process_at_one_step(tmp_path):
    from jaxopt_train.train.checkpoint import existing_checkpoint_steps

    script = tmp_path / "train_worker.py"
    script.write_text(TRAIN_WORKER)
    run_dir, port = str(tmp_path / "run"), str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, run_dir], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = _communicate_all(procs, 150, "two-process training after a signal")
    lines = []
    for output, rc in outputs:
        assert rc == 0, output[-3000:]
        lines.append([line for line in output.splitlines() if line.startswith("stopped ")])
    # Process 0's signal, sent before dispatching step 3 (steps 0..2 done), joins the agreement
    # after that dispatch (step 4) and is read one dispatch later: both stop at 5, before
    # process 1 would have stopped on its own.
    assert lines == [["stopped step=5 interrupted=True"]] * 2, outputs
    assert existing_checkpoint_steps(run_dir) == [5]


def _cli_job(tmp_path, per_process=((), ())):
    """Runs `jaxopt-train train` as a two-process job (1 CPU device each) on one tiny run;
    `per_process[i]` are extra flags of process i. Returns [(output, returncode)], run_dir."""
    run_dir, port = str(tmp_path / "run"), str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1",
           "JAX_NUM_CPU_DEVICES": "1"}
    argv = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--distributed-timeout", "30",
            "--steps", "4", "--batch-size", "4", "--seq-len", "16", "--model", "d_model=16",
            "--model", "n_layers=1", "--model", "n_heads=2", "--log-every", "2", "--eval-every", "0",
            "--eval-batches", "1", "--checkpoint-every", "0", "--progress", "lines", "--run-dir", run_dir]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxopt_train.train.cli", *argv, "--process-id", str(i),
                               *per_process[i]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    return _communicate_all(procs, 150, "the two-process CLI run"), run_dir


def test_the_train_cli_joins_a_two_process_job_from_its_flags(tmp_path):
    """`jaxopt-train train` had no way to call jax.distributed.initialize(): a multi-host run
    needed a Python script of one's own. --coordinator/--num-processes/--process-id join."""
    from jaxopt_train.runtime import read_jsonl

    outputs, run_dir = _cli_job(tmp_path)
    done = []
    for i, (output, rc) in enumerate(outputs):
        assert rc == 0, output[-3000:]
        assert f"joining the job as process {i} of 2 via " in output
        assert f"process {i} of 2 (jax.distributed)" in output
        done += [line for line in output.splitlines() if line.startswith("done: 4 steps")]
    assert len(done) == 2 and done[0] == done[1]  # the same eval loss on both processes
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == [2, 4]


def test_processes_that_build_different_batches_all_stop_before_training(tmp_path):
    """Each process builds the whole global batch and keeps its own rows: with another --seed
    (or data file) on one host the job trained, without an error, on rows of two data orders."""
    outputs, _ = _cli_job(tmp_path, per_process=((), ("--seed", "1")))
    for output, rc in outputs:
        assert rc == 2, output[-3000:]  # both: process 0 must not wait in the first all-reduce
        assert "process(es) [1] built another batch 0 than process 0" in output
        assert "step 2 |" not in output
