"""Resuming a run: the checks that refuse a checkpoint this run cannot continue, each
before anything is built or deleted, and `restore` itself.

A resume must continue the same run: the same model shape, data order (batch size and
seed), train-state parts (the fp16 loss scale, compressed reductions' error feedback) and
a step that `--steps` and `--steps-per-dispatch` can still reach. Each refusal says what
differs and how to resume or start a new run directory; none suggests `--overwrite` for a
sound checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from jaxopt_train.train.checkpoint import Checkpointer, RunDirError, as_abstract, check_same_model
from jaxopt_train.train.config import GPT_PRESETS, TrainConfig, resolved_seq_len, shape_overrides


def check_dispatch_alignment(step: int, k: int, ckpt_dir: str) -> None:
    """Refuses a resume whose checkpoint step is not a multiple of steps_per_dispatch:
    the dispatches would then never land on the log, eval and checkpoint multiples,
    and the run would overshoot its last step."""
    if step % k:
        ones = k - step % k
        raise RunDirError(
            f"the checkpoint in {ckpt_dir} is at step {step}, which is not a multiple of "
            f"steps_per_dispatch={k}; resume with a --steps-per-dispatch that divides {step} "
            f"(e.g. 1), or with --steps-per-dispatch 1 --until-step {step + ones} for {ones} "
            f"step(s) and then with {k} (--until-step stops there and keeps --steps, so the "
            f"learning-rate schedule is the run's own)")


def check_steps_left(step: int, target: int, steps: int, ckpt_dir: str) -> None:
    """Refuses a resume whose checkpoint is past the step it was asked to train to: it would
    train nothing and report the checkpoint's step as done."""
    if step > target:
        # The advice names the limit that stopped it: --steps 16 --until-step 4 against a
        # checkpoint at 8 was told to pass --steps greater than 8.
        if target == steps:
            asked, fix = f"--steps {steps}", f"pass --steps greater than {step}"
        else:
            asked = f"--until-step {target}"
            fix = (f"pass an --until-step greater than {step}, or leave it out to train on to "
                   f"--steps {steps}")
        raise RunDirError(
            f"the checkpoint in {ckpt_dir} is at step {step}, past the last step asked for "
            f"({asked}), so there is nothing to train; to continue the run {fix}")


def nothing_left(step: int, steps: int) -> str:
    """What a resume says whose checkpoint is at the last step asked for (`step`, of the
    run's `steps`): `check_steps_left` lets it through, and it trains nothing."""
    if step == steps:
        return (f"the run is already complete at step {step} (--steps {steps}): nothing left "
                "to train; raise --steps to continue it")
    return (f"the run is already at step {step} (--until-step {step}): nothing to train; to "
            f"continue, resume with a later --until-step, or without one to train on to "
            f"--steps {steps}")


def _damaged(ckpt: Checkpointer, err: Exception) -> RunDirError:
    """The error for a latest checkpoint that orbax cannot read (files missing or truncated),
    saying which step and how to resume from the previous one."""
    step = ckpt.latest_step()
    earlier = [s for s in ckpt.all_steps() if s < step]
    hint = (f"to resume from step {earlier[-1]} (the previous checkpoint), move "
            f"{os.path.join(ckpt.directory, str(step))} out of {ckpt.directory}"
            if earlier else "no earlier checkpoint is kept")
    # The innermost cause says what is wrong and where: orbax wraps a TensorStore read error
    # ('OUT_OF_RANGE: Error reading "params...kernel.value/0.0" ...') in an Exception whose
    # text is a bound method's repr and a page of TensorStore spec.
    while err.__cause__ is not None:
        err = err.__cause__
    reason = (str(err).strip().splitlines() or [""])[0][:300]
    return RunDirError(f"cannot restore the checkpoint at step {step} in {ckpt.directory}: "
                       f"{type(err).__name__}: {reason}. It is damaged or incomplete; {hint}, "
                       f"or start over with --overwrite.")


# What decides the parts of the train state that a model of the same shape may still lack
# or add: a resume with another of these settings cannot load the checkpoint.
_STATE_PART_SETTINGS = {
    "loss_scale": "the loss scale, set by --precision (fp16 keeps a dynamic loss scale, the "
                  "other policies none)",
    "grad_error": "the error feedback of compressed gradient reductions, set by "
                  "--grad-compression (bf16 and int8 keep it, none does not)",
}


def restore(ckpt: Checkpointer, state):
    """The checkpoint's state, in the layout of `state`, whose arrays are freed first:
    a resume then needs no more device memory than the run (two states would not fit
    where one just does, e.g. gpt-1b within 16 GiB). The run stops if this raises."""
    target = jax.tree.map(as_abstract, state)
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            leaf.delete()
    try:
        restored, _ = ckpt.restore(target, part_settings=_STATE_PART_SETTINGS)
    except RunDirError:
        raise
    except Exception as err:  # noqa: BLE001 - orbax/tensorstore raise many kinds on bad files
        raise _damaged(ckpt, err) from err
    return restored


def _saved_config(run_dir: str, key: str, what: str) -> dict[str, Any] | None:
    """The object under `key` of the run's config.json record (`loop._write_config`), or
    None where the file or the key is missing: the fallback for checkpoints written before
    their meta recorded `what`, which a check reads.

    Raises:
      RunDirError: the file cannot be read, is not JSON, or it or its `key` is not an object
        (truncated or hand-edited). Nothing in the run directory is changed.
    """
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except OSError as err:  # a folder there, no permission
        problem = f"cannot be read ({type(err).__name__}: {err.strerror or err})"
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError: truncated or hand-edited
        problem = f"is not valid JSON ({type(err).__name__}: {err})"
    else:
        if not isinstance(record, dict):
            problem = f"holds a JSON {_json_type(record)}, not an object"
        elif not isinstance(record.get(key), (dict, type(None))):
            problem = f"holds a JSON {_json_type(record[key])} under {key!r}, not an object"
        else:
            return record.get(key)
    raise RunDirError(
        f"cannot resume run_dir={run_dir!r}: its checkpoints predate recording {what} in their "
        f"metadata, so it is read from {path}, which {problem}; expected the JSON object the run "
        f"wrote, with an object under {key!r}. Restore the file, or start a new --run-dir.")


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def check_resume_shape(run_dir: str, cfg: TrainConfig, ckpt: Checkpointer,
                       classes: int | None = None) -> None:
    """Refuses a checkpoint of another model shape (RunDirError naming what differs).

    `classes`: a vision run's classifier width once its data is read (`Task.classes`);
    None, before anything is built, leaves the width to that second call.
    """
    try:
        saved = ckpt.read_meta().get("model_shape")
    except Exception as err:  # noqa: BLE001 - as in restore
        raise _damaged(ckpt, err) from err
    if saved is None:
        saved = _saved_config(run_dir, "model_shape", "the model shape")
    if saved is None:
        return
    saved = dict(saved)
    # Runs saved before the ZeRO stage was left out of the shape: every stage's checkpoint
    # restores into any other's layout (the checkpoint's own tree check refuses real changes).
    saved.pop("zero", None)
    if isinstance(saved.get("model_overrides"), dict):  # runs saved before remat was left out
        saved["model_overrides"] = shape_overrides(saved["model_overrides"])
    if saved.get("preset") in GPT_PRESETS and saved.get("seq_len", 0) is None:
        # Saved before the length was resolved: None meant the preset's.
        saved["seq_len"] = resolved_seq_len(saved["preset"], None)
    current = json.loads(json.dumps(cfg.model_shape(classes)))
    if "opt_state_dtype" in saved or "opt_state_dtype" in current:
        # model_shape leaves out the default, so a change to or from f32 read "now None"
        saved.setdefault("opt_state_dtype", "f32")
        current.setdefault("opt_state_dtype", "f32")
    if "param_dtype" not in saved:  # saved before it was recorded: cannot be checked
        current.pop("param_dtype")
    widths = _classes_to_compare(saved, current, cfg, known=classes is not None)
    check_same_model(saved, current, run_dir)  # first: another preset differs in width too
    if widths is not None and widths[0] != widths[1]:
        raise _classes_changed(*widths, cfg, run_dir)


def _classes_to_compare(saved: dict[str, Any], current: dict[str, Any], cfg: TrainConfig, *,
                        known: bool) -> tuple[Any, int, str] | None:
    """(saved, now, key) of a vision run's classifier width, taken out of both shapes; None
    when there is nothing to compare yet (its data not read: `known` false).

    A shape saved before the width was recorded holds the --num-classes flag instead
    (key "num_classes"): then the flags are compared, as they were then.
    """
    if not cfg.is_vision:
        return None
    now = current.pop("classes")
    if "classes" not in saved:
        return saved.pop("num_classes", None), cfg.num_classes, "num_classes"
    before = saved.pop("classes")
    return (before, now, "classes") if known else None


def _classes_changed(before: Any, now: int, key: str, cfg: TrainConfig,
                     run_dir: str) -> RunDirError:
    fix = "start a new --run-dir"
    if key == "num_classes":  # an older run: only its flag is known
        return RunDirError(f"cannot resume run_dir={run_dir!r}: its checkpoints were saved with "
                           f"num_classes={before!r}, but now num_classes={now}; resume with "
                           f"--num-classes {before}, or {fix}.")
    widened = (f", widened to the largest label + 1 in data={cfg.data!r}"
               if now != cfg.num_classes else "")
    return RunDirError(
        f"cannot resume run_dir={run_dir!r}: its checkpoints hold a classifier of {before} "
        f"classes, but this run's has {now} (num_classes={cfg.num_classes}{widened}); resume "
        f"on the run's own data and --num-classes, or {fix}.")


# The settings that fix which examples batch `step` holds (`data.sampling.batch_indices`:
# rows step * batch_size onwards of a permutation seeded by `seed`).
DATA_ORDER_FIELDS = ("batch_size", "seed")


def data_order(cfg: TrainConfig, data_size: int | None = None) -> dict[str, Any]:
    """What a checkpoint records of its data order: the settings, and the data's size
    where known (`data_size_change`)."""
    order: dict[str, Any] = {name: getattr(cfg, name) for name in DATA_ORDER_FIELDS}
    if data_size is not None:
        order["data_size"] = data_size
    return order


def check_resume_data_order(run_dir: str, cfg: TrainConfig, ckpt: Checkpointer) -> None:
    """Refuses a resume whose batch size or seed differs from its checkpoint's: batch `step`
    would then start at another example, and the run would skip or repeat data unnoticed."""
    saved = ckpt.read_meta().get("data_order")
    if saved is None:  # checkpoints from before it was recorded: config.json has the run's
        config = _saved_config(run_dir, "config", "the data order (batch size, seed)") or {}
        saved = {name: config[name] for name in DATA_ORDER_FIELDS if name in config}
    diffs = [f"{name}: saved {saved[name]!r}, now {value!r}"
             for name, value in data_order(cfg).items() if name in saved and saved[name] != value]
    if diffs:
        raise RunDirError(
            f"cannot resume run_dir={run_dir!r} with another data order ({'; '.join(diffs)}): "
            "each step's batch is picked by step x batch_size from a permutation seeded by "
            "seed, so the resumed run would skip or repeat examples. Resume with the saved "
            "values (--batch-size, --seed; on fewer devices --microbatches keeps the global "
            "batch), or start a new --run-dir.")


def data_size_change(ckpt: Checkpointer, data_size: int | None, unit: str) -> str | None:
    """A warning if the run's data has another size than when its latest checkpoint was
    written (None if it has not, or either size is unknown).

    Not refused: appending to a corpus and training on is a choice. But batch `step` is
    then drawn from another permutation, so the user should hear that the run does not
    continue the original data order.
    """
    saved = (ckpt.read_meta().get("data_order") or {}).get("data_size")
    if saved is None or data_size is None or saved == data_size:
        return None
    return (f"warning: the training data holds {data_size:,} {unit} now, {saved:,} when the "
            f"checkpoint at step {ckpt.latest_step()} was written (changed or appended data; "
            "or a text corpus over 16 MiB, which earlier versions cut at 16 MiB): from here on "
            "the run draws other batches than the original run would have")
