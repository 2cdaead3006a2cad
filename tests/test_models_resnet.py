"""Inputs of the vision models (`jaxopt_train.models.resnet`) that used to be taken silently:
a `train` flag that is not a bool, preset names of the wrong type."""

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxopt_train.models import create_vision_model
from jaxopt_train.models.flops import resnet_flops_per_image


@pytest.mark.parametrize("name", ["cnn-small", "resnet18"])
def test_vision_models_refuse_a_train_flag_that_is_not_a_bool(name):
    model = create_vision_model(name, num_classes=3, rngs=nnx.Rngs(0))
    images = jnp.ones((1, 4, 4, 3))
    with pytest.raises(TypeError, match=r"train='False' must be True or False"):
        model(images, train="False")  # truthy: trained on batch stats, running averages overwritten
    with pytest.raises(TypeError, match="static_argnames='train'"):
        nnx.jit(lambda m, x, t: m(x, t))(model, images, True)


@pytest.mark.parametrize("name", [["resnet50"], {"resnet50": 1}])
def test_vision_preset_name_of_the_wrong_type_names_the_presets(name):
    with pytest.raises(ValueError, match="is not a vision preset"):
        create_vision_model(name, num_classes=10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not a vision preset"):
        resnet_flops_per_image(name)
