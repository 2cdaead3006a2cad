"""jaxopt-train plot: PNGs from metrics.jsonl, several runs overlaid."""

from __future__ import annotations

import os
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


def _plot_error(argv, capsys):
    """plot.main's exit status and stderr, asserting it printed no traceback."""
    code = plot.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_missing_run_dir_exits_2(tmp_path, capsys):
    code, err = _plot_error([str(tmp_path / "nope")], capsys)
    assert code == 2 and f"run directory '{tmp_path / 'nope'}' does not exist" in err


def test_run_dir_without_metrics_exits_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    code, err = _plot_error([str(tmp_path / "run")], capsys)
    assert code == 2 and "no metrics.jsonl in run directory" in err and "metrics.jsonl" in err
    (tmp_path / "file").write_text("x")
    code, err = _plot_error([str(tmp_path / "file")], capsys)
    assert code == 2 and "is not a directory" in err


@pytest.mark.parametrize("content", [b"", b"\n\n", b'{"step": 0, "lo', b"[1, 2]\n", b"\xff\xfe\n"])
def test_empty_or_unreadable_metrics_exits_2(tmp_path, capsys, content):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(content)
    code, err = _plot_error([str(tmp_path / "run")], capsys)
    assert code == 2 and "holds no records" in err


def test_metrics_path_is_a_directory_exits_2(tmp_path, capsys):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    code, err = _plot_error([str(tmp_path / "run")], capsys)
    assert code == 2 and "metrics.jsonl' is not a file (a folder?)" in err  # was "no metrics.jsonl"


def test_torn_lines_are_skipped_with_a_warning(tmp_path, capsys):
    _write_run(tmp_path / "run", 1.0)
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    # A run killed mid-line, then resumed: the torn line gets the next record appended.
    path.write_bytes(b"".join(lines[:3]) + lines[3][:20] + b"".join(lines[4:]) + b'{"step": 50, "loss": 0.')
    assert plot.load_run(str(tmp_path / "run"))[-1]["step"] == 45
    err = capsys.readouterr().err
    assert "warning: skipped line 4 of" in err and "warning: skipped line 10 of" in err
    code, err = _plot_error([str(tmp_path / "run"), "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and (tmp_path / "out" / "loss.png").is_file() and "skipped line 10" in err


def test_out_that_is_a_file_or_cannot_be_created_exits_2(tmp_path, capsys):
    _write_run(tmp_path / "run", 1.0)
    (tmp_path / "file").write_text("x")
    code, err = _plot_error([str(tmp_path / "run"), "--out", str(tmp_path / "file")], capsys)
    assert code == 2 and f"--out '{tmp_path / 'file'}' is a file" in err
    code, err = _plot_error([str(tmp_path / "run"), "--out", str(tmp_path / "file" / "sub")], capsys)
    assert code == 2 and "cannot create --out directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"]


@pytest.mark.skipif(getattr(os, "geteuid", lambda: 1)() == 0, reason="root writes anywhere")
def test_unwritable_out_exits_2(tmp_path, capsys):
    _write_run(tmp_path / "run", 1.0)
    (tmp_path / "ro").mkdir(mode=0o500)
    try:
        code, err = _plot_error([str(tmp_path / "run"), "--out", str(tmp_path / "ro")], capsys)
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert code == 2 and "is not writable" in err


def test_write_failure_while_saving_exits_2(tmp_path, capsys, monkeypatch):
    import matplotlib.pyplot as plt

    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    _write_run(tmp_path / "run", 1.0)
    monkeypatch.setattr(plt.Figure, "savefig", fail)
    code, err = _plot_error([str(tmp_path / "run"), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "cannot write a PNG" in err and "Permission denied" in err


def test_a_save_that_fails_part_way_keeps_the_earlier_plot(tmp_path, capsys, monkeypatch):
    # Was: the PNG was saved in place, so a full disk mid-save left the run's earlier
    # loss.png truncated to the bytes written before the failure.
    import PIL.Image

    _write_run(tmp_path / "run", 1.0)
    assert plot.main([str(tmp_path / "run")]) == 0
    earlier = (tmp_path / "run" / "loss.png").read_bytes()

    def full_disk(image, fp, *args, **kwargs):  # PIL opens (truncates) the file, then encodes
        with open(fp, "wb") as file:
            file.write(earlier[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PIL.Image.Image, "save", full_disk)
    code, err = _plot_error([str(tmp_path / "run")], capsys)
    assert code == 2 and "No space left on device" in err
    assert (tmp_path / "run" / "loss.png").read_bytes() == earlier
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "loss.png", "memory.png", "metrics.jsonl", "mfu.png", "throughput.png"]  # no temporary left


def test_existing_pngs_are_kept_unless_overwrite(tmp_path, capsys):
    # Was: a plot into a folder named by --out replaced the PNGs there without a word.
    _write_run(tmp_path / "run", 1.0, with_mfu=False)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "loss.png").write_bytes(b"an earlier plot")
    (out / "mfu.png").write_bytes(b"not one this run would write")
    code, err = _plot_error([str(tmp_path / "run"), "--out", str(out)], capsys)
    assert code == 2
    assert f"--out directory '{out}' already holds loss.png; pass --overwrite" in err
    assert "or another --out DIR" in err
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "mfu.png"]
    assert (out / "loss.png").read_bytes() == b"an earlier plot"
    with pytest.raises(ValueError, match="already holds loss.png"):
        plot.plot_runs([str(tmp_path / "run")], str(out))
    assert plot.main([str(tmp_path / "run"), "--out", str(out), "--overwrite"]) == 0
    assert (out / "loss.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "mfu.png").read_bytes() == b"not one this run would write"
    # Without --out the run's own plots are redrawn, as a run that is still training needs.
    assert plot.main([str(tmp_path / "run")]) == 0
    assert plot.main([str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "loss.png").read_bytes().startswith(PNG_MAGIC)


def test_no_run_dirs_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as err:
        plot.main([])
    assert err.value.code == 2 and "RUN_DIR" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one run directory"):
        plot.plot_runs([], "out")


def test_nothing_to_plot_exits_2(tmp_path, capsys):
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    sink.write(0, {"grad_norm": 1.0})
    sink.close()
    code, err = _plot_error([str(tmp_path / "run")], capsys)
    assert code == 2 and "no run has any metric to plot" in err
    code, err = _plot_error([str(tmp_path / "run"), "--out", str(tmp_path / "new")], capsys)
    assert code == 2 and not (tmp_path / "new").exists()  # it made the folder, then failed


def test_a_series_of_one_point_is_drawn_with_a_marker(tmp_path, monkeypatch):
    """ax.plot of one point without a marker draws nothing: a legend entry and empty axes."""
    import matplotlib.axes

    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    sink.write(0, {"loss": 2.0})
    for step in (0, 5):
        sink.write(step, {"tokens_per_s": 10.0 + step})
    sink.close()
    markers = {}
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        markers[kwargs.get("label")] = kwargs.get("marker")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    plot.plot_runs([str(tmp_path / "run")], str(tmp_path / "out"))
    assert markers == {"loss": "o", "tokens_per_s": None}


def test_runs_with_the_same_base_name_are_all_drawn(tmp_path, capsys):
    import matplotlib.pyplot as plt

    _write_run(tmp_path / "a" / "run", 1.0)
    _write_run(tmp_path / "b" / "run", 2.0)
    labels = []
    original_savefig = plt.Figure.savefig

    def spy(fig, path, **kwargs):
        if str(path).endswith("loss.png"):
            labels.extend(line.get_label() for line in fig.axes[0].get_lines())
        return original_savefig(fig, path, **kwargs)

    plt.Figure.savefig = spy
    try:
        plot.plot_runs([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")], str(tmp_path / "out"))
    finally:
        plt.Figure.savefig = original_savefig
    assert labels == [f"{tmp_path / 'a' / 'run'}: loss", f"{tmp_path / 'b' / 'run'}: loss"]
    code, err = _plot_error([str(tmp_path / "a" / "run"), str(tmp_path / "a" / "run" / ".")], capsys)
    assert code == 2 and "given twice" in err


def test_import_does_not_touch_matplotlib_backend():
    import importlib
    import subprocess

    code = "import jaxopt_train.plot, sys; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False"
    importlib.import_module("jaxopt_train.plot")


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path):
    # Crashed after logging step 150 with its last checkpoint at 100; resumed from 100.
    # Was: the curve ran 50, 100, 150, 110, ... (backwards), drawing both histories.
    run = tmp_path / "resumed"
    sink = JsonlSink(run / "metrics.jsonl")
    for step in (50, 100, 120, 140, 150):
        sink.write(step, {"loss": 3.0 - step / 100})
    sink.close()
    sink = JsonlSink(run / "metrics.jsonl")
    for step in (110, 130, 150, 200):  # logs at other steps than the crashed run did
        sink.write(step, {"loss": 9.0})
    sink.close()
    steps, values = plot._series(plot.load_run(str(run)), "loss")
    # 120 and 140 belong to the crashed history too, though the resumed run never logs them.
    assert steps == [50, 100, 110, 130, 150, 200]
    assert values == [2.5, 2.0, 9.0, 9.0, 9.0, 9.0]


def test_records_of_one_step_merge_and_the_last_value_wins():
    records = [{"step": 10, "loss": 2.0}, {"step": 10, "eval_loss": 2.5},  # separate writes
               {"step": 20, "loss": 1.0}, {"step": 20, "loss": 0.9}, {"step": "x", "loss": 5.0}]
    assert plot._series(records, "loss") == ([10, 20], [2.0, 0.9])
    assert plot._series(records, "eval_loss") == ([10], [2.5])


def test_non_finite_values_are_reported_not_taken_for_a_missing_metric(tmp_path, capsys):
    # Was: a run whose loss was NaN from the start printed "no loss metrics (names
    # matching ...)", and a loss that turned NaN mid-run ended its curve without a word.
    from jaxopt_train.train.metrics import JsonlWriter

    diverged = JsonlWriter(tmp_path / "diverged" / "metrics.jsonl")  # writes NaN as "nan"
    late = JsonlSink(tmp_path / "late" / "metrics.jsonl")  # writes NaN as NaN
    for step in (1, 2, 3):
        diverged.write(step, {"loss": float("nan"), "tokens_per_s": 10.0})
        late.write(step, {"loss": 1.0 if step == 1 else float("inf"), "tokens_per_s": 10.0})
    diverged.close()
    late.close()
    written = plot.plot_runs([str(tmp_path / "diverged")], str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert [os.path.basename(p) for p in written] == ["throughput.png"]
    assert "no loss metrics" not in out
    assert "plot: loss: 'loss' has no finite value (3 of 3 records NaN or inf, from step 1); " in out
    plot.plot_runs([str(tmp_path / "late")], str(tmp_path / "out2"))
    assert "plot: loss: 'loss' has 2 of 3 records NaN or inf, from step 2; drawn without them" \
        in capsys.readouterr().out


def test_plot_refuses_records_without_a_numeric_step(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0, "loss": 1.0}\n{"iteration": 1, "loss": 0.5}\n')
    assert plot.main([str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert 'has a numeric "step"' in err and "iteration, loss" in err
    assert "no finite numbers" not in err


def test_plot_draws_a_bytes_per_second_rate_as_throughput_not_memory(tmp_path):
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for step in range(3):
        sink.write(step, {"hbm_bytes_per_s": 2.0**40, "peak_memory_gib": 3.0})
    sink.close()
    curves = {panel: [name for _, name, _, _ in plot._panel_curves(
        {"run": plot.load_run(str(tmp_path / "run"))}, pattern)]
        for panel, (_, pattern, _) in plot.PANELS.items()}
    assert curves["throughput"] == ["hbm_bytes_per_s"]
    assert curves["memory"] == ["peak_memory_gib"]


def test_an_integer_past_floats_range_is_reported_as_inf_not_a_crash(tmp_path, capsys):
    """JSON allows any integer: float(10**400) raised OverflowError out of the plot."""
    run = tmp_path / "huge"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 1%s}\n{"step": 2, "loss": 2.5, "tokens_per_s": -1%s}\n'
        '{"step": 1%s, "loss": 2.0}\n' % ("0" * 400, "0" * 400, "0" * 400))
    written = plot.plot_runs([str(run)], str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert [os.path.basename(p) for p in written] == ["loss.png"]
    assert "plot: loss: 'loss' has 1 of 3 records NaN or inf, from step 1; drawn without them" in out
    assert plot._series(plot.load_run(str(run)), "loss") == ([2.0], [2.5])
