"""The optimised row's remat choice (`bench/train_remat.py`) against AOT memory estimates."""

from __future__ import annotations

import types

import jax
import pytest

from jaxopt_train.bench import train_remat, train_steps
from jaxopt_train.train import remat_search


def test_next_layers_from_the_two_estimates():
    # 8 blocks; none needs 18, all-blocks remat 10: each block under the policy saves 1.
    nxt = train_remat.next_remat_layers
    assert nxt(0, 18, 8, 10, 16) == 2
    assert nxt(0, 18, 8, 10, 10) == 8  # every block: nothing partial
    assert nxt(0, 18, 8, 10, 17.5) == 1
    assert nxt(0, 18, 8, 10, 18) == 1  # at least one block more than k_lo
    assert nxt(0, 10, 8, 10, 9) == 1  # the measurements do not fall: one block at a time
    # k = 2 missed at 17 (the layout saves less early on): redrawn from (2, 17) to (8, 10)
    assert nxt(2, 17, 8, 10, 16) == 3
    assert nxt(2, 17, 8, 10, 12) == 7
    with pytest.raises(ValueError, match="k_lo=8 is not below k_hi=8"):
        nxt(8, 10, 8, 10, 9)


def _table_attempt(table, budget, calls):
    """An `attempt` whose step needs table[(remat, remat_layers)] bytes."""
    def attempt(remat, layers, rest):
        calls.append((remat, layers, rest))
        needed = table(remat, layers)
        return needed, needed <= budget, (remat, layers, rest)
    return attempt


def test_search_redraws_the_line_through_a_count_that_misses():
    """A layout whose first blocks save little (the embedding's buffers stay live): the
    straight line from none (18) to dots_attention everywhere (10) says 2 blocks fit
    16, but 2 need 17.6; the line redrawn from there says 4, which needs 16.3; from
    there, 5, the fewest that fit. The old search gave up after k + 1 = 3 and recomputed
    every block."""
    needs = {0: 18, 1: 17.8, 2: 17.6, 3: 16.9, 4: 16.3, 5: 15.6, 6: 14, 7: 12, 8: 10}

    def table(remat, layers):
        return 18 if remat == "none" else needs[8 if layers is None else layers]

    calls, rebuilt = [], []
    result = remat_search.search_remat(_table_attempt(table, 16, calls), rebuilt.append, 8, 16)
    assert result == ("dots_attention", 5, "none") and not rebuilt
    assert [c[1] for c in calls] == [None, None, 2, 4, 5]


def test_search_rebuilds_every_block_when_the_tries_run_out():
    def table(remat, layers):  # only the policy on every block fits
        return 18 if remat == "none" else 10 if layers is None else 17.9

    calls, rebuilt = [], []
    result = remat_search.search_remat(_table_attempt(table, 16, calls), rebuilt.append, 8, 16)
    assert rebuilt == ["dots_attention"] and result is None  # rebuilt's return, here None
    assert len(calls) == 2 + remat_search.PARTIAL_TRIES


def test_search_keeps_the_whole_run_when_one_block_is_all_there_is():
    calls, rebuilt = [], []
    table = lambda remat, layers: 18 if remat == "none" else 10  # noqa: E731
    result = remat_search.search_remat(_table_attempt(table, 16, calls), rebuilt.append, 1, 16)
    assert result == ("dots_attention", None, "none") and not rebuilt and len(calls) == 2


def test_label_names_partial_remat():
    assert train_remat.remat_label("dots") == "dots"
    assert train_remat.remat_label("dots", 12) == "dots (first 12 blocks)"
    assert train_remat.remat_label("full", 3, "dots") == "full (first 3 blocks, dots on the rest)"


class _FakeRunner:
    def __init__(self, run):
        self.compiled = [run]


def _fake_memory(monkeypatch, layers, per_block, base, calls):
    """build_runner/fits stand-ins: a block without remat costs 0.8 * per_block
    (dots_attention), per_block (dots) or 2 * per_block (full) more than one under it.
    Blocks past remat_layers run remat_rest.
    XLA:CPU's memory analysis does not show remat's saving, so the search is tested
    on this model of it; the GPU run in BENCHMARKS.md shows the real one."""
    from jaxopt_train import runtime
    from jaxopt_train.runtime.memory import FitReport

    def fake_fits(run, budget):
        covered = 0 if run.remat == "none" else layers if run.remat_layers is None else run.remat_layers
        saving = {"none": 0, "dots_attention": per_block * 4 // 5, "dots": per_block,
                  "full": 2 * per_block}
        calls.append((run.remat, run.remat_layers, run.remat_rest))
        needed = (base + layers * 2 * per_block - covered * saving[run.remat]
                  - (layers - covered) * saving[run.remat_rest])
        return FitReport(0, 0, 0, needed, 0, budget)

    monkeypatch.setattr(train_steps, "build_runner", lambda workload, run, mesh: _FakeRunner(run))
    monkeypatch.setattr(runtime, "fits", fake_fits)


def _bench(layers):
    workload = train_steps.Workload("gpt-tiny", 4, 1, seq_len=64, n_layers=layers)
    return types.SimpleNamespace(args=types.SimpleNamespace(remat="auto"), workload=workload,
                                 devices=jax.devices()[:1])


@pytest.mark.parametrize("budget,want", [
    # 8 blocks: no remat needs 100 + 8 * 20 = 260; dots_attention saves 8 a block,
    # dots 10, full 20
    (260, ("none", None, "none")),  # everything fits without remat
    (259, ("dots_attention", 1, "none")),  # one block short: the least recompute, on one block
    (235, ("dots_attention", 4, "none")),  # 25 short: 3.1 blocks' worth
    (196, ("dots_attention", None, "none")),  # dots_attention on every block, exactly
    # dots_attention everywhere misses by 1: dots on 1 block, dots_attention on the 7 others
    # (not dots on 7 blocks and none on one)
    (195, ("dots", 1, "dots_attention")),
    (185, ("dots", 6, "dots_attention")),  # 11 short of dots_attention, 2 saved a block
    (180, ("dots", None, "none")),  # dots on every block, exactly
    (179, ("full", 1, "dots")),  # dots everywhere misses by 1: full on 1 block, dots on 7
    (130, ("full", 5, "dots")),  # full on 5 blocks, not 7 with none on the rest
    (10, ("full", None, "none")),  # nothing fits: the last policy, on every block
])
def test_remat_search_recomputes_only_what_the_budget_needs(monkeypatch, budget, want):
    calls = []
    _fake_memory(monkeypatch, layers=8, per_block=10, base=100, calls=calls)
    run = train_steps.RunConfig("optimised", accumulation="scan", donate=True)
    chosen, runner, trials, _ = train_remat.choose_remat(_bench(8), run, budget, reserve=0)
    assert (chosen.remat, chosen.remat_layers, chosen.remat_rest) == want
    assert runner.compiled[0] == chosen  # the runner handed back is the chosen one's
    assert [(t["remat"], t["remat_layers"], t["remat_rest"]) for t in trials] == calls
    assert trials[-1]["fits"] or want == ("full", None, "none")


def test_remat_search_is_fixed_by_the_flag_or_without_a_budget():
    run = train_steps.RunConfig("optimised")
    bench = _bench(4)
    chosen, runner, trials, _ = train_remat.choose_remat(bench, run, None)
    assert chosen.remat == "none" and runner is None and trials[0]["reason"] == "no memory budget known"
    bench.args.remat = "dots"
    chosen, _, trials, _ = train_remat.choose_remat(bench, run, 1 << 30)
    assert chosen.remat == "dots" and trials[0]["reason"] == "fixed by --remat"


def test_the_search_keeps_a_reserve_for_what_xla_does_not_count(monkeypatch):
    """16 GiB keeps 512 MiB back (the allocator ran ~0.3 GiB over XLA's estimate on
    gpt-1b); a step estimated at exactly the budget is then refused."""
    assert train_remat.allocator_reserve(16 << 30) == 512 << 20
    assert train_remat.allocator_reserve(1 << 30) == 32 << 20
    calls = []
    _fake_memory(monkeypatch, layers=8, per_block=10 << 20, base=100 << 20, calls=calls)
    run = train_steps.RunConfig("optimised", accumulation="scan", donate=True)
    budget = (260 << 20) + train_remat.allocator_reserve(260 << 20) - 1  # just short of "none"
    chosen, _, trials, _ = train_remat.choose_remat(_bench(8), run, budget)
    assert (chosen.remat, chosen.remat_layers, chosen.remat_rest) == ("dots_attention", 1, "none")
    assert trials[0]["reserve_bytes"] == train_remat.allocator_reserve(budget) and not trials[0]["fits"]
