"""Edge cases of jaxopt_train.models found by an audit: host ids that wrap, one-row
embeddings, unchecked flags and embeddings of the wrong shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.models import (GPT, Embed, LinenEmbed, create_vision_model, embedding_lookup,
                                 get_gpt_config, gpt_loss, resnet_flops_per_image)

PAST_INT32 = 2**32 + 1  # wraps to 1 as int32


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


def test_logits_from_embeddings_says_which_shape_it_needs():
    cfg = get_gpt_config("gpt-tiny", n_layers=1, d_model=8, n_heads=2, seq_len=4, vocab_size=5)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    for bad in (jnp.zeros((1, 2, 7)), jnp.zeros((2, 8)), jnp.zeros((1, 2, 8), jnp.int32)):
        with pytest.raises(ValueError, match=r"embeddings must be a floating array \[batch, time, d_model=8\]"):
            model.logits_from_embeddings(bad)
    tokens = jnp.array([[1, 2, 3]])
    np.testing.assert_array_equal(model.logits_from_embeddings(model.embed(tokens)), model(tokens))


@pytest.mark.parametrize("name", ["cnn-small", "resnet18"])
def test_vision_models_refuse_a_train_flag_that_is_not_a_bool(name):
    model = create_vision_model(name, num_classes=3, rngs=nnx.Rngs(0))
    images = jnp.ones((1, 4, 4, 3))
    with pytest.raises(TypeError, match=r"train='False' must be True or False"):
        model(images, train="False")  # truthy: trained on batch stats, running averages overwritten
    with pytest.raises(TypeError, match="static_argnames='train'"):
        nnx.jit(lambda m, x, t: m(x, t))(model, images, True)


def test_resnet_flops_refuses_a_training_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="training='no' must be True"):
        resnet_flops_per_image("cnn-small", training="no")
    assert resnet_flops_per_image("cnn-small", training=np.bool_(False)) * 3 == resnet_flops_per_image("cnn-small")
