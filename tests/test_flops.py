"""Tests for jaxopt_train.models.flops: parameter counts and FLOPs per token / image."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.models import GPT, create_vision_model, get_gpt_config, resnet_flops_per_image
from jaxopt_train.models.flops import gpt_flops_param_count, gpt_flops_per_token, gpt_param_count


def test_gpt_124m_counts_match_nanogpt():
    cfg = get_gpt_config("gpt-124m")
    # GPT-2 small with vocab 50304: nanoGPT prints 123.69M (without position embeddings).
    assert gpt_param_count(cfg) == 124_475_904
    assert gpt_flops_param_count(cfg) == 123_689_472
    assert gpt_flops_per_token(cfg) == 6 * 123_689_472 + 12 * 12 * 768 * 1024
    assert gpt_flops_per_token(cfg, seq_len=512) == 6 * 123_689_472 + 12 * 12 * 768 * 512


def test_untied_head_counts_head_not_input_embedding():
    tied = get_gpt_config("gpt-tiny")
    untied = get_gpt_config("gpt-tiny", tie_embeddings=False)
    assert gpt_param_count(untied) - gpt_param_count(tied) == 256 * 128
    assert gpt_flops_param_count(untied) == gpt_flops_param_count(tied)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-1b"])
def test_gpt_forward_flops_match_xla_cost_analysis(name):
    # Forward matmul FLOPs per token are 2N + 4*L*d*T (a third of the training
    # formula); XLA also counts the elementwise ops, a few percent on top.
    cfg = get_gpt_config(name, scan_layers=False, n_layers=2, seq_len=256)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    lowered = jax.jit(lambda s, x: nnx.merge(*s)(x)).lower(nnx.split(model), tokens)
    per_token = lowered.cost_analysis()["flops"] / cfg.seq_len
    assert 1.0 <= per_token / (gpt_flops_per_token(cfg) / 3) < 1.1


def test_flops_bad_inputs():
    with pytest.raises(TypeError, match="GPTConfig"):
        gpt_param_count({"d_model": 3})
    with pytest.raises(ValueError, match=r"seq_len=2000 must be an int in \[1, 1024\]"):
        gpt_flops_per_token(get_gpt_config("gpt-124m"), seq_len=2000)
    with pytest.raises(ValueError, match="legal values"):
        resnet_flops_per_image("resnet34")
    with pytest.raises(ValueError, match="image_size=0"):
        resnet_flops_per_image("resnet50", image_size=0)


def test_flops_accept_numpy_ints():
    cfg = get_gpt_config("gpt-124m")
    assert gpt_flops_per_token(cfg, seq_len=np.int64(64)) == gpt_flops_per_token(cfg, seq_len=64)
    assert (resnet_flops_per_image("resnet18", image_size=np.int32(64), num_classes=np.int64(10))
            == resnet_flops_per_image("resnet18", image_size=64, num_classes=10))


@pytest.mark.parametrize("call, error, match", [
    (lambda cfg: gpt_flops_per_token(cfg, seq_len=True), TypeError, "seq_len=True must be an int in"),
    (lambda cfg: gpt_flops_per_token(cfg, seq_len=64.0), TypeError, "seq_len=64.0 must be an int in"),
    (lambda cfg: gpt_flops_per_token(cfg, seq_len=0), ValueError, r"seq_len=0 must be an int in \[1, 1024\]"),
    (lambda cfg: gpt_flops_param_count({}), TypeError, "cfg must be a GPTConfig .*got dict"),
    (lambda cfg: gpt_flops_per_token({}), TypeError, "cfg must be a GPTConfig"),
    (lambda cfg: resnet_flops_per_image("resnet50", num_classes=0), ValueError,
     "num_classes=0 must be a positive int"),
    (lambda cfg: resnet_flops_per_image("resnet50", num_classes=True), TypeError, "num_classes=True"),
    (lambda cfg: resnet_flops_per_image("resnet50", image_size=True), TypeError, "image_size=True"),
    (lambda cfg: resnet_flops_per_image("resnet50", image_size=224.0), TypeError, "image_size=224.0"),
])
def test_flops_refuse_bools_non_ints_and_empty_sizes(call, error, match):
    with pytest.raises(error, match=match):
        call(get_gpt_config("gpt-124m"))


def test_resnet_macs_match_published_figures():
    # torchvision: ResNet-18 1.81 GMACs, ResNet-50 4.09 GMACs at 224x224.
    assert abs(resnet_flops_per_image("resnet18", training=False) / 2e9 - 1.814) < 0.001
    assert abs(resnet_flops_per_image("resnet50", training=False) / 2e9 - 4.089) < 0.001


def abstract_vision_model(name):
    return nnx.eval_shape(lambda: create_vision_model(name, num_classes=1000, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("name, tolerance", [("cnn-small", 0.02), ("resnet50", 0.05), ("resnet18", 0.1)])
def test_vision_flops_match_xla_cost_analysis(name, tolerance):
    # XLA skips taps that fall into zero padding, so small late feature maps
    # (ResNet-18's 7x7 3x3 convs) count a little less than the textbook formula.
    model = abstract_vision_model(name)
    images = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    lowered = jax.jit(lambda s, x: nnx.merge(*s)(x, train=False)).lower(nnx.split(model), images)
    forward = resnet_flops_per_image(name, image_size=224, training=False)
    assert abs(lowered.cost_analysis()["flops"] / forward - 1) < tolerance
    assert resnet_flops_per_image(name, image_size=224) == 3 * forward




@pytest.mark.parametrize("name, stem_out, kernel, width", [
    # 7x7/2 stem, pad 3: (224 + 6 - 7) // 2 + 1 = 112; cnn-small's 3x3/1 keeps 32.
    ("resnet18", 112, 7, 64), ("resnet50", 112, 7, 64), ("cnn-small", 32, 3, 32),
])
def test_vision_flops_grow_by_the_stem_conv_per_input_channel(name, stem_out, kernel, width):
    size = 224 if name != "cnn-small" else 32
    rgb = resnet_flops_per_image(name, image_size=size, in_channels=3)
    gray = resnet_flops_per_image(name, image_size=size, in_channels=1)
    # Only the stem reads the input: 2 extra channels, 2 FLOPs per MAC, x3 for training.
    assert rgb - gray == 3 * 2 * stem_out * stem_out * kernel * kernel * width * 2
    assert resnet_flops_per_image(name, image_size=size) == rgb


def test_vision_flops_of_non_square_images():
    # Stem of 224x160: 112x80 outputs.
    tall = resnet_flops_per_image("resnet18", image_size=(224, 160), in_channels=1, training=False)
    wide = resnet_flops_per_image("resnet18", image_size=(160, 224), in_channels=1, training=False)
    rgb = resnet_flops_per_image("resnet18", image_size=(224, 160), in_channels=3, training=False)
    assert tall == wide and rgb - tall == 2 * 112 * 80 * 7 * 7 * 64 * 2
    assert (resnet_flops_per_image("resnet18", image_size=(96, 96))
            == resnet_flops_per_image("resnet18", image_size=96))
    assert (resnet_flops_per_image("resnet18", image_size=(64, 128))
            < resnet_flops_per_image("resnet18", image_size=(96, 128)))


@pytest.mark.parametrize("name, tolerance", [("cnn-small", 0.02), ("resnet50", 0.05)])
def test_grayscale_non_square_flops_match_xla_cost_analysis(name, tolerance):
    model = nnx.eval_shape(lambda: create_vision_model(name, num_classes=10, in_channels=1,
                                                       rngs=nnx.Rngs(0)))
    images = jax.ShapeDtypeStruct((1, 160, 224, 1), jnp.float32)
    lowered = jax.jit(lambda s, x: nnx.merge(*s)(x, train=False)).lower(nnx.split(model), images)
    forward = resnet_flops_per_image(name, image_size=(160, 224), num_classes=10, in_channels=1,
                                     training=False)
    assert abs(lowered.cost_analysis()["flops"] / forward - 1) < tolerance


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(image_size=(28, 0)), ValueError, r"image_size=\(28, 0\) must be .*\(height, width\)"),
    (dict(image_size=(28,)), ValueError, r"image_size=\(28,\) must be .*got 1 values"),
    (dict(image_size=(28, 28.0)), TypeError, r"image_size=\(28, 28.0\) .*width=28.0"),
    (dict(in_channels=0), ValueError, "in_channels=0 must be a positive int"),
    (dict(in_channels=True), TypeError, "in_channels=True"),
])
def test_vision_flops_refuse_bad_shapes(kwargs, error, match):
    with pytest.raises(error, match=match):
        resnet_flops_per_image("cnn-small", **kwargs)


def test_resnet_flops_refuses_a_training_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="training='no' must be True"):
        resnet_flops_per_image("cnn-small", training="no")
    assert resnet_flops_per_image("cnn-small", training=np.bool_(False)) * 3 == resnet_flops_per_image("cnn-small")
