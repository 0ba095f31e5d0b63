"""``coconet.nn``: tensor-parallel layers users put in their models.

Each layer is an ``nn.Module`` with plain shard ``Parameter``s whose forward and backward are
compiled coconet steps (the backward derived by ``coconet.grad``) inside one
``torch.autograd.Function``; see ``coconet.nn.layers``. ``parallelize`` swaps a model's modules
for them by name; ``attach`` gives a model saved with ``torch.save`` and loaded again its group.
"""

from coconet.nn.attention import KVCache, ParallelMLP, ParallelSelfAttention
from coconet.nn.layers import ColumnParallelLinear, RowParallelLinear
from coconet.nn.parallelize import Style, attach, parallelize

__all__ = [
    "ColumnParallelLinear",
    "KVCache",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "Style",
    "attach",
    "parallelize",
]
