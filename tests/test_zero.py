"""ZeRO stages 0/1/3: equal results, and per-device memory falling as the compiled analysis shows."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxopt_train.train.state import default_optimizer
from jaxopt_train.zero import (elementwise_mismatch, gather_leaves, leaf_spec, leaf_specs,
                               make_layout, make_zero_step, opt_state_leaf_specs, place_leaves,
                               reduce_scatter_leaves, shard_dim, spec_dim, zero_shardings)

N = 8
STEPS = 2
HIDDEN = 96  # params ~ 2 * 96 * 96 floats: large enough that state dominates the arguments


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _problem():
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w1": jax.random.normal(k[0], (HIDDEN, HIDDEN), jnp.float32) / HIDDEN**0.5,
              "b1": jnp.zeros((HIDDEN,), jnp.float32),
              "w2": jax.random.normal(k[1], (HIDDEN, 7), jnp.float32) / HIDDEN**0.5}
    batch = {"x": jax.random.normal(k[2], (N * 2, HIDDEN), jnp.float32),
             "y": jax.random.normal(k[3], (N * 2, 7), jnp.float32)}
    return params, batch


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def runs(mesh):
    params, batch = _problem()
    tx = optax.adam(1e-2)
    out = {}
    for stage in (0, 1, 3):
        zero = make_zero_step(_loss, tx, params, mesh, stage=stage)
        state = zero.init(params)
        sharded = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
        compiled = zero.step.lower(state, sharded).compile()
        losses = []
        for _ in range(STEPS):
            state, loss = compiled(state, sharded)
            losses.append(float(loss))
        final = zero.layout.unflatten(state.params) if stage == 3 else state.params
        out[stage] = (compiled.memory_analysis(), final, losses)
    @jax.jit
    def reference_step(params, opt_state):  # one device, full batch
        with jax.numpy_dtype_promotion("standard"):
            loss, grads = jax.value_and_grad(_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    reference, ref_state, ref_losses = params, tx.init(params), []
    for _ in range(STEPS):
        reference, ref_state, loss = reference_step(reference, ref_state)
        ref_losses.append(float(loss))
    out["reference"] = (None, reference, ref_losses)
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_every_stage_matches_full_batch_adam(runs, stage):
    _, params, losses = runs[stage]
    _, reference, ref_losses = runs["reference"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, reference)


def test_per_device_memory_falls_with_stage(runs):
    params, _ = _problem()
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    args = {stage: runs[stage][0].argument_size_in_bytes for stage in (0, 1, 3)}
    batch_bytes = 2 * (HIDDEN + 7) * 4  # 2 rows per device
    # Adam holds 2 moments per parameter: 3P replicated, P + 2P/N at stage 1, 3P/N at stage 3.
    expected = {0: 3 * param_bytes, 1: param_bytes + 2 * param_bytes / N, 3: 3 * param_bytes / N}
    for stage, want in expected.items():
        got = args[stage] - batch_bytes
        assert abs(got - want) <= 0.05 * want + 512, (stage, got, want, args)
    assert args[3] < args[1] < 0.5 * args[0]


def test_layout_round_trip_and_errors():
    params, _ = _problem()
    layout = make_layout(params, N)
    assert layout.padded_size % N == 0 and layout.padded_size - layout.size < N
    back = layout.unflatten(layout.flatten(params))
    jax.tree.map(np.testing.assert_array_equal, back, params)
    with pytest.raises(ValueError, match="one floating dtype"):
        make_layout({"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(3, jnp.bfloat16)}, N)
    with pytest.raises(ValueError, match=r"stage=2 must be one of \(0, 1, 3\)"):
        make_zero_step(_loss, optax.sgd(0.1), params, jax.make_mesh((N,), ("data",)), stage=2)


def test_zero_shardings_for_jit(mesh):
    params, _ = _problem()
    opt_state = optax.adam(1e-3).init(params)
    p3, o3 = zero_shardings(params, opt_state, mesh, stage=3)
    assert p3["w1"].spec == P("data") and p3["w2"].spec == P("data") and p3["b1"].spec == P("data")
    p1, o1 = zero_shardings(params, opt_state, mesh, stage=1)
    assert p1["w1"].spec == P() and o1[0].mu["w1"].spec == P("data") and o1[0].count.spec == P()
    assert leaf_spec((3, 16), N) == P(None, "data") and leaf_spec((3, 5), N) == P()


# Per-leaf ZeRO-1 ------------------------------------------------------------

LEAF_N = 4


def _leaf_problem():
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    # w: dim 0 divisible by 4; v: only dim 1; odd and scale: no divisible dim (stay replicated).
    params = {"w": normal(8, 6), "v": normal(6, 8), "odd": normal(3, 5), "scale": jnp.ones((), jnp.float32)}
    return params, normal(LEAF_N * 2, 8)


def _leaf_loss(params, x):
    h = jnp.tanh(x @ params["w"] @ params["v"]) * params["scale"]
    return jnp.mean((h[:, :3] @ params["odd"]) ** 2)


def test_shard_dim_picks_the_first_divisible_dimension():
    assert shard_dim((8, 6), 4) == 0 and shard_dim((3, 8), 4) == 1 and shard_dim((12, 16), 4) == 0
    assert shard_dim((3, 5), 4) is None and shard_dim((), 4) is None and shard_dim((2, 8), 4) == 1
    specs = leaf_specs(_leaf_problem()[0], LEAF_N)
    assert specs == {"w": P("data"), "v": P(None, "data"), "odd": P(), "scale": P()}
    assert {k: spec_dim(s) for k, s in specs.items()} == {"w": 0, "v": 1, "odd": None, "scale": None}
    with pytest.raises(ValueError, match="num_shards=0 must be a positive int"):
        leaf_specs(_leaf_problem()[0], 0)


@pytest.mark.parametrize("method", ["psum", "ring"])
def test_per_leaf_zero1_matches_replicated_adamw(method):
    # Each device updates its shards (and the replicated leaves whole, after an
    # all-reduce by `method`) with AdamW: the result must be the replicated update.
    params, batch = _leaf_problem()
    mesh = jax.make_mesh((LEAF_N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:LEAF_N])
    tx = optax.adamw(1e-2, weight_decay=0.1)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = tx.init(params)
    param_specs = leaf_specs(params, LEAF_N)
    specs = (param_specs, opt_state_leaf_specs(tx, opt_state, params, param_specs))
    assert specs[1][0].mu == param_specs and specs[1][0].count == P()
    state = place_leaves((params, opt_state), specs, mesh)
    assert state[1][0].mu["w"].addressable_shards[0].data.shape == (2, 6)
    assert state[1][0].nu["v"].addressable_shards[0].data.shape == (6, 2)
    assert state[1][0].mu["odd"].addressable_shards[0].data.shape == (3, 5)

    def per_device(state, x):
        shards, opt_state = state
        grads = jax.grad(_leaf_loss)(gather_leaves(shards, param_specs), x)
        grads = jax.tree.map(lambda g: g / LEAF_N, reduce_scatter_leaves(grads, param_specs, method=method))
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, shards)
        return (optax.apply_updates(shards, updates), opt_state)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs,
                                 check_vma=False))

    @jax.jit
    def reference(params, opt_state):
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(jax.grad(_leaf_loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    sharded_batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
    ref = (params, opt_state)
    for _ in range(STEPS):
        state, ref = step(state, sharded_batch), reference(*ref)
    assert jax.tree.map(lambda x: x.sharding.spec, state[0]) == param_specs  # layout kept
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state, ref)


def test_opt_state_leaf_specs_refuses_what_it_cannot_split():
    params = {"w": jnp.zeros((8, 4), jnp.float32)}
    specs = leaf_specs(params, LEAF_N)
    factored = optax.adafactor(1e-3, min_dim_size_to_factor=2)  # row/column moments, not param-shaped
    with pytest.raises(ValueError, match="do not have their parameter's shape"):
        opt_state_leaf_specs(factored, factored.init(params), params, specs)
    peeks = optax.GradientTransformation(lambda p: {"rows": jnp.zeros(p["w"].shape[:1])}, None)
    with pytest.raises(ValueError, match="could not match the optimizer state"):
        opt_state_leaf_specs(peeks, peeks.init(params), params, specs)


# Bad input: a clear error, never a silently wrong result ----------------------


def _flat_mask_problem():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}
    batch = (jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
             jnp.asarray(rng.normal(size=(16, 4)), jnp.float32))
    return params, batch


def _flat_mask_loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_flat_stages_refuse_a_masked_optimizer_rather_than_drop_the_mask(mesh, stage):
    params, _ = _flat_mask_problem()
    masked = default_optimizer(lr=0.1, total_steps=10, weight_decay=0.5, clip_norm=0.0)  # ndim>=2 mask
    with pytest.raises(ValueError, match=rf"stage={stage} runs the optimizer on each device's 1-D "
                                         r"slice.*AdamW's weight-decay mask.*Use stage=0"):
        make_zero_step(_flat_mask_loss, masked, params, mesh, stage=stage, method="psum")


def test_flat_stage_0_keeps_the_weight_decay_mask(mesh):
    params, batch = _flat_mask_problem()
    masked = default_optimizer(lr=0.1, total_steps=10, weight_decay=0.5, clip_norm=0.0)
    zero = make_zero_step(_flat_mask_loss, masked, params, mesh, stage=0, method="psum")
    state, ref, ref_state = zero.init(params), params, masked.init(params)
    for _ in range(2):
        state, _ = zero.step(state, batch)
        with jax.numpy_dtype_promotion("standard"):
            grads = jax.grad(_flat_mask_loss)(ref, batch)
            updates, ref_state = masked.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state.params, ref)


_MASK = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731


@pytest.mark.parametrize("name, optimizer, flat_ok, leaf_ok", [
    ("adam", optax.adam(1e-2), True, True),
    ("sgd", optax.sgd(0.1), True, True),
    ("masked adamw", optax.adamw(0.1, weight_decay=0.5, mask=_MASK), False, True),
    ("clip + sgd", optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), False, False),
    ("lamb", optax.lamb(0.1), False, False),
])
def test_elementwise_mismatch_tells_shard_safe_optimizers(name, optimizer, flat_ok, leaf_ok):
    params = {"w": jnp.zeros((16, 3)), "b": jnp.zeros((16,)), "c": jnp.zeros((3,))}
    assert (elementwise_mismatch(optimizer, params, N) is None) == flat_ok, name
    assert (elementwise_mismatch(optimizer, params, N, leaf_specs(params, N)) is None) == leaf_ok, name



def _warmup():  # starts at lr 0: update 2 is ~1.5e-7, below the old check's absolute floor
    return optax.warmup_cosine_decay_schedule(0.0, 3e-4, 2000, 100_000)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name, make, flat_ok, leaf_ok", [
    ("adam", lambda: optax.adam(_warmup()), True, True),
    ("adamw", lambda: optax.adamw(_warmup(), weight_decay=0.1), True, True),
    ("sgd + momentum", lambda: optax.sgd(_warmup(), momentum=0.9), True, True),
    ("masked adamw", lambda: optax.adamw(_warmup(), weight_decay=0.1, mask=_MASK), False, True),
    # optax's default weight decay: a 1e-4 part of each update, at a constant lr
    ("masked adamw 1e-4", lambda: optax.adamw(1e-3, weight_decay=1e-4, mask=_MASK), False, True),
    ("clip + adamw", lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                         optax.adamw(_warmup(), weight_decay=0.1)), False, False),
    ("clip + sgd + momentum", lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                  optax.sgd(_warmup(), momentum=0.9)), False, False),
    ("lamb", lambda: optax.lamb(_warmup()), False, False),
])
def test_elementwise_mismatch_sees_differences_in_the_tiny_updates_of_a_warmup(
        name, make, flat_ok, leaf_ok, dtype):
    """Before: differences below 1e-7 passed, so with a warmup from lr 0 a global-norm clip
    (each shard clipped by its own norm) and a dropped weight-decay mask were accepted."""
    params = {"w": jnp.zeros((64, 32), dtype), "b": jnp.zeros((32,), dtype), "c": jnp.zeros((3,), dtype)}
    assert (elementwise_mismatch(make(), params, N) is None) == flat_ok, name
    assert (elementwise_mismatch(make(), params, N, leaf_specs(params, N)) is None) == leaf_ok, name


@pytest.mark.parametrize("name, optimizer", [
    ("callable mask, optax's default weight decay",
     optax.adamw(1e-3, weight_decay=1e-4, mask=_MASK)),
    # Before: a cryptic pytree structure error from vmap, naming no stage and no fix.
    ("tree-shaped mask", optax.adamw(1e-3, weight_decay=0.01, mask={"w": True, "b": False})),
])
def test_flat_stage_1_refuses_any_weight_decay_mask_with_the_fix(mesh, name, optimizer):
    params, _ = _flat_mask_problem()
    with pytest.raises(ValueError, match=r"stage=1 runs the optimizer on each device's 1-D slice.*"
                                         r"AdamW's weight-decay mask.*Use stage=0"):
        make_zero_step(_flat_mask_loss, optimizer, params, mesh, stage=1, method="psum")


def test_elementwise_mismatch_names_the_failure_of_a_shard_run():
    params = {"w": jnp.zeros((16, 3)), "b": jnp.zeros((16,))}
    tree_mask = optax.adamw(1e-3, weight_decay=0.01, mask={"w": True, "b": False})
    assert re.search(r"running it on one shard's parameters fails: ValueError: pytree structure",
                     elementwise_mismatch(tree_mask, params, N))
    # The per-leaf layout keeps the tree: there the same mask is shard-safe.
    assert elementwise_mismatch(tree_mask, params, N, leaf_specs(params, N)) is None
    broken = optax.adamw(1e-3, weight_decay=0.01, mask={"w": True})  # fails on the whole tree too
    with pytest.raises(ValueError, match="pytree structure|Dict key mismatch|Custom node type"):
        elementwise_mismatch(broken, params, N)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_every_stage_runs_on_a_default_explicit_axes_mesh(stage):
    """jax.make_mesh's default axes are Explicit; before, stage 0's init raised
    'Length of device assignment 1 is not equal to the size of the mesh 8'."""
    explicit = jax.make_mesh((N,), ("data",))
    params, batch = _flat_mask_problem()
    tx = optax.adam(1e-2)
    zero = make_zero_step(_flat_mask_loss, tx, params, explicit, stage=stage, method="psum")
    state = zero.init(params)
    sharded = jax.device_put(batch, jax.sharding.NamedSharding(explicit, P("data")))
    ref, ref_state = params, tx.init(params)
    for _ in range(2):
        state, _ = zero.step(state, sharded)
        with jax.numpy_dtype_promotion("standard"):
            updates, ref_state = tx.update(jax.grad(_flat_mask_loss)(ref, batch), ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    # Stage 3's vector as it is, sharded over Explicit axes (its slices needed an
    # out_sharding: unflatten raised ShardingTypeError), eagerly and under jit.
    final = zero.layout.unflatten(state.params) if stage == 3 else state.params
    if stage == 3:
        jax.tree.map(np.testing.assert_array_equal, jax.jit(zero.layout.unflatten)(state.params), final)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), final, ref)


def _bad_params():
    params, _ = _problem()
    return {"transposed": {**params, "w2": params["w2"].T},  # same size, another shape
            "smaller": {**params, "w2": params["w2"][:-1]},
            "bf16": {**params, "b1": params["b1"].astype(jnp.bfloat16)},
            "missing": {k: v for k, v in params.items() if k != "b1"},
            "extra": {**params, "b2": params["b1"]}}


BAD_PARAMS = {"transposed": r"leaf \['w2'\] has shape \(7, 96\) dtype float32; expected shape \(96, 7\)",
              "smaller": r"leaf \['w2'\] has shape \(95, 7\) dtype float32; expected shape \(96, 7\)",
              "bf16": r"leaf \['b1'\] has shape \(96,\) dtype bfloat16; expected shape \(96,\) dtype float32",
              "missing": r"missing leaves \[\"\['b1'\]\"\], unexpected leaves \[\]",
              "extra": r"missing leaves \[\], unexpected leaves \[\"\['b2'\]\"\]"}


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_init_refuses_params_unlike_the_layout(mesh, stage, case):
    params, _ = _problem()
    zero = make_zero_step(_loss, optax.sgd(0.1), params, mesh, stage=stage)
    with pytest.raises(ValueError, match=BAD_PARAMS[case]):
        zero.init(_bad_params()[case])


@pytest.mark.parametrize("case", [c for c in BAD_PARAMS if c != "bf16"])
def test_layout_flatten_refuses_trees_unlike_the_layout(case):
    layout = make_layout(_problem()[0], N)
    match = BAD_PARAMS[case].replace(" dtype float32", "( dtype float32)?")
    with pytest.raises(ValueError, match=match):
        layout.flatten(_bad_params()[case])


def test_layout_flatten_widens_narrower_gradients():
    """Gradients may come in the compute dtype (bf16): flatten casts them, as before."""
    params = _problem()[0]
    layout = make_layout(params, N)
    narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    flat = layout.flatten(narrow)
    assert flat.dtype == layout.dtype
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(layout.flatten(
        jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(layout.dtype), params))))


def test_layout_names_another_tree_structure_with_the_same_leaf_paths():
    layout = make_layout((jnp.zeros(3, jnp.float32), jnp.zeros(2, jnp.float32)), N)
    with pytest.raises(ValueError, match=r"missing leaves \[\], unexpected leaves \[\]; "
                                         r"expected PyTreeDef\(\(\*, \*\)\), got PyTreeDef\(\[\*, \*\]\)"):
        layout.flatten([jnp.zeros(3, jnp.float32), jnp.zeros(2, jnp.float32)])


@pytest.mark.parametrize("length", [10, 36, 96 * 96 + 96 + 96 * 7 + N])
def test_layout_unflatten_refuses_a_vector_of_another_length(length):
    layout = make_layout(_problem()[0], N)
    with pytest.raises(ValueError, match=rf"flat vector of shape \({length},\); expected \({layout.padded_size},\)"):
        layout.unflatten(jnp.zeros((length,), jnp.float32))


def _in_shard_map(fn, mesh, shard_shape=(2, 4)):
    """Runs `fn(local_shard)` inside shard_map over every axis of `mesh`."""
    x = jnp.zeros((mesh.size * shard_shape[0], *shard_shape[1:]), jnp.float32)
    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(x)


def _leaf_fns():
    return {"gather_leaves": gather_leaves,
            "reduce_scatter_leaves": lambda tree, specs, axis: reduce_scatter_leaves(tree, specs, axis)}


def _grid():
    # Built when a test needs it, not at import: collecting this module on a machine with
    # fewer devices (`pytest -m gpu tests` on one GPU) must not fail.
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("fn", list(_leaf_fns()))
@pytest.mark.parametrize("spec, axis, mesh_axes, error", [
    (P("data"), "model", ("data",), r"axis_name='model' is not a mapped axis here"),  # was: the local shard
    (P("data"), "model", ("data", "model"), r"spec=P\('data',\) names an axis other than axis_name='model'"),
    (P(None, "model"), "data", ("data", "model"), r"names an axis other than axis_name='data'"),
    ("data", "data", ("data",), r"spec='data' must be a jax.sharding.PartitionSpec"),
    (None, "data", ("data",), r"spec=None must be a jax.sharding.PartitionSpec"),
    (P("data"), "", ("data",), r"axis_name='' is not a mapped axis here"),
], ids=["unmapped-axis", "other-axis", "other-axis-dim1", "str-spec", "none-spec", "empty-axis"])
def test_leaf_collectives_refuse_specs_they_would_ignore(mesh, fn, spec, axis, mesh_axes, error):
    on = mesh if mesh_axes == ("data",) else _grid()
    with pytest.raises(ValueError, match=error):
        _in_shard_map(lambda x: _leaf_fns()[fn]({"w": x}, {"w": spec}, axis)["w"], on)


@pytest.mark.parametrize("fn", list(_leaf_fns()))
def test_leaf_collectives_outside_shard_map_say_how_to_bind_the_axis(fn):
    with pytest.raises(ValueError, match=r"axis_name='data' is not a mapped axis here; call this inside "
                                         r"jax.shard_map"):
        _leaf_fns()[fn]({"w": jnp.zeros((16, 4), jnp.float32)}, {"w": P("data")}, "data")


def test_leaf_collectives_with_valid_specs_still_gather_and_scatter(mesh):
    gathered = _in_shard_map(lambda x: gather_leaves({"w": x}, {"w": P("data")}, "data")["w"][:2], mesh)
    assert gathered.shape == (16, 4)
    summed = _in_shard_map(lambda x: reduce_scatter_leaves({"w": jnp.ones((16, 4))}, {"w": P("data")})["w"],
                           mesh)
    np.testing.assert_array_equal(summed, np.full((16, 4), N, np.float32))


@pytest.mark.parametrize("build", ["zero_shardings", "make_zero_step"])
@pytest.mark.parametrize("axis", ["model", "", None, 0])
def test_an_axis_not_in_the_mesh_is_named(mesh, build, axis):
    params, _ = _problem()
    error = (r"axis_name='model' is not an axis of the mesh, whose axes are \('data',\)" if axis == "model"
             else rf"axis_name={axis!r} must be a non-empty str")
    with pytest.raises(ValueError, match=error):
        if build == "zero_shardings":
            zero_shardings(params, optax.sgd(0.1).init(params), mesh, stage=1, axis_name=axis)
        else:
            make_zero_step(_loss, optax.sgd(0.1), params, mesh, stage=1, axis_name=axis)


@pytest.mark.parametrize("n", [0, -4, True, False, 2.0, None])
def test_num_shards_must_be_a_positive_int(n):
    error = rf"num_shards={n!r} must be a positive int"
    for call in (lambda: shard_dim((8, 6), n), lambda: leaf_spec((8, 6), n),
                 lambda: leaf_specs(_leaf_problem()[0], n), lambda: make_layout(_problem()[0], n)):
        with pytest.raises(ValueError, match=error):
            call()


@pytest.mark.parametrize("axis", [None, "", 0, ("data",)])
def test_leaf_specs_axis_name_must_be_a_non_empty_str(axis):
    error = rf"axis_name={axis!r} must be a non-empty str".replace("(", r"\(").replace(")", r"\)")
    for call in (lambda: leaf_spec((8, 6), 4, axis), lambda: leaf_specs(_leaf_problem()[0], 4, axis),
                 lambda: spec_dim(P(), axis)):
        with pytest.raises(ValueError, match=error):
            call()


@pytest.mark.parametrize("stage", [True, False, 1.0, 3.0, 2, "1", None])
def test_stage_must_be_an_int_in_the_allowed_set(mesh, stage):
    params, _ = _problem()
    error = rf"stage={stage!r} must be one of \(0, 1, 3\)"
    with pytest.raises(ValueError, match=error):
        zero_shardings(params, optax.sgd(0.1).init(params), mesh, stage=stage)
    with pytest.raises(ValueError, match=error):
        make_zero_step(_loss, optax.sgd(0.1), params, mesh, stage=stage)


_TREE = {"w": jnp.zeros((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32),
         "c": jnp.zeros((3,), jnp.float32)}


@pytest.mark.parametrize("specs", [None, "per-leaf"])
@pytest.mark.parametrize("name, make", [
    ("prodigy", lambda: optax.contrib.prodigy(1.0)),
    ("d-adaptation adamw", lambda: optax.contrib.dadapt_adamw(1.0)),
])
def test_elementwise_mismatch_refuses_a_step_size_summed_over_the_tree(name, make, specs):
    """Before: both were accepted. Their step size sums over the whole tree (a shard sums over
    its shard), but on two independent gradients it never left its initial value, so the two
    updates compared matched exactly; sharded, Prodigy's updates 5 and 6 differ by 7-17%."""
    leaf = None if specs is None else leaf_specs(_TREE, N)
    assert re.search(r"update [2-6] of leaf .* differs", elementwise_mismatch(make(), _TREE, N, leaf) or ""), name


@pytest.mark.parametrize("specs", [None, "per-leaf"])
@pytest.mark.parametrize("name, make", [
    ("adam", lambda: optax.adam(1e-3)),
    ("sgd + momentum", lambda: optax.sgd(1e-2, momentum=0.9)),
    ("nesterov", lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True)),
    ("lion", lambda: optax.lion(1e-4, weight_decay=0.1)),
    ("schedule-free adamw", lambda: optax.contrib.schedule_free_adamw(1e-3)),
    ("schedule-free sgd", lambda: optax.contrib.schedule_free_sgd(1e-2)),
])
def test_elementwise_mismatch_over_more_steps_still_accepts_elementwise_optimizers(name, make, specs):
    leaf = None if specs is None else leaf_specs(_TREE, N)
    assert elementwise_mismatch(make(), _TREE, N, leaf) is None, name


@pytest.mark.parametrize("specs", [None, "per-leaf"])
def test_a_schedule_free_optimizer_is_accepted_under_the_suites_older_cpu_emitters(specs):
    """Before: refused here (jaxlib 0.10, the suite's `--xla_cpu_use_fusion_emitters=false`),
    as for any user running those emitters: 'update 2 of leaf ['w'] differs by up to 0.000122
    (updates up to 0.000732)', flat layout. The check now pins the fusion emitters itself."""
    params = {"w": jnp.zeros((64, 32), jnp.float32)}
    tx = optax.contrib.schedule_free_adamw(1e-3)
    leaf = None if specs is None else leaf_specs(params, N)
    assert elementwise_mismatch(tx, params, N, leaf) is None


def test_the_emitter_option_is_left_out_where_jaxlib_does_not_know_it(monkeypatch):
    """A jaxlib without `xla_cpu_use_fusion_emitters` (0.11.2 does not know the flag) refuses a
    compile option it does not know by name: the check then runs at -O0 alone, and still judges."""
    from jaxopt_train.zero import elementwise  # noqa: PLC0415

    monkeypatch.setattr(elementwise, "_EMITTER_OPTION", {"xla_no_such_option_here": True})
    elementwise._compiler_options.cache_clear()
    try:
        assert elementwise._compiler_options() == elementwise._COMPILER_OPTIONS
        assert elementwise_mismatch(optax.adam(1e-3), _TREE, N) is None
        assert "differs" in (elementwise_mismatch(optax.contrib.prodigy(1.0), _TREE, N) or "")
    finally:
        elementwise._compiler_options.cache_clear()  # the next caller probes the real option


def test_narrow_floats_are_checked_in_float32_and_other_leaves_as_they_are():
    """On jaxlib 0.11.2 the bf16 check refused sgd + momentum (per-leaf layout): 'update 5 of
    leaf ['c'] differs by up to 1.91e-06 (updates up to 0.000183)', 1.04% against bf16's 1%:
    rounding, not sharding. The surrogates of bf16 and fp16 leaves are float32 now."""
    from jaxopt_train.zero import elementwise  # noqa: PLC0415

    checked = [elementwise._check_dtype(np.dtype(d)) for d in
               (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64, jnp.int32, jnp.int8)]
    assert checked == [np.float32, np.float32, np.float32, np.float64, np.int32, np.int8]


def test_elementwise_mismatch_accepts_schedule_free_at_xla_default_optimisation_level(
        real_run_xla_flags):
    """Before: refused in a run without the suite's -O0 (every real run), the whole-tree and
    the shard program rounding its param differences (params ~1e3) an ulp apart:
    'update 2 of leaf ['w'] differs by up to 0.000122 (updates up to 0.000763)'. Checked in a
    process with a real run's XLA flags (both layouts), without the suite's (tests/conftest.py)."""
    code = ("import jax.numpy as jnp, optax\n"
            "from jaxopt_train.zero import elementwise_mismatch, leaf_specs\n"
            "p = {'w': jnp.zeros((64, 32)), 'b': jnp.zeros((32,)), 'c': jnp.zeros((3,))}\n"
            "tx = optax.contrib.schedule_free_adamw(1e-3)\n"
            "print(elementwise_mismatch(tx, p, 8), elementwise_mismatch(tx, p, 8, leaf_specs(p, 8)))\n")
    env = {**os.environ, "XLA_FLAGS": real_run_xla_flags, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "None None", run.stdout


@pytest.mark.parametrize("stage, method", [(0, "psum"), (1, "psum"), (3, "psum"), (1, "ring")])
def test_fp16_gradients_are_averaged_over_devices_not_summed_past_fp16_range(mesh, stage, method):
    # Each device's f16 gradient is ~2e4: their sum over 8 devices (inf in f16) was taken
    # before the division by 8, so SGD wrote -inf into every parameter.
    params = {"w": jnp.zeros((16,), jnp.float16), "b": jnp.zeros((8,), jnp.float16)}

    def loss(params, batch):
        return jnp.mean(batch["x"] @ params["w"] + jnp.sum(params["b"]) * 1e3)
    batch = {"x": (2e4 * (1 + jax.random.uniform(jax.random.key(0), (N * 2, 16)))).astype(jnp.float16)}
    lr = 1e-4
    zero = make_zero_step(loss, optax.sgd(lr), params, mesh, stage=stage, method=method)
    state, _ = zero.step(zero.init(params), jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data"))))
    got = zero.layout.unflatten(state.params) if stage == 3 else state.params
    # Reference: one full-batch SGD step in f32 on the same f16 values.
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    grads = jax.grad(loss)(f32(params), f32(batch))
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) * N > float(np.finfo(np.float16).max)
    for name in params:
        assert got[name].dtype == jnp.float16
        np.testing.assert_allclose(np.asarray(got[name], np.float32), -lr * grads[name], rtol=2e-3)


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_params_with_plain_sgd_get_a_step_count_to_seed_their_rounding(mesh, stage):
    """optax.sgd keeps no step count, so the stochastic rounding of bf16 params had a constant
    seed (a repeated update rounded alike every step). The step now adds a uint32 count."""
    params = {"w": jnp.ones((N * 4,), jnp.bfloat16)}
    grad = np.random.default_rng(0).uniform(0.5, 1.5, N * 4).astype(np.float32) * 1e-4

    def loss(p, batch):  # d loss / d w = grad, whatever the batch
        return jnp.sum(p["w"].astype(jnp.float32) * jnp.asarray(grad)) + 0 * jnp.sum(batch["x"])
    zero = make_zero_step(loss, optax.sgd(1.0), params, mesh, stage=stage, method="psum")
    state = zero.init(params)
    batch = jax.device_put({"x": jnp.zeros((N, 1), jnp.float32)},
                           jax.sharding.NamedSharding(mesh, P("data")))
    for _ in range(300):  # synced: hundreds of queued CPU collectives stalled their rendezvous
        state, _ = jax.block_until_ready(zero.step(state, batch))
    counts = [x for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.uint32 and not x.ndim]
    assert [int(c) for c in counts] == [300]
    w = zero.layout.unflatten(state.params)["w"] if stage == 3 else state.params["w"]
    assert w.dtype == jnp.bfloat16
    moved = 1.0 - np.asarray(w, np.float32)
    # Unbiased in expectation; a constant seed moved these weights by ~0.2% of what was due.
    np.testing.assert_allclose(moved.mean(), 300 * grad.mean(), rtol=0.15)
