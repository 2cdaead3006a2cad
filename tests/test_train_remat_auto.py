"""`remat="auto"` in the trainer: the least recompute whose compiled step fits the memory pool.

XLA:CPU's memory analysis does not show remat's saving (see tests/test_bench_remat.py), so
the search is tested on a model of it; the real step runs where the CPU reports no pool.
"""

import json
import os

import pytest

from jaxopt_train.runtime.memory import FitReport
from jaxopt_train.train import TrainConfig, loop, remat_search, resume, train
from jaxopt_train.train.cli import config_from_args
from jaxopt_train.train.trainer import StepTooLargeError

from test_train import TINY_RUN

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

LAYERS = 8


class _FakeTrainer:
    """Needs 100 + 20 a block, less 8 (dots_attention), 10 (dots) or 20 (full) a block under
    remat; blocks past remat_layers run remat_rest."""

    def __init__(self, cfg):
        self.cfg, self.compiled_with = cfg, None

    def compile(self, batch):
        self.compiled_with = batch

    def memory_fit(self, budget):
        remat, layers = self.cfg.remat, self.cfg.model_overrides.get("remat_layers")
        rest = self.cfg.model_overrides.get("remat_rest", "none")
        covered = 0 if remat == "none" else LAYERS if layers is None else layers
        saving = {"none": 0, "dots_attention": 8, "dots": 10, "full": 20}
        needed = 100 + LAYERS * 20 - covered * saving[remat] - (LAYERS - covered) * saving[rest]
        return FitReport(0, 0, 0, needed, 0, budget)


class _FakeTask:
    def train_batch(self, step):
        return {"tokens": step}


def _search(monkeypatch, pool, **overrides):
    built = []

    def fake_build_run(cfg, devices=None):
        built.append(cfg)
        return _FakeTask(), _FakeTrainer(cfg)

    monkeypatch.setattr(loop, "build_run", fake_build_run)
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: pool)
    monkeypatch.setattr(remat_search, "allocator_reserve", lambda budget: 0)
    cfg = TrainConfig(preset="gpt-tiny", remat="auto",
                      model_overrides={"n_layers": LAYERS, **overrides})
    return built, remat_search.build_fitting_run(cfg)


@pytest.mark.parametrize("pool, want", [
    (260, ("none", None, None)),
    (259, ("dots_attention", 1, None)),  # one block short: the least recompute, on one block
    (196, ("dots_attention", None, None)),
    (185, ("dots", 6, "dots_attention")),  # the policy that missed runs the other blocks
    (179, ("full", 1, "dots")),
])
def test_auto_picks_the_least_recompute_that_fits(monkeypatch, pool, want):
    built, (cfg, task, trainer, trials) = _search(monkeypatch, pool)
    got = cfg.model_overrides
    assert (cfg.remat, got.get("remat_layers"), got.get("remat_rest")) == want
    assert cfg.model_overrides["n_layers"] == LAYERS  # the other overrides kept
    assert trainer.cfg == cfg and trainer.compiled_with == {"tokens": 0}  # the chosen build, compiled
    assert trials[-1]["fits"] and not any(t["fits"] for t in trials if t["remat"] != cfg.remat)
    assert [(t["remat"], t["remat_layers"], t["remat_rest"]) for t in trials] == [
        (c.remat, c.model_overrides.get("remat_layers"), c.model_overrides.get("remat_rest", "none"))
        for c in built]  # nothing built twice


def test_auto_ignores_remat_layers_given_in_the_overrides(monkeypatch):
    # (A remat override itself is refused by TrainConfig: the remat field sets it.)
    _, (cfg, *_rest) = _search(monkeypatch, 259, remat_layers=3, remat_rest="dots")
    assert cfg.remat == "dots_attention" and cfg.model_overrides == {"n_layers": LAYERS, "remat_layers": 1}


def test_auto_says_what_each_remat_needs_when_nothing_fits(monkeypatch):
    with pytest.raises(StepTooLargeError, match=r"remat auto: no remat fits 0.000 GiB per device .*: "
                                                r"none needs .* GiB; dots_attention needs .*; full needs"):
        _search(monkeypatch, 10)


def test_auto_is_none_without_a_pool_and_saves_the_choice(tmp_path, capsys):
    # The CPU reports no memory pool: "auto" trains without remat and says why.
    run_dir = str(tmp_path / "run")
    result = train(TrainConfig(**TINY_RUN, remat="auto", run_dir=run_dir))
    assert result.step == TINY_RUN["steps"]
    assert "remat auto -> none: no device reports a memory pool (CPU)" in capsys.readouterr().err
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["config"]["remat"] == "none"  # a resume runs what was chosen


def test_build_run_refuses_auto_and_the_cli_accepts_it():
    cfg = config_from_args(["--remat", "auto"])
    assert cfg.remat == "auto"
    with pytest.raises(ValueError, match="build_run\\(\\) takes a fixed remat"):
        loop.build_run(cfg)


def test_remat_overrides_do_not_change_the_model_shape(tmp_path):
    base = TrainConfig(model_overrides={"d_model": 32})
    assert TrainConfig(model_overrides={"d_model": 32, "remat_layers": 3,
                                        "remat_rest": "dots"}).model_shape() == base.model_shape()
    assert TrainConfig(model_overrides={"d_model": 64}).model_shape() != base.model_shape()

    class _SavedMeta:  # a checkpoint written before remat was left out of the shape
        def read_meta(self):
            return {"model_shape": {**base.model_shape(),
                                    "model_overrides": {"d_model": 32, "remat_layers": 15}}}

    resume.check_resume_shape(str(tmp_path), base, _SavedMeta())  # no RunDirError


def test_auto_with_a_pool_that_holds_the_step_compiles_it_once(tmp_path, monkeypatch, capsys):
    from jaxopt_train.train.trainer import Trainer

    compiles = []
    real_compile = Trainer.compile
    monkeypatch.setattr(Trainer, "compile", lambda self, batch: compiles.append(1) or real_compile(self, batch))
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: 1 << 40)
    result = train(TrainConfig(**TINY_RUN, remat="auto", run_dir=str(tmp_path / "run")))
    err = capsys.readouterr().err
    assert "remat none: needs" in err and "fits" in err and "remat auto -> none" in err
    assert result.step == TINY_RUN["steps"] and len(compiles) == 1  # the search's compile is the run's


def test_auto_decides_on_the_most_any_process_needs(monkeypatch):
    """Each process compiles its own copy of a candidate; on GPUs their analyses may differ
    (autotuned workspaces), and a candidate that fits on one host only made the hosts pick
    different models, whose collectives then never met. Here another process needs 8 bytes
    more for every candidate (its pool is larger: the smallest, ours, is the budget)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: np.stack([np.asarray(x), np.asarray(x) + 8]))
    # Alone, "none" (260) fits 260; with the other's 268 it does not.
    _, (cfg, _task, _trainer, trials) = _search(monkeypatch, 260)
    assert (cfg.remat, cfg.model_overrides.get("remat_layers")) == ("dots_attention", 1)
    assert [t["needed_bytes"] for t in trials] == [268, 204, 260]


def test_auto_without_a_memory_analysis_is_none_and_says_why(monkeypatch, capsys):
    # A pool but no analysis: every candidate was taken as too large, all four were built
    # and compiled, and the error said that no remat fits without a single figure.
    monkeypatch.setattr(_FakeTrainer, "memory_fit", lambda self, budget: None)
    built, (cfg, _task, trainer, trials) = _search(monkeypatch, 100)
    assert cfg.remat == "none" and len(built) == 1 and trainer.cfg == cfg
    assert "remat auto -> none: no memory analysis" in capsys.readouterr().err


def test_auto_takes_devices_as_any_iterable(monkeypatch):
    # `mesh.devices.flat` (a one-pass iterator) reached build_run empty after the pool was
    # read from it, and a numpy array of devices raised "truth value ... is ambiguous".
    import jax
    import numpy as np

    seen = []
    monkeypatch.setattr(loop, "build_run", lambda cfg, devices=None: seen.append(list(devices))
                        or (_FakeTask(), _FakeTrainer(cfg)))
    monkeypatch.setattr("jaxopt_train.train.step.device_pool_limit", lambda device: 260)
    monkeypatch.setattr(remat_search, "allocator_reserve", lambda budget: 0)
    cfg = TrainConfig(preset="gpt-tiny", remat="auto", model_overrides={"n_layers": LAYERS})
    mesh_devices = np.asarray(jax.devices()[:2])
    for devices in (mesh_devices, mesh_devices.flat):
        seen.clear()
        chosen, *_ = remat_search.build_fitting_run(cfg, devices)
        assert chosen.remat == "none" and seen == [list(mesh_devices)]
