"""`jaxopt-train bench matmul` in its CPU mode: rows, ratios, JSON, the config column, bad input."""

from __future__ import annotations

import json
import re
import types

import jax
import jax.numpy as jnp
import pytest

from jaxopt_train.bench import matmul as bench
from jaxopt_train.kernels import MatmulConfig


def test_quick_run_measures_each_backend_next_to_xla(tmp_path, capsys):
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["backends"] == ["xla_dot", "interpret", "xla"]
    shapes = {tuple(r["shape"]) for r in data["plain"]}
    assert shapes == set(bench.QUICK_SHAPES)
    for row in data["plain"] + data["fused"]:
        assert "error" not in row, row
        assert row["max_rel_error"] < 1e-2 and row["ms"] > 0 and row["tflops"] > 0
        assert row["vs_xla"] == pytest.approx(
            row["tflops"] / next(r["tflops"] for r in data["plain" if not row["fused"] else "fused"]
                                 if r["shape"] == row["shape"] and r["backend"] == "xla_dot"))
    assert all("config" in r for r in data["plain"] if r["backend"] == "interpret")
    # The layer table: forward + backward against the f32 reference's output and gradients,
    # each kernel backend recomputing and keeping the pre-activation, next to XLA's.
    layer = {r["backend"]: r for r in data["layer"]}
    assert list(layer) == ["xla_dot", "interpret", "interpret+saved", "xla", "xla+saved"]
    for row in layer.values():
        assert "error" not in row, row
        assert tuple(row["shape"]) == bench.QUICK_SHAPES[1] and row["max_rel_error"] < 3e-2
        assert row["vs_xla"] == pytest.approx(row["tflops"] / layer["xla_dot"]["tflops"])
    out = capsys.readouterr().out
    assert "matmul: C = A @ B" in out and "fused: gelu(A @ B + bias)" in out
    assert "layer, forward + backward" in out and "interpret+saved" in out


def test_config_column_names_the_layout_knobs():
    plain = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=16)
    assert bench._short(plain.to_dict()) == "128x128x64 s4 w8 g16n f0"
    chained = MatmulConfig(block_m=128, block_n=128, block_k=64, num_stages=4, group_m=16,
                           chain_tiles=True, cluster="n")
    assert bench._short(chained.to_dict()) == "128x128x64 s4 w8 g16n f0 chained cluster-n"
    assert bench._short(MatmulConfig(schedule="pingpong").to_dict()).endswith(" pingpong")
    assert bench._short(None) == ""


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--backends", "mosaic,xla"], "unknown \\['mosaic'\\]"),
    (["--quick", "--calls", "0"], "--calls must be >= 1"),
    (["--quick", "--input-sets", "0"], "--input-sets must be >= 1"),
    (["--quick", "--warmup-s", "-1"], "--warmup-s must be a finite number >= 0"),
    (["--quick", "--warmup-s", "nan"], "--warmup-s must be a finite number >= 0; got nan"),
    (["--quick", "--launches-per-dispatch", "0"], "--launches-per-dispatch must be >= 1"),
    (["--input-sets", "4", "--launches-per-dispatch", "3"], "3 must divide --input-sets 4"),
    (["--quick", "--shapes", "16x16"], "--shapes='16x16' must be a comma list of MxNxK"),
    (["--quick", "--shapes", "16x0x16"], "positive dims"),
    (["--quick", "--shapes", "16xax16"], "must be a comma list of MxNxK"),
    (["--quick", "--json", "/"], "--json /: '/' is a folder"),
    (["--quick", "--backends", "interpret,xla,interpret"], "repeats \\['interpret'\\]; give each backend once"),
    (["--quick", "--shapes", "16x16x16,8x8x8,16x16x16"], "repeats \\['16x16x16'\\]; give each shape once"),
    # It printed the header and exited 0, having measured nothing / ignoring --shapes.
    (["--quick", "--no-plain", "--no-fused", "--no-layer"], "leave nothing to measure"),
    (["--quick", "--no-plain", "--shapes", "16x16x16"], "--shapes 16x16x16 sets the A @ B table, which --no-plain skips"),
])
def test_bad_arguments_are_refused_with_the_expected_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert re.search(message, capsys.readouterr().err)


def test_launches_per_dispatch_times_several_launches_per_jitted_call(tmp_path, monkeypatch):
    """K launches on K different input sets share one dispatch; the figure stays per launch."""
    seen = []
    real_timer = bench.burst_timer

    def spying_timer(fn, *, calls, repeats, warmup_s):
        out = fn()
        seen.append((calls, [tuple(o.shape) for o in out] if isinstance(out, list) else None))
        return real_timer(fn, calls=calls, repeats=repeats, warmup_s=warmup_s)

    monkeypatch.setattr(bench, "burst_timer", spying_timer)
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--shapes", "24x40x8", "--no-fused", "--no-layer", "--backends",
                       "xla", "--launches-per-dispatch", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["launches_per_dispatch"] == 2
    # --quick times 2 calls a burst: one dispatch of two launches, two (24, 40) outputs.
    assert seen == [(1, [(24, 40), (24, 40)])] * 2
    assert all("error" not in r and r["ms"] > 0 for r in data["plain"])
    with pytest.raises(ValueError, match="divide the 3 input sets"):
        bench.time_fn(lambda a: a, [(1,), (2,), (3,)], calls=2, bursts=1, warmup_s=0, per_dispatch=2)


def test_shapes_replace_the_plain_tables_shapes(tmp_path):
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--shapes", "24x40x8,17x9x33", "--no-fused", "--no-layer",
                       "--backends", "xla", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["plain"]
    assert [(tuple(r["shape"]), r["backend"]) for r in rows] == [
        ((24, 40, 8), "xla_dot"), ((24, 40, 8), "xla"), ((17, 9, 33), "xla_dot"), ((17, 9, 33), "xla")]
    assert all("error" not in r and r["max_rel_error"] < 1e-2 for r in rows)


def test_quick_keeps_the_values_given_explicitly(tmp_path):
    """--quick fills in only what was not given: --calls 3 stays 3, and --input-sets 4 with
    --launches-per-dispatch 4 is not refused over a quick value of 2 nobody passed."""
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--calls", "3", "--input-sets", "4", "--launches-per-dispatch",
                       "4", "--shapes", "24x40x8", "--no-fused", "--no-layer", "--backends", "xla",
                       "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert (data["calls"], data["bursts"], data["input_sets"]) == (3, 2, 4)


def test_tables_can_be_skipped(tmp_path, capsys):
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--no-plain", "--no-fused", "--backends", "xla",
                       "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["plain"] == [] and data["fused"] == []
    assert [r["backend"] for r in data["layer"]] == ["xla_dot", "xla", "xla+saved"]
    out = capsys.readouterr().out
    assert "matmul: C = A @ B" not in out and "geomean" not in out
    assert "layer, forward + backward" in out


def test_layer_rows_keep_or_recompute_the_preactivation_as_named():
    """`<backend>+saved` runs the kept-Z backward (one kernel launch fewer: forward, dA, dB)
    and `<backend>` the recomputing one. A parsing slip once ran the recomputing path in
    both rows (fourteenth session, H200: both 4 launches, 2.02 and 2.04 ms)."""
    m, n, k = bench.QUICK_SHAPES[1]
    a, b, bias = bench._input_sets(m, n, k, jnp.bfloat16, 1)[0]
    cotangent = jnp.ones((m, n), jnp.bfloat16)
    launches = {name: bench._layer_fn(name, cotangent).lower(a, b, bias).as_text()
                .count("call @_launch") for name in ("interpret", "interpret+saved")}
    assert launches == {"interpret": 4, "interpret+saved": 3}, launches


def test_an_existing_json_is_kept_unless_overwrite(tmp_path, capsys):
    path = tmp_path / "matmul.json"
    path.write_text("KEEP")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--json", str(path)])
    assert exc.value.code == 2 and "already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert path.read_text() == "KEEP"


def test_a_backend_this_machine_lacks_is_refused_before_the_sweep(tmp_path, monkeypatch, capsys):
    """It ran the whole sweep with an ERROR row and exited 0 (1 under --quick)."""
    monkeypatch.setattr(bench, "_measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--backends", "xla,mosaic_gpu", "--json", str(tmp_path / "no" / "m.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--backends mosaic_gpu: matmul backend 'mosaic_gpu' is unavailable: needs a GPU" in err
    assert "expected some of ['interpret', 'xla', 'xla_dot'] here" in err
    assert not (tmp_path / "no").exists()  # refused before the --json folder is made


def test_a_kernel_with_non_finite_output_gets_an_error_row_and_strict_json(tmp_path, monkeypatch):
    real = bench._plain_fn
    monkeypatch.setattr(bench, "_plain_fn", lambda backend: real(backend) if backend == "xla_dot"
                        else jax.jit(lambda a, b, bias: jnp.dot(a, b) * jnp.nan))
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--shapes", "24x40x8", "--no-fused", "--no-layer", "--backends",
                       "xla", "--json", str(path)]) == 1  # --quick: an ERROR row fails the run

    def refuse(name):
        raise ValueError(f"non-finite {name} in the JSON")
    xla_dot, xla = json.loads(path.read_text(), parse_constant=refuse)["plain"]
    assert "error" not in xla_dot and "max_rel_error" not in xla
    assert xla["error"] == "FloatingPointError: non-finite output (max_rel_error=nan)"


@pytest.mark.parametrize("dtype, scale, wrong", [
    ("bfloat16", 1.1, True),     # 10% off: timed and reported normally before, exit 0
    ("bfloat16", 1.008, False),  # within bf16's 2e-2 (the autotuner's rule)
    ("float16", 1.008, True),    # beyond fp16's 5e-3
])
def test_a_finite_but_wrong_backend_is_reported_wrong_and_fails_the_run(tmp_path, monkeypatch, capsys,
                                                                       dtype, scale, wrong):
    real = bench._plain_fn
    monkeypatch.setattr(bench, "_plain_fn", lambda backend: real(backend) if backend == "xla_dot"
                        else jax.jit(lambda a, b, bias: jnp.dot(a, b) * jnp.asarray(scale, a.dtype)))
    path = tmp_path / "matmul.json"
    # Not --quick, where any ERROR row fails the run: a wrong result fails every run.
    rc = bench.main(["--dtype", dtype, "--calls", "1", "--bursts", "1", "--input-sets", "1",
                     "--warmup-s", "0", "--shapes", "24x40x8", "--no-fused", "--no-layer",
                     "--backends", "xla", "--json", str(path)])
    xla_dot, xla = json.loads(path.read_text())["plain"]
    assert "error" not in xla_dot and xla_dot["max_rel_error"] < 5e-3
    captured = capsys.readouterr()
    if not wrong:
        assert rc == 0 and "error" not in xla and "vs_xla" in xla
        return
    assert rc == 1 and xla["wrong_output"] is True
    assert xla["max_rel_error"] == pytest.approx(scale - 1, abs=1e-2)
    assert xla["error"].startswith("WrongOutputError: max_rel_error")
    assert not {"tflops", "vs_xla", "ms"} & set(xla)  # no figure claimed for a wrong kernel
    assert re.search(r"24x40x8 +xla +WRONG WrongOutputError", captured.out)
    assert "wrong output (vs the f32 reference) from ['xla 24x40x8 (plain)']" in captured.err


def test_an_error_without_a_message_still_gets_its_row(tmp_path, monkeypatch):
    """`str(err).splitlines()[0]` of an empty message raised IndexError out of the handler
    and ended the whole sweep."""
    def broken(a, b, bias):
        raise AssertionError()
    real = bench._plain_fn
    monkeypatch.setattr(bench, "_plain_fn", lambda backend: real(backend) if backend == "xla_dot" else broken)
    path = tmp_path / "matmul.json"
    assert bench.main(["--quick", "--shapes", "24x40x8", "--no-fused", "--no-layer", "--backends",
                       "xla", "--json", str(path)]) == 1
    xla_dot, xla = json.loads(path.read_text())["plain"]
    assert "error" not in xla_dot and xla["error"] == "AssertionError: " and "wrong_output" not in xla


@pytest.mark.parametrize("shape, requested, per_dispatch, platform, expected", [
    ((8192, 8192, 8192), 4, 1, "gpu", 4),       # 268 MB a set: the requested 4 already pass L2
    ((1024, 1024, 1024), 4, 1, "gpu", 32),      # 4 MiB a set: 4 sets were 16.8 MB, hot in a 50 MB L2
    ((1000, 777, 513), 4, 4, "gpu", 64),        # 1.8 MB a set: 73 wanted, capped at 64
    ((64, 64, 64), 4, 3, "gpu", 66),            # the cap, rounded up to whole dispatches
    ((1024, 1024, 1024), 2, 1, "cpu", 2),       # no L2 to dodge in the CPU test mode
])
def test_small_shapes_rotate_over_more_sets_than_l2_holds(shape, requested, per_dispatch, platform,
                                                          expected):
    count = bench.rotation_sets(*shape, jnp.bfloat16, requested, per_dispatch, platform)
    assert count == expected and count % per_dispatch == 0
    m, n, k = shape
    if platform == "gpu" and count < bench.MAX_SETS:
        assert count * (m * k + k * n + n) * 2 >= bench.ROTATE_BYTES


@pytest.mark.parametrize("platform, timed", [("gpu", 1), ("cpu", 0)])
def test_the_first_shape_is_timed_once_and_thrown_away_on_a_gpu(monkeypatch, platform, timed):
    """The first row of a process read low for XLA on the H200 (13.6 TFLOP/s at 1024^3
    first, 41.9 later in the run): a throwaway timing takes that hit instead."""
    calls = []
    monkeypatch.setattr(bench, "time_fn", lambda fn, sets, **kw: calls.append(len(sets)) or 1.0)
    args = types.SimpleNamespace(platform=platform, input_sets=2, launches_per_dispatch=1, calls=1, bursts=1,
                                 warmup_s=0.0)
    bench._prime((64, 64, 64), jnp.bfloat16, args)
    assert len(calls) == timed
