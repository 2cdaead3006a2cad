"""`jaxopt-train bench matmul` in its CPU mode: rows, ratios, JSON, the config column, bad input."""

from __future__ import annotations

import json
import re

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
