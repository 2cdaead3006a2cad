"""jaxopt-train plot: PNGs from metrics.jsonl, several runs overlaid."""

from __future__ import annotations

import sys

import pytest

from jaxopt_train import plot
from jaxopt_train.runtime import JsonlSink

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, scale, with_mfu=True):
    sink = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(0, 50, 5):
        metrics = {"loss": scale * 5.0 / (step + 1), "tokens_per_s": 1000.0 * scale,
                   "memory_bytes_in_use": 2**30 * (1 + step / 50), "step_time_s": 0.1,
                   "DCGM_FI_DEV_FB_USED/gpu0": 2048.0}
        if with_mfu:
            metrics["mfu"] = 0.4 * scale
        sink.write(step, metrics)
    sink.close()


def test_plots_overlaid_runs(tmp_path, capsys):
    _write_run(tmp_path / "baseline", 1.0)
    _write_run(tmp_path / "optimised", 2.0)
    out = tmp_path / "plots"
    assert plot.main([str(tmp_path / "baseline"), str(tmp_path / "optimised"), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["loss.png", "memory.png", "mfu.png", "throughput.png"]
    for png in out.iterdir():
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, png
    assert str(out / "loss.png") in capsys.readouterr().out


def test_panel_contents_and_missing_panel(tmp_path, capsys):
    import matplotlib.pyplot as plt

    _write_run(tmp_path / "run", 1.0, with_mfu=False)
    captured = {}
    original_savefig = plt.Figure.savefig

    def spy(fig, path, **kwargs):  # record what each PNG shows, then save it for real
        ax = fig.axes[0]
        captured[str(path).rsplit("/", 1)[-1]] = {line.get_label(): list(line.get_ydata())
                                                  for line in ax.get_lines()}
        return original_savefig(fig, path, **kwargs)

    plt.Figure.savefig = spy
    try:
        written = plot.plot_runs([str(tmp_path / "run")], str(tmp_path / "run"))
    finally:
        plt.Figure.savefig = original_savefig
    assert len(written) == 3 and "no mfu metrics" in capsys.readouterr().out
    assert captured["loss.png"]["loss"][0] == 5.0
    memory = captured["memory.png"]
    assert memory["memory_bytes_in_use"][0] == pytest.approx(1.0)  # GiB
    assert memory["DCGM_FI_DEV_FB_USED/gpu0"][0] == pytest.approx(2.0)  # MiB -> GiB
    assert set(captured["throughput.png"]) == {"tokens_per_s"}


def test_memory_units_follow_the_metric_name(tmp_path):
    # The loop logs peak_memory_gib already in GiB; it used to be divided by 2**30 again.
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for step in (1, 2):
        sink.write(step, {"peak_memory_gib": 20.5, "peak_memory_bytes": 3 * 2**30,
                          "host_memory_mib": 2048.0, "memory_in_use": 7.0})
    sink.close()
    captured = {}
    import matplotlib.pyplot as plt

    original_savefig = plt.Figure.savefig

    def spy(fig, path, **kwargs):
        captured[str(path).rsplit("/", 1)[-1]] = {line.get_label(): list(line.get_ydata())
                                                  for line in fig.axes[0].get_lines()}
        return original_savefig(fig, path, **kwargs)

    plt.Figure.savefig = spy
    try:
        plot.plot_runs([str(tmp_path / "run")], str(tmp_path / "out"))
    finally:
        plt.Figure.savefig = original_savefig
    assert captured["memory.png"] == {"peak_memory_gib": [20.5, 20.5],
                                      "peak_memory_bytes": [3.0, 3.0],
                                      "host_memory_mib": [2.0, 2.0],
                                      "memory_in_use": [7.0, 7.0]}  # no unit: drawn as logged


def test_bad_run_dir(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nope")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        plot.main([])
    assert err.value.code == 2


def test_import_does_not_touch_matplotlib_backend():
    import importlib
    import subprocess

    code = "import jaxopt_train.plot, sys; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False"
    importlib.import_module("jaxopt_train.plot")
