"""Train a small GPT data-parallel on 2 local ranks: ``coconet.optim.AdamW`` against DDP.

Three runs of the same model from the same initial weights on the same batches:

- **coconet**: 2 ranks, each its half of every batch, plain ``loss.backward()`` (no DDP wrapper)
  and ``coconet.optim.AdamW`` (average the gradients, update each rank's slice of the state,
  gather the parameters: one fused collective, over shared memory on one host);
- **ddp**: 2 ranks, ``DistributedDataParallel`` (gloo) + ``torch.optim.AdamW(fused=True)``;
- **single**: one process, the full batch, ``torch.optim.AdamW``: the reference both must follow.

The two data-parallel runs train in alternation, step by step, in one process group (a barrier
before each timed step), so they see the same machine. It prints the three loss curves side by
side, the step times (and the share of DDP's step that is not forward + backward), and writes a
PNG of the curves with ``--plot`` (needs matplotlib). The text it learns is coconet's README as
it stood when the committed results were measured (``examples/corpus.txt``: bytes, a 256-symbol
vocabulary), so nothing is downloaded and the data never changes under the results.

    python examples/train_gpt.py                 # 15-30 s on 2 cores (cold cache: ~1 minute)
    python examples/train_gpt.py --steps 60 --plot losses.png --json run.json
    python examples/train_gpt.py --dtype bfloat16  # the model in bfloat16, float32 masters
    python examples/train_gpt.py --local-sgd 8 --overlap --steps 200 --plot local_sgd.png

With ``--dtype bfloat16`` the model's parameters are bfloat16 (the forward and backward compute
in bfloat16): coconet.optim.AdamW keeps a float32 master copy of each rank's slice; **ddp** is
the usual recipe for it, bfloat16 gradients averaged by DDP and ``torch.optim.AdamW(fused=True)``
stepping a float32 master copy of the parameters, copied back into them after each step; and
**single** is one process doing the same. The runs then differ by bfloat16's roundings (the
reductions' orders differ: DDP's gloo averages in bfloat16) and their trajectories drift apart
step by step (a few percent at single steps after ~50), so the check compares the mean loss
of each window of 10 steps, to 1e-2 relative (one run of 100 steps: coconet within 0.4% of one
process, DDP within 0.7%; ``benchmarks/results/train_gpt_bf16.txt``).

With ``--local-sgd K`` a run of **Local SGD** joins them: each rank steps its own model on its
half of the batch with ``torch.optim.AdamW(fused=True)`` and ``coconet.optim.LocalSGD`` averages
the models after every K-th step; ``--overlap`` adds **Overlap Local-SGD**
(``coconet.optim.OverlapLocalSGD``: each model pulled half way toward an anchor, the next average
travelling while the next K steps run). These are other algorithms, not the same arithmetic:
their losses (each rank's on its half with its own model, averaged over the ranks) are not held
to the reference; the summary gives each one's final loss (the mean of the last 10 steps) over
sync data parallel's (coconet.optim's).

While it runs it says what it is doing (the first step compiles coconet's fused kernels: 10-35 s
on a cold cache), then prints the table, the verdict against DDP ("1.37x faster than DDP") and
an ``ok`` or ``FAIL`` line. The exit status is non-zero when a data-parallel run's losses leave
the reference's by more than ``--tolerance`` (relative; float32 sums in a different order drift
apart slowly over training).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - torch's convention
from torch import nn

from coconet.progress import phase, say

CORPUS = Path(__file__).resolve().parent / "corpus.txt"


@dataclass(frozen=True)
class Config:
    steps: int = 30
    seq: int = 32  # tokens per sequence
    batch: int = 4  # sequences per step, over all ranks (an even split over 2 ranks)
    d_model: int = 256
    layers: int = 3
    heads: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    world: int = 2
    dtype: str = "float32"  # the parameters' (bfloat16: float32 masters in the optimizers)
    fully_shard: bool = False  # a third run: the model fully sharded (coconet.fsdp)
    local_sgd: int = 0  # > 0: a run of Local SGD averaging after every local_sgd-th step
    overlap: bool = False  # and one of Overlap Local-SGD with the same period


def local_runs(cfg: Config) -> tuple[str, ...]:
    """The Local-SGD runs ``cfg`` asks for (keys of the results: ``<run>_loss``, ``<run>_ms``)."""
    if not cfg.local_sgd:
        return ()
    return ("local_sgd", "overlap_local_sgd") if cfg.overlap else ("local_sgd",)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only transformer over bytes."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def model(cfg: Config) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(cfg)


def corpus() -> torch.Tensor:
    text = CORPUS.read_bytes()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batch(data: torch.Tensor, cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``cfg.batch`` random windows (inputs, next bytes)."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    starts = torch.randint(0, data.numel() - cfg.seq - 1, (cfg.batch,), generator=gen)
    x = torch.stack([data[s : s + cfg.seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + cfg.seq + 1] for s in starts.tolist()])
    return x, y


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (the logits of a bfloat16 model widened: the loss in float32)
    return F.cross_entropy(net(x).float().reshape(-1, 256), y.reshape(-1))


class MasterAdamW:
    """``torch.optim.AdamW`` over float32 master copies of 16-bit parameters (the recipe of a
    bfloat16 model without coconet): the 16-bit gradients widened into the masters', the
    masters stepped, the parameters their rounding. For float32 parameters, AdamW itself."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float,
                 fused: bool = False) -> None:  # fmt: skip
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.plain = all(p.dtype == torch.float32 for p in self.params)
        kw = {"fused": True} if fused else {}
        self.opt = torch.optim.AdamW(self.params if self.plain else self.masters, lr=lr,
                                     weight_decay=weight_decay, **kw)  # fmt: skip

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.plain:
            self.opt.step()
            return
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)


# -- the two data-parallel runs, on the ranks ------------------------------------------------------


def ranks(comm, cfg: Config) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import coconet.optim

    torch.set_num_threads(1)
    data = corpus()
    dtype = getattr(torch, cfg.dtype)
    ours = model(cfg).to(dtype)
    opt = coconet.optim.AdamW(
        ours.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, comm=comm
    )
    ddp = DistributedDataParallel(model(cfg).to(dtype))
    ddp_opt = MasterAdamW(list(ddp.parameters()), cfg.lr, cfg.weight_decay, fused=True)
    runs = ("ddp", "coconet", "fsdp") if cfg.fully_shard else ("ddp", "coconet")
    if cfg.fully_shard:
        import coconet.fsdp

        sharded = model(cfg).to(dtype)
        fs = coconet.fsdp.fully_shard(sharded, comm=comm)  # each Block gathered in its turn
        fs_opt = coconet.optim.AdamW(
            sharded.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, comm=comm
        )
    local = {}  # run: (model, optimizer), each rank's own model between averages
    for run in local_runs(cfg):
        net = model(cfg)
        inner = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=True)  # fmt: skip
        local[run] = (net, coconet.optim.OverlapLocalSGD(inner, period=cfg.local_sgd, comm=comm)
                      if run == "overlap_local_sgd" else
                      coconet.optim.LocalSGD(inner, period=cfg.local_sgd, comm=comm))  # fmt: skip
    runs = (*runs, *local)
    out = {k: [] for k in ("coconet_loss", "ddp_loss", "coconet_ms", "ddp_ms", "compute_ms",
                           "coconet_step_ms", "fsdp_loss", "fsdp_ms",
                           *(f"{run}_{what}" for run in local for what in ("loss", "ms")))}
    def one_step(k: int) -> None:
        x, y = batch(data, cfg, k)
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        for run in runs:
            dist.barrier()
            t0 = time.perf_counter()
            if run in local:
                net, local_opt = local[run]
                local_opt.zero_grad()
                loss = loss_of(net, xs, ys)
                loss.backward()
                local_opt.step()  # a local step; after every K-th the models are averaged
            elif run == "fsdp":  # the update of each block runs in its backward
                fs_opt.zero_grad()
                loss = loss_of(sharded, xs, ys)
                loss.backward()
                fs_opt.step()
            elif run == "ddp":
                ddp_opt.zero_grad()
                loss = loss_of(ddp, xs, ys)
                loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
                ddp_opt.step()
            else:
                opt.zero_grad()
                loss = loss_of(ours, xs, ys)
                loss.backward()
                t1 = time.perf_counter()
                opt.step()
                out["compute_ms"].append((t1 - t0) * 1e3)
                out["coconet_step_ms"].append((time.perf_counter() - t1) * 1e3)
            out[f"{run}_ms"].append((time.perf_counter() - t0) * 1e3)
            out[f"{run}_loss"].append(loss.item())

    with phase("step 1: coconet compiles its fused AdamW kernels",
               why="once per machine and torch version: 10-35 s on a cold cache, seconds cached",
               enabled=comm.rank == 0):  # fmt: skip
        one_step(0)
    shown = time.perf_counter()
    for k in range(1, cfg.steps):
        one_step(k)
        if comm.rank == 0 and (time.perf_counter() - shown > 2.0 or k + 1 == cfg.steps):
            shown = time.perf_counter()
            say(f"  step {k + 1}/{cfg.steps} (rank 0: coconet {out['coconet_ms'][-1]:.1f} ms, "
                f"DDP {out['ddp_ms'][-1]:.1f} ms)")
    # the global batch's loss: the mean of the ranks' (equal shares)
    for run in runs:
        t = torch.tensor(out[f"{run}_loss"], dtype=torch.float64)
        dist.all_reduce(t)
        out[f"{run}_loss"] = (t / comm.world).tolist()
    if cfg.fully_shard:
        # the fully sharded parameters, gathered, against DDP's and coconet.optim's after the
        # last step (and coconet.optim's against DDP's: what float32 sums in another order do)
        whole = fs.state_dict()
        mine, theirs = ours.state_dict(), ddp.module.state_dict()
        out["param_drift"] = {
            "fsdp_vs_ddp": _drift(whole, theirs),
            "fsdp_vs_coconet": _drift(whole, mine),
            "coconet_vs_ddp": _drift(mine, theirs),
        }
        # (bytes: the parent compares them with one process's; tensors do not cross spawn)
        buf = io.BytesIO()
        torch.save({"fsdp": whole, "coconet": mine, "ddp": theirs}, buf)
        out["params"] = buf.getvalue()
    for key in ("coconet_ms", "ddp_ms", "compute_ms", "coconet_step_ms",
                *(("fsdp_ms",) if cfg.fully_shard else ()),
                *(f"{run}_ms" for run in local)):  # fmt: skip
        t = torch.tensor(out[key], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time, step by step
        out[key] = t.tolist()
    return out


def _drift(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest difference of any parameter of ``a`` from ``b``'s, relative to that
    parameter's largest value in ``b`` (``max``), and over all of them the largest
    difference relative to ``b``'s largest value (``global``)."""
    worst, scale, diff = 0.0, 0.0, 0.0
    for k, v in b.items():
        d = (a[k].double() - v.double()).abs().max().item()
        m = v.double().abs().max().item()
        worst, scale, diff = max(worst, d / max(m, 1e-30)), max(scale, m), max(diff, d)
    return {"max": worst, "global": diff / max(scale, 1e-30)}


def single(cfg: Config, params: dict | None = None) -> list[float]:
    """One process, the full batch, torch.optim.AdamW: the losses both runs must follow
    (``params``: filled with its parameters after the last step)."""
    data = corpus()
    net = model(cfg).to(getattr(torch, cfg.dtype))
    opt = MasterAdamW(list(net.parameters()), cfg.lr, cfg.weight_decay)
    losses = []
    for k in range(cfg.steps):
        x, y = batch(data, cfg, k)
        opt.zero_grad()
        loss = loss_of(net, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if params is not None:
        params.update({k: v.detach().clone() for k, v in net.state_dict().items()})
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--d-model", type=int, default=Config.d_model)
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--batch", type=int, default=Config.batch, help="sequences per step, all ranks")
    ap.add_argument("--seq", type=int, default=Config.seq)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the parameters' dtype (bfloat16: float32 masters in every optimizer)")
    ap.add_argument("--fully-shard", action="store_true",
                    help="a third run: the model fully sharded (coconet.fsdp.fully_shard), "
                    "each block's update in its backward; its parameters are checked against "
                    "DDP's after the last step")
    ap.add_argument("--local-sgd", type=int, default=0, metavar="K",
                    help="a run of Local SGD (coconet.optim.LocalSGD over torch AdamW) averaging "
                    "the models after every K-th step")
    ap.add_argument("--overlap", action="store_true",
                    help="with --local-sgd: a run of Overlap Local-SGD too "
                    "(coconet.optim.OverlapLocalSGD, the same period)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="relative, on the losses (default 1e-4; 1e-2 with --dtype bfloat16)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH", help="a PNG of the loss curves (needs matplotlib)")
    args = ap.parse_args(argv)
    cfg = Config(
        steps=args.steps, d_model=args.d_model, layers=args.layers, batch=args.batch,
        seq=args.seq, dtype=args.dtype, fully_shard=args.fully_shard,
        local_sgd=args.local_sgd, overlap=args.overlap,
    )
    if args.local_sgd < 0 or (args.overlap and not args.local_sgd):
        ap.error("--local-sgd takes a period K >= 1; --overlap needs --local-sgd K")
    if args.local_sgd and cfg.dtype != "float32":
        ap.error("--local-sgd trains float32 models (leave --dtype out)")
    if args.tolerance is None:
        # bfloat16: each run rounds its gradients' sums in its own order (one bfloat16 ulp is
        # 2**-8 relative), and the losses drift apart by more than float32's
        args.tolerance = 1e-2 if cfg.dtype == "bfloat16" else 1e-4
    if cfg.batch % cfg.world:
        ap.error(f"--batch must split evenly over {cfg.world} ranks")
    if args.plot and not has_matplotlib():
        ap.error(f"--plot {args.plot} needs matplotlib, which is not installed: "
                 "pip install matplotlib (or leave --plot out)")  # fmt: skip
    from coconet.runtime import CommOptions, spawn

    params = sum(p.numel() for p in model(cfg).parameters())
    say(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {params:,} {cfg.dtype} parameters; "
        f"{cfg.batch} x {cfg.seq} tokens per step over {cfg.world} ranks; {cfg.steps} steps")
    t0 = time.perf_counter()
    masters = " over float32 masters" if cfg.dtype != "float32" else ""
    with phase(f"training on {cfg.world} ranks: coconet.optim.AdamW and DDP + "
               f"torch.optim.AdamW(fused=True){masters}, step by step in alternation"
               ):  # fmt: skip
        res = spawn(ranks, cfg.world, cfg, options=CommOptions(timeout=300), timeout=1800)[0]
    with phase(f"the reference: one process, the full batch, torch.optim.AdamW{masters}, "
               f"{cfg.steps} steps"):  # fmt: skip
        ref_params: dict[str, torch.Tensor] = {}
        ref = single(cfg, ref_params)
    wall = time.perf_counter() - t0

    window = 10 if cfg.dtype != "float32" else 1  # (bfloat16: the means of 10-step windows)

    def drift(run: str) -> float:
        ours = res[f"{run}_loss"]
        return max(abs(statistics.mean(ours[i:i + window]) - statistics.mean(ref[i:i + window]))
                   / abs(statistics.mean(ref[i:i + window]))
                   for i in range(0, cfg.steps, window))  # fmt: skip

    def step_drift(run: str) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(res[f"{run}_loss"], ref, strict=True))

    runs = ("coconet", "ddp", "fsdp") if cfg.fully_shard else ("coconet", "ddp")

    say("\nlosses of the global batch, and each data-parallel step's time (the slowest rank's);")
    say("'1 process' is the reference: one process on the full batch with torch.optim.AdamW")
    fs_head = f" {'fsdp':>10}" if cfg.fully_shard else ""
    fs_ms = f" {'fsdp ms':>8}" if cfg.fully_shard else ""
    names = {"local_sgd": "local sgd", "overlap_local_sgd": "overlap"}
    fs_head += "".join(f" {names[run]:>10}" for run in local_runs(cfg))
    say(f"\n{'step':>4} {'1 process':>10} {'coconet':>10} {'ddp':>10}{fs_head}   "
        f"{'coconet ms':>10} {'ddp ms':>8}{fs_ms}")
    for k in range(cfg.steps):
        note = "   <- the first step compiles coconet's fused kernels (once)" if k == 0 else ""
        fs_loss = f" {res['fsdp_loss'][k]:>10.5f}" if cfg.fully_shard else ""
        fs_loss += "".join(f" {res[f'{run}_loss'][k]:>10.5f}" for run in local_runs(cfg))
        fs_time = f" {res['fsdp_ms'][k]:>8.1f}" if cfg.fully_shard else ""
        say(f"{k + 1:>4} {ref[k]:>10.5f} {res['coconet_loss'][k]:>10.5f} "
            f"{res['ddp_loss'][k]:>10.5f}{fs_loss}   {res['coconet_ms'][k]:>10.1f} "
            f"{res['ddp_ms'][k]:>8.1f}{fs_time}{note}")
    timed = slice(2, None)  # the first steps compile coconet's kernel and warm DDP's buckets
    med = {k: statistics.median(res[k][timed] or res[k]) for k in (
        "coconet_ms", "ddp_ms", "compute_ms", "coconet_step_ms")}  # fmt: skip
    share = 1.0 - med["compute_ms"] / med["ddp_ms"]
    summary = {
        "config": asdict(cfg),
        "parameters": params,
        "median_step_ms": {"coconet": med["coconet_ms"], "ddp": med["ddp_ms"]},
        "speedup_vs_ddp": med["ddp_ms"] / med["coconet_ms"],
        "forward_backward_ms": med["compute_ms"],
        "coconet_optimizer_step_ms": med["coconet_step_ms"],
        "ddp_share_not_forward_backward": share,
        "loss_drift": {run: drift(run) for run in runs},
        "loss_drift_window": window,
        "loss_drift_per_step": {run: step_drift(run) for run in runs},
        "losses": {"single": ref, **{run: res[f"{run}_loss"] for run in runs}},
        "wall_s": wall,
    }
    speed = summary["speedup_vs_ddp"]
    if speed >= 1.005:
        verdict = f"coconet is {speed:.2f}x faster than DDP"
    elif speed > 1 / 1.005:
        verdict = "coconet is as fast as DDP (1.00x)"
    else:
        verdict = f"coconet is {1 / speed:.2f}x slower than DDP"
    say(f"\nmedian step (steps 3-{cfg.steps}, slowest rank): coconet.optim.AdamW "
        f"{med['coconet_ms']:.1f} ms (forward + backward {med['compute_ms']:.1f}, opt.step "
        f"{med['coconet_step_ms']:.1f}), DDP + torch.optim.AdamW(fused=True) {med['ddp_ms']:.1f} "
        f"ms: {verdict}; communication + optimizer are {share:.0%} of DDP's step")
    over = f" of {window}-step means" if window > 1 else ""
    per_step = summary["loss_drift_per_step"]
    also = (f" (single steps: coconet {per_step['coconet']:.1e}, ddp {per_step['ddp']:.1e})"
            if window > 1 else "")  # fmt: skip
    say(f"losses vs one process on the full batch (max relative{over}): coconet "
        f"{summary['loss_drift']['coconet']:.1e}, ddp {summary['loss_drift']['ddp']:.1e} "
        f"(tolerance {args.tolerance:g}){also}; wall {wall:.0f} s")
    if cfg.fully_shard:
        fs_med = statistics.median(res["fsdp_ms"][timed] or res["fsdp_ms"])
        summary["median_step_ms"]["fsdp"] = fs_med
        drift_p = summary["param_drift"] = res["param_drift"]
        finals = torch.load(io.BytesIO(res.pop("params")), weights_only=True)
        for run, got in finals.items():
            drift_p[f"{run}_vs_single"] = _drift(got, ref_params)
        say(f"fully sharded (coconet.fsdp): median step {fs_med:.1f} ms "
            f"({fs_med / med['coconet_ms']:.2f}x coconet.optim's, {med['ddp_ms'] / fs_med:.2f}x "
            f"faster than DDP); its parameters after step {cfg.steps}, relative to each "
            f"tensor's largest: {drift_p['fsdp_vs_coconet']['max']:.1e} from coconet.optim's, "
            f"{drift_p['fsdp_vs_ddp']['max']:.1e} from DDP's (coconet.optim's from DDP's: "
            f"{drift_p['coconet_vs_ddp']['max']:.1e}); from one process's: fsdp "
            f"{drift_p['fsdp_vs_single']['max']:.1e}, coconet.optim "
            f"{drift_p['coconet_vs_single']['max']:.1e}, DDP {drift_p['ddp_vs_single']['max']:.1e}"
            f" (relative to the largest value of all: fsdp "
            f"{drift_p['fsdp_vs_single']['global']:.1e}, DDP "
            f"{drift_p['ddp_vs_single']['global']:.1e})")
    if local_runs(cfg):
        last = min(10, cfg.steps)
        sync = statistics.mean(res["coconet_loss"][-last:])
        summary["local_sgd"] = {"period": cfg.local_sgd, "final_loss_window": last}
        for run in local_runs(cfg):
            summary["losses"][run] = res[f"{run}_loss"]
            final = statistics.mean(res[f"{run}_loss"][-last:])
            ms = statistics.median(res[f"{run}_ms"][timed] or res[f"{run}_ms"])
            summary["median_step_ms"][run] = ms
            summary["local_sgd"][f"{run}_final_loss_over_sync_dp"] = final / sync
            say(f"{run.replace('_', ' ')} (K={cfg.local_sgd}): final loss {final:.4f} (mean of "
                f"the last {last} steps), {final / sync:.3f}x sync data parallel's {sync:.4f}; "
                f"median step {ms:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        say(f"JSON written to {args.json}")
    if args.plot:
        plot(summary, args.plot)
    finite = all(math.isfinite(x) for run in runs for x in res[f"{run}_loss"])
    worst = max(summary["loss_drift"].values())
    if cfg.fully_shard and res["param_drift"]["fsdp_vs_coconet"]["max"] > args.tolerance:
        say(f"FAIL: the fully sharded parameters left coconet.optim's by "
            f"{res['param_drift']['fsdp_vs_coconet']['max']:.1e} relative (tolerance "
            f"{args.tolerance:g})")
        return 1
    if finite and worst <= args.tolerance:
        say(f"ok: both data-parallel runs follow one process (max relative {worst:.1e} <= "
            f"{args.tolerance:g}); {verdict}")
        return 0
    say(f"FAIL: the losses left one process's by {worst:.1e} relative (tolerance "
        f"{args.tolerance:g})" + ("" if finite else ", or are not finite"))
    return 1


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    smooth = 10 if len(summary["losses"]["single"]) >= 50 else 1
    for name, style, label in (("single", "-", "one process"), ("coconet", "--", "coconet"),
                               ("ddp", ":", "ddp"), ("local_sgd", "-.", "local sgd"),
                               ("overlap_local_sgd", "-", "overlap local-sgd")):  # fmt: skip
        losses = summary["losses"].get(name)
        if losses is None:
            continue
        if smooth > 1:  # each batch's loss jumps: the mean of the last `smooth` steps
            losses = [statistics.mean(losses[max(0, i - smooth + 1) : i + 1])
                      for i in range(len(losses))]  # fmt: skip
        ax.plot(range(1, len(losses) + 1), losses, style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)" + (f", mean of {smooth} steps" if smooth > 1 else ""))
    ms = summary["median_step_ms"]
    dtype = summary["config"].get("dtype", "float32")
    title = f"{dtype}: coconet {ms['coconet']:.0f} ms/step vs DDP {ms['ddp']:.0f} ms/step"
    if "local_sgd" in summary:
        title = (f"{dtype}: sync data parallel (coconet, ddp) against local SGD, "
                 f"K={summary['local_sgd']['period']}")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
