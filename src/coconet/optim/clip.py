"""Gradient clipping (``max_grad_norm=``): torch's ``clip_grad_norm_`` of the *averaged*
gradient over every parameter the optimizer holds, inside the step.

A step's ``ClipPlan`` is decided once, at its start, from what the last step did:

- **In the bucket** (one bucket, an optimizer that may clip inside its step): its fused step is
  speculative (``Clip.SPECULATIVE``): one pass computes the update unclipped and, alongside it,
  the norm (the squares of this rank's slice after the reduce_scatter, one scalar all_reduce);
  the update is committed when the factor is 1 (clipping would not change it: the same bits as
  clipping by 1) and otherwise declined (nothing written) and the step runs again given the
  factor (``Clip.GIVEN``). After a step that clipped, the next computes the norm first and
  clips before the update in one step (``Clip.IN_STEP``: two passes, none wasted), until a
  step does not clip.
- **A lead** (several buckets: the global norm needs every bucket's gradient before any bucket
  is updated): the largest bucket speculates. A norm pass (``programs.grad_norm_pass``, which
  commits nothing) runs over the others only, then the lead's speculative step, whose own norm
  joins theirs (committed when the factor of the whole norm is 1, else declined and run again
  given it), then the others given that factor.
- **The factor first**: after a step that clipped, or for an optimizer whose factor is not
  torch's (LAMB's), or when some buckets hold parts of tensors split over other ranks (their
  squares are summed over that group: one exact round): a norm pass over every bucket, the
  factor computed here as torch computes it, each bucket given it.

Every bucket keeps its compiled forms by clip mode (``Bucket.forms``): nothing is swapped.

**A ``GradScaler``'s check** (``coconet.optim.scaling``: the step must be skipped on every rank
when the averaged gradient holds an inf or a nan) rides on the same norm, computed before any
update commits: with clipping, a non-finite norm skips the step instead of clipping by nan;
without, the step's plan is ``PlanKind.CHECK``, the speculative way without a factor (the
largest bucket's update with its norm alongside, committed when the norm is finite; the other
buckets' norm first, in one pass, when there are several; with parts of tensors split over
other ranks, the norm over every axis first). A skipped step commits nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from coconet.compiler import compile as coconet_compile
from coconet.ir.types import DType
from coconet.optim import programs
from coconet.optim.buckets import Bucket, Buckets
from coconet.optim.programs import Clip
from coconet.options import CompileOptions

__all__ = ["ClipPlan", "Clipper", "PlanKind"]


class PlanKind(enum.Enum):
    """How a step clips (the module docstring)."""

    OFF = "off"  # no max_grad_norm=
    IN_BUCKET = "in the bucket"  # the only bucket clips inside its own step
    LEAD = "a lead speculates"  # the largest bucket speculates after the others' norm
    FACTOR_FIRST = "the factor first"  # a norm pass over every bucket, the factor given
    # no clipping, a GradScaler's check: the lead's update committed when the norm is finite
    CHECK = "the norm checked"


@dataclass
class ClipPlan:
    """One step's clipping: decided at its start (``Clipper.plan``), the factor filled in once
    it is known (the norm pass's, or the lead's step's)."""

    kind: PlanKind
    lead: Bucket | None = None
    rest: torch.Tensor | None = None  # LEAD: the norm of every bucket but the lead
    norm: torch.Tensor | None = None  # the global norm, once known
    coef: torch.Tensor | None = None  # the factor, once known
    check: bool = False  # a GradScaler's: a non-finite norm skips the step
    skip: bool = False  # the step is skipped on every rank (an inf or nan in the gradient)

    def scalars(self) -> dict[str, Any]:
        """The clipping scalar a bucket given the factor takes (none before it is known)."""
        return {} if self.coef is None else {"clip_coef": self.coef}


# A bucket's step run by the caller: (bucket, compiled step, scalars, agree, commit_if) -> outputs
Run = Callable[..., dict[str, torch.Tensor]]


class Clipper:
    """An optimizer's clipping room: ``max_norm`` (None: off), its compiled norm passes, and
    the buckets' ways of clipping. ``factor``: the optimizer's ``clip_factor`` (norm -> the
    factor); ``in_step``: whether a bucket may compute the norm and torch's factor itself."""

    def __init__(self, max_norm: float | None, comm: Any, options: CompileOptions,
                 factor: Callable[[torch.Tensor], torch.Tensor], in_step: bool
                 ) -> None:  # fmt: skip
        self.max_norm, self.comm, self.options = max_norm, comm, options
        self.factor, self.in_step = factor, in_step
        # the compiled norm passes, by the ids of the buckets each runs over
        self.norm_passes: dict[tuple[int, ...], Any] = {}
        # the global norm of the averaged gradient at the last step, as clip_grad_norm_ returns
        # it; the factor the averaged gradient was multiplied by (None: not clipped)
        self.last_grad_norm: torch.Tensor | None = None
        self.last_clip_coef: torch.Tensor | None = None
        # this step's factor of the gradient's scale (a GradScaler's 1 / scale; 1 otherwise):
        # the norm passes compute the norm of the unscaled average, as the steps update with it
        self.unscale = 1.0

    # -- the buckets' ways of clipping ----------------------------------------------------------

    def mode_of_new_bucket(self, buckets: Buckets) -> Clip:
        """How a bucket made now clips: inside its own step while it is the only bucket, given
        the factor otherwise (``settle`` turns a first bucket's way when a second comes)."""
        if self.max_norm is None:
            return Clip.OFF
        return Clip.SPECULATIVE if not len(buckets) and self.in_step else Clip.GIVEN

    def lead_of(self, buckets: Buckets) -> Bucket | None:
        """The bucket that speculates with several buckets: the largest (the first of equals),
        where the optimizer computes the norm inside its step and no bucket holds parts."""
        if self.max_norm is None or not self.in_step or buckets.has_parts():
            return None
        clipping = [b for b in buckets if b.clip is not Clip.OFF]
        return max(clipping, key=lambda b: b.size) if clipping else None

    def settle(self, buckets: Buckets, compile_form: Callable[[Bucket, Clip], Any]) -> None:
        """The buckets changed: the largest keeps (or gets) the speculative way, every other
        bucket is given the factor (``Clip.GIVEN``); a form a bucket lacks is compiled
        (collective, as adding a group: every rank at the same point; the gradient buffers and
        state stay, the steps only read them)."""
        self.norm_passes.clear()  # over buckets that changed
        if len(buckets) < 2 and not buckets.has_parts():
            return
        lead = self.lead_of(buckets)
        for b in buckets:
            if b.clip is Clip.OFF:
                continue
            b.clip = Clip.SPECULATIVE if b is lead else Clip.GIVEN
            if b.clip not in b.forms:
                b.forms[b.clip] = compile_form(b, b.clip)

    # -- a step ---------------------------------------------------------------------------------

    def plan(self, buckets: Buckets, agree: dict[str, str] | None, check: bool = False
             ) -> tuple[ClipPlan, bool]:  # fmt: skip
        """This step's plan, and whether ``agree`` was used (by a norm pass, which then runs
        first: a step that fails there leaves everything as it was). ``check``: a GradScaler's
        (a non-finite norm skips the step)."""
        plan, used = self._plan(buckets, agree, check)
        plan.check = check
        known = plan.norm if plan.norm is not None else plan.rest  # (a norm pass's, first)
        if check and known is not None and not math.isfinite(float(known)):
            plan.skip = True
            plan.norm = known
        return plan, used

    def _plan(self, buckets: Buckets, agree: dict[str, str] | None, check: bool
              ) -> tuple[ClipPlan, bool]:  # fmt: skip
        if not len(buckets):
            return ClipPlan(PlanKind.OFF), False
        if self.max_norm is None:
            if not check:
                return ClipPlan(PlanKind.OFF), False
            if buckets.has_parts():  # the norm over every axis first
                return ClipPlan(PlanKind.CHECK, norm=self.parts_norm(buckets, agree)), \
                    agree is not None  # fmt: skip
            lead = max(buckets, key=lambda b: b.size)
            if len(buckets) == 1:
                return ClipPlan(PlanKind.CHECK, lead=lead), False
            rest = self.norm_pass([b for b in buckets if b is not lead], agree)
            return ClipPlan(PlanKind.CHECK, lead=lead, rest=rest), agree is not None
        if buckets.has_parts():
            norm = self.parts_norm(buckets, agree)
            return ClipPlan(PlanKind.FACTOR_FIRST, norm=norm, coef=self.factor(norm)), \
                agree is not None  # fmt: skip
        if len(buckets) == 1 and buckets[0].clip is Clip.SPECULATIVE:
            return ClipPlan(PlanKind.IN_BUCKET, lead=buckets[0]), False
        lead = next((b for b in buckets if b.clip is Clip.SPECULATIVE), None)
        if lead is not None and not lead.clipped_last:  # (the same on every rank)
            rest = self.norm_pass([b for b in buckets if b is not lead], agree)
            return ClipPlan(PlanKind.LEAD, lead=lead, rest=rest), agree is not None
        norm = self.norm_pass(list(buckets), agree)
        return ClipPlan(PlanKind.FACTOR_FIRST, norm=norm, coef=self.factor(norm)), \
            agree is not None  # fmt: skip

    def norm_pass(self, buckets: list[Bucket], agree: dict[str, str] | None) -> torch.Tensor:
        """The global norm of the averaged gradient of ``buckets``: one fused reduce_scatter +
        sum of squares per bucket, one scalar all_reduce (``programs.grad_norm_pass``);
        compiled once per set of buckets (collective: every rank steps the same buckets)."""
        if not buckets:  # (a lead alone with parts elsewhere: nothing else to count)
            return torch.zeros((), device=self.comm.device)
        key = tuple(id(b) for b in buckets)
        if key not in self.norm_passes:
            dtypes = tuple(DType.from_torch(b.grad.dtype) for b in buckets)
            reduce = buckets[0].reduce  # (the optimizer's: the same for every bucket)
            program = programs.grad_norm_pass(dtypes, len(buckets), reduce)
            step_fn = coconet_compile(programs.grad_norm_pass_schedule(program),
                                      comm=self.comm, options=self.options)  # fmt: skip
            step_fn.input_sources = {"grad_scale": "the world size"}
            self.norm_passes[key] = step_fn
        inputs: dict[str, Any] = {f"g{j}": b.grad for j, b in enumerate(buckets)}
        inputs["grad_scale"] = self.unscale / self.comm.world
        return self.norm_passes[key].run(inputs, agree=agree)["grad_norm"]

    def parts_norm(self, buckets: Buckets, agree: dict[str, str] | None) -> torch.Tensor:
        """The global norm when some buckets hold parts of tensors split over other ranks (a
        tensor-parallel model stepped over its data-parallel communicator): a parameter counts
        once over every axis it is split along. A norm pass over the buckets of each kind
        (whole tensors; the parts of each group), the parts' squares summed over their group in
        one exact round (the same bits on every rank of it), the whole tensors' counted once
        (they are the same on every rank of the group). Every rank of every group runs the same
        passes in the same order."""
        kinds: dict[tuple, list[Bucket]] = {}
        for b in buckets:
            kinds.setdefault(b.placement.key if b.placement else (), []).append(b)
        total = 0.0
        for members in kinds.values():
            norm = self.norm_pass(members, agree)
            agree = None  # (the first pass carries the step's agreement)
            squares = float(norm.double()) ** 2
            placement = members[0].placement
            if placement is not None:
                every = placement.comm.gather_floats(
                    [squares], "coconet.optim: the squares of the gradient's parts")
                squares = math.fsum(row[0] for row in every)
            total += squares
        return torch.tensor(math.sqrt(total), dtype=torch.float32, device=self.comm.device)

    def run(self, b: Bucket, scalars: dict[str, Any], agree: dict[str, str] | None,
            plan: ClipPlan, run: Run, form: Callable[[Bucket, Clip], Any]
            ) -> dict[str, torch.Tensor]:  # fmt: skip
        """``b``'s step as ``plan`` clips it (``run``: one compiled step over the bucket;
        ``form``: the bucket's step of a clip mode, compiled when first needed); the outputs
        of the step that committed. Fills in the plan's norm and factor when this step is the
        one that finds them, and ``plan.skip`` when a GradScaler's check finds the norm
        non-finite (nothing committed)."""
        if plan.kind is PlanKind.CHECK:
            return self._run_checked(b, scalars, agree, plan, run, form)
        if b.clip is not Clip.SPECULATIVE or plan.kind is PlanKind.FACTOR_FIRST:
            # its own form (off, or given the factor); a speculating bucket given the factor of
            # a norm pass over every bucket (its last step clipped) guesses again from it
            step = b.forms[b.clip] if b.clip is not Clip.SPECULATIVE else form(b, Clip.GIVEN)
            out = run(b, step, {**scalars, **plan.scalars()}, agree)
            if b.clip is Clip.SPECULATIVE:
                b.clipped_last = bool(plan.coef != 1.0)
            self._keep(plan, out)
            return out
        if plan.kind is PlanKind.LEAD:
            return self._run_lead(b, scalars, agree, plan, run, form)
        if b.clipped_last:
            # the last step clipped, so this one likely does: the norm first, then the clipped
            # update, in one step (two passes; a speculative pass would likely be wasted)
            step = form(b, Clip.IN_STEP)
            out = run(b, step, {**scalars, "max_norm": self.max_norm}, agree,
                      self._finite if plan.check else None)  # fmt: skip
            self._keep(plan, out)
            if plan.check and step.last_declined:
                plan.skip = True
                return out
            plan.coef = self.factor(out["grad_norm"])
            b.clipped_last = bool(plan.coef != 1.0)
            return out
        verdict: dict[str, torch.Tensor] = {}

        def unclipped(outputs: dict[str, torch.Tensor]) -> bool:
            # the same norm on every rank (all-reduced in the step), so the same answer
            verdict["coef"] = coef = self.factor(outputs["grad_norm"])
            return bool(coef == 1.0)  # NaN: declined, and clipped by NaN as torch does

        out = run(b, b.forms[Clip.SPECULATIVE], scalars, agree, unclipped)
        self._keep(plan, out)
        if plan.check and not self._finite(out):
            plan.skip = True  # (declined: the factor is nan)
            return out
        b.clipped_last = b.forms[Clip.SPECULATIVE].last_declined  # (every rank declined)
        plan.coef = verdict.get("coef")
        if b.clipped_last:
            # declined on every rank, nothing written: the step again, with the factor
            out = run(b, form(b, Clip.GIVEN), {**scalars, "clip_coef": verdict["coef"]}, None)
        return out

    def _run_lead(self, b: Bucket, scalars: dict[str, Any], agree: dict[str, str] | None,
                  plan: ClipPlan, run: Run, form: Callable[[Bucket, Clip], Any]
                  ) -> dict[str, torch.Tensor]:  # fmt: skip
        """The speculative lead of several buckets: its update unclipped with its own norm
        alongside, committed when the factor of the whole norm (the others' from the norm pass,
        and its own) is 1, else declined and run again with the factor; either way the factor
        is then the other buckets'. A second group of its parameters at another step count
        takes the factor the first decided."""
        if b is not plan.lead or plan.coef is not None:
            out = run(b, form(b, Clip.GIVEN), {**scalars, **plan.scalars()}, agree)
            if b is not plan.lead:
                b.clipped_last = bool(plan.coef != 1.0)
            return out
        verdict: dict[str, torch.Tensor] = {}
        rest = plan.rest

        def unclipped(outputs: dict[str, torch.Tensor]) -> bool:
            # the whole norm from the two all-reduced parts: the same on every rank
            own = outputs["grad_norm"].double()
            norm = torch.sqrt(own * own + rest.double() * rest.double()).to(rest.dtype)
            verdict["norm"], verdict["coef"] = norm, self.factor(norm)
            return bool(verdict["coef"] == 1.0)  # NaN: declined, and clipped by NaN

        out = run(b, b.forms[Clip.SPECULATIVE], scalars, agree, unclipped)
        plan.norm, plan.coef = verdict["norm"], verdict["coef"]
        if plan.check and not math.isfinite(float(plan.norm)):
            plan.skip = True  # (declined: the factor is nan)
            return out
        b.clipped_last = b.forms[Clip.SPECULATIVE].last_declined
        if b.clipped_last:
            out = run(b, form(b, Clip.GIVEN), {**scalars, **plan.scalars()}, None)
        return out

    def _run_checked(self, b: Bucket, scalars: dict[str, Any], agree: dict[str, str] | None,
                     plan: ClipPlan, run: Run, form: Callable[[Bucket, Clip], Any]
                     ) -> dict[str, torch.Tensor]:  # fmt: skip
        """A GradScaler's check without clipping (``PlanKind.CHECK``): the lead's update with
        its norm alongside (the speculative form), committed when the whole norm (its own and
        the others', ``plan.rest``) is finite, else declined and the step skipped; every other
        bucket then its own step (the norm known finite)."""
        if b is not plan.lead:
            return run(b, b.forms[b.clip], scalars, agree)
        rest = plan.rest
        verdict: dict[str, torch.Tensor] = {}

        def finite(outputs: dict[str, torch.Tensor]) -> bool:
            own = outputs["grad_norm"].double()
            total = own * own + (rest.double() ** 2 if rest is not None else 0.0)
            verdict["norm"] = torch.sqrt(total).to(outputs["grad_norm"].dtype)
            return self._finite({"grad_norm": verdict["norm"]})

        step = form(b, Clip.SPECULATIVE)
        out = run(b, step, scalars, agree, finite)
        plan.norm = verdict.get("norm")
        if step.last_declined:
            plan.skip = True
        return out

    @staticmethod
    def _finite(outputs: dict[str, torch.Tensor]) -> bool:
        """Whether a step's norm (``grad_norm``) is finite: a GradScaler's verdict."""
        return math.isfinite(float(outputs["grad_norm"]))

    def lead_skipped(self, plan: ClipPlan) -> None:
        """The lead was not stepped (no gradient for it on any rank: its bucket holds zeros):
        the norm is the others'."""
        plan.norm, plan.coef = plan.rest, self.factor(plan.rest)

    @staticmethod
    def _keep(plan: ClipPlan, out: dict[str, torch.Tensor]) -> None:
        # the norm computed inside a bucket's step (the only bucket); a bucket stepped once per
        # step count computes the same norm each time (the same gradient): the first is kept
        if "grad_norm" in out and plan.norm is None:
            plan.norm = out["grad_norm"]

    def finish(self, plan: ClipPlan, stepped: bool) -> None:
        """After the step: ``last_grad_norm`` and ``last_clip_coef`` from the plan (torch's
        norm of no gradients when nothing was stepped)."""
        self.unscale = 1.0
        self.last_clip_coef = None if plan.skip else plan.coef
        self.last_grad_norm = plan.norm
        if self.max_norm is not None and plan.norm is None:
            self.last_grad_norm = torch.zeros((), device=self.comm.device)
