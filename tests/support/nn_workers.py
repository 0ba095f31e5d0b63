"""Rank bodies for tests/dist/test_dist_nn.py: coconet.nn layers against torch.nn on one process.

Every rank builds the same torch modules from one seed (the single-process reference) and the
tensor-parallel layers from them (``from_linear``), runs both on the same global inputs and
reports the largest error of each output and gradient, relative to its largest value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coconet.ir.types import slice_bounds
from coconet.nn import ColumnParallelLinear, RowParallelLinear
from coconet.random import dropout_mask


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    return (got.double() - want.double()).abs().max().item() / scale if got.numel() else 0.0


def _part(t: torch.Tensor, dim: int, comm) -> torch.Tensor:
    lo, hi = slice_bounds(t.shape[dim], comm.world, comm.rank)
    return t.narrow(dim, lo, hi - lo)


def layers_vs_torch(comm, dtype_name: str = "float32") -> dict[str, float]:
    dtype = getattr(torch, dtype_name)
    errors: dict[str, float] = {}
    torch.manual_seed(0)
    lin1 = nn.Linear(6, 9, dtype=dtype)  # 9 features over the ranks: uneven on 2 and 4
    lin2 = nn.Linear(9, 6, dtype=dtype)
    x = torch.randn(2, 3, 6, dtype=dtype)
    ct = torch.randn(2, 3, 6, dtype=dtype)

    # column-parallel, output gathered: y and every gradient
    col = ColumnParallelLinear.from_linear(lin1, comm=comm, gather_output=True)
    xa = x.clone().requires_grad_()
    y = col(xa)
    ref_x = x.clone().requires_grad_()
    ref = lin1(ref_x)
    ct9 = torch.randn(2, 3, 9, dtype=dtype)
    (y * ct9).sum().backward()
    (ref * ct9).sum().backward()
    errors["column y"] = _err(y, ref)
    errors["column dx"] = _err(xa.grad, ref_x.grad)
    errors["column dw"] = _err(col.weight.grad, _part(lin1.weight.grad, 0, comm))
    errors["column db"] = _err(col.bias.grad, _part(lin1.bias.grad, 0, comm))
    lin1.zero_grad()

    # row-parallel over the whole input (its part taken inside)
    row = RowParallelLinear.from_linear(lin2, comm=comm, input_is_parallel=False)
    h = torch.randn(2, 3, 9, dtype=dtype)
    ha, ref_h = h.clone().requires_grad_(), h.clone().requires_grad_()
    y, ref = row(ha), lin2(ref_h)
    (y * ct).sum().backward()
    (ref * ct).sum().backward()
    errors["row y"] = _err(y, ref)
    errors["row dx"] = _err(ha.grad, ref_h.grad)
    errors["row dw"] = _err(row.weight.grad, _part(lin2.weight.grad, 1, comm))
    errors["row db"] = _err(row.bias.grad, lin2.bias.grad)
    lin2.zero_grad()

    # the MLP: column -> gelu -> row with dropout and the residual, trained 3 SGD steps
    p = 0.25
    col = ColumnParallelLinear.from_linear(lin1, comm=comm)
    row = RowParallelLinear.from_linear(lin2, comm=comm, dropout=p, seed=5)
    params = [col.weight, col.bias, row.weight, row.bias]
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD([*lin1.parameters(), *lin2.parameters()], lr=0.1)
    for step in range(3):
        xa, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = row(F.gelu(col(xa)), residual=xa)
        keep = dropout_mask(5, step, p, tuple(ct.shape))
        ref_out = torch.where(keep, lin2(F.gelu(lin1(ref_x))) / (1 - p), 0.0) + ref_x
        errors[f"mlp out step {step}"] = _err(out, ref_out)
        opt.zero_grad()
        ref_opt.zero_grad()
        (out * ct).sum().backward()
        (ref_out * ct).sum().backward()
        errors[f"mlp dx step {step}"] = _err(xa.grad, ref_x.grad)
        opt.step()
        ref_opt.step()
    full1, full2 = col.to_full(), row.to_full()
    errors["mlp trained w1"] = _err(full1.weight, lin1.weight)
    errors["mlp trained b1"] = _err(full1.bias, lin1.bias)
    errors["mlp trained w2"] = _err(full2.weight, lin2.weight)
    errors["mlp trained b2"] = _err(full2.bias, lin2.bias)

    # inference: no graph, no dropout in eval mode, inference_mode tensors
    row.eval()
    with torch.inference_mode():
        out = row(F.gelu(col(x)), residual=x)
    errors["mlp eval"] = _err(out, lin2(F.gelu(lin1(x))).detach() + x)
    return errors


def sequence_parallel_vs_torch(comm) -> dict[str, float]:
    """Sequence parallel: each rank holds its part of the sequence (dim 0: [T, B, H]) before
    and after the MLP; all_gather in, reduce_scatter out, and their adjoints in backward."""
    errors: dict[str, float] = {}
    torch.manual_seed(1)
    lin1, lin2 = nn.Linear(4, 6), nn.Linear(6, 4)
    x = torch.randn(5, 2, 4)  # 5 tokens: uneven over 2 ranks
    ct = torch.randn(5, 2, 4)
    col = ColumnParallelLinear.from_linear(lin1, comm=comm, sequence_parallel=True)
    row = RowParallelLinear.from_linear(lin2, comm=comm, sequence_parallel=True)
    mine = _part(x, 0, comm).clone().requires_grad_()
    out = row(F.gelu(col(mine)), residual=mine)
    ref_x = x.clone().requires_grad_()
    ref = lin2(F.gelu(lin1(ref_x))) + ref_x
    (out * _part(ct, 0, comm)).sum().backward()
    (ref * ct).sum().backward()
    errors["sp out"] = _err(out, _part(ref, 0, comm))
    errors["sp dx"] = _err(mine.grad, _part(ref_x.grad, 0, comm))
    errors["sp dw1"] = _err(col.weight.grad, _part(lin1.weight.grad, 0, comm))
    errors["sp dw2"] = _err(row.weight.grad, _part(lin2.weight.grad, 1, comm))
    errors["sp db2"] = _err(row.bias.grad, lin2.bias.grad)
    # the pipeline boundary's form: the whole sequence in (replicated), this rank's slice of the
    # output out (reduce_scatter, bias, the residual's slice), the residual's gradient whole
    whole = x.clone().requires_grad_()
    col = ColumnParallelLinear.from_linear(lin1, comm=comm)
    row = RowParallelLinear.from_linear(lin2, comm=comm, sequence_parallel=True)
    out = row(F.gelu(col(whole)), residual=whole)
    (out * _part(ct, 0, comm)).sum().backward()
    errors["sp whole residual out"] = _err(out, _part(ref, 0, comm))
    # the input is Replicated: its gradient is whole on every rank (the column layer's
    # all_reduce, and the all_gather that is the adjoint of taking the residual's slice)
    errors["sp whole residual dx"] = _err(whole.grad, ref_x.grad)
    errors["sp whole residual dw2"] = _err(row.weight.grad, _part(lin2.weight.grad, 1, comm))
    errors["sp whole residual db2"] = _err(row.bias.grad, lin2.bias.grad)
    return errors


MLP_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
BLOCK_PLAN = {**MLP_PLAN, "transformer.h.*.attn": "attention"}


def attention_vs_torch(comm) -> dict[str, float]:
    """ParallelSelfAttention from a nanoGPT attention: output, gradients, and decoding with a
    KV cache (a prefill, then tokens one by one) equal to the full causal forward."""
    from coconet.nn import ParallelSelfAttention
    from support.nanogpt import CausalSelfAttention, GPTConfig

    errors: dict[str, float] = {}
    torch.manual_seed(2)
    config = GPTConfig(n_head=4, n_embd=16)
    ref = CausalSelfAttention(config)
    attn = ParallelSelfAttention.from_modules(ref.c_attn, ref.c_proj, 4, comm=comm)
    x = torch.randn(2, 7, 16)
    ct = torch.randn(2, 7, 16)
    xa, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, want = attn(xa), ref(ref_x)
    (y * ct).sum().backward()
    (want * ct).sum().backward()
    errors["attn y"] = _err(y, want)
    errors["attn dx"] = _err(xa.grad, ref_x.grad)
    c_attn, c_proj = attn.to_full()
    errors["attn to_full"] = _err(c_attn.weight, ref.c_attn.weight) + _err(
        c_proj.weight, ref.c_proj.weight)  # fmt: skip
    order = attn._order()
    mine = slice(*slice_bounds(48, comm.world, comm.rank))
    errors["attn dw_qkv"] = _err(attn.qkv.weight.grad, ref.c_attn.weight.grad[order][mine])
    with torch.no_grad():
        cache = attn.new_cache()
        steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t : t + 1], cache=cache)
                                                for t in range(4, 7)]  # fmt: skip
        errors["attn decode"] = _err(torch.cat(steps, dim=1), want.detach())
    return errors


def parallelized_gpt_vs_torch(comm, steps: int = 4, plan: str = "mlp") -> dict[str, float]:
    """A nanoGPT-style model with its MLPs parallelized, trained with torch.optim.AdamW next to
    the same model on one process: losses per step and the final weights (gathered)."""
    import copy

    from coconet.nn import parallelize
    from support.nanogpt import GPT, GPTConfig

    torch.manual_seed(3)
    reference = GPT(GPTConfig())
    model = parallelize(copy.deepcopy(reference), comm,
                        BLOCK_PLAN if plan == "block" else MLP_PLAN)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    kinds = {type(m).__name__ for m in model.modules()}
    errors["swapped"] = 0.0 if {"ColumnParallelLinear", "RowParallelLinear"} <= kinds else 1.0
    for step in range(steps):
        idx = torch.randint(0, 32, (2, 16), generator=gen)
        targets = torch.randint(0, 32, (2, 16), generator=gen)
        loss, ref_loss = model(idx, targets), reference(idx, targets)
        errors[f"loss step {step}"] = _err(loss.detach(), ref_loss.detach())
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
    for name, block in enumerate(model.transformer.h):
        ref_block = reference.transformer.h[name]
        errors[f"h.{name}.c_fc"] = _err(block.mlp.c_fc.to_full().weight, ref_block.mlp.c_fc.weight)
        errors[f"h.{name}.c_proj"] = _err(block.mlp.c_proj.to_full().weight,
                                          ref_block.mlp.c_proj.weight)  # fmt: skip
        if plan == "block":
            errors[f"h.{name}.attn"] = _err(block.attn.to_full()[0].weight,
                                            ref_block.attn.c_attn.weight)  # fmt: skip
        else:
            errors[f"h.{name}.attn"] = _err(block.attn.c_attn.weight,
                                            ref_block.attn.c_attn.weight)  # fmt: skip
    return errors


def schedules_vs_torch(comm, fused_kernels: bool = False) -> dict[str, float]:
    """Every paper schedule of the layers (row-parallel forward with bias, dropout and residual;
    column-parallel backward's input-gradient all_reduce) equals torch.nn."""
    from coconet.nn.layers import SCHEDULES

    errors: dict[str, float] = {}
    torch.manual_seed(4)
    lin1, lin2 = nn.Linear(6, 10), nn.Linear(10, 6)
    x, ct = torch.randn(5, 3, 6), torch.randn(5, 3, 6)
    for name in [k for k, v in SCHEDULES.items() if not v.sequence_parallel]:
        col = ColumnParallelLinear.from_linear(lin1, comm=comm, schedule=name,
                                               fused_kernels=fused_kernels)  # fmt: skip
        row = RowParallelLinear.from_linear(lin2, comm=comm, dropout=0.2, seed=9, schedule=name,
                                            fused_kernels=fused_kernels)  # fmt: skip
        xa, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = row(F.gelu(col(xa)), residual=xa)
        keep = dropout_mask(9, 0, 0.2, tuple(ct.shape))
        ref = torch.where(keep, lin2(F.gelu(lin1(ref_x))) / 0.8, 0.0) + ref_x
        (out * ct).sum().backward()
        (ref * ct).sum().backward()
        errors[f"{name} out"] = _err(out, ref)
        errors[f"{name} dx"] = _err(xa.grad, ref_x.grad)
        errors[f"{name} dw1"] = _err(col.weight.grad, _part(lin1.weight.grad, 0, comm))
        errors[f"{name} dw2"] = _err(row.weight.grad, _part(lin2.weight.grad, 1, comm))
        lin1.zero_grad()
        lin2.zero_grad()
    return errors


def sequence_parallel_schedules_vs_torch(comm, tokens: int = 7) -> dict[str, float]:
    """The sequence-parallel schedules (``ol_AG_MM``, ``ol_MM_RS_C``, ``ol_sequence_parallel``,
    ``auto``) on a column -> gelu -> row MLP with dropout and a residual, sequence dim 0,
    ``tokens`` over the ranks (uneven; fewer than the chunks on a rank when short): output, input
    gradient and every weight and bias gradient equal torch.nn; which programs each schedule
    overlapped is reported (every program with its chain, none without)."""
    from coconet.nn.layers import SCHEDULES

    errors: dict[str, float] = {}
    torch.manual_seed(5)
    lin1, lin2 = nn.Linear(6, 10), nn.Linear(10, 6)
    x, ct = torch.randn(tokens, 3, 6), torch.randn(tokens, 3, 6)
    keep = dropout_mask(9, 0, 0.2, tuple(ct.shape))
    from coconet.schedule import paper

    def own(program):  # a user's function: 2 chunks, every chain
        return paper.ol_sequence_parallel(program, chunks=2)

    names = [k for k, v in SCHEDULES.items() if v.sequence_parallel] + ["auto", "own"]
    for name in names:
        schedule = own if name == "own" else name
        col = ColumnParallelLinear.from_linear(lin1, comm=comm, schedule=schedule,
                                               sequence_parallel=True)  # fmt: skip
        row = RowParallelLinear.from_linear(lin2, comm=comm, dropout=0.2, seed=9,
                                            schedule=schedule, sequence_parallel=True)  # fmt: skip
        mine = _part(x, 0, comm).clone().requires_grad_()
        ref_x = x.clone().requires_grad_()
        out = row(F.gelu(col(mine)), residual=mine)
        ref = torch.where(keep, lin2(F.gelu(lin1(ref_x))) / 0.8, 0.0) + ref_x
        (out * _part(ct, 0, comm)).sum().backward()
        (ref * ct).sum().backward()
        errors[f"{name} out"] = _err(out, _part(ref, 0, comm))
        errors[f"{name} dx"] = _err(mine.grad, _part(ref_x.grad, 0, comm))
        errors[f"{name} dw1"] = _err(col.weight.grad, _part(lin1.weight.grad, 0, comm))
        errors[f"{name} db1"] = _err(col.bias.grad, _part(lin1.bias.grad, 0, comm))
        errors[f"{name} dw2"] = _err(row.weight.grad, _part(lin2.weight.grad, 1, comm))
        errors[f"{name} db2"] = _err(row.bias.grad, lin2.bias.grad)
        if name != "auto":
            # forward and backward of both layers: which compiled steps overlap a chain
            steps = [st for layer in (col, row) for st in layer._programs.values()]
            compiled = [c for st in steps for c in (st.forward, *st.backward.values())]
            overlapped = sum("overlap(" in c.source for c in compiled)
            expected = {"ol_AG_MM": 2, "ol_MM_RS_C": 2, "ol_sequence_parallel": 4,
                        "own": 4}[name]
            errors[f"{name} programs overlapped: {overlapped} of 4, expected {expected}"] = float(
                overlapped != expected)
        lin1.zero_grad()
        lin2.zero_grad()
    # a schedule for the other form of layer, or no schedule at all: refused at construction,
    # the fitting names in the hint
    from coconet.errors import ConfigError

    for bad, sp, words in (("MM_AR_C", True, "'ol_AG_MM'"), ("ol_AG_MM", False, "'MM_AR_C'"),
                           ("nope", True, "'ol_sequence_parallel'")):  # fmt: skip
        try:
            ColumnParallelLinear(6, 10, comm=comm, schedule=bad, sequence_parallel=sp)
            errors[f"schedule={bad!r}, sequence_parallel={sp}: not refused"] = 1.0
        except ConfigError as e:
            errors[f"schedule={bad!r}, sequence_parallel={sp}: hint {e.hint!r}"] = float(
                words not in e.hint or e.op != "ColumnParallelLinear")
    return errors


def compiled_model_vs_torch(comm) -> dict[str, float]:
    """torch.compile of a model holding coconet layers, as one graph (``fullgraph=True``: each
    layer call is a custom op, ``coconet.nn.traceable``): forward and x's gradient equal the
    eager single-process model; with ``aot_eager`` (nothing around the layers rewritten) the
    forward and every gradient are the eager coconet model's bits."""
    from coconet.cache import use_inductor_cache

    # The model's own torch.compile is the user's, not coconet's: Inductor's FX-graph cache is
    # not keyed by ATEN_CPU_CAPABILITY (a run with =default loads the native run's vectorized
    # C++ and fails to build it), so key it as coconet keys its fused kernels, as a user who
    # switches capability on one machine must.
    use_inductor_cache()
    torch.manual_seed(0)
    lin1, lin2, ln = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = ln
            self.fc = ColumnParallelLinear.from_linear(lin1, comm=comm)
            self.proj = RowParallelLinear.from_linear(lin2, comm=comm)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(self.ln(x))), residual=x)

    block = Block()
    model = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 3, 8)
    xa, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = model(xa)
    ref = lin2(F.gelu(lin1(ln(ref_x)))) + ref_x
    y.sum().backward()
    ref.sum().backward()
    out = {"compiled y": _err(y, ref), "compiled dx": _err(xa.grad, ref_x.grad)}
    # the same graph without Inductor: every bit the eager coconet model's, on both ranks
    plain = torch.compile(block, fullgraph=True, backend="aot_eager")
    for length in (3, 6):
        x = torch.randn(2, length, 8)
        grads = []
        for run in (block, plain):
            block.zero_grad()
            xi = x.clone().requires_grad_()
            yi = run(xi)
            yi.square().sum().backward()
            grads.append([yi.detach(), xi.grad, block.fc.weight.grad.clone(),
                          block.proj.weight.grad.clone(), block.proj.bias.grad.clone()])
        out[f"aot_eager, length {length}: not the eager bits"] = float(
            not all(torch.equal(a, b) for a, b in zip(*grads, strict=True)))
    return out


def killed_in_backward(comm, victim: int) -> dict:
    """``victim`` dies inside the column-parallel layer's backward (at its input gradient's
    all_reduce); the survivor must get a RuntimeFault within the timeout, its parameters as
    they were."""
    import os
    import signal
    import time

    from coconet.errors import RuntimeFault

    torch.manual_seed(0)
    col = ColumnParallelLinear.from_linear(nn.Linear(6, 8), comm=comm)
    row = RowParallelLinear.from_linear(nn.Linear(8, 6), comm=comm)
    x = torch.randn(2, 6, requires_grad=True)
    row(F.gelu(col(x))).sum().backward()  # a good step first: warm, agreed steps
    before = {k: v.detach().clone() for k, v in (*col.named_parameters(), *row.named_parameters())}
    out = row(F.gelu(col(x)))
    if comm.rank == victim:
        comm.all_reduce_start = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        out.sum().backward()
    except RuntimeFault as e:
        after = dict((*col.named_parameters(), *row.named_parameters()))
        return {"status": "fault", "message": str(e), "seconds": time.perf_counter() - t0,
                "unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    return {"status": "no error"}


def auto_schedule_vs_torch(comm) -> dict[str, float]:
    """schedule="auto": the tuner picks each layer program's schedule at its first call's
    shape; the result equals torch.nn, and the picks are reported."""
    errors: dict[str, float] = {}
    torch.manual_seed(6)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    col = ColumnParallelLinear.from_linear(lin1, comm=comm, schedule="auto")
    row = RowParallelLinear.from_linear(lin2, comm=comm, schedule="auto")
    x, ct = torch.randn(4, 8), torch.randn(4, 8)
    xa, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = row(F.gelu(col(xa)), residual=xa), lin2(F.gelu(lin1(ref_x))) + ref_x
    (out * ct).sum().backward()
    (ref * ct).sum().backward()
    errors["auto out"] = _err(out, ref)
    errors["auto dx"] = _err(xa.grad, ref_x.grad)
    errors["tuned"] = 0.0 if row.tuning else 1.0  # the row forward was tuned
    return errors


# -- dropout of a parallelized attention, copies and saves of a parallelized model -------------


def _attention_reference(attn: nn.Module, x: torch.Tensor, p: float, seeds: tuple[int, int],
                         step: int) -> torch.Tensor:  # fmt: skip
    """nanoGPT's attention on one process (its slow path) with coconet's masks for its two
    dropouts: ``seeds`` = (the probabilities', the output's), drawn at ``step`` over the whole
    ``[B, n_head, T, T]`` probabilities and the ``[B, T, C]`` output."""
    import math

    B, T, C = x.shape
    H = attn.n_head
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    att = torch.softmax(att, dim=-1)
    att = torch.where(dropout_mask(seeds[0], step, p, (B, H, T, T)), att / (1 - p), 0.0)
    y = attn.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
    return torch.where(dropout_mask(seeds[1], step, p, (B, T, C)), y / (1 - p), 0.0)


class _MaskedAttention(nn.Module):
    """A nanoGPT attention module whose forward is ``_attention_reference`` in training (the
    one-process model a parallelized one with attention dropout must equal), its own in eval."""

    def __init__(self, attn: nn.Module, p: float, seeds: tuple[int, int]) -> None:
        super().__init__()
        self.attn, self.p, self.seeds, self.calls = attn, p, seeds, 0

    def forward(self, x):
        if not self.training:
            return self.attn(x)
        self.calls += 1
        return _attention_reference(self.attn, x, self.p, self.seeds, self.calls - 1)


def attention_dropout_vs_reference(comm) -> dict[str, float]:
    """``parallelize`` carries a nanoGPT attention's dropouts over (its flash path's float
    ``dropout``, its slow path's ``attn_dropout`` module, ``resid_dropout``): in training the
    output and the gradients equal one process with the same counter-based masks (each layer its
    own seed, derived from the base seed and its name) over two calls; eval mode equals the
    module; and a whole GPT's train-mode loss equals the one-process
    model's with the same masks (its MLP and embedding dropouts the model's own, torch's
    generator seeded alike), and differs from its loss without dropout."""
    import copy

    from coconet.nn import parallelize
    from coconet.random import derive_seed
    from support.nanogpt import GPT, GPTConfig

    errors: dict[str, float] = {}
    p, base = 0.3, 11
    seeds = (derive_seed(derive_seed(base, "attn"), "attn_dropout"),
             derive_seed(derive_seed(base, "attn"), "resid_dropout"))  # fmt: skip
    for flash in (True, False):
        torch.manual_seed(7)
        ref = GPT(GPTConfig(n_head=4, n_embd=16, dropout=p, flash=flash)).transformer.h[0].attn
        model = parallelize(nn.ModuleDict({"attn": copy.deepcopy(ref)}), comm,
                            {"attn": "attention"}, seed=base)  # fmt: skip
        attn = model["attn"]
        x, ct = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
        for step in range(2):
            xa, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            y, want = attn(xa), _attention_reference(ref, ref_x, p, seeds, step)
            (y * ct).sum().backward()
            (want * ct).sum().backward()
            tag = f"flash={flash} step {step}"
            errors[f"{tag} y"] = _err(y, want)
            errors[f"{tag} dx"] = _err(xa.grad, ref_x.grad)
            mine = slice(*slice_bounds(48, comm.world, comm.rank))
            errors[f"{tag} dw_qkv"] = _err(attn.qkv.weight.grad,
                                           ref.c_attn.weight.grad[attn._order()][mine])
            errors[f"{tag} dw_proj"] = _err(attn.proj.weight.grad,
                                            _part(ref.c_proj.weight.grad, 1, comm))
            model.zero_grad()
            ref.zero_grad()
        model.eval(), ref.eval()
        with torch.no_grad():
            errors[f"flash={flash} eval"] = _err(attn(x), ref(x))

    # a whole GPT: train-mode losses equal the one-process model with the same masks
    torch.manual_seed(3)
    reference = GPT(GPTConfig(n_head=4, n_embd=16, dropout=0.2))
    model = parallelize(copy.deepcopy(reference), comm, BLOCK_PLAN, seed=base)
    for i, block in enumerate(reference.transformer.h):
        name = f"transformer.h.{i}.attn"
        block.attn = _MaskedAttention(block.attn, 0.2, (
            derive_seed(derive_seed(base, name), "attn_dropout"),
            derive_seed(derive_seed(base, name), "resid_dropout")))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 16), generator=gen)
    targets = torch.randint(0, 32, (2, 16), generator=gen)
    for step in range(2):
        torch.manual_seed(100 + step)  # the model's own dropouts: the same draws in both
        loss = model(idx, targets)
        torch.manual_seed(100 + step)
        errors[f"gpt train loss step {step}"] = _err(loss.detach(), reference(idx, targets))
    # what parallelize did before it carried the attention's dropouts over: the same model
    # with them off (its other dropouts on, the same draws) is more than rounding away
    for block in reference.transformer.h:
        block.attn.p = 0.0
    torch.manual_seed(101)
    without = reference(idx, targets)
    errors[f"gpt train loss {loss.item()!r}, without the attention's dropouts "
           f"{without.item()!r}: too close"] = float(
        abs(loss.item() - without.item()) < 1e-4 * abs(without.item()))  # fmt: skip
    model.eval(), reference.eval()
    with torch.no_grad():
        errors["gpt eval loss"] = _err(model(idx, targets), reference(idx, targets))
    return errors


def refusals_of_dropouts(comm) -> dict[str, str]:
    """What ``parallelize`` refuses about dropout, as each rank saw it: torch's generator
    seeded differently on the ranks while the model keeps dropouts of its own (every rank
    refuses)."""
    import copy

    from coconet.errors import ConfigError
    from coconet.nn import parallelize
    from support.nanogpt import GPT, GPTConfig

    torch.manual_seed(3)
    model = GPT(GPTConfig(n_head=4, n_embd=16, dropout=0.1))
    seen: dict[str, str] = {}
    torch.manual_seed(3 + comm.rank)  # nanoGPT's train.py seeds 1337 + rank
    try:
        parallelize(copy.deepcopy(model), comm, BLOCK_PLAN)
        seen["per-rank seeds"] = "not refused"
    except ConfigError as e:
        seen["per-rank seeds"] = str(e)
    torch.manual_seed(3)  # alike: accepted
    parallelize(copy.deepcopy(model), comm, BLOCK_PLAN)
    seen["alike"] = "accepted"
    return seen


def copies_and_saves(comm, directory: str) -> dict[str, float]:
    """A parallelized nanoGPT (dropout on) and its ``copy.deepcopy``: one AdamW step each on the
    same batch gives the same loss and weights, and they stay apart after. ``torch.save`` ->
    ``torch.load`` -> ``coconet.nn.attach`` gives the same losses (train and eval) and gradient
    norm as the model saved; calling the loaded model before ``attach`` and attaching another
    rank's file are refused."""
    import copy
    import os

    from coconet.errors import ConfigError
    from coconet.nn import attach, parallelize
    from support.nanogpt import GPT, GPTConfig

    errors: dict[str, float] = {}
    torch.manual_seed(3)
    model = parallelize(GPT(GPTConfig(n_head=4, n_embd=16, dropout=0.1)), comm, BLOCK_PLAN)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 16), generator=gen)
    targets = torch.randint(0, 32, (2, 16), generator=gen)
    torch.manual_seed(50)
    model(idx, targets).backward()  # compiled steps and dropout counts before the copy
    model.zero_grad()

    twin = copy.deepcopy(model)
    pairs = list(zip(model.parameters(), twin.parameters(), strict=True))
    errors["copy has its own values"] = float(any(a.data_ptr() == b.data_ptr() for a, b in pairs))
    errors["copy shares the group"] = float(
        twin.transformer.h[0].attn.qkv.comm is not model.transformer.h[0].attn.qkv.comm
        or twin.transformer.h[0].attn.qkv.weight.placement.comm is not comm)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    losses = []
    for m, opt in zip((model, twin), opts, strict=True):
        torch.manual_seed(51)
        loss = m(idx, targets)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    errors["copy: loss of a step"] = float(not torch.equal(losses[0], losses[1]))
    errors["copy: weights after a step"] = float(not all(torch.equal(a, b) for a, b in pairs))
    before = [a.detach().clone() for a in model.parameters()]
    torch.manual_seed(52)
    twin(idx, targets).backward()
    opts[1].step()
    errors["copy steps alone"] = float(
        not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        or all(torch.equal(a, b) for a, b in pairs))

    # saved and loaded: each rank its own file
    model.zero_grad()
    path = os.path.join(directory, f"model.rank{comm.rank}.pt")
    torch.save(model, path)
    torch.manual_seed(53)
    train_loss = model(idx, targets)
    train_loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    model.eval()
    with torch.no_grad():
        eval_loss = model(idx, targets)
    loaded = torch.load(path, weights_only=False)
    try:
        loaded(idx, targets)
        errors["called before attach: not refused"] = 1.0
    except ConfigError as e:
        errors["called before attach: the hint"] = float(
            "coconet.nn.attach(model, comm)" not in str(e))
    comm.barrier("saved")  # every rank's file is written
    theirs = torch.load(os.path.join(directory, f"model.rank{1 - comm.rank}.pt"),
                        weights_only=False)  # fmt: skip
    try:
        attach(theirs, comm)
        errors["another rank's file: not refused"] = 1.0
    except ConfigError as e:
        errors["another rank's file: the message"] = float("holds part" not in str(e))
    attach(loaded, comm)
    loaded.train()
    torch.manual_seed(53)
    got = loaded(idx, targets)
    got.backward()
    errors["loaded: train loss"] = float(not torch.equal(got, train_loss))
    errors["loaded: grad norm"] = float(
        not torch.equal(torch.nn.utils.clip_grad_norm_(loaded.parameters(), 1e9), norm))
    loaded.eval()
    with torch.no_grad():
        errors["loaded: eval loss"] = float(not torch.equal(loaded(idx, targets), eval_loss))
    errors["loaded: to_full"] = _err(loaded.transformer.h[1].attn.to_full()[0].weight,
                                     model.transformer.h[1].attn.to_full()[0].weight)
    return errors


def hf_llama_generate(comm) -> dict:
    """A ``transformers`` Llama (small config, random weights: nothing downloaded; grouped
    key/value heads) parallelized with its own plan (``parallelize(model, comm)``): its logits
    against one process, its own ``generate()`` (greedy, KV cache) token for token, what the
    plan left whole, and the refusals (heads that do not divide; a style that computes
    something else)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from coconet.errors import ConfigError
    from coconet.nn import ColumnParallelLinear, RowParallelLinear, parallelize

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)  # fmt: skip
    ref = LlamaForCausalLM(config).eval()
    model = parallelize(copy.deepcopy(ref), comm)
    out: dict = {"left whole": dict(model.coconet_plan_left_whole)}
    kinds = (ColumnParallelLinear, RowParallelLinear)
    out["swapped"] = sorted({type(m).__name__ for m in model.modules() if isinstance(m, kinds)})
    prompt = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out["logits"] = _err(model(prompt).logits, ref(prompt).logits)
        got = model.generate(prompt, max_new_tokens=24, do_sample=False)
        want = ref.generate(prompt, max_new_tokens=24, do_sample=False)
    out["tokens"] = (int((got[:, 7:] == want[:, 7:]).sum()), got[:, 7:].numel())
    refusals = {}
    odd = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=3, num_key_value_heads=3)  # fmt: skip
    torch.manual_seed(0)
    for label, build in {
        "heads": lambda: LlamaForCausalLM(odd),
        "style": lambda: _with_plan(LlamaForCausalLM(config), "packed_colwise"),
        "no plan": lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)),
    }.items():
        try:
            parallelize(build(), comm)
            refusals[label] = "no error"
        except ConfigError as e:
            refusals[label] = str(e)
    out["refusals"] = refusals
    return out


def _with_plan(model, style: str):
    """``model`` whose own plan has ``style`` on its MLPs' gate projections."""
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.gate_proj": style}
    return model
