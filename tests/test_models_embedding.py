"""Tests for jaxopt_train.models.embedding: the lookup whose gradient is summed in f32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.models import GPT, Embed, LinenEmbed, get_gpt_config, gpt_loss
from jaxopt_train.models.embedding import embedding_lookup

V, D = 64, 8
PAST_INT32 = 2**32 + 1  # wraps to 1 as int32


def skewed_ids(n, seed=0, hot=0.3):
    """Ids where one token fills `hot` of the positions, as the space does in source code."""
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < hot, 0, rng.integers(0, V, n)).astype(np.int32)


def f32_scatter(ids, g):
    """The reference: every row's cotangent added in float64 (numpy), then rounded to f32."""
    out = np.zeros((V, g.shape[-1]), np.float64)
    np.add.at(out, ids.reshape(-1), np.asarray(g, np.float64).reshape(-1, g.shape[-1]))
    return out.astype(np.float32)


@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_forward_is_take_then_cast(table_dtype, dtype):
    table = jax.random.normal(jax.random.key(0), (V, D), table_dtype)
    ids = jax.random.randint(jax.random.key(1), (3, 5), 0, V)
    got = embedding_lookup(table, ids, dtype)
    assert got.dtype == dtype and got.shape == (3, 5, D)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.take(table, ids, axis=0).astype(dtype), np.float32))


@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_of_a_frequent_token_is_summed_in_f32(table_dtype):
    n = 8192
    ids = skewed_ids(n)
    g = (np.random.default_rng(1).normal(size=(n, D)) * 1e-3).astype(np.float32)
    g = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32)  # exactly what a bf16 cotangent holds
    table = jnp.zeros((V, D), table_dtype)

    def loss(t):
        rows = embedding_lookup(t, jnp.asarray(ids), jnp.bfloat16)
        return jnp.sum(rows.astype(jnp.float32) * g)

    got = jax.grad(loss)(table)
    assert got.dtype == table_dtype
    want = f32_scatter(ids, g)
    # f32 sums (order aside), then one rounding to the table's dtype.
    rtol = 1e-5 if table_dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol, atol=1e-7)

    # What this replaces: nnx.Embed's lookup of the bf16-cast table, whose gradient is a bf16
    # scatter-add. On the frequent row (~2,500 addends) it is several % off; the test above
    # would not tell the two apart if it were not.
    old = jax.grad(lambda t: jnp.sum(jnp.take(t.astype(jnp.bfloat16), jnp.asarray(ids), axis=0)
                                     .astype(jnp.float32) * g))(table.astype(jnp.float32))
    old_err = np.linalg.norm(np.asarray(old[0]) - want[0]) / np.linalg.norm(want[0])
    new_err = np.linalg.norm(np.asarray(got[0], np.float32) - want[0]) / np.linalg.norm(want[0])
    assert old_err > 0.01 and new_err < old_err / 10, (old_err, new_err)


def test_out_of_range_id_gives_nan_row_and_no_gradient():
    table = jax.random.normal(jax.random.key(0), (V, D), jnp.float32)
    ids = jnp.array([[1, V, 2], [-1, 1, V + 5]])
    rows = embedding_lookup(table, ids, jnp.bfloat16)
    bad = np.array([[False, True, False], [False, False, True]])
    assert np.isnan(np.asarray(rows, np.float32)[bad]).all()
    # -1 is jnp.take's "from the end" only in wrap mode; fill mode treats it as out of range.
    assert np.isnan(np.asarray(rows, np.float32)[1, 0]).all()
    g = np.ones((2, 3, D), np.float32)
    grad = jax.grad(lambda t: jnp.sum(jnp.nan_to_num(embedding_lookup(t, ids, jnp.float32)) * g))(table)
    want = np.zeros((V, D), np.float32)
    want[1] = 2.0
    want[2] = 1.0
    np.testing.assert_array_equal(np.asarray(grad), want)


def test_under_jit_and_vmap():
    table = jax.random.normal(jax.random.key(0), (V, D), jnp.float32)
    ids = jnp.asarray(skewed_ids(40).reshape(4, 10))
    g = jax.random.normal(jax.random.key(2), (4, 10, D), jnp.float32)

    def loss(t, i, gi):
        return jnp.sum(embedding_lookup(t, i, jnp.float32) * gi)

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(table, ids, g)
    for b in range(4):
        np.testing.assert_allclose(np.asarray(per_example[b]), f32_scatter(np.asarray(ids[b]), np.asarray(g[b])),
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("table, ids, dtype, match", [
    (np.zeros((V,), np.float32), np.zeros(3, np.int32), jnp.float32, "table must be a floating array"),
    (np.zeros((V, D), np.int32), np.zeros(3, np.int32), jnp.float32, "table must be a floating array"),
    (np.zeros((V, D), np.float32), np.zeros(3, np.float32), jnp.float32, "ids must be an integer array"),
    (np.zeros((V, D), np.float32), np.zeros(3, np.int32), jnp.int32, "dtype must be a floating dtype"),
])
def test_bad_input(table, ids, dtype, match):
    with pytest.raises(ValueError, match=match):
        embedding_lookup(table, ids, dtype)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_gpt_embedding_gradients_are_f32_sums(param_dtype):
    """GPT.embed in bf16: the token table's gradient is the f32 scatter of the bf16
    cotangent, the position table's its f32 sum over the batch."""
    cfg = get_gpt_config("gpt-tiny", n_layers=1, d_model=D, n_heads=2, seq_len=128, vocab_size=V,
                         dtype=jnp.bfloat16, param_dtype=param_dtype)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(skewed_ids(16 * 128).reshape(16, 128))
    g = np.random.default_rng(3).normal(size=(16, 128, D)).astype(np.float32)
    g = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32)

    def loss(m):
        return jnp.sum(m.embed(tokens).astype(jnp.float32) * g)

    grads = nnx.grad(loss)(model)
    tol = dict(rtol=1e-5, atol=1e-6) if param_dtype == jnp.float32 else dict(rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads.wte.embedding[...], np.float32),
                               f32_scatter(np.asarray(tokens), g), **tol)
    np.testing.assert_allclose(np.asarray(grads.wpe.embedding[...], np.float32), g.sum(0), **tol)
    # The forward: token row plus position row, added in f32 and rounded once.
    want = (np.asarray(model.wte.embedding[...], np.float32)[np.asarray(tokens)]
            + np.asarray(model.wpe.embedding[...], np.float32)[None, :128])
    np.testing.assert_array_equal(np.asarray(model.embed(tokens), np.float32),
                                  np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))


def test_narrow_and_unsigned_ids():
    table = jax.random.normal(jax.random.key(0), (300, D), jnp.float32)
    # int8 cannot hold 300: every non-negative int8 id is a row, a negative one is not.
    rows = np.asarray(embedding_lookup(table, jnp.array([127, -1, 0], jnp.int8), jnp.float32))
    np.testing.assert_array_equal(rows[0], np.asarray(table[127]))
    assert np.isnan(rows[1]).all() and not np.isnan(rows[2]).any()
    # uint32 2**32 - 1 would be -1 (the last row) once cast to int32.
    rows = np.asarray(embedding_lookup(table, jnp.array([2 ** 32 - 1, 299], jnp.uint32), jnp.float32))
    assert np.isnan(rows[0]).all()
    np.testing.assert_array_equal(rows[1], np.asarray(table[299]))


# ---------------------------------------------------------------- Embed, the nnx.Embed drop-in


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_embed_matches_nnx_embed_and_sums_in_f32(dtype):
    from jaxopt_train.models import Embed

    ours = Embed(V, D, dtype=dtype, rngs=nnx.Rngs(0))
    theirs = nnx.Embed(V, D, dtype=dtype, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(ours.embedding[...]), np.asarray(theirs.embedding[...]))
    ids = jnp.asarray(skewed_ids(4096).reshape(8, 512))
    got, want = ours(ids), theirs(ids)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    x = jax.random.normal(jax.random.key(1), (3, D), jnp.float32)
    np.testing.assert_array_equal(np.asarray(ours.attend(x)), np.asarray(theirs.attend(x)))

    g = np.asarray(jnp.asarray(np.random.default_rng(2).normal(size=(8, 512, D)) * 1e-3, jnp.bfloat16),
                   np.float32)
    grad = nnx.grad(lambda m: jnp.sum(m(ids).astype(jnp.float32) * g))(ours)
    np.testing.assert_allclose(np.asarray(grad.embedding[...]), f32_scatter(np.asarray(ids), g),
                               rtol=1e-5, atol=1e-7)


def test_embed_single_row_and_bad_ids():
    from jaxopt_train.models import Embed

    one = Embed(1, D, rngs=nnx.Rngs(0))
    out = one(jnp.zeros((2, 3), jnp.int32))
    assert out.shape == (2, 3, D)
    np.testing.assert_array_equal(np.asarray(out[1, 2]), np.asarray(one.embedding[0]))
    with pytest.raises(ValueError, match="Embed takes integer ids, got dtype=float32"):
        Embed(V, D, rngs=nnx.Rngs(0))(jnp.zeros(3, jnp.float32))
    rows = Embed(V, D, rngs=nnx.Rngs(0))(jnp.array([-1, V]))
    assert np.isnan(np.asarray(rows)).all()


def test_embed_out_sharding(cpu_devices):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxopt_train.models import Embed

    mesh = jax.make_mesh((8,), ("data",), devices=cpu_devices)  # also on a 1-GPU machine
    with jax.default_device(cpu_devices[0]):
        e = Embed(V, D, rngs=nnx.Rngs(0))
        ids = jnp.asarray(skewed_ids(64).reshape(8, 8))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(ids, NamedSharding(mesh, P("data")))
        out = jax.jit(lambda i: e(i, out_sharding=P("data")))(sharded)
    assert out.sharding.spec == P("data", None, None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(e.embedding[...])[np.asarray(ids)])


def test_trainer_warns_about_a_16_bit_nnx_embed():
    import warnings

    from jaxopt_train.models import Embed
    from jaxopt_train.train import Trainer

    class Model(nnx.Module):
        def __init__(self, embed_cls, dtype):
            self.tok = embed_cls(V, D, dtype=dtype, rngs=nnx.Rngs(0))
            self.out = nnx.Linear(D, V, rngs=nnx.Rngs(1))

        def __call__(self, ids):
            return self.out(self.tok(ids))

    def loss_fn(model, batch):
        logits = model(batch["x"]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["x"][..., None], -1))

    with pytest.warns(UserWarning, match=r"nnx.Embed with a 16-bit dtype at tok: .*models.Embed"):
        Trainer(Model(nnx.Embed, jnp.bfloat16), loss_fn, precision="bf16", total_steps=2,
                   devices=jax.devices()[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Ours, and nnx.Embed left in f32 (it casts the bf16 table back up): no warning.
        Trainer(Model(Embed, jnp.bfloat16), loss_fn, precision="bf16", total_steps=2,
                   devices=jax.devices()[:1])
        Trainer(Model(nnx.Embed, None), loss_fn, precision="bf16", total_steps=2,
                   devices=jax.devices()[:1])


# ---------------------------------------------------------------- LinenEmbed, the linen.Embed drop-in


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_linen_embed_matches_linen_embed_and_sums_in_f32(dtype):
    import flax.linen as nn

    from jaxopt_train.models import LinenEmbed

    ids = jnp.asarray(skewed_ids(4096).reshape(8, 512))
    ours, theirs = LinenEmbed(V, D, dtype=dtype), nn.Embed(V, D, dtype=dtype)
    variables = theirs.init(jax.random.key(0), ids)
    np.testing.assert_array_equal(
        np.asarray(ours.init(jax.random.key(0), ids)["params"]["embedding"]),
        np.asarray(variables["params"]["embedding"]))
    got, want = ours.apply(variables, ids), theirs.apply(variables, ids)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    x = jax.random.normal(jax.random.key(1), (3, D), jnp.float32)
    np.testing.assert_array_equal(np.asarray(ours.apply(variables, x, method="attend")),
                                  np.asarray(theirs.apply(variables, x, method="attend")))

    # As a bf16 policy passes them: the table cast to bf16 before the call. With dtype unset,
    # linen.Embed then adds the gradient in bf16; ours adds in f32 and rounds once.
    g = np.asarray(jnp.asarray(np.random.default_rng(2).normal(size=(8, 512, D)) * 1e-3, jnp.bfloat16),
                   np.float32)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)

    def grad(module):
        return jax.grad(lambda v: jnp.sum(module.apply(v, ids).astype(jnp.float32) * g))(bf16)

    want = f32_scatter(np.asarray(ids), g)
    ours_grad = np.asarray(grad(ours)["params"]["embedding"], np.float32)
    np.testing.assert_allclose(ours_grad, want, rtol=2 ** -8, atol=1e-7)
    if dtype is None:  # the case this exists for: the plain module sums the frequent row in bf16
        theirs_grad = np.asarray(grad(theirs)["params"]["embedding"], np.float32)
        err = lambda a: np.linalg.norm(a[0] - want[0]) / np.linalg.norm(want[0])  # noqa: E731
        assert err(theirs_grad) > 0.01 and err(ours_grad) < err(theirs_grad) / 10


def test_linen_embed_bad_ids_and_single_row():
    from jaxopt_train.models import LinenEmbed

    e = LinenEmbed(V, D)
    variables = e.init(jax.random.key(0), jnp.zeros(2, jnp.int32))
    assert np.isnan(np.asarray(e.apply(variables, jnp.array([-1, V])))).all()
    with pytest.raises(ValueError, match="LinenEmbed takes integer ids, got dtype=float32"):
        e.apply(variables, jnp.zeros(2, jnp.float32))
    one = LinenEmbed(1, D)
    v1 = one.init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    assert one.apply(v1, jnp.zeros((2, 3), jnp.int32)).shape == (2, 3, D)


def test_trainer_warns_about_a_linen_embed_gathering_in_16_bits():
    import warnings

    import flax.linen as nn

    from jaxopt_train.models import LinenEmbed
    from jaxopt_train.train import Trainer

    class Model(nn.Module):
        embed_cls: type
        dtype: object = None

        @nn.compact
        def __call__(self, ids):
            # An f32 head: the tests' strict dtype promotion refuses f16 rows into a bf16 kernel.
            return nn.Dense(V, dtype=jnp.float32)(self.embed_cls(V, D, dtype=self.dtype, name="tok")(ids))

    def loss_fn(apply, batch):
        logits = apply(batch["x"]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["x"][..., None], -1))

    ids = (jnp.zeros((2, 4), jnp.int32),)

    def trainer(embed_cls, dtype, precision):
        return Trainer(Model(embed_cls, dtype), loss_fn, init_args=ids, precision=precision,
                       total_steps=2, devices=jax.devices()[:1])

    # dtype unset: it gathers from the table as the bf16 policy passes it, a bf16 copy.
    with pytest.warns(UserWarning, match=r"linen.Embed gathering in 16 bits under the bfloat16 "
                                         r"compute dtype at tok: .*models.LinenEmbed"):
        trainer(nn.Embed, None, "bf16")
    with pytest.warns(UserWarning, match="at tok"):  # a 16-bit dtype set: even under fp32
        trainer(nn.Embed, jnp.float16, "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(LinenEmbed, None, "bf16")  # ours
        trainer(nn.Embed, jnp.float32, "bf16")  # casts the bf16 table up: an f32 scatter-add
        trainer(nn.Embed, None, "fp32")


def test_host_int64_ids_past_int32_are_out_of_range_not_wrapped():
    """Without x64 jnp.asarray wraps int64 ids: 2**32 + 1 read row 1, and gpt_loss scored
    a target of 2**32 as class 0."""
    from jaxopt_train.models import gpt_loss

    table = jnp.arange(V * D, dtype=jnp.float32).reshape(V, D)
    ids = np.array([1, 2**32 + 1, -(2**32) + 2, 2**40], np.int64)
    out = np.asarray(embedding_lookup(table, ids, jnp.float32))
    np.testing.assert_array_equal(out[0], np.asarray(table[1]))
    assert np.isnan(out[1:]).all()
    assert np.isnan(np.asarray(embedding_lookup(table, np.array([2**32], np.uint64), jnp.float32))).all()
    with pytest.raises(ValueError, match=r"targets must be ids in \[0, 4\); got values from 0 to 4294967296"):
        gpt_loss(jnp.zeros((2, 4), jnp.float32), np.array([0, 2**32], np.int64))


def test_dtype_none_keeps_the_table_dtype():
    """np.dtype(None) is float64, which JAX turned into float32: a bf16 table's rows came back f32."""
    table = jnp.ones((V, D), jnp.bfloat16)
    assert embedding_lookup(table, jnp.array([0, 1]), None).dtype == jnp.bfloat16


@pytest.mark.parametrize("as_scalar", [np.int64, np.uint64])
def test_numpy_scalar_ids_past_int32_do_not_wrap_to_a_real_id(as_scalar):
    table = jnp.arange(12.0).reshape(4, 3)
    assert np.isnan(np.asarray(embedding_lookup(table, as_scalar(PAST_INT32), None))).all()
    np.testing.assert_array_equal(embedding_lookup(table, as_scalar(2), None), table[2])
    with pytest.raises(ValueError, match="targets must be ids in"):
        gpt_loss(jnp.zeros(5), as_scalar(PAST_INT32))


def test_embed_modules_do_not_wrap_host_int64_ids():
    ids = np.array([PAST_INT32, 1], np.int64)
    embed = Embed(4, 3, rngs=nnx.Rngs(0))
    rows = np.asarray(embed(ids))
    assert np.isnan(rows[0]).all()
    np.testing.assert_array_equal(rows[1], embed.embedding[...][1])
    linen_embed = LinenEmbed(4, 3)
    variables = linen_embed.init(jax.random.key(0), jnp.zeros(1, jnp.int32))
    assert np.isnan(np.asarray(linen_embed.apply(variables, ids))[0]).all()


def test_one_row_embeds_keep_the_nan_contract_and_an_f32_gradient_sum():
    ids = jnp.array([0, 1, -1])
    one = Embed(1, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rows = np.asarray(one(ids), np.float32)
    np.testing.assert_array_equal(rows[0], np.asarray(one.embedding[...][0].astype(jnp.bfloat16), np.float32))
    assert np.isnan(rows[1:]).all()
    # 100000 bf16 rows summed: in f32 that is exact; rounded to bf16 it read 100352.
    zeros = jnp.zeros(100_000, jnp.int32)
    grad = nnx.grad(lambda m: jnp.sum(m(zeros).astype(jnp.float32)))(one)
    np.testing.assert_array_equal(np.asarray(grad.embedding[...]), 100_000.0)
    linen_one = LinenEmbed(1, 2)
    variables = linen_one.init(jax.random.key(0), jnp.zeros(1, jnp.int32))
    assert np.isnan(np.asarray(linen_one.apply(variables, ids))[1:]).all()


def test_embedding_lookup_unknown_dtype_string_is_a_value_error():
    table = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match="dtype must be a floating dtype.*'bf16'"):
        embedding_lookup(table, jnp.array([1, 2]), dtype="bf16")
    rows = embedding_lookup(table, jnp.array([1, 2]), dtype="bfloat16")
    assert rows.dtype == jnp.bfloat16 and rows.shape == (2, 3)
