"""Fully sharded parameters: ``coconet.fsdp`` against what users run, a GPT of ~64M parameters.

Two ranks (spawned with ``coconet.runtime.spawn``, 1 torch thread each: the two fill the 2-core
machine, so communication and computation compete for the same cores) train
``examples/train_gpt.py``'s GPT (bytes, ``--layers`` x ``--d-model``) from the same weights on
the same batches, float32, AdamW (lr 3e-3, weight decay 0.1). Contenders, each in a job of its
own (fresh processes, so each rank's peak memory is its own):

- ``coconet.fsdp``: ``coconet.fsdp.fully_shard`` (each transformer layer a block, the rest the
  root block) + ``coconet.optim.AdamW``: each layer gathered before its forward and backward,
  its gradient's reduce_scatter fused with the update of this rank's slice, over shared memory;
- ``coconet.optim``: the parameters whole, ``coconet.optim.AdamW`` with its state sliced
  (ZeRO-1/2: one fused reduce_scatter + update + all_gather after the backward);
- ``ddp``: ``DistributedDataParallel`` (gloo) + ``torch.optim.AdamW(fused=True)``;
- ``torch fully_shard``: torch's FSDP2 (``fully_shard`` of each layer and the root, on a CPU
  device mesh over gloo) + ``torch.optim.AdamW`` (over DTensors).

Each step is timed between barriers (the slowest rank's time); medians over the timed steps.
**Memory** is each rank's peak proportional set size (PSS: private pages plus its share of pages
it maps with the other rank, so a shared-memory transport's buffers count once over the ranks)
sampled every 4 ms over two steps of a job of its own (run with glibc handing every freed
buffer back at once: ``MALLOC_MMAP_THRESHOLD_`` = 64 KiB and coconet's ``keep_buffers_mapped``
off, so that the resident set follows the live tensors, not what the allocator keeps for
reuse; the timed job keeps the defaults), minus its PSS just before the model was built
(after a few steps of a tiny model of the same kind: imports, compiled kernels and first
buffers are in the baseline): what the model, its gradients, the optimizer state, the gathered
blocks, the communication buffers and the activations added (the largest rank's). Not
allocator statistics: CPU tensors have none in torch. Next to it is
the arithmetic of params + grads + AdamW state for each contender. The losses of every contender
are compared with ``ddp``'s (they must follow it; float32 sums in another order drift slowly).

    python benchmarks/fully_sharded.py --json benchmarks/results/fully_sharded.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ["coconet.fsdp", "coconet.optim", "ddp", "torch fully_shard"]
TARGETS = [
    # (name, kind, numerator, denominator, threshold, sense)
    ("fully sharded: peak memory per rank over ddp's", "memory", "coconet.fsdp", "ddp", 0.55,
     "<="),
    ("fully sharded: step time over coconet.optim (sliced state only)", "time", "coconet.fsdp",
     "coconet.optim", 1.15, "<="),
    ("fully sharded: speedup over torch fully_shard", "time", "torch fully_shard",
     "coconet.fsdp", 1.3, ">="),
    ("fully sharded: speedup over ddp", "time", "ddp", "coconet.fsdp", 1.5, ">="),
]


def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = mod
    spec.loader.exec_module(mod)
    return mod


def pss() -> int:
    """This process's proportional set size in bytes (``/proc/self/smaps_rollup``): its
    private pages plus its share of pages mapped by several processes (a shared-memory
    transport's buffers count once over the ranks that map them, not once per rank as in
    the resident set)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise KeyError("Pss")


class PeakSampler:
    """The largest ``pss()`` seen while running, sampled every ``every`` seconds by a thread
    (reading smaps_rollup takes ~1 ms; it runs while the main thread is inside torch ops)."""

    def __init__(self, every: float = 0.004) -> None:
        import threading

        self.every, self.peak, self._stop = every, pss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, pss())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, pss())


def worker(comm, name: str, cfg: dict, memory: bool) -> dict:
    """Contender ``name`` on this rank: the timed pass, or (``memory``) the memory pass (two
    steps under the sampler)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    tg = train_gpt()
    data = tg.corpus()
    # a few steps of a tiny model of the same kind first: the imports, torch.compile's kernels
    # and the transports' first buffers are in the resident set before the baseline is taken
    tiny = {**cfg["gpt"], "layers": 1, "d_model": 32, "heads": 2}
    _train(comm, name, tg, tg.Config(**tiny), data, 2)
    if memory:
        base = pss()
        _train(comm, name, tg, tg.Config(**cfg["gpt"]), data, 2, sampler=PeakSampler)
        mem = torch.tensor([float(_train.peak - base)], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return {"peak_bytes": mem.item()}
    times, losses = _train(comm, name, tg, tg.Config(**cfg["gpt"]), data,
                           cfg["warmup"] + cfg["steps"])  # fmt: skip
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    return {"times_s": t.tolist()[cfg["warmup"]:], "first_s": t.tolist()[: cfg["warmup"]],
            "losses": (lt / comm.world).tolist()}  # fmt: skip


def _train(comm, name: str, tg: Any, gcfg: Any, data: torch.Tensor, steps: int,
           sampler: Any = None) -> tuple[list[float], list[float]]:  # fmt: skip
    """``steps`` steps of contender ``name``: each step's time and loss on this rank; with
    ``sampler``, two more steps under it (its peak in ``_train.peak``)."""
    import torch.distributed as dist

    import coconet.fsdp
    import coconet.optim

    net = tg.model(gcfg)
    lr, wd = gcfg.lr, gcfg.weight_decay
    if name == "coconet.fsdp":
        coconet.fsdp.fully_shard(net, comm=comm)
        opt = coconet.optim.AdamW(net.parameters(), lr=lr, weight_decay=wd, comm=comm)
        run = net
    elif name == "coconet.optim":
        opt = coconet.optim.AdamW(net.parameters(), lr=lr, weight_decay=wd, comm=comm)
        run = net
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(net)
        opt = torch.optim.AdamW(run.parameters(), lr=lr, weight_decay=wd, fused=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (comm.world,))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        run = net
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=wd)
    times, losses = [], []
    for k in range(steps):
        x, y = tg.batch(data, gcfg, k)
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = tg.loss_of(run, xs, ys)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if sampler is not None:
        with sampler() as s:
            for k in range(steps, steps + 2):
                x, y = tg.batch(data, gcfg, k)
                opt.zero_grad()
                tg.loss_of(run, torch.tensor_split(x, comm.world)[comm.rank],
                           torch.tensor_split(y, comm.world)[comm.rank]).backward()
                opt.step()
                dist.barrier()
        _train.peak = s.peak
    return times, losses


def arithmetic(n: int, world: int, largest_block: int, root: int) -> dict[str, float]:
    """Bytes of params + grads + AdamW state per rank, float32 (4 bytes), by contender: whole
    parameters and gradients and the whole state (ddp; DDP's gradient buckets are a second
    copy of the gradients); the state sliced (coconet.optim); everything sliced, plus what is
    whole at once (coconet.fsdp: the root block and two layers gathered, with one gradient
    buffer per size; torch fully_shard: the same shape of sums)."""
    f = 4
    sliced = n / world
    return {
        "ddp": f * (n + n + n + 2 * n),
        "coconet.optim": f * (n + n + 2 * sliced),
        "coconet.fsdp": f * (3 * sliced + 2 * root + 3 * largest_block),
        "torch fully_shard": f * (3 * sliced + 2 * root + 3 * largest_block),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step, all ranks")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, default=CONTENDERS)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    from coconet.runtime import CommOptions, spawn

    tg = train_gpt()
    gpt = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
           "seq": args.seq, "batch": args.batch}  # fmt: skip
    cfg = {"gpt": gpt, "steps": args.steps, "warmup": args.warmup}
    net = tg.model(tg.Config(**gpt))
    n = sum(p.numel() for p in net.parameters())
    layer = sum(p.numel() for p in net.blocks[0].parameters())
    root = n - layer * len(net.blocks)
    del net
    print(f"GPT: {args.layers} layers x d_model {args.d_model}, {n:,} float32 parameters "
          f"({layer:,} a layer); {args.batch} x {args.seq} tokens per step over 2 ranks",
          flush=True)  # fmt: skip
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for name in args.only:
        print(f"  running {name} ({args.warmup} + {args.steps} steps) ...", flush=True)
        res = spawn(worker, 2, name, cfg, False, options=CommOptions(timeout=600),
                    timeout=3600)[0]  # fmt: skip
        # the memory pass: glibc hands every freed buffer back at once (large ones mapped
        # each on its own, coconet's keep_buffers_mapped off), so that the resident set
        # follows the live tensors rather than what the allocator keeps for reuse
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
        try:
            res.update(spawn(worker, 2, name, cfg, True, timeout=3600,
                             options=CommOptions(timeout=600, keep_buffers_mapped=False))[0])
        finally:
            if saved is None:
                os.environ.pop("MALLOC_MMAP_THRESHOLD_")
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        res["median_ms"] = statistics.median(res["times_s"]) * 1e3
        rows[name] = res
        print(f"    median step {res['median_ms']:.0f} ms, peak memory "
              f"{res['peak_bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
    wall = time.perf_counter() - t0
    arith = arithmetic(n, 2, layer, root)
    ref = rows.get("ddp")
    for name, r in rows.items():
        r["arithmetic_bytes"] = arith[name]
        if ref is not None:
            r["loss_drift"] = max(abs(a - b) / abs(b) for a, b in
                                  zip(r["losses"], ref["losses"], strict=True))  # fmt: skip
    targets = []
    for what, kind, num, den, threshold, sense in TARGETS:
        if num in rows and den in rows:
            key = "peak_bytes" if kind == "memory" else "median_ms"
            ratio = rows[num][key] / rows[den][key]
            met = ratio <= threshold if sense == "<=" else ratio >= threshold
            targets.append({"target": what, "measured": round(ratio, 3), "threshold": threshold,
                            "sense": sense, "met": met})  # fmt: skip
    doc = {
        "benchmark": "fully_sharded",
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads_per_rank": 1, "ranks": 2},
        "config": cfg,
        "parameters": n,
        "layer_parameters": layer,
        "rows": rows,
        "targets": targets,
        "wall_s": wall,
    }
    lines = [f"GPT {args.layers} x {args.d_model} ({n:,} float32 parameters, {layer:,} a layer), "
             f"{args.batch} x {args.seq} tokens a step over 2 ranks (1 thread each), AdamW; "
             f"median of {args.steps} steps after {args.warmup}; torch {torch.__version__}",
             "peak MiB: each rank's peak PSS above its PSS before the model was built, in a job "
             "of its own (glibc returning freed memory at once); arith MiB: params + grads + "
             "AdamW state (+ what is whole at once) by arithmetic",
             f"\n{'contender':<20} {'median ms':>10} {'peak MiB':>9} {'arith MiB':>10} "
             f"{'loss drift vs ddp':>18}"]
    for name, r in rows.items():
        drift = f"{r['loss_drift']:.1e}" if "loss_drift" in r else "-"
        lines.append(f"{name:<20} {r['median_ms']:>10.0f} {r['peak_bytes'] / 2**20:>9.0f} "
                     f"{r['arithmetic_bytes'] / 2**20:>10.0f} {drift:>18}")
    lines += ["", "targets (ratios from this run):"]
    for t in targets:
        lines.append(f"  {t['target']}: {t['measured']} ({t['sense']} {t['threshold']}: "
                     f"{'met' if t['met'] else 'MISSED'})")
    print("\n".join(lines))
    print(f"(wall time {wall:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        Path(args.json).with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print(f"JSON written to {args.json}")
    drifts = [r.get("loss_drift", 0.0) for r in rows.values()]
    return 0 if all(d <= 1e-3 for d in drifts) else 1


if __name__ == "__main__":
    sys.exit(main())
