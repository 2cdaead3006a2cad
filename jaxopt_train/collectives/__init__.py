"""Explicit, inspectable all-reduce algorithms for data-parallel training.

Everything here runs inside `jax.shard_map` or `jax.pmap` and is built from
`lax.ppermute` steps (or `lax.psum` for the baseline).
"""

from jaxopt_train.collectives.tree import METHODS as METHODS
from jaxopt_train.collectives.tree import all_reduce_tree as all_reduce_tree
