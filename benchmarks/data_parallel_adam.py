"""Data-parallel Adam: coconet's compiled schedules against what users run, in one process group.

Two gloo ranks (spawned here with ``coconet.runtime.spawn``, 1 torch thread each unless
``--threads`` says otherwise) each hold a gradient of ``--params`` float32 values; one step makes
the data-parallel gradient (the SUM over ranks: coconet's convention, and what every contender
computes) and applies torch.optim.Adam's update (L2 weight decay) to the parameters.

Contenders (all in one process group, in alternation A B C ... A B C ..., a barrier before each
step, the slowest rank's time of each step):

- ``ddp``: ``dist.all_reduce(grad)`` then ``torch.optim.Adam(fused=True)``; the reference;
- ``ddp_foreach``: the same with ``foreach=True`` (to show which of fused/foreach is faster here);
- ``zero``: ``dist.all_reduce(grad)`` then ``ZeroRedundancyOptimizer`` over Adam(fused=True);
  the parameter is split into ``--zero-chunks`` tensors (default: one per rank) because ZeRO
  shards whole parameters: with one flat tensor, one rank would do all the work;
- ``coconet:unscheduled`` and ``coconet:<schedule>`` for each of ``examples/adam.py``'s
  SCHEDULES, compiled with ``coconet.compile(..., comm=comm)`` (fused kernels: torch.compile).

Mixed precision (``--mixed``, the default; ``--no-mixed`` leaves them out), in the same
alternation:

- ``coconet.optim.Adam[bf16]``: the parameter is ``p0.to(torch.bfloat16)``; the optimizer keeps
  a float32 master copy of its slice (with float32 m, v), reduces the bfloat16 gradients (float32
  sum, rounded once to bfloat16), updates the master and all-gathers the rounded parameters;
- ``coconet.optim.Adam[reduce bf16]``: float32 parameters, ``reduce_dtype=torch.bfloat16`` (each
  rank's gradient cast to bfloat16, then reduced as above);
- ``ddp_bf16``: DDP's recipe for bfloat16 parameters without coconet: ``dist.all_reduce`` of the
  bfloat16 gradient over gloo (bfloat16 SUM), divided by world into a float32 master's ``.grad``,
  ``torch.optim.Adam(fused=True)`` on the master, the master cast into the bfloat16 parameter;
- ``deepspeed_shm_all_reduce+adam_fused[bf16]``: the same with DeepSpeed's
  ``inference_all_reduce`` of the bfloat16 gradient (when DeepSpeed is installed).

Their float32 master weights (the parameters of ``[reduce bf16]``) are compared with a single
torch.optim.Adam on a float32 master over the same rounded gradient, ``sum_r(g_r.to(bf16).float())
.to(bf16).float() / world`` (g_r: what rank r wrote into ``.grad``), and their bfloat16
parameters must be the master's rounding exactly.

Probes measured in the same alternation give the lower bound (BENCHMARKS.md): a copy loop (memory
bandwidth) and a gloo all_reduce of the gradient (transport bandwidth). The bfloat16 step has its
own bound over shared memory: its slice of every peer's bfloat16 gradient (2n bytes), its master,
m, v slices read and written (24n/world), its new bfloat16 parameter slice written (2n/world) and
the peers' new bfloat16 slices copied into its parameters (4n), at the copy probe's bandwidth.

After the timed steps every contender's parameters are compared with ``ddp``'s (max abs error
over max |ddp|, every rank), and ``ddp`` itself with a single-process torch.optim.Adam over the
rank-order sum of the same gradients.

    python benchmarks/data_parallel_adam.py --params 16777216 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
NOTE_CORES = (
    "NOTE: this machine has {cpus} CPU core(s) and the benchmark runs {world} ranks x {threads} "
    "thread(s): the ranks fill the cores, so computation and gloo communication compete for "
    "them (there is no free core to overlap on)."
)
# An extra coconet variant: the per-step safety checks off (fixed shapes, no commit vote), to show
# what they cost. Not a baseline: coconet's defaults are the ones timed under the plain names.
LEAN = "[lean]"  # no per-step shape check and no commit vote: the guarantee's price, measured
LEAN_OPTIONS = {"check_every_step": False, "commit_vote": False, "commit": "swap"}
SWAP = "[swap]"  # every check and the vote; state committed by taking the new storage, no copy
SWAP_OPTIONS = {"commit": "swap"}
SHM, GLOO = "[shm]", "[gloo]"  # coconet's transport: shared memory (one host) or gloo
# Mixed precision (--mixed): the contenders' names, and where their references' masters start
BF16_OPTIM = "coconet.optim.Adam[bf16]"  # bfloat16 parameters, float32 master in the optimizer
REDUCE_BF16_OPTIM = "coconet.optim.Adam[reduce bf16]"  # float32, reduce_dtype=torch.bfloat16
DDP_BF16 = "ddp_bf16"
DEEPSPEED_BF16 = "deepspeed_shm_all_reduce+adam_fused[bf16]"
MIXED = (BF16_OPTIM, REDUCE_BF16_OPTIM, DDP_BF16, DEEPSPEED_BF16)
BF16_PARAMS = "bf16 params"  # the reference's master starts from p0.to(bfloat16).float()
FP32_PARAMS = "fp32 params"  # ... from p0 (float32 parameters, bfloat16 gradients)
RTOL = 1e-5  # an element is an outlier beyond RTOL * max|reference param| (see is_correct)


def load_adam():
    """examples/adam.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("coconet_example_adam", ROOT / "examples/adam.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def gradient(seed: int, rank: int, k: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s gradient number ``k`` (deterministic, so any rank can rebuild any)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 1_009 * (rank + 1) + k)
    return torch.randn(n, generator=gen)


def initial_param(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# -- contenders ---------------------------------------------------------------------------------


class Contender:
    name = ""
    kind = "baseline"
    schedule = ""
    # the max_norm the reference clips the summed gradient to (None: the reference is ddp's)
    clip_norm: float | None = None
    # mixed precision: the initial float32 master its reference starts from (BF16_PARAMS: the
    # bfloat16 parameters widened, FP32_PARAMS: p0) and whose rounded gradients it steps on
    # (``mixed_reference``); None: the float32 step, checked against ddp's
    mixed: str | None = None

    def prepare(self, g: torch.Tensor) -> None:
        """Untimed: put this step's gradient where the contender expects it (as backward would)."""

    def step(self, k: int, g: torch.Tensor) -> None:
        raise NotImplementedError

    def param(self) -> torch.Tensor:
        raise NotImplementedError

    def master(self) -> torch.Tensor | None:
        """The float32 master weights of 16-bit parameters (None: the parameters are float32).
        Called once after the timed steps, on every rank in the same order (it may communicate)."""
        return None


class TorchDDP(Contender):
    """all_reduce(grad) + torch.optim.Adam on one flat parameter."""

    def __init__(self, name: str, p0: torch.Tensor, hp: dict, impl: str) -> None:
        self.name = name
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.opt = torch.optim.Adam([self.p], **hp, **{impl: True})

    def prepare(self, g):
        self.p.grad.copy_(g)

    def step(self, k, g):
        dist.all_reduce(self.p.grad)
        self.opt.step()

    def param(self):
        return self.p.detach()


class Zero(Contender):
    """all_reduce(grad) + ZeroRedundancyOptimizer(Adam fused) over ``chunks`` parameters."""

    def __init__(self, p0: torch.Tensor, hp: dict, chunks: int, bucket_view: bool) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.name = "zero"
        self.params = [torch.nn.Parameter(c.clone()) for c in torch.tensor_split(p0, chunks)]
        self.flat_grad = torch.empty_like(p0)
        for p, view in zip(self.params, torch.tensor_split(self.flat_grad, chunks), strict=True):
            p.grad = view  # as DDP's gradient_as_bucket_view: one buffer, one all_reduce
        self.opt = ZeroRedundancyOptimizer(
            self.params,
            optimizer_class=torch.optim.Adam,
            parameters_as_bucket_view=bucket_view,
            fused=True,
            **hp,
        )

    def prepare(self, g):
        self.flat_grad.copy_(g)

    def step(self, k, g):
        dist.all_reduce(self.flat_grad)
        self.opt.step()

    def param(self):
        return torch.cat([p.detach() for p in self.params])


class Coconet(Contender):
    kind = "coconet"

    def __init__(self, name, target, comm, p0, hp, cache_dir, **options) -> None:
        import coconet
        from coconet.testing import rank_inputs

        self.name = name
        # Like ddp's all_reduce of its own .grad buffer, the step may reduce the gradient in
        # place: each contender gets its own gradient buffer (filled untimed, in prepare) and
        # donates it.
        self.fn = coconet.compile(target, comm=comm, cache_dir=cache_dir, donate=("g",), **options)
        # The gradient buffer lives where the step's collective reads it (symmetric memory on
        # shared memory, as DDP's buckets are its all_reduce's buffers); filled in prepare.
        self.g = self.fn.input_buffer("g", p0.shape)
        lines = [s.strip() for s in self.fn.schedule.splitlines()[1:] if s.strip()]
        self.schedule = "; ".join(lines) or "(none)"
        zeros = torch.zeros_like(p0)
        given = {"p": p0, "m": zeros, "v": zeros}
        state = rank_inputs(self.fn.program, given, comm.mesh, comm.rank)
        self.p, self.m, self.v = state["p"], state["m"], state["v"]
        self.scalars = {
            "lr": hp["lr"],
            "beta1": hp["betas"][0],
            "beta2": hp["betas"][1],
            "eps": hp["eps"],
            "weight_decay": hp["weight_decay"],
        }

    def prepare(self, g):
        self.g.copy_(g)

    def step(self, k, g):
        self.fn(g=self.g, p=self.p, m=self.m, v=self.v, step=float(k + 1), **self.scalars)

    def param(self):
        return self.p


class ShmAllReduce(Contender):
    """coconet's shared-memory all_reduce of a gradient bucket in symmetric memory, then
    ``torch.optim.Adam(fused=True)``: the best unfused step our own transport allows (it isolates
    what fusion itself buys)."""

    name = "shm_all_reduce+adam_fused"

    def __init__(self, comm, p0: torch.Tensor, hp: dict) -> None:
        self.comm = comm
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = comm.symmetric_tensor(p0.shape, p0.dtype)  # a bucket the peers map
        self.opt = torch.optim.Adam([self.p], **hp, fused=True)

    def prepare(self, g):
        self.p.grad.copy_(g)

    def step(self, k, g):
        from coconet.ir.ops import ReduceOp

        work = self.comm.all_reduce_start(
            self.p.grad, ReduceOp.SUM, axis=None, donate=True, label="grad"
        )
        self.comm.wait(work)  # donated: reduced in place, into the bucket
        self.opt.step()

    def param(self):
        return self.p.detach()


class DeepSpeedShm(Contender):
    """DeepSpeed's CPU shared-memory all_reduce (``deepspeed.comm.inference_all_reduce``) of the
    gradient, then ``torch.optim.Adam(fused=True)``: the best published peer on one host. Only
    when DeepSpeed is installed (the ``bench`` extra); see ``deepspeed_available``."""

    name = "deepspeed_shm_all_reduce+adam_fused"

    def __init__(self, p0: torch.Tensor, hp: dict) -> None:
        import deepspeed.comm as ds

        self.all_reduce = ds.inference_all_reduce
        self.p = torch.nn.Parameter(p0.clone())
        self.p.grad = torch.empty_like(self.p)
        self.opt = torch.optim.Adam([self.p], **hp, fused=True)

    def prepare(self, g):
        self.p.grad.copy_(g)

    def step(self, k, g):
        self.all_reduce(self.p.grad)  # in place, float32 SUM
        self.opt.step()

    def param(self):
        return self.p.detach()


def deepspeed_available(world: int) -> str:
    """Set DeepSpeed up over the existing process group: '' when its shared-memory all_reduce
    runs, else why not (then the contender is left out, and the report says why).

    DeepSpeed needs ``LOCAL_SIZE`` = the ranks on this host (else its ranks segfault) and falls
    back to gloo silently when its op did not build or the CPU lacks the vector ISA: both are
    checked here, so a row labelled DeepSpeed is DeepSpeed's shared memory."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what it runs on here; no guessing banner
    try:
        import deepspeed.comm as ds
    except ImportError:
        return "DeepSpeed is not installed (pip install -e '.[bench]', see benchmarks/README.md)"
    os.environ["LOCAL_SIZE"] = str(world)
    ds.init_distributed(dist_backend="gloo", verbose=False)
    cdb = ds.comm.cdb
    op = getattr(cdb, "shm_comm_op", None)
    if op is None or not hasattr(torch.ops, "deepspeed"):
        return "DeepSpeed's shared-memory op did not build: it would fall back to gloo"
    if not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        return "DeepSpeed registered no inference_all_reduce_ op: it would fall back to gloo"
    if getattr(cdb, "shm_vector_kernel_level", 0) < 1:
        return "this CPU lacks the ISA DeepSpeed's float32 kernel needs: it would use gloo"
    return ""


def remove_deepspeed_segments() -> list[str]:
    """DeepSpeed leaves its workspace in /dev/shm (one file per rank, never unlinked): remove
    this job's, so the benchmark leaves nothing behind. Returns what was removed."""
    prefix = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
        f"{os.environ.get('MASTER_PORT')}_"
    )
    removed = []
    for path in Path("/dev/shm").glob(prefix + "*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


class CoconetOptim(Contender):
    """``coconet.optim.Adam`` as a user writes it: one parameter whose ``.grad`` backward would
    fill (a view of the optimizer's bucket in symmetric memory), ``opt.step()``. It averages the
    gradient (as DDP does) where this benchmark sums: ``prepare`` writes ``world * g`` into the
    bucket, exact for a power-of-two world, so every contender computes the same step."""

    kind = "coconet"
    name = "coconet.optim.Adam"

    def __init__(self, comm, p0: torch.Tensor, hp: dict, storage: str = "per-rank",
                 groups: int | str = 1, clip: float | None = None,
                 param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        import coconet.optim

        self.world = comm.world
        if storage != "per-rank":
            self.name = f"{CoconetOptim.name}[{storage}]"
        precision = ""
        if param_dtype == torch.bfloat16:
            # bfloat16 parameters (and gradients): a float32 master copy in the optimizer
            self.name, self.mixed = BF16_OPTIM, BF16_PARAMS
            precision = (
                ", bfloat16 parameters and gradients (float32 master, m, v slices; the "
                "gradients reduced in float32, rounded once to bfloat16)"
            )
            p0 = p0.to(torch.bfloat16)
        elif reduce_dtype == torch.bfloat16:
            self.name, self.mixed = REDUCE_BF16_OPTIM, FP32_PARAMS
            precision = (
                ", reduce_dtype=torch.bfloat16 (each rank's float32 gradient cast to "
                "bfloat16, reduced in float32, rounded once to bfloat16)"
            )
        if groups == SMALL_SECOND:
            # nanoGPT's decay / no-decay groups: the second (biases, LayerNorm weights) small
            n = p0.numel()
            self.sizes = [n - n // 64, n // 64]
            self.name += f"[{SMALL_SECOND}]"
        elif groups > 1:
            self.sizes = [len(part) for part in p0.tensor_split(groups)]
            self.name += f"[{groups}-groups]"
        else:
            self.sizes = [p0.numel()]
        # max_grad_norm=CLIP_NEVER: so large that the factor is always 1: the clip's whole cost
        # when it does not clip (the norm, its all_reduce, or the norm pass over several
        # buckets), the same result. CLIP_ALWAYS: it clips at every step (the reference too)
        if clip == CLIP_NEVER:
            self.name += "[clip]"
        elif clip is not None:
            self.name += "[clip-active]"
            self.clip_norm = clip
        # param groups over parts of the parameter (equal, or SMALL_SECOND): a bucket each
        self.ps = [torch.nn.Parameter(part.clone()) for part in p0.split(self.sizes)]
        self.opt = coconet.optim.Adam(
            [{"params": [p]} for p in self.ps], **hp, comm=comm, param_storage=storage,
            max_grad_norm=clip, reduce_dtype=reduce_dtype,
        )
        clipping = "" if clip is None else (
            ", max_grad_norm= (the norm computed, never clipping)" if clip == CLIP_NEVER
            else f", max_grad_norm={clip:g} (clipping at every step)")
        self.schedule = (
            f"coconet.optim default (fuse_RS_C_AG, state sliced, commit swap), {storage} "
            f"parameters, {len(self.sizes)} param group(s) of {self.sizes} elements{clipping}"
            f"{precision}"
        )
        self.fn = self.opt.buckets[0].step_fn

    def prepare(self, g):
        # (bfloat16 parameters: world * g computed in float32, rounded to nearest bfloat16)
        for p, part in zip(self.ps, g.split(self.sizes), strict=True):
            torch.mul(part, self.world, out=p.grad)

    def step(self, k, g):
        self.opt.step()

    def param(self):
        return torch.cat([p.detach() for p in self.ps])

    def master(self):
        if self.mixed != BF16_PARAMS:
            return None
        state = self.opt.state_dict()["state"]  # collective: every rank calls it
        return torch.cat([state[i]["master_param"].reshape(-1) for i in range(len(self.ps))])


class MasterBf16(Contender):
    """bfloat16 parameters without coconet, as DDP users run them: the bfloat16 gradient
    all-reduced (``all_reduce``: gloo's or DeepSpeed's, SUM in place), divided by world into a
    float32 master's ``.grad`` (DDP averages; ``prepare`` writes ``world * g`` rounded to bfloat16,
    as for coconet.optim, so it is the same step), ``torch.optim.Adam(fused=True)`` on the master,
    the master cast (round to nearest) into the bfloat16 parameter."""

    mixed = BF16_PARAMS

    def __init__(self, name: str, p0: torch.Tensor, hp: dict, world: int, all_reduce,
                 transport: str) -> None:  # fmt: skip
        self.name, self.world, self.all_reduce = name, world, all_reduce
        self.p = torch.nn.Parameter(p0.to(torch.bfloat16))
        self.p.grad = torch.empty_like(self.p)
        self.m = torch.nn.Parameter(self.p.detach().float())
        self.m.grad = torch.empty_like(self.m)
        self.opt = torch.optim.Adam([self.m], **hp, fused=True)
        self.schedule = (
            f"{transport} of the bfloat16 gradient (bfloat16 SUM, in place); "
            "torch.div(grad, world, out=master.grad) (widened to float32); "
            "torch.optim.Adam(fused=True) on the float32 master; param.copy_(master) (rounded to "
            "bfloat16)"
        )

    def prepare(self, g):
        torch.mul(g, self.world, out=self.p.grad)

    def step(self, k, g):
        self.all_reduce(self.p.grad)
        torch.div(self.p.grad, self.world, out=self.m.grad)
        self.opt.step()
        self.p.detach().copy_(self.m.detach())

    def param(self):
        return self.p.detach()

    def master(self):
        return self.m.detach()


class CopyProbe(Contender):
    """A copy loop: the memory bandwidth each rank sees while the other rank runs too."""

    name, kind = "probe:copy", "probe"

    def __init__(self, n: int) -> None:
        self.src, self.dst = torch.randn(n), torch.empty(n)

    def step(self, k, g):
        self.dst.copy_(self.src)


class InPlaceProbe(Contender):
    """An in-place read-modify-write loop (``x += y``, as torch's fused Adam updates p, m, v):
    the bandwidth of a pass whose writes land on lines it has just read (no read for ownership),
    which the copy probe's out-of-place writes pay."""

    name, kind = "probe:in_place", "probe"

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n), torch.randn(n)

    def step(self, k, g):
        self.x.add_(self.y, alpha=1e-30)


class AllReduceProbe(Contender):
    """gloo all_reduce of the gradient's size: the transport bandwidth."""

    name, kind = "probe:all_reduce", "probe"

    def __init__(self, n: int) -> None:
        self.buf = torch.ones(n)

    def step(self, k, g):
        dist.all_reduce(self.buf)


# -- the ranks ----------------------------------------------------------------------------------


class AlignedStart:
    """Starts every rank's timed step within about a microsecond of the others.

    A gloo barrier alone releases the ranks up to milliseconds apart on this VM (measured: median
    20 us, but p90 3.9 ms when the ranks ran different work before it, as they do between
    contenders): a rank that waited in it has its vCPU halted and woken late, and the rank that
    left first then waits for it inside the step it times, which puts the barrier's skew into
    that contender's time. So after the barrier each rank bumps its own counter in a page of
    shared memory and busy-polls the others' (no sleep, nothing to wake): every contender's
    step starts from the same instant on every rank. The file is unlinked as soon as every rank
    mapped it (nothing is left in /dev/shm, even if a rank dies)."""

    LINE = 8  # int64 words per rank: one cache line each
    TIMEOUT_S = 120.0

    def __init__(self, rank: int, world: int) -> None:
        import numpy as np

        name = [f"/dev/shm/coconet-bench-start-{os.getpid()}-{time.time_ns()}" if rank == 0
                else None]
        dist.broadcast_object_list(name, src=0)
        path = name[0]
        if rank == 0:
            with open(path, "wb") as f:
                f.write(bytes(8 * self.LINE * world))
        dist.barrier()
        flags = torch.from_file(path, shared=True, size=self.LINE * world, dtype=torch.int64)
        dist.barrier()
        if rank == 0:
            os.unlink(path)
        self.flags = flags  # kept: the numpy view below does not own the mapping
        self.words = np.asarray(flags.numpy())
        self.rank, self.world, self.count = rank, world, 0

    def __call__(self) -> None:
        self.count += 1
        k, words, line = self.count, self.words, self.LINE
        words[self.rank * line] = k
        deadline = time.monotonic() + self.TIMEOUT_S
        for j in range(self.world):
            spins = 0
            while words[j * line] < k:
                spins += 1
                if spins % 100_000 == 0 and time.monotonic() > deadline:
                    raise RuntimeError(f"rank {j} did not reach the aligned start in "
                                       f"{self.TIMEOUT_S:g} s")


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    rank, world, n, seed = comm.rank, comm.world, cfg["params"], cfg["seed"]
    adam = load_adam()
    hp = {
        "lr": f32(adam.LR),
        "betas": (f32(adam.BETAS[0]), f32(adam.BETAS[1])),
        "eps": f32(adam.EPS),
        "weight_decay": f32(adam.WEIGHT_DECAY),
    }
    say = (lambda *a: print("  [rank 0]", *a, file=sys.stderr, flush=True)) if rank == 0 else None
    grads = [gradient(seed, rank, k, n) for k in range(cfg["distinct_grads"])]
    p0 = initial_param(seed, n)
    wanted = cfg["contenders"]

    # Collective algorithms: measured once here (coconet does it on first use otherwise), so that
    # the first-call times below are compilation, not tuning.
    from coconet.ir.ops import Op
    from coconet.runtime.tuning import size_class

    t0 = time.perf_counter()
    cls = size_class(n * 4)
    tuned = (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER)
    choices = {op.value: comm.measure(op, cls).to_json() for op in tuned}
    tuning_s = time.perf_counter() - t0
    if say:
        say(
            f"collective algorithms measured in {tuning_s:.1f} s: "
            + ", ".join(f"{op} -> {c['algorithm']}" for op, c in choices.items())
        )

    contenders: list[Contender] = [CopyProbe(n), InPlaceProbe(n), AllReduceProbe(n)]
    # coconet on each transport: the default communicator uses shared memory among the ranks of
    # one host; a second one over the same processes runs on gloo.
    from coconet.runtime import CommOptions, Communicator

    gloo = Communicator(
        comm.mesh,
        CommOptions(
            timeout=comm.options.timeout, cache_dir=cfg["cache_dir"], transport="torch.distributed"
        ),
    )
    on = {SHM: comm, GLOO: gloo}
    if "shm_all_reduce+adam_fused" in wanted:
        contenders.append(ShmAllReduce(comm, p0, hp))
    if CoconetOptim.name in wanted:
        contenders.append(CoconetOptim(comm, p0, hp))
    if HOST_SHARED_OPTIM in wanted:
        contenders.append(CoconetOptim(comm, p0, hp, storage="host-shared"))
    for name, (groups, clip) in CLIP_OPTIMS.items():
        if name in wanted:
            contenders.append(CoconetOptim(comm, p0, hp, groups=groups, clip=clip))
    if BF16_OPTIM in wanted:
        contenders.append(CoconetOptim(comm, p0, hp, param_dtype=torch.bfloat16))
    if REDUCE_BF16_OPTIM in wanted:
        contenders.append(CoconetOptim(comm, p0, hp, reduce_dtype=torch.bfloat16))
    if DDP_BF16 in wanted:
        contenders.append(MasterBf16(DDP_BF16, p0, hp, world, dist.all_reduce,
                                     "dist.all_reduce over gloo"))  # fmt: skip
    skipped: dict[str, str] = {}
    deepspeed = [name for name in (DEEPSPEED, DEEPSPEED_BF16) if name in wanted]
    if deepspeed:
        why = deepspeed_available(world)
        for name in deepspeed:
            if why:
                skipped[name] = why
                if say:
                    say(f"{name} left out: {why}")
            elif name == DEEPSPEED:
                contenders.append(DeepSpeedShm(p0, hp))
            else:
                import deepspeed.comm as ds

                contenders.append(MasterBf16(DEEPSPEED_BF16, p0, hp, world,
                                             ds.inference_all_reduce,
                                             "deepspeed.comm.inference_all_reduce"))  # fmt: skip
    if "ddp" in wanted:
        contenders.append(TorchDDP("ddp", p0, hp, "fused"))
    if "ddp_foreach" in wanted:
        contenders.append(TorchDDP("ddp_foreach", p0, hp, "foreach"))
    if "zero" in wanted:
        contenders.append(Zero(p0, hp, cfg["zero_chunks"] or world, cfg["zero_bucket_view"]))
    program = adam.program()
    targets: dict[str, Any] = {"coconet:unscheduled": program}
    for sname, make in adam.SCHEDULES.items():
        targets[f"coconet:{sname}"] = make(program)
    for name, target in targets.items():
        for transport, on_comm in on.items():
            if f"{name}{transport}" in wanted:
                contenders.append(
                    Coconet(f"{name}{transport}", target, on_comm, p0, hp, cfg["cache_dir"])
                )
            for suffix, options in ((SWAP, SWAP_OPTIONS), (LEAN, LEAN_OPTIONS)):
                if f"{name}{transport}{suffix}" in wanted:
                    contenders.append(
                        Coconet(
                            f"{name}{transport}{suffix}",
                            target,
                            on_comm,
                            p0,
                            hp,
                            cfg["cache_dir"],
                            **options,
                        )
                    )
    names = [c.name for c in contenders]

    rounds = 1 + cfg["warmup"] + cfg["steps"]
    start = AlignedStart(rank, world)
    first = torch.zeros(len(contenders), dtype=torch.float64)
    times = torch.zeros(len(contenders), cfg["steps"], dtype=torch.float64)
    for r in range(rounds):
        if say and r <= 1:
            say(
                "first call of every contender (compiles coconet's kernels)"
                if r == 0
                else f"warm-up ({cfg['warmup']} rounds), then {cfg['steps']} timed rounds"
            )
        g = grads[r % len(grads)]
        for i, c in enumerate(contenders):
            c.prepare(g)
            dist.barrier()
            start()  # every rank from the same instant (the barrier alone: ms apart)
            t = time.perf_counter()
            c.step(r, g)
            dt = (time.perf_counter() - t) * 1e3
            if r == 0:
                first[i] = dt
            elif r > cfg["warmup"]:
                times[i, r - 1 - cfg["warmup"]] = dt
    dist.all_reduce(first, op=dist.ReduceOp.MAX)  # the slowest rank's time, step by step
    dist.all_reduce(times, op=dist.ReduceOp.MAX)

    # Correctness: every contender against ddp (and across ranks), ddp against plain torch (and
    # every contender against plain torch where ddp was not run).
    if say:
        say("checking every contender's parameters against ddp's")
    ref = next(c for c in contenders if c.name == "ddp").param() if "ddp" in names else None
    checked = [c for c in contenders if c.kind != "probe"]
    mixed_refs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    vectors = []
    for c in checked:
        mine = c.param()
        master = c.master()  # (coconet.optim's: gathered by state_dict(), on every rank)
        across = 0.0
        for mine_t in (mine, master):
            if mine_t is not None:  # (float32: a bfloat16 broadcast exactly, on any backend)
                rank0 = mine_t.to(torch.float32, copy=True)  # (a copy, float32 or not)
                dist.broadcast(rank0, src=0)
                across = max(across, (mine_t.float() - rank0).abs().max().item())
        # 16-bit parameters: exactly the rounding of their float32 master (elements that differ)
        unrounded = 0.0 if master is None else float((mine != master.to(mine.dtype)).sum().item())
        if c.mixed is not None:
            if c.mixed not in mixed_refs:
                mixed_refs[c.mixed] = mixed_reference(
                    c.mixed, p0, hp, seed, world, n, cfg["distinct_grads"], rounds
                )
            want, ill = mixed_refs[c.mixed]
            errs = compare(mine if master is None else master, want, exempt=ill)
            vectors.append([errs[k] for k in ERR_KEYS] + [across, unrounded, ill.sum().item()])
            continue
        if c.name == "ddp":
            want = torch_reference(p0, hp, seed, world, n, cfg["distinct_grads"], rounds)
        elif c.clip_norm is not None:
            want = torch_reference(p0, hp, seed, world, n, cfg["distinct_grads"], rounds,
                                   clip=c.clip_norm)
        else:
            if ref is None:  # ddp not run: the plain single-process torch reference instead
                ref = torch_reference(p0, hp, seed, world, n, cfg["distinct_grads"], rounds)
            want = ref
        errs = compare(mine, want)
        vectors.append([errs[k] for k in ERR_KEYS] + [across, unrounded, 0.0])
    err_t = torch.tensor(vectors, dtype=torch.float64).reshape(len(checked), len(ERR_KEYS) + 3)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)  # the worst rank
    errors = {}
    for c, vec in zip(checked, err_t.tolist(), strict=True):
        across, unrounded, ill = vec[-3:]
        errors[c.name] = dict(zip(ERR_KEYS, vec[:-3], strict=True))
        errors[c.name]["max_abs_diff_across_ranks"] = across
        errors[c.name]["correct"] = (is_correct(errors[c.name], n, hp["lr"]) and across == 0.0
                                     and unrounded == 0.0)  # fmt: skip
        if c.mixed is not None:  # (left out of the norm and the outliers, within lr)
            errors[c.name]["ill_conditioned"] = ill
        if c.mixed == BF16_PARAMS:  # (their masters compared, the parameters their rounding)
            errors[c.name]["params_not_master_rounding"] = unrounded

    if DEEPSPEED in wanted and DEEPSPEED not in skipped:
        dist.barrier()  # every rank is done with DeepSpeed's workspace
        removed = remove_deepspeed_segments()
        if say and removed:
            say(f"removed DeepSpeed's /dev/shm workspace: {', '.join(sorted(removed))}")

    out = []
    for i, c in enumerate(contenders):
        row = {
            "name": c.name,
            "kind": c.kind,
            "first_call_ms": round(first[i].item(), 3),
            "steps_ms": [round(x, 3) for x in times[i].tolist()],
        }
        if c.name in errors:
            row.update(errors[c.name])
            row["compared_with"] = (
                "torch.optim.Adam (one process)" if c.name == "ddp" else
                f"clipped to {c.clip_norm:g} by the float64 norm + torch.optim.Adam (one "
                "process)"
                if c.clip_norm is not None else MIXED_COMPARED[c.mixed] if c.mixed else "ddp")
        if c.kind == "coconet" or c.schedule:
            row["schedule"] = c.schedule
        if c.kind == "coconet":
            row["kernel_first_call_s"] = {
                k: round(v, 3) for k, v in c.fn.kernels.first_call_seconds.items()
            }
        out.append(row)
    return {
        "rows": out,
        "tuning_s": tuning_s,
        "choices": choices,
        "threads": torch.get_num_threads(),
        "skipped": skipped,
    }


def torch_reference(p0, hp, seed, world, n, distinct, rounds, clip=None) -> torch.Tensor:
    """The parameters after ``rounds`` steps of a single-process torch.optim.Adam (single-tensor)
    over the rank-order sum of every rank's gradients: what ddp must compute (``clip``: the sum
    clipped to that norm first by ``clip_grad_norm_``'s formula, ``min(clip / (norm + 1e-6),
    1)``, with the norm computed in float64 and rounded: torch's own float32 ``vector_norm``
    drifts by ~8e-5 relative over 4M elements on one thread here, more than the check allows,
    while coconet's sum of squares is within ~4e-7 of the float64 norm)."""
    sums = []
    for k in range(distinct):
        total = gradient(seed, 0, k, n)
        for r in range(1, world):
            total = total + gradient(seed, r, k, n)
        sums.append(total)
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adam([p], **hp, foreach=False)
    for r in range(rounds):
        p.grad = sums[r % distinct].clone()
        if clip is not None:
            norm = p.grad.double().norm().float()
            p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
        opt.step()
    return p.detach()


def mixed_reference(mixed, p0, hp, seed, world, n, distinct, rounds
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The float32 master after ``rounds`` steps of a single-process torch.optim.Adam
    (single-tensor) on what a bfloat16 reduction makes of the gradients: rank r writes
    ``world * g_r`` (averaged, as coconet.optim and DDP: see ``CoconetOptim``) rounded to
    bfloat16; the sum of those, widened, in float32 in rank order, rounded once to bfloat16,
    widened and divided by world. The master starts from ``p0`` rounded to bfloat16
    (``BF16_PARAMS``) or from ``p0`` (``FP32_PARAMS``: float32 parameters, ``reduce_dtype=``).

    Also returns the elements whose update is ill-conditioned (``is_correct``): at a step where
    the element has no history (``exp_avg_sq`` below ``ILL_CONDITIONED**2``) ``g +
    weight_decay * p`` cancels to within ``ILL_CONDITIONED`` (in float64), where the update
    ``lr * g' / (|g'| + eps)`` moves by ``lr / eps`` per unit of g': one rounding of
    ``weight_decay * p`` (fused multiply-add or not: torch's Adam does not round the product,
    coconet's kernel does) moves it by up to ~4e-3 * lr. With bfloat16 gradients and
    parameters both on a coarse grid, ``g == -weight_decay * p`` holds exactly for ~12
    elements per million (measured: 1M parameters, first step), far more than the few per
    million of float32 data."""
    sums = []
    for k in range(distinct):
        total = torch.zeros(n)
        for r in range(world):
            total += (gradient(seed, r, k, n) * world).to(torch.bfloat16).float()
        sums.append(total.to(torch.bfloat16).float() / world)
    start = p0.to(torch.bfloat16).float() if mixed == BF16_PARAMS else p0.clone()
    master = torch.nn.Parameter(start)
    opt = torch.optim.Adam([master], **hp, foreach=False)
    ill = torch.zeros(n, dtype=torch.bool)
    for r in range(rounds):
        master.grad = sums[r % distinct].clone()
        fresh = opt.state[master]["exp_avg_sq"] < ILL_CONDITIONED**2 if r else ill.logical_not()
        g_wd = master.grad.double().add(master.detach().double(), alpha=hp["weight_decay"])
        ill |= fresh & (g_wd.abs() < ILL_CONDITIONED)
        opt.step()
    return master.detach(), ill


ILL_CONDITIONED = 1e-6  # |g + weight_decay * p| below this (with no history): see mixed_reference
MIXED_COMPARED = {
    BF16_PARAMS: "its float32 master against torch.optim.Adam (one process) on a float32 master "
    "from p0.to(bf16), over sum_r(g_r.to(bf16).float()).to(bf16).float() / world; the bfloat16 "
    "parameters exactly the master's rounding",
    FP32_PARAMS: "torch.optim.Adam (one process) over sum_r(g_r.to(bf16).float()).to(bf16)"
    ".float() / world",
}
ERR_KEYS = ("max_rel_err", "norm_rel_err", "outliers", "max_abs_err")


def compare(actual: torch.Tensor, want: torch.Tensor, chunk: int = 1 << 22,
            exempt: torch.Tensor | None = None) -> dict:  # fmt: skip
    """Errors of ``actual`` against ``want`` (see ``is_correct``), in float64, ``chunk``
    elements at a time (whole-tensor float64 temporaries on both ranks at once took this
    machine's memory at 64M parameters). ``exempt``: a mask of elements whose update the
    reference found ill-conditioned (``mixed_reference``): left out of the norm and of the
    outliers, still in the max error (which must stay within lr)."""
    a, w = actual.reshape(-1), want.reshape(-1)
    scale = max((w[i : i + chunk].double().abs().max().item()
                 for i in range(0, w.numel(), chunk)), default=0.0)
    max_diff, diff_sq, want_sq, outliers = 0.0, 0.0, 0.0, 0
    for i in range(0, w.numel(), chunk):
        wd = w[i : i + chunk].double()
        diff = (a[i : i + chunk].double() - wd).abs()
        max_diff = max(max_diff, diff.max().item())
        if exempt is not None:
            diff = diff.masked_fill(exempt.reshape(-1)[i : i + chunk], 0.0)
        diff_sq += diff.square().sum().item()
        want_sq += wd.square().sum().item()
        outliers += int((diff > RTOL * scale).sum().item())
    return {
        "max_rel_err": max_diff / scale,
        "norm_rel_err": diff_sq**0.5 / want_sq**0.5,
        "outliers": float(outliers),
        "max_abs_err": max_diff,
    }


def is_correct(errs: dict, n: int, lr: float) -> bool:
    """Within float32 rounding of the reference.

    Adam's update ``lr * m / (sqrt(v) + eps)`` is ill-conditioned where ``g + weight_decay * p``
    cancels to about ``eps``: there the last bit of that sum (which implementations round
    differently: fused multiply-add or not) moves the update by up to ``lr``. With random data a
    few such elements occur per million (at 16M parameters the worst one is off by 3e-5 after one
    step), so the criterion is: the error is at rounding level as a whole (norm-wise relative
    error <= 1e-6), at most one element per million (at least one) is beyond RTOL * max|ref|, and
    no element is off by more than ``lr`` (one step's largest move).
    """
    allowed = max(1, n // 1_000_000)
    return bool(
        errs["norm_rel_err"] <= 1e-6 and errs["outliers"] <= allowed and errs["max_abs_err"] <= lr
    )


# -- the report ---------------------------------------------------------------------------------


def summarize(rows: list[dict]) -> None:
    for row in rows:
        ts = row["steps_ms"]
        row["median_ms"] = round(statistics.median(ts), 3)
        row["min_ms"] = round(min(ts), 3)
        row["max_ms"] = round(max(ts), 3)


def lower_bound(rows: list[dict], n: int, world: int) -> dict:
    by = {r["name"]: r for r in rows}
    copy_ms = by["probe:copy"]["median_ms"]
    ar_ms = by["probe:all_reduce"]["median_ms"]
    copy_gbs = 2 * 4 * n / copy_ms / 1e6  # read + write
    bus_bytes = 2 * (world - 1) / world * 4 * n  # what an all_reduce puts on the wire per rank
    bus_gbs = bus_bytes / ar_ms / 1e6
    # A data-parallel step must at least reduce-scatter the gradient and all-gather the new
    # parameters: (world-1)/world of the tensor each way, per rank = an all_reduce's bus bytes.
    wire_bytes = bus_bytes
    # and update its 1/world of the parameters: read g_sum, p, m, v; write p, m, v.
    mem_bytes = 7 * 4 * n / world
    comm_ms = wire_bytes / bus_gbs / 1e6
    mem_ms = mem_bytes / copy_gbs / 1e6
    # Over shared memory there is no wire, only bytes each rank must read and write: its slice
    # of every peer's gradient (4n), its p, m, v slices (read) and m, v and the new p slice
    # (written: 24n/world together), and the peers' new p slices copied into its parameters
    # (read and write: 8n).
    shm_bytes = 4 * n + 24 * n / world + 8 * n
    shm_ms = shm_bytes / copy_gbs / 1e6
    # An all_reduce over shared memory, then Adam over all of the parameters (the unfused
    # contenders: shm_all_reduce+adam_fused, DeepSpeed's): the all_reduce reads its slice of every
    # peer's gradient (4n), writes its reduced slice (4n/world) and copies the peers' reduced
    # slices into its gradient (8n (world-1)/world); Adam reads g, p, m, v and writes p, m, v
    # over all n (28n). Their real bound, not gloo's bus time.
    # Adam's pass is in place (its writes land on lines it just read): at the in-place probe's
    # bandwidth, which is higher than the copy probe's (no read for ownership), so this bound is
    # honest for it; the all_reduce's writes are out of place (copy probe).
    in_place_gbs = 3 * 4 * n / by["probe:in_place"]["median_ms"] / 1e6  # read x, y; write x
    all_reduce_bytes = 4 * n + 4 * n / world + 8 * n * (world - 1) / world
    unfused_bytes = all_reduce_bytes + 28 * n
    unfused_ms = (all_reduce_bytes / copy_gbs + 28 * n / in_place_gbs) / 1e6
    # With host-shared parameters (coconet.runtime.replica) the peers' new p slices are not
    # copied: its slice of every peer's gradient, its p, m, v slices read, m, v and its new p
    # slice written (out of place: copy probe).
    host_shared_bytes = 4 * n + 24 * n / world
    host_shared_ms = host_shared_bytes / copy_gbs / 1e6
    # The bfloat16 step (coconet.optim.Adam[bf16]: bfloat16 parameters and gradients, a float32
    # master, m, v sliced) over shared memory: its slice of every peer's bfloat16 gradient (2n),
    # its float32 master, m, v slices read (12n/world) and written (12n/world), its new bfloat16
    # parameter slice written (2n/world), and the peers' new bfloat16 slices copied into its
    # parameters (read and write: 4n).
    bf16_bytes = 2 * n + 12 * n / world + 12 * n / world + 2 * n / world + 4 * n
    bf16_ms = bf16_bytes / copy_gbs / 1e6
    # float32 parameters with reduce_dtype=torch.bfloat16 (coconet.optim.Adam[reduce bf16]): its
    # float32 gradient cast into a bfloat16 buffer the peers read (read 4n, write 2n), its slice
    # of every peer's bfloat16 gradient (2n), then as the float32 step: its p, m, v slices read,
    # m, v and the new p slice written (24n/world), the peers' new p slices copied (8n). More
    # bytes than the float32 step's (the cast), on shared memory: the halved traffic pays only
    # where the gradient crosses a wire.
    reduce_bf16_bytes = 4 * n + 2 * n + 2 * n + 24 * n / world + 8 * n
    reduce_bf16_ms = reduce_bf16_bytes / copy_gbs / 1e6
    # Exact clipping that clips (``max_grad_norm=`` with a factor below 1, torch's
    # clip_grad_norm_ of the averaged gradient): the norm of the whole reduced gradient must be
    # known before any element's update, so the reduced slice that the one-pass step keeps in
    # registers is written once (4n/world) and read again (4n/world) after the norm's scalar
    # round; re-reading every peer's piece instead costs 4n, more for every world >= 2. Any
    # form that clips exactly moves at least this; a factor of 1 (never clipping) needs none of it
    # (the speculative step's norm rides in the update's pass).
    clip_active_bytes = shm_bytes + 8 * n / world
    clip_active_ms = clip_active_bytes / copy_gbs / 1e6
    return {
        "clip_active_shared_memory_bytes_per_rank": int(clip_active_bytes),
        "clip_active_shared_memory_ms": round(clip_active_ms, 3),
        "clip_active_over_step_bound": round(clip_active_bytes / shm_bytes, 3),
        "bf16_shared_memory_bytes_per_rank": int(bf16_bytes),
        "bf16_shared_memory_ms": round(bf16_ms, 3),
        "reduce_bf16_shared_memory_bytes_per_rank": int(reduce_bf16_bytes),
        "reduce_bf16_shared_memory_ms": round(reduce_bf16_ms, 3),
        "shared_memory_bytes_per_rank": int(shm_bytes),
        "shared_memory_ms": round(shm_ms, 3),
        "shared_memory_unfused_bytes_per_rank": int(unfused_bytes),
        "shared_memory_unfused_ms": round(unfused_ms, 3),
        "host_shared_bytes_per_rank": int(host_shared_bytes),
        "host_shared_ms": round(host_shared_ms, 3),
        "in_place_GBps": round(in_place_gbs, 3),
        "copy_GBps": round(copy_gbs, 3),
        "all_reduce_bus_GBps": round(bus_gbs, 3),
        "wire_bytes_per_rank": int(wire_bytes),
        "memory_bytes_per_rank": int(mem_bytes),
        "communication_ms": round(comm_ms, 3),
        "memory_ms": round(mem_ms, 3),
        "overlapped_ms": round(max(comm_ms, mem_ms), 3),
        "serial_ms": round(comm_ms + mem_ms, 3),
    }


def is_fused_shm(name: str) -> bool:
    """coconet's one-pass float32 data-parallel steps over shared memory (the fused forms; not
    the mixed-precision ones, which have targets of their own)."""
    if name in MIXED:
        return False
    return name.startswith(CoconetOptim.name) or name.startswith(f"coconet:fuse_RS_C_AG{SHM}")


def own_bound(name: str, lb: dict) -> float | None:
    """The lower bound of the bytes this contender's own form must move (None: not one of the
    shared-memory forms the bounds describe)."""
    if name == BF16_OPTIM:
        return lb["bf16_shared_memory_ms"]
    if name == REDUCE_BF16_OPTIM:
        return lb["reduce_bf16_shared_memory_ms"]
    if "[host-shared]" in name:
        return lb["host_shared_ms"]
    if name.endswith("[clip-active]") and "clip_active_shared_memory_ms" in lb:
        return lb["clip_active_shared_memory_ms"]
    if is_fused_shm(name):
        return lb["shared_memory_ms"]
    if name in ("shm_all_reduce+adam_fused", DEEPSPEED):
        return lb["shared_memory_unfused_ms"]
    return None


# (target, the baseline's name, threshold): the best fused coconet step against each baseline
TARGETS = [
    ("best fused coconet step: speedup over shm_all_reduce+adam_fused", "shm_all_reduce+adam_fused",
     1.4),
    ("best fused coconet step: speedup over DeepSpeed's shm all_reduce + fused Adam",
     DeepSpeedShm.name,
     2.0),
    ("best fused coconet step: speedup over ddp", "ddp", 2.5),
    ("best fused coconet step: speedup over zero", "zero", 3.0),
]
# (target, the slower contender, the faster one, threshold): speedups (slower's median over the
# faster's) of the mixed-precision steps
MIXED_TARGETS = [
    ("bf16 step: speedup over coconet fp32 step", CoconetOptim.name, BF16_OPTIM, 1.4),
    ("bf16 step: speedup over ddp bf16", DDP_BF16, BF16_OPTIM, 3.0),
    ("bf16 step: speedup over deepspeed", DEEPSPEED_BF16, BF16_OPTIM, 2.0),
    (
        "bf16 grads on fp32 params: speedup over fp32 reduce",
        CoconetOptim.name,
        REDUCE_BF16_OPTIM,
        1.25,
    ),
]
BF16_BOUND_TARGET = ("bf16 step: time over its own bound", 1.15)


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, from this run's medians: each a ratio, its threshold and whether it
    is met (a baseline not run gives no entry)."""
    by = {r["name"]: r for r in rows}
    fused = [r for r in rows if is_fused_shm(r["name"]) and r.get("correct", True)]
    if not fused:
        return mixed_targets(by)
    best = min(fused, key=lambda r: r["median_ms"])
    out = []
    for what, baseline, threshold in TARGETS:
        if baseline in by:
            ratio = by[baseline]["median_ms"] / best["median_ms"]
            out.append({"target": what, "contender": best["name"], "measured": round(ratio, 3),
                        "threshold": threshold, "met": ratio >= threshold})
    for name, (groups, clip) in CLIP_OPTIMS.items():
        unclipped = CoconetOptim.name + (f"[{SMALL_SECOND}]" if groups == SMALL_SECOND else
                                         f"[{groups}-groups]" if groups > 1 else "")
        if clip is None or name not in by or unclipped not in by:
            continue
        ratio = by[name]["median_ms"] / by[unclipped]["median_ms"]
        how = "never clipping" if clip == CLIP_NEVER else "clipping at every step"
        out.append({"target": f"max_grad_norm= ({how}): time over the step without",
                    "contender": name, "measured": round(ratio, 3), "threshold": 1.05,
                    "met": ratio <= 1.05})
        if clip != CLIP_NEVER and "x_bound" in by[name]:
            # the 1.05 is below what exact clipping must move (lower_bound's
            # clip_active_*): this says how close the step is to that
            out.append({"target": f"max_grad_norm= ({how}): time over its own lower bound",
                        "contender": name, "measured": by[name]["x_bound"], "threshold": 1.1,
                        "met": by[name]["x_bound"] <= 1.1})
    if "x_bound" in best:
        out.append({"target": "best fused coconet step: time over its own lower bound",
                    "contender": best["name"], "measured": best["x_bound"], "threshold": 1.1,
                    "met": best["x_bound"] <= 1.1})
    return out + mixed_targets(by)


def mixed_targets(by: dict[str, dict]) -> list[dict]:
    """The mixed-precision targets whose contenders ran (met only when both are correct)."""
    out = []
    for what, slower, faster, threshold in MIXED_TARGETS:
        if slower in by and faster in by:
            ratio = by[slower]["median_ms"] / by[faster]["median_ms"]
            correct = by[slower].get("correct", True) and by[faster].get("correct", True)
            out.append(
                {
                    "target": what,
                    "contender": faster,
                    "baseline": slower,
                    "measured": round(ratio, 3),
                    "threshold": threshold,
                    "met": bool(correct and ratio >= threshold),
                }
            )
    row = by.get(BF16_OPTIM)
    if row is not None and "x_bound" in row:
        what, threshold = BF16_BOUND_TARGET
        out.append(
            {
                "target": what,
                "contender": BF16_OPTIM,
                "measured": row["x_bound"],
                "threshold": threshold,
                "met": bool(row.get("correct", True) and row["x_bound"] <= threshold),
            }
        )
    return out


def table(doc: dict) -> str:
    rows = doc["results"] + doc["probes"]
    lb = doc["lower_bound"]
    ddp = next((r for r in rows if r["name"] == "ddp"), None)
    cfg = doc["config"]
    m = doc["machine"]
    lines = [
        f"data_parallel_adam: {doc['world_size']} gloo ranks x {cfg['threads_per_rank']} torch "
        f"thread(s), {cfg['params']:,} float32 params ({cfg['params'] * 4 / 2**20:.1f} MiB), "
        f"{cfg['steps']} timed steps after {cfg['warmup']} warm-up (+1 first call)",
        f"machine: {m['cpus']} cpus ({m['cpu_model']}), torch {m['torch']}, load average "
        f"{m['loadavg_before']} before / {m['loadavg_after']} after",
        f"coconet source digest {m['coconet_source_digest']}; environment {m['env']}",
        NOTE_CORES.format(cpus=m["cpus"], world=doc["world_size"], threads=cfg["threads_per_rank"]),
        "",
        f"{'name':<38} {'kind':<9} {'median ms':>10} {'min':>9} {'max':>9} {'ddp/this':>9} "
        f"{'x bound':>8} {'first call':>11}  {'correct':<8} {'norm err':>9} {'max err':>9} "
        f"{'outliers':>8}",
    ]
    for r in rows:
        speed = f"{ddp['median_ms'] / r['median_ms']:.2f}x" if ddp and r["kind"] != "probe" else ""
        correct = ""
        if "correct" in r:
            correct = "yes" if r["correct"] else "NO !!!"
        err = ""
        if "max_rel_err" in r:
            err = f"{r['norm_rel_err']:>9.1e} {r['max_rel_err']:>9.1e} {int(r['outliers']):>8}"
        first = f"{r['first_call_ms'] / 1e3:.2f} s" if r["kind"] != "probe" else ""
        xb = f"{r['x_bound']:.2f}x" if "x_bound" in r else ""
        lines.append(
            f"{r['name']:<38} {r['kind']:<9} {r['median_ms']:>10.1f} {r['min_ms']:>9.1f} "
            f"{r['max_ms']:>9.1f} {speed:>9} {xb:>8} {first:>11}  {correct:<8} {err}".rstrip()
        )
    lines += [
        "",
        f"lower bound over gloo {doc['lower_bound_ms']:.1f} ms/step = max(communication "
        f"{lb['communication_ms']:.1f} ms, memory {lb['memory_ms']:.1f} ms); without overlap "
        f"(no free core here) {lb['serial_ms']:.1f} ms",
        f"lower bound over shared memory {lb['shared_memory_ms']:.1f} ms/step: "
        f"{lb['shared_memory_bytes_per_rank'] / 2**20:.1f} MiB/rank read and written (its slice "
        "of every peer's gradient; its p, m, v slices read, m, v and the new p slice written; "
        "the peers' new p slices copied into its parameters) at the copy probe's bandwidth",
        f"lower bound with host-shared parameters (no gather: {HOST_SHARED_OPTIM}) "
        f"{lb['host_shared_ms']:.1f} ms/step: {lb['host_shared_bytes_per_rank'] / 2**20:.1f} "
        "MiB/rank (its slice of every peer's gradient, its p, m, v slices read, m, v and its new "
        "p slice written) at the copy probe's bandwidth",
    ]
    clip_active = any(r["name"].endswith("[clip-active]") for r in rows)
    if clip_active and "clip_active_shared_memory_ms" in lb:
        lines.append(
            f"lower bound of exact clipping that clips (the [clip-active] contenders) "
            f"{lb['clip_active_shared_memory_ms']:.1f} ms/step: "
            f"{lb['clip_active_shared_memory_bytes_per_rank'] / 2**20:.1f} MiB/rank, "
            f"{lb['clip_active_over_step_bound']:.3f}x the step's: the norm of the whole reduced "
            "gradient precedes every element's update, so the reduced slice is written and read "
            "once more (re-reading the peers' pieces costs more); the 1.05 target of a step that "
            "clips is below it"
        )
    if any(r["name"] in MIXED for r in rows):
        lines += [
            f"lower bound of the bfloat16 step ({BF16_OPTIM}) over shared memory "
            f"{lb['bf16_shared_memory_ms']:.1f} ms/step: "
            f"{lb['bf16_shared_memory_bytes_per_rank'] / 2**20:.1f} MiB/rank (its slice of every "
            "peer's bfloat16 gradient; its float32 master, m, v slices read and written; its new "
            "bfloat16 slice written; the peers' new bfloat16 slices copied into its parameters) at "
            "the copy probe's bandwidth",
            f"lower bound of bfloat16 gradients on float32 parameters ({REDUCE_BF16_OPTIM}) "
            f"{lb['reduce_bf16_shared_memory_ms']:.1f} ms/step: "
            f"{lb['reduce_bf16_shared_memory_bytes_per_rank'] / 2**20:.1f} MiB/rank (the float32 "
            "step's bytes, its gradient's slices read in bfloat16, plus the cast of its float32 "
            "gradient to bfloat16) at the copy probe's bandwidth",
        ]
    lines += [
        f"lower bound of an unfused step over shared memory (all_reduce, then Adam on every "
        f"parameter: shm_all_reduce+adam_fused, DeepSpeed's) {lb['shared_memory_unfused_ms']:.1f}"
        f" ms/step: {lb['shared_memory_unfused_bytes_per_rank'] / 2**20:.1f} MiB/rank, the "
        f"all_reduce at the copy probe's {lb['copy_GBps']:.2f} GB/s and Adam's in-place pass at "
        f"the in-place probe's {lb['in_place_GBps']:.2f} GB/s",
        "x bound = median / the contender's own lower bound (each form's own bytes)",
        f"  communication: {lb['wire_bytes_per_rank'] / 2**20:.1f} MiB/rank on the wire "
        f"(reduce-scatter the gradient + all-gather the parameters) at the all_reduce probe's "
        f"{lb['all_reduce_bus_GBps']:.2f} GB/s bus bandwidth",
        f"  memory: {lb['memory_bytes_per_rank'] / 2**20:.1f} MiB/rank (read g, p, m, v and write "
        f"p, m, v for 1/{doc['world_size']} of the params) at the copy probe's "
        f"{lb['copy_GBps']:.2f} GB/s",
        f"coconet collective algorithms (measured in {doc['tuning_s']:.1f} s before compiling): "
        + ", ".join(f"{op} -> {c['algorithm']}" for op, c in doc["collective_algorithms"].items()),
        "first call = the first step, slowest rank (coconet: torch.compile of the fused kernel, "
        f"Inductor cache {cfg['inductor_cache']})",
        f"correct: the parameters after all {1 + cfg['warmup'] + cfg['steps']} steps, compared "
        "with ddp's (ddp: with a single-process torch.optim.Adam over the summed gradients), on "
        "every rank, and identical on every rank:",
        "  norm err = |p - ref|_2 / |ref|_2 <= 1e-6; max err = max|p - ref| / max|ref| (reported);",
        f"  outliers = elements with |p - ref| > {RTOL:g} max|ref|: at most 1 per million (min 1),"
        " each within lr",
        "  (outliers are elements where g + weight_decay*p cancels to ~eps and the update hangs on "
        "its last bit)",
    ]
    if any(r["name"] in MIXED for r in rows):
        lines += [
            "  mixed precision: the float32 masters (the float32 parameters of "
            f"{REDUCE_BF16_OPTIM}) against torch.optim.Adam on a float32 master over "
            "sum_r(g_r.to(bf16).float()).to(bf16).float() / world, by the same criterion; the "
            "bfloat16 parameters must be exactly their master's rounding; elements whose first "
            f"update is ill-conditioned (|g + weight_decay*p| < {ILL_CONDITIONED:g} with no "
            "history: bfloat16's grid makes exact cancellations common) are left out of the norm "
            "and the outliers (still within lr): "
            + ", ".join(f"{r['name']} {int(r['ill_conditioned'])}" for r in rows
                        if "ill_conditioned" in r),
        ]
    for name, why in doc.get("skipped", {}).items():
        lines.append(f"left out: {name}: {why}")
    if doc.get("targets"):
        lines += ["", "targets (ratios of medians from this run):"]
        for t in doc["targets"]:
            sign = ("<=" if "lower bound" in t["target"] or "max_grad_norm" in t["target"]
                    or "time over" in t["target"] else ">=")  # fmt: skip
            lines.append(
                f"  {'met ' if t['met'] else 'MISSED'} {t['target']} ({t['contender']}): "
                f"{t['measured']:.2f} {sign} {t['threshold']}"
            )
    wrong = [r["name"] for r in rows if r.get("correct") is False]
    if wrong:
        lines += [
            "",
            "!" * 78,
            f"!!! WRONG RESULTS: {', '.join(wrong)} (times above do not count)",
            "!" * 78,
        ]
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"--plot {path}: matplotlib is not installed; no plot written "
            "(pip install matplotlib to get one)"
        )
        return
    rows = doc["results"]
    names = [r["name"] for r in rows]
    med = [r["median_ms"] for r in rows]
    err = [
        [r["median_ms"] - r["min_ms"] for r in rows],
        [r["max_ms"] - r["median_ms"] for r in rows],
    ]
    colors = ["tab:gray" if r["kind"] == "baseline" else "tab:blue" for r in rows]
    # the mixed-precision rows (bfloat16) in lighter shades of the same colours
    colors = [{"tab:gray": "silver", "tab:blue": "lightskyblue"}[c] if r["name"] in MIXED else c
              for c, r in zip(colors, rows, strict=True)]  # fmt: skip
    colors = [c if r.get("correct", True) else "tab:red" for c, r in zip(colors, rows, strict=True)]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh(names, med, xerr=err, color=colors, capsize=3)
    ax.axvline(doc["lower_bound_ms"], color="k", linestyle="--", label="lower bound (overlapped)")
    ax.axvline(
        doc["lower_bound"]["serial_ms"], color="k", linestyle=":", label="lower bound (serial)"
    )
    if any(r["name"] in MIXED for r in rows):
        ax.axvline(doc["lower_bound"]["bf16_shared_memory_ms"], color="tab:green",
                   linestyle="--", label="bf16 step's lower bound (shared memory)")  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median, min-max bars; slowest rank)")
    cfg = doc["config"]
    ax.set_title(
        f"data-parallel Adam, {cfg['params']:,} params, {doc['world_size']} gloo ranks "
        f"on {doc['machine']['cpus']} cores"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def coconet_digest() -> str:
    """sha256 (16 hex digits) of coconet's source files: which tree the numbers came from."""
    import hashlib

    import coconet

    h = hashlib.sha256()
    src = Path(coconet.__file__).resolve().parent
    for path in sorted(src.rglob("*.py")):
        h.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# Environment variables that change how memory is allocated (and so these timings).
ENV_KNOBS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "THP_MEM_ALLOC_ENABLE",
    "LD_PRELOAD",
    "OMP_NUM_THREADS",
)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine(before: list[float], after: list[float] | None = None) -> dict:
    """What a result file says of the machine it ran on (``before``/``after``: the load at the
    start and the end; the end's is read now when not given)."""
    return {
        "cpus": os.cpu_count(),
        "device": "cpu",
        "backend": "gloo",
        "torch": torch.__version__.split("+")[0],
        "torch_build": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "loadavg_before": before,
        "loadavg_after": loadavg() if after is None else after,
        "env": {k: os.environ[k] for k in ENV_KNOBS if k in os.environ},
        "coconet_source_digest": coconet_digest(),
    }


def agree_failed(failed: dict[str, str], names: list[str]) -> None:
    """Every rank leaves out the same contenders: a failure on any rank fails it everywhere."""
    import torch.distributed as dist

    flags = torch.tensor([1.0 if n in failed else 0.0 for n in names])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    for n, f in zip(names, flags.tolist(), strict=True):
        if f and n not in failed:
            failed[n] = "failed on another rank"


def pyplot(path: str):
    """matplotlib's pyplot on the Agg backend, or None (saying so) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written")
        return None
    return plt


def emit(doc: dict, text: str, wall: float, json_path: str | None,
         plot_fn, plot_path: str | None) -> None:  # fmt: skip
    """Print a benchmark's table, write its JSON and plot, as every benchmark here does."""
    print(text)
    print(f"(wall time {wall:.0f} s)")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"JSON written to {json_path}")
    if plot_path:
        plot_fn(doc, plot_path)


DEEPSPEED = DeepSpeedShm.name
# coconet.optim with param_storage="host-shared": one copy of the parameters per host
HOST_SHARED_OPTIM = f"{CoconetOptim.name}[host-shared]"
# coconet.optim with max_grad_norm= (issue 25), and the two-group step it is compared with
# two param groups as nanoGPT's decay / no-decay: the second 1/64 of the parameters
SMALL_SECOND = "2-groups-63:1"
CLIP_NEVER = 1e30
CLIP_ALWAYS = 1.0  # the summed gradients' norm is ~sqrt(world * n): clipped at every step
CLIP_OPTIMS = {
    f"{CoconetOptim.name}[clip]": (1, CLIP_NEVER),
    f"{CoconetOptim.name}[clip-active]": (1, CLIP_ALWAYS),
    f"{CoconetOptim.name}[2-groups]": (2, None),
    f"{CoconetOptim.name}[2-groups][clip]": (2, CLIP_NEVER),
    f"{CoconetOptim.name}[2-groups][clip-active]": (2, CLIP_ALWAYS),
    f"{CoconetOptim.name}[{SMALL_SECOND}]": (SMALL_SECOND, None),
    f"{CoconetOptim.name}[{SMALL_SECOND}][clip]": (SMALL_SECOND, CLIP_NEVER),
}
ALL = [
    "ddp",
    "ddp_foreach",
    "zero",
    "shm_all_reduce+adam_fused",
    DEEPSPEED,
    f"coconet:unscheduled{GLOO}",
    f"coconet:AR_C{GLOO}",
    f"coconet:fuse_RS_C_AG{GLOO}",
    f"coconet:AR_C{SHM}",
    f"coconet:AR_C{SHM}{SWAP}",
    f"coconet:RS_C_AG{SHM}",
    f"coconet:fuse_RS_C_AG{SHM}",
    f"coconet:fuse_RS_C_AG{SHM}{SWAP}",
    f"coconet:AR_C{SHM}{LEAN}",
    f"coconet:fuse_RS_C_AG{SHM}{LEAN}",
    CoconetOptim.name,
    HOST_SHARED_OPTIM,
    *CLIP_OPTIMS,
    *MIXED,
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=16 * 1024 * 1024, help="float32 parameters")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (>= 10)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps after the first call")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--distinct-grads",
        type=int,
        default=2,
        help="distinct gradients per rank, cycled step by step",
    )
    ap.add_argument(
        "--zero-chunks",
        type=int,
        default=0,
        help="parameter tensors for ZeRO to shard (default: one per rank)",
    )
    ap.add_argument(
        "--zero-bucket-view",
        action="store_true",
        help="ZeroRedundancyOptimizer(parameters_as_bucket_view=True)",
    )
    ap.add_argument(
        "--contenders", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}"
    )
    ap.add_argument(
        "--fresh-inductor-cache",
        action="store_true",
        help="compile with an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR=new dir)",
    )
    ap.add_argument(
        "--mixed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"the mixed-precision contenders ({', '.join(MIXED)}); --no-mixed leaves them out",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be at least 10")
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(ALL))
    if unknown:
        ap.error(f"unknown contenders {unknown}; choose from {ALL}")
    if not args.mixed:
        wanted = [c for c in wanted if c not in MIXED]

    from coconet.runtime import CommOptions, spawn

    before = loadavg()
    with tempfile.TemporaryDirectory(prefix="coconet-bench-") as tmp:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the ranks inherit it
        if args.fresh_inductor_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        cfg = {
            "params": args.params,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "seed": args.seed,
            "distinct_grads": args.distinct_grads,
            "zero_chunks": args.zero_chunks,
            "zero_bucket_view": args.zero_bucket_view,
            "contenders": wanted,
            "cache_dir": os.path.join(tmp, "coconet"),
        }
        print(
            f"spawning {args.world} ranks ({args.params:,} params) ...", file=sys.stderr, flush=True
        )
        t0 = time.perf_counter()
        res = spawn(
            worker,
            args.world,
            cfg,
            options=CommOptions(cache_dir=cfg["cache_dir"]),
            timeout=args.timeout,
        )[0]
        wall = time.perf_counter() - t0
    summarize(res["rows"])
    lb = lower_bound(res["rows"], args.params, args.world)
    rows = [r for r in res["rows"] if r["kind"] != "probe"]
    probes = [r for r in res["rows"] if r["kind"] == "probe"]
    ddp = next((r for r in rows if r["name"] == "ddp"), None)
    for r in rows:
        if ddp:
            r["speedup_vs_ddp"] = round(ddp["median_ms"] / r["median_ms"], 3)
        bound = own_bound(r["name"], lb)
        if bound is not None:
            r["bound_ms"] = bound
            r["x_bound"] = round(r["median_ms"] / bound, 3)
    doc = {
        "benchmark": "data_parallel_adam",
        "machine": machine(before),
        "world_size": args.world,
        "config": {
            "params": args.params,
            "dtype": "float32",
            "mixed": args.mixed,
            "mixed_precision": (
                "bfloat16 parameters and gradients with a float32 master, m, v "
                f"({BF16_OPTIM}, {DDP_BF16}, {DEEPSPEED_BF16}); float32 parameters with "
                f"reduce_dtype=torch.bfloat16 ({REDUCE_BF16_OPTIM})"
                if args.mixed
                else "left out (--no-mixed)"
            ),
            "steps": args.steps,
            "warmup": args.warmup,
            "threads_per_rank": res["threads"],
            "seed": args.seed,
            "distinct_grads": args.distinct_grads,
            "zero_chunks": args.zero_chunks or args.world,
            "zero_bucket_view": args.zero_bucket_view,
            "gradient": "sum over ranks (all_reduce SUM), every contender",
            "adam": "lr=1e-2 betas=(0.9, 0.999) eps=1e-8 weight_decay=1e-2 (float32-rounded)",
            "inductor_cache": (
                "fresh (empty)" if args.fresh_inductor_cache else "default (may be warm)"
            ),
            "coconet_options": "compile defaults: fused_kernels, check_every_step, commit_vote",
            "correct_if": "norm_rel_err <= 1e-6 and outliers (|diff| > rtol * max|ref|) <= "
            "max(1, params // 1e6) and max_abs_err <= lr and identical on every rank",
            "rtol": RTOL,
        },
        "lower_bound_ms": lb["overlapped_ms"],
        "lower_bound": lb,
        "tuning_s": round(res["tuning_s"], 3),
        "collective_algorithms": res["choices"],
        "wall_s": round(wall, 1),
        "probes": probes,
        "note": NOTE_CORES.format(cpus=os.cpu_count(), world=args.world, threads=res["threads"]),
        "results": rows,
        "skipped": res["skipped"],
        "targets": targets(rows),
    }
    emit(doc, table(doc), wall, args.json, plot, args.plot)
    return 0 if all(r.get("correct", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
