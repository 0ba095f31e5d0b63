"""Ranks for tests/dist/test_dist_fault_trials.py: a SIGKILL, a stall or a Ctrl-C of one rank at
a precise point of a ``coconet.nn`` layer's forward or backward, of a ``coconet.pipeline`` step
(a stage's forward, its backward, the stage boundary) and of a ``coconet.optim`` step on a
``dp x tp`` mesh (issue 42).

A trial: every rank makes a fresh communicator and its case (the layers, the pipeline or the
optimizer over a tensor-parallel model) and trains ``STEPS`` steps; at step ``AT`` the victim
runs into its trap, patched in front of the function it is about to call (as
``support.commit_phase_workers`` does), and the trap

- ``kill``: sends the victim SIGKILL (the job ends with the trial: one trial per spawn);
- ``stall``: sleeps ``STALL_S`` seconds, past the communicator's timeout, then goes on;
- ``ctrl-c``: sends the victim SIGINT (a ``KeyboardInterrupt`` in it).

The trap writes the moment it fired in the job's store first. Every rank then reports what it
met: its status (``RuntimeFault``, ``KeyboardInterrupt``, ...), the message, the seconds from the
trap to its error (one clock: one host), and where its state (parameters, and the optimizer's
state) stands: as before step ``AT`` ("before"), as after it ("after"), or neither ("split").
A rank that finished step ``AT`` (its part did not wait for the victim) meets the fault in the
next step. After its error a rank tells its peers as a script's exit would (it aborts every
communicator it holds: their waits end at once); the ranks meet again through the store, never
through the broken communicator. The report's ``mapped`` counts the coconet shared-memory
segments the rank still maps once it closed the trial's communicator (the killed rank's
included: nothing may stay alive). A trial reports; the test judges.
"""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from coconet.errors import RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.options import CompileOptions
from coconet.runtime import CommOptions, Communicator, spawn

TIMEOUT = 4.0  # the communicator's timeout in every trial
STALL_S = TIMEOUT + 3.0  # how long a stalled victim sleeps: past its peers' timeout
AT = 2  # the step (0-based) in which the victim's trap fires
STEPS = AT + 2  # a rank that finished step AT meets the fault in the next
WIDTH = 6

FAULTS = ("kill", "stall", "ctrl-c")
# the places; "optim step, 2nd bucket" is one more (the trap at the second bucket's vote)
PLACES = ("nn forward", "nn backward", "pipeline forward", "pipeline backward",
          "pipeline boundary", "optim step", "optim step, 2nd bucket")  # fmt: skip


class _Trap:
    """The victim's fault, fired at the ``nth`` call it is put in front of during step ``AT``."""

    def __init__(self, fault: str, store, tag: str, nth: int = 1) -> None:
        self.fault, self.store, self.tag, self.nth = fault, store, tag, nth
        self.armed = False
        self.calls = 0
        self._undo: list[tuple[object, str, object, bool]] = []

    def fire(self) -> None:
        self.armed = False
        self.store.set(f"{self.tag}/sent", repr(time.monotonic()))
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached: the signal is delivered at once
        elif self.fault == "stall":
            time.sleep(STALL_S)
        else:
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt at the next bytecode

    def maybe(self) -> None:
        if self.armed:
            self.calls += 1
            if self.calls == self.nth:
                self.fire()

    def wrap(self, owner: object, name: str, pick: Callable | None = None) -> None:
        """Put the trap in front of ``owner.name`` (an instance's attribute or a module's
        function; ``pick(args, kwargs)``: which calls count)."""
        had = name in getattr(owner, "__dict__", {})
        original = getattr(owner, name)
        trap = self

        def patched(*args, **kwargs):
            if pick is None or pick(args, kwargs):
                trap.maybe()
            return original(*args, **kwargs)

        setattr(owner, name, patched)
        self._undo.append((owner, name, original, had))

    def undo(self) -> None:
        for owner, name, original, had in reversed(self._undo):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._undo.clear()


class _Probe(torch.autograd.Function):
    """The identity, with a trap in its forward and its backward (a pipeline stage's own
    computation: the trap fires inside the stage, not in coconet)."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        if box.forward is not None:
            box.forward.maybe()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        if ctx.box.backward is not None:
            ctx.box.backward.maybe()
        return dx, None


class _ProbeModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.forward_trap: _Trap | None = None
        self.backward_trap: _Trap | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(x, _Box(self.forward_trap, self.backward_trap))


@dataclass
class _Box:
    forward: _Trap | None
    backward: _Trap | None


@dataclass
class _Case:
    """One place's training: ``one()`` a step, ``state()`` this rank's parameters and optimizer
    state, ``install(trap)`` puts the trap in place, ``close()`` hands back what it holds."""

    one: Callable[[], None]
    state: Callable[[], list[torch.Tensor]]
    install: Callable[[_Trap], None]
    close: Callable[[], None] = lambda: None
    # the parameters alone, and which replica of them this rank holds (ranks of one replica
    # hold the same parameters; None: every rank holds parameters of its own)
    params: Callable[[], list[torch.Tensor]] | None = None
    replica: int | None = None


def _batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)


def _only(steps: dict):
    (value,) = steps.values()
    return value


def _layers(comm: Communicator, axis: str | None):
    from coconet.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    col = ColumnParallelLinear.from_linear(nn.Linear(WIDTH, 8), comm=comm, axis=axis)
    row = RowParallelLinear.from_linear(nn.Linear(8, WIDTH), comm=comm, axis=axis)
    return col, row


def _nn_case(comm: Communicator, where: str, point: int) -> _Case:
    """2 ranks, tensor parallel over the world: a column-parallel layer, gelu, a row-parallel
    one, trained with torch's SGD on each rank's parts. The trap: in front of the generated code
    of the row layer's forward step (its all_reduce), or of the column layer's backward step
    (the input gradient's all_reduce); ``point=2``: of the other layer's step (which computes
    its part alone)."""
    col, row = _layers(comm, None)
    params = [*col.parameters(), *row.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    x, t = _batch(1, 4)

    def one() -> None:
        opt.zero_grad()
        xa = x.clone().requires_grad_()
        F.mse_loss(row(F.gelu(col(xa))), t).backward()
        opt.step()

    def install(trap: _Trap) -> None:
        first, second = (row, col) if where == "forward" else (col, row)
        steps = _only((first if point == 1 else second)._programs)
        step = steps.forward if where == "forward" else _only(steps.backward)
        trap.wrap(step.module, "step")

    return _Case(one, lambda: [p.detach() for p in params], install)


def _pipeline_case(comm: Communicator, where: str, point: int) -> _Case:
    """2 ranks, one stage each (Linear, Tanh), 1F1B over 4 micro-batches, stage messages over
    shared memory; SGD after each step. The trap: in the victim's stage forward of its
    ``point``-th micro-batch, in its backward of the ``point``-th, or at the boundary: in front
    of its ``point``-th receive of a stage message."""
    from coconet.pipeline import Pipeline

    torch.manual_seed(0)
    probe = _ProbeModule()
    stage = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), probe)
    pipe = Pipeline(stage, comm, micro_batches=4, activation_shape=(2, WIDTH),
                    loss_fn=F.mse_loss, axis=None)  # fmt: skip
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    x, t = _batch(2, 8)

    def one() -> None:
        opt.zero_grad()
        pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
        opt.step()

    def install(trap: _Trap) -> None:
        trap.nth = point
        if where == "forward":
            probe.forward_trap = trap
        elif where == "backward":
            probe.backward_trap = trap
        else:
            trap.wrap(pipe._p2p.channels, "recv")  # its shared-memory receives

    return _Case(one, lambda: [p.detach() for p in stage.parameters()], install, pipe.close)


def _optim_case(comm: Communicator, nth: int) -> _Case:
    """Mesh(dp=2, tp=2): the layers over tp, ``coconet.optim.AdamW(comm=comm.along("dp"))``
    (two buckets: the parts of the split tensors, and the row layer's bias, whole on every
    rank); each replica trains on its own batch. The trap: in front of the victim's commit vote
    of its optimizer step's ``nth`` bucket (the bucket's collectives done, nothing of it
    written yet; with ``nth=2`` the first bucket is committed on every rank)."""
    import coconet.optim

    col, row = _layers(comm, "tp")
    params = [*col.parameters(), *row.parameters()]
    dp = comm.along("dp")
    opt = coconet.optim.AdamW(params, lr=1e-2, comm=dp,
                              options=CompileOptions(fused_kernels=False))  # fmt: skip
    x, t = _batch(10 + comm.mesh.index_in(comm.rank, "dp"), 4)

    def one() -> None:
        opt.zero_grad()
        F.mse_loss(row(F.gelu(col(x))), t).backward()
        opt.step()

    def state() -> list[torch.Tensor]:
        out = [p.detach() for p in params]
        for p in params:
            out += [v for v in opt.state[p].values() if torch.is_tensor(v)]
        return out

    def install(trap: _Trap) -> None:
        trap.nth = nth
        # (the vote is the mesh's: every rank of dp x tp votes on each bucket's commit)
        trap.wrap(dp.root, "agree_max", pick=lambda a, k: k.get("op") == "commit vote")

    return _Case(one, state, install, params=lambda: [p.detach() for p in params],
                 replica=comm.mesh.index_in(comm.rank, "tp"))


def _case(comm: Communicator, place: str, point: int) -> _Case:
    kind, where = place.split(" ", 1)
    if kind == "nn":
        return _nn_case(comm, where, point)
    if kind == "pipeline":
        return _pipeline_case(comm, where, point)
    return _optim_case(comm, 2 if "2nd bucket" in where else 1)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _meet(store, key: str, ranks: list[int], rank: int) -> None:
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in ranks])


def _tell_peers(comm: Communicator, reason: str) -> None:
    """What this rank's exit would tell its peers after an error: every communicator it holds
    that is not broken already (a step that failed told its peers itself) is aborted: a peer
    waiting in any of them fails at once."""
    for c in (comm, *comm._subs.values()):
        if c.broken is None:
            c.abort(reason)


def _mapped() -> int:
    """The coconet shared-memory segments this process maps (anonymous memfds)."""
    with open("/proc/self/maps") as f:
        return sum("coconet-symmem" in line for line in f)


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def trials(comm: Communicator, victim: int, plan: list[tuple[str, str, int]]) -> list[dict]:
    """One trial per (place, fault, point) of ``plan``, in this job; one dict each (see the
    module; ``point``: which of the calls the trap can stand before, see each case). A ``kill``
    must be the plan's last trial (the job ends with it)."""
    store = dist.distributed_c10d._get_default_store()
    options, mesh, rank, world = comm.options, comm.mesh, comm.rank, comm.world
    comm.close()  # each trial makes its own
    out = []
    for k, (place, fault, point) in enumerate(plan):
        tag = f"trial/{k}"
        alive = [r for r in range(world) if not (fault == "kill" and r == victim)]
        _meet(store, f"{tag}/start", list(range(world)), rank)
        trial = Communicator(mesh, options)
        case = _case(trial, place, point)
        trap = _Trap(fault, store, tag) if rank == victim else None
        status, message, raised_at = "finished", "", None
        before = after_at = None
        steps = 0
        try:
            for steps in range(STEPS):  # noqa: B007 - reported
                if steps == AT:
                    before = _digest(case.state())
                    if trap is not None:
                        case.install(trap)
                        trap.armed = True
                case.one()
                if steps == AT:
                    after_at = _digest(case.state())
        except KeyboardInterrupt as exc:
            status, raised_at, message = "KeyboardInterrupt", time.monotonic(), _message(exc)
            message += "".join(f"\n  note: {n}" for n in getattr(exc, "__notes__", []))
        except RuntimeFault as exc:
            status, raised_at, message = "RuntimeFault", time.monotonic(), _message(exc)
        except Exception as exc:  # noqa: BLE001 - reported: a raw error is a finding
            status, raised_at, message = type(exc).__name__, time.monotonic(), _message(exc)
        finally:
            if trap is not None:
                trap.undo()
        if status != "finished":
            _tell_peers(trial, f"rank {rank}: {status} in the fault trial")
        final = _digest(case.state())
        params = _digest(case.params()) if case.params is not None else None
        _meet(store, f"{tag}/end", alive, rank)
        sent = store.get(f"{tag}/sent").decode() if store.check([f"{tag}/sent"]) else "None"
        # rank 0 holds the store: it waits until every rank has read what it needs
        _meet(store, f"{tag}/read", alive, rank)
        case.close()
        trial.close()
        del case
        gc.collect()
        sent_at = None if sent == "None" else float(sent)
        out.append(dict(
            place=place, fault=fault, point=point, rank=rank, victim=victim, status=status,
            message=message, step=steps, before=before, after_at=after_at, final=final,
            params=params, replica=None if params is None else _replica(mesh, rank),
            after_fault=None if raised_at is None or sent_at is None else raised_at - sent_at,
            mapped=_mapped(),
        ))  # fmt: skip
    return out


def _replica(mesh, rank: int) -> int:
    return mesh.index_in(rank, "tp")


# -- judging a trial (the test's and the counts' rules) -----------------------------------------

# What a survivor's RuntimeFault must say: that a peer died, stalled (its timeout), or aborted
# its step (it was interrupted, or failed itself: a rank that learned from another survivor)
CAUSES = ("died", "stalled", "no answer within", "aborted its step", "left the job")


def state_of(r: dict) -> str:
    """Where a rank's state stands after the trial: "before" step AT, "after" it, or "split"
    (neither: a half-applied step). A rank whose Ctrl-C came out of a committed step (its note
    says so) is "after" if its parameters equal a replica's that finished the step."""
    if r["final"] == r["before"]:
        return "before"
    if r["final"] == r["after_at"]:
        return "after"
    if r["status"] == "KeyboardInterrupt" and any(
            n in r["message"] for n in ("applied on every rank", "committed on this rank")):
        return "after (noted)"
    return "split"


def judge(results: list) -> dict:
    """The verdict on one trial from every rank's report (``RankFailure`` for the killed one):
    ``clear`` (every survivor got a RuntimeFault naming a rank and the cause within
    ``TIMEOUT + 5`` s of the fault, the victim of a Ctrl-C a KeyboardInterrupt), ``whole``
    (every live rank wholly before or wholly after the step, ranks of one replica alike, and
    the replicas' parameters equal), ``mesh_whole`` (moreover all live ranks on the same side),
    ``leaked`` (segments a live rank still maps after closing), and what each rank saw."""
    reports = [r for r in results if isinstance(r, dict)]
    first = reports[0]
    fault, victim = first["fault"], first["victim"]
    problems: list[str] = []
    if fault == "kill" and isinstance(results[victim], dict):
        problems.append(f"the victim {victim} was not killed")
    for r in reports:
        seen = f"rank {r['rank']}: {r['status']} after {r['after_fault']}: {r['message'][:300]}"
        if r["rank"] == victim:
            want = "KeyboardInterrupt" if fault == "ctrl-c" else "RuntimeFault"
            if r["status"] != want:
                problems.append(f"victim {seen}")
            continue
        if r["status"] != "RuntimeFault":
            problems.append(f"survivor {seen}")
        elif r["after_fault"] is None or r["after_fault"] > TIMEOUT + 5:
            problems.append(f"late: {seen}")
        elif not ("rank" in r["message"] and any(c in r["message"] for c in CAUSES)):
            problems.append(f"unclear: {seen}")
    # the flight recorder's verdict (issue 48): a survivor of a kill or a stall names the victim
    # and the call it had not reached (or where it was)
    named = fault == "ctrl-c" or all(f"rank {victim}: " in r["message"] and "call #" in r["message"]
                                     for r in reports if r["rank"] != victim)  # fmt: skip
    states = {r["rank"]: state_of(r) for r in reports}
    sides = {s.split(" ")[0] for s in states.values()}
    by_replica: dict = {}
    for r in reports:
        if r["replica"] is not None:
            by_replica.setdefault(r["replica"], set()).add((states[r["rank"]].split(" ")[0],
                                                              r["params"]))  # fmt: skip
    whole = "split" not in sides and all(len(v) == 1 for v in by_replica.values())
    survivors = [r["after_fault"] or 0.0 for r in reports if r["rank"] != victim]
    return dict(place=first["place"], fault=fault, point=first["point"], clear=not problems,
                problems=problems, named=named,
                whole=whole, mesh_whole=whole and len(sides) == 1, states=states,
                leaked=sum(r["mapped"] for r in reports),
                seconds=max(survivors) if survivors else None)  # fmt: skip


def split_trials(results: list, plan: list) -> list[list]:
    """Each trial's reports, from ``spawn(trials, ...)``'s per-rank lists (a killed rank's
    ``RankFailure`` stands in for its report of the last trial)."""
    out = []
    for k in range(len(plan)):
        out.append([r[k] if isinstance(r, list) else r for r in results])
    return out


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def shm_leftovers(before: set[str], grace_s: float = 1.0) -> list[str]:
    """Entries of /dev/shm made since ``before`` that are still there after ``grace_s`` and
    that no live process holds (maps or has open, by inode: a POSIX semaphore is mapped under
    the temporary name it was made with): what a job left behind. (Other jobs on the machine
    make and remove their own meanwhile: those are held, or gone.)"""
    new = shm_entries() - before
    if not new:
        return []
    time.sleep(grace_s)
    inodes = {}
    for name in new:
        try:
            inodes[os.stat(f"/dev/shm/{name}").st_ino] = name
        except OSError:
            continue  # gone
    held: set[int] = set()
    shm_dev = os.stat("/dev/shm").st_dev
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                held |= {int(line.split()[4]) for line in f if " /dev/shm/" in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if st.st_dev == shm_dev:
                    held.add(st.st_ino)
        except (OSError, ValueError, IndexError):
            continue
    return sorted(name for ino, name in inodes.items() if ino not in held)


def table(verdicts: list[dict]) -> str:
    """The counts by (fault, place): trials, those clear within TIMEOUT + 5 s, those whose
    survivors named the victim and the call (the flight recorder's verdict), those whole on
    every rank (and on the same side of the step across the mesh)."""
    rows = {}
    for v in verdicts:
        row = rows.setdefault((v["fault"], v["place"]), [0, 0, 0, 0, 0, 0.0])
        row[0] += 1
        row[1] += v["clear"]
        row[2] += v["named"]
        row[3] += v["whole"]
        row[4] += v["mesh_whole"]
        row[5] = max(row[5], v["seconds"] or 0.0)
    lines = [f"{'fault':7} {'place':24} {'trials':>6} {'clear':>6} {'named':>6} {'whole':>6} "
             f"{'mesh':>6} {'slowest':>8}"]  # fmt: skip
    for (fault, place), (n, clear, named, whole, mesh, slowest) in sorted(
            rows.items(), key=lambda kv: (FAULTS.index(kv[0][0]), PLACES.index(kv[0][1]))):
        lines.append(f"{fault:7} {place:24} {n:6} {clear:6} {named:6} {whole:6} {mesh:6} "
                     f"{slowest:7.2f}s")
    return "\n".join(lines)


# -- running them -------------------------------------------------------------------------------

# the worlds the trials run in, and the victim in each (never rank 0: it holds the job's store)
WORLDS = {"2": 2, "dp=2,tp=2": Mesh(dp=2, tp=2)}
VICTIM = {"2": 1, "dp=2,tp=2": 3}


def run(world: str, plan: list[tuple[str, str, int]]) -> list:
    """``plan``'s trials in one spawned job of ``world``: each rank's list of reports, a
    ``RankFailure`` for a killed rank."""
    options = CommOptions(timeout=TIMEOUT)
    return spawn(trials, WORLDS[world], VICTIM[world], plan, options=options,
                 timeout=60 + 15 * len(plan), failures="return")  # fmt: skip


# Where each place's trap stands by default (see the cases), and every point a Ctrl-C is tried
# at (cheap: many share a job); a stall (7 s) and a kill (a job each) at the default only
POINTS = {"nn forward": 1, "nn backward": 1, "pipeline forward": 3, "pipeline backward": 2,
          "pipeline boundary": 2, "optim step": 1, "optim step, 2nd bucket": 1}  # fmt: skip
CTRL_C_POINTS = {"nn forward": (1, 2), "nn backward": (1, 2), "pipeline forward": (1, 2, 3, 4),
                 "pipeline backward": (1, 2, 3, 4), "pipeline boundary": (1, 2, 3, 4),
                 "optim step": (1,), "optim step, 2nd bucket": (1,)}  # fmt: skip


def stalls_and_ctrl_cs(places: tuple[str, ...]) -> tuple[tuple[str, str, int], ...]:
    """The stall and Ctrl-C trials of ``places``, in one job."""
    ctrl_c = [(p, "ctrl-c", n) for p in places for n in CTRL_C_POINTS[p]]
    return (*ctrl_c, *((p, "stall", POINTS[p]) for p in places))


def all_plans() -> list[tuple[str, tuple[tuple[str, str, int], ...]]]:
    """Every trial of the matrix, as the test file runs them: (world, plan) per spawned job."""
    plans = []
    for world, places in (("2", PLACES[:5]), ("dp=2,tp=2", PLACES[5:])):
        plans.append((world, stalls_and_ctrl_cs(places)))
        plans += [(world, ((p, "kill", POINTS[p]),)) for p in places]
    return plans


if __name__ == "__main__":  # the counts for the note
    import sys

    started = time.monotonic()
    verdicts = []
    for world, plan in all_plans():
        before = shm_entries()
        results = run(world, list(plan))
        left = shm_leftovers(before)
        for v in (judge(t) for t in split_trials(results, plan)):
            v["leftovers"] = left
            verdicts.append(v)
            if not v["clear"] or not v["whole"] or v["leaked"] or left:
                print(f"{v['fault']} {v['place']}: {v['states']} {v['problems']} "
                      f"leaked {v['leaked']}, left in /dev/shm {left}", file=sys.stderr)
    print(table(verdicts))
    print(f"{len(verdicts)} trials in {time.monotonic() - started:.0f} s")
