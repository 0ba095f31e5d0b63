"""Workers of tests/dist/test_dist_optim_precision.py: 16-bit parameters and ``reduce_dtype=``
on several ranks, against a reference written from torch alone.

The reference of a step is torch's optimizer over a float32 master copy of the parameters, on
the averaged gradient as the reduction defines it (``coconet.ir.semantics.reduce_values``): each
rank's gradient sent in the reduction's dtype (cast), summed in float32 in rank order, the sum
rounded once to that dtype, widened to float32 and divided by the world size.
"""

from __future__ import annotations

import io

import torch

import coconet.optim
from coconet.optim.programs import MASTER_STATE_KEY
from coconet.options import CompileOptions

SHAPES = [(7, 5), (13,), (3, 3, 2), (1,)]  # 63 values: uneven over 2, 3 and 4 ranks
EAGER = CompileOptions(fused_kernels=False)
P = torch.nn.Parameter


def grad(t: int, rank: int, j: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_000 * t + 100 * rank + j)
    return torch.randn(SHAPES[j], generator=g).to(dtype)


def averaged(t: int, j: int, world: int, dtype: torch.dtype, reduce: torch.dtype) -> torch.Tensor:
    """The averaged gradient the step must use (see the module docstring)."""
    total = torch.zeros(SHAPES[j])
    for r in range(world):
        total = total + grad(t, r, j, dtype).to(reduce).float()
    if world > 1 or reduce != dtype:
        total = total.to(reduce).float()
    return total / world


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().item()
    return (actual.double() - expected.double()).abs().max().item() / max(scale, 1e-30)


def run_case(comm, name: str, dtype: torch.dtype, reduce: torch.dtype | None, steps: int,
             clip: float | None = None, fused: bool = False, storage: str | None = None
             ) -> dict:  # fmt: skip
    """``steps`` steps of coconet.optim.<name> over 16-bit (or float32) parameters and of the
    reference; the worst relative error of the master weights (float32 parameters: the
    parameters), whether every parameter is its master's rounding, and the norms' error."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    ours = [P(w.to(dtype)) for w in init]
    master = [P(w.to(dtype).float().clone()) for w in init]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1} if name != "SGD" else {
        "lr": 0.05, "momentum": 0.9}
    extra = {} if clip is None else {"max_grad_norm": clip}
    opt = getattr(coconet.optim, name)(ours, comm=comm, options=None if fused else EAGER,
                                       reduce_dtype=reduce, param_storage=storage, **kwargs,
                                       **extra)  # fmt: skip
    if name == "LAMB":
        import pytorch_optimizer

        ref = pytorch_optimizer.Lamb(master, **kwargs)
    else:
        ref = getattr(torch.optim, name)(master, **kwargs)
    worst_norm = 0.0
    for t in range(steps):
        for j, (p, m) in enumerate(zip(ours, master, strict=True)):
            p.grad = grad(t, comm.rank, j, dtype)
            m.grad = averaged(t, j, comm.world, dtype, reduce or dtype)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        ref.step()
        if clip is not None:
            worst_norm = max(worst_norm, rel(opt.last_grad_norm, norm))
    sd = opt.state_dict()
    worst, rounded = 0.0, True
    for j, (p, m) in enumerate(zip(ours, master, strict=True)):
        weights = sd["state"][j].get(MASTER_STATE_KEY, p.detach())
        worst = max(worst, rel(weights, m.detach()))
        rounded &= torch.equal(p.detach(), weights.to(dtype))
    return {"rel": worst, "rounded": rounded, "norm": worst_norm, "state": sd}


def cases(comm) -> dict:
    """Every case of the file, in one spawned group."""
    out = {}
    for name, dtype, reduce in [
        ("AdamW", torch.bfloat16, None),
        ("AdamW", torch.float16, None),
        ("AdamW", torch.bfloat16, torch.float32),  # Megatron's grad_reduce_in_fp32
        ("AdamW", torch.float32, torch.bfloat16),  # bf16_compress_hook's trade
        ("SGD", torch.bfloat16, None),
        ("LAMB", torch.bfloat16, None),
    ]:
        label = f"{name} {dtype} reduce={reduce}"
        out[label] = {k: v for k, v in run_case(comm, name, dtype, reduce, 30).items()
                      if k != "state"}  # fmt: skip
    clipped = run_case(comm, "AdamW", torch.bfloat16, None, 10, clip=0.5)
    out["AdamW bf16 max_grad_norm=0.5"] = {k: v for k, v in clipped.items() if k != "state"}
    fused = run_case(comm, "AdamW", torch.bfloat16, None, 5, fused=True)
    out["AdamW bf16 compiled"] = {k: v for k, v in fused.items() if k != "state"}
    if comm.transport_of(None).value == "shared memory":  # one copy of the parameters per host
        shared = run_case(comm, "AdamW", torch.bfloat16, None, 5, fused=True,
                          storage="host-shared")  # fmt: skip
        out["AdamW bf16 host-shared"] = {k: v for k, v in shared.items() if k != "state"}
    # the state dict of this world size, saved for a run at another (rank 0's copy: every rank
    # holds the same)
    saved = run_case(comm, "AdamW", torch.bfloat16, None, 3)["state"]
    blob = io.BytesIO()  # (bytes: tensors would be shared with the parent by a file descriptor)
    torch.save(saved, blob)
    return {"cases": out, "saved": blob.getvalue() if comm.rank == 0 else None}


def resume(comm, blob: bytes) -> dict:
    """A state dict saved at another world size (``torch.save``'s bytes), loaded here: the next
    steps continue the reference (three steps before, three after)."""
    saved = torch.load(io.BytesIO(blob))
    dtype = torch.bfloat16
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    # the parameters as they were saved: the masters' rounding
    ours = [P(saved["state"][j][MASTER_STATE_KEY].to(dtype)) for j in range(len(SHAPES))]
    opt = coconet.optim.AdamW(ours, comm=comm, options=EAGER, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(saved)
    master = [P(w.to(dtype).float().clone()) for w in init]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    saved_world = 2
    for t in range(6):
        world = saved_world if t < 3 else comm.world
        for j, m in enumerate(master):
            m.grad = averaged(t, j, world, dtype, dtype)
        ref.step()
        if t >= 3:
            for j, p in enumerate(ours):
                p.grad = grad(t, comm.rank, j, dtype)
            opt.step()
    sd = opt.state_dict()
    return {"rel": max(rel(sd["state"][j][MASTER_STATE_KEY], m.detach())
                       for j, m in enumerate(master)),
            "rounded": all(torch.equal(p.detach(), sd["state"][j][MASTER_STATE_KEY].to(dtype))
                           for j, p in enumerate(ours))}  # fmt: skip


def scaled(comm, dtype: torch.dtype, groups: int, clip: float | None) -> dict:
    """torch's AMP recipe on every rank (``scaler.step(opt); scaler.update()``), an inf in one
    rank's gradient only (rank ``world - 1``, at step 2): every rank skips that step, every
    scaler backs off alike, and the masters follow torch over float32 copies of the averaged
    gradient (the scaled 16-bit gradients averaged as the reduction does, then unscaled)."""
    import warnings

    warnings.filterwarnings("ignore", "GradScaler is going to stop passing itself")
    torch.manual_seed(0)
    shapes = SHAPES[:2]
    init = [torch.randn(s) for s in shapes]
    ours = [P(w.to(dtype)) for w in init]
    master = [P(w.to(dtype).float().clone()) for w in init]
    given = [{"params": [p]} for p in ours] if groups == 2 else ours
    opt = coconet.optim.AdamW(given, comm=comm, options=EAGER, lr=1e-2, max_grad_norm=clip)
    ref = torch.optim.AdamW(master, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler.scale(torch.ones(()))
    scales, skipped = [], []
    for t in range(6):
        scale = scaler.get_scale()  # (the ranks' scalers compared after the run)
        grads = [[(grad(t, r, j, torch.float32) * scale).to(dtype) for j in range(len(shapes))]
                 for r in range(comm.world)]  # fmt: skip
        if t == 2:
            grads[-1][1].view(-1)[0] = float("inf")
        for j, p in enumerate(ours):
            p.grad = grads[comm.rank][j].clone()
        scaler.step(opt)
        scaler.update()
        total = [sum(grads[r][j].float() for r in range(comm.world)) for j in range(len(shapes))]
        if comm.world > 1:
            total = [x.to(dtype).float() for x in total]
        found = any(not torch.isfinite(x).all() for x in total)
        skipped.append(found)
        if not found:
            for m, x in zip(master, total, strict=True):
                m.grad = x / comm.world / scale
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(master, clip)
            ref.step()
        scales.append(scaler.get_scale())
    sd = opt.state_dict()["state"]
    return {
        "rel": max(rel(sd[j].get(MASTER_STATE_KEY, ours[j].detach()), m.detach())
                   for j, m in enumerate(master)),  # fmt: skip
        "scales": scales,
        "skipped": skipped,
        "steps": float(sd[0]["step"]),
    }


def stochastic(comm) -> bytes:
    """``rounding="stochastic"`` over a bucket sliced ``comm.world`` ways: the parameters after
    3 steps, as bytes. Every rank's gradient is the same multiple of 1/8 (so the average is
    exact whatever the world size), so the masters, and the random bits keyed by each element's
    place in the bucket, are the same at every world size and on every schedule: the rounded
    parameters must be too."""
    torch.manual_seed(0)
    p = P(torch.randn(1001).to(torch.bfloat16))
    opt = coconet.optim.AdamW([p], comm=comm, options=EAGER, lr=1e-3, rounding="stochastic")
    for t in range(3):
        g = torch.Generator().manual_seed(t)
        p.grad = (torch.randint(-8, 9, (1001,), generator=g) / 8).to(torch.bfloat16)
        opt.step()
    return p.detach().view(torch.int16).numpy().tobytes()


def exactness(comm, fused: bool) -> dict[str, bool]:
    """The 16-bit programs of coconet.optim (bfloat16 and float16 parameters, a bfloat16
    reduction of float32 gradients, stochastic rounding) under their schedules, bitwise the
    simulator's (``rtol=0``): 16-bit reductions accumulate in float32 in rank order and round
    once, on every transport and inside the fused kernels (Inductor keeps the rounding:
    ``emulate_precision_casts``). LAMB's norms over slices are partial sums (re-associated:
    ``schedule_rtol``, float32 as its master). 37 elements: uneven slices.

    Fused kernels are bitwise only where this CPU's eager ``sqrt`` (the simulator's) is
    correctly rounded, as Inductor's is (``eager_sqrt_is_correctly_rounded``); elsewhere they
    are held to ``FUSED_RTOL``, the tolerance of every other fused-kernel comparison, and the
    eager schedules (``fused=False``) keep proving the rounding bit for bit."""
    from coconet import schedule as schedules
    from coconet.ir.types import DType
    from coconet.optim import programs
    from coconet.testing import check_schedules
    from support.tolerances import FUSED_RTOL, eager_sqrt_is_correctly_rounded, schedule_rtol

    n = 37
    out = {}
    cases = [
        (programs.adam(DType.bfloat16), ("m", "v", "master")),
        (programs.adam(DType.float32, reduce=DType.bfloat16), ("m", "v")),
        (programs.adam(DType.bfloat16, reduce=DType.float32), ("m", "v", "master")),
        (programs.sgd_momentum(DType.float16), ("buf", "master")),
        (programs.lamb(DType.bfloat16), ("m", "v", "master")),
        (programs.adam(DType.bfloat16, stochastic=True), ("m", "v", "master")),
    ]
    for program, state in cases:
        g = torch.Generator().manual_seed(len(out))
        inputs: dict = {}
        for node in program.inputs:
            dtype = node.type.dtype.torch
            if node.type.rank == 0:
                inputs[node.name] = (7 if node.name.startswith("round") else
                                     0.5 if node.name == "grad_scale" else 0.9)  # fmt: skip
            elif node.name == "g":
                inputs["g"] = [torch.randn(n, generator=g).to(dtype) for _ in range(comm.world)]
            else:
                x = torch.randn(n, generator=g)
                inputs[node.name] = (x.abs() if node.name == "v" else x).to(dtype)
        if "master" in inputs:
            inputs["p"] = inputs["master"].to(inputs["p"].dtype)
        made = {
            "fuse_RS_C_AG": lambda p, st=state: schedules.fuse_RS_C_AG(p, state=st),
            "RS_C_AG": lambda p, st=state: schedules.RS_C_AG(p, state=st),
        }
        rtol = max(schedule_rtol(program, make(program).program) for make in made.values())
        if fused and not eager_sqrt_is_correctly_rounded():
            rtol = max(rtol, FUSED_RTOL)
        out[program.name] = check_schedules(program, made, inputs, comm=comm, rtol=rtol,
                                            fused_kernels=fused)  # fmt: skip
    return out


def tensor_parallel(comm) -> list[tuple[float, float]]:
    """A bfloat16 nanoGPT, its MLPs split over tp (``coconet.nn.parallelize``), stepped by
    ``coconet.optim.AdamW(comm=comm.along("dp"), max_grad_norm=0.5)`` (float32 masters of
    the parts and of the whole tensors; the norm of the parts summed over tp), against one
    process stepping torch's AdamW over float32 masters of the same bfloat16 model with
    ``clip_grad_norm_``: the losses of 4 steps, (ours, one process's)."""
    import copy

    from coconet.nn import parallelize
    from support.nanogpt import GPT, GPTConfig
    from support.tp_clip_workers import MLP_PLAN, _batch

    torch.manual_seed(3)
    reference = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=16)).to(torch.bfloat16)
    model = parallelize(copy.deepcopy(reference), comm, MLP_PLAN, axis="tp")
    opt = coconet.optim.AdamW(model.parameters(), comm=comm.along("dp"), lr=1e-2,
                              max_grad_norm=0.5)  # fmt: skip
    masters = [p.detach().float().clone().requires_grad_(True) for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    losses = []
    for step in range(4):
        idx, targets = _batch(step, 4)
        opt.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        for p in reference.parameters():
            p.grad = None
        ref_loss = reference(idx, targets)
        ref_loss.backward()
        for m, p in zip(masters, reference.parameters(), strict=True):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 0.5)
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, reference.parameters(), strict=True):
                p.copy_(m)
        losses.append((loss.item(), ref_loss.item()))
    return losses
