"""Data-parallel optimizer steps: ``coconet.optim`` against what users run, in one process group.

``--nproc`` local ranks (spawned with ``coconet.runtime.spawn``, 1 torch thread each) each hold
a gradient of ``--params`` float32 values for one parameter tensor; one step averages the
gradient over the ranks (as DDP does) and applies the optimizer. Contenders, in alternation
(A B C ... A B C ...), a barrier before each step, the slowest rank's time of each step:

- ``ddp``: ``dist.all_reduce`` (gloo) of the gradient, divided by the world size, then the
  fastest torch implementation (``fused=True`` for SGD/Adam/AdamW; for LAMB, which torch lacks,
  ``pytorch_optimizer.Lamb`` with its foreach path, the library users install);
- ``ddp+lamb_foreach``: LAMB written with ``torch._foreach_*`` ops the way a user would (LAMB only);
- ``zero``: ``ZeroRedundancyOptimizer`` over the same optimizer (the parameter split into one
  tensor per rank: ZeRO shards whole tensors; so not for LAMB, whose trust ratio is per tensor:
  halves would compute another update);
- ``coconet.optim.<X>``: the drop-in optimizer, default schedule (fuse_RS_C_AG, state sliced),
  over shared memory (the default on one host), and ``[gloo]`` over torch.distributed.

After the timed steps every contender's parameters are compared with ``ddp``'s. A copy probe
measures the memory bandwidth; each contender's lower bound is the bytes its step must read and
write at that bandwidth (and, for gloo contenders, the all_reduce's bus bytes at the gloo probe's
bandwidth, printed separately).

With ``--model gpt:LAYERS:WIDTH`` the parameters are not one tensor but the tensors of a
nanoGPT model (``bias=False``, vocabulary 65, block 256: 6 tensors a layer + 3), in nanoGPT's
two param groups (weight decay on the tensors of 2 or more dims, none on the rest), with
``--clip`` (default 1.0; SGD/Adam/AdamW) clipping by the global norm: ``ddp`` is then DDP's
communication (one flat bucket the gradients are views of, ``gradient_as_bucket_view=True``:
all_reduce, divide) + ``clip_grad_norm_`` + the torch optimizer over the two groups, and
``coconet.optim.<X>`` takes the same groups and ``max_grad_norm=``. This is the small-model row
of issue 25: the step's fixed costs (per group, per tensor, per collective) matter at this size.

    python benchmarks/data_parallel.py --optimizer adam --params 16M --nproc 2 --json out.json
    python benchmarks/data_parallel.py --optimizer lamb
    python benchmarks/data_parallel.py --optimizer adamw --model gpt:5:128 --steps 50
    python benchmarks/data_parallel.py --optimizer lamb --model gpt:4:128 --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from coconet.options import TransportKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import cpu_model, pyplot  # noqa: E402  (one definition for the benchmarks)

OPTIMIZERS = ("sgd", "adam", "adamw", "lamb")
HYPER = {
    "sgd": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2},
    "adam": {"lr": 1e-3, "weight_decay": 1e-2},
    "adamw": {"lr": 1e-3, "weight_decay": 1e-2},
    "lamb": {"lr": 1e-3, "weight_decay": 1e-2},
}
TORCH_NAME = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "lamb": "LAMB"}
# bytes of optimizer state per parameter (float32): SGD's momentum, Adam's m and v
STATE_WORDS = {"sgd": 1, "adam": 2, "adamw": 2, "lamb": 2}


def parse_size(text: str) -> int:
    """16M -> 16 * 2**20, 4k -> 4096, 1000 -> 1000."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def gradient(seed: int, rank: int, k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + rank * 104_729 + k)
    return torch.randn(n, generator=gen) * 1e-2


class Contender:
    name, kind = "", "baseline"

    def prepare(self, g: torch.Tensor) -> None:
        """Untimed: this step's local gradient into the contender's .grad (as backward would)."""
        self.p.grad.copy_(g)

    def param(self) -> torch.Tensor:
        return self.p.detach()


def torch_optimizer(opt: str, params, hp: dict, impl: str):
    if opt == "lamb":
        import pytorch_optimizer

        return pytorch_optimizer.Lamb(params, foreach=impl != "single", **hp)
    return getattr(torch.optim, TORCH_NAME[opt])(params, **hp, **{impl: True})


class DDP(Contender):
    def __init__(self, name, opt, p0, hp, world, impl) -> None:
        self.name, self.world = name, world
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.opt = torch_optimizer(opt, [self.p], hp, impl)

    def step(self) -> None:
        dist.all_reduce(self.p.grad)
        self.p.grad.div_(self.world)
        self.opt.step()


class ForeachLamb(DDP):
    """LAMB as a user writes it with torch's foreach ops (pytorch_optimizer.Lamb's maths)."""

    def __init__(self, p0, hp, world) -> None:
        self.name, self.world = "ddp+lamb_foreach", world
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.m, self.v = torch.zeros_like(p0), torch.zeros_like(p0)
        self.lr, self.wd, self.t = hp["lr"], hp["weight_decay"], 0

    @torch.no_grad()
    def step(self) -> None:
        dist.all_reduce(self.p.grad)
        self.p.grad.div_(self.world)
        b1, b2, eps, self.t = 0.9, 0.999, 1e-6, self.t + 1
        ps, gs, ms, vs = [self.p], [self.p.grad], [self.m], [self.v]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, gs, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        torch._foreach_mul_(ps, 1 - self.lr * self.wd)
        us = torch._foreach_div(ms, torch._foreach_add(torch._foreach_sqrt(vs), eps))
        for p, u, w, un in zip(ps, us, torch._foreach_norm(ps), torch._foreach_norm(us),
                               strict=True):
            w = w.clamp(max=10.0)
            trust = 1.0 if w == 0 or un == 0 else (w / (un + eps)).item()
            p.add_(u, alpha=-self.lr / (1 - b1**self.t) * trust)


class Zero(Contender):
    def __init__(self, opt, p0, hp, world) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.name, self.world = "zero", world
        self.params = [torch.nn.Parameter(c.clone()) for c in torch.tensor_split(p0, world)]
        self.flat = torch.empty_like(p0)
        for p, view in zip(self.params, torch.tensor_split(self.flat, world), strict=True):
            p.grad = view
        if opt == "lamb":
            import pytorch_optimizer

            cls, extra = pytorch_optimizer.Lamb, {}
        else:
            cls, extra = getattr(torch.optim, TORCH_NAME[opt]), {"fused": True}
        self.opt = ZeroRedundancyOptimizer(self.params, optimizer_class=cls, **hp, **extra)

    def prepare(self, g):
        self.flat.copy_(g)

    def step(self) -> None:
        dist.all_reduce(self.flat)
        self.flat.div_(self.world)
        self.opt.step()

    def param(self):
        return torch.cat([p.detach() for p in self.params])


class CoconetOptim(Contender):
    kind = "coconet"

    def __init__(self, name, opt, comm, p0, hp) -> None:
        import coconet.optim

        self.name = name
        self.p = torch.nn.Parameter(p0.clone())
        self.opt = getattr(coconet.optim, TORCH_NAME[opt])([self.p], **hp, comm=comm)

    def step(self) -> None:
        self.opt.step()


def gpt_shapes(layers: int, width: int, vocab: int = 65, block: int = 256
               ) -> list[tuple[str, tuple[int, ...]]]:  # fmt: skip
    """The parameter tensors of nanoGPT's ``GPT`` with ``bias=False`` (the lm_head tied to
    ``wte``), in ``named_parameters()`` order: 6 a layer, plus ``wte``, ``wpe`` and ``ln_f``."""
    shapes = [("transformer.wte.weight", (vocab, width)),
              ("transformer.wpe.weight", (block, width))]
    for i in range(layers):
        h = f"transformer.h.{i}"
        shapes += [(f"{h}.ln_1.weight", (width,)), (f"{h}.attn.c_attn.weight", (3 * width, width)),
                   (f"{h}.attn.c_proj.weight", (width, width)), (f"{h}.ln_2.weight", (width,)),
                   (f"{h}.mlp.c_fc.weight", (4 * width, width)),
                   (f"{h}.mlp.c_proj.weight", (width, 4 * width))]
    return shapes + [("transformer.ln_f.weight", (width,))]


def model_params(p0: torch.Tensor, shapes) -> list[torch.nn.Parameter]:
    """One Parameter per shape, each with storage of its own (as a model's), from ``p0``."""
    sizes = [torch.Size(shape).numel() for _, shape in shapes]
    return [torch.nn.Parameter(part.clone().view(shape))
            for part, (_, shape) in zip(p0.split(sizes), shapes, strict=True)]


def nanogpt_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """nanoGPT's ``configure_optimizers``: decay the tensors of 2+ dims, not the others."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


class ModelDDP(Contender):
    """What DDP + a torch optimizer do for a model's step once backward has filled the bucket:
    one flat gradient bucket (``gradient_as_bucket_view=True``: each ``.grad`` a view of it),
    its all_reduce (gloo) and division by the world size, ``clip_grad_norm_`` (``foreach``) when
    clipping, then the optimizer over nanoGPT's two param groups. (DDP overlaps the all_reduce
    with backward where a core is free; on this 2-core machine none is.)"""

    def __init__(self, name, opt, p0, shapes, hp, world, impl, clip) -> None:
        self.name, self.world, self.clip = name, world, clip
        self.params = model_params(p0, shapes)
        self.bucket = torch.empty_like(p0)
        off = 0
        for p in self.params:
            p.grad = self.bucket[off:off + p.numel()].view_as(p)
            off += p.numel()
        rest = {k: v for k, v in hp.items() if k != "weight_decay"}
        self.opt = torch_optimizer(opt, nanogpt_groups(self.params, hp["weight_decay"]), rest,
                                   impl)

    def prepare(self, g):
        self.bucket.copy_(g)

    def step(self) -> None:
        dist.all_reduce(self.bucket)
        self.bucket.div_(self.world)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()

    def param(self):
        return flat(self.params)


class ModelCoconet(Contender):
    """``coconet.optim.<X>`` over the same tensors and groups, ``max_grad_norm=`` when clipping:
    the loop's only change (its ``.grad``s are views of coconet's buckets, as backward fills)."""

    kind = "coconet"

    def __init__(self, name, opt, comm, p0, shapes, hp, clip) -> None:
        import coconet.optim

        self.name, self.params = name, model_params(p0, shapes)
        rest = {k: v for k, v in hp.items() if k != "weight_decay"}
        extra = {"max_grad_norm": clip} if clip is not None else {}
        self.opt = getattr(coconet.optim, TORCH_NAME[opt])(
            nanogpt_groups(self.params, hp["weight_decay"]), **rest, comm=comm, **extra)

    def prepare(self, g):
        off = 0
        for p in self.params:
            p.grad.copy_(g[off:off + p.numel()].view_as(p))
            off += p.numel()

    def step(self) -> None:
        self.opt.step()

    def param(self):
        return flat(self.params)


class CopyProbe(Contender):
    name, kind = "probe:copy", "probe"

    def __init__(self, n: int) -> None:
        self.src, self.dst = torch.randn(n), torch.empty(n)

    def prepare(self, g):
        pass

    def step(self) -> None:
        self.dst.copy_(self.src)


class AllReduceProbe(CopyProbe):
    name = "probe:all_reduce"

    def __init__(self, n: int) -> None:
        self.buf = torch.ones(n)

    def step(self) -> None:
        dist.all_reduce(self.buf)


def worker(comm, cfg: dict) -> dict:
    from coconet.runtime import CommOptions, Communicator

    torch.set_num_threads(1)
    opt, n, world = cfg["optimizer"], cfg["params"], comm.world
    hp = HYPER[opt]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(cfg["seed"]))
    gloo = Communicator(comm.mesh, CommOptions(timeout=comm.options.timeout,
                                               transport="torch.distributed"))
    name = f"coconet.optim.{TORCH_NAME[opt]}"
    contenders = [CopyProbe(n), AllReduceProbe(n)]
    if cfg.get("model"):
        return run(comm, cfg, contenders + model_contenders(comm, gloo, cfg, p0, hp, name))
    contenders.append(DDP("ddp", opt, p0, hp, world, "foreach" if opt == "lamb" else "fused"))
    if opt == "lamb":
        contenders.append(DDP("ddp+lamb_single", opt, p0, hp, world, "single"))
        contenders.append(ForeachLamb(p0, hp, world))
    if opt != "lamb":  # ZeRO shards whole tensors: LAMB's per-tensor norms would change meaning
        contenders.append(Zero(opt, p0, hp, world))
    # across hosts the default may be two levels (shared memory inside each host): say so
    two_levels = comm.transport_of(None) is TransportKind.HIERARCHICAL
    contenders.append(CoconetOptim(f"{name}[hierarchical]" if two_levels else name, opt, comm,
                                   p0, hp))
    contenders.append(CoconetOptim(f"{name}[gloo]", opt, gloo, p0, hp))
    return run(comm, cfg, contenders)


def model_contenders(comm, gloo, cfg: dict, p0, hp: dict, name: str) -> list[Contender]:
    """The small-model row's contenders (``--model``): ddp (the reference) first."""
    opt, shapes, clip = cfg["optimizer"], gpt_shapes(*cfg["model"]), cfg["clip"]
    impl = "foreach" if opt == "lamb" else "fused"
    suffix = f"[clip {clip:g}]" if clip is not None else ""
    return [ModelDDP(f"ddp{suffix}", opt, p0, shapes, hp, comm.world, impl, clip),
            ModelCoconet(f"{name}{suffix}", opt, comm, p0, shapes, hp, clip),
            ModelCoconet(f"{name}{suffix}[gloo]", opt, gloo, p0, shapes, hp, clip)]


def run(comm, cfg: dict, contenders: list[Contender]) -> dict:
    """Time ``contenders`` in alternation (the first two are the probes, the third the
    reference the others' parameters are compared with) and return the rows."""
    rounds, n = 1 + cfg["warmup"] + cfg["steps"], cfg["params"]
    times = torch.zeros(len(contenders), cfg["steps"], dtype=torch.float64)
    first = torch.zeros(len(contenders), dtype=torch.float64)
    for r in range(rounds):
        if comm.rank == 0:
            print(f"\r  round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
        g = gradient(cfg["seed"], comm.rank, r % 2, n)
        for i, c in enumerate(contenders):
            c.prepare(g)
            dist.barrier()
            t = time.perf_counter()
            c.step()
            dt = (time.perf_counter() - t) * 1e3
            if r == 0:
                first[i] = dt
            elif r > cfg["warmup"]:
                times[i, r - 1 - cfg["warmup"]] = dt
    if comm.rank == 0:
        print(file=sys.stderr)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    ref = contenders[2].param()
    rows = []
    for i, c in enumerate(contenders):
        row = {"name": c.name, "kind": c.kind, "first_call_ms": round(first[i].item(), 3)}
        ts = times[i].tolist()
        row.update(median_ms=round(statistics.median(ts), 3), min_ms=round(min(ts), 3),
                   max_ms=round(max(ts), 3))
        if c.kind != "probe":
            mine = c.param()
            err = torch.tensor([((mine - ref).abs().max() / ref.abs().max()).item()],
                               dtype=torch.float64)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            row["max_rel_err_vs_ddp"] = err.item()
            row["correct"] = err.item() <= 1e-5
        rows.append(row)
    return {"rows": rows}


def lower_bounds(rows: list[dict], opt: str, n: int, world: int) -> dict:
    by = {r["name"]: r for r in rows}
    copy_gbs = 8 * n / by["probe:copy"]["median_ms"] / 1e6  # read + write
    s = STATE_WORDS[opt]
    # an unfused step (all_reduce, then the update on every element): read g, p, state and write
    # p, state over all n, plus the all_reduce's own memory traffic over shared memory
    update = (2 + 2 * s) * 4 * n
    ar_bus = 2 * (world - 1) / world * 4 * n
    ar_gbs = ar_bus / by["probe:all_reduce"]["median_ms"] / 1e6
    # coconet's fused step over shared memory: its slice of every peer's gradient (4n), its slice
    # of p and the state read and written, and the peers' new p slices copied into p (8n)
    fused = 4 * n + (2 + 2 * s) * 4 * n / world + 8 * n
    return {
        "copy_GBps": round(copy_gbs, 3),
        "fused_shared_memory_ms": round(fused / copy_gbs / 1e6, 3),
        "update_memory_ms": round(update / copy_gbs / 1e6, 3),
        "gloo_all_reduce_ms": round(ar_bus / ar_gbs / 1e6, 3),
    }


def table(doc: dict) -> str:
    rows, cfg = doc["results"], doc["config"]
    ddp = next(r for r in rows if r["kind"] != "probe")  # the reference: ddp
    lb = doc["lower_bound"]
    model = (f" in the {len(gpt_shapes(*cfg['model']))} tensors of nanoGPT {cfg['model'][0]} "
             f"x {cfg['model'][1]} (2 param groups)" if cfg.get("model") else "")
    lines = [
        f"data_parallel: {cfg['optimizer']}, {cfg['params']:,} float32 params{model}, "
        f"{doc['world_size']} ranks x 1 thread, {cfg['steps']} timed steps after "
        f"{cfg['warmup']} warm-up (+1 first call); {doc['machine']['cpu_model']}, "
        f"{doc['machine']['cpus']} cpus",
        "",
        f"{'name':<32} {'median ms':>10} {'min':>8} {'max':>8} {'ddp/this':>9} {'correct':>8} "
        f"{'err vs ddp':>11}",
    ]
    for r in rows:
        speed = f"{ddp['median_ms'] / r['median_ms']:.2f}x" if r["kind"] != "probe" else ""
        ok = "" if "correct" not in r else ("yes" if r["correct"] else "NO !!!")
        err = f"{r['max_rel_err_vs_ddp']:.1e}" if "max_rel_err_vs_ddp" in r else ""
        lines.append(f"{r['name']:<32} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f} "
                     f"{r['max_ms']:>8.1f} {speed:>9} {ok:>8} {err:>11}".rstrip())
    lines += [
        "",
        f"lower bounds (copy probe {lb['copy_GBps']:.1f} GB/s): coconet's fused step over shared "
        f"memory {lb['fused_shared_memory_ms']:.1f} ms; an update over every parameter "
        f"{lb['update_memory_ms']:.1f} ms (+ the all_reduce: over gloo "
        f"{lb['gloo_all_reduce_ms']:.1f} ms at the gloo probe's bandwidth)",
        "err vs ddp: max |p - p_ddp| / max |p_ddp| after every step; correct: <= 1e-5",
    ]
    if doc["targets"]:
        lines += ["", "targets (ratios of medians from this run):"]
        lines += [f"  {'met ' if t['met'] else 'MISSED'} {t['name']}: {t['value']:.2f} >= "
                  f"{t['threshold']}" for t in doc["targets"]]
    return "\n".join(lines)


def targets(rows: list[dict], cfg: dict) -> list[dict]:
    """Issue 25's small-model targets, from this run's medians: coconet's step over shared
    memory no slower than ddp's (ddp's median / coconet's >= 1)."""
    if not cfg.get("model"):
        return []
    ddp = next(r for r in rows if r["kind"] != "probe")
    mine = next(r for r in rows if r["kind"] == "coconet")
    value = ddp["median_ms"] / mine["median_ms"]
    return [{"name": f"{mine['name']} no slower than {ddp['name']} ({ddp['name']} / coconet)",
             "value": round(value, 3), "threshold": 1.0, "met": value >= 1.0}]


def plot(doc: dict, path: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    rows = [r for r in doc["results"] if r["kind"] != "probe"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh([r["name"] for r in rows], [r["median_ms"] for r in rows],
            color=["tab:blue" if r["kind"] == "coconet" else "tab:gray" for r in rows])
    ax.axvline(doc["lower_bound"]["fused_shared_memory_ms"], color="k", linestyle="--",
               label="fused step's memory bound")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median, slowest rank)")
    ax.set_title(f"{doc['config']['optimizer']}, {doc['config']['params']:,} params, "
                 f"{doc['world_size']} ranks")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    ap.add_argument("--params", default="16M", help="float32 parameters (16M, 4M, 1000000)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", metavar="gpt:LAYERS:WIDTH",
                    help="the tensors and two param groups of a nanoGPT model instead of one "
                    "tensor of --params (e.g. gpt:4:128, the issue's 27 tensors)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="with --model: the max_grad_norm / clip_grad_norm_ (SGD/Adam/AdamW; "
                    "0: off)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH")
    args = ap.parse_args(argv)
    model = None
    if args.model:
        try:
            kind, layers, width = args.model.split(":")
            model = (int(layers), int(width))
        except ValueError:
            kind = ""
        if kind != "gpt" or model is None or min(model) < 1:
            ap.error(f"--model {args.model!r}: expected gpt:LAYERS:WIDTH, e.g. gpt:4:128")
    if args.steps < 10:
        ap.error("--steps must be at least 10")
    if args.optimizer == "lamb":
        try:
            import pytorch_optimizer  # noqa: F401
        except ImportError:
            ap.error("--optimizer lamb compares with pytorch_optimizer.Lamb: pip install -e "
                     "'.[bench]'")
    n = parse_size(args.params)
    clip = args.clip if model and args.clip > 0 and args.optimizer != "lamb" else None
    if model:
        n = sum(torch.Size(shape).numel() for _, shape in gpt_shapes(*model))
    from coconet.runtime import CommOptions, spawn

    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = {"optimizer": args.optimizer, "params": n, "steps": args.steps,
           "warmup": args.warmup, "seed": args.seed, "model": model, "clip": clip}
    with tempfile.TemporaryDirectory(prefix="coconet-bench-"):
        t0 = time.perf_counter()
        res = spawn(worker, args.nproc, cfg, options=CommOptions(timeout=600), timeout=3600)[0]
        wall = time.perf_counter() - t0
    rows = res["rows"]
    import coconet

    doc = {
        "benchmark": "data_parallel",
        "machine": {
            "cpus": os.cpu_count(), "device": "cpu", "backend": "gloo",
            "torch": torch.__version__.split("+")[0], "python": platform.python_version(),
            "cpu_model": cpu_model(), "coconet": coconet.__version__,
        },
        "world_size": args.nproc,
        "config": {**cfg, "dtype": "float32", "hyper_parameters": HYPER[args.optimizer]},
        "lower_bound": lower_bounds(rows, args.optimizer, n, args.nproc),
        "results": [r for r in rows if r["kind"] != "probe"],
        "probes": [r for r in rows if r["kind"] == "probe"],
        "wall_s": round(wall, 1),
    }
    doc["lower_bound_ms"] = doc["lower_bound"]["fused_shared_memory_ms"]
    doc["targets"] = targets(rows, cfg)
    doc["results"] += doc["probes"]
    print(table(doc))
    print(f"(wall time {wall:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"JSON written to {args.json}")
    if args.plot:
        plot(doc, args.plot)
    return 0 if all(r.get("correct", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
