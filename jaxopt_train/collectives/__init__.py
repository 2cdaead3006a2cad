"""Explicit, inspectable all-reduce algorithms for data-parallel training.

Everything here runs inside `jax.shard_map` or `jax.pmap` and is built from
`lax.ppermute` steps (or XLA's own collectives for the "psum" baseline), except
`peer_all_reduce`: one Mosaic GPU kernel storing into the peer GPU's memory
(2 Hopper GPUs, `jax.shard_map`).
"""

from jaxopt_train.collectives.buckets import Bucket as Bucket
from jaxopt_train.collectives.buckets import plan_buckets as plan_buckets
from jaxopt_train.collectives.compression import CODECS as CODECS
from jaxopt_train.collectives.compression import ErrorFeedbackState as ErrorFeedbackState
from jaxopt_train.collectives.compression import init_error_feedback as init_error_feedback
from jaxopt_train.collectives.embedding import embedding_grad_exchange as embedding_grad_exchange
from jaxopt_train.collectives.hierarchical import grouped_all_reduce as grouped_all_reduce
from jaxopt_train.collectives.hierarchical import hierarchical_all_reduce as hierarchical_all_reduce
from jaxopt_train.collectives.peer import peer_all_reduce as peer_all_reduce
from jaxopt_train.collectives.ring import ring_all_gather as ring_all_gather
from jaxopt_train.collectives.ring import ring_all_reduce as ring_all_reduce
from jaxopt_train.collectives.ring import ring_reduce_scatter as ring_reduce_scatter
from jaxopt_train.collectives.tree import METHODS as METHODS
from jaxopt_train.collectives.tree import all_reduce_tree as all_reduce_tree
from jaxopt_train.collectives.topology import describe_ring as describe_ring
from jaxopt_train.collectives.topology import ring_order as ring_order
