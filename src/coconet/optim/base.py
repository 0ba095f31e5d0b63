"""``DistributedOptimizer``: a ``torch.optim.Optimizer`` whose step is a compiled coconet program.

What it does with the parameters (the contract ``coconet.optim``'s optimizers share):

- **Buckets.** The trainable parameters of each param group are packed, per dtype, into one flat
  bucket: each parameter's ``.data`` becomes a view of the bucket's flat parameter tensor and its
  ``.grad`` a view of the bucket's flat gradient, which lives in symmetric memory where the
  transport has it (``CompiledStep.input_buffer``). ``backward()`` accumulates straight into it;
  ``step()`` hands the whole bucket to the program; nothing is copied per step. Parameters that
  do not require grad are kept in ``param_groups`` but packed nowhere and never stepped (as
  torch, which skips them: they never get a gradient).
- **The step** reduces the gradients itself (the average over ranks, as DDP computes it; no DDP
  wrapper is needed) with the optimizer's schedule: by default ``fuse_RS_C_AG`` with the state
  stored sliced, so each rank keeps ``1/world`` of the state and updates only its slice, inside
  the fused collective; over shared memory as one pass.
- **Parameters without a gradient are skipped, as torch skips them**: no update, no weight decay,
  no change of their state or step count. A ``.grad`` is always a view of the bucket (a ``None``
  gradient would make the next ``backward()`` allocate outside it), so "has a gradient" is kept
  apart, per parameter: set by ``backward()`` (a post-accumulate-grad hook), by assigning
  ``.grad``, or by a non-zero value written into the view; cleared by
  ``zero_grad(set_to_none=True)`` (torch's default) and by ``p.grad = None``. Over several ranks
  a parameter is stepped when any rank has a gradient for it (the others count zero, as DDP's
  ``find_unused_parameters``). The ranks compare which parameters have a gradient inside the
  first bucket's own start-of-step agreement (no extra collective); only when they differ do
  they exchange it (and the first step is run again).
- **Step counts are per parameter** (torch's bias corrections are): a bucket whose parameters all
  have a gradient and one step count runs one fused step (the common case); otherwise the
  parameters are grouped by the scalars of their step (their bias corrections) and each group
  runs the fused step over the whole bucket, the others' values put back after it: the same
  arithmetic per element, one fused step per distinct step count.
- **All or nothing.** A bucket's update is committed on every rank or on none (the compiled
  step's guarantee, and the mixed case above restores the bucket when a step fails). With
  several buckets (several param groups or dtypes) each is its own step: a failure in a later
  bucket leaves the earlier ones updated.
- **Gradient clipping** (``max_grad_norm=``, SGD / Adam / AdamW): torch's
  ``clip_grad_norm_`` of the *averaged* gradient over every parameter the optimizer holds,
  inside the step. One bucket: its fused step is **speculative** (``Clip.SPECULATIVE``): one
  pass computes the update unclipped and, alongside it, the norm (the squares of this rank's
  slice after the reduce_scatter, one scalar all_reduce); the update is committed when the
  factor is 1 (clipping would not change it: the same bits as clipping by 1) and otherwise
  declined (nothing written) and the step runs again with the factor (``Clip.GIVEN``). After a
  step that clipped, the next computes the norm first and clips before the update in one step
  (``Clip.IN_STEP``: two passes, no pass wasted), until a step does not clip. Several
  buckets (param groups): the global norm needs every bucket's gradient before any bucket is
  updated. The largest bucket speculates: a norm pass (``programs.grad_norm_pass``, which
  commits nothing) runs over the others only, then the largest's speculative step, whose own
  norm joins theirs (committed when the factor of the whole norm is 1, else declined and run
  again with it), then the others with that factor (``Clip.GIVEN``). After a step that
  clipped, the norm pass runs over every bucket first and each takes the factor.
  ``last_grad_norm`` is the norm; ``step()`` returns the closure's loss, as torch's. A
  ``clip_grad_norm_`` between ``backward()`` and ``step()`` would clip each rank's local
  gradient: on several ranks it is warned about (``LocalGradientEditWarning``, once).
- **Hyper-parameters** are read from ``param_groups`` at every step (``torch.optim.lr_scheduler``
  works unchanged), checked when a group is added or loaded; their scalar arithmetic is done on
  the host in float64.
- ``zero_grad()`` zeroes the buckets and keeps every ``.grad`` a view of its bucket, whatever
  ``set_to_none`` says (``set_to_none=True`` marks the parameters as without a gradient). A
  ``.grad`` replaced by another tensor is copied into the bucket at the next step (and made a
  view again).
- ``state_dict()`` is torch's format, gathered from the slices (collective: every rank calls it);
  ``load_state_dict()`` takes that format from any world size, or from the torch optimizer. The
  state-dict hooks (``register_state_dict_pre_hook`` and the others) run as torch runs them.
- ``opt.state[p]`` reads the state in torch's keys (see ``_StateView``: whole tensors where this
  rank holds them whole, this rank's slice otherwise).
- It cannot be copied or pickled (it holds a communicator and compiled steps): save its
  ``state_dict()`` and load it into a new one.

Every rank must construct the optimizer over the same parameters (shapes, values, names), in the
same order, and make the same collective calls (``step``, ``state_dict``, ``load_state_dict``,
``add_param_group``) in the same order: checked before anything changes, a mismatch fails every
rank at once with the same error (``coconet.optim.identity``). A parameter no longer the view
of its bucket (``p.data`` replaced, cast, moved) is refused at the next step on every rank
(``_Bucket.detachment``), and so is one frozen (``requires_grad_(False)``) on some ranks only;
frozen on every rank, it is skipped as torch skips it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import numbers
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from coconet import schedule as schedules
from coconet.compiler import compile as coconet_compile
from coconet.errors import CoconetError, ConfigError, ConfigValueError, GradientError, RuntimeFault
from coconet.ir.program import Program
from coconet.ir.types import DType, slice_bounds
from coconet.optim import checkpoint, identity, programs
from coconet.optim import ddp as ddp_hook
from coconet.optim.identity import CALL_KEY, CallKind
from coconet.optim.programs import Clip
from coconet.options import CommitMode, CompileOptions, ParamStorage
from coconet.runtime import interrupts
from coconet.runtime.comm import Communicator
from coconet.runtime.replica import HostReplica
from coconet.runtime.shards import Placement, placement_of
from coconet.schedule import Schedule

__all__ = ["DistributedOptimizer", "LocalGradientEditWarning"]

_DTYPES = {torch.float32: DType.float32}
# The largest tensor (elements) of a bucket of rows (``_tensor_buckets``): 1 MiB of float32, about
# what a step's fixed cost (~1 ms of agreement, waits and launches) moves at the copy bandwidth;
# a slice of whole rows leaves a rank at most one tensor of this size more than its peer.
ROW_ELEMENTS = 1 << 18
# the key under which the ranks compare which parameters have a gradient (see _step_agreeing)
_AGREE = "coconet.optim: which parameters have a gradient"
# what the clipping scalars are made from, as an error naming a differing one says it
_CLIP_SOURCES = {
    "max_norm": "max_grad_norm",
    "clip_coef": "max_grad_norm and the gradient's global norm "
    "(clip_coef = min(max_grad_norm / (norm + 1e-6), 1))",
}


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
    clip: Clip = Clip.OFF  # how step_fn clips the gradient (max_grad_norm=)
    # elements per row of a bucket of equal-sized tensors, one per row (``programs.lamb(
    # rows=True)``; its slices are whole rows); 0: a flat bucket
    row: int = 0
    # a speculative bucket's other steps (Clip.GIVEN, Clip.IN_STEP), compiled when first needed
    clip_steps: dict[Clip, Any] = field(default_factory=dict)
    clipped_last: bool = False  # whether the last step clipped (a speculative bucket's guess)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # program name -> this slice
    # Per parameter: how many times it was stepped (torch's per-parameter ``step``; 0: no state
    # yet, as torch has none before a parameter's first step).
    steps: list[int] = field(default_factory=list)
    # Per parameter: whether it has a gradient (torch's ``p.grad is not None``; see step()). The
    # list object is shared with the parameters' post-accumulate-grad hooks: mutate it in place.
    has_grad: list[bool] = field(default_factory=list)
    # packed (not with ddp=): the parameters, flat (each param's .data a view of it), and the
    # gradients, flat (symmetric memory where the transport has it; each .grad a view of it)
    flat: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    # with ParamStorage.HOST_SHARED: the host's one copy of the parameters, double-buffered
    # (``flat`` is its live buffer, re-pointed by each step's commit)
    replica: HostReplica | None = None
    # parts of tensors split over other ranks (tensor-parallel weights: coconet.runtime.shards),
    # all over one group; None: whole tensors (the same on the ranks of such a group). Their
    # squares count over that group in the global norm (max_grad_norm=).
    placement: Placement | None = None
    # the gradients arrive averaged (a DDP wrapper reduced them): the step communicates nothing
    averaged: bool = False

    # per parameter: its shape when it was packed (what its view of the bucket has)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    # [the gradient buffer's version counter after the last backward() accumulation into it,
    # whether a backward() reached it since the last step or zero_grad]: shared with the
    # post-accumulate-grad hooks (mutated in place), to see a gradient changed in place
    # between backward() and step() (a clip_grad_norm_ of the local gradient; see step())
    seen: list = field(default_factory=lambda: [0, False])

    def __post_init__(self) -> None:
        if not self.steps:
            self.steps = [0] * len(self.params)
        if not self.has_grad:
            self.has_grad = [False] * len(self.params)
        if not self.shapes:
            self.shapes = [tuple(p.shape) for p in self.params]

    def detached(self) -> set[int]:
        """The parameters no longer attached to this bucket (see ``detachment``): the per-step
        check, kept to what tells (a replaced ``.data`` is a new pointer, whatever its dtype,
        device or shape), ~0.5 us a parameter; ``detachment`` says why for the ones found.
        ``requires_grad`` is not attachment: a packed parameter frozen on every rank is skipped
        as torch skips it (see ``_step_agreeing``)."""
        flat = self.flat
        if flat is None:
            return set()
        base, size = flat.data_ptr(), flat.element_size()
        return {
            i for i, (p, offset, shape) in enumerate(
                zip(self.params, self.offsets, self.shapes, strict=True))
            if p.shape != shape
            or (p.data_ptr() != base + offset * size and p.numel())
        }

    def detachment(self, i: int) -> str | None:
        """Why parameter ``i`` is no longer the view of this bucket's parameters the optimizer
        holds now (``flat``, wherever it lives), or None: compared with that view, so storage
        the optimizer itself re-points the parameters to stays attached."""
        flat = self.flat
        if flat is None:
            return None  # not packed (ddp=): DDP owns the parameters
        start = flat.data_ptr() + self.offsets[i] * flat.element_size()
        return identity.detachment(self.params[i], start, flat.dtype, flat.device,
                                   self.shapes[i])

    @property
    def numel(self) -> int:
        return self.size

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the program steps: flat, or one row per parameter."""
        return (self.size // self.row, self.row) if self.row else (self.size,)

    def bounds_of(self, rank: int, world: int) -> tuple[int, int]:
        """Rank ``rank``'s slice of the bucket (flat elements): the program's slice along dim
        0, so whole rows of a bucket of rows."""
        if not self.row:
            return slice_bounds(self.size, world, rank)
        lo, hi = slice_bounds(self.size // self.row, world, rank)
        return lo * self.row, hi * self.row

    def inputs(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's tensor inputs: the gradient, ``p`` and the state, in the program's shape
        (views of the flat buffers; the commit writes through them)."""
        if not self.row:
            return {"g": self.grad, "p": p, **self.state}
        rows = {name: x.view(-1, self.row) for name, x in self.state.items()}
        return {"g": self.grad.view(self.shape), "p": p.view(self.shape), **rows}

    def span(self, i: int) -> tuple[int, int]:
        """Parameter ``i``'s elements in the bucket."""
        return self.offsets[i], self.offsets[i] + self.params[i].numel()

    def local(self, name: str, i: int) -> slice | None:
        """Parameter ``i``'s part of state ``name`` as this rank stores it (whole, or this
        rank's slice of the bucket: a parameter may straddle two ranks), None if it has none."""
        start, stop = self.span(i)
        if self.state[name].numel() == self.size:
            return slice(start, stop)
        lo, hi = self.bounds
        a, z = max(start, lo), min(stop, hi)
        return slice(a - lo, z - lo) if a < z else None


class DistributedOptimizer(torch.optim.Optimizer):
    """Base of ``coconet.optim``'s optimizers (see the module docstring for the contract).

    A subclass names its DSL program (``program``), the program's state inputs and their
    ``torch.optim`` names (``state_names``), and the host scalars of one step (``scalars``).
    ``comm`` defaults to the communicator of ``coconet.runtime.init()`` (the job of an
    initialised ``torch.distributed``, or a world of one).
    """

    # Buckets of tensors instead of per (group, dtype): for updates whose norms are a tensor's
    # own (LAMB's layer-wise trust ratio). The small tensors of one size share a bucket, one
    # per row (``program(..., rows=True)``), the others are a bucket each (``_tensor_buckets``).
    bucket_per_parameter = False
    # Whether ``program`` takes ``clip=`` (a ``Clip``): ``max_grad_norm=`` needs it.
    supports_grad_clip = False
    # Whether a single bucket may compute the norm and torch's factor inside its step
    # (``Clip.IN_STEP``, torch's 1e-6); False: the factor is always ``clip_factor``'s (LAMB's)
    clip_in_step = True

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        comm: Communicator | None = None,
        schedule: str | Callable[[Program], Schedule] | None = None,
        options: CompileOptions | None = None,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
        param_storage: ParamStorage | str | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        self._max_grad_norm = _checked_max_grad_norm(
            max_grad_norm, type(self).__name__, ddp, self.supports_grad_clip)
        # the global norm of the averaged gradient at the last step (max_grad_norm=), as
        # torch.nn.utils.clip_grad_norm_ returns it
        self.last_grad_norm: torch.Tensor | None = None
        # the factor the averaged gradient was multiplied by at the last step (None: not
        # clipped, or clipped inside a bucket's own step)
        self.last_clip_coef: torch.Tensor | None = None
        # the compiled norm passes, by the ids of the buckets each runs over (every bucket's;
        # all but a speculative lead's), made again when the buckets change
        self._norm_passes: dict[tuple[int, ...], Any] = {}
        self._clip_now: dict[str, Any] = {}  # the clipping scalars of the step under way
        # with several buckets: the speculative lead of the step under way (None: the factor
        # came from a norm pass over every bucket) and the others' norm (``_clip_scalars``)
        self._lead: _Bucket | None = None
        self._norm_rest: torch.Tensor | None = None
        self._warned_edit = False  # LocalGradientEditWarning given (once per optimizer)
        # Who averages the gradients before the step, when not the step itself: a
        # DistributedDataParallel wrapper the optimizer found around its parameters (HF Trainer,
        # accelerate), whose all_reduce is then the one reduction (_take_wrapper); None: the
        # step reduces them. Looked for once, when a gradient is first written after backward()
        self.gradients_averaged_by: str | None = None
        self._wrapper_looked = False
        self._comm = _default_comm(comm, type(self).__name__)
        self._storage = _param_storage(param_storage, type(self).__name__, ddp)
        self._schedule = schedule
        # State updates take the new storage (no copy); the parameters are always written in
        # place (they are views of a bucket, see step()).
        self._options = dataclasses.replace(options or CompileOptions(), commit=CommitMode.SWAP)
        self._buckets: list[_Bucket] = []
        self._frozen: list[torch.Tensor] = []  # parameters that did not require grad: skipped
        self._hooks: list[Any] = []  # the post-accumulate-grad hooks' handles
        self._auto: dict[tuple[str, str], Any] = {}  # schedule="auto": (program, size class)
        self._where_key: tuple[int, ...] = ()
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._ddp = ddp
        # how this optimizer's steps are named in the calls its rank made (Communicator.progress:
        # what a rank that leaves the job tells its peers)
        self._progress_key = f"coconet.optim.{type(self).__name__}.step"
        while self._progress_key in self._comm.progress:
            self._progress_key += "'"  # another optimizer of the same kind on this communicator
        self._comm.progress[self._progress_key] = 0
        # What the ranks agree on before each collective call (coconet.optim.identity): the
        # steps done, and the digest of the param groups (recomputed when they change).
        self._steps_done = 0
        self._identity_lines: list[str] = []
        self._identity_digest = identity.digest("")
        if ddp is not None:
            params = list(params)  # as torch does; looked at before DDP's hook is registered
            ddp_hook.check_and_register(self, ddp, params)
        super().__init__(params, defaults)  # calls add_param_group for each group
        # torch's own `state` (a defaultdict) stays empty here: this one reads the buckets.
        self.state = _StateView(self)
        # The hooks hold only the buckets' flag lists; remove them with the optimizer.
        weakref.finalize(self, _remove_hooks, self._hooks)

    # -- what a subclass provides ---------------------------------------------------------------

    def program(self, group: dict[str, Any], dtype: DType) -> Program:
        """One step of the optimizer over a flat bucket of ``dtype``: inputs ``g`` (Local) and
        ``p`` (Replicated), the state (Replicated; the schedule slices it), then the scalars.
        With ``supports_grad_clip``, it also takes ``clip=`` (``coconet.optim.programs.Clip``):
        the averaged gradient clipped by the global norm as ``programs.adam`` does."""
        raise NotImplementedError

    @property
    def max_grad_norm(self) -> float | None:
        """The ``max_grad_norm=`` given at construction (None: no clipping)."""
        return self._max_grad_norm

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        """The program's state inputs for ``group`` -> their names in torch's state dict."""
        raise NotImplementedError

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        """The program's scalar inputs for ``group`` at step ``step`` (1-based), computed in
        float64 on the host."""
        raise NotImplementedError

    # What the user set that each scalar input of the program is made from, as an error that
    # names a differing input says it (issue 26: a differing lr named as lr, not step_size).
    SCALAR_SOURCES: dict[str, str] = {}

    def check_group(self, group: dict[str, Any], where: str) -> None:
        """Refuse hyper-parameters this optimizer cannot honour (a ``ConfigError``); called for
        every group added and every group of a loaded state dict, before anything changes."""

    def step_state(self, steps: int) -> dict[str, Any]:
        """A parameter's state entries besides the tensors (Adam's ``step``), after ``steps``
        steps of it."""
        return {}

    def step_of(self, entry: dict[str, Any]) -> int:
        """How many steps a parameter's saved state ``entry`` (torch's format) stands for."""
        return 1

    def next_steps(self, b: _Bucket) -> list[int]:
        """The step number each parameter of ``b`` is at in this step (1-based): its own count,
        as torch keeps it per parameter (LAMB: its group's)."""
        return [s + 1 for s in b.steps]

    def after_bucket(self, b: _Bucket, outputs: dict[str, torch.Tensor], stepped: list[int]
                     ) -> None:  # fmt: skip
        """Called with a bucket step's outputs and the parameters it stepped (LAMB keeps its
        per-tensor diagnostics from them)."""

    def after_step(self) -> None:
        """Called after every bucket was stepped (LAMB counts its groups' steps here)."""

    def after_load(self) -> None:
        """Called after a state dict was loaded."""

    # -- buckets --------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and packs the group's trainable parameters into buckets (collective:
        every rank adds the same group at the same point). Parameters that do not require grad
        stay in the group, unpacked: they are never stepped (torch skips them too)."""
        # Collective: every rank checks the group, then the ranks agree on it (the same
        # parameters, values and hyper-parameters, and every rank's verdict) before any is
        # packed; a refusal or a difference anywhere leaves every rank's groups as they were.
        before = len(self.param_groups)
        refusal: BaseException | None = None
        try:
            super().add_param_group(param_group)
        except (TypeError, ValueError, KeyError, CoconetError) as e:  # torch's own checks
            refusal = e
        added = len(self.param_groups) > before
        index = len(self.param_groups) - 1
        group = self.param_groups[index] if added else {"params": []}
        trainable = []
        if refusal is None:
            try:
                self.check_group(group, f"param group {index}")
                for p in group["params"]:
                    if p.requires_grad:
                        self._check_param(p, index)
                        trainable.append(p)
            except CoconetError as e:
                refusal = e
            except BaseException:
                self.param_groups.pop()  # as if never added
                raise
        try:
            # (the values' checksums only where there is a peer to compare them with)
            content = (json.dumps(identity.describe_group(group, index, values=True))
                       if self._agrees() else "")
            self._agree_call(CallKind.ADD_PARAM_GROUP, content, refusal)
        except BaseException:
            if added:
                self.param_groups.pop()  # as if never added
            raise
        self._frozen.extend(p for p in group["params"] if not p.requires_grad)
        # one bucket per dtype and per group a parameter is split over (whole tensors apart
        # from parts: their squares count differently in the global norm)
        by_kind: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in trainable:
            placement = placement_of(p)
            by_kind.setdefault((p.dtype, placement.key if placement else ()), []).append(p)
        if self._ddp is not None:
            ddp_hook.check_group(self, index)
            self._refresh_identity()
            return  # DDP's buckets are the buckets: made on the hook's first call
        for (dtype, _), params in by_kind.items():
            if self.bucket_per_parameter:
                for members in self._tensor_buckets(params):
                    self._buckets.append(self._bucket(index, group, dtype, members))
            else:
                self._buckets.append(self._bucket(index, group, dtype, params))
        self._settle_clip()
        self._refresh_identity()

    def _tensor_buckets(self, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        """The buckets of an optimizer whose norms are each tensor's own (``bucket_per_parameter``):
        the tensors of one size together, one per row, where that pays and holds, every other
        tensor alone. Rows pay for small tensors, whose step is mostly its fixed cost (a
        nanoGPT-sized model's 27 tensors are 27 steps otherwise): at most ``ROW_ELEMENTS``
        elements each, at least one per rank (a row bucket's slices are whole rows: every rank
        updates whole tensors, so the norms need no collective). A large tensor keeps its own
        flat step, sliced evenly whatever the tensor count. Not with host-shared parameters
        (one flat copy per host)."""
        if self._storage is ParamStorage.HOST_SHARED:
            return [[p] for p in params]
        by_size: dict[int, list[torch.nn.Parameter]] = {}
        for p in params:
            by_size.setdefault(p.numel(), []).append(p)
        buckets: list[list[torch.nn.Parameter]] = []
        for n, same in by_size.items():  # in the order of first appearance: the same on every rank
            if 0 < n <= ROW_ELEMENTS and len(same) >= max(2, self._comm.world):
                buckets.append(same)
            else:
                buckets.extend([p] for p in same)
        return buckets

    # -- gradient clipping (max_grad_norm=) -----------------------------------------------------

    def _clip_of_new_bucket(self) -> Clip:
        """How a bucket made now clips: the norm inside its own step while it is the only
        bucket, given from the norm pass otherwise (``_settle_clip`` turns a first bucket's
        in-step clipping into a given one when a second bucket comes)."""
        if self._max_grad_norm is None or self._ddp is not None:
            return Clip.OFF
        return Clip.SPECULATIVE if not self._buckets and self.clip_in_step else Clip.GIVEN

    def _settle_clip(self) -> None:
        """With several buckets the global norm needs every bucket's gradient before any bucket
        is updated. The largest bucket keeps (or gets) the speculative step: the norm pass runs
        over the others only, and the largest computes its own norm alongside its update, which
        commits when the factor of the whole norm is 1 (``_run``). Every other bucket takes the
        factor (``Clip.GIVEN``). Collective, as add_param_group: every rank recompiles at the
        same point; the gradient buffers and state stay, the steps only read them."""
        self._norm_passes.clear()  # over buckets that changed
        if len(self._buckets) < 2 and not self._has_parts():
            return
        lead = self._speculative_lead()
        for b in self._buckets:
            group = self.param_groups[b.group]
            if b is lead and b.clip is Clip.GIVEN:
                b.clip_steps = {Clip.GIVEN: b.step_fn}
                b.step_fn = self._step_fn(group, b.params[0].dtype, b.size, Clip.SPECULATIVE,
                                          b.row)  # fmt: skip
                b.clip = Clip.SPECULATIVE
            elif b is not lead and b.clip is Clip.SPECULATIVE:
                b.step_fn = b.clip_steps.get(Clip.GIVEN) or self._step_fn(
                    group, b.params[0].dtype, b.size, Clip.GIVEN, b.row)
                b.clip = Clip.GIVEN
                b.clip_steps.clear()

    def _speculative_lead(self) -> _Bucket | None:
        """The bucket whose step speculates with several buckets: the largest (the first of
        equals), where the optimizer computes the norm inside its step."""
        if self._max_grad_norm is None or self._ddp is not None or not self.clip_in_step:
            return None
        if self._has_parts():
            return None  # the norm needs a round over the parts' groups first (_parts_norm)
        clipping = [b for b in self._buckets if b.clip is not Clip.OFF]
        return max(clipping, key=lambda b: b.size) if clipping else None

    def _norm_step(self, buckets: list[_Bucket]) -> Any:
        """The compiled norm pass over ``buckets``' gradients (``programs.grad_norm_pass``),
        made again when they change (collective: every rank steps the same buckets)."""
        key = tuple(id(b) for b in buckets)
        if key not in self._norm_passes:
            dtype = _DTYPES[buckets[0].grad.dtype]
            program = programs.grad_norm_pass(dtype, len(buckets))
            # one fused reduce_scatter + sum of squares per bucket, one scalar all_reduce
            step_fn = coconet_compile(programs.grad_norm_pass_schedule(program),
                                      comm=self._comm, options=self._options)
            step_fn.input_sources = {"grad_scale": "the world size"}
            self._norm_passes[key] = step_fn
        return self._norm_passes[key]

    def _clip_scalars(self, agree: dict[str, str] | None) -> tuple[dict[str, Any], bool]:
        """The clipping scalars of this step's bucket steps, and whether ``agree`` was used
        (by the norm pass, which then runs first). One bucket: ``max_norm``, the norm is
        computed inside its fused step. Several, with a speculative lead (``_settle_clip``)
        whose last step did not clip: the norm pass runs over the other buckets only
        (``_norm_rest``) and the factor is known once the lead has stepped (``_run``). Else
        the norm pass runs over every bucket's gradient (one reduce_scatter each, one scalar
        all_reduce) and the factor is computed here as torch computes it, in float32:
        ``clamp(max_norm / (norm + 1e-6), max=1)``."""
        self._lead, self._norm_rest = None, None
        if self._max_grad_norm is None or not self._buckets:
            return {}, False
        if self._has_parts():
            norm = self._parts_norm(agree)
            self.last_grad_norm = norm
            return {"clip_coef": self.clip_factor(norm)}, agree is not None
        if self._buckets[0].clip is Clip.SPECULATIVE and len(self._buckets) == 1:
            return {}, False  # the only bucket: clips in _run
        lead = next((b for b in self._buckets if b.clip is Clip.SPECULATIVE), None)
        speculate = lead is not None and not lead.clipped_last  # the same on every rank
        over = [b for b in self._buckets if b is not lead] if speculate else self._buckets
        inputs: dict[str, Any] = {f"g{j}": b.grad for j, b in enumerate(over)}
        inputs["grad_scale"] = 1.0 / self._comm.world
        norm = self._norm_step(over).run(inputs, agree=agree)["grad_norm"]
        if speculate:
            self._lead, self._norm_rest = lead, norm
            return {}, agree is not None
        self.last_grad_norm = norm
        return {"clip_coef": self.clip_factor(norm)}, agree is not None

    def _has_parts(self) -> bool:
        """Whether a bucket holds parts of tensors split over other ranks (tensor parallel)."""
        return any(b.placement is not None for b in self._buckets)

    def _parts_norm(self, agree: dict[str, str] | None) -> torch.Tensor:
        """The global norm of the averaged gradient when some buckets hold parts of tensors
        split over other ranks (a tensor-parallel model stepped over its data-parallel
        communicator): a parameter counts once over every axis it is split along. A norm pass
        over the buckets of each kind (whole tensors; the parts of each group), the parts'
        squares summed over their group in one exact round (rank order: the same bits on every
        rank of the group), and the whole tensors' counted once: they are the same on every
        rank of the group. Every rank of every group runs the same passes in the same order."""
        kinds: dict[tuple, list[_Bucket]] = {}
        for b in self._buckets:
            kinds.setdefault(b.placement.key if b.placement else (), []).append(b)
        total = 0.0
        for buckets in kinds.values():
            inputs: dict[str, Any] = {f"g{j}": b.grad for j, b in enumerate(buckets)}
            inputs["grad_scale"] = 1.0 / self._comm.world
            norm = self._norm_step(buckets).run(inputs, agree=agree)["grad_norm"]
            agree = None  # (the first pass carries the step's agreement)
            squares = float(norm.double()) ** 2
            placement = buckets[0].placement
            if placement is not None:
                every = placement.comm.gather_floats(
                    [squares], "coconet.optim: the squares of the gradient's parts")
                squares = math.fsum(row[0] for row in every)
            total += squares
        return torch.tensor(math.sqrt(total), dtype=torch.float32, device=self._comm.device)

    def clip_factor(self, norm: torch.Tensor) -> torch.Tensor:
        """The factor the gradient is multiplied by, from its global norm (a float32 0-d
        tensor), as ``torch.nn.utils.clip_grad_norm_`` computes it."""
        return torch.clamp(self._max_grad_norm / (norm + programs.CLIP_EPS), max=1.0)

    # -- what the ranks agree on (coconet.optim.identity) ---------------------------------------

    def _refresh_identity(self) -> None:
        """The param groups' description and digest, carried by every step's agreement:
        recomputed when the groups change (a group added, a state dict loaded), not per step."""
        lines = [line for j, g in enumerate(self.param_groups)
                 for line in identity.describe_group(g, j, values=False)]
        self._identity_lines = lines
        self._identity_digest = identity.digest("\n".join(lines))

    def _agrees(self) -> bool:
        """Whether collective calls agree first: a world of one has nobody to disagree with,
        and with ``ddp=`` DDP's hook runs the steps inside ``backward()``."""
        return self._comm.world > 1 and self._ddp is None

    def _call(self, kind: CallKind, content: str = "", refusal: BaseException | None = None
              ) -> identity.Call:
        why = "" if refusal is None else _first_line(refusal)
        return identity.Call(kind, self._steps_done, self._identity_digest, content, why)

    def _agree_call(self, kind: CallKind, content: str = "",
                    refusal: BaseException | None = None) -> None:
        """Every rank makes this same collective call (``kind``, after as many steps, over the
        same param groups, with the same ``content``) and none refused it (``refusal``: this
        rank's reason), else the same ``ConfigError`` on every rank naming the difference.
        Through the first bucket's step agreement, so that it pairs with a peer's ``step()``
        (no bucket: nothing else is collective, an exchange). Raises ``refusal`` itself when
        every rank refused alike."""
        comm = self._comm
        if not self._agrees():
            if refusal is not None:
                raise refusal
            return
        text = self._call(kind, content, refusal).text()
        if self._buckets:
            reports = self._buckets[0].step_fn.agree_call({CALL_KEY: text})
            texts = None if reports is None else [r.replicated.get(CALL_KEY) for r in reports]
        else:
            every = comm.exchange(text, CALL_KEY)
            texts = None if len(set(every)) == 1 else every
        if texts is not None and len(set(texts)) > 1:
            self._raise_mismatch(texts, kind, refusal)
        if refusal is not None:
            raise refusal

    def _raise_mismatch(self, texts: list[str | None], kind: CallKind,
                        refusal: BaseException | None = None) -> None:
        """The ranks' call values differ: the same error on every rank (each has every rank's
        values). Only the identity digests differ: the ranks exchange their descriptions (each
        decided so from the same values) to name the first parameter that differs."""
        op = f"coconet.optim.{type(self).__name__}.{kind.value}"
        hint = getattr(refusal, "hint", None) or (
            "fix the call on the rank named; nothing was changed on any rank")
        error = identity.mismatch_error(texts, op, hint)
        if error is None:
            every = self._comm.exchange(self._identity_lines, "coconet.optim: param groups")
            diff = identity.first_difference(every)
            error = ConfigError(
                f"the ranks' optimizers hold different parameters: {diff[0]}",
                op=op,
                details=diff[1:],
                hint="build the same model on every rank and pass its parameters to the "
                "optimizer in the same order (named_parameters() names them in errors); "
                "nothing was changed on any rank",
            )
        raise error from refusal

    def _param_label(self, b: _Bucket, i: int) -> str:
        """``param group 0, parameter 2 ('fc.weight', shape (4, 4))``, for errors."""
        group = self.param_groups[b.group]
        p = b.params[i]
        j = next((k for k, q in enumerate(group["params"]) if q is p), i)
        names = group.get("param_names") or []
        name = f"{names[j]!r}, " if j < len(names) else ""
        return f"param group {b.group}, parameter {j} ({name}shape {b.shapes[i]})"

    def _check_param(self, p: torch.Tensor, index: int) -> None:
        name = f"coconet.optim.{type(self).__name__}"
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
        if p.grad is not None:
            self._check_grad(p, p.grad, f"param group {index}")
        self._check_placement(p, index)

    def _check_placement(self, p: torch.Tensor, index: int) -> None:
        """A part of a tensor split over other ranks (a tensor-parallel weight) is stepped by an
        optimizer whose ranks hold the same part: its communicator must not reach the ranks that
        hold the other parts (it would average different parts of one tensor), and the update
        must not need the whole tensor's norms (LAMB's trust ratio)."""
        placement = placement_of(p)
        if placement is None:
            return
        name = f"coconet.optim.{type(self).__name__}"
        if placement.comm is None:
            raise ConfigError(
                f"param group {index}: a parameter {placement.describe()} has no communicator "
                "(the model was unpickled)",
                op=name,
                hint="give the model its group first: coconet.nn.attach(model, comm)",
            )
        mine = set(self._comm.members)
        shared = sorted(set(placement.comm.members) & mine - {self._comm.members[self._comm.rank]})
        if shared:
            raise ConfigError(
                f"param group {index}: a parameter of shape {tuple(p.shape)} is this rank's part "
                f"of a tensor {placement.describe()}, and the optimizer's communicator also "
                f"holds the job's rank(s) {shared}, which hold other parts of it: the step would "
                "average different parts of one tensor",
                op=name,
                hint="step a tensor-parallel model with the data-parallel communicator only: "
                "coconet.optim.AdamW(model.parameters(), comm=comm.along('dp'))",
            )
        if self.bucket_per_parameter:
            raise ConfigError(
                f"param group {index}: {type(self).__name__}'s update needs each tensor's own "
                f"norms, and a parameter of shape {tuple(p.shape)} is this rank's part of a "
                f"tensor {placement.describe()}: its part's norms are not the tensor's",
                op=name,
                hint="use coconet.optim.AdamW/Adam/SGD for a tensor-parallel model (their update "
                "is element-wise), or keep the model whole on each rank",
            )

    def _check_grad(self, p: torch.Tensor, g: torch.Tensor, where: str) -> None:
        name = type(self).__name__
        if g.layout != torch.strided:
            raise GradientError(
                f"{where}: a parameter of shape {tuple(p.shape)} has a {g.layout} gradient: "
                f"coconet.optim.{name} does not support sparse gradients",
                op=f"coconet.optim.{name}",
                hint="use dense gradients (nn.Embedding(..., sparse=False)), or "
                "torch.optim.SparseAdam for the sparse parameters",
            )
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise GradientError(
                f"{where}: a parameter of shape {tuple(p.shape)} ({p.dtype}, {p.device}) has a "
                f"gradient of shape {tuple(g.shape)} ({g.dtype}, {g.device})",
                op=f"coconet.optim.{name}",
                hint="assign p.grad a tensor like p (torch.zeros_like(p)), or let backward() "
                "write it",
            )

    def _bucket(
        self, index: int, group: dict[str, Any], dtype: torch.dtype, params: list
    ) -> _Bucket:
        """A packed bucket: the parameters become views of one flat tensor, their gradients
        views of one flat buffer the program reads in place."""
        bucket = self._compiled_bucket(index, group, dtype, params)
        total = bucket.size
        shared = self._storage is ParamStorage.HOST_SHARED and self._comm.world > 1
        if shared:
            # one copy per host, written by its first rank (the values are the same on every
            # rank: compared when the group was added)
            bucket.replica = bucket.step_fn.host_replica("p", (total,))
            flat = bucket.replica.live()
        else:
            flat = torch.empty(total, dtype=dtype, device=self._comm.device)
        writes = not shared or self._comm.rank == 0
        grad = bucket.step_fn.input_buffer("g", bucket.shape).view(-1)
        grad.zero_()
        with torch.no_grad():
            for i, p in enumerate(params):
                start, stop = bucket.span(i)
                view = flat[start:stop].view_as(p)
                if writes:
                    view.copy_(p.detach())
                p.data = view
                bucket.has_grad[i] = p.grad is not None
                if p.grad is not None:
                    grad[start:stop].copy_(p.grad.reshape(-1))
                p.grad = grad[start:stop].view_as(p)
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    _marker(bucket.has_grad, i, bucket.seen, grad)))
        bucket.flat, bucket.grad = flat, grad
        if shared:  # the first rank's writes are in before any rank reads them
            self._comm.control.barrier("coconet.optim: host-shared parameters written")
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
        clip = self._clip_of_new_bucket()
        # several tensors in a bucket of an optimizer with per-tensor norms: one per row
        row = params[0].numel() if self.bucket_per_parameter and len(params) > 1 else 0
        step_fn = self._step_fn(group, dtype, total, clip, row)
        names = self.state_names(group)
        bucket = _Bucket(index, params, offsets, total, step_fn, (0, total), names, clip, row)
        bucket.placement = placement_of(params[0])
        bucket.bounds = bounds = bucket.bounds_of(comm.rank, comm.world)
        n = bounds[1] - bounds[0]
        for name in names:
            size = n if _is_sliced(step_fn.program, name) else total
            bucket.state[name] = torch.zeros(size, dtype=dtype, device=comm.device)
        return bucket

    def _step_fn(self, group: dict[str, Any], dtype: torch.dtype, total: int, clip: Clip,
                 row: int = 0, averaged: bool | None = None) -> Any:  # fmt: skip
        """The compiled step of a bucket of ``total`` elements of ``group`` (collective);
        ``row``: of equal-sized tensors of ``row`` elements, one per row (``_tensor_buckets``;
        0: flat); ``averaged``: of gradients averaged before the step (``_take_wrapper``: the
        program as written, which communicates nothing; None: as the optimizer is now)."""
        if averaged is None:
            averaged = self.gradients_averaged_by is not None
        extra: dict[str, Any] = {"rows": True} if row else {}
        if averaged:
            extra["averaged"] = True
        base = self.program(group, _DTYPES[dtype], **extra)
        program = base if clip is Clip.OFF else self.program(group, _DTYPES[dtype], clip=clip,
                                                             **extra)  # fmt: skip
        target = program if averaged else self._scheduled(
            program, tuple(self.state_names(group)), total, row, base)
        step_fn = coconet_compile(target, comm=self._comm, options=self._options)
        step_fn.input_sources = {**self.SCALAR_SOURCES, **_CLIP_SOURCES}
        return step_fn

    def _scheduled(
        self, program: Program, state: tuple[str, ...], total: int = 0, row: int = 0,
        base: Program | None = None,
    ) -> Program | Schedule:
        """``program``'s schedule; ``base``: the same step without clipping, when ``program``
        is one of its clipping forms (``schedule="auto"`` tunes ``base`` and gives every form
        the same recipe, see ``_tuned``)."""
        # A world of one has nothing to fuse the update with: its default is the program as
        # written (one no-op all_reduce instead of a reduce_scatter and an all_gather).
        default = "fuse_RS_C_AG" if self._comm.world > 1 else "unscheduled"
        choice = self._schedule if self._schedule is not None else default
        if callable(choice):
            return choice(program)
        if choice == "auto":
            return self._tuned(program, state, total, row, base)
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

    def _tuned(self, program: Program, state: tuple[str, ...], total: int, row: int = 0,
               base: Program | None = None) -> Program | Schedule:
        """``schedule="auto"``: the tuner's choice for a bucket of ``total`` elements, once per
        (program, size class): buckets of very different sizes (LAMB's one per parameter, or
        param groups) may get different schedules, and same-class buckets reuse the choice (a
        program's schedule does not depend on its size: N is symbolic). Collective.

        A clipping form of a step (``base`` given: the step without clipping) is not tuned on
        its own: ``base`` is, and the form gets the winner's recipe. A bucket runs several
        forms on the same state (the speculative step, the step given the factor, the one
        with the norm first), so they must slice it alike; tuned each on its own they could
        pick schedules that do not (one slicing ``m`` and ``v``, one not), and the second form
        then refused the bucket's state."""
        from coconet.tune import tune
        from coconet.tune.tuner import tuning_bucket

        if base is not None and base is not program:
            self._tuned(base, state, total, row)  # tuned once per size class, then cached
            chosen = self._auto[(base.digest(), tuning_bucket(total * 4))].winner
            return _same_recipe(program, state, chosen, type(self).__name__)
        key = (program.digest(), tuning_bucket(total * 4))
        if key not in self._auto:
            result = tune(
                program,
                self._comm,
                # a bucket of rows: K tensors of N (at least one per rank, _tensor_buckets)
                {"K": total // row, "N": row} if row else {"N": max(total, self._comm.world)},
                options=self._options,
                state=state,
                transports=[self._comm.transport_of(None)],
                top=2,
                reps=5,
                fix_algorithms=False,
                replicas=("p",) if self._storage is ParamStorage.HOST_SHARED else (),
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
        """One step over every bucket, of the parameters that have a gradient (see the module
        docstring). With ``ddp=``, the update already happened during ``backward()`` (DDP's
        communication hook ran it, bucket by bucket): only ``closure`` runs (a closure that
        calls ``backward()`` triggers the update itself)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._ddp is not None:
            return loss
        changed = self._changed_params()
        if changed:
            self._take_in(changed)
        if not self._wrapper_looked and self._comm.world > 1 and self._ddp is None:
            self._look_for_wrapper(bool(changed))
        self._warn_local_edits()
        problems: list[str] = []
        masks = [self._local_grads(b, problems) for b in self._buckets]
        for p in self._frozen:
            if p.grad is not None and not problems:
                problems.append(
                    f"a parameter of shape {tuple(p.shape)} did not require grad when the "
                    "optimizer was built (so it was not packed) but has a gradient now"
                )
        # Once a bucket starts to commit, a Ctrl-C waits until the whole step is applied (every
        # bucket, the step counts): coconet.runtime.interrupts
        outcome = [f"coconet.optim.{type(self).__name__}: the step was not applied on any rank"]
        with interrupts.span(lambda: outcome[0]):
            try:
                if self._comm.world == 1 or not self._buckets:
                    # nobody to agree with (no bucket: no collective either, so a refusal stays
                    # local)
                    self._refuse(problems, problems)
                    self._step_buckets(masks, None)
                else:
                    self._step_agreeing(masks, problems)
            except RuntimeFault as fault:
                # which call of this rank's met the peer's failure or departure (the peer's
                # own words say where it stopped)
                fault.details = (*fault.details, f"this rank was making its {self._progress_key} "
                                 f"number {self._steps_done + 1}")  # fmt: skip
                raise
            self._steps_done += 1
            self._comm.progress[self._progress_key] = self._steps_done
            for b in self._buckets:
                b.seen[:] = [b.grad._version, False]
            self.after_step()
            outcome[0] = (f"coconet.optim.{type(self).__name__}: the step was applied on every "
                          "rank before this was raised: do not repeat it")
        return loss

    def _look_for_wrapper(self, repointed: bool) -> None:
        """Look, once, for a ``DistributedDataParallel`` wrapper the optimizer was not told of,
        when there are signs of one: the parameters re-pointed (accelerate's ``prepare``), a
        gradient written after ``backward()`` accumulated it (DDP writes the average), or a
        gradient that is not the bucket's view (DDP's own buffer). The look walks the live
        objects (~0.2 s): not made without a sign."""
        signs = repointed or any(b.seen[1] and b.grad._version != b.seen[0]
                                 for b in self._buckets)  # fmt: skip
        for b in self._buckets:
            g = b.params[0].grad if b.params else None
            if g is not None and g.data_ptr() != b.grad.data_ptr():
                signs = True
        if not signs:
            return
        self._wrapper_looked = True
        wrapper = _ddp_wrapping([p for b in self._buckets for p in b.params])
        if wrapper is not None:
            self._take_wrapper(wrapper)

    def _take_wrapper(self, wrapper: torch.nn.Module) -> None:
        """The parameters are wrapped by ``DistributedDataParallel`` (made by code the user
        does not see: HF Trainer's, accelerate's ``prepare``), which all-reduces the gradients
        in ``backward()``; a step that reduced them again would move every gradient twice. From
        now on the gradients are taken as averaged: each bucket's program is its ``averaged``
        form (no collective: every rank updates the whole bucket, its state whole, as torch's
        optimizer behind DDP does) and DDP's all_reduce is the one reduction. A ``clip_grad_
        norm_`` between ``backward()`` and ``step()`` (Trainer's) then clips the average, as
        under DDP. Collective: every rank must have found its wrapper (else the same
        ConfigError on every rank). Kept as it was (the gradients reduced twice, the same
        values) where a program has no averaged form (a user's ``program`` without
        ``averaged=``) or the parameters are host-shared (one copy per host: the ranks of a
        host would all write it)."""
        content = f"gradients averaged by {type(wrapper).__name__} before the step"
        if self._agrees():
            self._agree_call(CallKind.WRAPPED, content)
        if self._storage is ParamStorage.HOST_SHARED:
            return
        try:
            forms = [self._step_fn(self.param_groups[b.group], b.params[0].dtype, b.size,
                                   b.clip, b.row, averaged=True) for b in self._buckets]
        except TypeError:  # a subclass's program() without averaged=
            return
        for b, step_fn in zip(self._buckets, forms, strict=True):
            whole = {name: self._whole(b, name) for name in b.names}  # (collective)
            b.step_fn, b.clip_steps, b.bounds, b.averaged = step_fn, {}, (0, b.size), True
            b.state = whole
        self._norm_passes.clear()
        self.gradients_averaged_by = type(wrapper).__name__

    def _changed_params(self) -> list[tuple[str, tuple]]:
        """The parameters changed since the last step, as this rank sees them: one whose
        ``.data`` was replaced (``p.data = ...``: a wrapper that re-points the storage, a
        re-initialisation by assignment, a cast), and one that did not require grad when it
        was added and does now (gradual unfreezing). Each as (the line the ranks compare, what
        to do). A few microseconds per bucket: the pointers compared."""
        out: list[tuple[str, tuple]] = []
        for b in self._buckets:
            for i in sorted(b.detached()):
                why = b.detachment(i) or "its .data was replaced"
                out.append((f"{self._param_label(b, i)}: {why}", ("detached", b, i)))
        for p in self._frozen:
            if p.requires_grad:
                j = next(j for j, g in enumerate(self.param_groups)
                         if any(p is q for q in g["params"]))
                out.append((f"param group {j}, a parameter of shape {tuple(p.shape)} requires "
                            "grad now (it did not when it was added)", ("trainable", j, p)))
        return out

    def _take_in(self, changed: list[tuple[str, tuple]]) -> None:
        """Take changed parameters in again (collective: every rank must have changed the same
        parameters to the same values, compared by checksum, else the same ConfigError on every
        rank names the first that differs, and nothing changes). A replaced ``.data`` is copied
        into the parameter's place in its bucket and the parameter becomes its view again (its
        state is kept: the new values continue it); a parameter that requires grad now is
        packed into a bucket of its own group and stepped from its first gradient, as torch
        steps it. A cast (``model.double()``) or a move cannot be taken in: refused."""
        lines, refusal = [], None
        for line, (kind, *where) in changed:
            p = where[0].params[where[1]] if kind == "detached" else where[1]
            lines.append(f"{line} (values {identity.values_checksum(p)})")
            if refusal is not None:
                continue
            try:
                if kind == "detached":
                    b, i = where
                    if p.dtype != b.flat.dtype or p.device != b.flat.device or (
                        tuple(p.shape) != b.shapes[i]
                    ):
                        raise ConfigError(
                            f"{line}: it can be taken in again only with the dtype, device and "
                            f"shape it was added with ({b.flat.dtype}, {b.flat.device}, "
                            f"{b.shapes[i]})",
                            op=f"coconet.optim.{type(self).__name__}.step",
                            hint=identity.DETACHED_HINT,
                        )
                else:
                    self._check_param(p, where[0])
            except CoconetError as e:
                refusal = e
        if self._agrees():
            self._agree_call(CallKind.ATTACH, json.dumps(lines), refusal)
        elif refusal is not None:
            raise refusal
        adopted: dict[tuple, list[torch.nn.Parameter]] = {}
        for _, (kind, *where) in changed:
            if kind == "detached":
                self._reattach(*where)
            else:
                j, p = where
                placement = placement_of(p)
                adopted.setdefault((j, p.dtype, placement.key if placement else ()), []).append(p)
        for (j, dtype, _), params in adopted.items():
            self._frozen = [q for q in self._frozen if all(q is not p for p in params)]
            group = self.param_groups[j]
            makes = self._tensor_buckets(params) if self.bucket_per_parameter else [params]
            for members in makes:
                self._buckets.append(self._bucket(j, group, dtype, members))
        if adopted:
            self._settle_clip()
        self._refresh_identity()

    @torch.no_grad()
    def _reattach(self, b: _Bucket, i: int) -> None:
        """Parameter ``i`` of ``b`` (its ``.data`` replaced, alike on every rank) a view of its
        place in the bucket again, holding its new values."""
        p = b.params[i]
        start, stop = b.span(i)
        view = b.flat[start:stop].view_as(p)
        if b.replica is None or self._comm.rank == 0:  # host-shared: one writer per host
            view.copy_(p.detach())
        p.data = view
        if b.replica is not None:
            self._comm.control.barrier("coconet.optim: a parameter taken in again")

    def _warn_local_edits(self) -> None:
        """Warn (once per optimizer) when a bucket's gradient was written in place after the
        last ``backward()`` into it: on several ranks a ``clip_grad_norm_`` there clips this
        rank's local gradient before the step averages it, which nothing else can see. One
        integer compared per bucket per step; a world of one is left alone (its local
        gradient is the average: clipping it is right)."""
        if self._warned_edit or self._comm.world == 1 or self.gradients_averaged_by is not None:
            return
        edited = [b for b in self._buckets if b.seen[1] and b.grad._version != b.seen[0]]
        if not edited:
            return
        self._warned_edit = True
        name = type(self).__name__
        also = (" (and max_grad_norm= clips the average again)"
                if self._max_grad_norm is not None else "")
        warnings.warn(
            f"coconet.optim.{name}: the gradients of param group {edited[0].group} were "
            "changed in place between backward() and step(). If that was "
            "torch.nn.utils.clip_grad_norm_ (or clip_grad_value_), it clipped this rank's "
            "local gradient: step() averages the gradients over the ranks afterwards, so the "
            f"update differs from DDP + clip_grad_norm_{also}. Clip the average instead: "
            f"coconet.optim.{name}(..., max_grad_norm=1.0), and drop the clip_grad_norm_ "
            "call (opt.last_grad_norm is the norm it returned). A linear change "
            "(GradScaler.unscale_, a division) is harmless: filter LocalGradientEditWarning.",
            LocalGradientEditWarning,
            stacklevel=_user_stacklevel(),
        )

    def _step_agreeing(self, masks: list[list[bool]], problems: list[str]) -> None:
        """The buckets' steps on several ranks, which must agree on which parameters have a
        gradient. The first bucket's step compares a digest of it in its own start-of-step
        agreement (no extra collective); when the ranks differ (a parameter with a gradient on
        some ranks only, or a gradient a rank refuses), that step fails on every rank before
        anything moves, and the ranks exchange what they have: a parameter with a gradient on
        any rank is stepped (the others count zero, as DDP averages), a refusal anywhere fails
        every rank."""
        # Which packed parameters do not require grad now: frozen on every rank it is torch's
        # case (no gradient, skipped); frozen on some ranks only, refused (the ranks differ on
        # what they train). Compared with the masks, at no extra cost.
        frozen = [(j, i) for j, b in enumerate(self._buckets)
                  for i, p in enumerate(b.params) if not p.requires_grad]
        mine = _digest(masks, problems, self._comm.rank, frozen)
        # which call this is (a peer may be making another: identity), with the step's agreement
        call = self._call(CallKind.STEP).text()
        try:
            self._step_buckets(masks, {_AGREE: mine, CALL_KEY: call})
            return
        except RuntimeFault as e:
            texts = [r.replicated.get(CALL_KEY) for r in getattr(e, "reports", None) or ()]
            if len(set(texts)) > 1:  # a peer made another call, or over other parameters
                self._raise_mismatch(texts, CallKind.STEP)
            if not any(repr(_AGREE) in d for d in e.details):  # another difference: as is
                raise
        every = self._comm.exchange((masks, problems, frozen), _AGREE)
        self._refuse(problems, [p for _, theirs, _ in every for p in theirs],
                     [(r, p) for r, (_, theirs, _) in enumerate(every) for p in theirs])
        self._refuse_frozen([f for _, _, f in every])
        masks = [[any(r[j][i] for r, _, _ in every) for i in range(len(m))]
                 for j, m in enumerate(masks)]
        self._step_buckets(masks, {_AGREE: _digest(masks, [], 0, frozen), CALL_KEY: call})

    def _refuse_frozen(self, frozen_by_rank: list[list[tuple[int, int]]]) -> None:
        """A ConfigError on every rank when the ranks froze different parameters
        (``requires_grad`` turned off after the optimizer was built, on some ranks only)."""
        if all(f == frozen_by_rank[0] for f in frozen_by_rank):
            return
        where = sorted({x for f in frozen_by_rank for x in f})
        j, i = next(x for x in where if any(x not in f for f in frozen_by_rank))
        on = [r for r, f in enumerate(frozen_by_rank) if (j, i) in f]
        off = [r for r, f in enumerate(frozen_by_rank) if (j, i) not in f]
        raise ConfigError(
            f"{self._param_label(self._buckets[j], i)} does not require grad on rank(s) {on} "
            f"but does on rank(s) {off}: its requires_grad was changed on some ranks only",
            op=f"coconet.optim.{type(self).__name__}.step",
            hint="freeze or unfreeze a parameter on every rank (requires_grad_(False) on all of "
            "them: it is then skipped, as torch skips a parameter without a gradient); nothing "
            "was stepped on any rank",
        )

    def _refuse(self, mine: list[str], anywhere: list[str],
                by_rank: list[tuple[int, str]] | None = None) -> None:
        """A GradientError when a gradient cannot be stepped here or on another rank (a
        ConfigError when a parameter is detached from its bucket: see identity.detachment);
        ``by_rank``: each problem with the rank that has it, when the ranks exchanged them."""
        if not anywhere:
            return
        problems = mine or ["another rank holds a gradient it cannot step (its error says which)"]
        op = f"coconet.optim.{type(self).__name__}.step"
        tagged = by_rank or [(self._comm.rank, p) for p in anywhere]
        detached = [(r, p.replace(f": {identity.DETACHED}", "")) for r, p in tagged
                    if identity.DETACHED in p]
        if detached:
            # a parameter no longer the view of its bucket (here or on a peer): not a gradient
            # problem; every rank raises the same error, naming the rank and the parameter
            ranks = sorted({r for r, _ in detached})
            on = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            if len(ranks) == self._comm.world:
                on = "every rank"
            raise ConfigError(
                f"on {on}: {detached[0][1]}",
                op=op,
                details=[f"rank {r}: {p}" for r, p in detached[1:4]],
                hint=identity.DETACHED_HINT,
            )
        raise GradientError(
            problems[0],
            op=op,
            details=problems[1:4],
            hint="nothing was stepped; a sparse gradient: use dense gradients or "
            "torch.optim.SparseAdam; a frozen parameter: build the optimizer after "
            "unfreezing it, or set its .grad = None",
        )

    def _step_buckets(self, masks: list[list[bool]], agree: dict[str, str] | None) -> None:
        """Each bucket's step; ``agree`` goes with the first collective step: the norm pass
        when it runs (max_grad_norm= over several buckets), else the first bucket's first
        fused step. With clipping the norm pass runs before any update (it commits nothing),
        so a step that fails there or in the agreement leaves everything as it was."""
        self.last_grad_norm = None
        try:
            self._clip_now, used = self._clip_scalars(agree)
            if used:
                agree = None
            order = list(zip(self._buckets, masks, strict=True))
            if self._lead is not None:
                # the speculative lead first: its step gives the norm the others are clipped by
                order.sort(key=lambda pair: pair[0] is not self._lead)
            for j, (b, mask) in enumerate(order):
                self._step_bucket(b, mask, agree if j == 0 else None)
                if b is self._lead and "clip_coef" not in self._clip_now:
                    # the lead was not stepped (no gradient for it on any rank: its bucket
                    # holds zeros): the norm is the others'
                    self.last_grad_norm = self._norm_rest
                    self._clip_now = {"clip_coef": self.clip_factor(self._norm_rest)}
            # the factor the gradient was clipped by (None: not clipped), for after_step
            self.last_clip_coef = self._clip_now.get("clip_coef")
        except CoconetError:
            raise  # a compiled step's own: it told the peers already, or they all refused
        except BaseException as e:
            # Between two compiled steps (after the norm pass, between buckets) only this code
            # runs: an error or a Ctrl-C here must reach the peers, waiting in the next step's
            # agreement, at once rather than at their timeout (a compiled step that failed
            # aborted already: this is then a no-op).
            if self._comm.world > 1:
                self._comm.abort(f"rank {self._comm.rank} failed in coconet.optim."
                                 f"{type(self).__name__}.step: {_first_line(e)}")
            raise
        finally:
            self._clip_now, self._lead, self._norm_rest = {}, None, None
        if self._max_grad_norm is not None and self.last_grad_norm is None:
            # nothing was stepped (no gradient anywhere): torch's norm of no gradients
            self.last_grad_norm = torch.zeros((), device=self._comm.device)

    def _local_grads(self, b: _Bucket, problems: list[str]) -> list[bool]:
        """This rank's view of which of ``b``'s parameters have a gradient; every ``.grad`` made
        the bucket's view again (a replaced one copied into it first)."""
        detached = b.detached()
        for i, p in enumerate(b.params):
            if detached and i in detached:  # refused on every rank (see _refuse)
                why = b.detachment(i) or "it is no longer a view of the optimizer's bucket"
                problems.append(f"{self._param_label(b, i)}: {why}: {identity.DETACHED}")
                continue
            start, stop = b.span(i)
            view = b.grad[start:stop]
            g = p.grad
            if g is None:  # `p.grad = None`: no gradient, and the view back, zero
                b.has_grad[i] = False
                view.zero_()
                p.grad = view.view_as(p)
            elif (g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype
                  or g.device != p.device):
                try:
                    self._check_grad(p, g, f"param group {b.group}")
                except GradientError as e:
                    problems.append(e.message)
            elif g.data_ptr() != view.data_ptr():  # assigned: a gradient
                view.copy_(g.reshape(-1))
                p.grad = view.view_as(p)
                b.has_grad[i] = True
            elif not b.has_grad[i] and p.numel() and bool(view.any()):
                # written into the view in place (no backward, no assignment): a gradient
                b.has_grad[i] = True
        return list(b.has_grad)

    def _step_bucket(self, b: _Bucket, mask: list[bool], agree: dict[str, str] | None) -> None:
        """Step ``b``'s parameters that have a gradient, each at its own step count."""
        group = self.param_groups[b.group]
        steps = self.next_steps(b)
        if all(mask) and steps.count(steps[0]) == len(steps):  # the common case: one fused step
            out = self._run(b, self.scalars(group, steps[0]), agree)
            b.steps[:] = [s + 1 for s in b.steps]
            self.after_bucket(b, out, list(range(len(b.params))))
            return
        # parameters grouped by the scalars of their step (SGD's are the same after the first)
        plan: dict[tuple, tuple[dict[str, float], list[int]]] = {}
        of_step: dict[int, tuple[tuple, dict[str, float]]] = {}
        for i, has in enumerate(mask):
            if not has:
                continue
            if steps[i] not in of_step:
                s = self.scalars(group, steps[i])
                of_step[steps[i]] = (tuple(sorted(s.items())), s)
            key, s = of_step[steps[i]]
            plan.setdefault(key, (s, []))[1].append(i)
        if not plan and agree is None:
            return
        if not plan:
            # nothing to step here, but this step carries the ranks' agreement (a peer may have
            # gradients here): run it and keep nothing
            self._run_some(b, [(self.scalars(group, steps[0]), [])], agree)
            return
        if len(plan) == 1 and all(mask):  # one step count's scalars after all (SGD)
            out = self._run(b, next(iter(plan.values()))[0], agree)
            self.after_bucket(b, out, list(range(len(b.params))))
        else:
            self._run_some(b, list(plan.values()), agree)
        for _, stepped in plan.values():
            for i in stepped:
                b.steps[i] += 1

    def _run(self, b: _Bucket, scalars: dict[str, float], agree: dict[str, str] | None
             ) -> dict[str, torch.Tensor]:  # fmt: skip
        """One step of ``b`` (clipped as its clip mode says); the outputs of the step that
        committed."""
        if b.clip is not Clip.SPECULATIVE:
            out = self._run_step(b, b.step_fn, {**scalars, **self._clip_now}, agree)
            self._keep_norm(out)
            return out
        if len(self._buckets) > 1:
            self._run_lead(b, scalars, agree)
            return {}
        if b.clipped_last:
            # the last step clipped, so this one likely does: the norm first, then the clipped
            # update, in one step (two passes; a speculative pass would likely be wasted)
            step_fn = self._clip_step(b, Clip.IN_STEP)
            out = self._run_step(b, step_fn, {**scalars, "max_norm": self._max_grad_norm}, agree)
            b.clipped_last = bool(self.clip_factor(out["grad_norm"]) != 1.0)
            self._keep_norm(out)
            return out
        verdict: dict[str, torch.Tensor] = {}

        def unclipped(outputs: dict[str, torch.Tensor]) -> bool:
            # the same norm on every rank (all-reduced in the step), so the same answer
            verdict["coef"] = coef = self.clip_factor(outputs["grad_norm"])
            return bool(coef == 1.0)  # NaN: declined, and clipped by NaN as torch does

        out = self._run_step(b, b.step_fn, scalars, agree, commit_if=unclipped)
        self._keep_norm(out)
        b.clipped_last = b.step_fn.last_declined  # (with the commit vote: if any rank declined)
        if b.clipped_last:
            # declined on every rank, nothing written: the step again, with the factor
            step_fn = self._clip_step(b, Clip.GIVEN)
            out = self._run_step(b, step_fn, {**scalars, "clip_coef": verdict["coef"]}, None)
        return out

    def _run_lead(self, b: _Bucket, scalars: dict[str, float],
                  agree: dict[str, str] | None) -> None:  # fmt: skip
        """The speculative lead of several buckets. Speculating (``_lead``): its update
        unclipped with its own norm alongside, committed when the factor of the whole norm
        (the others' from the norm pass, and its own) is 1, else declined and run again with
        the factor; either way the factor is then the other buckets'. Not speculating (its
        last step clipped: the norm pass ran over every bucket): the factor given."""
        if self._lead is not b or "clip_coef" in self._clip_now:
            # the factor is known (a full norm pass; or a second group of this bucket's
            # parameters at another step count, the first having decided)
            step_fn = self._clip_step(b, Clip.GIVEN)
            self._run_step(b, step_fn, {**scalars, **self._clip_now}, agree)
            if self._lead is not b:
                b.clipped_last = bool(self._clip_now["clip_coef"] != 1.0)
            return
        verdict: dict[str, torch.Tensor] = {}
        rest = self._norm_rest

        def unclipped(outputs: dict[str, torch.Tensor]) -> bool:
            # the whole norm from the two all-reduced parts: the same on every rank
            own = outputs["grad_norm"].double()
            norm = torch.sqrt(own * own + rest.double() * rest.double()).to(rest.dtype)
            verdict["norm"], verdict["coef"] = norm, self.clip_factor(norm)
            return bool(verdict["coef"] == 1.0)  # NaN: declined, and clipped by NaN

        self._run_step(b, b.step_fn, scalars, agree, commit_if=unclipped)
        b.clipped_last = b.step_fn.last_declined
        self.last_grad_norm = verdict["norm"]
        self._clip_now = {"clip_coef": verdict["coef"]}
        if b.clipped_last:
            step_fn = self._clip_step(b, Clip.GIVEN)
            self._run_step(b, step_fn, {**scalars, **self._clip_now}, None)

    def _clip_step(self, b: _Bucket, clip: Clip) -> Any:
        """A speculative bucket's step that clips as ``clip`` says, compiled at its first use
        (collective: the ranks decline, and guess, alike)."""
        if clip not in b.clip_steps:
            group = self.param_groups[b.group]
            b.clip_steps[clip] = self._step_fn(group, b.params[0].dtype, b.size, clip, b.row)
        return b.clip_steps[clip]

    def _run_step(self, b: _Bucket, step_fn: Any, scalars: dict[str, Any],
                  agree: dict[str, str] | None, commit_if: Any = None) -> dict[str, torch.Tensor]:
        """One run of ``step_fn`` over ``b``: its outputs (the updates committed, or declined
        by ``commit_if``)."""
        if b.averaged and "grad_scale" in scalars:  # (the average's sign only: +1, or -1)
            scalars = {**scalars, "grad_scale": scalars["grad_scale"] * self._comm.world}
        if b.replica is None:
            # `flat` is passed as a view: the commit writes a view's values in place rather
            # than handing it new storage, so the parameters (views of it) see the update.
            return step_fn.run({**b.inputs(b.flat[:]), **scalars}, agree=agree,
                               commit_if=commit_if)
        # A host replica: the commit re-points `flat` at the buffer the step wrote (every rank
        # wrote its slice there); the parameters follow it.
        before = b.flat.data_ptr()
        out = step_fn.run({**b.inputs(b.flat), **scalars}, agree=agree, commit_if=commit_if)
        if b.flat.data_ptr() != before:
            with torch.no_grad():
                for i, p in enumerate(b.params):
                    start, stop = b.span(i)
                    p.data = b.flat[start:stop].view_as(p)
        return out

    def _keep_norm(self, out: dict[str, torch.Tensor]) -> None:
        # the norm computed inside a bucket's step (the only bucket); a bucket stepped once per
        # step count computes the same norm each time (the same gradient): the first is kept
        if "grad_norm" in out and self.last_grad_norm is None:
            self.last_grad_norm = out["grad_norm"]

    def _run_some(self, b: _Bucket, plan: list[tuple[dict[str, float], list[int]]],
                  agree: dict[str, str] | None) -> None:
        """The fused step over the whole bucket once per group of ``plan`` (scalars, the
        parameters stepped with them); each group keeps its own parameters' results, everything
        else keeps its values: per element the same arithmetic as the common case. The
        programs are elementwise over the bucket (a norm is a tensor's own: LAMB's buckets hold
        one parameter, or one per row), so a parameter's result does not depend on the
        others'. On a failure the bucket is put back as it was."""
        if b.replica is not None:
            self._run_some_shared(b, plan, agree)
            return
        saved_p = b.flat.clone()
        saved = {name: x.clone() for name, x in b.state.items()}
        out_p = saved_p.clone()
        out = {name: x.clone() for name, x in saved.items()}
        try:
            for k, (scalars, stepped) in enumerate(plan):
                if k:  # the bucket as it was before this step, for the next group
                    b.flat.copy_(saved_p)
                    for name, x in b.state.items():
                        x.copy_(saved[name])
                self.after_bucket(b, self._run(b, scalars, agree if k == 0 else None), stepped)
                for i in stepped:
                    part = slice(*b.span(i))
                    out_p[part] = b.flat[part]
                    for name, x in b.state.items():
                        here = b.local(name, i)
                        if here is not None:
                            out[name][here] = x[here]
        except BaseException:
            b.flat.copy_(saved_p)
            for name, x in b.state.items():
                x.copy_(saved[name])
            raise
        b.flat.copy_(out_p)
        for name, x in b.state.items():
            x.copy_(out[name])

    def _run_some_shared(self, b: _Bucket, plan: list[tuple[dict[str, float], list[int]]],
                         agree: dict[str, str] | None) -> None:
        """``_run_some`` for host-shared parameters: every rank of the host maps them, so each
        rank saves, restores and writes back only its own slice (the one its kernel reads and
        writes), and the ranks meet once their slices are final, before any rank reads the
        parameters."""
        lo, hi = b.bounds
        saved_p = b.flat[lo:hi].clone()
        saved = {name: x.clone() for name, x in b.state.items()}
        out_p = saved_p.clone()
        out = {name: x.clone() for name, x in saved.items()}
        try:
            for k, (scalars, stepped) in enumerate(plan):
                if k:
                    b.flat[lo:hi].copy_(saved_p)
                    for name, x in b.state.items():
                        x.copy_(saved[name])
                self.after_bucket(b, self._run(b, scalars, agree if k == 0 else None), stepped)
                for i in stepped:
                    start, stop = b.span(i)
                    a, z = max(start, lo), min(stop, hi)
                    if a < z:
                        out_p[a - lo : z - lo] = b.flat[a:z]
                    for name, x in b.state.items():
                        here = b.local(name, i)
                        if here is not None:
                            out[name][here] = x[here]
        except BaseException:
            b.flat[lo:hi].copy_(saved_p)
            for name, x in b.state.items():
                x.copy_(saved[name])
            raise
        b.flat[lo:hi].copy_(out_p)
        for name, x in b.state.items():
            x.copy_(out[name])
        self._comm.control.barrier("coconet.optim: host-shared parameters written")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets; every ``.grad`` stays a view of its bucket (see the
        module docstring: with ``set_to_none`` the parameters count as without a gradient, as
        torch's ``None``). With ``ddp=``, torch's ``zero_grad`` (DDP owns the gradient
        buffers)."""
        if self._ddp is not None:
            return super().zero_grad(set_to_none)
        for b in self._buckets:
            b.grad.zero_()
            for i, p in enumerate(b.params):
                start, stop = b.span(i)
                view = b.grad[start:stop]
                if p.grad is None:
                    b.has_grad[i] = False
                elif p.grad.layout == torch.strided and p.grad.data_ptr() != view.data_ptr():
                    b.has_grad[i] = True  # torch would zero the assigned tensor and keep it
                if p.grad is None or p.grad.layout == torch.strided:
                    try:
                        p.grad = view.view_as(p)
                    except RuntimeError:
                        # torch refuses a float32 .grad for a parameter cast or moved since
                        # (detached from its bucket): left alone, the next step() refuses it
                        # on every rank, naming it (no check per parameter here: a step's cost)
                        if b.detachment(i) is None:
                            raise
            if set_to_none:
                b.has_grad[:] = [False] * len(b.has_grad)
            b.seen[:] = [b.grad._version, False]

    # -- state ----------------------------------------------------------------------------------

    def _located(self) -> dict[int, tuple[_Bucket, int]]:
        """id(param) -> (its bucket, its index there), rebuilt when the buckets change."""
        key = tuple(id(b) for b in self._buckets)
        if key != self._where_key:
            self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
            self._where_key = key
        return self._where

    def state_range(self, p: torch.Tensor) -> tuple[int, int]:
        """The elements of ``p.reshape(-1)`` whose state this rank holds (what ``opt.state[p]``
        holds on more than one rank with the state sliced): ``(start, stop)``."""
        b, i = self._located()[id(p)]
        start, stop = b.span(i)
        name = next(iter(b.state), None)
        if name is None or b.state[name].numel() == b.size:
            return 0, stop - start
        lo, hi = b.bounds
        a, z = max(start, lo), min(stop, hi)
        return (a - start, z - start) if a < z else (0, 0)

    def _write_state(self, b: _Bucket, i: int, name: str, value: Any) -> None:
        """``opt.state[p][key] = value`` for a state tensor: ``value`` shaped like the parameter
        (this rank keeps its part) or like the part this rank holds; the parameter then has
        state (as torch's, once a key is set)."""
        p = b.params[i]
        here = b.local(name, i)
        size = 0 if here is None else here.stop - here.start
        key = b.names[name]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or (
            value.numel() not in (p.numel(), size)
        ):
            raise ConfigError(
                f"opt.state[p][{key!r}] for {self._param_label(b, i)} must be a floating-point "
                f"tensor of the parameter's shape {tuple(p.shape)} (or of the {size} elements "
                f"this rank holds), got {type(value).__name__} "
                f"{tuple(getattr(value, 'shape', ()))}",
                op=f"coconet.optim.{type(self).__name__}.state",
                hint="write a tensor like the parameter: opt.state[p][key] = torch.zeros_like(p)",
            )
        flat = value.detach().reshape(-1)
        if value.numel() == p.numel() and size != p.numel():
            start, stop = self.state_range(p)
            flat = flat[start:stop]
        if here is not None:
            b.state[name][here].copy_(flat)
        if not b.steps[i]:
            b.steps[i] = 1  # it has state now (a step count given later replaces this)

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
        the torch optimizer or into this one at any world size. Runs the state-dict hooks as
        torch does (pre-hooks first; a post-hook's result replaces the state dict)."""
        self._agree_call(CallKind.STATE_DICT)  # every rank calls it now (not a step)
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        groups, index = self._packed_groups()
        state: dict[Any, dict[str, Any]] = {}
        view = self.state
        for b in self._buckets:
            # (the steps are the same on every rank: every rank gathers the same buckets)
            whole = {name: self._whole(b, name) for name in b.names} if any(b.steps) else {}
            for i, p in enumerate(b.params):
                extra = view._extra.get(id(p), {})
                if not b.steps[i] and not extra:
                    continue  # as torch: no state before a parameter's first step
                entry: dict[str, Any] = {}
                if b.steps[i]:
                    start, stop = b.span(i)
                    entry = self.step_state(b.steps[i])
                    for name, key in b.names.items():
                        entry[key] = whole[name][start:stop].view_as(p).clone()
                state[index[id(p)]] = {**entry, **extra}
        for p in (q for g in self.param_groups for q in g["params"]):
            if id(p) not in self._located() and view._extra.get(id(p)):
                state[index[id(p)]] = dict(view._extra[id(p)])  # never stepped: kept as given
        state.update(view._other)  # keys that are not parameters, as torch saves them
        state_dict: dict[str, Any] = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _whole(self, b: _Bucket, name: str) -> torch.Tensor:
        x = b.state[name]
        if x.numel() == b.numel:
            return x
        comm = self._comm
        bounds = (b.bounds_of(r, comm.world) for r in range(comm.world))
        parts = [hi - lo for lo, hi in bounds]
        work = comm.all_gather_start(x, dim=0, parts=parts, axis=None, label=f"state {name}")
        return comm.wait(work)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (from this optimizer at any world size, or from the torch one):
        hyper-parameters of each group (checked first: a setting this optimizer cannot honour
        is refused before anything changes), and each parameter's state and step count (this
        rank keeps its slice). A ``sharded_state_dict()`` is loaded back into the same rank of a
        like job. Runs the load-state-dict hooks as torch does."""
        state_dict = dict(state_dict)  # shallow copy, as torch (a pre-hook may edit it)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        # Collective: every rank checks all of it before anything changes, then the ranks agree
        # on the verdict (and, torch's format, on loading the same state): all load or none.
        shard = checkpoint.is_shard(state_dict)
        refusal: CoconetError | None = None
        loads = None
        try:
            if shard:
                checkpoint.check_shard(self, state_dict)
            else:
                loads = self._checked_torch_format(state_dict)
        except CoconetError as e:
            refusal = e
        # a shard is this rank's own: only its verdict is compared
        content = ("a shard" if shard or refusal or not self._agrees()
                   else _state_digest(state_dict))
        self._agree_call(CallKind.LOAD_STATE_DICT, content, refusal)
        if shard:
            checkpoint.apply_shard(self, state_dict)
        else:
            self._apply_torch_format(*loads)
        self._refresh_identity()
        self.after_load()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _checked_torch_format(self, state_dict: dict[str, Any]) -> tuple[list, list, dict]:
        """What loading torch's format changes (the merged groups, each bucket's saved state and
        steps), every tensor's shape and every parameter checked first: a ``ConfigError`` and
        nothing changed when anything does not fit."""
        where = f"coconet.optim.{type(self).__name__}.load_state_dict"
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ConfigError(
                f"the state dict has {len(groups) if isinstance(groups, list) else 'no'} param "
                f"groups, this optimizer {len(self.param_groups)}",
                op=where,
                hint="load a checkpoint of an optimizer built over the same param groups",
            )
        for mine, theirs in zip(self.param_groups, groups, strict=True):
            if len(mine["params"]) != len(theirs["params"]):
                raise ConfigError(
                    f"a param group has {len(theirs['params'])} parameters in the state dict, "
                    f"{len(mine['params'])} here",
                    op=where,
                    hint="load a checkpoint of an optimizer built over the same parameters",
                )
        # the groups as they will be, checked before anything changes
        merged = []
        for j, (mine, theirs) in enumerate(zip(self.param_groups, groups, strict=True)):
            new = {k: v for k, v in mine.items() if k != "params"}
            new.update(copy.deepcopy({k: v for k, v in theirs.items() if k != "params"}))
            self.check_group(new, f"param group {j} of the state dict")
            merged.append(new)
        saved_ids = [i for g in groups for i in g["params"]]
        if len(set(saved_ids)) != len(saved_ids):
            raise ConfigError(
                "the state dict names a parameter in more than one place of its param groups "
                f"({saved_ids[:8]}...)",
                op=where,
                hint="load a checkpoint saved by state_dict() of an optimizer built over the same "
                "parameters",
            )
        params = [p for g in self.param_groups for p in g["params"]]
        mine_ids = {id(p): i for p, i in zip(params, saved_ids, strict=True)}
        entries = state_dict.get("state", {})
        if not isinstance(entries, Mapping):
            raise ConfigError(f"the state dict's 'state' is a {type(entries).__name__}",
                              op=where, hint="load a checkpoint saved by state_dict()")
        held = set(saved_ids)
        # keys that are not parameter indices (a hook's mark) are kept as given, as torch keeps
        # them; an index no param group holds is refused
        others = {k: v for k, v in entries.items()
                  if not isinstance(k, int) or isinstance(k, bool)}
        unknown = [k for k in entries if k not in held and k not in others]
        if unknown:
            raise ConfigError(
                f"the state dict has state for parameter(s) {unknown[:4]} that none of its param "
                f"groups holds (they hold {sorted(saved_ids)[:8]}...)",
                op=where,
                hint="load a checkpoint saved by state_dict() of an optimizer built over the same "
                "parameters",
            )
        loads = []
        for b in self._buckets:
            saved = [entries.get(mine_ids[id(p)]) for p in b.params]
            for i, (p, e) in enumerate(zip(b.params, saved, strict=True)):
                if e is not None and not isinstance(e, Mapping):
                    raise ConfigError(
                        f"the state dict's entry for {self._param_label(b, i)} is a "
                        f"{type(e).__name__}", op=where,
                        hint="load a checkpoint saved by state_dict()")
                missing = [] if e is None else [k for k in self.required_state(b.names)
                                                    if k not in e]
                if missing:
                    raise ConfigError(
                        f"the state dict's entry for {self._param_label(b, i)} has no "
                        f"{', '.join(map(repr, missing))} (it has {sorted(map(str, e))})",
                        op=where,
                        hint="load a complete checkpoint saved by state_dict(); a parameter "
                        "without any entry starts from zero state, as torch's",
                    )
                for key in b.names.values():
                    x = None if e is None else e.get(key)
                    # the exact shape (torch's format keeps each tensor shaped as its
                    # parameter): a transposed or one-element tensor would be broadcast or
                    # reshaped into wrong values
                    if x is not None and (not isinstance(x, torch.Tensor)
                                          or tuple(x.shape) != tuple(p.shape)
                                          or not x.is_floating_point()):
                        raise ConfigError(
                            f"the state dict's {key!r} of {self._param_label(b, i)} is "
                            f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}"
                            f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}; "
                            f"it must be a floating-point tensor of shape {tuple(p.shape)}",
                            op=where,
                            hint="load a checkpoint of an optimizer built over the same "
                            "parameters, in the same order",
                        )
            try:
                steps = [self.step_of(e) if e is not None else 0 for e in saved]
            except (TypeError, ValueError, KeyError, RuntimeError) as exc:
                raise ConfigError(f"the state dict's step counts cannot be read: {exc}",
                                  op=where, hint="load a checkpoint saved by state_dict()") from exc
            loads.append((b, saved, steps))
        return merged, loads, others

    def required_state(self, names: dict[str, str]) -> list[str]:
        """The keys a saved parameter's entry must have (torch's own optimizer fails on an
        entry without them): every state tensor and the step count, where kept."""
        return [*names.values(), *self.step_state(1)]

    def _apply_torch_format(self, merged: list, loads: list, others: dict) -> None:
        """Load what ``_checked_torch_format`` checked (nothing here can refuse)."""
        for mine, new in zip(self.param_groups, merged, strict=True):
            mine.update(new)
        view = self.state
        view._other = dict(others)
        view._extra = {}
        for b, saved, steps in loads:
            b.steps[:] = steps
            # the entries' other keys (a Lamb checkpoint's diagnostics, a hook's marks)
            kept = {*b.names.values(), *self.step_state(1)}
            for p, e in zip(b.params, saved, strict=True):
                extra = {k: v for k, v in (e or {}).items() if k not in kept}
                if extra:
                    view._extra[id(p)] = extra
            lo, hi = b.bounds
            for name, key in b.names.items():
                target = b.state[name]
                whole = torch.zeros(b.numel, dtype=target.dtype, device=target.device)
                for i, e in enumerate(saved):
                    if e is not None and e.get(key) is not None:
                        start, stop = b.span(i)
                        whole[start:stop].copy_(e[key].reshape(-1))
                target.copy_(whole if target.numel() == b.numel else whole[lo:hi])

    # -- copies ---------------------------------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ConfigError(
            f"a coconet.optim.{type(self).__name__} cannot be copied or pickled: it holds a "
            "communicator and compiled steps, and its parameters are views of its buckets",
            op=f"coconet.optim.{type(self).__name__}",
            hint="save opt.state_dict() (torch.save works on it) and load it into an optimizer "
            "built over the new parameters: new = coconet.optim."
            f"{type(self).__name__}(params, ...); new.load_state_dict(opt.state_dict())",
        )

    def __deepcopy__(self, memo: dict) -> Any:
        return self.__reduce_ex__(4)


class _StateView(MutableMapping):
    """``opt.state``: each parameter's state in torch's keys, read from the buckets at each
    access (a step hands the state new storage: read ``opt.state[p]`` again after a step), and
    written through to them (a state-dict hook, a user's edit: ``opt.state[p]["exp_avg"] = t``).

    On a world of one, and with a schedule that keeps the state whole on every rank (``AR_C``),
    the tensors are shaped like the parameter. On more ranks with the state sliced (the
    default schedules) each rank holds a slice of the bucket, so the tensors are this rank's
    part of the parameter's flattened state: 1-D, possibly empty, its elements ``[start, stop)``
    of ``p.reshape(-1)`` with ``(start, stop) = opt.state_range(p)``. Whole tensors need every
    rank: ``opt.state_dict()`` gathers them. The tensors are views: writing into them in place
    writes the state. As torch's, a parameter has no state (``{}``) before its first step.

    Written: a state tensor takes a tensor shaped like the parameter (this rank keeps its part)
    or like this rank's part; a step count (``step``, where the optimizer keeps one per
    parameter) sets the parameter's; any other key (a hook's mark, LAMB's diagnostics) is kept
    as given, saved in ``state_dict()`` and loaded back, as torch keeps it. Keys that are not
    parameters (``opt.state["ran_hook"] = True``) are kept too, as torch's ``defaultdict``
    keeps them. ``del opt.state[p]`` drops the parameter's state (it starts again from zero)."""

    def __init__(self, opt: DistributedOptimizer) -> None:
        self._opt = opt
        self._other: dict[Any, Any] = {}  # keys that are not parameters, as torch keeps them
        self._extra: dict[int, dict[str, Any]] = {}  # id(param) -> its keys besides the state

    def _param(self, key: Any) -> bool:
        return isinstance(key, torch.Tensor) and any(
            key is q for g in self._opt.param_groups for q in g["params"])

    def __getitem__(self, key: Any) -> Any:
        found = self._opt._located().get(id(key)) if isinstance(key, torch.Tensor) else None
        if found is not None or self._param(key):
            return _Entry(self, key, found)
        if key not in self._other:
            self._other[key] = {}  # torch's state is a defaultdict(dict)
        return self._other[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        found = self._opt._located().get(id(key)) if isinstance(key, torch.Tensor) else None
        if found is None and not self._param(key):
            self._other[key] = value
            return
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"opt.state[p] takes a mapping of the parameter's state, got "
                f"{type(value).__name__}",
                op=f"coconet.optim.{type(self._opt).__name__}.state",
                hint="opt.state[p] = {'step': torch.tensor(3.0), 'exp_avg': ..., ...}",
            )
        entry = _Entry(self, key, found)
        entry.reset()
        for k, v in value.items():
            entry[k] = v

    def __delitem__(self, key: Any) -> None:
        found = self._opt._located().get(id(key)) if isinstance(key, torch.Tensor) else None
        if found is None and not self._param(key):
            del self._other[key]
            return
        _Entry(self, key, found).reset()

    def _stepped(self) -> list[Any]:
        params = [p for b in self._opt._buckets for p, s in zip(b.params, b.steps, strict=True)
                  if s or self._extra.get(id(p))]
        known = {id(p) for p in params}
        params += [p for g in self._opt.param_groups for p in g["params"]
                   if id(p) not in known and self._extra.get(id(p))]
        return [*params, *self._other]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._stepped())

    def __len__(self) -> int:
        return len(self._stepped())

    def __contains__(self, key: object) -> bool:
        if isinstance(key, torch.Tensor):
            return any(key is p for p in self._stepped())
        return key in self._other

    def __repr__(self) -> str:
        return f"<coconet.optim state of {len(self)} parameters>"


class _Entry(MutableMapping):
    """``opt.state[p]``: one parameter's state, read from and written to its bucket."""

    def __init__(self, view: _StateView, p: torch.Tensor, found: tuple[_Bucket, int] | None
                 ) -> None:  # fmt: skip
        self._view, self._p, self._found = view, p, found
        self._opt = view._opt

    def _extra(self, create: bool = False) -> dict[str, Any]:
        extra = self._view._extra.get(id(self._p))
        if extra is None:
            extra = {}
            if create:
                self._view._extra[id(self._p)] = extra
        return extra

    def _read(self) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        if self._found is not None:
            b, i = self._found
            if b.steps[i]:
                entry = self._opt.step_state(b.steps[i])
                for name, key in b.names.items():
                    here = b.local(name, i)
                    x = b.state[name]
                    if x.numel() == b.size:
                        entry[key] = x[here].view_as(b.params[i])
                    else:
                        entry[key] = x[here] if here is not None else x[:0]
        entry.update(self._extra())
        return entry

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())

    def __setitem__(self, key: str, value: Any) -> None:
        if self._found is None:  # a parameter the optimizer never steps: kept as given
            self._extra(create=True)[key] = value
            return
        b, i = self._found
        names = {v: k for k, v in b.names.items()}
        if key in names:
            self._opt._write_state(b, i, names[key], value)
        elif key in self._opt.step_state(1):  # the parameter's step count
            b.steps[i] = self._opt.step_of({key: value})
        else:
            self._extra(create=True)[key] = value

    def __delitem__(self, key: str) -> None:
        extra = self._extra()
        if key in extra:
            del extra[key]
            return
        if key in self._read():
            raise ConfigError(
                f"opt.state[p][{key!r}] cannot be removed alone: the optimizer's step reads it",
                op=f"coconet.optim.{type(self._opt).__name__}.state",
                hint="del opt.state[p] drops the parameter's whole state (it starts again from "
                "zero), or write new values: opt.state[p][key] = tensor",
            )
        raise KeyError(key)

    def reset(self) -> None:
        """No state: zeros, no step, no other keys (as before the parameter's first step)."""
        self._view._extra.pop(id(self._p), None)
        if self._found is not None:
            b, i = self._found
            for name in b.names:
                here = b.local(name, i)
                if here is not None:
                    b.state[name][here].zero_()
            b.steps[i] = 0


def _same_recipe(program: Program, state: tuple[str, ...], chosen: Any, name: str
                 ) -> Program | Schedule:  # fmt: skip
    """``program`` (a clipping form of a step) scheduled as ``chosen`` (the tuner's winning
    ``Candidate`` for the step without clipping) schedules it: the candidate of ``program``
    with that recipe on that transport, or the one that recipe duplicates. Where the recipe
    does not apply to the form (the norm of a clipping form can make a fusion illegal), the
    form's candidate that slices the same state, the one whose recipe shares the most
    primitives with the chosen recipe (the first such in enumeration order: the same on every
    rank)."""
    from coconet.tune.candidates import CHUNKS, enumerate_candidates

    candidates, found = enumerate_candidates(program, [chosen.transport], CHUNKS, state)
    recipe = chosen.recipe
    same = found.duplicates.get(recipe)
    for c in candidates:
        if c.recipe == recipe or (same is not None and c.name == same):
            return c.target
    sliced = {n for n in state if _is_sliced(chosen.scheduled, n)}
    alike = [c for c in candidates if {n for n in state if _is_sliced(c.scheduled, n)} == sliced]
    if not alike:
        raise ConfigError(
            f"schedule='auto' chose {chosen.name} ({recipe}) for the step without clipping, and "
            f"no schedule of {program.name} keeps its state sliced alike "
            f"({', '.join(sorted(sliced)) or 'nothing sliced'})",
            op=f"coconet.optim.{name}",
            details=[str(r) for r in found.rejected][:3],
            hint="give a named schedule (schedule='fuse_RS_C_AG', 'AR_C', ...) with "
            "max_grad_norm=",
        )

    def shared(c: Any) -> int:
        ours, theirs = c.recipe.split("+"), recipe.split("+")
        return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                     if a != b),
                    min(len(ours), len(theirs)))

    return max(alike, key=shared).target


def _default_comm(comm: Any, name: str) -> Communicator:
    """``comm``, or the communicator of ``coconet.runtime.init()`` (made once per process):
    the job of an initialised torch.distributed, torchrun's environment, or a world of one."""
    if comm is None:
        from coconet.runtime import launch

        return launch.current() or launch.init()
    if not isinstance(comm, Communicator):
        raise ConfigError(
            f"{name} needs a communicator, got comm={comm!r}",
            op=f"coconet.optim.{name}",
            hint="comm = coconet.runtime.init(); opt = coconet.optim."
            f"{name}(model.parameters(), comm=comm), or leave comm out for that default",
        )
    return comm


def _checked_max_grad_norm(value: Any, name: str, ddp: Any, supported: bool) -> float | None:
    """``max_grad_norm=``: None (no clipping) or a finite number > 0; refused with ``ddp=``
    and for an optimizer whose program cannot clip."""
    if value is None:
        return None
    op = f"coconet.optim.{name}"
    if not supported:
        raise ConfigError(
            f"{name}: max_grad_norm={value!r} is not supported: its program does not clip",
            op=op,
            hint="give its program a clip= parameter (see coconet.optim.programs.adam) and "
            "set supports_grad_clip = True, or leave max_grad_norm out",
        )
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{name}: max_grad_norm={value!r} is not a number",
            op=op,
            hint="max_grad_norm=1.0 (the gradients' global norm is clipped to it), or None "
            "for no clipping",
        )
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ConfigValueError(
            f"{name}: max_grad_norm={value!r} must be a finite number > 0",
            op=op,
            hint="max_grad_norm=1.0 (nanoGPT's grad_clip); None turns clipping off (not 0, "
            "which would zero every gradient, and not inf)",
        )
    if ddp is not None:
        raise ConfigError(
            f"{name}: max_grad_norm= cannot be combined with ddp=: with ddp= each DDP bucket "
            "is updated inside backward() as soon as its gradients are ready, before the "
            "other buckets' gradients exist, so the global norm is not known when a bucket is "
            "updated (and a clip_grad_norm_ after backward() would come too late: the update "
            "has happened)",
            op=op,
            hint="leave ddp= out and the model unwrapped: coconet.optim averages the gradients "
            "in its step and clips them there by the global norm (max_grad_norm=); backward() "
            "writes straight into its buckets",
        )
    return value


def _param_storage(storage: Any, name: str, ddp: Any) -> ParamStorage:
    """``param_storage=``, checked: a ``ParamStorage`` or its value."""
    if storage is None:
        return ParamStorage.PER_RANK
    try:
        storage = ParamStorage(storage)
    except ValueError:
        raise ConfigError(
            f"{name}: param_storage={storage!r} is not one of "
            f"{[s.value for s in ParamStorage]}",
            op=f"coconet.optim.{name}",
            hint="param_storage='host-shared' (one copy per host) or 'per-rank' (the default)",
        ) from None
    if storage is ParamStorage.HOST_SHARED and ddp is not None:
        raise ConfigError(
            f"{name}: param_storage='host-shared' cannot be combined with ddp=: DDP's buckets "
            "are its own",
            op=f"coconet.optim.{name}",
            hint="leave ddp= out (backward() then fills the optimizer's gradient bucket "
            "directly), or keep per-rank storage",
        )
    return storage


def _digest(masks: list[list[bool]], problems: list[str], rank: int,
            frozen: list[tuple[int, int]] = ()) -> str:
    """What the ranks compare: the masks, the packed parameters frozen since, and a refusal
    made unique to this rank (so that a refusal always reaches the exchange, even when every
    rank refuses)."""
    text = ";".join("".join("1" if x else "0" for x in m) for m in masks)
    if frozen:
        text += f"|frozen {frozen}"
    if problems:
        text += f"|refused by rank {rank}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _marker(flags: list[bool], i: int, seen: list, grad: torch.Tensor
            ) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: parameter ``i`` got a gradient from ``backward()`` (and
    the bucket's gradient buffer is at this version now: autograd accumulates into the view in
    place, which counts on the buffer's shared version counter)."""

    def mark(_param: torch.Tensor) -> None:
        flags[i] = True
        seen[0] = grad._version
        seen[1] = True

    return mark


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside coconet and torch (step() runs
    inside torch's no_grad and profiling wrappers): where the user called ``step()``."""
    import os

    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["coconet"]))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


class LocalGradientEditWarning(UserWarning):
    """A ``coconet.optim`` optimizer on several ranks found its gradients changed in place
    between ``backward()`` and ``step()``: most likely ``torch.nn.utils.clip_grad_norm_`` (or
    ``clip_grad_value_``), which then clipped each rank's *local* gradient before the step
    averaged it. Global-norm clipping of the average is ``max_grad_norm=``. A linear change
    (``GradScaler.unscale_``, a division for gradient accumulation) is harmless: filter this
    warning (``warnings.filterwarnings("ignore", category=LocalGradientEditWarning)``)."""


def _ddp_wrapping(params: list[torch.Tensor]) -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` module that holds any of ``params``, if one is alive
    (found among the live objects: a wrapper made by code the optimizer is not shown)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        # (by its type: isinstance would call into weak proxies, some of them dead)
        if issubclass(type(obj), DistributedDataParallel) and any(
            id(p) in ids for p in getattr(obj, "_module_parameters", ())
        ):
            return obj
    return None


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _is_sliced(program: Program, name: str) -> bool:
    return program.input(name).type.layout.is_sliced


def _first_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's message, on one line: what a refusing rank tells its peers."""
    text = exc.message if isinstance(exc, CoconetError) else str(exc)
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _state_digest(state_dict: dict[str, Any]) -> str:
    """A digest of torch's format as the ranks compare it before loading (the same checkpoint
    on every rank): its groups and every entry, each tensor by shape, dtype and values."""
    h = hashlib.sha256()

    def add(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"T{tuple(v.shape)}{v.dtype}{identity.values_checksum(v)}".encode())
        elif isinstance(v, Mapping):
            for k in sorted(v, key=repr):
                h.update(f"K{k!r}".encode())
                add(v[k])
        elif isinstance(v, list | tuple):
            h.update(b"[")
            for x in v:
                add(x)
            h.update(b"]")
        else:
            h.update(repr(v).encode())

    add({"state": state_dict.get("state", {}), "param_groups": state_dict.get("param_groups")})
    return "state dict " + h.hexdigest()[:16]
