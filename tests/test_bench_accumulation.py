"""`jaxopt-train bench accumulation` in CPU small mode: the three variants, the JSON, bad input."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxopt_train.accumulation import multi_steps
from jaxopt_train.bench import accumulation as bench


def test_quick_mlp_run_times_every_variant_at_equal_tokens(tmp_path, capsys):
    out = tmp_path / "acc.json"
    argv = ["--quick", "--batch", "32", "--microbatches", "4", "--width", "32", "--steps", "2",
            "--repeats", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["tokens_per_step"] == 32 and record["args"]["microbatches"] == 4
    results = record["results"]
    assert list(results) == list(bench.VARIANTS)
    for name, r in results.items():
        assert len(r["per_step_s"]) == 2 and r["median_s"] > 0, name
        assert r["first_call_s"] > 0
        assert r["temp_bytes"] is None or r["temp_bytes"] > 0
    # Same data, optimizer and number of optimizer steps: every variant ends at the same
    # whole-batch loss (f32 MLP; accumulation reorders the sums only). MultiSteps used to
    # report its last micro-batch's loss instead, a quarter of the batch (~17% off here).
    losses = {name: r["final_loss"] for name, r in results.items()}
    assert losses["scan"] == pytest.approx(losses["full"], rel=1e-5), losses
    assert losses["multisteps"] == pytest.approx(losses["full"], rel=1e-5), losses
    printed = capsys.readouterr().out
    assert "vs full" in printed and all(name in printed for name in bench.VARIANTS)


def _square_loss(w, batch):
    return jnp.mean((batch["x"] * w - batch["y"]) ** 2)


def _multisteps_setup(k: int = 4):
    """(loss_fn, w, batch, the bench's steps, the K micro-batches) of a one-weight model."""
    w, batch = jnp.float32(1.0), {"x": jnp.arange(8.0), "y": jnp.ones(8)}
    steps, _ = bench._steps(_square_loss, optax.sgd(0.0), k)
    return _square_loss, w, batch, steps, [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def test_multisteps_loss_is_the_mean_over_the_step_s_micro_batches():
    # One optimizer step of K micro-steps reports the whole batch's loss, not the last one's.
    k = 4
    loss_fn, w, batch, steps, micro_batches = _multisteps_setup(k)
    whole_batch = float(loss_fn(w, batch))  # 11.5; the last micro-batch's: 20.0
    *_, loss = steps["multisteps"](w, multi_steps(optax.sgd(0.0), k).init(w), micro_batches)
    assert bench.final_loss(loss) == pytest.approx(whole_batch, rel=1e-6)


def test_the_timed_multisteps_step_is_the_k_micro_steps_alone(monkeypatch):
    """Averaging the K losses was one more dispatch per optimizer step, timed in the
    multisteps row only; it now happens once, after the timing."""
    k = 4
    loss_fn, w, batch, steps, micro_batches = _multisteps_setup(k)
    calls, real = [], bench._mean_loss
    monkeypatch.setattr(bench, "_mean_loss", lambda *losses: calls.append(len(losses)) or real(*losses))
    # Fresh buffers, as main makes: the steps donate params and optimizer state.
    state = jax.tree.map(jnp.array, multi_steps(optax.sgd(0.0), k).init(w))
    *_, loss = bench._time(steps["multisteps"], jnp.array(w), state, micro_batches,
                           warmup=2, steps=3, repeats=2)
    assert calls == [k]  # once, for the reported loss; not in any timed step
    assert loss == pytest.approx(float(loss_fn(w, batch)), rel=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0 must be >= 1"),
    (["--repeats", "-1"], "--repeats=-1 must be >= 1"),
    (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--microbatches", "0"], "--microbatches=0 must be >= 1"),
    (["--precision", "fp9"], "--precision: unknown precision policy 'fp9'"),
    # each model reads only its own size flag; the other was accepted and ignored
    (["--model", "gpt-tiny", "--width", "64"], "--width=64 applies to --model mlp only; got --model gpt-tiny"),
    (["--seq-len", "64"], "--seq-len=64 applies to GPT models only; got --model mlp"),
])
def test_bad_flags_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_indivisible_batch_exits_2_naming_the_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--microbatches", "3", "--json", str(tmp_path / "nodir" / "a.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--batch=128 must be divisible by --microbatches=3 (equal micro-batches), e.g. --batch 129" in err
    assert not (tmp_path / "nodir").exists()  # refused before the --json folder is made


def test_an_existing_json_is_kept_unless_overwrite(tmp_path, capsys):
    path = tmp_path / "acc.json"
    path.write_text("KEEP")
    with pytest.raises(SystemExit) as exc:
        bench._parse(["--quick", "--json", str(path)])
    assert exc.value.code == 2
    assert "already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert path.read_text() == "KEEP"
    assert bench._parse(["--quick", "--json", str(path), "--overwrite"]).overwrite


def test_a_diverged_loss_is_written_as_null_in_strict_json(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_time", lambda *a, **k: ([1e-3, 2e-3], 5e-3, float("nan")))
    out = tmp_path / "acc.json"
    assert bench.main(["--quick", "--width", "8", "--json", str(out)]) == 0

    def refuse(name):
        raise ValueError(f"non-finite {name} in the JSON")
    results = json.loads(out.read_text(), parse_constant=refuse)["results"]
    assert [r["final_loss"] for r in results.values()] == [None] * 3


def test_json_folder_is_created_and_checked_before_the_run(tmp_path, capsys):
    args = bench._parse(["--quick", "--json", str(tmp_path / "nodir" / "acc.json")])
    assert (tmp_path / "nodir").is_dir() and args.json.endswith("acc.json")
    with pytest.raises(SystemExit) as exc:
        bench._parse(["--quick", "--json", str(tmp_path)])
    assert exc.value.code == 2 and "--json" in capsys.readouterr().err
