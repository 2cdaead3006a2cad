"""`collectives.embedding_grad_exchange` and the GPT step built on it, on 8 emulated devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.bench import collectives_gpt as bench_gpt
from jaxopt_train.collectives import all_reduce_tree, embedding_grad_exchange
from jaxopt_train.models import GPT, get_gpt_config, gpt_loss


def _mesh(n=8):
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _smap(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exchange_equals_psum_of_local_lookup_gradients(dtype):
    mesh, vocab, d = _mesh(), 37, 6
    # Few distinct ids, so rows repeat within and across devices.
    ids = jax.random.randint(jax.random.key(0), (8 * 3, 5), 0, 9, jnp.int32)
    cot = jax.random.normal(jax.random.key(1), (8 * 3, 5, d), jnp.float32).astype(dtype)

    def body(ids, cot):
        local = jnp.zeros((vocab, d), jnp.float32).at[ids.reshape(-1)].add(cot.reshape(-1, d).astype(jnp.float32))
        return embedding_grad_exchange(ids, cot, "data", vocab, out_dtype=jnp.float32), lax.psum(local, "data")

    got, want = _smap(body, mesh, (P("data"), P("data")), (P(), P()))(
        jax.device_put(ids, NamedSharding(mesh, P("data"))), jax.device_put(cot, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.count_nonzero(np.abs(np.asarray(got)).sum(1)) == len(np.unique(np.asarray(ids)))
    # And against the autodiff gradient of the lookup itself, summed over devices.
    table = jnp.zeros((vocab, d), jnp.float32)
    full = jax.grad(lambda t: jnp.sum(t[ids] * cot.astype(jnp.float32)))(table)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("id_dtype", [jnp.int32, jnp.uint8, jnp.int16])
@pytest.mark.parametrize("vocab", [1, 7, 300])
def test_exchange_equals_dense_reference_over_the_whole_id_range(vocab, id_dtype):
    # Every id in [0, vocab), both ends included, against jax.grad of the dense lookup.
    mesh, d = _mesh(), 3
    hi = min(vocab, int(jnp.iinfo(id_dtype).max) + 1)
    ids = jax.random.randint(jax.random.key(3), (8 * 2, 4), 0, hi, jnp.int32)
    ids = ids.at[0, 0].set(0).at[-1, -1].set(hi - 1).astype(id_dtype)
    cot = jax.random.normal(jax.random.key(4), (8 * 2, 4, d), jnp.float32)
    f = _smap(lambda i, c: embedding_grad_exchange(i, c, "data", vocab), mesh, (P("data"), P("data")), P())
    got = f(jax.device_put(ids, NamedSharding(mesh, P("data"))), jax.device_put(cot, NamedSharding(mesh, P("data"))))
    want = jax.jit(jax.grad(lambda t: jnp.sum(t[ids] * cot)))(jnp.zeros((vocab, d), jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad_id", [37, 38, 1000, -1, -37, -1000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exchange_flags_out_of_range_ids_with_nan(bad_id, dtype):
    # Out-of-range ids are refused as GPT.embed and gpt_loss refuse them (NaN under
    # tracing), not dropped nor wrapped round to a real row as jax.grad of t[ids]
    # may do; one bad id on one device poisons the result on every device.
    mesh, vocab, d = _mesh(), 37, 4
    ids = jax.random.randint(jax.random.key(5), (8, 3), 0, vocab, jnp.int32).at[5, 1].set(bad_id)
    cot = jnp.ones((8, 3, d), dtype)
    f = _smap(lambda i, c: embedding_grad_exchange(i, c, "data", vocab), mesh, (P("data"), P("data")), P("data"))
    got = np.asarray(f(jax.device_put(ids, NamedSharding(mesh, P("data"))),
                       jax.device_put(cot, NamedSharding(mesh, P("data")))), np.float32)
    assert got.shape == (8 * vocab, d) and np.isnan(got).all()


def test_exchange_default_dtype_is_the_cotangent_dtype():
    mesh = _mesh(2)
    f = _smap(lambda i, c: embedding_grad_exchange(i, c, "data", 4), mesh, (P("data"), P("data")), P())
    out = f(jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3, 5), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == (4, 5) and float(out[0, 0]) == 6.0


@pytest.mark.parametrize("args,error,match", [
    ((jnp.zeros((2, 3), jnp.float32), jnp.zeros((2, 3, 4)), 5), TypeError, "ids must be integers"),
    ((jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4, 4)), 5), ValueError, "ids.shape"),
    ((jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 4)), 0), ValueError, "positive int"),
    ((jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 4)), 5, jnp.int32), TypeError,
     "out_dtype must be a floating dtype .*got out_dtype="),
    # An integer cotangent cannot carry the NaN flag: an out-of-range id came back as zeros.
    ((jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 4), jnp.int32), 5), TypeError,
     "cotangent must be a floating array .*got dtype=int32"),
    # True is an int to isinstance; it failed inside jnp with a dtype-promotion error.
    ((jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 4)), True), ValueError, "positive int; got True"),
])
def test_exchange_bad_input(args, error, match):
    mesh = _mesh(2)
    out_dtype = args[3] if len(args) > 3 else None
    with pytest.raises(error, match=match):
        _smap(lambda i, c: embedding_grad_exchange(i, c, "data", args[2], out_dtype=out_dtype), mesh,
              (P(), P()), P())(*args[:2])


def test_exchange_refuses_a_list_with_a_clear_error():
    # A list used to fail with "'list' object has no attribute 'dtype'".
    mesh = _mesh(2)
    with pytest.raises(TypeError, match="ids must be a jax or numpy array; got list"):
        _smap(lambda c: embedding_grad_exchange([0, 1, 2], c, "data", 5), mesh, P(), P())(jnp.zeros((3, 4)))


def test_exchange_outside_a_mapped_axis_says_how_to_bind_it():
    with pytest.raises(ValueError, match="not a mapped axis"):
        embedding_grad_exchange(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3)), "data", 4)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_step_with_exchange_matches_plain_all_reduce(tie):
    # The bench's --gpt-embedding-exchange step: same loss and gradients as
    # differentiating the whole model and all-reducing every gradient.
    cfg = get_gpt_config("gpt-tiny", n_layers=1, d_model=32, n_heads=2, seq_len=16, tie_embeddings=tie)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    mesh = _mesh()
    tokens = jax.random.randint(jax.random.key(2), (8 * 2, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)

    def plain(p, toks):
        loss, g = jax.value_and_grad(
            lambda q: gpt_loss(nnx.merge(graphdef, q)(toks[:, :-1]), toks[:, 1:]))(p)
        return lax.pmean(loss, "data"), all_reduce_tree(g, "data", method="psum")

    def exchanged(p, toks):
        loss, g = bench_gpt.exchange_gradients(graphdef, p, toks, method="ring", bucket_mb=0.01)
        return lax.pmean(loss, "data"), g

    args = (jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    want_loss, want = _smap(plain, mesh, (P(), P("data")), (P(), P()))(*args)
    got_loss, got = _smap(exchanged, mesh, (P(), P("data")), (P(), P()))(*args)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(got["wte"]["embedding"][...]).sum()) > 0


@pytest.mark.parametrize("tokens, d", [(0, 3), (2, 0)])
def test_exchange_of_an_empty_lookup_is_psum_of_zeros(tokens, d):
    # No tokens (or d=0) used to fail to lower ("dimension size of operand at 'all_gather_dim'
    # cannot be zero") or divide by zero reshaping to (-1, d); lax.psum of the local gradient is zeros.
    mesh, vocab = _mesh(), 5
    ids = jnp.ones((8, tokens), jnp.int32)
    cot = jnp.ones((8, tokens, d), jnp.bfloat16)

    def body(i, c):
        local = jnp.zeros((vocab, d), jnp.float32).at[i.reshape(-1)].add(c.reshape(i.size, d).astype(jnp.float32))
        return embedding_grad_exchange(i, c, "data", vocab), lax.psum(local, "data").astype(c.dtype)

    got, want = _smap(body, mesh, (P("data"), P("data")), (P(), P()))(
        jax.device_put(ids, NamedSharding(mesh, P("data"))), jax.device_put(cot, NamedSharding(mesh, P("data"))))
    assert got.shape == want.shape == (vocab, d) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
