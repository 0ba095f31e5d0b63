"""Data-parallel optimizer steps: ``coconet.optim`` against what users run, in one process group.

``--nproc`` local ranks (spawned with ``coconet.runtime.spawn``, 1 torch thread each) each hold
a gradient of ``--params`` float32 values for one parameter tensor; one step averages the
gradient over the ranks (as DDP does) and applies the optimizer. Contenders, in alternation
(A B C ... A B C ...), a barrier before each step, the slowest rank's time of each step:

- ``ddp``: ``dist.all_reduce`` (gloo) of the gradient, divided by the world size, then the
  fastest torch implementation (``fused=True`` for SGD/Adam/AdamW; for LAMB, which torch lacks,
  ``pytorch_optimizer.Lamb`` with its foreach path, the library users install);
- ``ddp+lamb_foreach``: LAMB written with ``torch._foreach_*`` ops the way a user would (LAMB only);
- ``zero``: ``ZeroRedundancyOptimizer`` over the same optimizer (the parameter split into one
  tensor per rank: ZeRO shards whole tensors; so not for LAMB, whose trust ratio is per tensor:
  halves would compute another update);
- ``coconet.optim.<X>``: the drop-in optimizer, default schedule (fuse_RS_C_AG, state sliced),
  over shared memory (the default on one host), and ``[gloo]`` over torch.distributed.

With ``--bf16`` (opt-in; SGD/Adam/AdamW, one tensor), the gradients sent in bfloat16, three
contenders more:

- ``ddp[bf16_compress_hook]``: a real ``torch.nn.parallel.DistributedDataParallel`` over a
  module holding the parameter (``gradient_as_bucket_view=True``: one bucket) with torch's
  ``default_hooks.bf16_compress_hook`` registered (through a one-line wrapper that calls it:
  DDP refuses that hook by its name on a build without CUDA + NCCL), then the torch optimizer
  (``fused=True``). The timed step is ``loss.backward()`` + ``opt.step()``: the forward
  (untimed) is an autograd function whose backward only hands this step's gradient over
  (AccumulateGrad adds it into the bucket-view ``.grad``, zeroed untimed: one pass over the
  gradient), then DDP's hook: the float32 bucket cast to bfloat16 and divided by the world
  size, gloo all_reduce (SUM, in bfloat16), cast back into the bucket;
- ``coconet.optim.<X>[reduce bf16]`` (``[hierarchical][reduce bf16]`` across hosts): the same
  optimizer with ``reduce_dtype=torch.bfloat16``: each rank's float32 gradient cast to
  bfloat16, reduced (float32 accumulation, rounded to bfloat16 once per level: once on one
  host, each host's sum and then the hosts' across hosts), widened, averaged; the float32
  parameters gathered;
- ``coconet.optim.<X>[bf16]`` (``[hierarchical][bf16]`` across hosts): the optimizer over the
  bfloat16 parameter ``p0.to(bf16)``, whose ``.grad`` (a view of the optimizer's bucket) gets
  this rank's gradient rounded to bfloat16 (``g_r.to(bf16)``, in place): the same reduction of
  the bfloat16 gradients, then the update of this rank's float32 master slice (float32 m, v),
  the new master rounded to bfloat16 (to nearest) and the bfloat16 parameters all-gathered:
  half the bytes of the float32 step, gradients and parameters.

Their results are checked with their own rounding, against the torch optimizer (``fused=True``)
stepped untimed on the gradient each should have reduced (each rank makes every rank's
gradient from the seed): coconet's, ``hierarchy.reduce_order`` of the ranks' bfloat16
gradients (the order and roundings its transport states), widened, ``* (1 / world)``; DDP's,
its own reduced gradient (its ``.grad`` after the first two steps: the two gradients of the
cycle) once that is checked, element by element, to be a bfloat16 sum of the ranks'
``g_r.to(bf16) / world`` in a cyclic order of the ranks, rounded at every addition (gloo's
ring all_reduce of bfloat16; a float32 average or one rounded once fails it). The tolerance is
the float32 contenders' (``TOL``); the distance from ``ddp``'s float32 step is reported too.
The bfloat16 step is checked through its float32 master (``opt.state_dict()``'s
``master_param``, gathered on every rank after the timed steps) against the torch optimizer on
a float32 master from ``p0.to(bf16).float()`` over coconet's average, and its bfloat16
parameter must be exactly ``master.to(bf16)`` (``params_not_master_rounding``: 0). With Adam,
elements whose first update is ill-conditioned (``|g + weight_decay * p| < 1e-6`` with no
history, in float64: exact cancellations, frequent on bfloat16's grid, where torch's unrounded
``weight_decay * p`` and coconet's rounded one move the update by a good part of ``lr``) are
left out of the max error, each still within ``lr`` (``ill_conditioned``: their count; as
``data_parallel_adam.py`` does; measured at 1M: 34 on 2 ranks, the worst 4.1e-6 relative, and
60 on 4 ranks, the worst 6.5e-5 relative: beyond ``TOL``, 3.1e-4 absolute, within ``lr``).

After the timed steps every contender's parameters are compared with ``ddp``'s (the bfloat16
ones with their reference). A copy probe
measures the memory bandwidth; each contender's lower bound is the bytes its step must read and
write at that bandwidth (and, for gloo contenders, the all_reduce's bus bytes at the gloo probe's
bandwidth, printed separately).

With ``--model gpt:LAYERS:WIDTH`` the parameters are not one tensor but the tensors of a
nanoGPT model (``bias=False``, vocabulary 65, block 256: 6 tensors a layer + 3), in nanoGPT's
two param groups (weight decay on the tensors of 2 or more dims, none on the rest), with
``--clip`` (default 1.0; SGD/Adam/AdamW) clipping by the global norm: ``ddp`` is then DDP's
communication (one flat bucket the gradients are views of, ``gradient_as_bucket_view=True``:
all_reduce, divide) + ``clip_grad_norm_`` + the torch optimizer over the two groups, and
``coconet.optim.<X>`` takes the same groups and ``max_grad_norm=``. This is the small-model row
of issue 25: the step's fixed costs (per group, per tensor, per collective) matter at this size.

    python benchmarks/data_parallel.py --optimizer adam --params 16M --nproc 2 --json out.json
    python benchmarks/data_parallel.py --optimizer lamb
    python benchmarks/data_parallel.py --optimizer adamw --model gpt:5:128 --steps 50
    python benchmarks/data_parallel.py --optimizer lamb --model gpt:4:128 --steps 50
    python benchmarks/data_parallel.py --optimizer adam --params 1M --nproc 4 --bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from coconet.options import TransportKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import cpu_model, pyplot  # noqa: E402  (one definition for the benchmarks)

OPTIMIZERS = ("sgd", "adam", "adamw", "lamb")
HYPER = {
    "sgd": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2},
    "adam": {"lr": 1e-3, "weight_decay": 1e-2},
    "adamw": {"lr": 1e-3, "weight_decay": 1e-2},
    "lamb": {"lr": 1e-3, "weight_decay": 1e-2},
}
TORCH_NAME = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "lamb": "LAMB"}
# bytes of optimizer state per parameter (float32): SGD's momentum, Adam's m and v
STATE_WORDS = {"sgd": 1, "adam": 2, "adamw": 2, "lamb": 2}
TOL = 1e-5  # max |p - p_ref| / max |p_ref| for "correct"
# |g + weight_decay * p| below this with no history: Adam's update ill-conditioned (--bf16's
# bfloat16 step; see data_parallel_adam.mixed_reference)
ILL_CONDITIONED = 1e-6


def parse_size(text: str) -> int:
    """16M -> 16 * 2**20, 4k -> 4096, 1000 -> 1000."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def gradient(seed: int, rank: int, k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + rank * 104_729 + k)
    return torch.randn(n, generator=gen) * 1e-2


class Contender:
    name, kind = "", "baseline"

    def prepare(self, g: torch.Tensor) -> None:
        """Untimed: this step's local gradient into the contender's .grad (as backward would)."""
        self.p.grad.copy_(g)

    def param(self) -> torch.Tensor:
        return self.p.detach()


def torch_optimizer(opt: str, params, hp: dict, impl: str):
    if opt == "lamb":
        import pytorch_optimizer

        return pytorch_optimizer.Lamb(params, foreach=impl != "single", **hp)
    return getattr(torch.optim, TORCH_NAME[opt])(params, **hp, **{impl: True})


class DDP(Contender):
    def __init__(self, name, opt, p0, hp, world, impl) -> None:
        self.name, self.world = name, world
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.opt = torch_optimizer(opt, [self.p], hp, impl)

    def step(self) -> None:
        dist.all_reduce(self.p.grad)
        self.p.grad.div_(self.world)
        self.opt.step()


class ForeachLamb(DDP):
    """LAMB as a user writes it with torch's foreach ops (pytorch_optimizer.Lamb's maths)."""

    def __init__(self, p0, hp, world) -> None:
        self.name, self.world = "ddp+lamb_foreach", world
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.m, self.v = torch.zeros_like(p0), torch.zeros_like(p0)
        self.lr, self.wd, self.t = hp["lr"], hp["weight_decay"], 0

    @torch.no_grad()
    def step(self) -> None:
        dist.all_reduce(self.p.grad)
        self.p.grad.div_(self.world)
        b1, b2, eps, self.t = 0.9, 0.999, 1e-6, self.t + 1
        ps, gs, ms, vs = [self.p], [self.p.grad], [self.m], [self.v]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, gs, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        torch._foreach_mul_(ps, 1 - self.lr * self.wd)
        us = torch._foreach_div(ms, torch._foreach_add(torch._foreach_sqrt(vs), eps))
        for p, u, w, un in zip(ps, us, torch._foreach_norm(ps), torch._foreach_norm(us),
                               strict=True):
            w = w.clamp(max=10.0)
            trust = 1.0 if w == 0 or un == 0 else (w / (un + eps)).item()
            p.add_(u, alpha=-self.lr / (1 - b1**self.t) * trust)


class Zero(Contender):
    def __init__(self, opt, p0, hp, world) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.name, self.world = "zero", world
        self.params = [torch.nn.Parameter(c.clone()) for c in torch.tensor_split(p0, world)]
        self.flat = torch.empty_like(p0)
        for p, view in zip(self.params, torch.tensor_split(self.flat, world), strict=True):
            p.grad = view
        if opt == "lamb":
            import pytorch_optimizer

            cls, extra = pytorch_optimizer.Lamb, {}
        else:
            cls, extra = getattr(torch.optim, TORCH_NAME[opt]), {"fused": True}
        self.opt = ZeroRedundancyOptimizer(self.params, optimizer_class=cls, **hp, **extra)

    def prepare(self, g):
        self.flat.copy_(g)

    def step(self) -> None:
        dist.all_reduce(self.flat)
        self.flat.div_(self.world)
        self.opt.step()

    def param(self):
        return torch.cat([p.detach() for p in self.params])


class CoconetOptim(Contender):
    kind = "coconet"

    def __init__(self, name, opt, comm, p0, hp, **extra) -> None:
        import coconet.optim

        self.name = name
        self.p = torch.nn.Parameter(p0.clone())
        self.opt = getattr(coconet.optim, TORCH_NAME[opt])([self.p], **hp, comm=comm, **extra)

    def step(self) -> None:
        self.opt.step()


class CoconetBf16(CoconetOptim):
    """``coconet.optim.<X>`` over the bfloat16 parameter ``p0.to(bf16)``: its ``.grad`` (a
    view of the optimizer's bucket) gets this rank's gradient rounded to bfloat16 (``copy_``:
    round to nearest, the ``g_r.to(bf16)`` of the reference); the optimizer keeps float32
    master, m, v slices. Checked through its master (``master``: ``state_dict()``, collective)
    and its parameter, which must be exactly the master's rounding."""

    def __init__(self, name, opt, comm, p0, hp) -> None:
        super().__init__(name, opt, comm, p0.to(torch.bfloat16), hp)

    def master(self) -> torch.Tensor:
        return self.opt.state_dict()["state"][0]["master_param"].reshape(-1)


class _GivenGradient(torch.autograd.Function):
    """A loss whose backward hands ``g`` to the parameter and computes nothing: the stand-in
    for a model's backward, so that DDP's own hooks (and its comm hook) run as in training."""

    @staticmethod
    def forward(ctx, w, g):
        ctx.g = g
        return w.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.g, None


class _Holder(torch.nn.Module):
    def __init__(self, p0: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(p0.clone())

    def forward(self, g):
        return _GivenGradient.apply(self.w, g)


class DDPHook(Contender):
    """``torch.nn.parallel.DistributedDataParallel`` with ``bf16_compress_hook`` registered, as
    users run it; forward untimed, ``backward()`` (DDP's hook: cast to bfloat16, divide, gloo
    all_reduce, cast back) and ``opt.step()`` timed."""

    def __init__(self, opt, p0, hp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        self.name = "ddp[bf16_compress_hook]"
        self.model = DistributedDataParallel(_Holder(p0), gradient_as_bucket_view=True)
        # DDP refuses bf16_compress_hook by its name without CUDA + NCCL (or XPU + XCCL):
        # "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and
        # XCCL"; under another name it takes it, and torch's hook itself runs, over gloo
        def bf16_compress(process_group, bucket):
            return default_hooks.bf16_compress_hook(process_group, bucket)

        self.model.register_comm_hook(None, bf16_compress)
        self.opt = torch_optimizer(opt, self.model.parameters(), hp, "fused")
        self.loss = None

    def prepare(self, g):
        w = self.model.module.w
        if w.grad is not None:  # after the first step: the bucket view, zeroed as zero_grad()
            w.grad.zero_()       # with set_to_none=False would (backward adds into it)
        self.loss = self.model(g)

    def step(self) -> None:
        self.loss.backward()
        self.loss = None
        self.opt.step()

    def param(self):
        return self.model.module.w.detach()


def bf16_gradients(seed: int, world: int, n: int) -> list[list[torch.Tensor]]:
    """Every rank's gradient of the two of the cycle (``run``: round r uses r % 2), in
    bfloat16: ``[k][rank]``, made here from the seed as each rank makes its own."""
    return [[gradient(seed, r, k, n).to(torch.bfloat16) for r in range(world)] for k in range(2)]


def ring_sum_share(reduced: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """The share of ``reduced``'s elements that are a bfloat16 sum of ``parts`` (one a rank,
    ``g_r.to(bf16).div_(world)`` as the hook makes it) in a cyclic order of the ranks, either
    way round, rounded at every addition: what gloo's ring all_reduce of bfloat16 gives (each
    chunk summed rank after rank around the ring; measured: every element is one of these)."""
    x = reduced.to(torch.bfloat16)
    ok = torch.zeros(x.shape, dtype=torch.bool)
    world = len(parts)
    for start in range(world):
        for way in (1, -1) if world > 2 else (1,):
            acc = parts[start].clone()
            for i in range(1, world):
                acc += parts[(start + way * i) % world]
            ok |= acc == x
    ok &= x.float() == reduced  # and the value on bfloat16's grid
    return ok.float().mean().item()


class Bf16Reference(Contender):
    """Untimed: ``torch.optim.<X>(fused=True)`` on the average with coconet's bfloat16
    rounding: ``hierarchy.reduce_order`` of the ranks' ``g_r.to(bf16)`` (each host's sum in
    local rank order, accumulated in float32 and rounded to bfloat16, then the hosts' sums in
    host order, rounded again: once per level; on one host, once), widened, ``* (1 / world)``."""

    name, kind = "torch.optim on the bf16 sum in coconet's order", "reference"
    ill = None  # (the elements left out of the check: see __init__)

    def __init__(self, opt, p0, hp, grads16, layout, start: torch.Tensor | None = None) -> None:
        """``start``: the float32 master it steps from (default ``p0``; the bfloat16 step's:
        ``p0.to(bf16).float()``), which then also marks the ill-conditioned elements
        (``ill``)."""
        from coconet.ir.ops import ReduceOp
        from coconet.runtime.hierarchy import reduce_order

        self.p = torch.nn.Parameter(p0.clone() if start is None else start)
        self.p.grad = torch.empty_like(self.p)
        self.opt = torch_optimizer(opt, [self.p], hp, "fused")
        self.avg = [reduce_order(ReduceOp.SUM, gs, layout).float() * (1.0 / len(gs))
                    for gs in grads16]
        self.round = 0
        # Adam (weight decay added to the gradient) from a bfloat16 start: the elements whose
        # update is ill-conditioned (``data_parallel_adam.mixed_reference``)
        wd = hp.get("weight_decay", 0.0)
        self.ill = (torch.zeros(p0.numel(), dtype=torch.bool)
                    if start is not None and opt == "adam" and wd else None)
        self.wd = wd

    def prepare(self, g):
        self.p.grad.copy_(self.avg[self.round % 2])
        self.round += 1

    def step(self) -> None:
        if self.ill is not None:  # g + wd * p cancelling (float64) where there is no history
            state = self.opt.state.get(self.p)
            fresh = (state["exp_avg_sq"] < ILL_CONDITIONED**2 if state
                     else torch.ones_like(self.ill))
            g_wd = self.p.grad.double().add(self.p.detach().double(), alpha=self.wd)
            self.ill |= fresh & (g_wd.abs() < ILL_CONDITIONED)
        self.opt.step()


class HookReference(Bf16Reference):
    """Untimed, after ``ddp[bf16_compress_hook]``: its reduced gradient of the first two
    rounds (the two of the cycle) taken from its ``.grad`` and checked element by element to
    be a ring sum (``ring_sum_share``), then ``torch.optim.<X>(fused=True)`` stepped on it."""

    name, kind = "torch.optim on ddp's hook's gradient, checked a bf16 ring sum", "reference"

    def __init__(self, opt, p0, hp, grads16, hook: DDPHook) -> None:
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.opt = torch_optimizer(opt, [self.p], hp, "fused")
        self.grads16, self.hook, self.avg, self.shares, self.round = grads16, hook, [], [], 0

    def prepare(self, g):
        if self.round < 2:  # the hook stepped this round: its .grad is this round's average
            reduced = self.hook.model.module.w.grad.detach().clone()
            gs = self.grads16[self.round]
            parts = [g.clone().div_(len(gs)) for g in gs]  # as the hook divides, in bfloat16
            self.shares.append(ring_sum_share(reduced, parts))
            self.avg.append(reduced)
            self.hook.ring_sum_share = min(self.shares)
            if self.round == 1:
                self.grads16 = None
        super().prepare(g)
def gpt_shapes(layers: int, width: int, vocab: int = 65, block: int = 256
               ) -> list[tuple[str, tuple[int, ...]]]:  # fmt: skip
    """The parameter tensors of nanoGPT's ``GPT`` with ``bias=False`` (the lm_head tied to
    ``wte``), in ``named_parameters()`` order: 6 a layer, plus ``wte``, ``wpe`` and ``ln_f``."""
    shapes = [("transformer.wte.weight", (vocab, width)),
              ("transformer.wpe.weight", (block, width))]
    for i in range(layers):
        h = f"transformer.h.{i}"
        shapes += [(f"{h}.ln_1.weight", (width,)), (f"{h}.attn.c_attn.weight", (3 * width, width)),
                   (f"{h}.attn.c_proj.weight", (width, width)), (f"{h}.ln_2.weight", (width,)),
                   (f"{h}.mlp.c_fc.weight", (4 * width, width)),
                   (f"{h}.mlp.c_proj.weight", (width, 4 * width))]
    return shapes + [("transformer.ln_f.weight", (width,))]


def model_params(p0: torch.Tensor, shapes) -> list[torch.nn.Parameter]:
    """One Parameter per shape, each with storage of its own (as a model's), from ``p0``."""
    sizes = [torch.Size(shape).numel() for _, shape in shapes]
    return [torch.nn.Parameter(part.clone().view(shape))
            for part, (_, shape) in zip(p0.split(sizes), shapes, strict=True)]


def nanogpt_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """nanoGPT's ``configure_optimizers``: decay the tensors of 2+ dims, not the others."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


class ModelDDP(Contender):
    """What DDP + a torch optimizer do for a model's step once backward has filled the bucket:
    one flat gradient bucket (``gradient_as_bucket_view=True``: each ``.grad`` a view of it),
    its all_reduce (gloo) and division by the world size, ``clip_grad_norm_`` (``foreach``) when
    clipping, then the optimizer over nanoGPT's two param groups. (DDP overlaps the all_reduce
    with backward where a core is free; on this 2-core machine none is.)"""

    def __init__(self, name, opt, p0, shapes, hp, world, impl, clip) -> None:
        self.name, self.world, self.clip = name, world, clip
        self.params = model_params(p0, shapes)
        self.bucket = torch.empty_like(p0)
        off = 0
        for p in self.params:
            p.grad = self.bucket[off:off + p.numel()].view_as(p)
            off += p.numel()
        rest = {k: v for k, v in hp.items() if k != "weight_decay"}
        self.opt = torch_optimizer(opt, nanogpt_groups(self.params, hp["weight_decay"]), rest,
                                   impl)

    def prepare(self, g):
        self.bucket.copy_(g)

    def step(self) -> None:
        dist.all_reduce(self.bucket)
        self.bucket.div_(self.world)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()

    def param(self):
        return flat(self.params)


class ModelCoconet(Contender):
    """``coconet.optim.<X>`` over the same tensors and groups, ``max_grad_norm=`` when clipping:
    the loop's only change (its ``.grad``s are views of coconet's buckets, as backward fills)."""

    kind = "coconet"

    def __init__(self, name, opt, comm, p0, shapes, hp, clip) -> None:
        import coconet.optim

        self.name, self.params = name, model_params(p0, shapes)
        rest = {k: v for k, v in hp.items() if k != "weight_decay"}
        extra = {"max_grad_norm": clip} if clip is not None else {}
        self.opt = getattr(coconet.optim, TORCH_NAME[opt])(
            nanogpt_groups(self.params, hp["weight_decay"]), **rest, comm=comm, **extra)

    def prepare(self, g):
        off = 0
        for p in self.params:
            p.grad.copy_(g[off:off + p.numel()].view_as(p))
            off += p.numel()

    def step(self) -> None:
        self.opt.step()

    def param(self):
        return flat(self.params)


class CopyProbe(Contender):
    name, kind = "probe:copy", "probe"

    def __init__(self, n: int) -> None:
        self.src, self.dst = torch.randn(n), torch.empty(n)

    def prepare(self, g):
        pass

    def step(self) -> None:
        self.dst.copy_(self.src)


class AllReduceProbe(CopyProbe):
    name = "probe:all_reduce"

    def __init__(self, n: int) -> None:
        self.buf = torch.ones(n)

    def step(self) -> None:
        dist.all_reduce(self.buf)


def worker(comm, cfg: dict) -> dict:
    from coconet.runtime import CommOptions, Communicator

    torch.set_num_threads(1)
    opt, n, world = cfg["optimizer"], cfg["params"], comm.world
    hp = HYPER[opt]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(cfg["seed"]))
    gloo = Communicator(comm.mesh, CommOptions(timeout=comm.options.timeout,
                                               transport="torch.distributed"))
    name = f"coconet.optim.{TORCH_NAME[opt]}"
    contenders = [CopyProbe(n), AllReduceProbe(n)]
    if cfg.get("model"):
        return run(comm, cfg, contenders + model_contenders(comm, gloo, cfg, p0, hp, name))
    contenders.append(DDP("ddp", opt, p0, hp, world, "foreach" if opt == "lamb" else "fused"))
    if opt == "lamb":
        contenders.append(DDP("ddp+lamb_single", opt, p0, hp, world, "single"))
        contenders.append(ForeachLamb(p0, hp, world))
    if opt != "lamb":  # ZeRO shards whole tensors: LAMB's per-tensor norms would change meaning
        contenders.append(Zero(opt, p0, hp, world))
    # across hosts the default may be two levels (shared memory inside each host): say so
    two_levels = comm.transport_of(None) is TransportKind.HIERARCHICAL
    contenders.append(CoconetOptim(f"{name}[hierarchical]" if two_levels else name, opt, comm,
                                   p0, hp))
    contenders.append(CoconetOptim(f"{name}[gloo]", opt, gloo, p0, hp))
    if cfg.get("bf16"):
        contenders += bf16_contenders(comm, cfg, p0, hp, contenders[-2].name)
    return run(comm, cfg, contenders)


def bf16_contenders(comm, cfg: dict, p0, hp: dict, name: str) -> list[Contender]:
    """``--bf16``'s contenders (the gradients sent in bfloat16), each after its reference (of
    kind "reference": stepped untimed, not a row)."""
    from coconet.runtime.hierarchy import HostLayout
    from coconet.runtime.symmem import host_identity

    opt = cfg["optimizer"]
    grads16 = bf16_gradients(cfg["seed"], comm.world, p0.numel())
    # which rank is on which host: the order of coconet's sums over two levels (one host: all)
    hosts = [None] * comm.world
    if comm.transport_of(None) is TransportKind.HIERARCHICAL:
        dist.all_gather_object(hosts, host_identity())
    hook = DDPHook(opt, p0, hp)
    hook.reference = HookReference(opt, p0, hp, grads16, hook)
    layout = HostLayout.of(hosts)
    mine = CoconetOptim(f"{name}[reduce bf16]", opt, comm, p0, hp, reduce_dtype=torch.bfloat16)
    mine.reference = Bf16Reference(opt, p0, hp, grads16, layout)
    half = CoconetBf16(f"{name}[bf16]", opt, comm, p0, hp)
    half.reference = Bf16Reference(opt, p0, hp, grads16, layout,
                                   start=p0.to(torch.bfloat16).float())
    half.reference.name = ("torch.optim on a float32 master from p0.to(bf16), the bf16 sum in "
                           "coconet's order")
    return [hook, hook.reference, mine.reference, mine, half.reference, half]


def model_contenders(comm, gloo, cfg: dict, p0, hp: dict, name: str) -> list[Contender]:
    """The small-model row's contenders (``--model``): ddp (the reference) first."""
    opt, shapes, clip = cfg["optimizer"], gpt_shapes(*cfg["model"]), cfg["clip"]
    impl = "foreach" if opt == "lamb" else "fused"
    suffix = f"[clip {clip:g}]" if clip is not None else ""
    return [ModelDDP(f"ddp{suffix}", opt, p0, shapes, hp, comm.world, impl, clip),
            ModelCoconet(f"{name}{suffix}", opt, comm, p0, shapes, hp, clip),
            ModelCoconet(f"{name}{suffix}[gloo]", opt, gloo, p0, shapes, hp, clip)]


def run(comm, cfg: dict, contenders: list[Contender]) -> dict:
    """Time ``contenders`` in alternation (the first two are the probes, the third the
    reference the others' parameters are compared with, unless a contender names its own
    ``reference``: one of kind "reference", stepped untimed and not a row) and return the
    rows."""
    rounds, n = 1 + cfg["warmup"] + cfg["steps"], cfg["params"]
    times = torch.zeros(len(contenders), cfg["steps"], dtype=torch.float64)
    first = torch.zeros(len(contenders), dtype=torch.float64)
    for r in range(rounds):
        if comm.rank == 0:
            print(f"\r  round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
        g = gradient(cfg["seed"], comm.rank, r % 2, n)
        for i, c in enumerate(contenders):
            c.prepare(g)
            if c.kind == "reference":
                c.step()
                continue
            dist.barrier()
            t = time.perf_counter()
            c.step()
            dt = (time.perf_counter() - t) * 1e3
            if r == 0:
                first[i] = dt
            elif r > cfg["warmup"]:
                times[i, r - 1 - cfg["warmup"]] = dt
    if comm.rank == 0:
        print(file=sys.stderr)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    ddp = contenders[2]
    rows = []
    for i, c in enumerate(contenders):
        if c.kind == "reference":
            continue
        row = {"name": c.name, "kind": c.kind, "first_call_ms": round(first[i].item(), 3)}
        ts = times[i].tolist()
        row.update(median_ms=round(statistics.median(ts), 3), min_ms=round(min(ts), 3),
                   max_ms=round(max(ts), 3))
        if c.kind != "probe":
            mine, against = c.param(), getattr(c, "reference", ddp)
            # bfloat16 parameters: their float32 master checked (state_dict(): collective, every
            # rank here in the same order), the parameters exactly its rounding
            master = c.master() if hasattr(c, "master") else None
            unrounded = 0 if master is None else (mine != master.to(mine.dtype)).sum().item()
            mine = mine if master is None else master
            ill = getattr(against, "ill", None)
            ref = against.param()
            diff = (mine - ref).abs()
            scale = ref.abs().max().item()
            every = diff.max().item() / scale  # (every element, the ill-conditioned too)
            if ill is not None:  # left out of the error, each still within lr
                ill_worst = diff[ill].max().item() if ill.any() else 0.0
                diff = diff.masked_fill(ill, 0.0)
            errs = torch.tensor([diff.max().item() / scale,
                                 ((mine - ddp.param()).abs().max() / ddp.param().abs().max()
                                  ).item(),
                                 unrounded, 0.0 if ill is None else ill.sum().item(),
                                 0.0 if ill is None else ill_worst, every], dtype=torch.float64)
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            row["max_rel_err_vs_ddp"] = errs[1].item()  # (the bf16 rows': how far from float32)
            row["correct"] = errs[0].item() <= TOL
            if master is not None:
                row["params_not_master_rounding"] = int(errs[2].item())
                row["correct"] = row["correct"] and errs[2].item() == 0
            if ill is not None:
                row["ill_conditioned"] = int(errs[3].item())
                row["max_rel_err_vs_reference_every_element"] = errs[5].item()
                row["ill_conditioned_max_abs_err"] = errs[4].item()
                row["correct"] = row["correct"] and errs[4].item() <= HYPER[cfg["optimizer"]]["lr"]
            if against is not ddp:
                row["reference"], row["max_rel_err_vs_reference"] = against.name, errs[0].item()
            if hasattr(c, "ring_sum_share"):  # the share of the reduced gradient checked
                share = torch.tensor([c.ring_sum_share], dtype=torch.float64)
                dist.all_reduce(share, op=dist.ReduceOp.MIN)
                row["reduced_grad_ring_sum_share"] = share.item()
                row["correct"] = row["correct"] and share.item() == 1.0
        rows.append(row)
    return {"rows": rows}


def lower_bounds(rows: list[dict], opt: str, n: int, world: int) -> dict:
    by = {r["name"]: r for r in rows}
    copy_gbs = 8 * n / by["probe:copy"]["median_ms"] / 1e6  # read + write
    s = STATE_WORDS[opt]
    # an unfused step (all_reduce, then the update on every element): read g, p, state and write
    # p, state over all n, plus the all_reduce's own memory traffic over shared memory
    update = (2 + 2 * s) * 4 * n
    ar_bus = 2 * (world - 1) / world * 4 * n
    ar_gbs = ar_bus / by["probe:all_reduce"]["median_ms"] / 1e6
    # coconet's fused step over shared memory: its slice of every peer's gradient (4n), its slice
    # of p and the state read and written, and the peers' new p slices copied into p (8n)
    fused = 4 * n + (2 + 2 * s) * 4 * n / world + 8 * n
    return {
        "copy_GBps": round(copy_gbs, 3),
        "fused_shared_memory_ms": round(fused / copy_gbs / 1e6, 3),
        "update_memory_ms": round(update / copy_gbs / 1e6, 3),
        "gloo_all_reduce_ms": round(ar_bus / ar_gbs / 1e6, 3),
    }


def table(doc: dict) -> str:
    rows, cfg = doc["results"], doc["config"]
    ddp = next(r for r in rows if r["kind"] != "probe")  # the reference: ddp
    lb = doc["lower_bound"]
    model = (f" in the {len(gpt_shapes(*cfg['model']))} tensors of nanoGPT {cfg['model'][0]} "
             f"x {cfg['model'][1]} (2 param groups)" if cfg.get("model") else "")
    width = max(32, *(len(r["name"]) for r in rows))
    lines = [
        f"data_parallel: {cfg['optimizer']}, {cfg['params']:,} float32 params{model}, "
        f"{doc['world_size']} ranks x 1 thread, {cfg['steps']} timed steps after "
        f"{cfg['warmup']} warm-up (+1 first call); {doc['machine']['cpu_model']}, "
        f"{doc['machine']['cpus']} cpus",
        "",
        f"{'name':<{width}} {'median ms':>10} {'min':>8} {'max':>8} {'ddp/this':>9} {'correct':>8} "
        f"{'err vs ddp':>11}",
    ]
    for r in rows:
        speed = f"{ddp['median_ms'] / r['median_ms']:.2f}x" if r["kind"] != "probe" else ""
        ok = "" if "correct" not in r else ("yes" if r["correct"] else "NO !!!")
        err = next((f"{r[k]:.1e}{'*' if k.endswith('reference') else ''}"
                    for k in ("max_rel_err_vs_reference", "max_rel_err_vs_ddp") if k in r), "")
        lines.append(f"{r['name']:<{width}} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f} "
                     f"{r['max_ms']:>8.1f} {speed:>9} {ok:>8} {err:>11}".rstrip())
    lines += [
        "",
        f"lower bounds (copy probe {lb['copy_GBps']:.1f} GB/s): coconet's fused step over shared "
        f"memory {lb['fused_shared_memory_ms']:.1f} ms; an update over every parameter "
        f"{lb['update_memory_ms']:.1f} ms (+ the all_reduce: over gloo "
        f"{lb['gloo_all_reduce_ms']:.1f} ms at the gloo probe's bandwidth)",
        f"err vs ddp: max |p - p_ddp| / max |p_ddp| after every step; correct: <= {TOL:g}",
    ]
    lines += [f"*: {r['name']}'s err is against {r['reference']} (vs ddp's float32 step: "
              f"{r['max_rel_err_vs_ddp']:.1e})" + (
        f" ({r['reduced_grad_ring_sum_share']:.0%} of its elements such a sum)"
        if "reduced_grad_ring_sum_share" in r else "") for r in rows if "reference" in r]
    if doc["targets"]:
        lines += ["", "targets (ratios of medians from this run):"]
        lines += [f"  {'met ' if t['met'] else 'MISSED'} {t['name']}: {t['value']:.2f} >= "
                  f"{t['threshold']}" for t in doc["targets"]]
    return "\n".join(lines)


def targets(rows: list[dict], cfg: dict) -> list[dict]:
    """Issue 25's small-model targets, from this run's medians: coconet's step over shared
    memory no slower than ddp's (ddp's median / coconet's >= 1)."""
    if not cfg.get("model"):
        return []
    ddp = next(r for r in rows if r["kind"] != "probe")
    mine = next(r for r in rows if r["kind"] == "coconet")
    value = ddp["median_ms"] / mine["median_ms"]
    return [{"name": f"{mine['name']} no slower than {ddp['name']} ({ddp['name']} / coconet)",
             "value": round(value, 3), "threshold": 1.0, "met": value >= 1.0}]


def plot(doc: dict, path: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    rows = [r for r in doc["results"] if r["kind"] != "probe"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh([r["name"] for r in rows], [r["median_ms"] for r in rows],
            color=["tab:blue" if r["kind"] == "coconet" else "tab:gray" for r in rows])
    ax.axvline(doc["lower_bound"]["fused_shared_memory_ms"], color="k", linestyle="--",
               label="fused step's memory bound")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median, slowest rank)")
    ax.set_title(f"{doc['config']['optimizer']}, {doc['config']['params']:,} params, "
                 f"{doc['world_size']} ranks")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    ap.add_argument("--params", default="16M", help="float32 parameters (16M, 4M, 1000000)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", metavar="gpt:LAYERS:WIDTH",
                    help="the tensors and two param groups of a nanoGPT model instead of one "
                    "tensor of --params (e.g. gpt:4:128, the issue's 27 tensors)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="with --model: the max_grad_norm / clip_grad_norm_ (SGD/Adam/AdamW; "
                    "0: off)")
    ap.add_argument("--bf16", action="store_true",
                    help="add ddp[bf16_compress_hook] (DDP + bf16_compress_hook + fused Adam), "
                    "coconet.optim.<X>[reduce bf16] (reduce_dtype=torch.bfloat16) and "
                    "coconet.optim.<X>[bf16] (bfloat16 parameters, float32 master), checked "
                    "against a reference with the gradient's bfloat16 rounding (SGD/Adam/AdamW, "
                    "not with --model)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH")
    args = ap.parse_args(argv)
    if args.bf16 and (args.model or args.optimizer == "lamb"):
        ap.error("--bf16 takes one tensor (no --model) and --optimizer sgd, adam or adamw")
    model = None
    if args.model:
        try:
            kind, layers, width = args.model.split(":")
            model = (int(layers), int(width))
        except ValueError:
            kind = ""
        if kind != "gpt" or model is None or min(model) < 1:
            ap.error(f"--model {args.model!r}: expected gpt:LAYERS:WIDTH, e.g. gpt:4:128")
    if args.steps < 10:
        ap.error("--steps must be at least 10")
    if args.optimizer == "lamb":
        try:
            import pytorch_optimizer  # noqa: F401
        except ImportError:
            ap.error("--optimizer lamb compares with pytorch_optimizer.Lamb: pip install -e "
                     "'.[bench]'")
    n = parse_size(args.params)
    clip = args.clip if model and args.clip > 0 and args.optimizer != "lamb" else None
    if model:
        n = sum(torch.Size(shape).numel() for _, shape in gpt_shapes(*model))
    from coconet.runtime import CommOptions, spawn

    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = {"optimizer": args.optimizer, "params": n, "steps": args.steps,
           "warmup": args.warmup, "seed": args.seed, "model": model, "clip": clip,
           "bf16": args.bf16}
    with tempfile.TemporaryDirectory(prefix="coconet-bench-"):
        t0 = time.perf_counter()
        res = spawn(worker, args.nproc, cfg, options=CommOptions(timeout=600), timeout=3600)[0]
        wall = time.perf_counter() - t0
    rows = res["rows"]
    import coconet

    doc = {
        "benchmark": "data_parallel",
        "machine": {
            "cpus": os.cpu_count(), "device": "cpu", "backend": "gloo",
            "torch": torch.__version__.split("+")[0], "python": platform.python_version(),
            "cpu_model": cpu_model(), "coconet": coconet.__version__,
        },
        "world_size": args.nproc,
        "config": {**cfg, "dtype": "float32", "hyper_parameters": HYPER[args.optimizer]},
        "lower_bound": lower_bounds(rows, args.optimizer, n, args.nproc),
        "results": [r for r in rows if r["kind"] != "probe"],
        "probes": [r for r in rows if r["kind"] == "probe"],
        "wall_s": round(wall, 1),
    }
    doc["lower_bound_ms"] = doc["lower_bound"]["fused_shared_memory_ms"]
    doc["targets"] = targets(rows, cfg)
    doc["results"] += doc["probes"]
    print(table(doc))
    print(f"(wall time {wall:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"JSON written to {args.json}")
    if args.plot:
        plot(doc, args.plot)
    return 0 if all(r.get("correct", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
