"""Checkpoints: round trip into typed targets, keep-last-N, atomicity, run-dir guards."""

import os
import shutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxopt_train.precision import DynamicLossScale, NoOpLossScale
from jaxopt_train.train.checkpoint import (Checkpointer, RunDirError, check_same_model,
                                           clear_run_dir, existing_checkpoint_steps,
                                           prepare_run_dir)
from jaxopt_train.train.state import TrainState, init_train_state


def _state(scale):
    params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.zeros(4, jnp.float32)}
    return init_train_state(params, {"stats": jnp.ones(4, jnp.float32)}, optax.adamw(1e-3), scale)


@pytest.mark.parametrize("scale", [NoOpLossScale(), DynamicLossScale(initial_scale=8.0)])
def test_round_trip_keeps_types_and_values(tmp_path, scale):
    state = _state(scale)._replace(step=jnp.int32(7))
    ckpt = Checkpointer(str(tmp_path), keep=2)
    assert ckpt.save(7, state, {"model_shape": {"preset": "x"}})
    ckpt.wait()
    restored, meta = ckpt.restore(jax.tree.map(jnp.zeros_like, state))
    ckpt.close()
    assert isinstance(restored, TrainState)
    assert type(restored.loss_scale) is type(scale)
    assert type(restored.opt_state[0]) is type(state.opt_state[0])
    assert meta == {"model_shape": {"preset": "x"}}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_round_trip_keeps_error_feedback_sharded_per_device(tmp_path):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxopt_train.train.step import init_sharded_error_feedback, make_data_mesh, replicate

    mesh = make_data_mesh(jax.devices()[:4])
    state = replicate(_state(NoOpLossScale()), mesh)
    error = init_sharded_error_feedback(state.params, mesh)
    error = jax.tree.map(lambda e: e + jnp.arange(4, dtype=jnp.float32).reshape(4, *[1] * (e.ndim - 1)),
                         error)  # a different error on every device
    state = state._replace(grad_error=error)
    ckpt = Checkpointer(str(tmp_path), keep=1)
    ckpt.save(1, state, {})
    ckpt.wait()
    restored, _ = ckpt.restore(jax.tree.map(jnp.zeros_like, state))
    ckpt.close()
    leaf = restored.grad_error.error["w"]
    assert leaf.shape == (4, 3, 4) and leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_keep_last_n(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=2)
    state = _state(NoOpLossScale())
    for step in (1, 2, 3):
        ckpt.save(step, state, {})
    ckpt.close()
    assert existing_checkpoint_steps(str(tmp_path)) == [2, 3]


def test_interrupted_save_leaves_previous_checkpoint_restorable(tmp_path):
    state = _state(NoOpLossScale())._replace(step=jnp.int32(5))
    ckpt = Checkpointer(str(tmp_path), keep=3)
    ckpt.save(5, state, {})
    ckpt.close()
    # What a crash mid-save leaves: orbax's temporary directory, half written.
    tmp = tmp_path / "checkpoints" / "10.orbax-checkpoint-tmp-1234"
    tmp.mkdir()
    (tmp / "partial").write_bytes(b"\0" * 100)
    assert existing_checkpoint_steps(str(tmp_path)) == [5]
    reopened = Checkpointer(str(tmp_path), keep=3)
    assert reopened.latest_step() == 5
    restored, _ = reopened.restore(state)
    reopened.close()
    assert int(restored.step) == 5


def test_restore_without_checkpoint_raises(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(_state(NoOpLossScale()))
    ckpt.close()


def test_restore_into_other_shapes_names_each_array(tmp_path):
    """Orbax refuses it too, but without naming the array; ours says expected and found."""
    state = _state(NoOpLossScale())
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, state, {})
    other = state._replace(params={"w": jnp.zeros((4, 3)), "b": jnp.zeros(4)})
    with pytest.raises(RunDirError, match=r"1 array\(s\).*params/w: expected \(4, 3\), found \(3, 4\)"):
        ckpt.restore(other)
    ckpt.close()



@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32, jnp.float16])
def test_restore_into_another_dtype_names_each_array(tmp_path, dtype):
    """Before: orbax cast silently to the target's dtype (f32 rounded to bf16, truncated to int32)."""
    state = _state(NoOpLossScale())
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, state, {})
    other = state._replace(params={"w": state.params["w"].astype(dtype), "b": state.params["b"]})
    name = jnp.dtype(dtype).name
    with pytest.raises(RunDirError, match=rf"1 array\(s\) have another dtype.*params/w: saved float32, "
                                          rf"expected {name}.*start a new --run-dir"):
        ckpt.restore(other)
    ckpt.close()


def test_restore_widens_exactly_into_wider_dtypes(tmp_path):
    """Before: refused ('step: saved int32, expected int64'), though these casts keep every
    value: a run resumed under jax_enable_x64, or with f32 where it had bf16/f16 params."""
    state = {"step": jnp.int32(2**31 - 1),
             "h": jnp.asarray([1.5, 2.0**-24, 65504.0, -0.0], jnp.float16),
             "b": jnp.asarray([1 / 3, 1e30, -3e-38, 2.0**-133], jnp.bfloat16),
             "f": jnp.asarray([1 / 3, 3e38, 1e-45, -7.0], jnp.float32)}
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, state, {})
    with jax.enable_x64(True):
        wider = {"step": jnp.int64, "h": jnp.float32, "b": jnp.float32, "f": jnp.float64}
        restored, _ = ckpt.restore({name: jax.ShapeDtypeStruct(jnp.shape(state[name]), dtype)
                                    for name, dtype in wider.items()})
        for name, dtype in wider.items():
            assert restored[name].dtype == dtype, name
            np.testing.assert_array_equal(np.asarray(restored[name]),
                                          np.asarray(state[name]).astype(dtype))
    ckpt.close()


@pytest.mark.parametrize("saved, target", [
    (jnp.int64, jnp.int32),       # narrowing
    (jnp.int32, jnp.float32),     # across kinds: rounds above 2**24
    (jnp.int32, jnp.uint32),      # negative values do not fit
    (jnp.float64, jnp.float32),   # rounds
    (jnp.bfloat16, jnp.float16),  # fewer exponent bits: 1e30 overflows
    (jnp.float16, jnp.bfloat16),  # fewer mantissa bits
    (jnp.float32, jnp.int64),     # truncates
])
def test_restore_still_refuses_every_cast_that_is_not_exact(tmp_path, saved, target):
    with jax.enable_x64(True):
        ckpt = Checkpointer(str(tmp_path), async_save=False)
        ckpt.save(1, {"x": jnp.arange(3).astype(saved)}, {})
        with pytest.raises(RunDirError, match=rf"x: saved {jnp.dtype(saved).name}, "
                                              rf"expected {jnp.dtype(target).name}"):
            ckpt.restore({"x": jax.ShapeDtypeStruct((3,), target)})
        ckpt.close()


def test_restore_with_python_scalar_and_prng_key_leaves(tmp_path):
    """Before: a Python scalar leaf in the target raised AttributeError ('int' has no shape).
    Typed PRNG keys, stored as uint32 key data, still restore without a dtype complaint."""
    state = {"w": jnp.arange(3.0), "count": 5, "key": jax.random.key(3),
             "keys": jax.random.split(jax.random.key(4), 2)}
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, state, {})
    restored, _ = ckpt.restore(state)
    ckpt.close()
    assert restored["count"] == 5
    np.testing.assert_array_equal(restored["w"], state["w"])
    for name in ("key", "keys"):
        np.testing.assert_array_equal(jax.random.key_data(restored[name]),
                                      jax.random.key_data(state[name]))


@pytest.mark.parametrize("keep", [0, -1, True, 2.0, "3", None])
def test_bad_keep(keep):
    with pytest.raises(ValueError, match=re.escape(f"keep={keep!r} must be an integer >= 1")):
        Checkpointer("/tmp/unused", keep=keep)


def test_prepare_run_dir_guards(tmp_path):
    run = str(tmp_path / "run")
    with pytest.raises(RunDirError, match="no finished checkpoint"):
        prepare_run_dir(run, resume=True, overwrite=False)
    prepare_run_dir(run, resume=False, overwrite=False)
    os.makedirs(os.path.join(run, "checkpoints", "3"))
    with pytest.raises(RunDirError, match="--resume"):
        prepare_run_dir(run, resume=False, overwrite=False)
    prepare_run_dir(run, resume=True, overwrite=False)  # fine: there is something to resume
    assert existing_checkpoint_steps(run) == [3]
    prepare_run_dir(run, resume=False, overwrite=True)  # checks only: the old run is still there
    assert existing_checkpoint_steps(run) == [3]
    with open(os.path.join(run, "notes.txt"), "w") as f:
        f.write("the user's own file")
    os.makedirs(os.path.join(run, "profile", "plugins"))  # the old run's --profile-steps trace
    clear_run_dir(run)  # once the new run is built
    assert existing_checkpoint_steps(run) == [] and os.listdir(run) == ["notes.txt"]
    # In tb/ and profile/ the run's events and traces go, the user's own files stay: the
    # whole folders were deleted.
    written = {"tb/events.out.tfevents.1764.host": "run", "tb/notes.md": "mine",
               "profile/plugins/profile/2026_12_06/host.xplane.pb": "run",
               "profile/plugins/profile/2026_12_06/host.trace.json.gz": "run",
               "profile/notes.md": "mine", "profile/mine/a.txt": "mine"}
    for name, text in written.items():
        os.makedirs(os.path.dirname(os.path.join(run, name)), exist_ok=True)
        with open(os.path.join(run, name), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(run, "checkpoints", "3"))
    clear_run_dir(run)
    left = sorted(os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs)
    assert left == ["notes.txt", "profile/mine/a.txt", "profile/notes.md", "tb/notes.md"]
    assert sorted(os.listdir(os.path.join(run, "profile"))) == ["mine", "notes.md"]
    for name in ("tb", "profile"):
        shutil.rmtree(os.path.join(run, name))
    # A run that died before its first checkpoint left metrics and a config: a new run
    # there must not append to them unless told to start over.
    for name in ("metrics.jsonl", "config.json"):
        with open(os.path.join(run, name), "w") as f:
            f.write("{}\n")
    with pytest.raises(RunDirError, match="no finished checkpoint .*metrics.jsonl, config.json.*--overwrite"):
        prepare_run_dir(run, resume=False, overwrite=False)
    with pytest.raises(RunDirError, match="nothing to resume"):
        prepare_run_dir(run, resume=True, overwrite=False)
    prepare_run_dir(run, resume=False, overwrite=True)
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    with pytest.raises(RunDirError, match=r"cannot create run_dir='.*a_file/run': Not a directory"):
        prepare_run_dir(str(blocker / "run"), resume=False, overwrite=False)
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("resume", [False, True])
def test_a_file_where_the_run_dir_or_its_checkpoints_go_is_named_as_such(tmp_path, resume):
    """A file run_dir read "cannot create ...: File exists"; a file RUN_DIR/checkpoints was "a run
    with no finished checkpoint ... pass --overwrite", which then failed at the first save."""
    as_file = tmp_path / "afile"
    as_file.write_text("keep")
    with pytest.raises(RunDirError, match=r"run_dir '.*afile' is a file; expected a folder there"):
        prepare_run_dir(str(as_file), resume=resume, overwrite=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("keep")
    for overwrite in (False, True) if not resume else (False,):
        with pytest.raises(RunDirError, match=r"its checkpoints folder '.*checkpoints' is a file; expected a folder"):
            prepare_run_dir(str(run), resume=resume, overwrite=overwrite)
    assert as_file.read_text() == "keep" and (run / "checkpoints").read_text() == "keep"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_checkpoints_folder_that_cannot_be_written_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o500)
    try:
        with pytest.raises(RunDirError, match=r"cannot write checkpoints in '.*checkpoints': Permission denied"):
            prepare_run_dir(str(run), resume=False, overwrite=False)
    finally:
        (run / "checkpoints").chmod(0o700)


def test_the_write_check_leaves_nothing_behind(tmp_path, monkeypatch):
    run = tmp_path / "run"
    prepare_run_dir(str(run), resume=False, overwrite=False)
    assert os.listdir(run) == []
    import tempfile

    def refuse(**kwargs):  # as an immutable (chattr +i) or read-only mount answers, root too
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(RunDirError, match=r"cannot write checkpoints in '.*run': Operation not permitted; "
                                          r"expected a writable folder"):
        prepare_run_dir(str(run), resume=False, overwrite=False)


def test_check_same_model_names_the_difference():
    check_same_model({"preset": "gpt-tiny"}, {"preset": "gpt-tiny"}, "r")
    with pytest.raises(RunDirError, match="model_overrides: saved"):
        check_same_model({"model_overrides": {"d_model": 64}}, {"model_overrides": {}}, "r")


def test_resume_frees_the_initial_state_before_restoring(tmp_path):
    """Two training states on the device at once would not fit where one just does
    (gpt-1b within 16 GiB): the fresh state's arrays go before the checkpoint's load."""
    from jaxopt_train.train import resume

    state = _state(NoOpLossScale())
    ckpt = Checkpointer(str(tmp_path), keep=1)
    ckpt.save(3, state, {})
    ckpt.wait()
    fresh = jax.tree.map(jnp.zeros_like, state)
    restored = resume.restore(ckpt, fresh)
    ckpt.close()
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(fresh))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["sweep[lr=3e-4]", "run[1]", "a\\b"])
def test_a_run_dir_whose_checkpoints_orbax_cannot_read_back_is_refused_up_front(tmp_path, name):
    """Before: accepted. Orbax finds a save's per-process files with a glob of the whole
    path, so under `sweep[lr=3e-4]` (a character class) it merged nothing, and tensorstore
    reads a backslash as a separator: every save "succeeded", and every restore of the
    run failed as a damaged checkpoint, hours of training later."""
    run = str(tmp_path / name)
    with pytest.raises(RunDirError, match=r"run_dir=.* holds .*; orbax .* pick a --run-dir without"):
        prepare_run_dir(run, resume=False, overwrite=False)
    assert not os.path.exists(run)
    with pytest.raises(ValueError, match="pick a --run-dir without"):
        Checkpointer(run)
    assert not os.path.exists(run)


def _default_state(clip_norm, params):
    from jaxopt_train.train.state import default_optimizer

    optimizer = default_optimizer(lr=1e-3, total_steps=10, clip_norm=clip_norm)
    return init_train_state(params, {}, optimizer, NoOpLossScale())


@pytest.mark.parametrize("change, needle", [
    # --clip-norm 0 builds AdamW without the clip's chain around it.
    (lambda p: _default_state(0.0, p), r"--clip-norm"),
    # --scan-layers stacks the layers: one array per weight instead of one per layer.
    (lambda p: _default_state(1.0, {"blocks": {"w": jnp.stack([p["blocks"]["0"]["w"]] * 2)}}),
     r"--scan-layers"),
])
def test_resume_into_another_state_tree_names_the_setting_not_a_damaged_checkpoint(
        tmp_path, change, needle):
    """Before: orbax's "tree structures do not match" read as a damaged checkpoint, and the
    message told the user to move it away or start over with --overwrite: a sound run lost."""
    from jaxopt_train.train import resume

    params = {"blocks": {"0": {"w": jnp.ones((2, 2))}, "1": {"w": jnp.ones((2, 2))}}}
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(4, _default_state(1.0, params), {})
    with pytest.raises(RunDirError, match=needle) as info:
        resume.restore(ckpt, change(params))
    ckpt.close()
    message = str(info.value)
    assert "damaged" not in message and "--overwrite" not in message
    assert "checkpoint at step 4" in message and "new --run-dir" in message
    assert existing_checkpoint_steps(str(tmp_path)) == [4]


def test_resume_of_compressed_reductions_on_another_device_count_says_so(tmp_path):
    """Before: "written with another layout of the state, e.g. by a zero=1 or zero=3 run
    from before the per-leaf layout", for a run that only changed its device count: the
    error feedback of --grad-compression is kept per device ([devices, *param.shape])."""
    state = _state(NoOpLossScale())
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(2, state._replace(grad_error={"w": jnp.zeros((8, 3, 4)), "b": jnp.zeros((8, 4))}), {})
    fewer = state._replace(grad_error={"w": jnp.zeros((4, 3, 4)), "b": jnp.zeros((4, 4))})
    with pytest.raises(RunDirError, match=r"written on 8 devices, and this run has 4.*Resume on 8 "
                                          r"devices, or start a new --run-dir") as info:
        ckpt.restore(fewer)
    ckpt.close()
    assert "zero" not in str(info.value)


def test_a_save_before_the_latest_checkpoint_is_refused_and_deletes_nothing(tmp_path):
    """Before: accepted. Orbax keeps the last `keep` checkpoints saved (not the highest
    steps), so a second run started over from step 0 in the same folder had its save at
    100 replace step 800, latest_step() became 100, and two more saves deleted the rest of
    the first run (800-1000) without a word."""
    state = _state(NoOpLossScale())
    ckpt = Checkpointer(str(tmp_path), keep=3, async_save=False)
    for step in (800, 900, 1000):
        ckpt.save(step, state, {})
    ckpt.close()
    again = Checkpointer(str(tmp_path), keep=3, async_save=False)
    with pytest.raises(RunDirError, match=r"step=100 in .*checkpoints: it already holds a later one "
                                          r"\(step 1000\).*--resume"):
        again.save(100, state, {})
    assert not again.save(900, state, {})  # already saved: skipped, as before
    assert again.save(1100, state, {})
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=r"must be an int >= 0"):
            again.save(bad, state, {})
    assert again.latest_step() == 1100
    again.close()
    assert existing_checkpoint_steps(str(tmp_path)) == [900, 1000, 1100]


@pytest.mark.parametrize("name", ["checkpoints", "tb"])
def test_overwrite_of_a_run_with_a_linked_folder_is_refused_before_anything_is_deleted(
        tmp_path, name):
    """Before: prepare_run_dir passed, and clear_run_dir raised a bare "Cannot call rmtree
    on a symbolic link" after the new run was built; with `tb` linked (a shared log folder)
    the old run's checkpoints, metrics and config were deleted first, and no run started."""
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints" if name == "tb" else run)
    elsewhere = tmp_path / "bigdisk"
    (elsewhere / "4").mkdir(parents=True)  # a checkpoint, or another run's events
    os.symlink(elsewhere, run / name)
    if name == "tb":
        (run / "checkpoints" / "4").mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match=rf"--overwrite: '.*{name}' is a link to '.*bigdisk', "
                                          r"which is not empty.*Empty that folder"):
        prepare_run_dir(str(run), resume=False, overwrite=True)
    assert (run / "metrics.jsonl").exists() and (elsewhere / "4").is_dir()
    # Emptied, the link stays where the user put it, and the old run's other files go.
    os.rmdir(elsewhere / "4")
    prepare_run_dir(str(run), resume=False, overwrite=True)
    clear_run_dir(str(run))
    assert os.path.islink(run / name) and not (run / "metrics.jsonl").exists()
    assert existing_checkpoint_steps(str(run)) == []


def test_another_optimizer_with_the_same_arrays_is_named_not_called_damaged(tmp_path):
    """adam's state is a chain of 2, adamw's of 3 (its weight decay holds no array): the
    same arrays under the same names, which only orbax's container check tells apart."""
    params = {"w": jnp.ones((4,), jnp.float32)}
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, {"params": params, "opt_state": optax.adam(1e-3).init(params)}, {})
    with pytest.raises(RunDirError, match=r"at step 1 .* not the containers around them "
                       r"\(.*tree structures do not match.*\). It was written with "
                       r"another optimizer or chain of optax transforms"):
        ckpt.restore({"params": params, "opt_state": optax.adamw(1e-3).init(params)})
    restored, _ = ckpt.restore({"params": params, "opt_state": optax.adam(1e-3).init(params)})
    np.testing.assert_array_equal(restored["params"]["w"], params["w"])  # the checkpoint is sound
    assert ckpt.all_steps() == [1]


def _sgd_state():
    params = {"w": jnp.ones((2, 3), jnp.float32)}
    return init_train_state(params, {}, optax.sgd(0.1), NoOpLossScale())


def test_restoring_a_step_that_is_not_saved_names_the_saved_steps(tmp_path):
    """Orbax said only "Checkpoint at .../9 not found", and took step=True as a step
    named "True"."""
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(4, _sgd_state(), {"a": 1})
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step=9 in .*saved steps \[4\]"):
        ckpt.restore(_sgd_state(), step=9)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step=9 .*\[4\]"):
        ckpt.read_meta(9)
    for step in (True, 4.0, "4"):
        with pytest.raises(ValueError, match=f"step={step!r} must be an int"):
            ckpt.restore(_sgd_state(), step=step)
    assert ckpt.read_meta(np.int64(4)) == {"a": 1}
    ckpt.close()
