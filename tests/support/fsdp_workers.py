"""Rank bodies for test_dist_fsdp.py: ``coconet.fsdp.fully_shard`` with a ``coconet.optim``
optimizer against DDP's arithmetic with ``torch.optim`` on one process.

Every rank builds the same small transformer-like model (a tied embedding and head in the
root block, three residual blocks whose sizes are uneven over 2, 3 and 4 ranks); a global
batch of 12 sequences is split evenly over the ranks (so the average of the ranks' mean losses
is the global mean). The reference runs on every rank, in the same process: a copy of the model
whose gradients are the average of every rank's gradients (summed in rank order, divided by
the world size, as DDP does), stepped by the torch optimizer.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import coconet
import coconet.fsdp
from coconet.options import CompileOptions

BATCH, SEQ, VOCAB, WIDTH = 12, 5, 11, 6
EAGER = CompileOptions(fused_kernels=False)


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width + 1)
        self.down = nn.Linear(3 * width + 1, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer(WIDTH) for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))


def groups(net: nn.Module, decay: float) -> list[dict]:
    """nanoGPT's: matrices decayed, vectors not."""
    two = [p for p in net.parameters() if p.dim() >= 2]
    one = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": two, "weight_decay": decay}, {"params": one, "weight_decay": 0.0}]


def reference_step(ref: nn.Module, opt: torch.optim.Optimizer, world: int, step: int,
                   clip: float | None = None) -> float:  # fmt: skip
    """One DDP-equivalent step of ``ref`` on the whole batch: the ranks' gradients averaged."""
    x, y = batch(step)
    shares = list(zip(torch.tensor_split(x, world), torch.tensor_split(y, world), strict=True))
    losses = _averaged_step(ref, opt, [(xs, ys, 1) for xs, ys in shares], world, clip)
    return sum(losses) / world


def _averaged_step(ref: nn.Module, opt: torch.optim.Optimizer, shares: list, world: int,
                   clip: float | None) -> list[float]:  # fmt: skip
    """``ref``'s gradients of each (inputs, targets, loss divisor) of ``shares``, summed in
    that order and divided by ``world`` (DDP's average), clipped by ``clip``, then ``opt``
    steps: the shares' losses."""
    total, losses = None, []
    for xs, ys, divisor in shares:
        ref.zero_grad(set_to_none=True)
        loss = loss_of(ref, xs, ys)
        (loss if divisor == 1 else loss / divisor).backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in ref.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    for p, g in zip(ref.parameters(), total, strict=True):
        p.grad = g / world
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    opt.step()
    return losses


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / max(scale, 1e-30)


def follows_torch(comm, optimizer: str = "AdamW", steps: int = 6, groups_on: bool = True,
                  reshard: bool = True, prefetch: bool | None = None,
                  clip: float | None = None, dcp_dir: str | None = None) -> dict:  # fmt: skip
    """``steps`` steps of a fully sharded model and of the reference: the worst relative error
    of the losses and of the parameters, what each rank stores, and the state dict."""
    net, ref = model(), model()
    fs = coconet.fsdp.fully_shard(net, comm=comm, reshard_after_forward=reshard,
                                  prefetch=prefetch)  # fmt: skip
    kw = {"lr": 1e-2}
    if optimizer in ("Adam", "AdamW"):
        kw["betas"] = (0.8, 0.9)
    if optimizer == "SGD":
        kw["momentum"] = 0.9
    params = groups(net, 0.1) if groups_on else net.parameters()
    extra = {} if clip is None else {"max_grad_norm": clip}
    opt = getattr(coconet.optim, optimizer)(params, comm=comm, options=EAGER, **kw, **extra)
    ref_opt = getattr(torch.optim, optimizer)(groups(ref, 0.1) if groups_on
                                              else ref.parameters(), **kw)  # fmt: skip
    x_all, worst_loss, world = None, 0.0, comm.world
    for t in range(steps):
        x_all, y_all = batch(t)
        xs = torch.tensor_split(x_all, world)[comm.rank]
        ys = torch.tensor_split(y_all, world)[comm.rank]
        loss = loss_of(net, xs, ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = comm.gather_floats([loss.item()], "fsdp test loss")
        ours = sum(v[0] for v in mean) / world
        theirs = reference_step(ref, ref_opt, world, t, clip)
        worst_loss = max(worst_loss, abs(ours - theirs) / abs(theirs))
    from coconet.fsdp.blocks import Unsharded

    # between steps only the slices are stored, and no gradient is left behind
    freed = all(b.state is Unsharded.FREED for b in fs.blocks)
    no_grads = all(p.grad is None for p in net.parameters())
    clipped = opt.last_clip_coef is not None and float(opt.last_clip_coef) < 1.0
    whole = fs.state_dict()
    worst = max(rel(whole[k], v) for k, v in ref.state_dict().items())
    if dcp_dir is not None:  # torch's distributed checkpoint of the slices, each rank its own
        import torch.distributed.checkpoint as dcp

        dcp.save(fs.sharded_state_dict(), checkpoint_id=f"{dcp_dir}/model")
        dcp.save(opt.sharded_state_dict(), checkpoint_id=f"{dcp_dir}/optim")
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    state = max((rel(ours["state"][k][key], t) for k, entry in theirs["state"].items()
                 for key, t in entry.items() if isinstance(t, torch.Tensor) and t.dim()),
                default=0.0)  # fmt: skip
    same_keys = ({k: sorted(e) for k, e in ours["state"].items()}
                 == {k: sorted(e) for k, e in theirs["state"].items()})  # fmt: skip
    return {"loss": worst_loss, "params": worst, "memory": fs.memory(), "state": state,
            "same_keys": same_keys, "saved": _bytes((ours, whole)), "freed": freed,
            "no_grads": no_grads, "clipped": clipped}


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _step(net: nn.Module, opt: Any, comm, t: int, dtype: torch.dtype = torch.float32) -> float:
    x, y = batch(t)
    xs = torch.tensor_split(x, comm.world)[comm.rank]
    ys = torch.tensor_split(y, comm.world)[comm.rank]
    logits = net(xs).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ys.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def resume(comm, saved: bytes, first: int, steps: int = 3, clip: float | None = None) -> dict:
    """Load a saved (optimizer state dict, whole model) into a fully sharded model at this
    world size, train ``steps`` more steps (from step ``first``), and the same from the same
    state with torch.optim.AdamW on one process: the worst relative error of the parameters."""
    opt_state, weights = torch.load(io.BytesIO(saved), weights_only=False)
    net, ref = model(), model()
    ref.load_state_dict(weights)
    fs = coconet.fsdp.fully_shard(net, comm=comm)
    extra = {} if clip is None else {"max_grad_norm": clip}
    opt = coconet.optim.AdamW(groups(net, 0.1), lr=1e-2, betas=(0.8, 0.9), comm=comm,
                              options=EAGER, **extra)  # fmt: skip
    fs.load_state_dict(weights)
    opt.load_state_dict(opt_state)
    ref_opt = torch.optim.AdamW(groups(ref, 0.1), lr=1e-2, betas=(0.8, 0.9))
    ref_opt.load_state_dict(opt_state)
    for t in range(first, first + steps):
        _step(net, opt, comm, t)
        reference_step(ref, ref_opt, comm.world, t, clip)
    whole = fs.state_dict()
    return {"params": max(rel(whole[k], v) for k, v in ref.state_dict().items())}


def dcp_resume(comm, dcp_dir: str, saved: bytes, first: int, steps: int = 3) -> dict:
    """Load a distributed checkpoint of the slices (saved at another world size) into a fully
    sharded model and its optimizer, train ``steps`` more steps, and the same from the
    gathered state saved alongside with torch.optim.AdamW on one process."""
    import torch.distributed.checkpoint as dcp

    opt_state, weights = torch.load(io.BytesIO(saved), weights_only=False)
    net, ref = model(seed=1), model()  # (another initialisation: the checkpoint replaces it)
    ref.load_state_dict(weights)
    fs = coconet.fsdp.fully_shard(net, comm=comm)
    opt = coconet.optim.AdamW(groups(net, 0.1), lr=5e-2, betas=(0.8, 0.9), comm=comm,
                              options=EAGER)  # fmt: skip
    sd = fs.sharded_state_dict()
    dcp.load(sd, checkpoint_id=f"{dcp_dir}/model")
    fs.load_sharded_state_dict(sd)
    osd = opt.sharded_state_dict()
    dcp.load(osd, checkpoint_id=f"{dcp_dir}/optim")
    opt.load_state_dict(osd)
    lr = opt.param_groups[0]["lr"]
    ref_opt = torch.optim.AdamW(groups(ref, 0.1), lr=1e-2, betas=(0.8, 0.9))
    ref_opt.load_state_dict(opt_state)
    for t in range(first, first + steps):
        _step(net, opt, comm, t)
        reference_step(ref, ref_opt, comm.world, t)
    whole = fs.state_dict()
    return {"params": max(rel(whole[k], v) for k, v in ref.state_dict().items()), "lr": lr}


def torch_state(steps: int = 4) -> bytes:
    """A state dict of torch.optim.AdamW on one process (the reference's arithmetic at world
    2) and its model, after ``steps`` steps: what ``resume`` loads."""
    ref = model()
    opt = torch.optim.AdamW(groups(ref, 0.1), lr=1e-2, betas=(0.8, 0.9))
    for t in range(steps):
        reference_step(ref, opt, 2, t)
    return _bytes((opt.state_dict(), ref.state_dict()))


def like_unsharded(comm, dtype: str = "bfloat16", steps: int = 4) -> dict:
    """The same model fully sharded and not, each with coconet.optim.AdamW, on the same
    batches: the worst relative difference of the parameters and of the state (the two run
    the same program, one sliced: ``fuse_RS_C`` against ``fuse_RS_C_AG``)."""
    dt = getattr(torch, dtype)
    a, b = model().to(dt), model().to(dt)
    fs = coconet.fsdp.fully_shard(a, comm=comm)
    kw = {"lr": 1e-2, "comm": comm, "options": EAGER}
    opt_a = coconet.optim.AdamW(groups(a, 0.1), **kw)
    opt_b = coconet.optim.AdamW(groups(b, 0.1), **kw)
    for t in range(steps):
        _step(a, opt_a, comm, t)
        _step(b, opt_b, comm, t)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    state = max(rel(sa["state"][k][key], t) for k, e in sb["state"].items()
                for key, t in e.items() if isinstance(t, torch.Tensor) and t.dim())  # fmt: skip
    whole = fs.state_dict()
    params = max(rel(whole[k], v) for k, v in b.state_dict().items())
    return {"params": params, "state": state, "keys": sorted(next(iter(sa["state"].values())))}


def dies(comm, victim: int, where: str) -> dict:
    """``victim`` kills itself in its second step, at ``where`` ("gather": a block's
    all_gather in the forward; "update": the commit vote of a block's fused update in the
    backward). The others must get a RuntimeFault within the timeout, and every slice of
    theirs be as it was before the step or after it (the blocks stepped before the death are
    a step ahead, the others as they were)."""
    import os
    import signal
    import time

    from coconet.errors import RuntimeFault

    net = model()
    fs = coconet.fsdp.fully_shard(net, comm=comm)
    opt = coconet.optim.AdamW(net.parameters(), lr=1e-2, comm=comm, options=EAGER)
    _step(net, opt, comm, 0)
    before = [seg.shard.clone() for b in fs.blocks for seg in b.segments]
    if comm.rank == victim:
        if where == "gather":
            real_gather = comm.all_gather_start
            calls = [0]

            def gather(*a, **k):
                calls[0] += 1
                if calls[0] == 2:  # the second block's gather of the forward
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_gather(*a, **k)

            comm.all_gather_start = gather
        else:
            real_agree = comm.agree_max
            votes = [0]

            def agree(values, label, op="handshake"):
                if op == "commit vote":
                    votes[0] += 1
                    if votes[0] == 2:  # the second block's update of the backward
                        os.kill(os.getpid(), signal.SIGKILL)
                return real_agree(values, label, op)

            comm.agree_max = agree
    t0 = time.perf_counter()
    try:
        _step(net, opt, comm, 1)
        return {"status": "no error"}
    except RuntimeFault as e:
        after = [seg.shard for b in fs.blocks for seg in b.segments]
        changed = [not torch.equal(x, y) for x, y in zip(before, after, strict=True)]
        return {"status": "fault", "message": str(e), "seconds": time.perf_counter() - t0,
                "changed": changed}  # fmt: skip


def refusals(comm) -> dict:
    """What the optimizer refuses over fully sharded parameters, and a backward without one."""
    from coconet.errors import ConfigError

    out = {}

    def attempt(label, fn):
        try:
            fn()
            out[label] = "no error"
        except ConfigError as e:
            out[label] = str(e)

    net = model()
    coconet.fsdp.fully_shard(net, comm=comm)
    plain = nn.Linear(2, 2)
    attempt("mixed", lambda: coconet.optim.AdamW([*net.parameters(), *plain.parameters()],
                                                 comm=comm))  # fmt: skip
    attempt("lamb", lambda: coconet.optim.LAMB(net.parameters(), comm=comm))
    attempt("twice", lambda: coconet.fsdp.fully_shard(net, comm=comm))
    x, y = batch(0)
    attempt("no optimizer", lambda: loss_of(net, x[:2], y[:2]).backward())
    attempt("different models", lambda: coconet.fsdp.fully_shard(
        Tiny(layers=3 if comm.rank == 0 else 2), comm=comm))
    # a forward inside gathered() keeps every block whole, and they are freed after it
    from coconet.fsdp.blocks import Unsharded

    other = model()
    fs = coconet.fsdp.fully_shard(other, comm=comm)
    with torch.no_grad(), fs.gathered():
        inside = loss_of(other, x[:2], y[:2]).item()
        whole = all(b.state is Unsharded.WHOLE for b in fs.blocks)
    with torch.no_grad():
        outside = loss_of(other, x[:2], y[:2]).item()
    out["gathered"] = {"whole": whole, "same": inside == outside,
                       "freed": all(b.state is Unsharded.FREED for b in fs.blocks)}
    return out


def accumulated(comm, micro: int = 3, steps: int = 3, clip: float | None = None) -> dict:
    """``update_in_backward=False``: each step ``micro`` backwards of a share of the batch
    (``loss / micro``), then ``opt.step()``; the reference averages the same micro-batches'
    gradients over the ranks (DDP's ``no_sync`` accumulation). The parameters' worst error."""
    net, ref = model(), model()
    fs = coconet.fsdp.fully_shard(net, comm=comm, update_in_backward=False)
    extra = {} if clip is None else {"max_grad_norm": clip}
    opt = coconet.optim.AdamW(groups(net, 0.1), lr=1e-2, comm=comm, options=EAGER, **extra)
    ref_opt = torch.optim.AdamW(groups(ref, 0.1), lr=1e-2)
    world = comm.world
    for t in range(steps):
        x, y = batch(t)
        for k in range(micro):  # this rank's share of micro-batch k
            xs = torch.tensor_split(torch.tensor_split(x, micro)[k], world)[comm.rank]
            ys = torch.tensor_split(torch.tensor_split(y, micro)[k], world)[comm.rank]
            (loss_of(net, xs, ys) / micro).backward()
        opt.step()
        opt.zero_grad()
        shares = [(torch.tensor_split(torch.tensor_split(x, micro)[k], world)[r],
                   torch.tensor_split(torch.tensor_split(y, micro)[k], world)[r], micro)
                  for k in range(micro) for r in range(world)]  # fmt: skip
        _averaged_step(ref, ref_opt, shares, world, clip)
    whole = fs.state_dict()
    return {"params": max(rel(whole[k], v) for k, v in ref.state_dict().items())}


def compiled_blocks(comm, steps: int = 3) -> dict:
    """The same fully sharded model eager and with each layer ``compile()``d (the gathers
    and frees are graph breaks): the losses of each."""
    from coconet.cache import use_inductor_cache

    # the model's own torch.compile is the user's: Inductor's FX-graph cache is not keyed by
    # ATEN_CPU_CAPABILITY (a run with =default would load the native run's vectorized C++),
    # so it is keyed as coconet keys its fused kernels (as tests/support/nn_workers.py does)
    use_inductor_cache()
    out = {}
    for compiled in (False, True):
        net = model()
        coconet.fsdp.fully_shard(net, comm=comm)
        if compiled:
            for layer in net.layers:
                layer.compile()
        opt = coconet.optim.AdamW(groups(net, 0.1), lr=1e-2, comm=comm, options=EAGER)
        out["compiled" if compiled else "eager"] = [_step(net, opt, comm, t) for t in range(steps)]
    return out
