"""jaxopt_train.models: Flax NNX GPT and ResNet models, and their FLOP counts."""

from jaxopt_train.models.embedding import Embed as Embed
from jaxopt_train.models.embedding import LinenEmbed as LinenEmbed
from jaxopt_train.models.embedding import embedding_lookup as embedding_lookup
from jaxopt_train.models.flops import gpt_flops_per_token as gpt_flops_per_token
from jaxopt_train.models.flops import gpt_param_count as gpt_param_count
from jaxopt_train.models.gpt import GPT as GPT
from jaxopt_train.models.gpt import GPT_PRESETS as GPT_PRESETS
from jaxopt_train.models.gpt import GPTConfig as GPTConfig
from jaxopt_train.models.gpt import get_gpt_config as get_gpt_config
from jaxopt_train.models.losses import gpt_loss as gpt_loss
from jaxopt_train.models.flops import resnet_flops_per_image as resnet_flops_per_image
from jaxopt_train.models.resnet import VISION_PRESETS as VISION_PRESETS
from jaxopt_train.models.resnet import ResNet as ResNet
from jaxopt_train.models.resnet import SmallCNN as SmallCNN
from jaxopt_train.models.resnet import classification_loss as classification_loss
from jaxopt_train.models.resnet import create_vision_model as create_vision_model
