"""jaxopt_train: fast, measured large-model training on JAX/XLA.

Public API re-exports only. Importing this package starts no JAX backend and
sets no XLA flags; subpackages (models, data, train, kernels, collectives,
zero, runtime, bench) hold the rest of the API.
"""

from jaxopt_train.accumulation import accumulate_gradients as accumulate_gradients
from jaxopt_train.accumulation import check_divisible as check_divisible
from jaxopt_train.accumulation import data_parallel_value_and_grad as data_parallel_value_and_grad
from jaxopt_train.accumulation import multi_steps as multi_steps
from jaxopt_train.collectives import all_reduce_tree as all_reduce_tree
from jaxopt_train.collectives import hierarchical_all_reduce as hierarchical_all_reduce
from jaxopt_train.collectives import ring_all_gather as ring_all_gather
from jaxopt_train.collectives import ring_all_reduce as ring_all_reduce
from jaxopt_train.collectives import ring_reduce_scatter as ring_reduce_scatter
from jaxopt_train.precision import DynamicLossScale as DynamicLossScale
from jaxopt_train.precision import NoOpLossScale as NoOpLossScale
from jaxopt_train.precision import Policy as Policy
from jaxopt_train.precision import StaticLossScale as StaticLossScale
from jaxopt_train.precision import all_finite as all_finite
from jaxopt_train.precision import apply_updates_if_finite as apply_updates_if_finite
from jaxopt_train.precision import get_policy as get_policy
from jaxopt_train.precision import linen_apply as linen_apply
from jaxopt_train.precision import loss_scale_for as loss_scale_for
from jaxopt_train.precision import nnx_apply as nnx_apply
from jaxopt_train.precision import select_tree as select_tree

__version__ = "0.1.0"
