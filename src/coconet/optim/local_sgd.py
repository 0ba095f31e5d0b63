"""Local SGD and Overlap Local-SGD: local steps of any optimizer, the models averaged every
``period`` steps; in the overlapped variant the average travels while the next steps run.

::

    comm = coconet.runtime.init()
    local = torch.optim.AdamW(model.parameters(), lr=1e-3)        # no DDP: local gradients
    opt = coconet.optim.LocalSGD(local, period=8, comm=comm)     # average every 8 steps
    opt = coconet.optim.OverlapLocalSGD(local, period=8, pull=0.5, comm=comm)

**Local SGD** (torch's ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager``): each rank
steps its own model on its own data; after every ``period``-th step the models are replaced by
their average (``sum over ranks / world``, one all_reduce). ``host_period=h`` adds torch's
``HierarchicalModelAverager``'s inner level: after every ``h``-th step the ranks of each host
average among themselves (shared memory), across hosts every ``period`` steps.

**Overlap Local-SGD** (Wang, Liang and Joshi, ICASSP 2020; the seed's anchor-model algorithm):
every rank keeps an anchor ``z``, the same on all of them. After every ``period``-th step, sync
number ``j``:

1. the average ``a`` started at sync ``j - 1`` is waited for (it has had ``period`` local steps
   to arrive); the anchor moves to it: ``v = momentum * v + (a - z)``, ``z = z + v``
   (``momentum=0``: ``z = a``);
2. each local model is pulled toward the anchor: ``x = lerp(x, z, pull)``;
3. the average of the pulled models is started, to arrive by sync ``j + 1``.

At sync 1 there is no average in flight: the anchor is the starting model (every rank's is made
rank 0's at construction, as DDP does). Nothing reads an average before its wait, and each
started average is waited for exactly once, by construction: one is in flight at a time, in a
buffer of its own (the models change in place during the local steps, so what is sent is a
snapshot). Its meaning, rank by rank, is ``coconet.testing``-free plain torch:
``tests/support/local_sgd_workers.py`` holds the references the tests hold it to.

Where the average travels (``placement``, said by ``explain()``): on one host over shared memory,
which completes a collective when it starts (no overlap: on a CPU the copies take the cores the
steps would run on); across hosts in two levels, the host's sum reduce-scattered over shared
memory at the start, each slice all-reduced across hosts over torch.distributed in flight, and
gathered over shared memory at the wait; flat over torch.distributed where the hosts do not
hold the ranks in blocks of equal size.

A failed average (a dead peer, a timeout) raises ``RuntimeFault`` at the sync, before any model,
anchor or counter changes.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from coconet.errors import ConfigError, ConfigValueError
from coconet.ir.mesh import Mesh
from coconet.ir.ops import ReduceOp
from coconet.ir.types import slice_bounds
from coconet.optim.settings import default_comm
from coconet.options import AlgorithmPolicy, TransportKind, TransportPolicy
from coconet.runtime.comm import Communicator, Work
from coconet.runtime.symmem import host_identity

__all__ = ["LocalSGD", "OverlapLocalSGD", "Placement"]


class Placement(enum.Enum):
    """Where a model average travels."""

    # every rank on one host: the communicator's route (shared memory: done when it starts)
    ONE_HOST = "one host, the communicator's route"
    # inside each host over shared memory, across hosts over torch.distributed (in flight)
    TWO_LEVEL = "two levels: shared memory inside a host, torch.distributed across hosts"
    # the whole world over torch.distributed (in flight)
    FLAT = "flat over torch.distributed"
    # the communicator's own route for its whole world, waited for at once (LocalSGD)
    COMMUNICATOR = "the communicator's route for its world, waited for at once"


def _host_blocks(comm: Communicator) -> tuple[int, int] | None:
    """(hosts, ranks per host) where every host holds an equal block of consecutive ranks (the
    layout of ``Mesh(host=H, local=L)``); None otherwise. Collective."""
    hosts = [h for (h,) in comm.exchange((host_identity(),), "coconet.optim local-sgd hosts")]
    names = list(dict.fromkeys(hosts))
    n_hosts = len(names)
    if comm.world % n_hosts:
        return None
    per = comm.world // n_hosts
    if any(hosts[r] != names[r // per] for r in range(comm.world)):
        return None
    return n_hosts, per


class _Averager:
    """The average of a flat tensor over every rank: started, then finished (``Placement``)."""

    def __init__(self, comm: Communicator, *, in_flight: bool, host_level: bool) -> None:
        self.world = comm.world
        self.comm = comm
        self.inside: Communicator | None = None  # the ranks of this rank's host
        self.across: Communicator | None = None  # this rank's counterparts on other hosts
        blocks = _host_blocks(comm) if comm.world > 1 else (1, 1)
        if host_level and (blocks is None or comm.root is not comm):
            raise ConfigError(
                "host_period= needs a communicator of the whole job whose hosts each hold an "
                "equal block of consecutive ranks",
                op="coconet.optim.LocalSGD",
                hint="launch the same number of ranks on each host (torchrun --nproc-per-node), "
                "or leave host_period out",
            )
        self.placement = Placement.COMMUNICATOR
        if in_flight:
            self.placement = Placement.FLAT
            if blocks is not None and blocks[0] == 1:
                self.placement = Placement.ONE_HOST
            elif blocks is not None and comm.root is comm:
                self.placement = Placement.TWO_LEVEL
        mesh = None if blocks is None else Mesh(host=blocks[0], local=blocks[1])
        if (host_level or self.placement is Placement.TWO_LEVEL) and blocks[1] > 1:
            self.inside = Communicator(mesh, comm.options).along("local")
        # in flight over torch.distributed: gloo's own all_reduce, which its thread runs to the
        # end (an algorithm in two phases would start its second at the wait, and a measured
        # choice would time candidates inside the first start)
        flat = replace(comm.options, transport=TransportPolicy.TORCH_DISTRIBUTED,
                       algorithms=AlgorithmPolicy.NATIVE)
        if self.placement is Placement.TWO_LEVEL:
            self.across = Communicator(mesh, flat).along("host")
        elif self.placement is Placement.FLAT:
            self.comm = comm.variant(flat)

    def start(self, flat: torch.Tensor, label: str) -> tuple[Work, list[int] | None]:
        """Start the sum of ``flat`` (this rank's to give away: donated) over every rank."""
        if self.placement is not Placement.TWO_LEVEL:
            return self.comm.all_reduce_start(flat, ReduceOp.SUM, axis=None, donate=True,
                                              label=label), None  # fmt: skip
        return self._telling_the_host(self._start_two_level, flat, label)

    def finish(self, handle: tuple[Work, list[int] | None], out: torch.Tensor) -> torch.Tensor:
        """The average of what ``start`` was given (the sum divided by the world) in ``out``."""
        work, parts = handle
        if self.placement is not Placement.TWO_LEVEL:
            return torch.div(self.comm.wait(work), self.world, out=out)
        return self._telling_the_host(self._finish_two_level, work, parts, out)

    def _telling_the_host(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; where it fails, the host's communicator is aborted first. Each rank
        of a host takes the leg across hosts with its own counterparts: one may fail there
        (its counterpart died) where its host peer's leg had completed, and that peer would
        wait for it in the host's next collective until the timeout."""
        try:
            return fn(*args)
        except BaseException as e:
            if self.inside is not None and self.inside.broken is None:
                self.inside.abort(f"its average across hosts failed: {type(e).__name__}")
            raise

    def _start_two_level(self, flat: torch.Tensor, label: str
                         ) -> tuple[Work, list[int] | None]:  # fmt: skip
        parts = None
        mine = flat
        if self.inside is not None:
            n = self.inside.world
            parts = [b - a for a, b in (slice_bounds(flat.numel(), n, i) for i in range(n))]
            mine = self.inside.wait(self.inside.reduce_scatter_start(
                flat, ReduceOp.SUM, dim=0, axis=None, donate=True, label=label))  # fmt: skip
        # a copy of its own: the slice may lie in the host's shared area, which the next
        # collective inside the host reuses while this one is still in flight
        return self.across.all_reduce_start(mine.clone(), ReduceOp.SUM, axis=None,
                                            donate=True, label=label), parts  # fmt: skip

    def _finish_two_level(self, work: Work, parts: list[int] | None, out: torch.Tensor
                          ) -> torch.Tensor:  # fmt: skip
        total = self.across.wait(work)
        if parts is not None:
            total = self.inside.wait(self.inside.all_gather_start(
                total, dim=0, parts=parts, axis=None, label=work.label))  # fmt: skip
        return torch.div(total, self.world, out=out)

    def host_average(self, flat: torch.Tensor, label: str) -> torch.Tensor:
        """The average of ``flat`` over this rank's host (itself on a host of one), in
        ``flat``."""
        if self.inside is None:
            return flat
        total = self.inside.wait(self.inside.all_reduce_start(
            flat, ReduceOp.SUM, axis=None, donate=True, label=label))  # fmt: skip
        return torch.div(total, self.inside.world, out=flat)


def _checked_period(value: Any, name: str, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigValueError(
            f"{name}={value!r}: expected a whole number of steps >= 1",
            op=op,
            hint=f"{name}=8 averages after every 8th step",
        )
    return int(value)


def _checked_fraction(value: Any, name: str, op: str, *, low_open: bool) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(value) and (0 < value <= 1 if low_open else 0 <= value < 1))
    if not ok:
        span = "in (0, 1]" if low_open else "in [0, 1)"
        raise ConfigValueError(
            f"{name}={value!r}: expected a number {span}",
            op=op,
            hint="pull=0.5 moves each model half way to the anchor at a sync; momentum=0.0 "
            "makes the anchor the average itself",
        )
    return float(value)


class LocalSGD(torch.optim.Optimizer):
    """``optimizer``'s steps on this rank alone; after every ``period``-th step the models are
    replaced by their average over the ranks (``host_period``: also over each host's ranks after
    every ``host_period``-th). ``warmup_steps``: steps before the first average counts (torch's
    ``PeriodicModelAverager``'s), each followed by an average.

    A drop-in ``torch.optim.Optimizer``: ``param_groups`` and ``state`` are the wrapped one's
    (LR schedulers work), ``state_dict()`` is the wrapped one's plus a ``"local_sgd"`` entry, and
    a state dict of the wrapped optimizer alone loads too (the step count starts at 0)."""

    _op = "coconet.optim.LocalSGD"

    def __init__(self, optimizer: torch.optim.Optimizer, *, period: int, comm: Any = None,
                 warmup_steps: int = 0, host_period: int | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer, got {optimizer!r}",
                op=self._op,
                hint=f"{type(self).__name__}(torch.optim.AdamW(model.parameters()), period=8)",
            )
        inner_comm = getattr(optimizer, "comm", None)
        if isinstance(inner_comm, Communicator) and inner_comm.world > 1:
            raise ConfigError(
                f"the wrapped {type(optimizer).__name__} averages gradients over "
                f"{inner_comm.world} ranks at every step: its steps are not local",
                op=self._op,
                hint="wrap a torch optimizer (or a coconet one over a world of one)",
            )
        self.period = _checked_period(period, "period", self._op)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) \
                or warmup_steps < 0:
            raise ConfigValueError(f"warmup_steps={warmup_steps!r}: expected a whole number >= 0",
                                   op=self._op, hint="warmup_steps=0")  # fmt: skip
        self.warmup_steps = int(warmup_steps)
        self.host_period = (None if host_period is None
                            else _checked_period(host_period, "host_period", self._op))
        self.optimizer = optimizer
        self.comm = default_comm(comm, type(self).__name__)
        self.steps = 0  # steps taken (what decides when to average)
        seen: set[int] = set()
        self._params = [p for g in optimizer.param_groups for p in g["params"]
                        if id(p) not in seen and not seen.add(id(p))]  # fmt: skip
        devices = sorted({str(p.device) for p in self._params} - {str(self.comm.device)})
        if devices:
            raise ConfigError(
                f"parameters on {devices}, but the communicator's collectives run on "
                f"{self.comm.device}",
                op=self._op,
                hint="keep the model on the communicator's device (CPU over gloo and shared "
                "memory; CUDA over NCCL)",
            )
        self._averager = _Averager(self.comm, in_flight=self._in_flight,
                                   host_level=self.host_period is not None)  # fmt: skip
        # one flat buffer per dtype, made once: a fresh tensor costs its page faults at every
        # sync (made once, a sync's own time at 16M parameters across two hosts fell from
        # 200-540 ms to 140-300 ms); then DDP's habit: every rank starts from rank 0's model
        self._flat = self._flats()
        with torch.no_grad():
            for i, flat in enumerate(self._flat):
                got = self.comm.wait(self.comm.broadcast_start(
                    flat, root=0, axis=None, donate=False, label=f"{self._op}: start ({i})"))
                self._write(i, got)

    _in_flight = False

    # -- torch.optim.Optimizer's face: the wrapped optimizer's groups and state -----------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError(
            "a param group cannot be added to a Local-SGD optimizer after it was made",
            op=self._op,
            hint="add the group to the wrapped optimizer before wrapping it",
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(period={self.period}, {self.optimizer!r})"

    # -- the flat model, one tensor per dtype ---------------------------------------------------

    def _dtypes(self) -> list[torch.dtype]:
        return list(dict.fromkeys(p.dtype for p in self._params))

    def _flats(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """A flat copy of the parameters, one per dtype (in ``_dtypes`` order): new, or in
        ``out``'s tensors."""
        return [torch.cat([p.detach().reshape(-1) for p in self._params if p.dtype == d],
                          **({} if out is None else {"out": out[i]}))
                for i, d in enumerate(self._dtypes())]  # fmt: skip

    def _write(self, i: int, flat: torch.Tensor) -> None:
        at = 0
        d = self._dtypes()[i]
        for p in self._params:
            if p.dtype == d:
                p.detach().copy_(flat[at : at + p.numel()].view_as(p))
                at += p.numel()

    # -- stepping ---------------------------------------------------------------------------------

    def step(self, closure: Any = None) -> Any:
        loss = self.optimizer.step(closure)
        self.steps += 1
        with torch.no_grad():
            self._after_step()
        return loss

    def _after_step(self) -> None:
        n = self.steps
        if n <= self.warmup_steps or (n - self.warmup_steps) % self.period == 0:
            label = f"{self._op}: average after step {n}"
            flats = self._flats(self._flat)
            averaged = [self._averager.finish(self._averager.start(f, label), out=f)
                        for f in flats]  # fmt: skip
        elif self.host_period is not None and n % self.host_period == 0:
            label = f"{self._op}: host average after step {n}"
            averaged = [self._averager.host_average(f, label) for f in self._flats(self._flat)]
        else:
            return
        for i, flat in enumerate(averaged):  # only once every average has arrived
            self._write(i, flat)

    def explain(self) -> str:
        """How and where the models are averaged."""
        lines = [f"{type(self).__name__} over {type(self.optimizer).__name__}: "
                 f"{self.comm.world} ranks, the models averaged every {self.period} steps"]
        if self.warmup_steps:
            lines.append(f"  every step until step {self.warmup_steps} (warm-up)")
        if self.host_period is not None:
            lines.append(f"  and inside each host every {self.host_period} steps")
        lines.append(f"  the average travels: {self._averager.placement.value}")
        return "\n".join(lines)

    # -- checkpoints ------------------------------------------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def state_dict(self) -> dict[str, Any]:
        out = self.optimizer.state_dict()
        out["local_sgd"] = {"kind": type(self).__name__, "period": self.period,
                            **self._extra_state()}  # fmt: skip
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("local_sgd", None)
        if extra is not None and extra.get("kind") != type(self).__name__:
            raise ConfigError(
                f"the state dict is {extra.get('kind')!r}'s, this optimizer is "
                f"{type(self).__name__}",
                op=f"{self._op}.load_state_dict",
                hint="load it into the kind of optimizer that saved it, or load "
                "the wrapped optimizer's part alone (without 'local_sgd')",
            )
        # every check first, the wrapped optimizer's own (torch refuses a misfit before it
        # changes anything) included: a state dict that does not fit changes nothing
        apply = self._load_extra(extra or {"steps": 0})
        self.optimizer.load_state_dict(state_dict)
        apply()

    def _load_extra(self, extra: dict[str, Any]) -> Callable[[], None]:
        """``extra`` checked: what loading it does, to run once everything else is loaded."""
        steps = int(extra["steps"])

        def apply() -> None:
            self.steps = steps

        return apply


class OverlapLocalSGD(LocalSGD):
    """Overlap Local-SGD (module docstring): ``optimizer``'s local steps; after every
    ``period``-th, the anchor moves to the average that was started ``period`` steps before
    (with ``momentum``), each model is pulled ``pull`` of the way toward it, and the average of
    the pulled models starts, to be waited for at the next sync.

    ``state_dict()`` holds the anchor, its velocity and the average in flight (waited for: a
    checkpoint is a point where nothing travels), each as one flat tensor per parameter dtype.
    """

    _op = "coconet.optim.OverlapLocalSGD"
    _in_flight = True

    def __init__(self, optimizer: torch.optim.Optimizer, *, period: int, pull: float = 0.5,
                 momentum: float = 0.0, comm: Any = None) -> None:
        self.pull = _checked_fraction(pull, "pull", self._op, low_open=True)
        self.momentum = _checked_fraction(momentum, "momentum", self._op, low_open=False)
        super().__init__(optimizer, period=period, comm=comm)
        self.anchor = self._flats()  # the starting model, rank 0's on every rank
        self.velocity = [torch.zeros_like(a) for a in self.anchor] if self.momentum else None
        self._handles: list[Any] | None = None  # the averages in flight (one per dtype)
        self._arrived: list[torch.Tensor] | None = None  # ... or already waited for
        # Buffers made once (``_flat`` holds the pulled model): what is sent, which travels
        # while the models change in place, so it is a snapshot of its own; the average that
        # arrives; the next anchor and velocity, swapped in only once the sync has succeeded
        self._send = [torch.empty_like(a) for a in self.anchor]
        self._landing = [torch.empty_like(a) for a in self.anchor]
        self._spare = [torch.empty_like(a) for a in self.anchor]
        self._spare_v = None if self.velocity is None else [torch.empty_like(a)
                                                            for a in self.anchor]

    def _after_step(self) -> None:
        n = self.steps
        if n % self.period:
            return
        label = f"{self._op}: average after step {n}"
        # 1. the average in flight, waited for (a fault raises here: nothing has changed but
        #    the local step)
        arrived = self._arrived
        if arrived is None and self._handles is not None:
            arrived = [self._averager.finish(h, out=b)
                       for h, b in zip(self._handles, self._landing, strict=True)]
        anchor, velocity = self.anchor, self.velocity
        if arrived is not None:
            if velocity is not None:  # v' = v * momentum + (a - z); z' = z + v'
                velocity = [torch.mul(v, self.momentum, out=sv).add_(torch.sub(a, z, out=sz))
                            for v, a, z, sv, sz in zip(velocity, arrived, anchor, self._spare_v,
                                                       self._spare, strict=True)]  # fmt: skip
                anchor = [torch.add(z, v, out=sz)
                          for z, v, sz in zip(anchor, velocity, self._spare, strict=True)]
            else:
                anchor = arrived
        # 2. the pull, in the flat buffers: the models change once the next average started
        pulled = [x.lerp_(z, self.pull) for x, z in
                  zip(self._flats(self._flat), anchor, strict=True)]  # fmt: skip
        # 3. the next average starts from a snapshot of its own (the models go on changing)
        handles = [self._averager.start(s.copy_(x), label)
                   for s, x in zip(self._send, pulled, strict=True)]
        self._handles, self._arrived = handles, None
        # the buffers the old anchor (and velocity) held take the next ones' place
        if arrived is not None:
            if velocity is not None:
                self._spare, self._spare_v = self.anchor, self.velocity
            elif arrived[0] is self._landing[0]:
                self._landing = self.anchor
            # (else a state dict's average arrived, in tensors of its own: the old anchor goes)
        self.anchor, self.velocity = anchor, velocity
        for i, x in enumerate(pulled):
            self._write(i, x)

    def explain(self) -> str:
        text = super().explain()
        at_start = (self._averager.placement is Placement.ONE_HOST
                    and self.comm.world > 1
                    and self.comm.transport_of(None) is TransportKind.SHARED_MEMORY)
        overlap = ("completes when it starts (shared memory: no overlap to gain on a CPU)"
                   if at_start else "arrives while the next steps run")
        return (f"{text}\n  pull {self.pull}, anchor momentum {self.momentum}; each average "
                f"{overlap}")

    def wait_average(self) -> None:
        """Wait for the average in flight, if any (collective: every rank at the same point),
        so that nothing travels from here on; the anchor moves to it at the next sync, as it
        would have. What ``state_dict()`` does first; call it before timing something else,
        or before the process group goes away."""
        if self._arrived is None and self._handles is not None:
            self._arrived = [self._averager.finish(h, out=b)
                             for h, b in zip(self._handles, self._landing, strict=True)]
            self._handles = None

    def _extra_state(self) -> dict[str, Any]:
        self.wait_average()
        names = [str(d) for d in self._dtypes()]
        return {
            "steps": self.steps,
            "anchor": dict(zip(names, [a.clone() for a in self.anchor], strict=True)),
            "velocity": (None if self.velocity is None else
                         dict(zip(names, [v.clone() for v in self.velocity], strict=True))),
            "arrived": (None if self._arrived is None else
                        dict(zip(names, [a.clone() for a in self._arrived], strict=True))),
        }

    def _load_extra(self, extra: dict[str, Any]) -> Callable[[], None]:
        # an average in flight is waited for first (collective, as ``state_dict()``'s): never
        # dropped while it may still read the buffer the next sync sends from
        self.wait_average()
        names = [str(d) for d in self._dtypes()]
        mine = self._flats()

        def flats(entry: str) -> list[torch.Tensor] | None:
            got = extra.get(entry)
            if got is None:
                return None
            if sorted(got) != sorted(names) or any(
                got[n].numel() != m.numel() for n, m in zip(names, mine, strict=True)
            ):
                raise ConfigError(
                    f"the state dict's {entry} does not fit this model",
                    op=f"{self._op}.load_state_dict",
                    details=[f"saved: {[(k, v.numel()) for k, v in got.items()]}",
                             f"here: {[(n, m.numel()) for n, m in zip(names, mine, strict=True)]}"],
                    hint="load a state dict saved from the same model",
                )
            return [got[n].to(m.dtype).reshape(-1).clone()
                    for n, m in zip(names, mine, strict=True)]  # fmt: skip

        steps = int(extra["steps"])
        anchor = flats("anchor")
        velocity = flats("velocity")
        arrived = flats("arrived")
        if self.momentum and velocity is None and anchor is not None:
            velocity = [torch.zeros_like(a) for a in anchor]

        def apply() -> None:
            self.steps = steps
            self.anchor = anchor if anchor is not None else mine
            self.velocity = velocity if self.momentum else None
            self._arrived = arrived
            self._handles = None

        return apply
