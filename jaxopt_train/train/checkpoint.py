"""Checkpoints: orbax `CheckpointManager` with keep-last-N and atomic saves.

Orbax writes each checkpoint into a temporary directory and renames it into
place only once every file is written, so a crash mid-save leaves at worst a
`*.orbax-checkpoint-tmp-*` directory that `latest_step()` ignores: the previous
checkpoint stays the latest restorable one.

Each checkpoint holds the train state (restored into an abstract target, so
optax's namedtuples and our loss-scale pytrees come back with their types)
and a small JSON record of the run's model shape, used to refuse resuming a
run directory into a model of another shape.
"""

from __future__ import annotations

import numbers
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

CHECKPOINT_SUBDIR = "checkpoints"


class RunDirError(RuntimeError):
    """The run directory's contents conflict with what was asked (resume/overwrite/shape)."""


class Checkpointer:
    """Periodic, keep-last-N checkpoints of a train state under `run_dir/checkpoints`.

    Args:
      run_dir: the run directory.
      keep: how many most recent checkpoints to keep.
      async_save: write in a background thread (the device-to-host copy is
        still synchronous, so the next step may donate the state's buffers).
    """

    def __init__(self, run_dir: str, *, keep: int = 3, async_save: bool = True):
        # bool is an int: keep=True would keep one checkpoint where "keep them" was meant.
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an integer >= 1")
        self.directory = os.path.abspath(os.path.join(run_dir, CHECKPOINT_SUBDIR))
        unreadable = _unreadable_path(self.directory)
        if unreadable:
            raise ValueError(f"run_dir={run_dir!r} holds {unreadable}")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self._keep = keep
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Saves `state` at `step` (skipped if that step is already saved); True if saved.

        Raises:
          ValueError: `step` is not an int >= 0.
          RunDirError: `step` is before the latest checkpoint's (another run in this
            directory, started over from step 0 without --resume).
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0 (the train state's step)")
        step = int(step)
        if step in self._manager.all_steps():
            return False
        # Orbax keeps the last `keep` checkpoints *saved*, not those of the highest steps, and
        # its latest_step() is then the one just saved: saving 100 beside 800-1000 deleted 800,
        # and two more saves deleted the rest of that run, without a word.
        latest = max(self._manager.all_steps(), default=None)
        if latest is not None and step < latest:
            raise RunDirError(
                f"cannot save a checkpoint at step={step} in {self.directory}: it already holds "
                f"a later one (step {latest}), which keep={self._keep} would delete as newer saves "
                "come in. Continue that run from its latest checkpoint (--resume), or save into "
                "another run directory.")
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta))
        return bool(self._manager.save(step, args=args, force=True))

    def restore(self, abstract_state: Any, step: int | None = None, *,
                part_settings: dict[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores `(state, meta)` at `step` (default: latest) into `abstract_state`'s structure.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with shardings)
        or concrete arrays of the target shapes. `part_settings`: top-level parts of the
        state that the caller's settings add or leave out (name -> the words for that
        setting); a checkpoint that holds one of them and the target not, or the other
        way round, is refused naming the setting.
        """
        step = self._saved_step(step, "to restore")
        target = jax.tree.map(as_abstract, abstract_state)
        self._check_saved_arrays(step, target, part_settings or {})
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  meta=ocp.args.JsonRestore())
        try:
            restored = self._manager.restore(step, args=args)
        except ValueError as err:
            # Same arrays, other containers: adam's chain of 2 states against adamw's 3 (its
            # weight decay holds no array), or another chain of transforms. `_check_same_tree`
            # compares arrays only, and orbax's own message read as a damaged checkpoint.
            if "tree structures do not match" not in str(err):
                raise
            detail = " ".join(str(err).split("If this mismatch")[0].split())
            raise RunDirError(
                f"cannot restore the checkpoint at step {step} in {self.directory}: its arrays "
                f"match this run's, but not the containers around them ({detail[:400]}). It was "
                "written with another optimizer or chain of optax transforms (e.g. adam against "
                "adamw, whose weight decay keeps an empty state). Resume with the optimizer "
                "that wrote it, or start a new --run-dir.") from err
        return restored["state"], dict(restored["meta"] or {})

    def _saved_step(self, step: int | None, purpose: str) -> int:
        """`step`, or the latest one where None; FileNotFoundError naming the steps there are
        if it is not saved (orbax said only "Checkpoint at .../7 not found", and took
        step=True as a step named "True"), ValueError if it is not an int."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise ValueError(f"step={step!r} must be an int (a saved step) or None (the latest)")
        saved = self.all_steps()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint {purpose} in {self.directory}")
        if int(step) not in saved:
            raise FileNotFoundError(f"no checkpoint at step={step} in {self.directory}; expected "
                                    f"one of its saved steps {saved or '(none)'}")
        return int(step)

    def _check_saved_arrays(self, step: int, target: Any, part_settings: dict[str, str]) -> None:
        """Raises RunDirError naming the state parts (`part_settings`) that only one of the
        checkpoint and `target` holds, or else the arrays whose saved shape or dtype differs,
        or that only one of them holds (`--scan-layers`, `--clip-norm 0` against a clip).

        Orbax refuses a missing or extra part or array only with "tree structures do not
        match", which reads as a damaged checkpoint: the run is sound, the settings are not
        its own.

        Orbax refuses another shape too, but with a message that names no
        array and suggests padding/truncation. Cases that must not load: a
        zero=1 or zero=3 checkpoint from before the per-leaf layout, whose
        optimizer state holds per-device chunks ([n, ..., chunk]) where the
        moments now have their parameter's shape, and (zero=3) whose params
        are one flat vector where they are now a tree of per-leaf shards.
        (Where the moment shapes coincide, the chunks are the same elements in
        the same order, so loading them is right.) Another dtype orbax does not
        refuse: it casts to the target's, silently rounding f32 into bf16 or
        truncating it into int32. So only a cast that keeps every value exactly
        loads (`_exact_widening`: an int32 step into int64 under jax_enable_x64,
        bf16 or f16 into f32, f32 into f64); any other dtype change is refused.
        """
        saved = _saved_arrays(os.path.join(self.directory, str(step), "state"))
        if saved is None:  # no readable metadata: orbax's own shape check still applies
            return
        expected = {_path_name(path): _stored_shape_dtype(leaf)
                    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]
                    if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}  # not Python scalars
        self._check_parts(step, saved, expected, part_settings)
        # One saved array where this run has a tree of them (stage 3's old flat params).
        found = [f"{name}: expected a tree of arrays, found one array of shape {shape}"
                 for name, (shape, _) in saved.items() if name not in expected
                 and any(other.startswith(name + "/") for other in expected)]
        differ = {name: (saved[name][0], shape) for name, (shape, _) in expected.items()
                  if name in saved and saved[name][0] != shape}
        found += [f"{name}: expected {shape}, found {had}" for name, (had, shape) in differ.items()]
        self._check_device_count(step, found, differ)
        if found:
            raise RunDirError(
                f"cannot restore the checkpoint at step {step} in {self.directory}: {len(found)} "
                f"array(s) have another shape than this run's state ({_shown(found)}). It was "
                "written with another layout of the state, e.g. by a zero=1 or zero=3 run from "
                "before the per-leaf layout (moments stored as per-device chunks; at zero=3 the "
                "params as one flat vector). Resume it with the version and settings that wrote "
                "it, or start a new --run-dir.")
        self._check_same_tree(step, saved, target)
        found = [f"{name}: saved {saved[name][1]}, expected {dtype}"
                 for name, (_, dtype) in expected.items()
                 if name in saved and saved[name][1] is not None and saved[name][1] != dtype
                 and not _exact_widening(saved[name][1], dtype)]
        if found:
            raise RunDirError(
                f"cannot restore the checkpoint at step {step} in {self.directory}: {len(found)} "
                f"array(s) have another dtype than this run's state ({_shown(found)}); restoring "
                "would cast them silently (rounding, or truncating floats to ints); only a widening "
                "that keeps every value (int32 to int64, bf16/f16 to f32, f32 to f64) loads. It was written "
                "with other precision settings (param or optimizer-state dtype). Resume it with "
                "the settings that wrote it, or start a new --run-dir.")

    def _check_device_count(self, step: int, found: list[str], differ: dict) -> None:
        # The error feedback of compressed reductions is kept per device, [devices, *shape]:
        # a run resumed on another device count differs there only, in the leading axis.
        counts = {(had[0], shape[0]) if name.split("/")[0] == "grad_error" and had[1:] == shape[1:]
                  else None for name, (had, shape) in differ.items()}
        if len(found) != len(differ) or len(counts) != 1 or None in counts:
            return
        ((had, now),) = counts
        raise RunDirError(
            f"cannot restore the checkpoint at step {step} in {self.directory}: its error feedback "
            f"of compressed gradient reductions (--grad-compression), kept per device, was "
            f"written on {had} devices, and this run has {now} ({_shown(found)}). Resume on "
            f"{had} devices, or start a new --run-dir.")

    def _check_parts(self, step: int, saved, expected, part_settings: dict[str, str]) -> None:
        # Only these parts: another layout of params or moments (an old ZeRO checkpoint) has
        # its own message, from the shape check.
        differ = []
        for part, setting in part_settings.items():
            had = sorted(n for n in saved if n.split("/")[0] == part)
            wants = sorted(n for n in expected if n.split("/")[0] == part)
            if had != wants:
                differ.append(f"{setting}: saved {_some(had)}, this run {_some(wants)}")
        if differ:
            raise RunDirError(
                f"cannot resume from the checkpoint at step {step} in {self.directory}: it holds "
                f"another train state than this run's settings build ({'; '.join(differ)}). Resume "
                "with the settings that wrote it (see config.json in the run directory), or start a "
                "new --run-dir.")

    def _check_same_tree(self, step: int, saved, target) -> None:
        # Orbax refuses another tree only with "tree structures do not match", which reads as
        # a damaged checkpoint (and the advice to move it away or --overwrite): the arrays are
        # sound, the settings that shape the state are not the run's own.
        names = {_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
        only_saved, only_here = sorted(set(saved) - names), sorted(names - set(saved))
        if not (only_saved or only_here):
            return
        parts = {name.split("/")[0] for name in only_saved + only_here}
        # The first part that differs: the optimizer's moments follow the params' tree.
        hint = next((hint for part, hint in _TREE_HINTS if part in parts),
                    "a model or optimizer of another structure")
        raise RunDirError(
            f"cannot restore the checkpoint at step {step} in {self.directory}: it holds another "
            f"tree of arrays than this run's state ({len(only_saved)} only in the checkpoint: "
            f"{_some(only_saved)}; {len(only_here)} only in this run: {_some(only_here)}). It was "
            f"written with other settings: {hint}. Resume with the settings that "
            "wrote it (see config.json in the run directory), or start a new --run-dir.")

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record of a checkpoint, without touching its arrays."""
        step = self._saved_step(step, "to read")
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"] or {})

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


# Top-level part of the state -> the settings that change its tree (`_check_same_tree`), in
# the order they are named.
_TREE_HINTS = (
    ("params", "the parameters' tree (--scan-layers stacks each weight of every layer into one "
               "array; a --model override or another model changes it too)"),
    ("opt_state", "the optimizer's state (--clip-norm 0 builds AdamW without the clip that any "
                  "--clip-norm > 0 chains before it, so only the threshold may change on a "
                  "resume, not clipping on or off; and with clipping on, --zero 0 chains it into "
                  "the optimizer while --zero 1 and 3 clip in the step, so a resume may move "
                  "between --zero 1 and 3 but not to or from 0)"),
)


def _unreadable_path(directory: str) -> str | None:
    """Why orbax would save checkpoints under `directory` that it cannot restore, or None.

    Orbax merges a save's per-process files by globbing under the whole path, so a
    `[...]` in it is read as a character class and nothing is merged; tensorstore reads
    a backslash as a separator and writes the arrays elsewhere. Either way every save
    seems to succeed and every restore fails."""
    bad = sorted({char for char in directory if char in "[]\\"})
    if not bad:
        return None
    return (f"{' and '.join(map(repr, bad))} in its checkpoint path {directory!r}; orbax would "
            "write checkpoints there that it cannot read back (it globs the path, and "
            "tensorstore reads a backslash as a separator): pick a --run-dir without them")


def _stored_shape_dtype(leaf) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype orbax stores `leaf` with: a typed PRNG key (a model's RNG stream,
    e.g. nnx.Dropout's) is stored as its key data, one trailing axis longer and uint32."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _exact_widening(saved: np.dtype, target: np.dtype) -> bool:
    """True if casting every `saved` value to `target` is exact: an integer into an integer
    whose range holds the saved one's, or a float into a float with at least its mantissa and
    exponent range (bf16 into f16 is not: f16's range is smaller). Never across kinds: an
    int32 into f32 rounds above 2**24, a float into an int truncates."""
    if jnp.issubdtype(saved, jnp.integer) and jnp.issubdtype(target, jnp.integer):
        have, want = jnp.iinfo(saved), jnp.iinfo(target)
        return int(want.min) <= int(have.min) and int(have.max) <= int(want.max)
    if jnp.issubdtype(saved, jnp.floating) and jnp.issubdtype(target, jnp.floating):
        have, want = jnp.finfo(saved), jnp.finfo(target)
        return (want.nmant >= have.nmant and want.maxexp >= have.maxexp
                and want.minexp - want.nmant <= have.minexp - have.nmant)  # subnormals too
    return False


def _some(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _shown(found: list[str]) -> str:
    return "; ".join(found[:4]) + (f"; and {len(found) - 4} more" if len(found) > 4 else "")


def as_abstract(x):
    """`x` as a jax.ShapeDtypeStruct with its sharding (a restore target); a leaf with
    no shape and dtype (a Python scalar) is returned as it is."""
    if isinstance(x, jax.ShapeDtypeStruct) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _path_name(path) -> str:
    """'opt_state/0/mu/...' from a key path (orbax stores namedtuples as dicts by field name)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def _saved_arrays(directory: str) -> dict[str, tuple[tuple[int, ...], np.dtype | None]] | None:
    """{array path: (shape, dtype)} from a saved state item's metadata, or None if it cannot be
    read; the dtype is None for a saved Python scalar."""
    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(directory)).tree
    except (AttributeError, KeyError, OSError, TypeError, ValueError):
        return None
    finally:
        handler.close()
    return {_path_name(path): (tuple(leaf.shape), _saved_dtype(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if getattr(leaf, "shape", None) is not None}


def _saved_dtype(leaf) -> np.dtype | None:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or isinstance(leaf, ocp.metadata.ScalarMetadata):
        return None  # a Python scalar: orbax records it as 64-bit whatever the target
    return np.dtype(dtype)


def existing_checkpoint_steps(run_dir: str) -> list[int]:
    """Finished checkpoint steps under run_dir (tmp dirs of interrupted saves excluded)."""
    directory = os.path.join(run_dir, CHECKPOINT_SUBDIR)
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


# What a run leaves in its directory, and whether it is a folder: an existing one of these
# means a run was there, and --overwrite deletes those of the kind the run writes.
RUN_FILES = {CHECKPOINT_SUBDIR: True, "metrics.jsonl": False, "config.json": False, "tb": True, "profile": True}


def prepare_run_dir(run_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Checks run_dir against resume/overwrite and creates it; deletes nothing.

    With `overwrite`, the old run is removed later, by `clear_run_dir`, once the new run
    has been built: a bad flag must not cost the user the run they had.

    Raises:
      RunDirError: run_dir holds a run (checkpoints, or metrics/config of a run that died
        before its first checkpoint) and neither `resume` nor `overwrite` is set, or
        `resume` is set and there is no checkpoint to resume, or run_dir or its checkpoints
        folder is a file, cannot be created or written (checked by making and removing a
        folder in it), or its path is one orbax cannot restore checkpoints from
        (`_unreadable_path`), or `overwrite` is set and a folder the run writes is a link
        to a folder that is not empty (`_check_no_linked_folders`).
    """
    ckpt_dir = os.path.join(run_dir, CHECKPOINT_SUBDIR)
    for path, what in ((run_dir, "run_dir"), (ckpt_dir, "its checkpoints folder")):
        if os.path.exists(path) and not os.path.isdir(path):  # before the messages below misread it
            raise RunDirError(f"{what} {path!r} is a file; expected a folder there (move the file "
                              "away, or pass another --run-dir)")
    unreadable = _unreadable_path(os.path.abspath(ckpt_dir))
    if unreadable:
        raise RunDirError(f"run_dir={run_dir!r} holds {unreadable}")
    steps = existing_checkpoint_steps(run_dir)
    if steps and not (resume or overwrite):
        raise RunDirError(
            f"run_dir={run_dir!r} already holds checkpoints (steps {steps}); pass --resume to "
            "continue that run, --overwrite to delete it and start over, or another --run-dir")
    found = [name for name, folder in RUN_FILES.items() if name != CHECKPOINT_SUBDIR
             and (os.path.isdir if folder else os.path.isfile)(os.path.join(run_dir, name))]
    if found and not steps and not overwrite:
        raise RunDirError(
            f"run_dir={run_dir!r} holds a run with no finished checkpoint ({', '.join(found)}): "
            f"{'there is nothing to resume; ' if resume else ''}pass --overwrite to delete it and "
            "start over, or another --run-dir")
    if resume and not steps:
        raise RunDirError(f"--resume: run_dir={run_dir!r} has no finished checkpoint to resume from")
    if overwrite:
        _check_no_linked_folders(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as err:  # a file in the way, no permission, read-only or missing mount
        raise RunDirError(f"cannot create run_dir={run_dir!r}: {err.strerror or err}") from err
    _check_writable(ckpt_dir if os.path.isdir(ckpt_dir) else run_dir)


def _check_no_linked_folders(run_dir: str) -> None:
    """Refuses --overwrite where a folder the run writes (checkpoints on a larger disk, tb
    in a shared log folder) is a symbolic link to a folder that is not empty.

    rmtree refuses a link: `clear_run_dir` raised a bare "Cannot call rmtree on a symbolic
    link" after the whole build, once the names before it in `RUN_FILES` were deleted. Nor
    may it guess: removing the link loses where the user put the data, and emptying its
    target may delete other runs' files there. An empty one keeps its link."""
    for name, folder in RUN_FILES.items():
        path = os.path.join(run_dir, name)
        if folder and os.path.islink(path) and os.path.isdir(path) and os.listdir(path):
            raise RunDirError(
                f"--overwrite: {path!r} is a link to {os.path.realpath(path)!r}, which is not "
                "empty; --overwrite does not delete through a link (other files may live "
                "there): expected a plain folder or an empty one. Empty that folder, or "
                "replace the link, or pass another --run-dir")


def _check_writable(folder: str) -> None:
    """Makes and removes a folder in `folder`, as a checkpoint save will. A read-only or
    immutable checkpoints folder was found at the first save, after the steps before it,
    and orbax's threads then held the process for 300 s."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=folder))
    except OSError as err:
        raise RunDirError(f"cannot write checkpoints in {folder!r}: {err.strerror or err}; "
                          "expected a writable folder (pass another --run-dir)") from err


def clear_run_dir(run_dir: str) -> None:
    """Deletes what an earlier run left in run_dir (checkpoints, metrics, config, TensorBoard
    events, profiler traces): `--overwrite`, called once the new run is built. Other files
    stay, and so does a name of `RUN_FILES` of the other kind (a folder named metrics.jsonl,
    a file named profile): no run wrote it, and the new run refuses it before this
    (`loop._check_output_paths`). In tb/ and profile/ only the event files and the
    profiler's plugins/profile/ runs go: the whole folders were deleted, with a user's
    notes in them."""
    if jax.process_index() != 0:
        return
    for name, folder in RUN_FILES.items():
        path = os.path.join(run_dir, name)
        if folder and os.path.islink(path):
            continue  # prepare_run_dir refused one whose folder is not empty
        if folder and os.path.isdir(path):
            _clear_run_folder(name, path)
        elif not folder and os.path.isfile(path):
            os.remove(path)


def _clear_run_folder(name: str, path: str) -> None:
    if name == CHECKPOINT_SUBDIR:
        shutil.rmtree(path)
        return
    if name == "profile":  # jax.profiler.trace writes plugins/profile/<run>/<host>.*
        traces = os.path.join(path, "plugins", "profile")
        if os.path.isdir(traces) and not os.path.islink(traces):
            shutil.rmtree(traces)
    else:  # tb: the EventFileWriter's events.out.tfevents.* files
        for folder, _, files in os.walk(path):
            for file in files:
                if file.startswith("events.out.tfevents."):
                    os.remove(os.path.join(folder, file))
    for folder, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
        if not os.listdir(folder):  # deepest first, so a parent emptied by its children goes too
            os.rmdir(folder)


def check_same_model(saved: dict[str, Any], current: dict[str, Any], run_dir: str) -> None:
    """Raises RunDirError naming every model-shape field that differs from the saved run
    (`TrainConfig.model_shape`: the shapes, the weights' and optimizer state's dtypes)."""
    keys = sorted(set(saved) | set(current))
    diffs = [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise RunDirError(
            f"cannot resume run_dir={run_dir!r}: its checkpoints hold a model of another "
            "shape or dtype ("
            + "; ".join(diffs) + "). Use the original settings or a new --run-dir.")
