"""``DistributedOptimizer``: a ``torch.optim.Optimizer`` whose step is a compiled coconet program.

The class is torch's ``Optimizer`` surface over rooms that each do one job:

- ``coconet.optim.buckets``: the parameters packed into flat buckets (each ``.data`` a view of
  its bucket, each ``.grad`` a view of its flat gradient: ``backward()`` accumulates into it,
  nothing is copied per step), and each bucket's compiled steps by clip mode;
- ``coconet.optim.recipes``: how a bucket's program is scheduled (``schedule=``, ``"auto"``)
  and compiled;
- ``coconet.optim.clip``: ``max_grad_norm=``, torch's ``clip_grad_norm_`` of the averaged
  gradient inside the step, as one ``ClipPlan`` per step;
- ``coconet.optim.agreement``: what the ranks agree on before each collective call, and the
  typed value of a difference;
- ``coconet.optim.params``: what a step finds of the parameters (which have a gradient, which
  changed since the last step, a DDP wrapper around them);
- ``coconet.optim.stepping``: a step over every bucket (skipped parameters, per-parameter step
  counts, a failure put back);
- ``coconet.optim.state``: ``opt.state`` and torch's state dict format.

The contract ``coconet.optim``'s optimizers share:

- **The step** reduces the gradients itself (the average over ranks, as DDP computes it; no DDP
  wrapper is needed) with the optimizer's schedule: by default ``fuse_RS_C_AG`` with the state
  stored sliced, so each rank keeps ``1/world`` of the state and updates only its slice, inside
  the fused collective; over shared memory as one pass. Parameters that do not require grad are
  kept in ``param_groups`` but packed nowhere and never stepped (as torch, which skips them).
- **All or nothing.** A bucket's update is committed on every rank or on none (the compiled
  step's guarantee; a Ctrl-C once a bucket starts to commit waits until every bucket has). With
  several buckets (param groups, dtypes) a failure in a later bucket leaves the earlier ones
  updated.
- **Hyper-parameters** are read from ``param_groups`` at every step (``torch.optim.lr_scheduler``
  works unchanged), checked when a group is added or loaded; their scalar arithmetic is done on
  the host in float64.
- ``state_dict()`` is torch's format, gathered from the slices (collective: every rank calls it);
  ``load_state_dict()`` takes that format from any world size, or from the torch optimizer; the
  state-dict hooks run as torch runs them. ``opt.state[p]`` reads and writes the state in
  torch's keys. It cannot be copied or pickled: save its ``state_dict()``.

Every rank must construct the optimizer over the same parameters (shapes, values, names), in the
same order, and make the same collective calls (``step``, ``state_dict``, ``load_state_dict``,
``add_param_group``) in the same order: checked before anything changes, a mismatch fails every
rank at once with the same error. A parameter changed since the last step (its ``.data``
replaced, unfrozen) is taken in again where every rank changed it alike.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from coconet import tracing
from coconet.errors import CoconetError, ConfigError, RuntimeFault
from coconet.ir.program import Program
from coconet.ir.types import DType
from coconet.optim import agreement, checkpoint, settings, state
from coconet.optim import ddp as ddp_hook
from coconet.optim.agreement import CallAgreement, CallKind
from coconet.optim.buckets import Bucket, Buckets
from coconet.optim.clip import Clipper
from coconet.optim.packing import Packer
from coconet.optim.params import LocalGradientEditWarning, ParamWatch
from coconet.optim.recipes import Recipes
from coconet.optim.scaling import Scaling, warn_unscaled
from coconet.optim.sharded import ShardedSteps, is_fully_sharded
from coconet.optim.stepping import Stepper
from coconet.options import CommitMode, CompileOptions, ParamStorage, Rounding
from coconet.runtime import interrupts
from coconet.runtime.comm import Communicator
from coconet.runtime.shards import placement_of
from coconet.schedule import Schedule
from coconet.tracing import Category

__all__ = ["DistributedOptimizer", "LocalGradientEditWarning"]


class DistributedOptimizer(torch.optim.Optimizer):
    """Base of ``coconet.optim``'s optimizers (see the module docstring for the contract).

    A subclass names its DSL program (``program``), the program's state inputs and their
    ``torch.optim`` names (``state_names``), and the host scalars of one step (``scalars``).
    ``comm`` defaults to the communicator of ``coconet.runtime.init()`` (the job of an
    initialised ``torch.distributed``, or a world of one).
    """

    # Buckets of tensors instead of per (group, dtype): for updates whose norms are a tensor's
    # own (LAMB's layer-wise trust ratio). The small tensors of one size share a bucket, one
    # per row (``program(..., rows=True)``), the others are a bucket each (``tensor_buckets``).
    bucket_per_parameter = False
    # Whether ``program`` takes ``clip=`` (a ``Clip``): ``max_grad_norm=`` needs it.
    supports_grad_clip = False
    # Whether a single bucket may compute the norm and torch's factor inside its step
    # (``Clip.IN_STEP``, torch's 1e-6); False: the factor is always ``clip_factor``'s (LAMB's)
    clip_in_step = True
    # What the user set that each scalar input of the program is made from, as an error that
    # names a differing input says it (a differing lr named as lr, not step_size).
    SCALAR_SOURCES: dict[str, str] = {}
    # torch.amp.GradScaler hands itself to step() (grad_scaler=) instead of unscaling and
    # checking each rank's gradients itself: coconet.optim.scaling
    _step_supports_amp_scaling = True

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
        reduce_dtype: torch.dtype | None = None,
        rounding: Rounding | str | None = None,
    ) -> None:
        name = type(self).__name__
        max_norm = settings.checked_max_grad_norm(max_grad_norm, name, ddp,
                                                  self.supports_grad_clip)  # fmt: skip
        self.comm = settings.default_comm(comm, name)
        self.storage = settings.param_storage(param_storage, name, ddp)
        # the dtype the gradients are reduced in (None: their own; settings.checked_reduce_dtype)
        self.reduce_dtype = settings.checked_reduce_dtype(reduce_dtype, name, ddp)
        # how the float32 masters of 16-bit parameters are rounded into them
        self.rounding = settings.rounding(rounding, name)
        self.ddp = ddp
        # State updates take the new storage (no copy); the parameters are always written in
        # place (they are views of a bucket).
        options = dataclasses.replace(options or CompileOptions(), commit=CommitMode.SWAP)
        self.buckets = Buckets()
        self.recipes = Recipes(schedule, self.comm, options,
                               self.storage is ParamStorage.HOST_SHARED, name,
                               self.SCALAR_SOURCES)  # fmt: skip
        self.clipper = Clipper(max_norm if ddp is None else None, self.comm, options,
                               self.clip_factor, self.clip_in_step)  # fmt: skip
        self.agreement = CallAgreement(self.comm, name, enabled=ddp is None)
        self.watch = ParamWatch(self)
        self.packer = Packer(self)
        self.stepper = Stepper(self)
        # Who averages the gradients before the step, when not the step itself: a DDP wrapper
        # found around the parameters (params.ParamWatch.take_wrapper); None: the step does.
        self.gradients_averaged_by: str | None = None
        self.hooks: list[Any] = []  # the post-accumulate-grad hooks' handles
        # the steps of fully sharded parameters (coconet.fsdp), which run in the backward
        self.sharded: ShardedSteps | None = None
        # how this optimizer's steps are named in the calls its rank made (Communicator.progress:
        # what a rank that leaves the job tells its peers)
        self._progress_key, n = f"coconet.optim.{name}.step", 1
        while self._progress_key in self.comm.progress:  # another such optimizer, alive
            n += 1
            self._progress_key = f"coconet.optim.{name}.step (optimizer {n})"
        self.comm.progress[self._progress_key] = 0
        weakref.finalize(self, self.comm.progress.pop, self._progress_key, None)
        if ddp is not None:
            params = list(params)  # as torch does; looked at before DDP's hook is registered
            ddp_hook.check_and_register(self, ddp, params)
        super().__init__(params, defaults)  # calls add_param_group for each group
        # torch's own `state` (a defaultdict) stays empty here: this one reads the buckets.
        self.state = state.StateView(self)
        # The hooks hold only the buckets' flag lists; remove them with the optimizer.
        weakref.finalize(self, _remove_hooks, self.hooks)

    # -- what a subclass provides ---------------------------------------------------------------

    def program(self, group: dict[str, Any], dtype: DType) -> Program:
        """One step of the optimizer over a flat bucket of ``dtype``: inputs ``g`` (Local) and
        ``p`` (Replicated), the state (Replicated; the schedule slices it), then the scalars.
        With ``supports_grad_clip``, it also takes ``clip=`` (``coconet.optim.programs.Clip``);
        ``averaged=True``: the form of gradients averaged before the step (a DDP wrapper's).
        16-bit parameters and ``reduce_dtype=``: it takes ``reduce=`` (the dtype the gradients
        are reduced in) and, for a 16-bit ``dtype``, a float32 input ``master`` after the state
        that it updates, with ``p`` the master's rounding (``programs.Precision``); without
        those, the optimizer steps float32 parameters only."""
        raise NotImplementedError

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        """The program's state inputs for ``group`` -> their names in torch's state dict."""
        raise NotImplementedError

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        """The program's scalar inputs for ``group`` at step ``step`` (1-based), computed in
        float64 on the host."""
        raise NotImplementedError

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

    def required_state(self, names: dict[str, str]) -> list[str]:
        """The keys a saved parameter's entry must have (torch's own optimizer fails on an
        entry without them): every state tensor and the step count, where kept."""
        return [*names.values(), *self.step_state(1)]

    def next_steps(self, b: Bucket) -> list[int]:
        """The step number each parameter of ``b`` is at in this step (1-based): its own count,
        as torch keeps it per parameter (LAMB: its group's)."""
        return [s + 1 for s in b.steps]

    def before_bucket(self, b: Bucket) -> None:
        """Called before a bucket's step (LAMB takes its rows' weight norms here)."""

    def after_bucket(self, b: Bucket, outputs: dict[str, torch.Tensor], stepped: list[int]
                     ) -> None:  # fmt: skip
        """Called with a bucket step's outputs and the parameters it stepped (LAMB keeps its
        per-tensor diagnostics from them)."""

    def after_step(self) -> None:
        """Called after every bucket was stepped (LAMB counts its groups' steps here)."""

    def after_load(self) -> None:
        """Called after a state dict was loaded."""

    def clip_factor(self, norm: torch.Tensor) -> torch.Tensor:
        """The factor the gradient is multiplied by, from its global norm (a float32 0-d
        tensor), as ``torch.nn.utils.clip_grad_norm_`` computes it."""
        from coconet.optim.programs import CLIP_EPS

        return torch.clamp(self.max_grad_norm / (norm + CLIP_EPS), max=1.0)

    # -- what it shows --------------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> float | None:
        """The ``max_grad_norm=`` given at construction (None: no clipping)."""
        return self.clipper.max_norm

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global norm of the averaged gradient at the last step (``max_grad_norm=``), as
        ``torch.nn.utils.clip_grad_norm_`` returns it."""
        return self.clipper.last_grad_norm

    @property
    def last_clip_coef(self) -> torch.Tensor | None:
        """The factor the averaged gradient was multiplied by at the last step (None: not
        clipped)."""
        return self.clipper.last_clip_coef

    @property
    def tuning(self) -> list[Any]:
        """With ``schedule="auto"``: the ``TuneResult`` of each size class tuned (its
        ``explain()`` says why each schedule was chosen)."""
        return self.recipes.tuning

    def state_range(self, p: torch.Tensor) -> tuple[int, int]:
        """The elements of ``p.reshape(-1)`` whose state this rank holds (what ``opt.state[p]``
        holds on more than one rank with the state sliced): ``(start, stop)``."""
        b, i = self.buckets.find(p)
        return b.state_range(i)

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
        if refusal is None and added and (self.sharded is not None
                                          or is_fully_sharded(group["params"])):  # fmt: skip
            ShardedSteps.take_group(self, index, group)
            return
        trainable = []
        if refusal is None:
            try:
                self.check_group(group, f"param group {index}")
                for p in group["params"]:
                    if p.requires_grad:
                        self.watch.check_param(p, index)
                        trainable.append(p)
            except CoconetError as e:
                refusal = e
            except BaseException:
                self.param_groups.pop()  # as if never added
                raise
        try:
            # (the values' checksums only where there is a peer to compare them with)
            content = (json.dumps(agreement.describe_group(group, index, values=True))
                       if self.agreement.enabled else "")  # fmt: skip
            self.agree_call(CallKind.ADD_PARAM_GROUP, content, refusal)
        except BaseException:
            if added:
                self.param_groups.pop()  # as if never added
            raise
        self.watch.frozen.extend(p for p in group["params"] if not p.requires_grad)
        if self.ddp is not None:
            ddp_hook.check_group(self, index)
            self.agreement.refresh(self.param_groups)
            return  # DDP's buckets are the buckets: made on the hook's first call
        # one bucket per dtype and per group a parameter is split over (whole tensors apart
        # from parts: their squares count differently in the global norm)
        by_kind: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in trainable:
            placement = placement_of(p)
            by_kind.setdefault((p.dtype, placement.key if placement else ()), []).append(p)
        for (dtype, _), params in by_kind.items():
            self.packer.pack_group(index, dtype, params)
        self.packer.settle_clipping()
        self.agreement.refresh(self.param_groups)

    def agree_call(self, kind: CallKind, content: str = "",
                   refusal: BaseException | None = None) -> None:  # fmt: skip
        """Every rank makes this same collective call (``CallAgreement.agree``), through the
        first bucket's step agreement so that it pairs with a peer's ``step()``."""
        first = self.buckets[0].step_fn if len(self.buckets) else None
        self.agreement.agree(kind, first, content, refusal)

    # -- a step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             grad_scaler: Any = None) -> Any:  # fmt: skip
        """One step over every bucket, of the parameters that have a gradient (see
        ``coconet.optim.stepping``). With ``ddp=``, the update already happened during
        ``backward()`` (DDP's communication hook ran it, bucket by bucket): only ``closure``
        runs (a closure that calls ``backward()`` triggers the update itself).
        ``grad_scaler``: given by ``torch.amp.GradScaler.step(opt)``: the gradients are
        unscaled inside the step and a step whose averaged gradient holds an inf or a nan is
        skipped on every rank (``coconet.optim.scaling``). Traced as one span
        (``coconet.tracing``) holding its buckets' compiled steps."""
        with tracing.span(type(self).__name__, Category.OPTIMIZER, "step"):
            return self._step(closure, grad_scaler)

    def _step(self, closure: Callable[[], Any] | None, grad_scaler: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.sharded is not None:  # (coconet.optim.sharded: the blocks step in the backward)
            self.sharded.step(grad_scaler)
            return loss
        scaling = Scaling.begin(grad_scaler, self)
        if self.ddp is not None:
            return loss
        if scaling is None:
            warn_unscaled(self)
        watch = self.watch
        for b in self.buckets:
            b.sync_master()  # 16-bit parameters written in place since the last step
        changed = watch.changed()
        if changed:
            watch.take_in(changed)
        watch.look_for_wrapper(bool(changed))
        watch.warn_local_edits()
        problems: list[str] = []
        masks = [watch.local_grads(b, problems) for b in self.buckets]
        watch.frozen_problems(problems)
        # Once a bucket starts to commit, a Ctrl-C waits until the whole step is applied (every
        # bucket, the step counts): coconet.runtime.interrupts
        name = type(self).__name__
        outcome = [f"coconet.optim.{name}: the step was not applied on any rank"]
        with interrupts.span(lambda: outcome[0]):
            try:
                if self.comm.world == 1 or not len(self.buckets):
                    # nobody to agree with (no bucket: no collective either, so a refusal stays
                    # local)
                    watch.refuse(problems, problems)
                    skipped = self.stepper.step_buckets(masks, None, scaling)
                else:
                    skipped = self.stepper.step_agreeing(masks, problems, scaling)
            except RuntimeFault as fault:
                # which call of this rank's met the peer's failure or departure (the peer's
                # own words say where it stopped)
                fault.details = (*fault.details, f"this rank was making its "
                                 f"{self._progress_key} number {self.agreement.steps_done + 1}")
                raise
            self.agreement.steps_done += 1
            self.comm.progress[self._progress_key] = self.agreement.steps_done
            for b in self.buckets:
                b.seen[:] = [b.grad._version, False]
                b.mark_written()  # (the step's own writes: a host replica re-points .data)
            if scaling is not None:
                scaling.finish(self, skipped)
            if skipped:
                outcome[0] = (f"coconet.optim.{name}: the step was skipped on every rank (an "
                              "inf or nan in the gradient, GradScaler's found_inf)")
                return loss
            self.after_step()
            outcome[0] = (f"coconet.optim.{name}: the step was applied on every rank before "
                          "this was raised: do not repeat it")
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets; every ``.grad`` stays a view of its bucket (with
        ``set_to_none`` the parameters count as without a gradient, as torch's ``None``).
        With ``ddp=``, torch's ``zero_grad`` (DDP owns the gradient buffers)."""
        if self.ddp is not None or self.sharded is not None:  # (fsdp: the backward's own)
            return super().zero_grad(set_to_none)
        self.watch.zero_grads(set_to_none)

    # -- checkpoints ----------------------------------------------------------------------------

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's slices of the state with their offsets, no communication (see
        ``coconet.optim.checkpoint``: when to use it rather than ``state_dict``)."""
        if self.sharded is not None:
            return self.sharded.sharded_state_dict()
        for b in self.buckets:
            b.sync_master()
        groups, index = state.packed_groups(self.param_groups)
        return checkpoint.sharded_state_dict(self, groups, index)

    def state_dict(self) -> dict[str, Any]:
        """torch's format (``{'state': {index: {...}}, 'param_groups': [...]}``), whole tensors
        gathered from every rank's slice: collective, the same on every rank, and loadable into
        the torch optimizer or into this one at any world size. Runs the state-dict hooks as
        torch does (pre-hooks first; a post-hook's result replaces the state dict)."""
        self.agree_call(CallKind.STATE_DICT)  # every rank calls it now (not a step)
        for b in self.buckets:
            b.sync_master()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        # (fully sharded parameters: gathered from coconet.optim.sharded's segments)
        state_dict = (state.torch_state(self) if self.sharded is None
                      else self.sharded.state_dict())  # fmt: skip
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

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
        if self.sharded is not None:  # (fully sharded parameters: coconet.optim.sharded's)
            self.sharded.load_state_dict(state_dict)
        else:
            checkpoint.load(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

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


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
