"""Smoke test of `jaxopt-train bench collectives` on the 8 emulated CPU devices."""

import argparse
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.bench import collectives as bench
from jaxopt_train.bench import collectives_flags as flags
from jaxopt_train.bench import collectives_gpt as bench_gpt
from jaxopt_train.collectives import all_reduce_tree
from jaxopt_train.models import GPT, get_gpt_config, gpt_loss
from jaxopt_train.zero import leaf_specs, place_leaves


def test_parse_and_format_sizes():
    assert bench.parse_size("64K") == 64 << 10 and bench.parse_size("1MiB") == 1 << 20
    assert bench.parse_size("1G") == 1 << 30 and bench.parse_size("4096") == 4096
    assert bench.fmt_size(256 << 20) == "256M" and bench.fmt_size(1000) == "1000"
    assert bench.parse_size("0.5K") == 512 and bench.parse_size("1.5M") == 3 << 19
    assert bench.parse_size("1.5G") == 3 << 29 and bench.parse_size("1e3K") == 1024000


@pytest.mark.parametrize("size, bytes_", [("1.0001K", "1024.1024"), ("0.3K", "307.2"), ("1.5", "1.5")])
def test_a_size_that_is_not_whole_bytes_is_refused(size, bytes_, capsys):
    # Was: int(float(...) * 1024) timed 1024 bytes for "1.0001K" and 307 for "0.3K".
    with pytest.raises(ValueError, match=f"size '{size}' comes to {bytes_} bytes; expected a whole"):
        bench.parse_size(size)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sizes", f"1M,{size}"])
    assert exc.value.code == 2 and f"comes to {bytes_} bytes" in capsys.readouterr().err


def test_quick_run_writes_json_with_psum_baseline(tmp_path, capsys):
    out = tmp_path / "coll.json"
    rc = bench.main(["--quick", "--sizes", "64K", "--dtypes", "f32", "--chunks", "1", "--methods", "ring",
                     "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    variants = [r["variant"] for r in data["allreduce"]]
    assert variants == ["psum", "ring/c1"]
    psum, ring = data["allreduce"]
    assert psum["ratio_to_psum"] == 1.0 and ring["ratio_to_psum"] == pytest.approx(
        ring["busbw_gbs"] / psum["busbw_gbs"])
    assert ring["busbw_gbs"] == pytest.approx(ring["algbw_gbs"] * 2 * 7 / 8)
    assert psum["max_abs_diff_vs_psum"] == 0 and ring["max_abs_diff_vs_psum"] == 0  # exact inputs
    assert data["gpt_step"] == []  # --gpt not given
    assert data["meta"]["devices"] == 8 and data["meta"]["peak_gbs_per_direction"] is None
    assert "x psum" in capsys.readouterr().out


def test_bad_dtype_exits_2(capsys):
    assert bench.main(["--dtypes", "f64"]) == 2
    assert "expected some of" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ring,foo"], "--methods ['foo'] unknown; expected some of ['ring'"),
    (["--gpt-methods", "psum,nccl"], "--gpt-methods ['nccl'] unknown; expected some of ['psum'"),
    (["--iters", "0"], "--iters=0 must be >= 1"),
    (["--warmup", "-1"], "--warmup=-1 must be >= 0"),
    (["--peak", "-3"], "--peak=-3.0 must be > 0"),
    (["--bucket-mb", "0"], "--bucket-mb=0.0 must be > 0"),
])
def test_bad_values_exit_2_with_the_reason(argv, message, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    # With the usage and an "error:" prefix, as argparse's own refusals (they had neither).
    assert err.startswith("usage: ") and f": error: {message}" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "1Q"], "cannot read a size from '1Q'; expected bytes or a K/M/G suffix"),
    (["--sizes", "1M,0"], "size '0' must be more than 0 bytes; the flag takes a comma list like"),
    (["--sizes", ","], "empty list; expected e.g. 1M,16M,256M,1G"),
    (["--chunks", "1,0"], "0 is not >= 1"),
    (["--chunks", "two"], "invalid literal for int"),
])
def test_bad_lists_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be more than 0 bytes"):
        bench.parse_size("-1K")


@pytest.mark.parametrize("argv, message", [
    (["--dtypes", "f32,f32"], "argument --dtypes: 'f32,f32' repeats ['f32'] (an earlier item's value); "
                              "give each item once, e.g. f32,bf16"),
    (["--sizes", "1M,4K,1024K"], "argument --sizes: '1M,4K,1024K' repeats ['1024K']"),
    (["--methods", "ring,ring_bidir,ring"], "argument --methods: 'ring,ring_bidir,ring' repeats ['ring']"),
    (["--chunks", "1,4,1"], "argument --chunks: '1,4,1' repeats ['1']"),
    (["--gpt", "--gpt-methods", "ring,ring"], "argument --gpt-methods: 'ring,ring' repeats ['ring']"),
])
def test_repeated_list_items_are_refused(monkeypatch, argv, message, capsys):
    """--dtypes f32,f32 ran the whole sweep twice; the other repeats timed or dropped copies."""
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


# Every method once (f32 gradients); the bf16-gradient case on the ring alone, where the
# gradient dtype reaches our own reduction (all five methods twice took ~75 s of CI).
@pytest.mark.parametrize("grad_dtype, expected, extra, methods", [
    pytest.param("param", "float32", ["--gpt-embedding-exchange", "--gpt-zero1"],
                 ["psum", "ring", "psum+embx", "ring+embx", "zero1"], id="param-all-methods"),
    # hierarchical in one process: split in two groups (the default grouping is one group, the flat ring)
    pytest.param("compute", "bfloat16", ["--gpt-methods", "ring,hierarchical"],
                 ["psum", "ring", "hierarchical/4x2"], id="compute-ring-hierarchical"),
])
def test_gpt_step_reports_every_method_with_the_gradient_dtype(tmp_path, grad_dtype, expected,
                                                                extra, methods):
    out = tmp_path / "coll.json"
    rc = bench.main(["--quick", "--sizes", "4K", "--dtypes", "f32", "--chunks", "1", "--methods", "ring",
                     "--gpt", "--gpt-overrides", "n_layers=1,d_model=32,n_heads=2,dtype=bfloat16",
                     "--gpt-batch", "1", "--gpt-iters", "1", "--gpt-grad-dtype", grad_dtype,
                     *extra, "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["gpt_step"]
    assert [r["method"] for r in rows] == methods
    # psum is the baseline of every row, timed in the same run even when not asked for
    assert rows[0]["step_vs_psum"] == 1.0
    for row in rows:
        assert row["step_vs_psum"] == pytest.approx(rows[0]["step_s"] / row["step_s"])
        assert row["grad_dtype"] == expected
        assert row["step_s"] > 0 and row["compute_only_s"] > 0 and row["comm_only_s"] > 0
        assert row["throughput_vs_one_device"] == pytest.approx(8 * row["one_device_step_s"] / row["step_s"])
        # comm_only_s times the dense all-reduce, not an +embx row's row exchange
        assert (row["hidden_comm_fraction"] is None) == row["method"].endswith("+embx")


def test_gpt_trace_writes_a_profile_per_method_and_reports_overlap_fields(tmp_path, capsys):
    out, traces = tmp_path / "coll.json", tmp_path / "traces"
    rc = bench.main(["--quick", "--sizes", "4K", "--dtypes", "f32", "--chunks", "1", "--methods", "ring",
                     "--gpt", "--gpt-overrides", "n_layers=1,d_model=32,n_heads=2,dtype=bfloat16",
                     "--gpt-batch", "1", "--gpt-iters", "1", "--gpt-methods", "psum",
                     "--gpt-trace", str(traces), "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["gpt_step"]
    assert set(row["trace"]) >= {"collective_ms", "concurrent_ms", "exposed_ms", "compute_ms",
                                 "compute_only_compute_ms", "compute_slowdown_ms", "idle_ms", "span_ms"}
    # a CPU trace has no GPU streams: the figures are None, the table says so
    assert row["trace"]["compute_ms"] is None and row["trace"]["compute_slowdown_ms"] is None
    assert "no GPU streams" in capsys.readouterr().out
    for name in ("compute_only", "psum"):
        assert list((traces / name).rglob("*.trace.json.gz")), name


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_zero1_dp_step_matches_the_all_reduce_step(grad_dtype):
    """`--gpt-zero1`: sharded params gathered, gradients reduce-scattered per leaf, each
    device updating its shards, give the all-reduce step's new params and loss."""
    cfg = get_gpt_config("gpt-tiny", n_layers=1, d_model=32, n_heads=2, seq_len=16)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
    tokens = jax.random.randint(jax.random.key(3), (4 * 2, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    specs = leaf_specs(params, 4)

    def plain(p, toks):
        q = p if grad_dtype is None else jax.tree.map(lambda x: x.astype(grad_dtype), p)
        loss, g = jax.value_and_grad(lambda q: gpt_loss(nnx.merge(graphdef, q)(toks[:, :-1]), toks[:, 1:]))(q)
        return bench_gpt._sgd_update(p, all_reduce_tree(g, "data", method="psum")), lax.pmean(loss, "data")

    smap = lambda f, ins, outs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs,  # noqa: E731
                                                      check_vma=False))
    want, want_loss = smap(plain, (P(), P("data")), (P(), P()))(
        jax.device_put(params, NamedSharding(mesh, P())), tokens)
    got, got_loss = smap(bench_gpt.zero1_step_body(graphdef, specs, grad_dtype), (specs, P("data")),
                         (specs, P()))(place_leaves(params, specs, mesh), tokens)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    # Same gradients summed in another order (reduce-scatter vs all-reduce), times lr 1e-4:
    # in f32 that is rounding noise; bf16 sums differ by about one bf16 ulp of a gradient
    # (~4e-3 of it), i.e. < 1e-6 after lr. Updates reach 9e-5 here, and a gradient sum
    # off by 25% moves parameters by up to 2.3e-5 (checked when this test was written).
    atol = 1e-8 if grad_dtype is None else 1e-6
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))
    table = got["wte"]["embedding"][...]
    assert table.addressable_shards[0].data.size == table.size // 4  # really sharded


def _no_sweep(*_args, **_kwargs):
    raise AssertionError("the benchmark ran; the flags should have been refused first")


def test_time_burst_with_no_warmup():
    assert bench.time_burst(lambda x: x + 1, (jnp.ones(3),), warmup=0, iters=1, bursts=1) > 0


def test_exits_1_when_every_variant_failed(monkeypatch, capsys):
    def fail(*_args, **_kwargs):
        raise RuntimeError("no link")
    monkeypatch.setattr(bench, "time_burst", fail)
    assert bench.main(["--sizes", "4K", "--dtypes", "f32", "--chunks", "1", "--methods", "ring"]) == 1
    err = capsys.readouterr().err
    assert "psum f32 4K failed: RuntimeError: no link" in err and "every all-reduce variant failed" in err


@pytest.mark.parametrize("argv, expected", [
    (["--quick"], dict(warmup=1, iters=3, bursts=3, gpt_iters=2, gpt_batch=2, gpt_overrides={"n_layers": 1})),
    (["--quick", "--warmup", "0", "--iters", "7", "--bursts", "2", "--gpt-iters", "4", "--gpt-batch", "3",
      "--gpt-overrides", "n_layers=2,use_bias=false,layer_norm_epsilon=1e-6,dtype=bfloat16"],
     dict(warmup=0, iters=7, bursts=2, gpt_iters=4, gpt_batch=3,
          gpt_overrides={"n_layers": 2, "use_bias": False, "layer_norm_epsilon": 1e-6, "dtype": "bfloat16"})),
    ([], dict(warmup=3, iters=10, bursts=5, gpt_iters=5, gpt_batch=4, gpt_overrides={})),
])
def test_quick_defaults_fill_only_unset_flags(monkeypatch, argv, expected):
    seen = {}

    def fake_gpt(args, record):
        seen.update({k: getattr(args, k) for k in expected})
        return []
    monkeypatch.setattr(bench, "bench_collectives", lambda args, record: [{"fake": "row"}])
    monkeypatch.setattr(bench, "print_table", lambda rows, note: None)
    monkeypatch.setattr(bench_gpt, "bench_gpt", fake_gpt)
    assert bench.main([*argv, "--gpt"]) == 0
    assert seen == expected


@pytest.mark.parametrize("value, message", [
    ("n_layers", "argument --gpt-overrides: 'n_layers' must look like FIELD=VALUE"),
    ("=3", "argument --gpt-overrides: '=3' must look like FIELD=VALUE"),
    ("use_bias=maybe", "argument --gpt-overrides: use_bias='maybe' must be True or False"),
    ("n_layerz=2", "argument --gpt-overrides: unknown GPTConfig field(s) ['n_layerz']"),
])
def test_bad_gpt_overrides_exit_2_before_any_benchmark(monkeypatch, capsys, value, message):
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--gpt", "--gpt-overrides", value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "6", "--dtypes", "f32"], "[6] bytes must each be a positive multiple of the 4-byte item size"),
    (["--sizes", "4K,2", "--dtypes", "f32,bf16"], "[2] bytes must each be a positive multiple of the 4-byte"),
    (["--sizes", "4K,3"], "[3] bytes must each be a positive multiple of the 4-byte"),
    (["--sizes", "3", "--dtypes", "bf16"], "[3] bytes must each be a positive multiple of the 2-byte"),
])
def test_sizes_not_whole_elements_are_refused(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_nvlink_peak_reads_nvml_version_as_the_enum_it_is(monkeypatch):
    """nvmlDeviceGetNvLinkVersion returns nvmlNvlinkVersion_t: 5 is NVLink 3.1 (an A100's
    25 GB/s links), not NVLink 5; 6 is NVLink 4.0 (H100/H200)."""
    nvml = types.SimpleNamespace(NVMLError=RuntimeError, NVML_NVLINK_MAX_LINKS=18, nvmlInit=lambda: None,
                                 nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    device = types.SimpleNamespace(platform="gpu", local_hardware_id=0, device_kind="NVIDIA A100-SXM4-80GB")
    for kind, links, enum, want in [("NVIDIA A100-SXM4-80GB", 12, 5, 300.0), ("NVIDIA H200", 18, 6, 450.0),
                                    ("NVIDIA B200", 18, 7, 900.0)]:
        device.device_kind = kind
        nvml.nvmlDeviceGetNvLinkState = lambda _h, link, links=links: link < links
        nvml.nvmlDeviceGetNvLinkVersion = lambda _h, _link, enum=enum: enum
        peak, source = bench.nvlink_peak(device)
        assert peak == want and source.startswith("NVML"), (kind, peak, source)


def test_nvlink_peak_asks_nvml_for_the_gpu_cuda_visible_devices_maps_to(monkeypatch):
    """NVML numbers every GPU of the host: with CUDA_VISIBLE_DEVICES=3,2 JAX's GPU 1 is
    NVML's 2 (it asked NVML for GPU 1, another GPU's links)."""
    asked = []

    def handle(index):
        asked.append(index)
        return index
    nvml = types.SimpleNamespace(NVMLError=RuntimeError, NVML_NVLINK_MAX_LINKS=18, nvmlInit=lambda: None,
                                 nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=handle,
                                 nvmlDeviceGetNvLinkState=lambda h, _link: h == 2,
                                 nvmlDeviceGetNvLinkVersion=lambda _h, _link: 6)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    device = types.SimpleNamespace(platform="gpu", id=1, local_hardware_id=1, device_kind="NVIDIA H200")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert bench.nvlink_peak(device) == (450.0, "NVML: 18 active NVLink links (version enum 6)")
    assert asked == [2]
    # GPUs named by UUID cannot be mapped: NVML is not asked, the datasheet answers and says why.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0f3c")
    peak, source = bench.nvlink_peak(device)
    assert peak == 450.0 and asked == [2]
    assert source == ("datasheet table (H200); NVML not asked: CUDA_VISIBLE_DEVICES='GPU-0f3c' names "
                      "GPUs by UUID; not mapped to NVML")


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 PCIe", 300.0), ("NVIDIA H100 NVL", 300.0),
                                        ("NVIDIA H100 80GB HBM3", 450.0), ("NVIDIA H200", 450.0),
                                        ("NVIDIA GH200 480GB", 450.0), ("NVIDIA A100-SXM4-80GB", 300.0)])
def test_nvlink_datasheet_fallback_tells_the_bridged_cards_apart(monkeypatch, kind, peak):
    """Without NVML an H100 PCIe / NVL (a 600 GB/s bridge) got the SXM part's 450 GB/s a direction."""
    from jaxopt_train.runtime import nvml as nvml_lib

    monkeypatch.setattr(nvml_lib, "load_nvml", lambda: (None, "no NVML here"))
    device = types.SimpleNamespace(platform="gpu", id=0, local_hardware_id=0, device_kind=kind)
    assert bench.nvlink_peak(device)[0] == peak


def _quick(*argv):
    return ["--quick", "--sizes", "4K", "--dtypes", "f32", "--chunks", "1", *argv]


@pytest.mark.parametrize("target", ["folder", "nodir/coll.json"])
def test_json_path_is_checked_before_the_sweep(monkeypatch, tmp_path, capsys, target):
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    if target == "folder":
        with pytest.raises(SystemExit) as exc:
            bench.main(_quick("--json", str(tmp_path)))
        assert exc.value.code == 2 and "argument --json" in capsys.readouterr().err
    else:  # a missing folder is created up front, as `bench accumulation` does
        monkeypatch.setattr(bench, "bench_collectives", lambda args, record: [])
        bench.main(_quick("--json", str(tmp_path / target)))
        assert (tmp_path / "nodir").is_dir()


@pytest.mark.parametrize("argv, message", [
    (["--methods", "peer"], "['peer'] cannot run here (8 cpu devices"),
    (["--methods", "ring,peer_wire_bf16"], "['peer_wire_bf16'] cannot run here"),
    (["--dtypes", "bf16", "--methods", "ring_wire_bf16"], "ring_wire_bf16 needs f32 in --dtypes"),
    (["--gpt", "--gpt-methods", "psum,peer"], "argument --gpt-methods: 'peer' cannot run here"),
])
def test_methods_this_run_cannot_time_are_refused_up_front(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sizes", "4K", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("local, processes, label", [(8, 1, "hierarchical/4x2"), (4, 2, "hierarchical/4x2"),
                                                      (2, 4, "hierarchical/2x4"), (1, 8, "hierarchical/1x8")])
def test_gpt_hierarchical_groups_by_process_or_splits_one_process_in_two(local, processes, label):
    assert bench_gpt.method_label("hierarchical", 8, local, processes) == label
    assert bench_gpt.sync_options("hierarchical", 8, local, processes) == {"group_size": int(label[13])}
    assert bench_gpt.sync_options("ring", 8, local, processes) == {}
    assert bench_gpt.method_label("ring", 8, local, processes) == "ring"


@pytest.mark.parametrize("n", [2, 3])
def test_gpt_hierarchical_needs_two_groups_of_two(n, capsys):
    parser = argparse.ArgumentParser(prog="bench")
    args = argparse.Namespace(methods=None, dtypes=["f32"], chunks=[1], gpt=True, gpt_methods=["hierarchical"])
    with pytest.raises(SystemExit) as exc:
        flags.check_methods_run(parser, args, n, "cpu", lambda *a: {})
    assert exc.value.code == 2
    assert "'hierarchical' cannot run here" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--gpt-zero1"], ["--gpt-trace", "t"], ["--gpt-methods", "ring"],
                                  ["--bucket-mb", "4"], ["--gpt-grad-dtype", "compute"], ["--gpt-batch", "2"]])
def test_gpt_flags_without_gpt_are_refused(monkeypatch, capsys, flag):
    monkeypatch.setattr(bench, "bench_collectives", _no_sweep)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sizes", "4K", *flag])
    assert exc.value.code == 2 and f"{flag[0]} only apply to the GPT step" in capsys.readouterr().err


def test_inputs_are_varied_and_a_wrong_variant_is_reported(monkeypatch, tmp_path, capsys):
    """Constant inputs hid wrong results; now every variant is checked against psum."""
    x = bench.sweep_input(jax.sharding.Mesh(jax.devices(), ("data",)), 8 * 64, jnp.bfloat16)
    assert len(np.unique(np.asarray(x, np.float32))) > 2
    real = bench.variants
    monkeypatch.setattr(bench, "variants", lambda n, dtype, chunks: {
        **real(n, dtype, chunks), "ring/c1": lambda v: v * n})  # right for ones, wrong otherwise
    out = tmp_path / "coll.json"
    assert bench.main(_quick("--methods", "ring", "--json", str(out))) == 1
    psum, ring = json.loads(out.read_text())["allreduce"]
    assert psum["max_abs_diff_vs_psum"] == 0 and ring["max_abs_diff_vs_psum"] > 0
    captured = capsys.readouterr()
    assert "WRONG RESULT" in captured.out and "differ from lax.psum" in captured.err


def test_hierarchical_variant_per_chunk_count_matches_psum():
    """One hierarchical row per --chunks value, each run with that count (every row
    used chunks[0] before, under a name that did not say so)."""
    mesh = jax.make_mesh((8,), ("data",))
    built = bench.variants(8, "f32", [1, 2])
    names = sorted(k for k in built if k.startswith("hierarchical"))
    assert names == ["hierarchical/4x2/c1", "hierarchical/4x2/c2"]
    x = bench.sweep_input(mesh, 8 * 64, jnp.float32)
    want = None
    for name in ["psum", *names]:
        fn = jax.jit(jax.shard_map(built[name], mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        got = np.asarray(fn(x))
        want = got if want is None else want
        np.testing.assert_array_equal(got, want, err_msg=name)
