"""Tensor-parallel linear layers whose forward and backward are compiled coconet steps.

Each layer is an ``nn.Module`` holding plain shard ``Parameter``s (torch's ``[out, in]``
convention, each rank its ``tensor_split`` part). Its forward is a DSL program (Megatron's
layers written with layouts, below); its backward is that program's ``coconet.grad``; both run
as ``coconet.compile``d steps inside one ``torch.autograd.Function``, so the layer trains under
any torch optimizer and stacks with ordinary modules. Programs are built and compiled per input
rank, dtype and set of inputs that need a gradient (the sizes are Dims: any batch and sequence
length runs the same step).

- ``ColumnParallelLinear``: ``x`` Replicated over the tp axis (or Sliced along the sequence when
  ``sequence_parallel``: all_gather first), the weight sliced by output features:
  ``y = x @ w.T + b`` is Sliced on its last dim (``gather_output`` all_gathers it). Backward:
  the input gradient's partial sums are all_reduced (reduce_scattered along the sequence).
- ``schedule=``: one of the paper's layer schedules (``"MM_AR_C"``, ``"MM_RS_C_AG"``,
  ``"ol_MM_fuse_RS_C_AG"``) or a function Program -> Schedule, applied to the program that has
  the layer's all_reduce (a row-parallel forward; a column-parallel backward). With
  ``sequence_parallel``: ``"ol_AG_MM"`` (the all_gather overlapped with the matmul it feeds: a
  column-parallel forward, a row-parallel backward), ``"ol_MM_RS_C"`` (the matmul overlapped
  with its reduce_scatter: a row-parallel forward, a column-parallel backward) or
  ``"ol_sequence_parallel"`` (both); a function is then applied to each program with such a
  chain (``coconet.schedule.paper.sequence_parallel_chains``). ``"auto"`` tunes each program
  with ``coconet.tune``.
- ``RowParallelLinear``: ``x`` Sliced on its last dim (``input_is_parallel``; else its slice is
  taken), the weight sliced by input features: the partial products are all_reduced
  (reduce_scattered along the sequence), then bias, ``dropout`` (coconet's counter-based mask:
  the same on every rank and in backward) and an optional ``residual``. Backward: no
  communication for the input gradient; the cotangent is all_gathered in sequence parallel.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from coconet import dsl as cc
from coconet import tracing
from coconet.autodiff import grad
from coconet.compiler import compile as cc_compile
from coconet.errors import ConfigError, RuntimeFault
from coconet.ir.ops import Op
from coconet.ir.program import Program
from coconet.ir.types import Dim, DType, Layout, Replicated, Sliced, slice_bounds
from coconet.nn import traceable
from coconet.options import CompileOptions
from coconet.runtime.comm import Communicator
from coconet.runtime.shards import Placement, ShardedParameter
from coconet.schedule import Schedule, paper
from coconet.tracing import Category

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "layer_group", "probability"]


class _Key(NamedTuple):
    """What a layer's programs are built and compiled per (a tuple: made and hashed at every
    call, where a dataclass cost a few microseconds)."""

    rank: int  # the input's number of dims
    dtype: torch.dtype
    residual: Residual
    dropout: bool  # training with dropout: the program draws a mask
    needs: tuple[str, ...]  # the inputs that need a gradient


class Residual(enum.Enum):
    """The residual a row-parallel layer adds, if any, and in which layout it comes."""

    NONE = "none"
    LIKE_OUTPUT = "like the output"  # the output's layout (sliced in sequence parallel)
    WHOLE = "whole"  # in sequence parallel, the whole sequence: its slice taken in the program


class _Named(NamedTuple):
    """A layer schedule by name: the form of layer it is for, and which of the layer's programs
    (forward, backward) it schedules."""

    make: Callable[[Program], Schedule]
    applies: Callable[[Program], bool]
    sequence_parallel: bool  # for layers with sequence_parallel=True (else without)


def _schedulable(program: Program) -> bool:
    """Whether the program has the one all_reduce a layer schedule works on, with computation
    after it (a column-parallel backward whose input gradient is the all_reduce's result has
    nothing to fuse or move: its all_reduce runs as it is)."""
    reduced = [n.name for n in program.nodes if n.op is Op.ALL_REDUCE and n.type.rank]
    return len(reduced) == 1 and bool(Schedule(program).computations(reduced[0]))


def _has_chain(kind: str | None) -> Callable[[Program], bool]:
    def applies(program: Program) -> bool:
        chains = paper.sequence_parallel_chains(program)
        return any(chains.values()) if kind is None else bool(chains[kind])

    return applies


# Chunks of the sequence-parallel overlaps: each chunk is one collective and one matmul call
# (tens of microseconds each), so a few are enough to overlap the two.
SP_CHUNKS = 4

# The layer schedules, by name (coconet.schedule.paper). Without sequence parallelism each works
# on the layer's all_reduce, in the program that has it (a row-parallel forward, a
# column-parallel backward: the input gradient's partial sums). With it, on the all_gather that
# feeds a matmul (a column-parallel forward, a row-parallel backward) and on the matmul that
# feeds a reduce_scatter (a row-parallel forward, a column-parallel backward).
SCHEDULES: dict[str, _Named] = {
    "MM_AR_C": _Named(paper.MM_AR_C, _schedulable, False),
    "MM_RS_C_AG": _Named(paper.MM_RS_C_AG, _schedulable, False),
    "ol_MM_fuse_RS_C_AG": _Named(paper.ol_MM_fuse_RS_C_AG, _schedulable, False),
    "ol_AG_MM": _Named(lambda p: paper.overlap_every_chain(p, "ol_AG_MM", SP_CHUNKS),
                       _has_chain("ol_AG_MM"), True),
    "ol_MM_RS_C": _Named(lambda p: paper.overlap_every_chain(p, "ol_MM_RS_C", SP_CHUNKS),
                         _has_chain("ol_MM_RS_C"), True),
    "ol_sequence_parallel": _Named(lambda p: paper.ol_sequence_parallel(p, SP_CHUNKS),
                                   _has_chain(None), True),
}

LayerSchedule = str | Callable[[Program], Schedule] | None
AUTO = "auto"  # the tuner's choice per program and input shape (coconet.tune)


def _schedule_of(schedule: Any, who: str, sequence_parallel: bool) -> _Named | str | None:
    if schedule is None or schedule == AUTO:
        return schedule
    if callable(schedule):  # the user's own: applied where a named one of its form would be
        return _Named(schedule, _has_chain(None) if sequence_parallel else _schedulable,
                      sequence_parallel)  # fmt: skip
    if isinstance(schedule, str) and schedule in SCHEDULES:
        named = SCHEDULES[schedule]
        if named.sequence_parallel != sequence_parallel:
            fitting = [k for k, v in SCHEDULES.items() if v.sequence_parallel == sequence_parallel]
            raise ConfigError(
                f"schedule={schedule!r} is for a layer "
                f"{'with' if named.sequence_parallel else 'without'} sequence parallelism; this "
                f"one has sequence_parallel={sequence_parallel}",
                op=who,
                hint="one of " + ", ".join(repr(k) for k in fitting) + ", or 'auto'",
            )
        return named
    raise ConfigError(
        f"schedule={schedule!r} is not a layer schedule",
        op=who,
        hint="one of " + ", ".join(repr(k) for k in SCHEDULES) + ", 'auto' (the tuner's choice "
        "per input shape), a function Program -> Schedule, or None (the program as written)",
    )


def probability(value: Any, who: str, what: str) -> float:
    """A dropout probability in [0, 1) as a float, or a ConfigError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(
            f"{what} must be a probability in [0, 1), got {value!r}",
            op=who,
            hint=f"{what}=0.1 zeroes one element in ten while training",
        )
    return float(value)


def layer_group(comm: Communicator, axis: str | None) -> Communicator:
    """The communicator a layer over mesh ``axis`` runs on: of a larger mesh (tp of pp x tp,
    of dp x tp), its group alone, so that its steps do not agree or wait with ranks that never
    call them; else ``comm`` itself."""
    if axis is not None and axis in comm.mesh.names and comm.mesh.axis_size(axis) < comm.world:
        return comm.along(axis)
    return comm


def _compiled(target: Any, comm: Communicator, fused: bool):
    # A layer's step updates nothing, so the commit vote (every rank confirms the step before
    # any commits) guards no state: it is left out, one round trip less per call. What it would
    # add: a peer failing after the step's last collective is reported at the next call instead.
    return cc_compile(target, comm=comm, fused_kernels=fused, commit_vote=False)


class _Steps:
    """A layer's forward program, its backward programs and their compiled steps."""

    def __init__(self, forward: Program, comm: Communicator, fused: bool, schedule: Any,
                 sizes: dict[str, int], scalars: dict[str, Any]) -> None:  # fmt: skip
        self.forward_program = forward
        self.layer = forward.name  # the layer's class name, once the layer sets it
        self.schedule = schedule
        self.comm = comm
        self.fused = fused
        self.sizes, self.scalars = sizes, scalars  # what "auto" tunes at: the first call's
        self.tuning: list[Any] = []  # the TuneResults of "auto" (explain() says why)
        self.forward = _compiled(self._scheduled(forward), comm, fused)
        self.backward: dict[tuple[str, ...], Any] = {}

    def backward_step(self, needs: tuple[str, ...]):
        if needs not in self.backward:
            program = grad(self.forward_program, list(needs), name=f"{self.forward_program.name}"
                           "_backward")  # fmt: skip
            self.backward[needs] = _compiled(self._scheduled(program), self.comm, self.fused)
        return self.backward[needs]

    def _scheduled(self, program: Program) -> Program | Schedule:
        if self.schedule is None:
            return program
        if self.schedule != AUTO:
            return self.schedule.make(program) if self.schedule.applies(program) else program
        if not (_schedulable(program) or _has_chain(None)(program)):
            return program  # nothing the tuner could schedule
        from coconet.tune import tune  # imported when first asked for: it is heavy

        result = tune(
            program, self.comm, dict(self.sizes), scalars=self.scalars,
            options=CompileOptions(fused_kernels=self.fused, commit_vote=False),
            transports=[self.comm.transport_of(program_axis(program))], top=2, reps=5,
            fix_algorithms=False,
        )  # fmt: skip
        self.tuning.append(result)
        return result.winner.target


def program_axis(program: Program) -> str | None:
    """The mesh axis of the program's first collective (what runs it decides the transport)."""
    return next(n.attr("axis") for n in program.nodes
                if n.op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER))  # fmt: skip


class _Apply(torch.autograd.Function):
    """Runs a layer's compiled forward step; its backward runs the compiled gradient step."""

    @staticmethod
    def forward(ctx, steps, scalars, agree, names, *tensors):
        inputs = dict(zip(names, (t.detach() for t in tensors), strict=True))
        out = steps.forward.run({**inputs, **scalars}, agree=agree)["y"]
        ctx.steps, ctx.scalars, ctx.names = steps, scalars, names
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, d_y):
        tensors = ctx.saved_tensors
        needs = tuple(n for n, need in zip(ctx.names, ctx.needs_input_grad[4:], strict=True)
                      if need)  # fmt: skip
        if not needs:
            return (None,) * (4 + len(tensors))
        with tracing.span(ctx.steps.layer, Category.LAYER, "backward"):
            step = ctx.steps.backward_step(needs)
            inputs = dict(zip(ctx.names, (t.detach() for t in tensors), strict=True))
            grads = step(**inputs, **ctx.scalars, d_y=d_y.contiguous())
        return (None, None, None, None, *(grads.get(f"d_{n}") for n in ctx.names))


class _ParallelLinear(nn.Module):
    """What both layers share: shard parameters, the per-call program cache, conversion."""

    # which dim of torch's [out, in] weight is split over the ranks
    _weight_dim: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        comm: Communicator,
        axis: str | None,
        sequence_parallel: bool,
        sequence_dim: int,
        fused_kernels: bool,
        schedule: LayerSchedule,
        dtype: torch.dtype,
        device: Any,
    ) -> None:
        super().__init__()
        self.schedule = _schedule_of(schedule, type(self).__name__, bool(sequence_parallel))
        if not isinstance(comm, Communicator):
            raise ConfigError(
                f"comm must be the communicator of the layer's ranks, got {comm!r}",
                op=type(self).__name__,
                hint="comm = coconet.runtime.init(); layer = ColumnParallelLinear(..., comm=comm)",
            )
        for what, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(
                    f"{what} must be a positive int, got {v!r}",
                    op=type(self).__name__,
                    hint="the sizes of the whole layer, as nn.Linear(in_features, out_features)",
                )
        self.in_features, self.out_features = in_features, out_features
        self._schedule_given = schedule  # what a pickled layer rebuilds its schedule from
        comm = layer_group(comm, axis)
        self.comm: Communicator | None = comm  # None once unpickled, until coconet.nn.attach
        self.axis = axis
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.fused_kernels = fused_kernels
        self.parts = comm.mesh.axis_size(axis)
        self.index = comm.mesh.index_in(comm.rank, axis)
        full = (out_features, in_features)
        lo, hi = self._bounds(full[self._weight_dim])
        shape = list(full)
        shape[self._weight_dim] = hi - lo
        # A part of a tensor split over the ranks is a ShardedParameter (coconet.runtime.shards:
        # torch's clip_grad_norm_ and coconet.optim take its norm over the whole tensor)
        self.weight = self._parameter(torch.empty(shape, dtype=dtype, device=device),
                                      self._weight_dim, full)  # fmt: skip
        self.bias = None
        if bias:
            # sliced with the output features (column-parallel), else whole on every rank
            b = torch.empty(shape[0], dtype=dtype, device=device)
            self.bias = (self._parameter(b, 0, (out_features,)) if self._weight_dim == 0
                         else nn.Parameter(b))  # fmt: skip
        self._programs: dict[_Key, _Steps] = {}
        # the check of the model's replicated parameters that parallelize installs (or None)
        self._replicas: Any = None
        self.reset_parameters()
        traceable.register(self)  # (what a torch.compile graph names the layer by)

    # -- copies, pickles and the group --------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> _ParallelLinear:
        # A copy (an EMA model, a best-model snapshot) runs over the same group: it shares the
        # communicator (sockets and shared memory: not a value to copy) and copies the values
        # (ShardedParameter.__deepcopy__ keeps their placement's group). The compiled steps are
        # shared too, in a cache of the copy's own: each is code for this configuration bound
        # to the group, to which every call passes its own weights, so the copy need not compile
        # them again, and what either compiles later stays its own.
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            if key == "comm":
                copied.__dict__[key] = value
            elif key == "_programs":
                copied.__dict__[key] = dict(value)
            elif key != "_op_name":
                copied.__dict__[key] = copy.deepcopy(value, memo)
        traceable.register(copied)
        return copied

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (torch.save(model)) without its group and compiled steps: neither can be
        # saved, and the loading process has a group of its own, which coconet.nn.attach gives
        # the layer (its steps are compiled again at its first call). The schedule is rebuilt
        # from what the user gave (the named ones hold functions that do not pickle).
        state = super().__getstate__()
        state["comm"] = None
        state["_programs"] = {}
        del state["schedule"]
        state.pop("_op_name", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.schedule = _schedule_of(self._schedule_given, type(self).__name__,
                                     self.sequence_parallel)  # fmt: skip
        traceable.register(self)

    def _group(self) -> Communicator:
        """The layer's communicator; a ConfigError for a layer unpickled and not attached."""
        if self.comm is None:
            raise ConfigError(
                "this layer was loaded (torch.load, pickle) without its group of ranks: a "
                "communicator is not saved with it",
                op=type(self).__name__,
                details=[f"it is part {self.index} of {self.parts} along axis {self.axis!r}"],
                hint="give the loaded model its group first: coconet.nn.attach(model, comm)",
            )
        return self.comm

    def _attach(self, comm: Communicator, name: str) -> None:
        """Run over ``comm``'s group (``coconet.nn.attach``): it must hold this layer's part
        at this rank, as the group it was saved from did."""
        group = layer_group(comm, self.axis)
        parts, index = group.mesh.axis_size(self.axis), group.mesh.index_in(group.rank, self.axis)
        if (parts, index) != (self.parts, self.index):
            raise ConfigError(
                f"{name or 'the model'} holds part {self.index} of {self.parts} of its weights, "
                f"but this rank's part of the group is {index} of {parts}",
                op="coconet.nn.attach",
                details=[f"the layer: {type(self).__name__}({self.extra_repr()})",
                         f"this rank: {comm.rank} of {comm.world}, mesh {comm.mesh}"],
                hint="load, on each rank, the file that rank saved, into a job of the same mesh "
                "(or save the whole weights with to_full() and convert them again)",
            )  # fmt: skip
        self.comm = group
        self._programs = {}  # steps compiled for another group (none, once unpickled)
        for p in self.parameters(recurse=False):
            if isinstance(p, ShardedParameter):
                p.placement = p.placement._replace(comm=group)

    def _parameter(self, data: torch.Tensor, dim: int, whole: tuple[int, ...]) -> nn.Parameter:
        """This rank's part of a tensor of shape ``whole`` split along ``dim``: a
        ``ShardedParameter`` over the layer's group (a plain one when the group is one rank)."""
        if self.parts == 1:
            return nn.Parameter(data)
        return ShardedParameter(data, placement=Placement(self.comm, dim, tuple(whole)))

    def _bounds(self, size: int) -> tuple[int, int]:
        return slice_bounds(size, self.parts, self.index)

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the whole layer, sliced: every rank draws the whole
        weight from torch's generator (seed it alike on every rank) and keeps its part, so the
        layer equals an nn.Linear built after the same seed."""
        full = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         dtype=self.weight.dtype, device=self.weight.device)  # fmt: skip
        self._load_full(full)

    @torch.no_grad()
    def _load_full(self, linear: nn.Linear) -> None:
        lo, hi = self._bounds(linear.weight.shape[self._weight_dim])
        self.weight.copy_(linear.weight.narrow(self._weight_dim, lo, hi - lo))
        if self.bias is not None:
            b = linear.bias
            if self._weight_dim == 0:  # column-parallel: the bias is sliced with the outputs
                b = b[slice(*self._bounds(b.shape[0]))]
            self.bias.copy_(b)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, comm: Communicator, **kwargs: Any):
        """This rank's part of ``linear`` (the same nn.Linear on every rank)."""
        if not isinstance(linear, nn.Linear):
            raise ConfigError(
                f"the module to convert must be an nn.Linear, got {type(linear).__name__}",
                op=f"{cls.__name__}.from_linear",
                hint="convert each nn.Linear of the model; coconet.nn.parallelize does it by name",
            )
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, comm=comm,
            dtype=linear.weight.dtype, device=linear.weight.device, **kwargs,
        )  # fmt: skip
        layer._load_full(linear)
        return layer

    @torch.no_grad()
    def to_full(self) -> nn.Linear:
        """The whole layer as one nn.Linear on every rank (its parts all_gathered)."""
        full = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         dtype=self.weight.dtype, device=self.weight.device)  # fmt: skip
        dim = self._weight_dim
        full.weight.copy_(self._gather(self.weight, dim, full.weight.shape[dim]))
        if self.bias is not None:
            column = dim == 0  # the bias is sliced with the output features
            full.bias.copy_(self._gather(self.bias, 0, self.out_features) if column else self.bias)
        return full

    def _gather(self, part: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        comm = self._group()
        shape = [size if d == dim else s for d, s in enumerate(part.shape)]
        t = cc.Tensor("part", DType.from_torch(part.dtype), shape, Sliced(dim, self.axis))
        program = Program("gather_parts", [t], {"whole": cc.all_gather(t, axis=self.axis)})
        step = cc_compile(program, comm=comm, fused_kernels=False)
        return step(part=part.detach().contiguous())["whole"]

    # -- forward ------------------------------------------------------------------------------

    def _call(self, x: torch.Tensor, residual: torch.Tensor | None, scalars: dict[str, Any]):
        # torch.compile of a model holding the layer: the layer's steps are their own compiled
        # code (generated modules, collectives) that dynamo cannot trace; the call goes into
        # the graph as one custom op (coconet.nn.traceable) where the layer can say its output's
        # shape from this rank's input alone and no scalar changes from call to call, and runs
        # as a graph break otherwise (a column-parallel sequence-parallel layer, whose output's
        # length is the sum of every rank's; dropout in training, keyed by a call count)
        if torch.compiler.is_compiling() and not scalars and self._traceable():
            return traceable.call(self, x, residual)
        return self._eager_call(x, residual, scalars)

    @torch.compiler.disable
    def _eager_call(self, x: torch.Tensor, residual: torch.Tensor | None,
                    scalars: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        with tracing.span(type(self).__name__, Category.LAYER, "forward"):
            return self._forward(x, residual, scalars)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                 scalars: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        self._check_input(x)
        tensors = self._tensors(x, self.weight, self.bias, residual)
        needs = tuple(k for k, t in tensors.items() if t.requires_grad)
        # nothing to differentiate (inference, no_grad, frozen weights): the forward step
        # alone, without the autograd Function around it (~12 us a call at decode sizes; the
        # step detaches its inputs)
        return self._run(tensors, residual, scalars, needs, torch.is_grad_enabled() and bool(needs))

    def _check_input(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self._x_features():
            raise ConfigError(
                f"the input's last dim must be {self._x_features()}, got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}",
                op=type(self).__name__,
                hint="this rank's part of the features when the input is parallel, else all",
            )

    @staticmethod
    def _tensors(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 r: torch.Tensor | None) -> dict[str, torch.Tensor]:  # fmt: skip
        """The step's tensor inputs by the program's names."""
        tensors = {"x": x.contiguous(), "w": w}
        if b is not None:
            tensors["b"] = b
        if r is not None:
            tensors["r"] = r.contiguous()
        return tensors

    def _steps(self, x: torch.Tensor, residual: torch.Tensor | None, scalars: dict[str, Any],
               needs: tuple[str, ...]) -> _Steps:  # fmt: skip
        """The compiled steps of a call like this one (made at its first call)."""
        comm = self._group()
        kind = self._residual_kind(x, residual)
        key = _Key(x.dim(), x.dtype, kind, bool(scalars), needs)
        steps = self._programs.get(key)
        if steps is None:
            program = self._program(x.dim(), DType.from_torch(x.dtype), kind)
            sizes = {d.name: n for d, n in zip(self._dims(x.dim()), x.shape, strict=False)}
            if self.schedule == AUTO and self.sequence_parallel and self.parts > 1:
                # the tuner measures at sizes every rank names alike: the whole sequence's
                # length, not this rank's part of it (collective, as the tuning that follows)
                dim = self._seq_layout(x.dim()).dim
                mine = int(x.shape[dim])
                sizes[self._dims(x.dim())[dim].name] = sum(
                    comm.exchange(mine, f"{type(self).__name__}: the sequence's length"))
            steps = self._programs[key] = _Steps(program, comm, self.fused_kernels,
                                                 self.schedule, sizes, dict(scalars))  # fmt: skip
            steps.layer = type(self).__name__  # (what its backward's trace span is named)
        return steps

    def _run(self, tensors: dict[str, torch.Tensor], residual: torch.Tensor | None,
             scalars: dict[str, Any], needs: tuple[str, ...], differentiate: bool
             ) -> torch.Tensor:  # fmt: skip
        steps = self._steps(tensors["x"], residual, scalars, needs)
        # the model's replicated parameters, checked at its training forwards (nn.replicas)
        # (by a call that agrees at once: one that communicates, so that a difference is this
        # call's fault and not another's)
        agree = (self._replicas.take() if self._replicas is not None
                 and steps.forward.agrees_at_once else None)  # fmt: skip
        try:
            if not differentiate:
                return steps.forward.run({**tensors, **scalars}, agree=agree)["y"]
            names = tuple(tensors)
            return _Apply.apply(steps, scalars, agree, names, *tensors.values())
        except RuntimeFault as fault:
            drift = (self._replicas.explain(fault, type(self).__name__)
                     if agree is not None else None)  # fmt: skip
            if drift is None:
                raise
            raise drift from None

    # -- inside torch.compile: the custom ops' sides (coconet.nn.traceable) -------------------

    def _traceable(self) -> bool:
        """Whether this rank alone knows the output's shape (``traced_shape``)."""
        return True

    def traced_shape(self, x: torch.Tensor) -> list[Any]:
        """The output's shape for input ``x`` (the custom op's fake implementation)."""
        self._check_input(x)
        return self._output_shape(list(x.shape))

    def traced_forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       r: torch.Tensor | None, needs: tuple[str, ...]) -> torch.Tensor:  # fmt: skip
        """The custom op's forward: the layer's forward step, as an eager call runs it."""
        with tracing.span(type(self).__name__, Category.LAYER, "forward"):
            self._check_input(x)
            return self._run(self._tensors(x, w, b, r), r, {}, needs, False)

    def traced_backward(self, d_y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        b: torch.Tensor | None, r: torch.Tensor | None,
                        needs: tuple[str, ...]) -> dict[str, torch.Tensor]:  # fmt: skip
        """The custom op's gradient: the layer's backward step for ``needs``."""
        with tracing.span(type(self).__name__, Category.LAYER, "backward"):
            step = self._steps(x, r, {}, needs).backward_step(needs)
            return step(**self._tensors(x, w, b, r), d_y=d_y.contiguous())

    def _output_shape(self, shape: list[Any]) -> list[Any]:
        raise NotImplementedError  # pragma: no cover - each layer writes its own

    @property
    def tuning(self) -> list[Any]:
        """With ``schedule="auto"``: the ``TuneResult`` of each program tuned (``explain()``)."""
        return [r for steps in self._programs.values() for r in steps.tuning]

    def _x_features(self) -> int:
        return self.in_features

    def _residual_kind(self, x: torch.Tensor, residual: torch.Tensor | None) -> Residual:
        return Residual.NONE if residual is None else Residual.LIKE_OUTPUT

    def _dims(self, rank: int) -> list[Dim]:
        return [Dim(f"D{i}") for i in range(rank - 1)]

    def _seq_layout(self, rank: int) -> Layout:
        dim = self.sequence_dim % max(rank - 1, 1)
        return Sliced(dim, self.axis)

    def _program(self, rank: int, dtype: DType, residual: Residual) -> Program:
        raise NotImplementedError  # pragma: no cover - each layer writes its own

    def _replicated(self) -> Layout:
        return Replicated(self.axis) if self.axis is not None else Replicated

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, axis={self.axis!r}, parts={self.parts}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ w.T + b`` with the output features split over the ranks of ``axis``.

    ``gather_output=False`` (Megatron's default) leaves ``y`` as this rank's part of the
    features, ready for a ``RowParallelLinear``; ``True`` all_gathers it.
    """

    _weight_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 comm: Communicator, axis: str | None = None, gather_output: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 0,
                 fused_kernels: bool = False, schedule: LayerSchedule = None,
                 dtype: torch.dtype = torch.float32, device: Any = None) -> None:  # fmt: skip
        self.gather_output = bool(gather_output)
        super().__init__(in_features, out_features, bias, comm=comm, axis=axis,
                         sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                         fused_kernels=fused_kernels, schedule=schedule, dtype=dtype,
                         device=device)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x, None, {})

    def _traceable(self) -> bool:
        # sequence-parallel: the gathered length is the sum of every rank's, which one rank's
        # input does not say (the parts may differ by one)
        return not self.sequence_parallel

    def _output_shape(self, shape: list[Any]) -> list[Any]:
        lo, hi = self._bounds(self.out_features)
        return [*shape[:-1], self.out_features if self.gather_output else hi - lo]

    def _program(self, rank: int, dtype: DType, residual: Residual) -> Program:
        dims = self._dims(rank)
        x_layout = self._seq_layout(rank) if self.sequence_parallel else self._replicated()
        x = cc.Tensor("x", dtype, [*dims, self.in_features], x_layout)
        w = cc.Tensor("w", dtype, [self.out_features, self.in_features], Sliced(0, self.axis))
        inputs = [x, w]
        full = cc.all_gather(x, axis=self.axis, name="x_full") if self.sequence_parallel else x
        y = cc.matmul(full, cc.transpose(w, name="w_t")).named("xw")
        if self.bias is not None:
            b = cc.Tensor("b", dtype, [self.out_features], Sliced(0, self.axis))
            inputs.append(b)
            y = (y + b).named("xw_b")
        if self.gather_output:
            y = cc.all_gather(y, axis=self.axis, name="y_ag")
        return Program("column_parallel_linear", inputs, {"y": y})


class RowParallelLinear(_ParallelLinear):
    """``y = dropout(all_reduce(x @ w.T) + b) + residual`` with the input features split over
    the ranks of ``axis`` (the second layer of a tensor-parallel MLP, attention's output).

    ``input_is_parallel=True`` (Megatron's default) takes this rank's part of the features;
    ``False`` takes them all and uses its part. ``dropout`` is applied in training mode with
    coconet's counter-based mask, keyed by ``seed`` and the layer's call count (the same on
    every rank, in backward, and on one process with ``coconet.random.dropout_mask``).
    """

    _weight_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 comm: Communicator, axis: str | None = None, input_is_parallel: bool = True,
                 dropout: float = 0.0, seed: int = 0, sequence_parallel: bool = False,
                 sequence_dim: int = 0, fused_kernels: bool = False,
                 schedule: LayerSchedule = None, dtype: torch.dtype = torch.float32,
                 device: Any = None) -> None:  # fmt: skip
        self.input_is_parallel = bool(input_is_parallel)
        self.p = probability(dropout, "RowParallelLinear", "dropout")
        self.seed = int(seed)
        self.calls = 0  # the dropout mask's step: one per training forward
        super().__init__(in_features, out_features, bias, comm=comm, axis=axis,
                         sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                         fused_kernels=fused_kernels, schedule=schedule, dtype=dtype,
                         device=device)  # fmt: skip

    def _x_features(self) -> int:
        if not self.input_is_parallel:
            return self.in_features
        lo, hi = self._bounds(self.in_features)
        return hi - lo

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual``: added after the bias and dropout, in the output's layout; with
        ``sequence_parallel`` it may also be the whole sequence (the same on every rank), of
        which the program takes this rank's slice, so the output is this rank's slice of
        ``dropout(x @ w.T + b) + residual`` and the residual's gradient comes back whole: a
        pipeline stage that ends here sends only its slice (``Pipeline(slice_over=...)``: the
        paper's reduce_scatter + send boundary)."""
        scalars: dict[str, Any] = {}
        if self.p > 0.0 and self.training:
            scalars = {"seed": self.seed, "step": self.calls}
            self.calls += 1
        return self._call(x, residual, scalars)

    def _output_shape(self, shape: list[Any]) -> list[Any]:
        out = [*shape[:-1], self.out_features]
        if self.sequence_parallel:  # reduce_scattered over the sequence: this rank's part
            dim = self._seq_layout(len(shape)).dim
            lo, hi = slice_bounds(shape[dim], self.parts, self.index)
            out[dim] = hi - lo
        return out

    def _residual_kind(self, x: torch.Tensor, residual: torch.Tensor | None) -> Residual:
        if residual is None:
            return Residual.NONE
        if not self.sequence_parallel or not isinstance(residual, torch.Tensor):
            return Residual.LIKE_OUTPUT
        dim = self._seq_layout(x.dim()).dim
        # the whole sequence (as the input holds it), or this rank's part of it
        whole = residual.dim() == x.dim() and residual.shape[dim] == x.shape[dim]
        return Residual.WHOLE if whole and self.parts > 1 else Residual.LIKE_OUTPUT

    def _program(self, rank: int, dtype: DType, residual: Residual) -> Program:
        dims = self._dims(rank)
        x_layout = Sliced(rank - 1, self.axis) if self.input_is_parallel else self._replicated()
        x = cc.Tensor("x", dtype, [*dims, self.in_features], x_layout)
        w = cc.Tensor("w", dtype, [self.out_features, self.in_features], Sliced(1, self.axis))
        inputs = [x, w]
        part = x if self.input_is_parallel else cc.scatter(x, dim=-1, axis=self.axis)
        partial = cc.matmul(part, cc.transpose(w, name="w_t")).named("partial")
        if self.sequence_parallel:
            y = cc.reduce_scatter(partial, axis=self.axis, dim=self._seq_layout(rank).dim,
                                  name="y_rs")  # fmt: skip
            out_layout = self._seq_layout(rank)
        else:
            y = cc.all_reduce(partial, axis=self.axis, name="y_ar")
            out_layout = self._replicated()
        if self.bias is not None:
            b = cc.Tensor("b", dtype, [self.out_features], self._replicated())
            inputs.append(b)
            y = (y + b).named("biased")
        if self.p > 0.0 and self.training:
            seed, step = cc.Scalar("seed", DType.int64), cc.Scalar("step", DType.int64)
            inputs += [seed, step]
            y = cc.dropout(y, self.p, seed, step).named("dropped")
        if residual is Residual.WHOLE:
            r = cc.Tensor("r", dtype, [*dims, self.out_features], self._replicated())
            inputs.append(r)
            mine = cc.scatter(r, dim=out_layout.dim, axis=self.axis, name="r_part")
            y = (y + mine).named("out")
        elif residual is Residual.LIKE_OUTPUT:
            r = cc.Tensor("r", dtype, [*dims, self.out_features], out_layout)
            inputs.append(r)
            y = (y + r).named("out")
        return Program("row_parallel_linear", inputs, {"y": y})

