"""A training loop with nanoGPT's structure, ported to coconet.optim as a user ports it.

Karpathy's nanoGPT ``train.py`` has a structure most GPT training scripts share; this example
keeps it and changes only the optimizer (DDP + ``torch.optim.AdamW`` becomes
``coconet.optim.AdamW``), then checks the port against the original on 2 local ranks:

- **two param groups**, as nanoGPT's ``configure_optimizers``: weight decay on every parameter
  of two or more dimensions (matmul weights, embeddings), none on biases and LayerNorm weights;
- **its lr schedule**: linear warm-up, then cosine decay to ``min_lr``, written into every
  group's ``lr`` before each iteration;
- **gradient accumulation** (``--accum`` micro-steps per iteration; DDP synchronises only on the
  last, under ``no_sync`` before it; coconet's buckets accumulate the micro-steps' gradients and
  the step averages them once);
- **gradient clipping** by the global norm (``--clip``, nanoGPT's 1.0): ``clip_grad_norm_``
  before DDP's step; ``max_grad_norm=`` in coconet's, inside its fused step, on the averaged
  gradient as DDP's ``clip_grad_norm_`` sees it (clipping before coconet's step would clip each
  rank's local gradient: the trap issue 25 reported);
- **a checkpoint saved from rank 0** halfway (``optimizer.state_dict()`` on every rank, since
  coconet's state is sliced over them, ``torch.save`` on rank 0 only), then **a resume**: a fresh
  model and optimizer load it and run the second half again.

Three loss curves come out, per iteration: DDP's, coconet's, and coconet's resumed from the
checkpoint (the second half). The exit status is non-zero when coconet's or the resumed losses
leave DDP's by more than ``--tolerance`` (relative, per iteration)::

    python examples/train_like_nanogpt.py                 # 2 ranks, 40 iterations
    python examples/train_like_nanogpt.py --iters 300 --json run.json

Everything else as in ``train_gpt.py``: its GPT, its corpus (``examples/corpus.txt``, bytes);
each rank draws its own batches (nanoGPT's ``get_batch``, seeded per rank and iteration).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_gpt  # noqa: E402 - the model and corpus

from coconet.progress import phase, say  # noqa: E402


@dataclass(frozen=True)
class Run:
    cfg: train_gpt.Config
    iters: int = 40
    accum: int = 4
    micro: int = 2  # sequences per micro-step, per rank
    clip: float = 1.0
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    weight_decay: float = 0.1
    checkpoint: str = ""


def get_lr(run: Run, it: int) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to min_lr over the run."""
    if it < run.warmup:
        return run.learning_rate * (it + 1) / (run.warmup + 1)
    ratio = (it - run.warmup) / max(run.iters - run.warmup, 1)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0)))
    return run.min_lr + coeff * (run.learning_rate - run.min_lr)


def param_groups(net: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's configure_optimizers: decay the >= 2-D parameters, not the rest."""
    params = [p for p in net.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def get_batch(data: torch.Tensor, run: Run, rank: int, it: int, micro: int):
    gen = torch.Generator().manual_seed(1337 + 1000 * rank + 10 * it + micro)
    seq = run.cfg.seq
    starts = torch.randint(0, data.numel() - seq - 1, (run.micro,), generator=gen).tolist()
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    return x, y


def train(run: Run, comm, net: nn.Module, optimizer, first: int, last: int, data, ddp=None,
          save_at: int | None = None) -> tuple[list[float], list[float]]:  # fmt: skip
    """Iterations ``first`` to ``last - 1`` of nanoGPT's loop: the losses (this rank's) and the
    global gradient norms clipping saw (``clip_grad_norm_``'s, ``last_grad_norm``)."""
    import torch.distributed as dist

    model = ddp if ddp is not None else net
    losses, norms = [], []
    for it in range(first, last):
        if save_at is not None and it == save_at:
            state = optimizer.state_dict()  # every rank: coconet's state is sliced over them
            if comm.rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": state, "iter_num": it},
                           run.checkpoint)  # fmt: skip
            dist.barrier()
        lr = get_lr(run, it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(run.accum):
            x, y = get_batch(data, run, comm.rank, it, micro)
            if ddp is not None:
                ddp.require_backward_grad_sync = micro == run.accum - 1  # nanoGPT's no_sync
            loss = train_gpt.loss_of(model, x, y) / run.accum
            total += loss.item()
            loss.backward()
        if ddp is not None and run.clip:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), run.clip).item())
        optimizer.step()
        if ddp is None and run.clip:
            norms.append(optimizer.last_grad_norm.item())
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, norms


def ranks(comm, run: Run) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import coconet.optim

    torch.set_num_threads(1)
    data = train_gpt.corpus()
    half = run.iters // 2
    # the original: DDP + torch.optim.AdamW + clip_grad_norm_
    ref = train_gpt.model(run.cfg)
    ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW(param_groups(ref, run.weight_decay), lr=run.learning_rate,
                                betas=(0.9, 0.95), fused=True)  # fmt: skip
    ddp_losses, ddp_norms = train(run, comm, ref, ref_opt, 0, run.iters, data, ddp=ddp)
    # the port: the same loop, coconet.optim.AdamW (clipping inside its step)
    net = train_gpt.model(run.cfg)
    opt = coconet.optim.AdamW(param_groups(net, run.weight_decay), lr=run.learning_rate,
                              betas=(0.9, 0.95), max_grad_norm=run.clip or None,
                              comm=comm)  # fmt: skip
    ours, norms = train(run, comm, net, opt, 0, run.iters, data, save_at=half)
    # the resume: a fresh model and optimizer from rank 0's checkpoint (every rank reads it)
    saved = torch.load(run.checkpoint, weights_only=False)
    net2 = train_gpt.model(replace(run.cfg, seed=run.cfg.seed + 1))  # other weights: all loaded
    net2.load_state_dict(saved["model"])
    opt2 = coconet.optim.AdamW(param_groups(net2, run.weight_decay), lr=run.learning_rate,
                               betas=(0.9, 0.95), max_grad_norm=run.clip or None,
                               comm=comm)  # fmt: skip
    opt2.load_state_dict(saved["optimizer"])
    resumed, _ = train(run, comm, net2, opt2, saved["iter_num"], run.iters, data)
    out = {}
    for key, losses in (("ddp", ddp_losses), ("coconet", ours), ("resumed", resumed)):
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        out[key] = (t / comm.world).tolist()  # the global batch's loss: the ranks' mean
    out["norms"] = {"ddp": ddp_norms, "coconet": norms}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--accum", type=int, default=4, help="micro-steps per iteration")
    ap.add_argument("--clip", type=float, default=1.0, help="0: no clipping")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=1e-5, help="relative, per iteration")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.iters < 2:
        ap.error("--iters must be at least 2 (a checkpoint halfway, then the resume)")
    from coconet.runtime import CommOptions, spawn

    cfg = replace(train_gpt.Config(), d_model=args.d_model, layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(cfg, iters=args.iters, accum=args.accum, clip=args.clip,
                  checkpoint=str(Path(tmp) / "ckpt.pt"))  # fmt: skip
        params = sum(p.numel() for p in train_gpt.model(cfg).parameters())
        print(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {params:,} parameters in 2 "
              f"groups; 2 ranks, {run.accum} micro-steps of {run.micro} sequences per rank per "
              f"iteration, clip {run.clip:g}; checkpoint at iteration {run.iters // 2}, resumed")
        with phase(f"training on 2 ranks: DDP + torch.optim.AdamW, then the coconet port, "
                   f"then the resume from iteration {run.iters // 2}"):  # fmt: skip
            out = spawn(ranks, 2, run, options=CommOptions(timeout=300), timeout=1800)[0]
    half = args.iters // 2
    drift = max(abs(a - b) / abs(b) for a, b in zip(out["coconet"], out["ddp"], strict=True))
    resumed = max(abs(a - b) / abs(b)
                  for a, b in zip(out["resumed"], out["ddp"][half:], strict=True))  # fmt: skip
    print(f"\n{'iter':>4} {'ddp':>10} {'coconet':>10} {'resumed':>10}")
    for k, loss in enumerate(out["ddp"]):
        again = f"{out['resumed'][k - half]:>10.5f}" if k >= half else f"{'':>10}"
        print(f"{k:>4} {loss:>10.5f} {out['coconet'][k]:>10.5f} {again}")
    print(f"\ncoconet vs DDP (max relative, per iteration): {drift:.1e}; resumed vs DDP: "
          f"{resumed:.1e} (tolerance {args.tolerance:g})")
    norms = out["norms"]
    if args.clip:
        clipped = sum(n > args.clip for n in norms["ddp"])
        apart = max(abs(a - b) / b for a, b in zip(norms["coconet"], norms["ddp"], strict=True))
        print(f"clipping active in {clipped} of {args.iters} iterations; the global gradient "
              f"norm, coconet's max_grad_norm vs clip_grad_norm_ after DDP: {apart:.1e} apart")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"losses": {k: out[k] for k in ("ddp", "coconet", "resumed")},
             "drift": drift, "resumed_drift": resumed, "norms": norms},
            indent=1) + "\n")  # fmt: skip
    ok = all(math.isfinite(x) for x in out["coconet"]) and max(drift, resumed) <= args.tolerance
    worst = max(drift, resumed)
    say(f"ok: the coconet port and its resume follow DDP ({worst:.1e} <= {args.tolerance:g})"
        if ok else f"FAIL: the coconet port left DDP's losses by {worst:.1e} relative "
        f"(tolerance {args.tolerance:g}), or they are not finite")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
