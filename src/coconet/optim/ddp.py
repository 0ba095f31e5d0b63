"""A ``coconet.optim`` optimizer as ``DistributedDataParallel``'s communication hook.

For users who keep DDP: ``coconet.optim.AdamW(ddp.parameters(), comm=comm, ddp=ddp)`` registers
itself as ``ddp``'s comm hook. DDP then hands each gradient bucket, as soon as it is ready during
``backward()``, to the optimizer's compiled step instead of all-reducing it: reduce_scatter (the
average), the update of this rank's slice with its slice of the state, all_gather of the new
parameters (one fused collective; over shared memory on one host, over gloo otherwise, where
torch's own ``hook_with_zero_step`` refuses to run). The training loop stays the one users have
(``opt.zero_grad(); loss.backward(); opt.step()``): ``step()`` has nothing left to do.

- **State is keyed by parameter**, not by bucket index: DDP rebuilds its buckets after the first
  iteration (in the order gradients became ready). A bucket of parameters seen in another layout
  before gets their state from that layout (gathered across the ranks, then sliced anew), so a
  rebuild changes nothing in the results.
- **The gradients**: DDP copies the hook's result into ``.grad``. The hook returns the bucket's
  gradient as it got it (this rank's local gradient): the average only exists sliced, inside the
  fused step, and the update has been applied already.
- One param group, holding exactly DDP's parameters (DDP's buckets ignore param groups; a bucket
  cannot take two learning rates). Parameters are copied into a flat vector for the step and the
  new values copied back (two passes over the bucket that the packed optimizer does not make).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from coconet.errors import ConfigError
from coconet.optim import state
from coconet.optim.buckets import Bucket

__all__ = ["check_and_register", "check_group"]


def check_and_register(
    opt: torch.optim.Optimizer, ddp: DistributedDataParallel, params: list | None = None
) -> None:
    name = f"coconet.optim.{type(opt).__name__}"
    if opt.bucket_per_parameter:
        # DDP's buckets hold many tensors as one flat vector; this optimizer's norms are each
        # tensor's own (LAMB's trust ratio), so a DDP bucket cannot be its step
        raise ConfigError(
            f"{name} cannot be combined with ddp=: its norms are each parameter tensor's own, "
            "and DDP's gradient buckets hold many tensors as one vector",
            op=name,
            hint="leave ddp= out and the model unwrapped: coconet.optim averages the gradients "
            "in its step (backward() writes straight into its buckets)",
        )
    groups = [g for g in params or () if isinstance(g, dict)]
    if len(groups) > 1:
        raise ConfigError(
            f"with ddp=, the optimizer takes one param group; {len(groups)} were given",
            op=name,
            details=[
                "DDP's gradient buckets cut across param groups, and each bucket is stepped as "
                "one fused program with one set of hyper-parameters"
            ],
            hint="for groups (a decayed and a not-decayed set, as nanoGPT builds): leave ddp= "
            "out and the model unwrapped; coconet.optim averages the gradients itself, "
            "backward() writes straight into its buckets, and every param group is supported "
            "there",
        )
    if not isinstance(ddp, DistributedDataParallel):
        raise ConfigError(
            f"ddp= takes the DistributedDataParallel model, got {type(ddp).__name__}",
            op=name,
            hint="opt = coconet.optim.AdamW(ddp.parameters(), comm=comm, ddp=ddp)",
        )
    world = torch.distributed.get_world_size(ddp.process_group)
    if world != opt.comm.world:
        raise ConfigError(
            f"the DDP model runs on {world} ranks, the communicator on {opt.comm.world}",
            op=name,
            hint="wrap the model in DDP over the whole job (the default process group)",
        )
    opt.ddp_layouts = {}
    ddp.register_comm_hook(opt, _hook)


def check_group(opt: torch.optim.Optimizer, index: int) -> None:
    name = f"coconet.optim.{type(opt).__name__}"
    if index > 0:
        raise ConfigError(
            "with ddp=, the optimizer takes one param group (DDP's buckets ignore groups: a "
            "bucket cannot take two sets of hyper-parameters)",
            op=name,
            hint="pass ddp.parameters() as one group, or use the optimizer without DDP",
        )
    mine = {id(p) for p in opt.param_groups[0]["params"]}
    theirs = {id(p) for p in opt.ddp.parameters() if p.requires_grad}
    if mine != theirs:
        raise ConfigError(
            f"with ddp=, the optimizer must hold exactly the DDP model's trainable parameters "
            f"({len(mine)} given, the model has {len(theirs)})",
            op=name,
            hint="coconet.optim.AdamW(ddp.parameters(), comm=comm, ddp=ddp)",
        )


def _hook(opt, bucket):  # no annotations: DDP checks them, and these would be strings
    """DDP's communication hook: the fused step over this bucket's parameters; returns a
    ``torch.futures.Future`` of the bucket's gradient buffer."""
    params = bucket.parameters()
    b = _bucket_for(opt, params)
    group = opt.param_groups[0]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    # a DDP bucket's parameters are stepped together (DDP hands the hook every gradient, zero
    # for the unused ones): one step count for all of them
    b.step_fn(g=bucket.buffer(), p=flat, **b.state, **opt.scalars(group, b.steps[0] + 1))
    b.steps[:] = [s + 1 for s in b.steps]
    with torch.no_grad():
        for p, off in zip(params, b.offsets, strict=True):
            p.copy_(flat[off : off + p.numel()].view_as(p))
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _bucket_for(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> Bucket:
    """The compiled step of DDP's bucket ``params`` (its layout: the parameters, in order). A
    new layout takes its parameters' state from the layouts that held them before (collective:
    every rank gets DDP's buckets in the same order)."""
    key = tuple(id(p) for p in params)
    layouts: dict[tuple[int, ...], Bucket] = opt.ddp_layouts
    if key in layouts:
        return layouts[key]
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ConfigError(
            f"a DDP bucket mixes dtypes {sorted(map(str, dtypes))}",
            op=f"coconet.optim.{type(opt).__name__}",
            hint="keep the model's trainable parameters in one dtype",
        )
    new = opt.packer.new_bucket(0, dtypes.pop(), list(params))
    where = {id(p): (old, off) for old in layouts.values() for p, off in zip(
        old.params, old.offsets, strict=True)}
    moved = [p for p in params if id(p) in where]
    if moved:
        olds = list({id(where[id(p)][0]): where[id(p)][0] for p in moved}.values())
        steps = {s for old in olds for s in old.steps}
        if len(steps) > 1:
            raise ConfigError(
                f"DDP regrouped parameters that were stepped a different number of times "
                f"({sorted(steps)})",
                op=f"coconet.optim.{type(opt).__name__}",
                hint="a parameter that gets no gradient in some steps is not supported with ddp=",
            )
        new.steps[:] = [steps.pop()] * len(new.params)
        lo, hi = new.bounds
        for name in new.names:
            whole = torch.zeros(new.size, dtype=new.state[name].dtype)
            for old in olds:
                full = state.whole(opt.comm, old, name)
                for p, off in zip(old.params, old.offsets, strict=True):
                    if id(p) in {id(q) for q in params}:
                        at = new.offsets[[id(q) for q in params].index(id(p))]
                        whole[at : at + p.numel()].copy_(full[off : off + p.numel()])
            target = new.state[name]
            target.copy_(whole if target.numel() == new.size else whole[lo:hi])
        for old in olds:  # a layout all of whose parameters moved is gone
            if all(id(p) in set(key) for p in old.params):
                del layouts[tuple(id(p) for p in old.params)]
                opt.buckets.remove(old)
    layouts[key] = new
    opt.buckets.append(new)
    return new
