"""Smoke test of `jaxopt-train bench collectives` on the 8 emulated CPU devices."""

import json

import pytest

from jaxopt_train.bench import collectives as bench


def test_parse_and_format_sizes():
    assert bench.parse_size("64K") == 64 << 10 and bench.parse_size("1MiB") == 1 << 20
    assert bench.parse_size("1G") == 1 << 30 and bench.parse_size("4096") == 4096
    assert bench.fmt_size(256 << 20) == "256M" and bench.fmt_size(1000) == "1000"


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
    assert data["gpt_step"] == []  # --gpt not given
    assert data["meta"]["devices"] == 8 and data["meta"]["peak_gbs_per_direction"] is None
    assert "x psum" in capsys.readouterr().out


def test_bad_dtype_exits_2(capsys):
    assert bench.main(["--dtypes", "f64"]) == 2
    assert "expected some of" in capsys.readouterr().err


@pytest.mark.parametrize("grad_dtype, expected", [("param", "float32"), ("compute", "bfloat16")])
def test_gpt_step_reports_every_method_with_the_gradient_dtype(tmp_path, grad_dtype, expected):
    out = tmp_path / "coll.json"
    rc = bench.main(["--quick", "--sizes", "4K", "--dtypes", "f32", "--chunks", "1", "--methods", "ring",
                     "--gpt", "--gpt-overrides", "n_layers=1,d_model=32,n_heads=2,dtype=bfloat16",
                     "--gpt-batch", "1", "--gpt-iters", "1", "--gpt-grad-dtype", grad_dtype,
                     "--gpt-embedding-exchange", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["gpt_step"]
    assert [r["method"] for r in rows] == ["psum", "ring", "psum+embx", "ring+embx"]
    for row in rows:
        assert row["grad_dtype"] == expected
        assert row["step_s"] > 0 and row["compute_only_s"] > 0 and row["comm_only_s"] > 0
        assert row["throughput_vs_one_device"] == pytest.approx(8 * row["one_device_step_s"] / row["step_s"])


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
