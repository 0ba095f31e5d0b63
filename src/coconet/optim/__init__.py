"""Drop-in data-parallel optimizers: ``torch.optim``'s, whose step is a compiled coconet program.

::

    comm = coconet.runtime.init()
    opt = coconet.optim.AdamW(model.parameters(), lr=1e-3, comm=comm)
    for batch in data:                 # this rank's share of the batch
        opt.zero_grad()
        loss_fn(model(batch)).backward()   # local gradients: no DDP wrapper
        opt.step()                     # reduce (the average), update, gather: one fused collective

Gradient clipping: ``AdamW(..., max_grad_norm=1.0)`` clips the averaged gradient by its global
norm inside the step (not ``torch.nn.utils.clip_grad_norm_`` before ``step()``: that would clip
each rank's local gradient); ``opt.last_grad_norm`` is the norm.

The parameters end up identical on every rank and equal to what ``torch.optim`` computes from
the averaged gradient. See ``coconet.optim.base`` for the contract (buckets, ``.grad`` views,
sliced state, all-or-nothing updates, checkpoints in torch's format) and
``coconet.optim.optimizers`` for what each supports.
"""

from coconet.optim.base import DistributedOptimizer, LocalGradientEditWarning
from coconet.optim.checkpoint import merge_shards
from coconet.optim.optimizers import LAMB, SGD, Adam, AdamW

__all__ = [
    "LAMB",
    "SGD",
    "Adam",
    "AdamW",
    "DistributedOptimizer",
    "LocalGradientEditWarning",
    "merge_shards",
]
