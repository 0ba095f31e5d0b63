"""Where one coconet data-parallel Adam step spends its time, phase by phase (a profile, not a
benchmark: the phases are timed by wrapping coconet's runtime methods, which adds a little).

Two ranks (1 torch thread each) on the transport ``--transport`` chooses (default: shared memory,
what coconet uses on one host; ``torch.distributed`` for gloo), ``--params`` float32 values,
``--steps`` steps of each contender after a warm-up; each phase's median over the steps, on the
slowest rank. Phases:

- ``bind``: checking this rank's inputs (no communication);
- ``handshake``: the start-of-step all_reduce of program hash / shapes (``check_every_step``);
- ``collective start``: launching the collectives, including the copies they make of their input
  (over shared memory a collective does all its work here; so does the opening of a one-pass unit:
  publishing the input and waiting until every peer has). The gradient is passed where the step
  reads it (``CompiledStep.input_buffer``, as ``coconet.optim`` keeps it), so it is not copied in;
- ``collective wait``: waiting for them; over shared memory also the closing of a one-pass unit
  (waiting until every peer wrote its slot, or read this rank's rows);
- ``fused kernel``: the torch.compile'd kernel(s) (one-pass: including the reduction of the peers'
  slices it reads);
- ``other step code``: the rest of the generated step (eager ops of unfused code, views);
- ``commit vote``: the all_reduce confirming every rank succeeded (``commit_vote``);
- ``commit copies``: copying the step's new tensors into the caller's ``p``, ``m``, ``v`` (with a
  one-pass unit's published gather: the gather itself, from the peers' slots into ``p``; with
  ``--commit swap`` the state is swapped in, not copied).

``fuse_RS_C_AG[host-shared]`` is the same schedule with ``p`` a host replica
(``coconet.runtime.replica``: one double-buffered copy of the parameters per host): the kernel
writes its new slice into the spare buffer and the commit flips, so it has no gather to copy.

For scale, ``ddp`` is split into its ``all_reduce`` and ``Adam(fused=True).step()``.

Where the bytes go: for the one-pass steps, each memory phase's bytes per rank (what it must read
and write) and its effective bandwidth, next to probes run by both ranks at once on slices of
the same size: a copy (``dst.copy_(src)``: an out-of-place write, which the CPU first reads for
ownership unless it streams), the same copy with streaming stores (a small C loop built here:
what Inductor's kernels, which store normally, leave on the table), an in-place
read-modify-write (``x.add_(y)``: as torch's fused Adam updates ``p``, ``m``, ``v``) and a read
(``x.sum()``). Each phase also reports the minor
page faults it took (``getrusage``: fresh memory costs a fault per 4 KiB page; ``perf``'s hardware
counters are not available on this VM, so cache misses are not counted).

    python benchmarks/step_breakdown.py --params 4194304 --steps 10
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import f32, gradient, initial_param, load_adam  # noqa: E402

FAULTED = ["collective start", "fused kernel", "collective wait", "commit copies"]
HOST_SHARED = "fuse_RS_C_AG[host-shared]"
PHASES = [
    "bind",
    "handshake",
    "collective start",
    "collective wait",
    "fused kernel",
    "other step code",
    "commit vote",
    "commit copies",
    "total",
]


def worker(comm, cfg):
    import coconet
    from coconet.options import TransportKind
    from coconet.runtime import handshake
    from coconet.testing import rank_inputs

    torch.set_num_threads(cfg["threads"])
    n = cfg["params"]
    adam = load_adam()
    program = adam.program()
    hp = {
        "lr": f32(adam.LR),
        "beta1": f32(adam.BETAS[0]),
        "beta2": f32(adam.BETAS[1]),
        "eps": f32(adam.EPS),
        "weight_decay": f32(adam.WEIGHT_DECAY),
    }
    g = gradient(0, comm.rank, 0, n)
    p0 = initial_param(0, n)
    acc: dict[str, float] = collections.defaultdict(float)
    faults: dict[str, int] = collections.defaultdict(int)

    def minflt() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def wrap(obj, attr, label, pick=None):
        orig = getattr(obj, attr)

        def timed(*a, **k):
            t, f = time.perf_counter(), minflt()
            try:
                return orig(*a, **k)
            finally:
                key = pick(a, k) if pick else label
                acc[key] += (time.perf_counter() - t) * 1e3
                faults[key] += minflt() - f

        setattr(obj, attr, timed)

    wrap(handshake, "settle", "handshake:settle")
    wrap(comm, "agree_max", "", pick=lambda a, k: "agree:" + k.get("op", "handshake"))
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        wrap(comm, f"{op}_start", "collective start")
    wrap(comm, "wait", "collective wait")
    # the shared-memory transport's one-pass units and in-place all_reduce (its channel is made
    # once per axis: the generated code calls this object)
    if comm.transport_of(None) is TransportKind.SHARED_MEMORY:
        channel = comm.one_pass(None)
        for attr in ("begin", "slot", "reduce_in_place"):
            wrap(channel, attr, "collective start")
        for attr in ("end", "finish"):
            wrap(channel, attr, "collective wait")

    out = {}
    targets = {"unscheduled": program, **{k: f(program) for k, f in adam.SCHEDULES.items()}}
    shm = comm.transport_of(None) is TransportKind.SHARED_MEMORY
    if shm:
        targets[HOST_SHARED] = adam.SCHEDULES["fuse_RS_C_AG"](program)
    for name, target in targets.items():
        fn = coconet.compile(target, comm=comm, cache_dir=cfg["cache_dir"], commit=cfg["commit"])
        wrap(fn, "_bind", "bind")
        wrap(fn, "_commit", "commit copies")
        if not getattr(fn.module.step, "_timed", False):  # one module may serve two steps
            wrap(fn.module, "step", "module.step")
            fn.module.step._timed = True
        for kname in list(fn.kernels._kernels):
            wrap(fn.kernels._kernels[kname], "fn", "fused kernel")
        zeros = torch.zeros(n)
        st = rank_inputs(fn.program, {"p": p0, "m": zeros, "v": zeros}, comm.mesh, comm.rank)
        if name == HOST_SHARED:
            replica = fn.host_replica("p", (n,))
            if comm.rank == 0:
                replica.live().copy_(p0)
            dist.barrier()
            st["p"] = replica.live()
        # the gradient where the step's collective reads it, as coconet.optim keeps it (backward
        # writes it there): nothing is copied in
        try:
            grad = fn.input_buffer("g", (n,))
        except coconet.ConfigError:  # no collective reads it on this transport's plan
            grad = g.clone()
        grad.copy_(g)
        rows = collections.defaultdict(list)
        for k in range(cfg["warmup"] + cfg["steps"]):
            acc.clear()
            faults.clear()
            dist.barrier()
            t = time.perf_counter()
            fn(g=grad, step=float(k + 1), **st, **hp)
            total = (time.perf_counter() - t) * 1e3
            if k < cfg["warmup"]:
                continue
            inner = acc["collective start"] + acc["collective wait"] + acc["fused kernel"]
            rows["bind"].append(acc["bind"])
            rows["handshake"].append(acc["handshake:settle"])
            rows["collective start"].append(acc["collective start"])
            rows["collective wait"].append(acc["collective wait"])
            rows["fused kernel"].append(acc["fused kernel"])
            rows["other step code"].append(acc["module.step"] - inner)
            rows["commit vote"].append(acc["agree:commit vote"])
            rows["commit copies"].append(acc["commit copies"])
            rows["total"].append(total)
            for ph in FAULTED:
                rows["faults: " + ph].append(faults[ph])
        out[f"coconet:{name}"] = {ph: statistics.median(v) for ph, v in rows.items()}

    # The probes, on a slice's size, both ranks at once (a barrier before each).
    half = n // comm.world
    a, b, c = torch.randn(half), torch.randn(half), torch.empty(half)
    probes = {
        "copy (out of place)": (lambda: c.copy_(a), 8 * half),
        "in place (x += y)": (lambda: a.add_(b, alpha=1e-30), 12 * half),
        "read (sum)": (lambda: a.sum(), 4 * half),
    }
    streaming = streaming_copy(cfg["cache_dir"], comm.rank)
    if streaming is not None:
        dst, src, count = (ctypes.c_void_p(c.data_ptr()), ctypes.c_void_p(a.data_ptr()),
                           ctypes.c_size_t(half))
        probes["copy, streaming stores"] = (lambda: streaming(dst, src, count), 8 * half)
    rows = collections.defaultdict(list)
    for k in range(cfg["warmup"] + cfg["steps"]):
        for label, (fn_, _) in probes.items():
            dist.barrier()
            t = time.perf_counter()
            fn_()
            if k >= cfg["warmup"]:
                rows[label].append((time.perf_counter() - t) * 1e3)
    out["probe"] = {ph: statistics.median(v) for ph, v in rows.items()}
    out["probe bytes"] = {label: float(nbytes) for label, (_, nbytes) in probes.items()}

    param = torch.nn.Parameter(p0.clone())
    param.grad = torch.empty(n)
    betas = (hp["beta1"], hp["beta2"])
    opt = torch.optim.Adam(
        [param],
        lr=hp["lr"],
        betas=betas,
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        fused=True,
    )
    rows = collections.defaultdict(list)
    for k in range(cfg["warmup"] + cfg["steps"]):
        param.grad.copy_(g)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(param.grad)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if k >= cfg["warmup"]:
            rows["all_reduce"].append((t1 - t0) * 1e3)
            rows["Adam(fused=True).step"].append((t2 - t1) * 1e3)
            rows["total"].append((t2 - t0) * 1e3)
    out["ddp"] = {ph: statistics.median(v) for ph, v in rows.items()}

    # The slowest rank's median per phase.
    names = sorted(out)
    keys = [(c, ph) for c in names for ph in sorted(out[c])]
    t = torch.tensor([out[c][ph] for c, ph in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    worst = collections.defaultdict(dict)
    for (c, ph), v in zip(keys, t.tolist(), strict=True):
        worst[c][ph] = v
    worst = dict(worst)
    worst["probe bytes"] = out["probe bytes"]
    worst["transport"] = comm.transport_of(None).value
    return worst


# The lever Inductor's kernels cannot pull: a copy whose stores bypass the cache (no read for
# ownership of the destination). Measured here only, to size what streaming stores would buy.
_STREAMING_C = r"""
#include <immintrin.h>
#include <stddef.h>
void copy_streaming(float *dst, const float *src, size_t n) {
    size_t i = 0;
    while (i < n && ((size_t)(dst + i) & 15)) { dst[i] = src[i]; i++; }
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < n; i++) dst[i] = src[i];
    _mm_sfence();
}
"""


def streaming_copy(cache_dir: str, rank: int):
    """``copy_streaming(dst, src, n)`` from a C file built here (x86-64 only; None elsewhere or
    without a C compiler)."""
    import platform
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    build = Path(cache_dir) / f"streaming-{rank}"
    build.mkdir(parents=True, exist_ok=True)
    (build / "s.c").write_text(_STREAMING_C)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(build / "s.so"),
                           str(build / "s.c")], capture_output=True)
    if done.returncode != 0:
        return None
    lib = ctypes.CDLL(str(build / "s.so"))
    lib.copy_streaming.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.copy_streaming.restype = None
    return lib.copy_streaming


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shared memory", "torch.distributed"],
        help="what runs coconet's collectives (auto: shared memory on one host)",
    )
    ap.add_argument("--commit", default="copy", choices=["copy", "swap"])
    args = ap.parse_args(argv)

    import tempfile

    from coconet.runtime import CommOptions, spawn

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="coconet-breakdown-") as tmp:
        cfg = {
            "params": args.params,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "cache_dir": tmp,
            "commit": args.commit,
        }
        options = CommOptions(cache_dir=tmp, transport=args.transport)
        res = spawn(worker, 2, cfg, options=options, timeout=1200)[0]
    cols = [c for c in res if c.startswith("coconet:")]
    print(
        f"step_breakdown: {args.params:,} float32 params, 2 ranks x {args.threads} thread(s), "
        f"coconet over {res['transport']}, commit={args.commit}; ddp over gloo; median of "
        f"{args.steps} steps, slowest rank, ms (load average {os.getloadavg()[0]:.2f})"
    )
    width = max(15, *(len(c) - len("coconet:") + 2 for c in cols))
    print(f"{'phase':<26}" + "".join(f"{c.removeprefix('coconet:'):>{width}}" for c in cols))
    for ph in PHASES:
        print(f"{ph:<26}" + "".join(f"{res[c].get(ph, 0.0):>{width}.1f}" for c in cols))
    for ph in FAULTED:
        key = "faults: " + ph
        print(f"{'page faults: ' + ph:<26}" + "".join(f"{res[c].get(key, 0):>{width}.0f}"
                                                   for c in cols))
    print()
    print("ddp: " + ", ".join(f"{ph} {v:.1f}" for ph, v in res["ddp"].items()))
    print()
    print(bandwidth_table(res, args.params, 2))
    return 0


def bandwidth_table(res: dict, n: int, world: int) -> str:
    """Where the one-pass steps' bytes go: each memory phase's bytes per rank and effective
    bandwidth, against the probes (both ranks at once, on a slice's size)."""
    s = n // world
    mib = 2**20
    # the kernel reads this rank's slice of every peer's gradient (4n bytes together) and its
    # p, m, v slices; it writes m, v and its new p slice (into the gather's slot, or the
    # replica's spare buffer); the per-rank commit copies every rank's new slice into p
    kernel = 4 * n + 24 * s
    phases = {
        "coconet:fuse_RS_C_AG": [("fused kernel", kernel), ("commit copies", 8 * n)],
        f"coconet:{HOST_SHARED}": [("fused kernel", kernel), ("commit copies", 0)],
    }
    lines = [
        "where the bytes go (per rank; GB/s = bytes moved / time; probes on "
        f"{4 * s / mib:.0f} MiB slices, both ranks at once):",
        f"{'':<34}{'MiB':>8}{'ms':>8}{'GB/s':>8}",
    ]
    for label, ms in res["probe"].items():
        nbytes = res["probe bytes"][label]
        lines.append(
            f"{'probe: ' + label:<34}{nbytes / mib:>8.0f}{ms:>8.2f}{nbytes / ms / 1e6:>8.1f}"
        )
    for col, rows in phases.items():
        if col not in res:
            continue
        for ph, nbytes in rows:
            ms = res[col].get(ph, 0.0)
            rate = f"{nbytes / ms / 1e6:>8.1f}" if nbytes and ms > 0 else f"{'-':>8}"
            lines.append(
                f"{col.removeprefix('coconet:') + ': ' + ph:<34}{nbytes / mib:>8.0f}{ms:>8.2f}"
                + rate
            )
        total = sum(b for _, b in rows)
        ms = res[col]["total"]
        lines.append(
            f"{col.removeprefix('coconet:') + ': whole step':<34}{total / mib:>8.0f}{ms:>8.2f}"
            f"{total / ms / 1e6:>8.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
