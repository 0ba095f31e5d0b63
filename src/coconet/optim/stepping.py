"""A step over every bucket: who has a gradient, which step count each parameter is at, and
how a failure leaves the buckets.

- **Parameters without a gradient are skipped, as torch skips them**: no update, no weight
  decay, no change of their state or step count. Over several ranks a parameter is stepped
  when any rank has a gradient for it (the others count zero, as DDP's
  ``find_unused_parameters``). The ranks compare which parameters have a gradient inside the
  first collective step's own agreement (no extra collective); only when they differ do they
  exchange it (and the step is run again).
- **Step counts are per parameter** (torch's bias corrections are): a bucket whose parameters
  all have a gradient and one step count runs one fused step (the common case); otherwise the
  parameters are grouped by the scalars of their step and each group runs the fused step over
  the whole bucket, the others' values put back after it: the same arithmetic per element, one
  fused step per distinct step count. A failure there puts the bucket back as it was.
- **Clipping** is the step's ``ClipPlan`` (``coconet.optim.clip``), decided at its start.
"""

from __future__ import annotations

from typing import Any

import torch

from coconet.errors import CoconetError
from coconet.optim import agreement
from coconet.optim.agreement import CALL_KEY, GRADIENTS_KEY, CallKind
from coconet.optim.buckets import Bucket
from coconet.optim.clip import ClipPlan, PlanKind
from coconet.optim.scaling import Scaling
from coconet.runtime.handshake import CallRefused

__all__ = ["Stepper"]



class Stepper:
    """Runs an optimizer's steps over its buckets (see the module docstring); ``opt``: the
    optimizer, through its public surface."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def step_agreeing(self, masks: list[list[bool]], problems: list[str],
                      scaling: Scaling | None = None) -> bool:  # fmt: skip
        """The buckets' steps on several ranks, which must agree on which parameters have a
        gradient. The first collective step compares a digest of it in its own start-of-step
        agreement; when the ranks differ (a parameter with a gradient on some ranks only, or a
        gradient a rank refuses), that step fails on every rank before anything moves (a
        ``CallRefused``, whose agreed values say what differed), and the ranks exchange what
        they have: a parameter with a gradient on any rank is stepped, a refusal anywhere fails
        every rank."""
        opt = self.opt
        # Which packed parameters do not require grad now: frozen on every rank it is torch's
        # case (no gradient, skipped); frozen on some ranks only, refused (the ranks differ on
        # what they train). Compared with the masks, at no extra cost.
        frozen = [(j, i) for j, b in enumerate(opt.buckets)
                  for i, p in enumerate(b.params) if not p.requires_grad]
        mine = agreement.masks_digest(masks, problems, opt.comm.rank, frozen)
        # which call this is (a peer may be making another: a step with a GradScaler and one
        # without differ too), with the step's agreement
        call = opt.agreement.text(CallKind.STEP, "GradScaler" if scaling else "")
        try:
            return self.step_buckets(masks, {GRADIENTS_KEY: mine, CALL_KEY: call}, scaling)
        except CallRefused as refused:
            # a peer made another call, or over other parameters: the error that names it
            opt.agreement.raise_if_calls_differ(refused, CallKind.STEP)
            if not refused.differs(GRADIENTS_KEY):
                raise  # another difference: as it is
        every = opt.comm.exchange((masks, problems, frozen), GRADIENTS_KEY)
        opt.watch.refuse(problems, [p for _, theirs, _ in every for p in theirs])
        opt.watch.refuse_frozen([f for _, _, f in every])
        masks = [[any(r[j][i] for r, _, _ in every) for i in range(len(m))]
                 for j, m in enumerate(masks)]
        digest = agreement.masks_digest(masks, [], 0, frozen)
        return self.step_buckets(masks, {GRADIENTS_KEY: digest, CALL_KEY: call}, scaling)

    def step_buckets(self, masks: list[list[bool]], agree: dict[str, str] | None,
                     scaling: Scaling | None = None) -> bool:  # fmt: skip
        """Each bucket's step; ``agree`` goes with the first collective step: the norm pass
        when it runs, else the first bucket's first fused step. With clipping the norm pass runs
        before any update (it commits nothing), so a step that fails there or in the agreement
        leaves everything as it was. ``scaling``: a GradScaler's (``coconet.optim.scaling``).
        Returns whether the step was skipped (its check found an inf or a nan: nothing
        committed on any rank)."""
        opt = self.opt
        clipper = opt.clipper
        plan = ClipPlan(PlanKind.OFF)
        done: list[Bucket] = []
        clipper.unscale = scaling.unscale if scaling is not None else 1.0
        try:
            plan, used = clipper.plan(opt.buckets, agree, check=scaling is not None)
            if used:
                agree = None
            order = list(zip(opt.buckets, masks, strict=True))
            if plan.kind in (PlanKind.LEAD, PlanKind.CHECK):
                # the speculative lead first: its step gives the factor the others take
                order.sort(key=lambda pair: pair[0] is not plan.lead)
            for j, (b, mask) in enumerate(order):
                if plan.skip:
                    break
                self.step_bucket(b, mask, agree if j == 0 else None, plan)
                if plan.skip:
                    break  # (the lead declined: nothing was committed)
                done.append(b)
                if b is plan.lead and plan.kind is PlanKind.LEAD and plan.coef is None:
                    clipper.lead_skipped(plan)
        except CoconetError as e:
            if done:
                # A bucket commits on its own: a failure in a later one (a peer died, a timeout)
                # leaves the earlier ones stepped, on every rank that got as far. Said, so that
                # nobody saves this state as if it were a step's.
                later = [b for b, _ in order if b not in done]
                e.details = (*e.details, f"this step had already been applied to "
                             f"{_buckets_of(done, opt.param_groups)} (on every rank that got "
                             f"that far) and not to {_buckets_of(later, opt.param_groups)}: the "
                             "parameters are partly a step ahead; restore them from a checkpoint, "
                             "do not save them")  # fmt: skip
            raise  # a compiled step's own: it told the peers already, or they all refused
        except BaseException as e:
            # Between two compiled steps (after the norm pass, between buckets) only this code
            # runs: an error or a Ctrl-C here must reach the peers, waiting in the next step's
            # agreement, at once rather than at their timeout (a compiled step that failed
            # aborted already: this is then a no-op).
            if opt.comm.world > 1:
                opt.comm.abort(f"rank {opt.comm.rank} failed in coconet.optim."
                               f"{type(opt).__name__}.step: {agreement.first_line(e)}")
            raise
        finally:
            clipper.finish(plan, stepped=True)
        return plan.skip

    def step_bucket(self, b: Bucket, mask: list[bool], agree: dict[str, str] | None,
                    plan: ClipPlan) -> None:  # fmt: skip
        """Step ``b``'s parameters that have a gradient, each at its own step count."""
        opt = self.opt
        group = opt.param_groups[b.group]
        steps = opt.next_steps(b)
        every = list(range(len(b.params)))
        opt.before_bucket(b)
        if all(mask) and steps.count(steps[0]) == len(steps):  # the common case: one fused step
            out = self.run(b, opt.scalars(group, steps[0]), agree, plan)
            if plan.skip:
                return
            b.steps[:] = [s + 1 for s in b.steps]
            opt.after_bucket(b, out, every)
            return
        # parameters grouped by the scalars of their step (SGD's are the same after the first)
        groups: dict[tuple, tuple[dict[str, float], list[int]]] = {}
        of_step: dict[int, tuple[tuple, dict[str, float]]] = {}
        for i, has in enumerate(mask):
            if not has:
                continue
            if steps[i] not in of_step:
                s = opt.scalars(group, steps[i])
                of_step[steps[i]] = (tuple(sorted(s.items())), s)
            key, s = of_step[steps[i]]
            groups.setdefault(key, (s, []))[1].append(i)
        if not groups and agree is None:
            return
        if not groups:
            # nothing to step here, but this step carries the ranks' agreement (a peer may have
            # gradients here): run it and keep nothing
            self.run_some(b, [(opt.scalars(group, steps[0]), [])], agree, plan)
            return
        if len(groups) == 1 and all(mask):  # one step count's scalars after all (SGD)
            out = self.run(b, next(iter(groups.values()))[0], agree, plan)
            if plan.skip:
                return
            opt.after_bucket(b, out, every)
        else:
            self.run_some(b, list(groups.values()), agree, plan)
            if plan.skip:
                return
        for _, stepped in groups.values():
            for i in stepped:
                b.steps[i] += 1

    def run(self, b: Bucket, scalars: dict[str, float], agree: dict[str, str] | None,
            plan: ClipPlan) -> dict[str, torch.Tensor]:  # fmt: skip
        """One step of ``b``, clipped as ``plan`` says: the outputs of the step that committed."""
        return self.opt.clipper.run(b, scalars, agree, plan, self.run_form,
                                     self.opt.packer.form)

    def run_form(self, b: Bucket, step_fn: Any, scalars: dict[str, Any],
                 agree: dict[str, str] | None, commit_if: Any = None
                 ) -> dict[str, torch.Tensor]:  # fmt: skip
        """One run of the compiled ``step_fn`` over ``b``: its outputs (the updates committed,
        or declined by ``commit_if``)."""
        if b.averaged and "grad_scale" in scalars:  # (the average's sign only: +1, or -1)
            scalars = {**scalars, "grad_scale": scalars["grad_scale"] * self.opt.comm.world}
        if b.round_seed is not None:
            # stochastic rounding's bits: keyed by the bucket and its step (the same on every
            # rank; a step run again, declined or skipped, draws the same)
            scalars = {**scalars, "round_seed": b.round_seed, "round_step": max(b.steps) + 1}
        unscale = self.opt.clipper.unscale  # a GradScaler's 1 / scale (a power of two: exact)
        if unscale != 1.0 and "grad_scale" in scalars:
            scalars = {**scalars, "grad_scale": scalars["grad_scale"] * unscale}
        voters = self.voters()
        if b.replica is None:
            # `flat` is passed as a view: the commit writes a view's values in place rather
            # than handing it new storage, so the parameters (views of it) see the update.
            return step_fn.run({**b.inputs(b.flat[:]), **scalars}, agree=agree,
                               commit_if=commit_if, vote_with=voters)  # fmt: skip
        # A host replica: the commit re-points `flat` at the buffer the step wrote (every rank
        # wrote its slice there); the parameters follow it.
        before = b.flat.data_ptr()
        out = step_fn.run({**b.inputs(b.flat), **scalars}, agree=agree, commit_if=commit_if,
                          vote_with=voters)  # fmt: skip
        if b.flat.data_ptr() != before:
            with torch.no_grad():
                for i, p in enumerate(b.params):
                    start, stop = b.span(i)
                    p.data = b.flat[start:stop].view_as(p)
        return out

    def voters(self) -> Any:
        """Who votes on a bucket's commit: with parts of tensors split over another axis (a
        model tensor-parallel over tp, stepped over dp), every rank of the dp x tp mesh, so that
        a rank of another data-parallel group that failed before its commit keeps this one's
        parts from moving ahead (the step's own vote reaches its dp group only); None: the
        step's ranks. The mesh's communicator is the job's where it is exactly dp x tp (a
        pipeline's stages each step their own: there each dp group votes on its own)."""
        parts = self.opt.buckets.parts_group()
        if parts is None:
            return None
        root = self.opt.comm.root
        return root if root.world == self.opt.comm.world * parts.world else None

    def run_some(self, b: Bucket, groups: list[tuple[dict[str, float], list[int]]],
                 agree: dict[str, str] | None, plan: ClipPlan) -> None:  # fmt: skip
        """The fused step over the whole bucket once per group of ``groups`` (scalars, the
        parameters stepped with them); each group keeps its own parameters' results, everything
        else keeps its values: per element the same arithmetic as the common case. The
        programs are elementwise over the bucket (a norm is a tensor's own: LAMB's buckets hold
        one parameter, or one per row), so a parameter's result does not depend on the
        others'. On a failure the bucket is put back as it was. Host-shared parameters: every
        rank of the host maps them, so each rank saves, restores and writes back only its own
        slice (the one its kernel reads and writes), and the ranks meet once their slices are
        final, before any rank reads the parameters."""
        shared = b.replica is not None
        lo, hi = b.bounds if shared else (0, b.size)
        saved_p = b.flat[lo:hi].clone()
        saved = {name: x.clone() for name, x in b.state.items()}
        out_p = saved_p.clone()
        out = {name: x.clone() for name, x in saved.items()}
        try:
            for k, (scalars, stepped) in enumerate(groups):
                if k:  # the bucket as it was before this step, for the next group
                    b.flat[lo:hi].copy_(saved_p)
                    for name, x in b.state.items():
                        x.copy_(saved[name])
                outputs = self.run(b, scalars, agree if k == 0 else None, plan)
                if plan.skip:  # (declined: nothing written)
                    break
                self.opt.after_bucket(b, outputs, stepped)
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
        if plan.skip:  # the first group's check declined: the bucket as it was
            out_p, out = saved_p, saved
        b.flat[lo:hi].copy_(out_p)
        for name, x in b.state.items():
            x.copy_(out[name])
        if shared:
            self.opt.comm.control.barrier("coconet.optim: host-shared parameters written")


def _buckets_of(buckets: list[Bucket], param_groups: list[dict[str, Any]]) -> str:
    """``the buckets of param group 0 (2 tensors)``, for a message."""
    parts = [f"param group {b.group} ({len(b.params)} tensor{'s' if len(b.params) > 1 else ''}"
             f"{', parts split over another axis' if b.placement is not None else ''})"
             for b in buckets]  # fmt: skip
    return "; ".join(parts) or "nothing"
