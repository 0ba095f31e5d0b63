"""Train ``train_gpt.py``'s GPT tensor-parallel: its blocks split over the ranks with coconet.nn.

Each block's attention becomes a ``coconet.nn.ParallelSelfAttention`` (``heads / tp`` heads per
rank, q/k/v column-parallel, the output projection row-parallel with the residual fused into its
program) and its MLP a ``coconet.nn.ParallelMLP``; the embeddings, LayerNorms and the head stay
as they are, replicated. With ``--dp D`` the mesh is ``dp x tp``: each of the D replicas of
the tensor-parallel model takes its share of every batch, and ``coconet.optim.AdamW`` over the
replica's dp group (``comm.along("dp")``) averages each shard's gradient over the replicas and
updates it (its state sliced over them); with one replica the optimizer is plain
``torch.optim.AdamW`` over each rank's parameters (its shards and the replicated rest). The
losses must follow one process training the same model on the same batches::

    python examples/train_gpt_tp.py                  # TP = 2, 40 steps
    python examples/train_gpt_tp.py --world 4        # TP = 4 (oversubscribes a 2-core machine)
    python examples/train_gpt_tp.py --dp 2           # DP 2 x TP 2: 4 ranks (correctness here)

The exit status is non-zero when any step's loss differs from one process's by more than
``--tolerance`` (relative).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_gpt  # noqa: E402 - the model, data and reference run of the data-parallel example

from coconet.progress import phase, say  # noqa: E402


class TPBlock(nn.Module):
    """``train_gpt.Block`` with its attention and MLP split over the ranks of ``comm``.

    ``scatter_output``: the block ends with this rank's part of the sequence (its MLP's output
    projection reduce_scatters along the tokens, with the bias and the residual added to the
    part alone), for a pipeline stage that sends only its part (``Pipeline(slice_dim=1)``)."""

    def __init__(self, block: train_gpt.Block, comm, axis: str | None = None,
                 scatter_output: bool = False) -> None:  # fmt: skip
        super().__init__()
        from coconet.nn import ParallelMLP, ParallelSelfAttention, RowParallelLinear

        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = ParallelSelfAttention.from_modules(block.qkv, block.proj, block.heads,
                                                       comm=comm, axis=axis)  # fmt: skip
        self.mlp = ParallelMLP.from_modules(block.up, block.down, comm=comm, axis=axis)
        if scatter_output:
            self.mlp.proj = RowParallelLinear.from_linear(block.down, comm=comm, axis=axis,
                                                          sequence_parallel=True,
                                                          sequence_dim=1)  # fmt: skip

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = self.attn(self.ln1(x), cache=cache, residual=x)
        return self.mlp(self.ln2(x), residual=x)


def tensor_parallel(net: train_gpt.GPT, comm, axis: str | None = None,
                    scatter_after: tuple[int, ...] = ()) -> train_gpt.GPT:  # fmt: skip
    """``net`` with every block replaced by its TPBlock over mesh ``axis`` (the whole world for
    None), in place; the blocks numbered in ``scatter_after`` end with this rank's part of the
    sequence."""
    net.blocks = nn.ModuleList(TPBlock(b, comm, axis, scatter_output=i in scatter_after)
                               for i, b in enumerate(net.blocks))  # fmt: skip
    return net


def ranks(comm, cfg: train_gpt.Config) -> dict:
    """One rank of the ``dp x tp`` mesh: its tp group's layers, its dp replica's share of each
    batch; with dp > 1 the optimizer is ``coconet.optim.AdamW`` over the dp group (each shard's
    gradient averaged over its replicas), else ``torch.optim.AdamW``."""
    import coconet.optim

    data = train_gpt.corpus()
    dp = comm.mesh.axis_size("dp")
    replica = comm.mesh.index_in(comm.rank, "dp")
    net = tensor_parallel(train_gpt.model(cfg), comm, axis="tp")
    if dp > 1:
        opt = coconet.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  comm=comm.along("dp"))  # fmt: skip
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    share = cfg.batch // dp
    losses, ms = [], []
    for k in range(cfg.steps):
        x, y = train_gpt.batch(data, cfg, k)
        x, y = (t[replica * share:(replica + 1) * share] for t in (x, y))
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = train_gpt.loss_of(net, x, y)
        loss.backward()
        opt.step()
        ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    shards = sum(p.numel() for b in net.blocks for p in b.parameters()) - sum(
        p.numel() for b in net.blocks for p in (*b.ln1.parameters(), *b.ln2.parameters()))
    return {"loss": losses, "ms": ms, "shard_parameters": shards, "replica": replica}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks (divide heads)")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas of the tensor-parallel model (dp x world ranks)")
    ap.add_argument("--batch", type=int, default=train_gpt.Config.batch,
                    help="sequences per step, over all replicas")
    ap.add_argument("--d-model", type=int, default=train_gpt.Config.d_model)
    ap.add_argument("--layers", type=int, default=train_gpt.Config.layers)
    ap.add_argument("--heads", type=int, default=train_gpt.Config.heads)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="relative, on the losses")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.batch % args.dp:
        ap.error(f"--dp {args.dp} must divide --batch {args.batch}")
    if args.heads % args.world or args.d_model % args.heads:
        ap.error(f"--world {args.world} must divide --heads {args.heads}, which must divide "
                 f"--d-model {args.d_model}")  # fmt: skip
    cfg = replace(train_gpt.Config(), steps=args.steps, d_model=args.d_model, layers=args.layers,
                  heads=args.heads, world=args.world, batch=args.batch)  # fmt: skip
    from coconet import Mesh
    from coconet.runtime import CommOptions, spawn

    params = sum(p.numel() for p in train_gpt.model(cfg).parameters())
    print(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, {params:,} "
          f"parameters; tensor parallel over {cfg.world} ranks"
          + (f" x {args.dp} data-parallel replicas (coconet.optim.AdamW over dp)"
             if args.dp > 1 else "") + f"; {cfg.steps} steps")  # fmt: skip
    t0 = time.perf_counter()
    with phase(f"training on {args.dp * cfg.world} ranks (the first step compiles each "
               "layer's forward and backward steps)"):  # fmt: skip
        out = spawn(ranks, Mesh(dp=args.dp, tp=cfg.world), cfg,
                    options=CommOptions(timeout=300), timeout=1800)  # fmt: skip
    with phase(f"the reference: one process, the same batches, {cfg.steps} steps"):
        ref = train_gpt.single(cfg)
    # the whole batch's loss: the mean of the replicas' (equal shares) losses
    per_replica = {o["replica"]: o["loss"] for o in out}
    res = dict(out[0], loss=[sum(v) / args.dp for v in zip(*per_replica.values(), strict=True)])
    drift = max(abs(a - b) / abs(b) for a, b in zip(res["loss"], ref, strict=True))
    say("\nlosses per step ('1 process': one process training the same model on the same "
        "batches, the reference)")
    print(f"\n{'step':>4} {'1 process':>10} {'tp':>10} {'tp ms':>8}")
    for k in range(cfg.steps):
        note = "   <- compiles each layer's forward and backward steps (once)" if k == 0 else ""
        print(f"{k + 1:>4} {ref[k]:>10.5f} {res['loss'][k]:>10.5f} {res['ms'][k]:>8.1f}{note}")
    print(f"\nlosses vs one process (max relative): {drift:.1e} (tolerance {args.tolerance:g}); "
          f"wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"losses": {"single": ref, "tp": res["loss"]}, "loss_drift": drift,
             "ms": res["ms"], "world": cfg.world}, indent=1) + "\n")  # fmt: skip
    ok = all(math.isfinite(x) for x in res["loss"]) and drift <= args.tolerance
    say(f"ok: the tensor-parallel losses follow one process ({drift:.1e} <= {args.tolerance:g})"
        if ok else f"FAIL: the losses left one process's by {drift:.1e} relative (tolerance "
        f"{args.tolerance:g}), or are not finite")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
