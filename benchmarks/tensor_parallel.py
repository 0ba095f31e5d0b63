"""Tensor parallelism: one GPT block on 2 ranks (TP=2), every contender in one process group.

One pre-LayerNorm GPT block (nanoGPT layout: ``ln_1``, attention ``c_attn`` [q|k|v] and
``c_proj``, residual, ``ln_2``, MLP ``c_fc`` -> exact gelu -> ``c_proj``, residual; default
d_model 1024, 16 heads, MLP 4x, float32), split Megatron-style over 2 local ranks x 1 torch
thread (spawned with ``coconet.runtime.spawn``). Three cases:

- ``a`` prefill: the forward of a batch of ``--batch`` x ``--tokens`` tokens (4 x 128), no grad;
- ``b`` training: forward + backward of the same (input gradient and every weight gradient; no
  optimizer step);
- ``c`` decode: one new token per sequence (``--batch`` of them) with a ``--tokens``-token KV
  cache (the cache is cut back to ``--tokens`` before every step): per-token latency.

Contenders, in alternation (A B C ... A B C ...) after a warm-up, a barrier before each timed
step, the slowest rank's time of each step:

- ``one_process``: the whole block on rank 0, one thread (rank 1 idles): the scaling reference;
- ``dtensor``: torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on
  gloo (separate q, k, v Linears colwise, the output projection rowwise, 16/2 local heads: torch's
  TP tutorial; ``c_fc`` colwise, the MLP's ``c_proj`` rowwise);
- ``megatron_gloo``: hand-written Megatron f/g autograd ops (f: identity forward, all_reduce
  backward; g: all_reduce forward, identity backward) over ``torch.distributed.all_reduce``;
- ``megatron_shm``: the same f/g over coconet's shared-memory transport
  (``Communicator.all_reduce_start`` + ``comm.wait``, no compiled step around it);
- ``megatron_ds``: the same f/g over DeepSpeed's CPU shared-memory ``inference_all_reduce``
  (left out, with the reason, when DeepSpeed or its op is missing);
- ``coconet_nn``: the block built from ``coconet.nn`` layers: ``ParallelSelfAttention`` and
  ``ParallelMLP`` (from nanoGPT's modules, ``from_modules``), each residual folded into the
  layer's output projection, its ``KVCache`` when decoding; the LayerNorms in torch.

Every contender's output (and in ``b`` the input gradient, ``ln_1``'s weight gradient and this
rank's part of ``c_fc``'s weight gradient) is compared, on every rank, with one process on the
same weights and inputs, at its first call and again after the timed steps:
max |diff| / max |reference| <= 1e-4. A contender that disagrees (or
raises) is reported as FAILED and not timed; the exit status is then 1.

Lower bound of each case (printed next to the medians): the block's matmul FLOPs (attention's
two batched matmuls included; backward = 2x forward) at the GEMM rate a ``torch.matmul`` probe
of the block's four weight shapes measures in the same alternation (both ranks at once for the
TP=2 bound, rank 0 alone for one process), plus the bytes the all_reduces move over shared
memory (per rank, per all_reduce of n floats: 4n + 4n/2 + 4n, BENCHMARKS.md's count) and, when
decoding, the KV cache read, at a copy probe's bandwidth. No overlap is assumed (the two ranks
fill the two cores: nothing is free to overlap on).

``--json`` writes every step time, the medians and a ``targets`` list (issue 20's targets: name,
measured ratio of medians from this run, threshold, met); ``--plot`` a PNG (matplotlib).

    python benchmarks/tensor_parallel.py --json benchmarks/results/tensor_parallel.json \\
        --plot benchmarks/results/tensor_parallel.png | tee benchmarks/results/tensor_parallel.txt
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import (  # noqa: E402
    agree_failed,
    deepspeed_available,
    emit,
    loadavg,
    machine,
    remove_deepspeed_segments,
)

CASES = {"a": "prefill", "b": "training", "c": "decode"}
CONTENDERS = ("one_process", "dtensor", "megatron_gloo", "megatron_shm", "megatron_ds",
              "coconet_nn")  # fmt: skip
RTOL = 1e-4  # max |diff| / max |reference|, float32
ONE = "one_process"


# -- the block ------------------------------------------------------------------------------------


class KV:
    """A preallocated KV cache of one attention layer's (local) heads: ``append`` writes the new
    keys/values after the first ``n`` positions and returns the whole filled part."""

    def __init__(self, batch: int, heads: int, t_max: int, head_dim: int) -> None:
        self.k = torch.zeros(batch, heads, t_max, head_dim)
        self.v = torch.zeros(batch, heads, t_max, head_dim)
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        self.k[:, :, self.n : self.n + t] = k
        self.v[:, :, self.n : self.n + t] = v
        self.n += t
        return self.k[:, :, : self.n], self.v[:, :, : self.n]


def heads_of(z: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, T, h * dh] -> [B, h, T, dh] (h: whatever this rank holds)."""
    b, t, _ = z.shape
    return z.view(b, t, -1, head_dim).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    b, h, t, dh = y.shape
    return y.transpose(1, 2).reshape(b, t, h * dh)


def attend(q, k, v, cache: KV | None) -> torch.Tensor:
    """Causal attention of [B, h, T, dh] heads; with a cache, the new keys/values are appended
    first (a prefill into an empty cache is causal; one new token sees every cached one)."""
    causal = True
    if cache is not None:
        first = cache.n == 0
        if not first and q.shape[2] != 1:
            raise ValueError("this benchmark decodes one token at a time")
        k, v = cache.append(k, v)
        causal = first
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Block(nn.Module):
    """The reference: one pre-LayerNorm GPT block, nanoGPT's layout, on one process."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.d, self.heads, self.head_dim = d, heads, d // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, cache: KV | None = None) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).split(self.d, dim=-1)
        y = attend(*(heads_of(z, self.head_dim) for z in (q, k, v)), cache)
        x = x + self.attn_proj(merge_heads(y))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    def new_cache(self, batch: int, t_max: int, world: int = 1) -> KV:
        return KV(batch, self.heads // world, t_max, self.head_dim)


def reference_block(cfg: dict) -> Block:
    """The same weights on every rank (seeded), LayerNorms not at their trivial init."""
    torch.manual_seed(cfg["seed"])
    block = Block(cfg["d_model"], cfg["heads"])
    with torch.no_grad():
        for ln in (block.ln_1, block.ln_2):
            ln.weight.add_(0.1 * torch.randn_like(ln.weight))
            ln.bias.add_(0.1 * torch.randn_like(ln.bias))
    return block


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def head_ordered_c_attn(ref: Block, world: int) -> nn.Linear:
    """``c_attn`` with its output rows reordered [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank r's
    heads' q, k, v together), so that a column-parallel split by rows gives each rank its heads."""
    d = ref.d
    w, b = ref.c_attn.weight.detach(), ref.c_attn.bias.detach()
    rows = []
    for r in range(world):
        lo, hi = r * d // world, (r + 1) * d // world
        for part in range(3):
            rows.append(torch.arange(part * d + lo, part * d + hi))
    order = torch.cat(rows)
    return linear_from(w[order], b[order])


# -- DTensor ---------------------------------------------------------------------------------------


class DTBlock(nn.Module):
    """The block as torch's TP tutorial writes it: separate q, k, v Linears (colwise) and the
    output projection (rowwise); the local head count follows from the local q's width."""

    def __init__(self, ref: Block) -> None:
        super().__init__()
        d = ref.d
        self.head_dim = ref.head_dim
        w, b = ref.c_attn.weight.detach(), ref.c_attn.bias.detach()
        self.q = linear_from(w[:d], b[:d])
        self.k = linear_from(w[d : 2 * d], b[d : 2 * d])
        self.v = linear_from(w[2 * d :], b[2 * d :])
        self.proj = linear_from(ref.attn_proj.weight.detach(), ref.attn_proj.bias.detach())
        self.c_fc = linear_from(ref.c_fc.weight.detach(), ref.c_fc.bias.detach())
        self.mlp_proj = linear_from(ref.mlp_proj.weight.detach(), ref.mlp_proj.bias.detach())
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ln_1.load_state_dict(ref.ln_1.state_dict())
        self.ln_2.load_state_dict(ref.ln_2.state_dict())

    def forward(self, x: torch.Tensor, cache: KV | None = None) -> torch.Tensor:
        h = self.ln_1(x)
        y = attend(*(heads_of(f(h), self.head_dim) for f in (self.q, self.k, self.v)), cache)
        x = x + self.proj(merge_heads(y))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


def dtensor_block(ref: Block, world: int) -> DTBlock:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "proj": RowwiseParallel(), "c_fc": ColwiseParallel(),
            "mlp_proj": RowwiseParallel()}  # fmt: skip
    return parallelize_module(DTBlock(ref), mesh, plan)


# -- Megatron's f and g, hand-written --------------------------------------------------------------


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all_reduce of the gradient backward (in place, as
    Megatron's ``_CopyToModelParallelRegion``)."""

    @staticmethod
    def forward(ctx, x, reduce_):
        ctx.reduce_ = reduce_
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.reduce_(grad.contiguous()), None


class _G(torch.autograd.Function):
    """Megatron's g: all_reduce forward (in place), identity backward."""

    @staticmethod
    def forward(ctx, x, reduce_):
        ctx.mark_dirty(x)
        return reduce_(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MegatronBlock(nn.Module):
    """The block split by hand: q, k, v of this rank's heads in one column-parallel weight, the
    projections row-parallel (their bias added once, after the all_reduce)."""

    def __init__(self, ref: Block, rank: int, world: int, reduce_: Callable) -> None:
        super().__init__()
        d, self.head_dim, self.reduce_ = ref.d, ref.head_dim, reduce_
        lo, hi = rank * d // world, (rank + 1) * d // world
        self.local = hi - lo
        c_attn = head_ordered_c_attn(ref, world)
        rows = slice(3 * lo, 3 * hi)
        p = lambda t: nn.Parameter(t.detach().clone().contiguous())  # noqa: E731
        self.w_qkv, self.b_qkv = p(c_attn.weight[rows]), p(c_attn.bias[rows])
        self.w_proj, self.b_proj = p(ref.attn_proj.weight[:, lo:hi]), p(ref.attn_proj.bias)
        h = 4 * d
        flo, fhi = rank * h // world, (rank + 1) * h // world
        self.w_fc, self.b_fc = p(ref.c_fc.weight[flo:fhi]), p(ref.c_fc.bias[flo:fhi])
        self.w_mlp, self.b_mlp = p(ref.mlp_proj.weight[:, flo:fhi]), p(ref.mlp_proj.bias)
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ln_1.load_state_dict(ref.ln_1.state_dict())
        self.ln_2.load_state_dict(ref.ln_2.state_dict())

    def forward(self, x: torch.Tensor, cache: KV | None = None) -> torch.Tensor:
        r = self.reduce_
        h = _F.apply(self.ln_1(x), r)
        q, k, v = F.linear(h, self.w_qkv, self.b_qkv).split(self.local, dim=-1)
        y = attend(*(heads_of(z, self.head_dim) for z in (q, k, v)), cache)
        x = x + _G.apply(F.linear(merge_heads(y), self.w_proj), r) + self.b_proj
        h = _F.apply(self.ln_2(x), r)
        m = _G.apply(F.linear(F.gelu(F.linear(h, self.w_fc, self.b_fc)), self.w_mlp), r)
        return x + m + self.b_mlp

    def fc_weight(self) -> nn.Parameter:
        return self.w_fc


def gloo_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def shm_reduce(comm) -> Callable:
    from coconet.ir.ops import ReduceOp

    def reduce_(t: torch.Tensor) -> torch.Tensor:
        work = comm.all_reduce_start(t, ReduceOp.SUM, axis=None, donate=True, label="tp")
        out = comm.wait(work)  # donated: the sum lands in t
        if out.data_ptr() != t.data_ptr():
            t.copy_(out)
        return t

    return reduce_


def ds_reduce() -> Callable:
    import deepspeed.comm as ds

    def reduce_(t: torch.Tensor) -> torch.Tensor:
        ds.inference_all_reduce(t)  # in place, float32 SUM
        return t

    return reduce_


# -- coconet.nn ----------------------------------------------------------------------------------


class CoconetBlock(nn.Module):
    """The block from ``coconet.nn`` layers: ``ParallelSelfAttention`` (c_attn's rows ordered by
    head, the attention core on this rank's heads, the output projection's all_reduce, bias and
    residual in its program) and ``ParallelMLP`` (c_fc -> gelu -> c_proj, residual inside)."""

    kind = ("coconet.nn.ParallelSelfAttention(residual=x) + coconet.nn.ParallelMLP(residual=x), "
            "LayerNorms in torch; layer defaults (fused_kernels=False, no schedule)")  # fmt: skip

    def __init__(self, ref: Block, comm) -> None:
        super().__init__()
        import coconet.nn as cnn

        self.ln_1, self.ln_2 = nn.LayerNorm(ref.d), nn.LayerNorm(ref.d)
        self.ln_1.load_state_dict(ref.ln_1.state_dict())
        self.ln_2.load_state_dict(ref.ln_2.state_dict())
        self.attn = cnn.ParallelSelfAttention.from_modules(ref.c_attn, ref.attn_proj, ref.heads,
                                                           comm=comm)  # fmt: skip
        self.mlp = cnn.ParallelMLP.from_modules(ref.c_fc, ref.mlp_proj, comm=comm)

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        x = self.attn(self.ln_1(x), cache=cache, residual=x)
        return self.mlp(self.ln_2(x), residual=x)

    def fc_weight(self) -> torch.Tensor:
        return self.mlp.fc.weight


def cut_cache(cache: Any, length: int) -> None:
    """Back to ``length`` cached tokens (this benchmark's KV or a coconet.nn.KVCache)."""
    if isinstance(cache, KV):
        cache.n = length
    else:
        cache.length = length


# -- the ranks ---------------------------------------------------------------------------------


def flops(cfg: dict, case: str) -> dict:
    """Matmul FLOPs of the whole block (all ranks) for one step of ``case``."""
    d, b, t = cfg["d_model"], cfg["batch"], cfg["tokens"]
    m = b * (1 if case == "c" else t)  # new tokens
    weights = 2 * m * d * (3 * d + d + 4 * d + 4 * d)  # c_attn, attn c_proj, c_fc, mlp c_proj
    keys = t + 1 if case == "c" else t
    # q k^T and att v: 2 * (2 * b * T_q * T_k * d); causal prefill does half the pairs' work in
    # principle, counted whole here as SDPA computes it
    core = 2 * 2 * b * (m // b) * keys * d
    total = weights + core
    if case == "b":
        total *= 3  # backward: two matmuls per forward matmul
    return {"weights": weights * (3 if case == "b" else 1), "total": total}


def all_reduce_floats(cfg: dict, case: str) -> int:
    """Floats all_reduced per rank per step by Megatron's split: 2 all_reduces forward (after
    each row-parallel layer) of [B, T_new, d] and, training, 2 backward (f's)."""
    d, b, t = cfg["d_model"], cfg["batch"], cfg["tokens"]
    m = b * (1 if case == "c" else t)
    return (4 if case == "b" else 2) * m * d


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    rank, world = comm.rank, comm.world
    say = (lambda *a: print("  [rank 0]", *a, file=sys.stderr, flush=True)) if rank == 0 else None
    d, b, t = cfg["d_model"], cfg["batch"], cfg["tokens"]
    ref = reference_block(cfg)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    x = torch.randn(b, t, d, generator=gen)
    dout = torch.randn(b, t, d, generator=gen)
    x_new = torch.randn(b, 1, d, generator=gen)
    wanted = cfg["contenders"]
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    blocks: dict[str, nn.Module] = {}

    def build(name: str, make: Callable[[], nn.Module]) -> None:
        try:
            blocks[name] = make()
        except Exception as exc:  # noqa: BLE001 - reported, the contender left out
            failed[name] = f"setup raised {type(exc).__name__}: {exc}"
            if say:
                say(f"{name}: {traceback.format_exc()}")

    if ONE in wanted:
        blocks[ONE] = ref
    if "dtensor" in wanted:
        build("dtensor", lambda: dtensor_block(ref, world))
    if "megatron_gloo" in wanted:
        build("megatron_gloo", lambda: MegatronBlock(ref, rank, world, gloo_reduce))
    if "megatron_shm" in wanted:
        build("megatron_shm", lambda: MegatronBlock(ref, rank, world, shm_reduce(comm)))
    ds_on = False
    if "megatron_ds" in wanted:
        why = deepspeed_available(world)
        if why:
            skipped["megatron_ds"] = why
        else:
            ds_on = True
            build("megatron_ds", lambda: MegatronBlock(ref, rank, world, ds_reduce()))
    coconet_kind = ""
    if "coconet_nn" in wanted:
        build("coconet_nn", lambda: CoconetBlock(ref, comm))
        if "coconet_nn" in blocks:
            coconet_kind = CoconetBlock.kind
    agree_failed(failed, list(blocks))
    for name in failed:
        blocks.pop(name, None)
    if say:
        say(f"contenders: {', '.join(blocks)}; coconet_nn = {coconet_kind or '-'}")

    # a torch.distributed communicator of the same ranks (collective: made here on every
    # rank), for the backward-overlap probes of the training case
    gloo = None
    if "b" in cfg["cases"] and "coconet_nn" in blocks:
        from coconet.runtime import CommOptions

        gloo = comm.variant(CommOptions(transport="torch.distributed", timeout=120))

    # probes: the block's four weight matmuls (this rank's shapes, and rank 0 alone the whole
    # ones), and a copy (memory bandwidth)
    copy_n = cfg["copy_floats"]
    src, dst = torch.randn(copy_n), torch.empty(copy_n)

    def gemm_probe(m: int, parts: int):
        mats = [torch.randn(m, d), torch.randn(m, 4 * d // parts)]
        ws = [torch.randn(d, 3 * d // parts), torch.randn(d // parts, d),
              torch.randn(d, 4 * d // parts), torch.randn(4 * d // parts, d)]  # fmt: skip
        a_in = [mats[0], mats[0][:, : d // parts].contiguous(), mats[0], mats[1]]

        def run():
            for a, w in zip(a_in, ws, strict=True):
                torch.matmul(a, w)

        fl = 2 * m * sum(w.shape[0] * w.shape[1] for w in ws)
        return run, fl

    results: dict[str, Any] = {"cases": {}, "skipped": skipped, "failed": dict(failed),
                               "coconet_kind": coconet_kind}  # fmt: skip
    for case in cfg["cases"]:
        label = CASES[case]
        if say:
            say(f"case {case} ({label})")
        m = b * (1 if case == "c" else t)
        tp_run, tp_fl = gemm_probe(m, world)
        one_run, one_fl = gemm_probe(m, 1)
        probes: dict[str, tuple[Callable, bool]] = {
            "probe:matmul[tp]": (tp_run, True),
            "probe:matmul[one]": (one_run, rank == 0),
            "probe:copy": (lambda: dst.copy_(src), True),
        }
        if case == "c" and "coconet_nn" in blocks:
            probes.update(call_probes(blocks["coconet_nn"], comm, b, d, world))
        if case == "b" and "coconet_nn" in blocks:
            probes.update(overlap_probes(ref, gloo, x, world))
        # the reference on this rank (untimed), and each contender's step
        caches: dict[str, Any] = {}
        if case == "a":
            with torch.no_grad():
                want = {"out": ref(x)}
        elif case == "b":
            xr = x.clone().requires_grad_(True)
            ref.zero_grad(set_to_none=True)
            ref(xr).backward(dout)
            want = {"out": None, "d_x": xr.grad.clone(), "d_ln_1.weight": ref.ln_1.weight.grad
                    .clone(), "d_c_fc.weight": ref.c_fc.weight.grad.clone()}  # fmt: skip
            with torch.no_grad():
                want["out"] = ref(x)
        else:
            with torch.no_grad():
                cache = ref.new_cache(b, t + 1)
                ref(x, cache)
                want = {"out": ref(x_new, cache)}
        steps: dict[str, tuple[Callable, Callable, bool]] = {}
        for name, block in blocks.items():
            runs_here = name != ONE or rank == 0
            steps[name] = make_step(case, name, block, ref, x, dout, x_new, cfg, caches, world) + (
                runs_here,
            )
        # the check: each contender's first call against the reference
        checks: dict[str, dict] = {}
        first: dict[str, float] = {}
        bad: dict[str, str] = {}
        for name, (prepare, step, here) in steps.items():
            try:
                prepare()
                dist.barrier()
                t0 = time.perf_counter()
                got = step() if here else None
                first[name] = time.perf_counter() - t0
                if got is None:
                    got = step()  # one_process on rank 1: checked too, untimed
                checks[name] = compare(got, want, blocks[name], rank, world, d)
            except Exception as exc:  # noqa: BLE001 - reported, the contender not timed
                bad[name] = f"raised {type(exc).__name__}: {exc}"
                if say:
                    say(f"{name} ({label}): {traceback.format_exc()}")
        agree_failed(bad, list(steps))
        # a wrong result on any rank: failed, not timed
        worst = torch.tensor([checks.get(n, {}).get("max_rel_err", math.inf) for n in steps],
                             dtype=torch.float64)  # fmt: skip
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        for name, err in zip(steps, worst.tolist(), strict=True):
            if name not in bad and not err <= RTOL:
                bad[name] = f"wrong result: max rel err {err:.2e} > {RTOL:g} ({checks[name]})"
        timed = [(n, s) for n, s in steps.items() if n not in bad]
        timed += [(n, (lambda: None, fn, here)) for n, (fn, here) in probes.items()]
        n_steps = cfg["decode_steps"] if case == "c" else cfg["steps"]
        times = torch.zeros(len(timed), n_steps, dtype=torch.float64)
        if say:
            say(f"  {cfg['warmup']} warm-up rounds, then {n_steps} timed rounds of "
                f"{len(timed)} (incl. probes)")  # fmt: skip
        for r in range(cfg["warmup"] + n_steps):
            for i, (_name, (prepare, step, here)) in enumerate(timed):
                prepare()
                dist.barrier()
                t0 = time.perf_counter()
                if here:
                    step()
                dt = time.perf_counter() - t0
                if r >= cfg["warmup"]:
                    times[i, r - cfg["warmup"]] = dt
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank, step by step
        # checked again after the timed steps (the state a step leaves: caches, gradients)
        last = []
        for name, (prepare, step, _here) in steps.items():
            err = math.inf
            if name not in bad:
                prepare()
                err = compare(step(), want, blocks[name], rank, world, d)["max_rel_err"]
            last.append(err)
        last_t = torch.tensor(last, dtype=torch.float64)
        dist.all_reduce(last_t, op=dist.ReduceOp.MAX)
        for name, err in zip(steps, last_t.tolist(), strict=True):
            if name not in bad and not err <= RTOL:
                bad[name] = f"wrong result after the timed steps: max rel err {err:.2e}"
        worst = torch.maximum(worst, last_t)
        first_t = torch.tensor([first.get(n, 0.0) for n in steps], dtype=torch.float64)
        dist.all_reduce(first_t, op=dist.ReduceOp.MAX)
        results["cases"][case] = {
            "times_s": {n: times[i].tolist() for i, (n, _) in enumerate(timed)},
            "first_call_s": dict(zip(steps, first_t.tolist(), strict=True)),
            "errors": {n: {k: v for k, v in c.items()} for n, c in checks.items()},
            "max_rel_err": dict(zip(steps, worst.tolist(), strict=True)),
            "failed": bad,
            "probe_flops": {"probe:matmul[tp]": tp_fl, "probe:matmul[one]": one_fl},
        }
    if ds_on:
        dist.barrier()  # every rank is done with DeepSpeed's workspace
        if rank == 0:
            results["removed"] = remove_deepspeed_segments()
    results["threads"] = torch.get_num_threads()
    return results


CALLS = 20  # layer calls per timed step of the per-call probes


def call_probes(block: CoconetBlock, comm, b: int, d: int, world: int) -> dict:
    """What one coconet.nn layer call costs at decode size: ``CALLS`` calls of the block's
    attention output projection (a RowParallelLinear, [b, 1, d/2] -> [b, 1, d], no grad) against
    the same matmul + coconet's bare shared-memory all_reduce + bias (megatron_shm's way), and
    of its MLP's first linear (a ColumnParallelLinear, [b, 1, d] -> [b, 1, 2d], no grad: a step
    that communicates nothing) against ``F.linear`` with its part of the weight and bias."""
    row, col = block.attn.proj, block.mlp.fc
    xin = torch.randn(b, 1, d // world)
    xcol = torch.randn(b, 1, d)
    reduce_ = shm_reduce(comm)

    def coconet_column_calls():
        with torch.no_grad():
            for _ in range(CALLS):
                col(xcol)

    def linear_calls():
        with torch.no_grad():
            for _ in range(CALLS):
                F.linear(xcol, col.weight, col.bias)

    def coconet_calls():
        with torch.no_grad():
            for _ in range(CALLS):
                row(xin)

    def bare_calls():
        with torch.no_grad():
            for _ in range(CALLS):
                reduce_(F.linear(xin, row.weight)).add_(row.bias)

    return {"probe:call[coconet.nn RowParallelLinear]": (coconet_calls, True),
            "probe:call[F.linear + shm all_reduce + bias]": (bare_calls, True),
            "probe:call[coconet.nn ColumnParallelLinear]": (coconet_column_calls, True),
            "probe:call[F.linear, its part]": (linear_calls, True)}  # fmt: skip


def overlap_probes(ref: Block, gloo, x: torch.Tensor, world: int) -> dict:
    """Whether a layer's backward overlaps its communication with its computation: the MLP's
    ``c_fc`` as a ``coconet.nn.ColumnParallelLinear`` over torch.distributed (gloo, whose
    collectives progress on threads of their own), its compiled backward step (the input
    gradient's all_reduce started before the weight-gradient matmul and waited for after it,
    Megatron's asynchronous all_reduce) against its two parts run alone: that all_reduce, and
    the backward's matmuls and bias sum. The step at the parts' sum overlaps nothing; at the
    larger part's time it hides the all_reduce wholly. (Over shared memory a collective
    completes where it starts, on the calling rank's core: with both cores computing there is
    nothing to overlap on.)"""
    import coconet.nn as cnn
    from coconet.ir.ops import ReduceOp

    col = cnn.ColumnParallelLinear.from_linear(ref.c_fc, comm=gloo)
    xr = x.clone().requires_grad_(True)
    d_y = torch.randn(*x.shape[:-1], col.weight.shape[0],
                      generator=torch.Generator().manual_seed(7))  # fmt: skip
    col(xr).backward(d_y)  # compiles the forward and the backward step
    backward = next(iter(col._programs.values())).backward_step(("x", "w", "b"))
    inputs = {"x": x, "w": col.weight.detach(), "b": col.bias.detach(), "d_y": d_y}
    rows, hidden = x.numel() // x.shape[-1], d_y.shape[-1]
    flat_x, flat_dy = x.reshape(rows, -1), d_y.reshape(rows, hidden)
    w = col.weight.detach()

    def step():
        backward(**inputs)

    def all_reduce_alone():
        part = torch.matmul(flat_dy, w)  # what the step all_reduces (timed with it: small)
        gloo.wait(gloo.all_reduce_start(part, ReduceOp.SUM, axis=None, donate=True,
                                        label="probe"))  # fmt: skip

    def compute_alone():
        torch.matmul(flat_dy, w)
        torch.matmul(flat_dy.t(), flat_x)
        flat_dy.sum(0)

    return {"probe:backward[column, gloo]": (step, True),
            "probe:backward parts: all_reduce[gloo]": (all_reduce_alone, True),
            "probe:backward parts: matmuls": (compute_alone, True)}  # fmt: skip


def make_step(case, name, block, ref, x, dout, x_new, cfg, caches, world):
    """(prepare, step) of one contender in one case: prepare is untimed; step returns what the
    check compares (the output; in training also the gradients, read off the block)."""
    b, t = cfg["batch"], cfg["tokens"]
    if case == "a":
        def step():
            with torch.no_grad():
                return {"out": block(x)}

        return (lambda: None), step
    if case == "b":
        box: dict[str, torch.Tensor] = {}

        def prepare():
            block.zero_grad(set_to_none=True)
            box["x"] = x.clone().requires_grad_(True)

        def step():
            out = block(box["x"])
            out.backward(dout)
            return {"out": out, "d_x": box["x"].grad}

        return prepare, step
    # decode: a cache of the t-token prompt (filled once, untimed), cut back to t every step
    with torch.no_grad():
        if name == ONE:
            cache = ref.new_cache(b, t + 1)
        elif isinstance(block, CoconetBlock):
            cache = block.attn.new_cache()
        else:
            cache = ref.new_cache(b, t + 1, world)
        block(x, cache)
    caches[name] = cache

    def prepare():
        cut_cache(cache, t)

    def step():
        with torch.no_grad():
            return {"out": block(x_new, cache)}

    return prepare, step


def fc_weight_grad(block: nn.Module) -> torch.Tensor | None:
    if isinstance(block, Block):
        w = block.c_fc.weight
    elif isinstance(block, DTBlock):
        w = block.c_fc.weight
    else:
        w = block.fc_weight()
    g = w.grad
    if g is not None and hasattr(g, "to_local"):
        g = g.to_local()
    return g


def compare(got: dict, want: dict, block: nn.Module, rank: int, world: int, d: int) -> dict:
    """max |diff| / max |ref| of every compared tensor (and their max)."""
    errs: dict[str, float] = {}

    def err(a: torch.Tensor | None, ref: torch.Tensor) -> float:
        if a is None or hasattr(a, "to_local") or tuple(a.shape) != tuple(ref.shape):
            return math.inf
        return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()

    errs["out"] = err(got["out"].detach(), want["out"])
    if "d_x" in want:
        errs["d_x"] = err(got["d_x"], want["d_x"])
        errs["d_ln_1.weight"] = err(block.ln_1.weight.grad, want["d_ln_1.weight"])
        full = want["d_c_fc.weight"]
        g = fc_weight_grad(block)
        if isinstance(block, Block):
            errs["d_c_fc.weight"] = err(g, full)
        else:
            h = full.shape[0]
            lo, hi = rank * h // world, (rank + 1) * h // world
            errs["d_c_fc.weight (this rank's rows)"] = err(g, full[lo:hi])
    errs["max_rel_err"] = max(errs.values())
    return errs


# -- the report ---------------------------------------------------------------------------------


def summarize(res: dict, cfg: dict) -> dict:
    """Per case: medians of every contender and probe, lower bounds, speedups."""
    out = {}
    world = 2
    for case, c in res["cases"].items():
        rows = {}
        for name, ts in c["times_s"].items():
            ms = [v * 1e3 for v in ts]
            rows[name] = {"median_ms": statistics.median(ms), "min_ms": min(ms),
                          "max_ms": max(ms)}  # fmt: skip
        if "probe:copy" in rows:
            copy_gbs = 2 * 4 * cfg["copy_floats"] / rows["probe:copy"]["median_ms"] / 1e6
        else:
            copy_gbs = math.nan
        rate_tp = c["probe_flops"]["probe:matmul[tp]"] / rows["probe:matmul[tp]"]["median_ms"] / 1e6
        rate_one = (c["probe_flops"]["probe:matmul[one]"] / rows["probe:matmul[one]"]["median_ms"]
                    / 1e6)  # fmt: skip  (GFLOP/s)
        fl = flops(cfg, case)
        n_ar = all_reduce_floats(cfg, case)
        comm_bytes = 10 * n_ar  # per rank: 4n + 4n/2 + 8n/2 for 2 ranks (BENCHMARKS.md)
        kv = 0
        if case == "c":
            kv = 2 * cfg["batch"] * cfg["tokens"] * cfg["d_model"] * 4  # k and v, every head
        comp_tp = fl["total"] / world / rate_tp / 1e6
        comp_one = fl["total"] / rate_one / 1e6
        bound_tp = comp_tp + (comm_bytes + kv / world) / copy_gbs / 1e6
        bound_one = comp_one + kv / copy_gbs / 1e6
        t1 = rows.get(ONE, {}).get("median_ms")
        for name, row in rows.items():
            if name.startswith("probe:"):
                continue
            bound = bound_one if name == ONE else bound_tp
            row["bound_ms"] = bound
            row["x_bound"] = row["median_ms"] / bound
            row["first_call_s"] = c["first_call_s"].get(name)
            row["max_rel_err"] = c["max_rel_err"].get(name)
            if t1:
                row["speedup_vs_one_process"] = t1 / row["median_ms"]
                if name != ONE:
                    row["scaling_efficiency"] = t1 / (world * row["median_ms"])
        out[case] = {
            "name": CASES[case],
            "rows": rows,
            "failed": c["failed"],
            "errors": c["errors"],
            "lower_bound": {
                "tp_ms": bound_tp, "one_process_ms": bound_one,
                "tp_compute_ms": comp_tp, "one_process_compute_ms": comp_one,
                "communication_ms": comm_bytes / copy_gbs / 1e6,
                "kv_cache_ms": kv / world / copy_gbs / 1e6,
                "matmul_flops_total": fl["total"], "gemm_GFLOPs_tp": rate_tp,
                "gemm_GFLOPs_one": rate_one, "copy_GBps": copy_gbs,
                "all_reduce_floats_per_rank": n_ar, "communication_bytes_per_rank": comm_bytes,
            },  # fmt: skip
        }
    return out


def targets(cases: dict) -> list[dict]:
    """Issue 20's targets, from this run's medians (coconet_nn against each baseline); a target
    whose contenders did not run (or failed) gives an entry with measured None, met False."""
    out = []

    def med(case, name):
        row = cases.get(case, {}).get("rows", {}).get(name)
        return row["median_ms"] if row else None

    def add(case, what, num, den, op, threshold, factor=1.0):
        if case not in cases:
            return
        a, b_ = med(case, num), med(case, den)
        measured = a / (factor * b_) if a and b_ else None
        met = measured is not None and (measured >= threshold if op == ">=" else
                                        measured <= threshold)  # fmt: skip
        out.append({"case": CASES[case], "name": what, "measured": measured, "op": op,
                    "threshold": threshold, "met": met,
                    "ratio": f"{num} / {'2 x ' if factor == 2 else ''}{den}"})  # fmt: skip

    c = "coconet_nn"
    add("b", "training: speedup over dtensor", "dtensor", c, ">=", 1.3)
    add("b", "training: speedup over megatron_shm", "megatron_shm", c, ">=", 1.1)
    add("b", "training: TP=2 scaling efficiency t1/(2 t2)", ONE, c, ">=", 0.85, factor=2)
    add("a", "prefill: speedup over dtensor", "dtensor", c, ">=", 1.5)
    add("a", "prefill: TP=2 scaling efficiency t1/(2 t2)", ONE, c, ">=", 0.85, factor=2)
    add("c", "decode: speedup over dtensor", "dtensor", c, ">=", 2.0)
    add("c", "decode: latency over megatron_ds's", c, "megatron_ds", "<=", 1.2)
    add("c", "decode: speedup over one_process", ONE, c, ">=", 1.6)
    return out


def table(doc: dict) -> str:
    cfg = doc["config"]
    mch = doc["machine"]
    lines = [
        f"tensor_parallel: one GPT block (d_model {cfg['d_model']}, {cfg['heads']} heads, MLP 4x, "
        f"float32, pre-LayerNorm), TP={doc['world_size']}, {doc['world_size']} ranks x "
        f"{cfg['threads']} thread; batch {cfg['batch']} x {cfg['tokens']} tokens",
        f"machine: {mch['cpus']} cpus ({mch['cpu_model']}), torch {mch['torch']}, load average "
        f"{mch['loadavg_before']} before / {mch['loadavg_after']} after; coconet source digest "
        f"{mch['coconet_source_digest']}",
        f"timed: {cfg['steps']} steps ({cfg['decode_steps']} for decode) after {cfg['warmup']} "
        "warm-up rounds and a first call, in alternation, a barrier before each, slowest rank",
        f"coconet_nn = {doc['coconet_kind'] or '-'}",
    ]
    for name, why in doc["skipped"].items():
        lines.append(f"left out {name}: {why}")
    for name, why in doc["failed"].items():
        lines.append(f"FAILED {name} (setup): {why}")
    for case, c in doc["cases"].items():
        lb = c["lower_bound"]
        lines += [
            "",
            f"({case}) {c['name']}: {case_words(case, cfg)}",
            f"{'contender':<16} {'median ms':>10} {'min':>9} {'max':>9} {'1proc/this':>10} "
            f"{'scaling':>8} {'x bound':>8} {'first call':>10}  {'max rel err':>11}",
        ]
        for name, r in c["rows"].items():
            if name.startswith("probe:"):
                continue
            sp = f"{r['speedup_vs_one_process']:.2f}x" if "speedup_vs_one_process" in r else ""
            sc = f"{r['scaling_efficiency']:.2f}" if "scaling_efficiency" in r else ""
            first = f"{r['first_call_s']:.2f} s" if r.get("first_call_s") is not None else ""
            lines.append(
                f"{name:<16} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['max_ms']:>9.3f} "
                f"{sp:>10} {sc:>8} {r['x_bound']:>7.2f}x {first:>10}  {r['max_rel_err']:>11.1e}"
            )
        for name, why in c["failed"].items():
            lines.append(f"{name:<16} FAILED, not timed: {why}")
        lines.append(f"{'probe (same alternation)':<44} {'median ms':>10} {'min':>9} {'max':>9}")
        for name, r in c["rows"].items():
            if name.startswith("probe:"):
                lines.append(f"{name:<44} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} "
                             f"{r['max_ms']:>9.3f}")  # fmt: skip
        back = c["rows"].get("probe:backward[column, gloo]")
        parts = [c["rows"].get(f"probe:backward parts: {p}") for p in ("all_reduce[gloo]",
                                                                        "matmuls")]  # fmt: skip
        if back and all(parts):
            ar, mm = (p["median_ms"] for p in parts)
            hidden = (ar + mm - back["median_ms"]) / ar if ar else math.nan
            lines.append(
                f"backward overlap (c_fc's backward on gloo): the step {back['median_ms']:.3f} ms,"
                f" its all_reduce alone {ar:.3f} + its matmuls alone {mm:.3f} = {ar + mm:.3f} "
                f"ms: {100 * hidden:.0f}% of the all_reduce hidden"
            )
        cc_call = c["rows"].get("probe:call[coconet.nn RowParallelLinear]")
        bare_call = c["rows"].get("probe:call[F.linear + shm all_reduce + bias]")
        if cc_call and bare_call:
            a_us, b_us = (1e3 * r["median_ms"] / CALLS for r in (cc_call, bare_call))
            lines.append(f"per layer call (the probe:call rows are {CALLS} calls): coconet.nn "
                         f"RowParallelLinear {a_us:.1f} us, the same matmul + bare shm all_reduce "
                         f"+ bias {b_us:.1f} us: {a_us - b_us:.1f} us more per coconet.nn call "
                         "(a forward makes 4 layer calls, a backward 4 more)")  # fmt: skip
        cc_col = c["rows"].get("probe:call[coconet.nn ColumnParallelLinear]")
        plain = c["rows"].get("probe:call[F.linear, its part]")
        if cc_col and plain:
            a_us, b_us = (1e3 * r["median_ms"] / CALLS for r in (cc_col, plain))
            lines.append(f"per column-parallel call: coconet.nn ColumnParallelLinear {a_us:.1f} "
                         f"us, F.linear with its part of the weight {b_us:.1f} us: "
                         f"{a_us - b_us:.1f} us more per call (a step that communicates "
                         "nothing, replayed past its second call)")  # fmt: skip
        lines += [
            f"lower bound TP=2 {lb['tp_ms']:.3f} ms = compute {lb['tp_compute_ms']:.3f} ms "
            f"({lb['matmul_flops_total'] / 2e9:.3f} GFLOP per rank at the matmul probe's "
            f"{lb['gemm_GFLOPs_tp']:.1f} GFLOP/s, both ranks at once) + communication "
            f"{lb['communication_ms']:.3f} ms ({lb['communication_bytes_per_rank'] / 2**20:.2f} "
            f"MiB per rank at the copy probe's {lb['copy_GBps']:.2f} GB/s)"
            + (f" + KV cache read {lb['kv_cache_ms']:.3f} ms" if case == "c" else ""),
            f"lower bound one process {lb['one_process_ms']:.3f} ms = "
            f"{lb['matmul_flops_total'] / 1e9:.3f} GFLOP at {lb['gemm_GFLOPs_one']:.1f} GFLOP/s "
            "(rank 0 alone)" + (" + the KV cache read" if case == "c" else ""),
        ]
    lines += ["", "correct = every rank's output" + (" (training: also d_x, ln_1.weight's and "
              "this rank's rows of c_fc.weight's gradient)" if "b" in doc["cases"] else "")
              + ", at the first call and after the timed steps, within max|diff|/max|ref| <= "
              f"{RTOL:g} of one process on the same weights and inputs"]  # fmt: skip
    if doc["targets"]:
        lines += ["", "targets (coconet_nn; ratios of medians from this run):"]
        for t in doc["targets"]:
            m = f"{t['measured']:.3f}" if t["measured"] is not None else "n/a"
            lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['name']:<46} "
                         f"{t['ratio']:<32} {m:>7} {t['op']} {t['threshold']}")  # fmt: skip
    wrong = sorted({n for c in doc["cases"].values() for n in c["failed"]} | set(doc["failed"]))
    if wrong:
        lines += ["", "!" * 78, f"!!! FAILED: {', '.join(wrong)} (see above)", "!" * 78]
    return "\n".join(lines)


def case_words(case: str, cfg: dict) -> str:
    b, t = cfg["batch"], cfg["tokens"]
    return {
        "a": f"forward of {b} x {t} tokens, no grad",
        "b": f"forward + backward of {b} x {t} tokens (no optimizer step)",
        "c": f"one new token for each of {b} sequences, {t}-token KV cache (per-token latency)",
    }[case]


def plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written "
              "(pip install matplotlib to get one)")  # fmt: skip
        return
    cases = doc["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.6 * len(cases), 4.2), squeeze=False)
    colors = {ONE: "tab:gray", "dtensor": "tab:orange", "megatron_gloo": "tab:brown",
              "megatron_shm": "tab:olive", "megatron_ds": "tab:purple",
              "coconet_nn": "tab:blue"}  # fmt: skip
    for ax, (case, c) in zip(axes[0], cases.items(), strict=True):
        rows = [(n, r) for n, r in c["rows"].items() if not n.startswith("probe:")]
        names = [n for n, _ in rows]
        med = [r["median_ms"] for _, r in rows]
        err = [[r["median_ms"] - r["min_ms"] for _, r in rows],
               [r["max_ms"] - r["median_ms"] for _, r in rows]]  # fmt: skip
        ax.bar(range(len(rows)), med, yerr=err, capsize=3,
               color=[colors.get(n, "tab:green") for n in names])  # fmt: skip
        ax.axhline(c["lower_bound"]["tp_ms"], color="k", linestyle="--", label="TP=2 lower bound")
        ax.axhline(c["lower_bound"]["one_process_ms"], color="k", linestyle=":",
                   label="one-process lower bound")  # fmt: skip
        ax.set_xticks(range(len(rows)), names, rotation=35, ha="right")
        if case == next(iter(cases)):
            ax.set_ylabel("ms per step (median, min-max bars, slowest rank)")
        ax.set_title(f"({case}) {c['name']}")
        ax.legend(fontsize=7)
    cfg = doc["config"]
    fig.suptitle(f"one GPT block, d_model {cfg['d_model']}, {cfg['heads']} heads, batch "
                 f"{cfg['batch']} x {cfg['tokens']}: TP=2 on {doc['machine']['cpus']} cores, "
                 "1 thread per rank")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="a,b,c", help="a (prefill), b (training), c (decode)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps for a and b (>= 10)")
    ap.add_argument("--decode-steps", type=int, default=0,
                    help="timed steps for c (>= 10; default 3 x --steps)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds after the first call")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="sequences")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per sequence (decode: cache)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)}")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - set(CASES):
        ap.error(f"--cases: choose from {','.join(CASES)}")
    decode_steps = args.decode_steps or 3 * args.steps
    if args.steps < 10 or decode_steps < 10:
        ap.error("--steps and --decode-steps must be at least 10")
    if args.d_model % args.heads or args.heads % 2:
        ap.error("--heads must divide --d-model and be even (2 ranks)")
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CONTENDERS))
    if unknown:
        ap.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")

    from coconet.runtime import CommOptions, spawn

    before = loadavg()
    world = 2
    cfg = {"cases": cases, "steps": args.steps, "decode_steps": decode_steps,
           "warmup": args.warmup, "d_model": args.d_model, "heads": args.heads,
           "batch": args.batch, "tokens": args.tokens, "threads": args.threads,
           "seed": args.seed, "contenders": wanted, "copy_floats": 4 << 20}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="coconet-tp-bench-") as tmp:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the ranks inherit it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        print(f"spawning {world} ranks ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = spawn(worker, world, cfg, options=CommOptions(cache_dir=os.path.join(tmp, "cc"),
                                                            timeout=120),
                    timeout=args.timeout)  # fmt: skip
        wall = time.perf_counter() - t0
    ranks = res
    res = ranks[0]
    cases_doc = summarize(res, cfg)
    doc = {
        "benchmark": "tensor_parallel",
        "machine": machine(before),
        "world_size": world,
        "config": {**cfg, "threads": res["threads"], "dtype": "float32", "rtol": RTOL},
        "coconet_kind": res["coconet_kind"],
        "skipped": res["skipped"],
        "failed": res["failed"],
        "cases": cases_doc,
        "raw_times_s": {c: v["times_s"] for c, v in res["cases"].items()},
        "wall_s": round(wall, 1),
    }
    doc["targets"] = targets(cases_doc)
    if res.get("removed"):
        print(f"removed DeepSpeed's /dev/shm workspace: {', '.join(res['removed'])}")
    emit(doc, table(doc), wall, args.json, plot, args.plot)
    failed = doc["failed"] or any(c["failed"] for c in cases_doc.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
