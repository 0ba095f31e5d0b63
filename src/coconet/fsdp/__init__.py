"""``coconet.fsdp``: fully sharded parameters (ZeRO-3, torch's ``fully_shard``) with the paper's
fused step.

``fully_shard(model)`` stores each rank's 1/world of every parameter; a block's parameters are
all-gathered before its forward and its backward and freed after; a ``coconet.optim`` optimizer
built over ``model.parameters()`` then runs each block's step in the backward, as soon as the
block's gradient is complete: the reduce_scatter of the gradient and the update of this rank's
slice as one fused collective (``schedule.fuse_RS_C``), whose all_gather is the next forward's.
See ``coconet.fsdp.model`` for a step's sequence and ``coconet.fsdp.blocks`` for the layout.
"""

from coconet.fsdp.model import FullyShardedModel, fully_shard

__all__ = ["FullyShardedModel", "fully_shard"]
