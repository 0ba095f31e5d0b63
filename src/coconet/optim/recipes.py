"""Recipes: how an optimizer's programs are scheduled and compiled.

The schedule of a bucket's step is the optimizer's ``schedule=``: a named one (``fuse_RS_C_AG``,
the default on several ranks; ``RS_C_AG``; ``AR_C``; ``unscheduled``), a function Program ->
Schedule, or ``"auto"`` (the tuner's choice per program and size class, once). A clipping form
of a step (``Clip``) is never tuned on its own: it takes the recipe of the step without
clipping, so that every form of a bucket slices its state alike. A step of gradients averaged
before it (a DDP wrapper: ``averaged``) communicates nothing and runs as written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coconet import schedule as schedules
from coconet.compiler import compile as coconet_compile
from coconet.errors import ConfigError
from coconet.ir.program import Program
from coconet.optim.buckets import is_sliced
from coconet.optim.programs import Clip
from coconet.options import CompileOptions
from coconet.schedule import Schedule

__all__ = ["CLIP_SOURCES", "Recipes", "same_recipe"]

# what the clipping scalars are made from, as an error naming a differing one says it
CLIP_SOURCES = {
    "max_norm": "max_grad_norm",
    "clip_coef": "max_grad_norm and the gradient's global norm "
    "(clip_coef = min(max_grad_norm / (norm + 1e-6), 1))",
}


class Recipes:
    """An optimizer's schedules and compiled steps (see the module docstring). ``sources``:
    what the user set that each scalar input is made from (errors name it)."""

    def __init__(self, schedule: Any, comm: Any, options: CompileOptions, host_shared: bool,
                 name: str, sources: Mapping[str, str]) -> None:  # fmt: skip
        self.schedule, self.comm, self.options = schedule, comm, options
        self.host_shared, self.name = host_shared, name
        self.sources = {**sources, **CLIP_SOURCES}
        self.tuned: dict[tuple[str, str], Any] = {}  # schedule="auto": (program, size class)

    def compile(self, program: Callable[..., Program], state: tuple[str, ...], total: int,
                clip: Clip, row: int = 0, averaged: bool = False) -> Any:  # fmt: skip
        """The compiled step of a bucket of ``total`` elements (collective): ``program(**kw)``
        builds it (``clip=``, ``rows=``, ``averaged=``: the subclass's ``program`` bound to the
        bucket's group and dtype); ``row``: of equal-sized tensors of ``row`` elements, one per
        row (0: flat)."""
        extra: dict[str, Any] = {"rows": True} if row else {}
        if averaged:
            extra["averaged"] = True
        base = program(**extra)
        form = base if clip is Clip.OFF else program(clip=clip, **extra)
        target = form if averaged else self.target(form, state, total, row, base)
        step_fn = coconet_compile(target, comm=self.comm, options=self.options)
        step_fn.input_sources = self.sources
        return step_fn

    def target(self, program: Program, state: tuple[str, ...], total: int = 0, row: int = 0,
               base: Program | None = None) -> Program | Schedule:  # fmt: skip
        """``program``'s schedule; ``base``: the same step without clipping, when ``program``
        is one of its clipping forms (``"auto"`` tunes ``base`` and gives every form the same
        recipe, see ``tuned_target``)."""
        # A world of one has nothing to fuse the update with: its default is the program as
        # written (one no-op all_reduce instead of a reduce_scatter and an all_gather).
        default = "fuse_RS_C_AG" if self.comm.world > 1 else "unscheduled"
        choice = self.schedule if self.schedule is not None else default
        if callable(choice):
            return choice(program)
        if choice == "auto":
            return self.tuned_target(program, state, total, row, base)
        named = {
            "AR_C": lambda p: schedules.AR_C(p),
            "RS_C_AG": lambda p: schedules.RS_C_AG(p, state=state),
            "fuse_RS_C_AG": lambda p: schedules.fuse_RS_C_AG(p, state=state),
            "unscheduled": lambda p: p,
        }
        if choice not in named:
            raise ConfigError(
                f"unknown schedule {choice!r}",
                op=f"coconet.optim.{self.name}",
                hint=f"one of {', '.join(map(repr, named))}, 'auto', or a function "
                "program -> Schedule",
            )
        return named[choice](program)

    def tuned_target(self, program: Program, state: tuple[str, ...], total: int, row: int = 0,
                     base: Program | None = None) -> Program | Schedule:  # fmt: skip
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
            self.tuned_target(base, state, total, row)  # tuned once per size class, then cached
            chosen = self.tuned[(base.digest(), tuning_bucket(total * 4))].winner
            return same_recipe(program, state, chosen, self.name)
        key = (program.digest(), tuning_bucket(total * 4))
        if key not in self.tuned:
            self.tuned[key] = tune(
                program,
                self.comm,
                # a bucket of rows: K tensors of N (at least one per rank, tensor_buckets)
                {"K": total // row, "N": row} if row else {"N": max(total, self.comm.world)},
                options=self.options,
                state=state,
                transports=[self.comm.transport_of(None)],
                top=2,
                reps=5,
                fix_algorithms=False,
                replicas=("p",) if self.host_shared else (),
            )
        return self.tuned[key].winner.target

    @property
    def tuning(self) -> list[Any]:
        """With ``schedule="auto"``: the ``TuneResult`` of each size class tuned."""
        return list(self.tuned.values())


def same_recipe(program: Program, state: tuple[str, ...], chosen: Any, name: str
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
    sliced = {n for n in state if is_sliced(chosen.scheduled, n)}
    alike = [c for c in candidates if {n for n in state if is_sliced(c.scheduled, n)} == sliced]
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
