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
the averaged gradient.

Mixed precision: 16-bit parameters (``model.to(torch.bfloat16)``) are stepped through a float32
master copy of this rank's slice (kept with the state: 2 bytes of parameters per element on
every rank plus 12/world bytes of float32 master and moments, Megatron's distributed
optimizer's layout); the update is computed in float32 and rounded to nearest. ``reduce_dtype=``
sets the dtype the gradients are reduced in (a 16-bit reduction accumulates in float32).
``state_dict()`` holds each parameter's master as ``"master_param"``; ``with_master_weights``
starts the masters of a 16-bit model from a float32 one's weights.

See ``coconet.optim.base`` for the contract (buckets, ``.grad`` views,
sliced state, all-or-nothing updates, checkpoints in torch's format) and
``coconet.optim.optimizers`` for what each supports.
"""

from coconet.optim.base import DistributedOptimizer, LocalGradientEditWarning
from coconet.optim.checkpoint import merge_shards
from coconet.optim.local_sgd import LocalSGD, OverlapLocalSGD
from coconet.optim.optimizers import LAMB, SGD, Adam, AdamW
from coconet.optim.state import with_master_weights

__all__ = [
    "LAMB",
    "SGD",
    "Adam",
    "AdamW",
    "DistributedOptimizer",
    "LocalGradientEditWarning",
    "LocalSGD",
    "OverlapLocalSGD",
    "merge_shards",
    "with_master_weights",
]
