"""jaxopt_train.models: Flax NNX GPT and ResNet models, and their FLOP counts."""

from jaxopt_train.models.flops import gpt_flops_per_token as gpt_flops_per_token
from jaxopt_train.models.flops import gpt_param_count as gpt_param_count
from jaxopt_train.models.gpt import GPT as GPT
from jaxopt_train.models.gpt import GPT_PRESETS as GPT_PRESETS
from jaxopt_train.models.gpt import GPTConfig as GPTConfig
from jaxopt_train.models.gpt import get_gpt_config as get_gpt_config
from jaxopt_train.models.gpt import gpt_loss as gpt_loss
