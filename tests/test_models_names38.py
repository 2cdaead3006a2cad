"""Preset names and dtype arguments of the model constructors: a wrong type gets a clear error."""

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxopt_train.models import create_vision_model, embedding_lookup, get_gpt_config
from jaxopt_train.models.flops import resnet_flops_per_image


@pytest.mark.parametrize("name", [["gpt-124m"], {"gpt-124m": 1}, None, 3])
def test_gpt_preset_name_of_the_wrong_type_names_the_presets(name):
    with pytest.raises(ValueError, match="is not a GPT preset; legal values"):
        get_gpt_config(name)


@pytest.mark.parametrize("name", [["resnet50"], {"resnet50": 1}])
def test_vision_preset_name_of_the_wrong_type_names_the_presets(name):
    with pytest.raises(ValueError, match="is not a vision preset"):
        create_vision_model(name, num_classes=10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not a vision preset"):
        resnet_flops_per_image(name)


def test_embedding_lookup_unknown_dtype_string_is_a_value_error():
    table = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match="dtype must be a floating dtype.*'bf16'"):
        embedding_lookup(table, jnp.array([1, 2]), dtype="bf16")
    rows = embedding_lookup(table, jnp.array([1, 2]), dtype="bfloat16")
    assert rows.dtype == jnp.bfloat16 and rows.shape == (2, 3)
