"""jaxopt_train.train: train state, data-parallel step, loop, checkpoints, metrics."""

from jaxopt_train.train.checkpoint import Checkpointer as Checkpointer
from jaxopt_train.train.checkpoint import RunDirError as RunDirError
from jaxopt_train.train.config import TrainConfig as TrainConfig
from jaxopt_train.train.loop import NonFiniteError as NonFiniteError
from jaxopt_train.train.loop import TrainResult as TrainResult
from jaxopt_train.train.loop import train as train
from jaxopt_train.train.state import TrainState as TrainState
from jaxopt_train.train.state import default_optimizer as default_optimizer
from jaxopt_train.train.trainer import StepTooLargeError as StepTooLargeError
from jaxopt_train.train.trainer import Trainer as Trainer
