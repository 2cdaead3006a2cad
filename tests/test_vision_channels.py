"""Vision models take the data's channel count and image shape (grayscale, non-square).

Regression: `jaxopt-train train --preset cnn-small --data mnist.npz` with (N, 28, 28, 1)
images loaded, then failed in the model with "images must be float NHWC with 3
channels", and no flag could change it; the FLOP count (so MFU) assumed RGB and
square images.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.models import create_vision_model, resnet_flops_per_image
from jaxopt_train.precision import get_policy
from jaxopt_train.train import TrainConfig, train
from jaxopt_train.train.task import build_task


def _gray_npz(path, num, height, width):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (num, height, width, 1), dtype=np.uint8)
    np.savez(path, images=images, labels=(np.arange(num) % 10).astype(np.int64))
    return str(path)


def test_grayscale_npz_trains_through_the_trainer(tmp_path):
    data = _gray_npz(tmp_path / "mnist_like.npz", 40, 28, 28)
    cfg = TrainConfig(preset="cnn-small", data=data, steps=2, batch_size=8, warmup=0,
                      progress="lines", run_dir=str(tmp_path / "run"))
    result = train(cfg)
    assert result.step == 2
    assert np.isfinite(result.final_loss) and np.isfinite(result.eval_loss)


def test_task_builds_the_stem_and_flop_count_from_the_data_shape(tmp_path):
    data = _gray_npz(tmp_path / "wide.npz", 20, 12, 20)
    task = build_task(TrainConfig(preset="cnn-small", data=data, batch_size=8), get_policy("fp32"))
    stem_kernels = [x for x in jax.tree.leaves(task.fns.params) if x.shape == (3, 3, 1, 32)]
    assert len(stem_kernels) == 1, "expected a 1-channel first convolution"
    assert task.flops_per_example == resnet_flops_per_image(
        "cnn-small", image_size=(12, 20), num_classes=10, in_channels=1)
    assert "12x20x1" in task.description


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "cnn-small"])
@pytest.mark.parametrize("channels", [1, 4])
def test_vision_models_take_in_channels(name, channels):
    model = nnx.eval_shape(lambda: create_vision_model(name, num_classes=7, in_channels=channels,
                                                       rngs=nnx.Rngs(0)))
    images = jax.ShapeDtypeStruct((2, 24, 40, channels), jnp.float32)
    out = nnx.eval_shape(lambda m, x: m(x, train=True), model, images)
    assert out.shape == (2, 7)
    first_kernel = (7, 7, channels, 64) if name != "cnn-small" else (3, 3, channels, 32)
    kernels = [x.shape for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert first_kernel in kernels


def test_wrong_channel_count_names_in_channels():
    model = create_vision_model("cnn-small", num_classes=3, in_channels=1, rngs=nnx.Rngs(0))
    fix = r"with 1 channels, got shape=\(2, 8, 8, 3\).*in_channels=C\) for C-channel images"
    with pytest.raises(ValueError, match=fix):
        model(jnp.zeros((2, 8, 8, 3)), train=False)



def test_channels_first_images_are_told_to_transpose_not_to_rebuild():
    # NCHW (PyTorch's layout) into an RGB model: the hint said to rebuild the model with
    # in_channels=C, i.e. 32 "channels" here, instead of naming the layout.
    model = create_vision_model("cnn-small", num_classes=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"got shape=\(2, 3, 32, 32\).*NCHW.*transpose") as err:
        model(jnp.zeros((2, 3, 32, 32)), train=False)
    assert "in_channels=C" not in str(err.value)

@pytest.mark.parametrize("bad", [0, -1, True, 3.0, "1"])
def test_create_vision_model_refuses_bad_in_channels(bad):
    with pytest.raises(ValueError, match=r"in_channels=.* must be a positive int"):
        create_vision_model("cnn-small", num_classes=3, in_channels=bad, rngs=nnx.Rngs(0))


def test_create_vision_model_takes_numpy_integers():
    # num_classes from labels.max() + 1 is a numpy int; it was refused as "not a positive
    # int" while resnet_flops_per_image took the same value.
    labels = np.arange(5, dtype=np.int64)
    model = create_vision_model("cnn-small", num_classes=labels.max() + 1,
                                in_channels=np.int32(1), rngs=nnx.Rngs(0))
    assert model(jnp.zeros((2, 8, 8, 1)), train=False).shape == (2, 5)
    assert type(model.in_channels) is int
