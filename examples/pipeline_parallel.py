"""A pipeline-parallel boundary with tensor parallelism inside each stage, in the coconet DSL.

The ranks form a 2-D mesh ``Mesh(pp=S, tp=T)``: S pipeline stages of T tensor-parallel ranks.
Each stage ends with a row-parallel matmul whose partial sums are all-reduced inside the stage;
the result goes to the next stage, which adds its bias, applies dropout and adds its residual::

    x: [B, H]  Sliced(dim=1, axis=tp)   per stage: rank t holds columns t of the activations
    w: [H, H2] Sliced(dim=0, axis=tp)   per stage: the matching rows of the stage's weight
    partial = x @ w                                  Local partial sums
    out_sum = all_reduce(partial, axis="tp")         Replicated within the stage
    recv    = send(out_sum, axis="pp")               stage s receives stage s-1's out_sum
    out     = dropout(recv + b, p, seed, step) + r   on the receiving stage (r: its residual)

Stage 0 receives nothing (zeros), so its ``out`` is ``dropout(b) + r``: well defined, and
checked like the others. Schedules (``coconet.schedule``): ``AR_P2P_C`` sends the whole result;
``RS_P2P_C_AG`` reduce-scatters inside the stage, sends each rank's 1/T slice, computes on slices
and all-gathers on the receiving stage, so the pipeline link carries 1/T of the data;
``ol_RS_fuse_P2P_C_AG`` overlaps the reduce_scatter with the fused send/compute/all_gather.

Inputs: ``x``, ``w`` (Sliced over tp, different per stage), ``b`` (Replicated), ``r``
(Replicated over tp, different per stage), int64 scalars ``seed`` and ``step``.
Named nodes: ``partial``, ``out_sum``, ``recv``, ``biased``, ``dropped``, ``out``.

Run ``python examples/pipeline_parallel.py`` to simulate it on a 2x2 and a 2x3 mesh against
plain PyTorch (one full matmul per stage).
"""

from __future__ import annotations

import sys

import torch

import coconet as cc
from coconet.random import dropout_mask
from coconet.schedule import AR_P2P_C, RS_P2P_C_AG, ol_RS_fuse_P2P_C_AG
from coconet.testing import run_distributed

# The all_reduce adds the ranks' partial sums in another order than one matmul does.
TOLERANCE = 1e-5  # max relative error vs plain PyTorch in float32

# The paper's schedules of this boundary (see coconet.schedule), by name.
SCHEDULES = {
    "AR_P2P_C": AR_P2P_C,
    "RS_P2P_C_AG": RS_P2P_C_AG,
    "ol_RS_fuse_P2P_C_AG": ol_RS_fuse_P2P_C_AG,
}

P = 0.1  # dropout probability
MESHES = (cc.Mesh(pp=2, tp=2), cc.Mesh(pp=2, tp=3))


def program(p: float = P, dtype: cc.DType = cc.float32) -> cc.Program:
    """The stage boundary with dropout probability ``p``."""
    B, H, H2 = cc.Dim("B"), cc.Dim("H"), cc.Dim("H2")
    x = cc.Tensor("x", dtype, [B, H], cc.Sliced(1, axis="tp"))
    w = cc.Tensor("w", dtype, [H, H2], cc.Sliced(0, axis="tp"))
    b = cc.Tensor("b", dtype, [H2], cc.Replicated)
    r = cc.Tensor("r", dtype, [B, H2], cc.Replicated("tp"))
    seed = cc.Scalar("seed", cc.int64)
    step = cc.Scalar("step", cc.int64)

    partial = cc.matmul(x, w).named("partial")
    out_sum = cc.all_reduce(partial, axis="tp", name="out_sum")
    recv = cc.send(out_sum, axis="pp", name="recv")
    biased = (recv + b).named("biased")
    dropped = cc.dropout(biased, p, seed, step).named("dropped")
    out = (dropped + r).named("out")
    return cc.Program("pipeline_parallel", [x, w, b, r, seed, step], {"out": out})


def make_inputs(
    mesh: cc.Mesh,
    size: int = 16,
    seed: int = 0,
    step: int = 1,
    dtype: torch.dtype = torch.float32,
    *,
    batch: int = 6,
    out_features: int = 10,
) -> dict:
    """Per-rank inputs: each stage has its own activations, weight and residual.

    ``x`` and ``w`` are given as per-rank slices (rank (s, t) holds slice t of stage s's value),
    ``r`` as per-rank copies of its stage's residual. ``size`` is H.
    """
    gen = torch.Generator().manual_seed(seed)
    stages, tp = mesh.axis_size("pp"), mesh.axis_size("tp")

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    xs = [randn(batch, size) for _ in range(stages)]
    ws = [randn(size, out_features) / size**0.5 for _ in range(stages)]
    rs = [randn(batch, out_features) for _ in range(stages)]
    inputs: dict = {"x": [], "w": [], "r": [], "b": randn(out_features), "seed": seed, "step": step}
    for rank in range(mesh.size):
        c = mesh.coords(rank)
        s, t = c["pp"], c["tp"]
        inputs["x"].append(torch.tensor_split(xs[s], tp, dim=1)[t].clone())
        inputs["w"].append(torch.tensor_split(ws[s], tp, dim=0)[t].clone())
        inputs["r"].append(rs[s].clone())
    inputs["stage_values"] = (xs, ws, rs)  # for the reference only
    return inputs


def program_inputs(inputs: dict) -> dict:
    """The inputs the program takes (without the reference's whole per-stage values)."""
    return {k: v for k, v in inputs.items() if k != "stage_values"}


def reference(inputs: dict, p: float = P) -> list[torch.Tensor]:
    """Plain PyTorch, stage by stage: ``out`` of each stage (index = stage)."""
    xs, ws, rs = inputs["stage_values"]
    b = inputs["b"]
    outs = []
    for s in range(len(xs)):
        recv = xs[s - 1] @ ws[s - 1] if s > 0 else torch.zeros_like(rs[s])
        biased = recv + b
        keep = dropout_mask(inputs["seed"], inputs["step"], p, tuple(biased.shape))
        dropped = torch.where(keep, biased * (1.0 / (1.0 - p)), torch.zeros_like(biased))
        outs.append(dropped + rs[s])
    return outs


def max_relative_error(result: list[torch.Tensor], mesh: cc.Mesh, expect: list[torch.Tensor]):
    worst = 0.0
    for rank, value in enumerate(result):
        ref = expect[mesh.coords(rank)["pp"]]
        err = (value - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        worst = max(worst, err)
    return worst


def check(mesh: cc.Mesh, size: int = 16, program_: cc.Program | None = None) -> float:
    """Max relative error of the simulated program (or a scheduled form of it) vs the reference."""
    inputs = make_inputs(mesh, size)
    result = cc.simulate(program_ or program(), program_inputs(inputs), mesh)
    return max_relative_error(result.output("out"), mesh, reference(inputs))


def main() -> int:
    ok = True
    for mesh in MESHES:
        for size in (16, 7):  # 7: the hidden size does not divide by tp=2 or tp=3
            err = check(mesh, size)
            good = err <= TOLERANCE
            ok &= good
            print(
                f"pipeline_parallel {mesh} H={size}: max relative error {err:.2e} "
                f"({'ok' if good else 'MISMATCH'})"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc 2K` (pp=2, tp=K) or torchrun
        sys.exit(
            run_distributed(
                program(),
                SCHEDULES,
                lambda mesh: program_inputs(make_inputs(mesh, 17)),
                mesh=lambda world: cc.Mesh(pp=2, tp=world // 2),
            )
        )
    sys.exit(main())
