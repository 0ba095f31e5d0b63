"""Rank bodies for tests/dist/test_dist_pipeline.py: coconet.pipeline.Pipeline against one
process training the whole model on the whole batch, with its stage messages over shared memory
(the ranks share a host) and over gloo (``CommOptions(transport="torch.distributed")``), each
in the same spawned group where a check runs on both."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from coconet.ir.types import slice_bounds
from coconet.pipeline import Pipeline

WIDTH, LAYERS, BATCH = 6, 4, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(LAYERS)])  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


SHM, GLOO = "shared memory", "torch.distributed"


def _both(comm) -> dict:
    """``comm`` (spawned with transport auto: shared memory on this host) and a communicator of
    the same ranks forced to gloo, by the transport their pipelines' messages take."""
    gloo = comm.variant(dataclasses.replace(comm.options, transport=GLOO))
    return {SHM: comm, GLOO: gloo}


def _kinds(pipe) -> list[str]:
    return sorted({link.transport.value for link in pipe.links.values()})


def train_cases(comm, cases: list, pretend_hosts: bool = False) -> dict:
    """``train_vs_one_process`` for each (schedule, micro-batches) of ``cases``, over shared
    memory and over gloo. ``pretend_hosts``: then once more on 4 ranks that pretend to be 2 hosts
    of 2 (``COCONET_HOST_ID``: ranks 0-1 and 2-3), the world's group hierarchical: the stages of
    one host talk over shared memory, the boundary between the hosts over gloo."""
    import os

    from coconet.runtime import Communicator

    out = {}
    for name, c in _both(comm).items():
        for schedule, micro in cases:
            out[f"{name} {schedule} m={micro}"] = train_vs_one_process(c, schedule, micro)
    if pretend_hosts:
        os.environ["COCONET_HOST_ID"] = f"host{comm.rank // 2}"
        hosts = Communicator(None, comm.options)
        out["pretend hosts 1f1b m=4"] = train_vs_one_process(hosts, "1f1b", 4)
    return out


def train_vs_one_process(comm, schedule: str, micro: int, steps: int = 3) -> dict:
    """Each rank keeps its layers of the model (tensor_split over the stages), trains them with
    SGD through the pipeline; the reference trains the whole model on one process."""
    full = _model()
    n, i = comm.world, comm.rank
    lo, hi = slice_bounds(LAYERS, n, i)
    stage = nn.Sequential(*list(full)[lo:hi])
    pipe = Pipeline(stage, comm, micro_batches=micro, activation_shape=(BATCH // micro, WIDTH),
                    loss_fn=F.mse_loss, schedule=schedule, axis=None)  # fmt: skip
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    errors, losses = {}, []
    for k in range(steps):
        x, t = _batch(k)
        opt.zero_grad()
        loss = pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), t)
        ref_loss.backward()
        mine = [p.grad for p in stage.parameters()]
        want = [p.grad for p in nn.Sequential(*list(reference)[lo:hi]).parameters()]
        errors[f"grads step {k}"] = max((a - b).abs().max().item() / max(b.abs().max().item(),
                                        1e-12) for a, b in zip(mine, want, strict=True))
        if loss is not None:
            errors[f"loss step {k}"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            losses.append(loss.item())
        opt.step()
        ref_opt.step()
    links = {f"{src}->{dst}": link.transport.value for (src, dst), link in pipe.links.items()}
    pipe.close()
    return {"errors": errors, "losses": losses, "table_rows": len(pipe.steps), "links": links}


def killed_mid_schedule(comm, victim: int, how: str = "kill") -> dict:
    """``victim`` dies (``how="kill"``: SIGKILL) or fails (``"raise"``: its stage raises, and
    the process lives on for a while) in the middle of its schedule; the others must fail within
    the timeout (after a failure: at once over shared memory, its abort word), their parameters
    untouched (no optimizer step ran), and refuse a later step."""
    import os
    import signal
    import time

    from coconet.errors import RuntimeFault

    full = _model()
    lo, hi = slice_bounds(LAYERS, comm.world, comm.rank)
    stage = nn.Sequential(*list(full)[lo:hi])
    pipe = Pipeline(stage, comm, micro_batches=4, activation_shape=(2, WIDTH),
                    loss_fn=F.mse_loss, axis=None)  # fmt: skip
    x, t = _batch(0)
    before = [p.detach().clone() for p in stage.parameters()]
    if comm.rank == victim:
        real = stage.forward
        calls = []

        def dying(inp):
            calls.append(1)
            if len(calls) == 3:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("the stage failed")
            return real(inp)

        stage.forward = dying
    t0 = time.perf_counter()
    try:
        pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    except ValueError:
        time.sleep(2.0)  # alive: the peer must learn from the abort, not from a dead process
        return {"status": "raised"}
    except RuntimeFault as e:
        seconds = time.perf_counter() - t0
        try:
            pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
            again = "ran"
        except RuntimeFault as e2:
            again = str(e2)
        return {"status": "fault", "message": str(e), "seconds": seconds,
                "links": _kinds(pipe), "again": again,
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, stage.parameters(),
                                                                  strict=True))}  # fmt: skip
    return {"status": "no error"}


def random_schedules(comm, count: int, seed: int) -> dict:
    """``count`` random pipelines over this world, the same on every rank (one seed): a random
    number of micro-batches (fewer than the stages included), a random width at each boundary
    (shapes differ from boundary to boundary), float32 or float64, GPipe or 1F1B with up to two
    random swaps of one rank's steps. Each is either refused when the Pipeline is built (on
    every rank alike: ``check``) or runs, its gradients and loss equal one process. Counts what
    happened; a hang would trip the communicator's timeout (a RuntimeFault, not counted)."""
    import random

    from coconet.errors import ScheduleError
    from coconet.pipeline import gpipe, one_f_one_b

    rng = random.Random(seed)
    n = comm.world
    counts = {"ran": 0, "refused": 0}
    ran_on = {SHM: 0, GLOO: 0}
    comms = _both(comm)
    worst = 0.0
    for k in range(count):
        on = SHM if k % 2 == 0 else GLOO  # every other pipeline over shared memory
        micro, per = rng.randint(1, 5), rng.randint(1, 2)
        widths = [rng.randint(1, 5) for _ in range(n + 1)]
        dtype = rng.choice([torch.float32, torch.float64])
        build = rng.choice([gpipe, one_f_one_b])
        shapes = [(per, w) for w in widths[1:-1]]
        schedule = build(n, micro, shapes, str(dtype).removeprefix("torch."))
        for _ in range(rng.randint(0, 2)):
            r = rng.randrange(n)
            if len(schedule[r]) >= 2:
                i, j = rng.sample(range(len(schedule[r])), 2)
                schedule[r][i], schedule[r][j] = schedule[r][j], schedule[r][i]
        torch.manual_seed(rng.randint(0, 2**31))
        layers = [nn.Sequential(nn.Linear(widths[k], widths[k + 1]), nn.Tanh()).to(dtype)
                  for k in range(n)]  # fmt: skip
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        x = torch.randn(micro * per, widths[0], generator=gen, dtype=dtype)
        t = torch.randn(micro * per, widths[-1], generator=gen, dtype=dtype)
        stage = layers[comm.rank]
        try:
            pipe = Pipeline(stage, comms[on], micro_batches=micro, activation_shape=shapes,
                            loss_fn=F.mse_loss, schedule=schedule, axis=None,
                            dtype=dtype)  # fmt: skip
        except ScheduleError:
            counts["refused"] += 1
            continue
        loss = pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
        if set(_kinds(pipe)) - {on}:
            raise AssertionError(f"a pipeline on {on} sent over {_kinds(pipe)}")
        ran_on[on] += 1
        pipe.close()
        reference = nn.Sequential(*[nn.Sequential(nn.Linear(widths[k], widths[k + 1]), nn.Tanh())
                                    .to(dtype) for k in range(n)])  # fmt: skip
        reference.load_state_dict(nn.Sequential(*layers).state_dict())
        for p in reference.parameters():
            p.grad = None
        ref_loss = F.mse_loss(reference(x), t)
        ref_loss.backward()
        for a, b in zip(stage.parameters(), reference[comm.rank].parameters(), strict=True):
            worst = max(worst, (a.grad - b.grad).abs().max().item()
                        / max(b.grad.abs().max().item(), 1e-12))  # fmt: skip
        if loss is not None:
            worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        counts["ran"] += 1
    return {"counts": counts, "worst": worst, "ran_on": ran_on}


def sliced_boundaries(comm, schedules: list[str]) -> dict:
    """``sliced_boundary_vs_one_process`` for each schedule, over shared memory and over gloo
    (the tp all_gathers too), and ``fused_boundary_vs_one_process`` over each."""
    out = {f"{name} {schedule}": sliced_boundary_vs_one_process(c, schedule)
           for name, c in _both(comm).items() for schedule in schedules}  # fmt: skip
    out.update({f"fused {name}": fused_boundary_vs_one_process(c, schedules[0])
                for name, c in _both(comm).items()})  # fmt: skip
    return out


class _MLPToParts(nn.Module):
    """``x + lin2(gelu(lin1(x)))`` over the tp ranks, ending with this rank's part of the rows:
    the row-parallel layer reduce_scatters along dim 0 and adds its part of the residual (the
    fused boundary's sending stage)."""

    def __init__(self, lin1: nn.Linear, lin2: nn.Linear, comm) -> None:
        super().__init__()
        from coconet.nn import ColumnParallelLinear, RowParallelLinear

        self.col = ColumnParallelLinear.from_linear(lin1, comm=comm, axis="tp")
        self.row = RowParallelLinear.from_linear(lin2, comm=comm, axis="tp",
                                                 sequence_parallel=True, sequence_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row(F.gelu(self.col(x)), residual=x)


def fused_boundary_vs_one_process(comm, schedule: str) -> dict:
    """Mesh(pp=2, tp=2), the paper's fused boundary: stage 0 (coconet.nn layers over tp) ends with
    each tp rank's uneven part of the rows (3 rows: 2 and 1), sent as it is
    (``slice_dim=0``); stage 1 all_gathers the parts and returns each rank its part of the input
    gradient. Every gradient (stage 0's shards, stage 1's) and the loss equal one process."""
    width, hidden, rows, micro = 6, 8, 3, 4
    torch.manual_seed(4)
    lin1, lin2, head = nn.Linear(width, hidden), nn.Linear(hidden, width), nn.Linear(width, width)
    index = comm.mesh.index_in(comm.rank, "pp")
    tp = comm.mesh.index_in(comm.rank, "tp")
    mine = nn.Linear(width, width)
    mine.load_state_dict(head.state_dict())  # stage 1's own copy (the reference uses head)
    stage = _MLPToParts(lin1, lin2, comm) if index == 0 else nn.Sequential(mine, nn.Tanh())
    pipe = Pipeline(stage, comm, micro_batches=micro, activation_shape=(rows, width),
                    loss_fn=F.mse_loss, schedule=schedule, slice_over="tp", slice_dim=0)
    gen = torch.Generator().manual_seed(6)
    x, t = torch.randn(micro * rows, width, generator=gen), torch.randn(micro * rows, width,
                                                                      generator=gen)  # fmt: skip
    loss = pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    h = x + lin2(F.gelu(lin1(x)))
    ref_loss = F.mse_loss(torch.tanh(head(h)), t)
    ref_loss.backward()

    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        return (got - want).abs().max().item() / want.abs().max().item()

    if index == 0:
        lo, hi = slice_bounds(hidden, 2, tp)
        worst = max(err(stage.col.weight.grad, lin1.weight.grad[lo:hi]),
                    err(stage.col.bias.grad, lin1.bias.grad[lo:hi]),
                    err(stage.row.weight.grad, lin2.weight.grad[:, lo:hi]),
                    err(stage.row.bias.grad, lin2.bias.grad))  # fmt: skip
    else:
        worst = max(err(mine.weight.grad, head.weight.grad), err(mine.bias.grad, head.bias.grad))
    out = {"grads": worst, "sent": list(pipe.shapes), "links": _kinds(pipe)}
    pipe.close()
    if loss is not None:
        out["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return out


def sliced_boundary_vs_one_process(comm, schedule: str) -> dict:
    """Mesh(pp=2, tp=2): each stage's layers on both of its tp ranks; ``slice_over="tp"`` sends
    each tp rank's uneven part of every activation and gradient (3 rows x 5 = 15 elements: 8
    and 7) and the next stage all_gathers them. Gradients and the loss equal one process."""
    width, rows, micro = 5, 3, 4
    torch.manual_seed(3)
    full = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                for _ in range(4)])  # fmt: skip
    reference.load_state_dict(full.state_dict())
    index = comm.mesh.index_in(comm.rank, "pp")
    stage = nn.Sequential(*list(full)[2 * index : 2 * index + 2])
    pipe = Pipeline(stage, comm, micro_batches=micro, activation_shape=(rows, width),
                    loss_fn=F.mse_loss, schedule=schedule, slice_over="tp")  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    x, t = torch.randn(micro * rows, width, generator=gen), torch.randn(micro * rows, width,
                                                                      generator=gen)  # fmt: skip
    loss = pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    ref_loss = F.mse_loss(reference(x), t)
    ref_loss.backward()
    want = nn.Sequential(*list(reference)[2 * index : 2 * index + 2]).parameters()
    worst = max((a.grad - b.grad).abs().max().item() / b.grad.abs().max().item()
                for a, b in zip(stage.parameters(), want, strict=True))  # fmt: skip
    out = {"grads": worst, "sent": [s for s in pipe.shapes], "links": _kinds(pipe)}
    pipe.close()
    if loss is not None:
        out["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return out
