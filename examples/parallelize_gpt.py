"""Tensor parallelism with ``coconet.nn.parallelize`` on a GPT written the nanoGPT way.

The model below is written without coconet in mind: nanoGPT's module names (``transformer.h``,
``attn.c_attn``, ``mlp.c_fc``, ...). ``parallelize`` swaps, by name, each block's attention for
a ``ParallelSelfAttention`` (``n_head / tp`` heads per rank) and its MLP's two linears for a
column-parallel and a row-parallel layer; the embeddings, LayerNorms and the head stay as they
are, the same on every rank. Any torch optimizer then trains it (here ``torch.optim.AdamW``)::

    coconet run --nproc 2 examples/parallelize_gpt.py

Every rank also trains the same model unsplit, on one process's worth of compute, from the same
weights on the same batches: rank 0 prints both losses per step and an ``ok`` line when they
agree to ``--tolerance`` (relative), then how many parameters each rank holds. Exit status 1
otherwise.
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import sys

import torch
import torch.nn.functional as F  # noqa: N812 - torch's convention
from torch import nn

from coconet import runtime
from coconet.nn import parallelize

CORPUS = pathlib.Path(__file__).resolve().parent / "corpus.txt"


class CausalSelfAttention(nn.Module):  # nanoGPT's, without dropout
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806 - nanoGPT's names
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc, self.gelu = nn.Linear(n_embd, 4 * n_embd), nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = CausalSelfAttention(n_embd, n_head), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, block: int = 32):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(256, n_embd), "wpe": nn.Embedding(block, n_embd),
            "h": nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            "ln_f": nn.LayerNorm(n_embd),
        })  # fmt: skip
        self.lm_head = nn.Linear(n_embd, 256, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        return F.cross_entropy(logits.view(-1, 256), targets.view(-1))


# --8<-- [start:plan]
# nanoGPT's names -> the style each becomes (torch's names, plus coconet's "attention")
PLAN = {
    "transformer.h.*.attn": "attention",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}
# --8<-- [end:plan]


def batches(steps: int, batch: int = 4, block: int = 32):
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=gen).tolist()
        yield (torch.stack([data[s : s + block] for s in starts]),
               torch.stack([data[s + 1 : s + block + 1] for s in starts]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args(argv)

    comm = runtime.init()  # joins the job `coconet run` (or torchrun) started
    torch.manual_seed(0)  # the same weights on every rank
    reference = GPT()
    model = parallelize(copy.deepcopy(reference), comm, PLAN)  # in place; returns the model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    if comm.rank == 0:
        kinds = sorted({type(m).__name__ for m in model.modules()
                        if "Parallel" in type(m).__name__})  # fmt: skip
        print(f"parallelized over {comm.world} ranks: {', '.join(kinds)} "
              "(the first step compiles each layer's forward and backward)", flush=True)
        print(f"\n{'step':>4} {'1 process':>10} {'tp':>10}", flush=True)
    worst = 0.0
    for step, (x, y) in enumerate(batches(args.steps), 1):
        loss, ref_loss = model(x, y), reference(x, y)
        for o, value in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            value.backward()
            o.step()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        if comm.rank == 0:
            print(f"{step:>4} {ref_loss.item():>10.5f} {loss.item():>10.5f}", flush=True)
    ok = math.isfinite(worst) and worst <= args.tolerance
    if comm.rank == 0:
        mine = sum(p.numel() for p in model.parameters())
        whole = sum(p.numel() for p in reference.parameters())
        print(f"\nparameters on each rank: {mine:,} of {whole:,}")
        print(f"ok: tensor parallel follows one process ({worst:.1e} <= {args.tolerance:g})"
              if ok else f"FAIL: the losses differ by {worst:.1e} (tolerance {args.tolerance:g})")
    runtime.shutdown(comm, exit_code=0 if ok else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
