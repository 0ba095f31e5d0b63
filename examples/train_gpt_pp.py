"""Train ``train_gpt.py``'s GPT pipeline-parallel: its layers in stages, with coconet.pipeline.

The model is cut into ``--pp`` stages: the first holds the embeddings and its share of the
blocks, the last its blocks, the final LayerNorm and the head, the ones between only blocks.
Each rank of the ``pp`` axis builds a ``coconet.pipeline.Pipeline`` over its stage: the batch is
split into ``--micro`` micro-batches, run through a GPipe or 1F1B schedule proven deadlock-free
and matched (every receive pairs with its send in order, shape and dtype) before anything runs,
the activations and their gradients sent point to point between neighbouring stages. Each stage
steps its own ``torch.optim.AdamW``. With ``--tp 2`` every stage is also split tensor-parallel
(``pp x tp`` ranks, the blocks as in ``train_gpt_tp.py``: coconet.nn layers over the ``tp``
axis of a 2-D mesh). The losses must follow one process training the whole model on the whole
batch::

    python examples/train_gpt_pp.py                      # PP = 2, 1F1B, 8 micro-batches
    python examples/train_gpt_pp.py --schedule gpipe
    python examples/train_gpt_pp.py --pp 2 --tp 2        # 4 ranks (oversubscribes 2 cores)

The exit status is non-zero when any step's loss differs from one process's by more than
``--tolerance`` (relative). With ``--tp`` the boundary is the paper's fused one by default
(``--boundary fused``, ``ol_RS_fuse_P2P_C_AG`` in training): the last block of a stage that
sends ends with a reduce_scatter along the tokens instead of an all_reduce, its bias and residual
added to this rank's part alone (``coconet.nn.RowParallelLinear(sequence_parallel=True)`` given
the whole residual), each tp rank sends that part, and the next stage all_gathers the parts
(``Pipeline(slice_over="tp", slice_dim=1)``); gradients go back the same way.
``--boundary sliced`` computes the whole activation and sends a flat 1/tp slice of it (the
unfused ``RS_P2P_C_AG``), ``--boundary whole`` sends whole activations.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - torch's convention
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_gpt  # noqa: E402 - the model, data and reference run of the data-parallel example

from coconet.progress import phase, say  # noqa: E402


class Embed(nn.Module):
    """The first stage's front: token and position embeddings of a batch of byte indices."""

    def __init__(self, net: train_gpt.GPT) -> None:
        super().__init__()
        self.tok, self.pos = net.tok, net.pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class Head(nn.Module):
    """The last stage's back: the final LayerNorm and the head, logits flattened for the loss."""

    def __init__(self, net: train_gpt.GPT) -> None:
        super().__init__()
        self.ln, self.head = net.ln, net.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x)).reshape(-1, 256)


def stage_of(net: train_gpt.GPT, index: int, stages: int) -> nn.Sequential:
    """Stage ``index`` of ``stages``: a contiguous share of the blocks (the first stages take
    one more when they do not divide), the embeddings in front of the first, the head after
    the last."""
    from coconet.ir.types import slice_bounds

    lo, hi = slice_bounds(len(net.blocks), stages, index)
    parts: list[nn.Module] = [Embed(net)] if index == 0 else []
    parts += list(net.blocks[lo:hi])
    if index == stages - 1:
        parts.append(Head(net))
    return nn.Sequential(*parts)


BOUNDARIES = {
    "fused": "each tp rank's 1/{tp} of the tokens from a reduce_scatter (bias and residual on "
    "its part), all_gathered",
    "sliced": "1/{tp} slices of the whole activation, all_gathered",
    "whole": "whole activations",
}


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target.reshape(-1))


@dataclass(frozen=True)
class Run:
    cfg: train_gpt.Config
    pp: int
    tp: int
    micro: int
    schedule: str
    boundary: str = "fused"  # with tp > 1: fused, sliced or whole (the module's docstring)


def ranks(comm, run: Run) -> dict:
    from coconet.pipeline import Pipeline

    torch.set_num_threads(1)
    cfg = run.cfg
    data = train_gpt.corpus()
    net = train_gpt.model(cfg)
    index = comm.mesh.index_in(comm.rank, "pp")
    fused = run.tp > 1 and run.boundary == "fused"
    if run.tp > 1:
        import train_gpt_tp

        from coconet.ir.types import slice_bounds

        # the last block of every stage but the last ends with its part of the tokens
        ends = tuple(slice_bounds(len(net.blocks), run.pp, s)[1] - 1 for s in range(run.pp - 1))
        net = train_gpt_tp.tensor_parallel(net, comm, axis="tp",
                                           scatter_after=ends if fused else ())  # fmt: skip
    # --8<-- [start:pipeline]
    stage = stage_of(net, index, run.pp)
    pipe = Pipeline(stage, comm, micro_batches=run.micro, schedule=run.schedule, axis="pp",
                    activation_shape=(cfg.batch // run.micro, cfg.seq, cfg.d_model),
                    loss_fn=loss_fn, slice_over="tp" if run.boundary != "whole" else None,
                    slice_dim=1 if fused else None)  # fmt: skip
    opt = torch.optim.AdamW(stage.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses, ms = [], []
    for k in range(cfg.steps):
        x, y = train_gpt.batch(data, cfg, k)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        opt.step()
        ms.append((time.perf_counter() - t0) * 1e3)
        if loss is not None:
            losses.append(loss.item())
    # --8<-- [end:pipeline]
    from coconet.pipeline import format_table, peak_activations

    return {"loss": losses, "ms": ms, "stage": index, "peak": peak_activations(pipe.steps),
            "table": format_table(pipe.schedule),
            "parameters": sum(p.numel() for p in stage.parameters())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--boundary", choices=["fused", "sliced", "whole"], default="fused",
                    help="with --tp: each tp rank sends its part of the tokens made by a "
                    "reduce_scatter (fused, the default), a flat 1/tp slice of the whole "
                    "activation (sliced), or the whole activation (whole)")
    ap.add_argument("--d-model", type=int, default=train_gpt.Config.d_model)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=train_gpt.Config.heads)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="relative, on the losses")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.batch % args.micro:
        ap.error(f"--micro {args.micro} must divide --batch {args.batch}")
    if args.layers < args.pp:
        ap.error(f"--layers {args.layers} gives a stage without blocks at --pp {args.pp}")
    if args.heads % args.tp or args.d_model % args.heads:
        ap.error(f"--tp {args.tp} must divide --heads {args.heads}, which must divide "
                 f"--d-model {args.d_model}")  # fmt: skip
    cfg = replace(train_gpt.Config(), steps=args.steps, d_model=args.d_model, layers=args.layers,
                  heads=args.heads, batch=args.batch, world=args.pp * args.tp)  # fmt: skip
    run = Run(cfg, args.pp, args.tp, args.micro, args.schedule, args.boundary)
    from coconet import Mesh
    from coconet.runtime import CommOptions, spawn

    params = sum(p.numel() for p in train_gpt.model(cfg).parameters())
    print(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, {params:,} "
          f"parameters; {args.pp} stages x tp {args.tp}, {args.schedule}, {args.micro} "
          f"micro-batches of {cfg.batch // args.micro}; {cfg.steps} steps"
          + ("" if args.tp == 1 else "; boundary: " + BOUNDARIES[args.boundary].format(
              tp=args.tp)))  # fmt: skip
    t0 = time.perf_counter()
    mesh = Mesh(pp=args.pp, tp=args.tp)
    with phase(f"training on {mesh.size} ranks: each schedule is proven before it runs, the "
               "first step compiles"):  # fmt: skip
        out = spawn(ranks, mesh, run, options=CommOptions(timeout=300), timeout=1800)
    print(f"\nrank 0's view of the schedule (every rank's compute steps, in order):\n"
          f"{out[0]['table']}\n")
    last = next(o for o in out if o["loss"])
    with phase(f"the reference: one process, the whole model and batch, {cfg.steps} steps"):
        ref = train_gpt.single(cfg)
    drift = max(abs(a - b) / abs(b) for a, b in zip(last["loss"], ref, strict=True))
    stages = sorted({o["stage"]: o for o in out}.values(), key=lambda o: o["stage"])
    for o in stages:
        print(f"stage {o['stage']}: {o['parameters']:,} parameters per rank, at most "
              f"{o['peak']} micro-batches' activations held, median step "
              f"{statistics.median(o['ms'][1:] or o['ms']):.1f} ms")
    say("\nlosses per step ('1 process': one process training the whole model on the whole "
        "batch, the reference)")
    print(f"\n{'step':>4} {'1 process':>10} {'pipeline':>10}")
    for k in range(cfg.steps):
        print(f"{k + 1:>4} {ref[k]:>10.5f} {last['loss'][k]:>10.5f}")
    print(f"\nlosses vs one process (max relative): {drift:.1e} (tolerance {args.tolerance:g}); "
          f"wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"losses": {"single": ref, "pipeline": last["loss"]}, "loss_drift": drift,
             "ms": {o["stage"]: o["ms"] for o in stages}, "peak": [o["peak"] for o in stages],
             "pp": args.pp, "tp": args.tp, "schedule": args.schedule},
            indent=1) + "\n")  # fmt: skip
    ok = all(math.isfinite(x) for x in last["loss"]) and drift <= args.tolerance
    say(f"ok: the pipeline's losses follow one process ({drift:.1e} <= {args.tolerance:g})"
        if ok else f"FAIL: the losses left one process's by {drift:.1e} relative (tolerance "
        f"{args.tolerance:g}), or are not finite")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
