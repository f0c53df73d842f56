"""``hetero_fsdp``'s runtime: fully sharded data parallelism with shards sized per rank (pure torch.distributed).

- ``uneven_collectives``: all-gather and reduce-scatter of a flat tensor cut into pieces of unequal sizes;
- ``flat_unit``: ``FlatUnit``, one unit's parameters as one flat vector and this rank's shard of it;
- ``sharded_model``: ``shard_model`` / ``ShardedModel``, the forward and backward hooks that gather, free, prefetch
  and reduce the units, and the full state dict for export.
"""

from het_strategy.fsdp.flat_unit import FLAT_SHARD, ROOT_UNIT, FlatUnit
from het_strategy.fsdp.sharded_model import ShardedModel, shard_model
from het_strategy.fsdp.uneven_collectives import all_gather_uneven, reduce_scatter_uneven

__all__ = ["FlatUnit", "FLAT_SHARD", "ROOT_UNIT", "ShardedModel", "shard_model", "all_gather_uneven",
           "reduce_scatter_uneven"]
