"""``DistributedOptimizer``: a ``torch.optim.Optimizer`` whose step is a compiled coconet program.

What it does with the parameters (the contract ``coconet.optim``'s optimizers share):

- **Buckets.** The parameters of each param group are packed, per dtype, into one flat bucket:
  each parameter's ``.data`` becomes a view of the bucket's flat parameter tensor and its
  ``.grad`` a view of the bucket's flat gradient, which lives in symmetric memory where the
  transport has it (``CompiledStep.input_buffer``). ``backward()`` accumulates straight into it;
  ``step()`` hands the whole bucket to the program; nothing is copied per step.
- **The step** reduces the gradients itself (the average over ranks, as DDP computes it; no DDP
  wrapper is needed) with the optimizer's schedule: by default ``fuse_RS_C_AG`` with the state
  stored sliced, so each rank keeps ``1/world`` of the state and updates only its slice, inside
  the fused collective; over shared memory as one pass.
- **All or nothing.** A bucket's update is committed on every rank or on none (the compiled
  step's guarantee). With several buckets (several param groups or dtypes) each is its own step:
  a failure in a later bucket leaves the earlier ones updated (the step counts are kept per
  bucket, so a retry does not apply them twice).
- **Hyper-parameters** are read from ``param_groups`` at every step (``torch.optim.lr_scheduler``
  works unchanged); their scalar arithmetic is done on the host in float64.
- ``zero_grad()`` zeroes the buckets and keeps every ``.grad`` a view of its bucket, whatever
  ``set_to_none`` says: a ``None`` gradient would make the next ``backward()`` allocate a new
  tensor outside the bucket. A ``.grad`` replaced by another tensor is copied back into the
  bucket at the next step (and made a view again).
- ``state_dict()`` is torch's format, gathered from the slices (collective: every rank calls it);
  ``load_state_dict()`` takes that format from any world size, or from the torch optimizer.

Every rank must construct the optimizer over the same parameter shapes, in the same order
(checked: a mismatch fails on every rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from coconet import schedule as schedules
from coconet.compiler import compile as coconet_compile
from coconet.errors import ConfigError
from coconet.ir.program import Program
from coconet.ir.types import DType, slice_bounds
from coconet.optim import checkpoint
from coconet.optim import ddp as ddp_hook
from coconet.options import CommitMode, CompileOptions
from coconet.runtime.comm import Communicator
from coconet.schedule import Schedule

__all__ = ["DistributedOptimizer"]

_DTYPES = {torch.float32: DType.float32}


@dataclass
class _Bucket:
    """One param group's parameters of one dtype, as one flat vector the program steps."""

    group: int  # index into param_groups
    params: list[torch.nn.Parameter]
    offsets: list[int]
    size: int  # elements
    step_fn: Any  # the CompiledStep
    bounds: tuple[int, int]  # this rank's slice of the bucket (the state it keeps)
    names: dict[str, str]  # state: program input -> torch's state key
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # program name -> this slice
    steps: int = 0
    # packed (not with ddp=): the parameters, flat (each param's .data a view of it), and the
    # gradients, flat (symmetric memory where the transport has it; each .grad a view of it)
    flat: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.size


class DistributedOptimizer(torch.optim.Optimizer):
    """Base of ``coconet.optim``'s optimizers (see the module docstring for the contract).

    A subclass names its DSL program (``program``), the program's state inputs and their
    ``torch.optim`` names (``state_names``), and the host scalars of one step (``scalars``).
    """

    # One bucket per parameter tensor instead of per (group, dtype): for updates whose norms are
    # a tensor's own (LAMB's layer-wise trust ratio). One fused collective per parameter.
    bucket_per_parameter = False

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        comm: Communicator,
        schedule: str | Callable[[Program], Schedule] | None = None,
        options: CompileOptions | None = None,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
    ) -> None:
        if not isinstance(comm, Communicator):
            raise ConfigError(
                f"{type(self).__name__} needs the communicator, got comm={comm!r}",
                op=f"coconet.optim.{type(self).__name__}",
                hint="comm = coconet.runtime.init(); opt = coconet.optim."
                f"{type(self).__name__}(model.parameters(), comm=comm)",
            )
        self._comm = comm
        self._schedule = schedule
        # State updates take the new storage (no copy); the parameters are always written in
        # place (they are views of a bucket, see step()).
        self._options = dataclasses.replace(options or CompileOptions(), commit=CommitMode.SWAP)
        self._buckets: list[_Bucket] = []
        self._auto: dict[tuple[str, str], Any] = {}  # schedule="auto": (program, size class)
        self._ddp = ddp
        if ddp is not None:
            ddp_hook.check_and_register(self, ddp)
        super().__init__(params, defaults)  # calls add_param_group for each group

    # -- what a subclass provides ---------------------------------------------------------------

    def program(self, group: dict[str, Any], dtype: DType) -> Program:
        """One step of the optimizer over a flat bucket of ``dtype``: inputs ``g`` (Local) and
        ``p`` (Replicated), the state (Replicated; the schedule slices it), then the scalars."""
        raise NotImplementedError

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        """The program's state inputs for ``group`` -> their names in torch's state dict."""
        raise NotImplementedError

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        """The program's scalar inputs for ``group`` at step ``step`` (1-based), computed in
        float64 on the host."""
        raise NotImplementedError

    # -- buckets --------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and packs the group's parameters into buckets (collective: every rank
        adds the same group at the same point)."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in group["params"]:
            self._check_param(p, index)
            by_dtype.setdefault(p.dtype, []).append(p)
        if self._ddp is not None:
            ddp_hook.check_group(self, index)
            return  # DDP's buckets are the buckets: made on the hook's first call
        for dtype, params in by_dtype.items():
            if self.bucket_per_parameter:
                for param in params:
                    self._buckets.append(self._bucket(index, group, dtype, [param]))
            else:
                self._buckets.append(self._bucket(index, group, dtype, params))

    def _check_param(self, p: torch.Tensor, index: int) -> None:
        name = f"coconet.optim.{type(self).__name__}"
        if not p.requires_grad:
            raise ConfigError(
                f"param group {index}: a parameter of shape {tuple(p.shape)} does not require "
                "grad, so it would never get a gradient",
                op=name,
                hint="pass only trainable parameters: [p for p in model.parameters() "
                "if p.requires_grad]",
            )
        if p.dtype not in _DTYPES:
            raise ConfigError(
                f"param group {index}: parameters of dtype {p.dtype} are not supported (only "
                "float32 is)",
                op=name,
                hint="keep the parameters in float32 (mixed precision: autocast the forward)",
            )
        if p.device != self._comm.device:
            raise ConfigError(
                f"param group {index}: a parameter is on {p.device}, the communicator on "
                f"{self._comm.device}",
                op=name,
                hint="move the model to the communicator's device before building the optimizer",
            )

    def _bucket(
        self, index: int, group: dict[str, Any], dtype: torch.dtype, params: list
    ) -> _Bucket:
        """A packed bucket: the parameters become views of one flat tensor, their gradients
        views of one flat buffer the program reads in place."""
        bucket = self._compiled_bucket(index, group, dtype, params)
        total = bucket.size
        flat = torch.empty(total, dtype=dtype, device=self._comm.device)
        grad = bucket.step_fn.input_buffer("g", (total,))
        grad.zero_()
        with torch.no_grad():
            for p, off in zip(params, bucket.offsets, strict=True):
                view = flat[off : off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
                if p.grad is not None:
                    grad[off : off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = grad[off : off + p.numel()].view_as(p)
        bucket.flat, bucket.grad = flat, grad
        return bucket

    def _compiled_bucket(
        self, index: int, group: dict[str, Any], dtype: torch.dtype, params: list
    ) -> _Bucket:
        """The step of ``params`` as one flat vector, its state zero (collective: the ranks
        agree on the shapes, then compile)."""
        comm = self._comm
        self._agree_on_shapes(index, dtype, params)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        program = self.program(group, _DTYPES[dtype])
        names = self.state_names(group)
        target = self._scheduled(program, tuple(names), total)
        step_fn = coconet_compile(target, comm=comm, options=self._options)
        bounds = slice_bounds(total, comm.world, comm.rank)
        bucket = _Bucket(index, params, offsets, total, step_fn, bounds, names)
        n = bounds[1] - bounds[0]
        for name in names:
            size = n if _is_sliced(step_fn.program, name) else total
            bucket.state[name] = torch.zeros(size, dtype=dtype, device=comm.device)
        return bucket

    def _scheduled(
        self, program: Program, state: tuple[str, ...], total: int = 0
    ) -> Program | Schedule:
        choice = self._schedule if self._schedule is not None else "fuse_RS_C_AG"
        if callable(choice):
            return choice(program)
        if choice == "auto":
            return self._tuned(program, state, total)
        named = {
            "AR_C": lambda p: schedules.AR_C(p),
            "RS_C_AG": lambda p: schedules.RS_C_AG(p, state=state),
            "fuse_RS_C_AG": lambda p: schedules.fuse_RS_C_AG(p, state=state),
            "unscheduled": lambda p: p,
        }
        if choice not in named:
            raise ConfigError(
                f"unknown schedule {choice!r}",
                op=f"coconet.optim.{type(self).__name__}",
                hint=f"one of {', '.join(map(repr, named))}, 'auto', or a function "
                "program -> Schedule",
            )
        return named[choice](program)

    def _tuned(self, program: Program, state: tuple[str, ...], total: int) -> Program | Schedule:
        """``schedule="auto"``: the tuner's choice for a bucket of ``total`` elements, once per
        (program, size class): buckets of very different sizes (LAMB's one per parameter, or
        param groups) may get different schedules, and same-class buckets reuse the choice (a
        program's schedule does not depend on its size: N is symbolic). Collective."""
        from coconet.tune import tune
        from coconet.tune.tuner import tuning_bucket

        key = (program.digest(), tuning_bucket(total * 4))
        if key not in self._auto:
            result = tune(
                program,
                self._comm,
                {"N": max(total, self._comm.world)},
                options=self._options,
                state=state,
                transports=[self._comm.transport_of(None)],
                top=2,
                reps=5,
                fix_algorithms=False,
            )
            self._auto[key] = result
        return self._auto[key].winner.target

    @property
    def tuning(self) -> list[Any]:
        """With ``schedule="auto"``: the ``TuneResult`` of each size class tuned (its
        ``explain()`` says why each schedule was chosen)."""
        return list(self._auto.values())

    def _agree_on_shapes(self, index: int, dtype: torch.dtype, params: list) -> None:
        """Every rank packs the same shapes in the same order, else all of them fail."""
        text = f"{index}|{dtype}|" + ";".join(str(tuple(p.shape)) for p in params)
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        low, high = self._comm.agree_max([digest, -digest], "optimizer parameters")
        if low != digest or -high != digest:
            raise ConfigError(
                f"param group {index} ({dtype}): the ranks hold different parameters "
                f"({len(params)} here, shapes {[tuple(p.shape) for p in params][:4]}...)",
                op=f"coconet.optim.{type(self).__name__}",
                hint="build the same model on every rank and pass its parameters in the same "
                "order",
            )

    # -- a step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step over every bucket. With ``ddp=``, the update already happened during
        ``backward()`` (DDP's communication hook ran it, bucket by bucket): only ``closure``
        runs (a closure that calls ``backward()`` triggers the update itself)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._ddp is not None:
            return loss
        for b in self._buckets:
            self._gather_grads(b)
            group = self.param_groups[b.group]
            # `flat` is passed as a view: the commit writes a view's values in place rather than
            # handing it new storage, so the parameters (views of it) see the update.
            b.step_fn(g=b.grad, p=b.flat[:], **b.state, **self.scalars(group, b.steps + 1))
            b.steps += 1
        return loss

    def _gather_grads(self, b: _Bucket) -> None:
        """Make every parameter's .grad the view of its bucket again (copying a replaced one)."""
        for p, off in zip(b.params, b.offsets, strict=True):
            view = b.grad[off : off + p.numel()]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets; every ``.grad`` stays a view of its bucket (see the
        module docstring: ``set_to_none`` is not honoured, by design). With ``ddp=``, torch's
        ``zero_grad`` (DDP owns the gradient buffers)."""
        if self._ddp is not None:
            return super().zero_grad(set_to_none)
        for b in self._buckets:
            b.grad.zero_()
            self._gather_grads(b)

    # -- checkpoints ----------------------------------------------------------------------------

    def _packed_groups(self) -> tuple[list[dict[str, Any]], dict[int, int]]:
        """param_groups as torch saves them (parameters as indices), and the index of each."""
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            packed["params"] = ids
            groups.append(packed)
        return groups, index

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's slices of the state with their offsets, no communication (see
        ``coconet.optim.checkpoint``: when to use it rather than ``state_dict``)."""
        groups, index = self._packed_groups()
        return checkpoint.sharded_state_dict(self, groups, index)

    def state_dict(self) -> dict[str, Any]:
        """torch's format (``{'state': {index: {...}}, 'param_groups': [...]}``), whole tensors
        gathered from every rank's slice: collective, the same on every rank, and loadable into
        the torch optimizer or into this one at any world size."""
        groups, index = self._packed_groups()
        state: dict[int, dict[str, Any]] = {}
        for b in self._buckets:
            if b.steps == 0:
                continue  # as torch: no state before the first step
            whole = {name: self._whole(b, name) for name in b.names}
            for p, off in zip(b.params, b.offsets, strict=True):
                entry: dict[str, Any] = self.step_state(b.steps)
                for name, key in b.names.items():
                    entry[key] = whole[name][off : off + p.numel()].view_as(p).clone()
                state[index[id(p)]] = entry
        return {"state": state, "param_groups": groups}

    def step_state(self, steps: int) -> dict[str, Any]:
        """The per-parameter entries besides the tensors (Adam's ``step``)."""
        return {}

    def _whole(self, b: _Bucket, name: str) -> torch.Tensor:
        x = b.state[name]
        if x.numel() == b.numel:
            return x
        comm = self._comm
        bounds = (slice_bounds(b.numel, comm.world, r) for r in range(comm.world))
        parts = [hi - lo for lo, hi in bounds]
        work = comm.all_gather_start(x, dim=0, parts=parts, axis=None, label=f"state {name}")
        return comm.wait(work)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (from this optimizer at any world size, or from the torch one):
        hyper-parameters of each group, and each parameter's state (this rank keeps its slice).
        A ``sharded_state_dict()`` is loaded back into the same rank of a like job."""
        if state_dict.get("format") == checkpoint.FORMAT:
            checkpoint.load_shard(self, state_dict)
            return
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ConfigError(
                f"the state dict has {len(groups) if isinstance(groups, list) else 'no'} param "
                f"groups, this optimizer {len(self.param_groups)}",
                op=f"coconet.optim.{type(self).__name__}.load_state_dict",
                hint="load a checkpoint of an optimizer built over the same param groups",
            )
        for mine, theirs in zip(self.param_groups, groups, strict=True):
            if len(mine["params"]) != len(theirs["params"]):
                raise ConfigError(
                    f"a param group has {len(theirs['params'])} parameters in the state dict, "
                    f"{len(mine['params'])} here",
                    op=f"coconet.optim.{type(self).__name__}.load_state_dict",
                    hint="load a checkpoint of an optimizer built over the same parameters",
                )
        saved_ids = [i for g in groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        mine_ids = {id(p): i for p, i in zip(params, saved_ids, strict=True)}
        for mine, theirs in zip(self.param_groups, groups, strict=True):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
        entries = state_dict.get("state", {})
        for b in self._buckets:
            saved = [entries.get(mine_ids[id(p)]) for p in b.params]
            if all(e is None for e in saved):
                b.steps = 0
                for x in b.state.values():
                    x.zero_()
                continue
            b.steps = self.steps_of(saved)
            lo, hi = b.bounds
            for name, key in b.names.items():
                like = next(iter(b.state.values()))
                whole = torch.zeros(b.numel, dtype=like.dtype, device=like.device)
                for p, off, e in zip(b.params, b.offsets, saved, strict=True):
                    if e is not None and key in e:
                        whole[off : off + p.numel()].copy_(e[key].reshape(-1))
                target = b.state[name]
                target.copy_(whole if target.numel() == b.numel else whole[lo:hi])

    def steps_of(self, entries: list[dict[str, Any] | None]) -> int:
        """The step count of a bucket from its parameters' saved entries (Adam: ``step``)."""
        return 1


def _is_sliced(program: Program, name: str) -> bool:
    return program.input(name).type.layout.is_sliced

