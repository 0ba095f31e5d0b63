"""Ranks for tests/dist/test_dist_commit_phases.py: a Ctrl-C at each phase of a step.

One pair of processes runs a trial per phase. In each, both ranks make a fresh communicator and
step (a compiled momentum step, or a ``coconet.optim.AdamW`` of two param groups: two buckets)
a few times; at step ``AT`` the victim sends itself SIGINT at one precise point: inside its
local checks, its agreement, the step's collectives, its commit vote (before and after its
vote is counted), its commit's writes (the first, a later one: for the optimizer in its second
bucket), between two buckets, or between two steps. What must hold whatever the phase: the
victim raises ``KeyboardInterrupt``, the peer a ``RuntimeFault`` (at that step, or at the next
when the step was committed), both within a few seconds (told, not timed out), and afterwards
every rank holds the same parameters, and the step changed the state on every rank or on none,
for the optimizer every bucket alike. A trial reports what it saw; the test judges.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.runtime import Communicator
from coconet.runtime import binding as binding_module
from coconet.runtime import comm as comm_module
from coconet.runtime import control as control_module
from coconet.runtime import step as step_module
from coconet.runtime import transport as transport_module
from support.sigint_workers import program  # the momentum step both trials run

N = 256
AT = 3  # the step (0-based) at which the victim is interrupted
STEPS = 6

# phase -> (what to patch, when in the call to interrupt, which call of the step: 1 = first)
STEP_PHASES = {
    "local checks": ("bind", "before", 1),
    "agreement": ("agreement", "before", 1),
    "collective": ("generated step", "inside", 1),
    "before the vote": ("vote", "before", 1),
    "after the vote": ("vote", "after", 1),
    "first commit write": ("write", "before", 1),
    "after the first commit write": ("write", "after", 1),
    "between steps": ("between steps", "before", 1),
}
OPTIM_PHASES = {
    "bucket 1 vote": ("vote", "before", 1),
    "bucket 1 commit": ("write", "after", 1),
    "between buckets": ("bucket", "after", 1),
    "bucket 2 agreement": ("agreement", "before", 2),
    "bucket 2 vote": ("vote", "after", 2),
    "bucket 2 commit": ("write", "after", 4),  # p, m, v of bucket 1, then bucket 2's first
    "between steps": ("between steps", "before", 1),
}


class _Trap:
    """Sends this process SIGINT at one point of step ``AT`` (patched in on the victim)."""

    def __init__(self, where: str, when: str, nth: int) -> None:
        self.where, self.when, self.nth = where, when, nth
        self.armed = False  # during step AT only
        self.calls = 0
        self.sent: float | None = None
        self._undo: list = []

    def fire(self) -> None:
        self.armed = False
        self.sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    def hit(self) -> bool:
        if not self.armed:
            return False
        self.calls += 1
        return self.calls == self.nth

    def wrap(self, owner, name: str, pick=None) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        raw = original.__func__ if isinstance(original, staticmethod) else original
        trap = self

        def patched(*args, **kwargs):
            if pick is not None and not pick(args, kwargs):
                return raw(*args, **kwargs)
            hit = trap.hit()
            if hit and trap.when == "before":
                trap.fire()
            out = raw(*args, **kwargs)
            if hit and trap.when == "after":
                trap.fire()
            return out

        setattr(owner, name, staticmethod(patched) if isinstance(original, staticmethod)
                else patched)  # fmt: skip
        self._undo.append((owner, name, original))

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _install(trap: _Trap, step_fn) -> None:
    if trap.where == "bind":
        trap.wrap(binding_module.InputBinding, "_bind")  # (CompiledStep's base)
    elif trap.where == "agreement":
        trap.wrap(control_module.ControlChannel, "agreement")
    elif trap.where == "vote":
        trap.wrap(comm_module.Communicator, "agree_max",
                  pick=lambda a, k: k.get("op") == "commit vote")  # fmt: skip
    elif trap.where == "write":
        trap.wrap(step_module.CompiledStep, "_write")
        trap.wrap(transport_module.Published, "copy_into")
    elif trap.where == "generated step":
        module = step_fn.module
        original = module.step

        def inside(comm, *args):
            # in the middle of the step: once it started its collectives
            if trap.hit():
                trap.fire()
            return original(comm, *args)

        module.step = inside
        trap._undo.append((module, "step", original))
    elif trap.where == "bucket":
        from coconet.optim.stepping import Stepper

        trap.wrap(Stepper, "step_bucket")


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _meet(store, tag: str, world: int, rank: int) -> None:
    store.set(f"phase/{tag}/{rank}", "1")
    store.wait([f"phase/{tag}/{r}" for r in range(world)])


def _compiled(trial: Communicator, schedule: str):
    from coconet.schedule import fuse_RS_C_AG

    target = fuse_RS_C_AG(program()) if schedule == "fuse_RS_C_AG" else program()
    step = cc.compile(target, comm=trial, fused_kernels=False)
    g = torch.full((N,), float(trial.rank + 1))
    p, m = torch.ones(N), torch.zeros(N)

    def one() -> None:
        step(g=g, p=p, m=m, lr=0.01, beta=0.9)

    return one, step, lambda: [[p, m]], lambda: [p, m]


def _optimizer(trial: Communicator):
    import coconet.optim

    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    opt = coconet.optim.AdamW([{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.1}],
                              lr=0.01, comm=trial)  # fmt: skip
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(trial.rank))

    def one() -> None:
        opt.zero_grad()
        b(a(x)).square().mean().backward()
        opt.step()

    def state() -> list[list[torch.Tensor]]:
        out = []
        for group in opt.param_groups:  # per bucket: its parameters and this rank's state
            tensors = [p.detach().clone() for p in group["params"]]
            for p in group["params"]:
                tensors += [v.clone() for v in opt.state[p].values() if torch.is_tensor(v)]
            out.append(tensors)
        return out

    def params() -> list[torch.Tensor]:  # the same on every rank
        return [p.detach() for group in opt.param_groups for p in group["params"]]

    return one, None, state, params


def trials(comm: Communicator, victim: int, kind: str, schedule: str,
           only: list[str] | None = None) -> list[dict]:  # fmt: skip
    """A trial per phase (``STEP_PHASES`` or ``OPTIM_PHASES`` by ``kind``, or those of
    ``only``); one dict each."""
    store = dist.distributed_c10d._get_default_store()
    options, mesh = comm.options, comm.mesh
    comm.close()  # each trial makes its own
    phases = STEP_PHASES if kind == "step" else OPTIM_PHASES
    phases = {k: v for k, v in phases.items() if only is None or k in only}
    out = []
    for k, (phase, (where, when, nth)) in enumerate(phases.items()):
        tag = f"{kind}/{schedule}/{k}"
        _meet(store, f"{tag}/start", comm.world, comm.rank)
        trial = Communicator(mesh, options)
        one, step_fn, state, params = (_compiled(trial, schedule) if kind == "step"
                                       else _optimizer(trial))  # fmt: skip
        one()  # the first step: agreed, compiled, warm
        trap = _Trap(where, when, nth) if trial.rank == victim else None
        if trap is not None and where != "between steps":
            _install(trap, step_fn)
        status, raised_at, before = "finished", None, None
        try:
            for s in range(1, STEPS):
                if s == AT:
                    before = [_digest(x) for x in state()]
                    if trap is not None:
                        trap.armed = True
                one()
                if trap is not None and s == AT and where == "between steps":
                    trap.armed = True
                    trap.hit()
                    trap.fire()
        except KeyboardInterrupt as exc:
            status, raised_at = "KeyboardInterrupt", time.monotonic()
            notes = " ".join(getattr(exc, "__notes__", []))
            status += " (committed)" if "committed on this rank and on every other" in notes \
                or "was applied on every rank" in notes else ""  # fmt: skip
            if not trial.broken:
                trial.abort("interrupted after its step")  # as the script's exit would tell
        except RuntimeFault as exc:
            status, raised_at = "RuntimeFault", time.monotonic()
            status += f": {str(exc).splitlines()[0][:160]}"
        finally:
            if trap is not None:
                trap.undo()
        after = [_digest(x) for x in state()]
        changed = [b != a for b, a in zip(before or after, after, strict=True)]
        if trap is not None:
            store.set(f"phase/{tag}/sent", repr(trap.sent))
        _meet(store, f"{tag}/end", comm.world, comm.rank)
        sent = store.get(f"phase/{tag}/sent").decode()
        store.set(f"phase/{tag}/read/{trial.rank}", "1")
        if trial.rank == 0:
            store.wait([f"phase/{tag}/read/{r}" for r in range(comm.world)])
        sent_at = None if sent == "None" else float(sent)
        out.append(dict(
            phase=phase, status=status, changed=changed, params=_digest(params()),
            after_signal=None if raised_at is None or sent_at is None else raised_at - sent_at,
        ))  # fmt: skip
        trial.close()
    return out
