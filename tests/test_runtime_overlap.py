"""jaxopt_train.runtime.overlap: collective/compute overlap from traces and schedules."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.runtime import overlap


def _write_trace(tmp_path, kernels, *, extra_events=()):
    """A jax.profiler-shaped trace: GPU 0 with two streams, an XLA Ops row, a host thread."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10, "args": {"name": "Stream #10(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 11, "args": {"name": "Stream #11(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 99, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "python3"}},
        # rows that must not count: the XLA Ops summary and host activity
        {"ph": "X", "pid": 1, "tid": 99, "ts": 0.0, "dur": 1000.0, "name": "fusion.1"},
        {"ph": "X", "pid": 7, "tid": 1, "ts": 0.0, "dur": 1000.0, "name": "ncclHostWait"},
        *extra_events,
    ]
    for tid, start, end, name in kernels:
        events.append({"ph": "X", "pid": 1, "tid": tid, "ts": float(start), "dur": float(end - start),
                       "name": name})
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(tmp_path)


def test_collective_overlap_counts_concurrent_exposed_and_idle(tmp_path):
    logdir = _write_trace(tmp_path, [
        (10, 0, 100, "nvjet_gemm_bf16"),
        (10, 110, 200, "loop_fusion"),
        (11, 50, 150, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
        (11, 190, 230, "MemcpyP2P"),
        (10, 225, 226, "memset32"),  # neither compute nor collective
        (10, 300, 310, "input_reduce_fusion"),
    ])
    (gpu,) = overlap.collective_overlap(logdir, steps=2)
    assert gpu.device == "/device:GPU:0"
    # compute [0,100] [110,200] [300,310] = 200 us; collectives [50,150] [190,230] = 140 us
    assert gpu.compute_ms == pytest.approx(200 / 2e3)
    assert gpu.collective_ms == pytest.approx(140 / 2e3)
    # concurrent: [50,100] + [110,150] + [190,200] = 100 us; exposed 40 us
    assert gpu.concurrent_ms == pytest.approx(100 / 2e3)
    assert gpu.exposed_ms == pytest.approx(40 / 2e3)
    assert gpu.hidden_fraction == pytest.approx(100 / 140)
    # busy [0,230] [300,310]: span 310, idle 70 (one gap at 230/310 of the span)
    assert gpu.span_ms == pytest.approx(310 / 2e3)
    assert gpu.idle_ms == pytest.approx(70 / 2e3)
    assert gpu.largest_gaps[0] == (pytest.approx(round(230 / 310, 3)), pytest.approx(0.07))
    names = dict(gpu.collective_kernels)
    assert names["ncclDevKernel_AllReduce_Sum_bf16_RING_LL"] == pytest.approx(100 / 2e3)
    assert names["MemcpyP2P"] == pytest.approx(40 / 2e3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interval_algebra_matches_a_brute_force_grid(seed):
    rng = np.random.default_rng(seed)

    def random_intervals(count):
        starts = rng.integers(0, 900, count)
        return [(float(s), float(s + rng.integers(1, 100))) for s in starts]

    a, b = random_intervals(12), random_intervals(9)
    grid_a, grid_b = np.zeros(1000, bool), np.zeros(1000, bool)
    for s, e in a:
        grid_a[int(s):int(e)] = True
    for s, e in b:
        grid_b[int(s):int(e)] = True
    ua, ub = overlap._union(a), overlap._union(b)
    assert overlap._total(ua) == grid_a.sum()
    assert overlap._intersection(ua, ub) == (grid_a & grid_b).sum()


def test_collective_overlap_on_a_cpu_trace_has_no_gpus(tmp_path):
    f = jax.jit(lambda x: (x @ x.T).sum())
    x = jnp.ones((64, 64), jnp.float32)
    jax.block_until_ready(f(x))
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(f(x))
    assert overlap.collective_overlap(str(tmp_path)) == []
    # a file path works as well as the directory
    assert overlap.collective_overlap(overlap.find_trace_file(str(tmp_path))) == []


def test_collective_overlap_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        overlap.collective_overlap(str(tmp_path))
    logdir = _write_trace(tmp_path, [(10, 0, 1, "k")])
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            overlap.collective_overlap(logdir, steps=bad)


def test_collective_overlap_takes_numpy_int_steps_and_refuses_bools(tmp_path):
    """np.int64(2), e.g. a step count from a numpy array, was refused as not an int;
    True was taken as 1 step."""
    logdir = _write_trace(tmp_path, [(10, 0, 100, "loop_fusion")])
    (gpu,) = overlap.collective_overlap(logdir, steps=np.int64(2))
    assert gpu.compute_ms == pytest.approx(100 / 2e3) and type(gpu.compute_ms) is float
    with pytest.raises(ValueError, match="steps must be a positive int .*steps=True"):
        overlap.collective_overlap(logdir, steps=True)


def test_is_collective_kernel():
    assert overlap.is_collective_kernel("ncclDevKernel_SendRecv(x)")
    assert overlap.is_collective_kernel("Memcpy PtoP (Device -> Device)")
    assert not overlap.is_collective_kernel("MemcpyD2D")
    assert not overlap.is_collective_kernel("sm90_xmma_gemm_bf16")


_SCHEDULED = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8]{0})->bf16[8]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main.9 (p0: bf16[8], w: bf16[8,8]) -> bf16[8] {
  %p0 = bf16[8]{0} parameter(0)
  %w = bf16[8,8]{1,0} parameter(1)
  %all-reduce-start = bf16[8]{0} all-reduce-start(bf16[8]{0} %p0), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-start.1 = bf16[8]{0} all-reduce-start(bf16[8]{0} %p0), replica_groups={{0,1}}, to_apply=%add
  %custom-call.3 = (bf16[8,8]{1,0}, s8[16]{0}) custom-call(bf16[8,8]{1,0} %w, bf16[8,8]{1,0} %w), custom_call_target="__cublas$gemm"
  %fusion.2 = bf16[8]{0} fusion(bf16[8]{0} %p0), kind=kLoop, calls=%add
  %all-reduce-done.1 = bf16[8]{0} all-reduce-done(bf16[8]{0} %all-reduce-start.1)
  %collective-permute-start = (bf16[8]{0}, bf16[8]{0}) collective-permute-start(bf16[8]{0} %p0), source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = bf16[8]{0} collective-permute-done((bf16[8]{0}, bf16[8]{0}) %collective-permute-start)
  %all-reduce-done = bf16[8]{0} all-reduce-done(bf16[8]{0} %all-reduce-start)
  ROOT %add.9 = bf16[8]{0} add(bf16[8]{0} %all-reduce-done, bf16[8]{0} %collective-permute-done)
}
"""


def test_async_collective_schedule_pairs_starts_with_dones():
    pairs = {p.name: p for p in overlap.async_collective_schedule(_SCHEDULED)}
    assert set(pairs) == {"all-reduce-start", "all-reduce-start.1", "collective-permute-start"}
    # all-reduce-start spans: start.1, gemm, fusion, done.1, cp-start, cp-done
    assert (pairs["all-reduce-start"].between, pairs["all-reduce-start"].gemms_between) == (6, 1)
    assert (pairs["all-reduce-start.1"].between, pairs["all-reduce-start.1"].gemms_between) == (2, 1)
    assert (pairs["collective-permute-start"].between, pairs["collective-permute-start"].gemms_between) == (0, 0)
    assert {p.computation for p in pairs.values()} == {"main.9"}
    assert pairs["collective-permute-start"].op == "collective-permute-start"


def test_async_collective_schedule_on_a_cpu_module_and_bad_input():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                               in_specs=jax.P("data"), out_specs=jax.P()))
    text = fn.lower(jnp.ones((len(jax.devices()) * 4,), jnp.float32)).compile().as_text()
    # XLA:CPU runs its all-reduce synchronously: nothing asynchronous to report
    assert overlap.async_collective_schedule(text) == []
    for bad in ("", "not hlo", None):
        with pytest.raises(ValueError, match="compiled HLO module"):
            overlap.async_collective_schedule(bad)


def test_a_logdir_with_glob_characters_is_found(tmp_path):
    # "lr=[0.1]" was read as a glob pattern (a set of characters): "no *.trace.json.gz".
    logdir = _write_trace(tmp_path / "lr=[0.1]", [(10, 0, 100, "gemm"), (11, 50, 150, "ncclKernel")])
    (gpu,) = overlap.collective_overlap(logdir)
    assert gpu.collective_ms == pytest.approx(0.1)
    assert overlap.find_trace_file(logdir).startswith(logdir)
