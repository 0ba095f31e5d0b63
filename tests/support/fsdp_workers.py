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


def reference_step(ref: nn.Module, opt: torch.optim.Optimizer, world: int, step: int) -> float:
    """One DDP-equivalent step of ``ref`` on the whole batch: the ranks' gradients averaged."""
    x, y = batch(step)
    total, losses = None, []
    for xs, ys in zip(torch.tensor_split(x, world), torch.tensor_split(y, world), strict=True):
        ref.zero_grad(set_to_none=True)
        loss = loss_of(ref, xs, ys)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in ref.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    for p, g in zip(ref.parameters(), total, strict=True):
        p.grad = g / world
    opt.step()
    return sum(losses) / world


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / max(scale, 1e-30)


def follows_torch(comm, optimizer: str = "AdamW", steps: int = 6, groups_on: bool = True,
                  reshard: bool = True, prefetch: bool | None = None) -> dict:  # fmt: skip
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
    opt = getattr(coconet.optim, optimizer)(params, comm=comm, options=EAGER, **kw)
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
        theirs = reference_step(ref, ref_opt, world, t)
        worst_loss = max(worst_loss, abs(ours - theirs) / abs(theirs))
    whole = fs.state_dict()
    worst = max(rel(whole[k], v) for k, v in ref.state_dict().items())
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    state = max((rel(ours["state"][k][key], t) for k, entry in theirs["state"].items()
                 for key, t in entry.items() if isinstance(t, torch.Tensor) and t.dim()),
                default=0.0)  # fmt: skip
    same_keys = ({k: sorted(e) for k, e in ours["state"].items()}
                 == {k: sorted(e) for k, e in theirs["state"].items()})  # fmt: skip
    return {"loss": worst_loss, "params": worst, "memory": fs.memory(), "state": state,
            "same_keys": same_keys, "saved": _bytes((ours, whole))}


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
