"""Inputs of the GPT model and its presets that used to be taken silently or fail deep
inside (`jaxopt_train.models.gpt`, `jaxopt_train.models.gpt_config`): embeddings of the wrong
shape, preset names of the wrong type."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.models import GPT, get_gpt_config


def test_logits_from_embeddings_says_which_shape_it_needs():
    cfg = get_gpt_config("gpt-tiny", n_layers=1, d_model=8, n_heads=2, seq_len=4, vocab_size=5)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    for bad in (jnp.zeros((1, 2, 7)), jnp.zeros((2, 8)), jnp.zeros((1, 2, 8), jnp.int32)):
        with pytest.raises(ValueError, match=r"embeddings must be a floating array \[batch, time, d_model=8\]"):
            model.logits_from_embeddings(bad)
    tokens = jnp.array([[1, 2, 3]])
    np.testing.assert_array_equal(model.logits_from_embeddings(model.embed(tokens)), model(tokens))


@pytest.mark.parametrize("name", [["gpt-124m"], {"gpt-124m": 1}, None, 3])
def test_gpt_preset_name_of_the_wrong_type_names_the_presets(name):
    with pytest.raises(ValueError, match="is not a GPT preset; legal values"):
        get_gpt_config(name)
