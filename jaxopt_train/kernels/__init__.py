"""Matmul kernels (Pallas Mosaic GPU, jax-triton, Pallas TPU / interpret), autotuning, Flax hook."""

from jaxopt_train.kernels.autotune import autotune as autotune
from jaxopt_train.kernels.configs import MatmulConfig as MatmulConfig
from jaxopt_train.kernels.dot_general import dot_general as dot_general
from jaxopt_train.kernels.dot_general import dot_general_for as dot_general_for
from jaxopt_train.kernels.dot_general import make_dot_general as make_dot_general
from jaxopt_train.kernels.matmul import available_backends as available_backends
from jaxopt_train.kernels.matmul import matmul as matmul
from jaxopt_train.kernels.matmul import matmul_reference as matmul_reference
