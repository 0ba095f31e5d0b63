"""What the ranks of a ``coconet.optim`` optimizer agree on, beyond what a compiled step sees:
the call value, its typed mismatch, and ``CallAgreement``, the optimizer's room that makes them.

A compiled step's per-step agreement compares its program, its inputs' shapes and its scalars:
it cannot see which parameter is which (two ``nn.Linear(4, 4)`` passed in another order have the
same shapes), nor which optimizer call a rank is making (a rank calling ``state_dict()`` while
its peer calls ``step()`` would meet it in different collectives and time out). So every
collective call of the optimizer (``step``, ``state_dict``, ``load_state_dict``,
``add_param_group``) first agrees on a **call value**

    kind | optimizer steps done | identity digest | content | this rank's refusal

carried as one more Replicated value of the first bucket's step agreement (``step``: inside the
step's own agreement, no extra collective; the other calls: ``CompiledStep.agree_call``, the
same agreement without the step, so it pairs with a peer's step). Equal values on every rank
cost one hash; a difference gives every rank every rank's value at once, from which each raises
the same ``ConfigError`` naming both calls ("rank 1 called state_dict while rank 0 called
step"), the refusing rank's reason, or the first parameter that differs. Nothing was changed on
any rank when it is raised, and the communicator stays usable.

The **identity** is each param group's parameters (order, names where torch knows them, shapes,
dtypes, requires_grad) and its hyper-parameters: its digest is recomputed when the groups
change (``add_param_group``, ``load_state_dict``), not per step. When a group is added the
parameters' values are compared too (a checksum, once): the optimizer never broadcasts them, so
ranks that start from different values (or pass same-shaped parameters in another order) would
diverge silently.

``detachment`` is the per-step check that a parameter is still the view of the bucket the
optimizer holds (a ``p.data = ...`` makes the model keep values the optimizer no longer updates).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from coconet.errors import CoconetError, ConfigError
from coconet.runtime.handshake import CallRefused

__all__ = ["CALL_KEY", "DETACHED", "DETACHED_HINT", "GRADIENTS_KEY", "Call", "CallAgreement",
           "CallKind", "describe_group", "detachment", "digest", "first_difference",
           "masks_digest", "mismatch_error", "values_checksum"]

# The key under which a call value rides in the step agreement's Replicated values.
CALL_KEY = "coconet.optim: the optimizer call"
# the key under which the ranks compare which parameters have a gradient (``masks_digest``)
GRADIENTS_KEY = "coconet.optim: which parameters have a gradient"
_SEP = "\x1f"  # between a call value's fields (never in a kind, a number or a digest)


class CallKind(enum.Enum):
    """The optimizer's collective calls."""

    STEP = "step"
    STATE_DICT = "state_dict"
    LOAD_STATE_DICT = "load_state_dict"
    ADD_PARAM_GROUP = "add_param_group"
    # before a step: parameters whose .data was replaced, or that require grad since, taken in
    # again (the same on every rank, values included)
    ATTACH = "attach"
    # at a step: the parameters turned out to be wrapped by DDP, which averages the gradients
    WRAPPED = "wrapped"


class Call:
    """One rank's call value (see the module docstring), built and parsed here only."""

    __slots__ = ("kind", "steps", "digest", "content", "refusal")

    def __init__(self, kind: CallKind, steps: int, digest: str, content: str = "",
                 refusal: str = "") -> None:
        self.kind, self.steps, self.digest = kind, steps, digest
        self.content, self.refusal = content, refusal

    def text(self) -> str:
        return _SEP.join((self.kind.value, str(self.steps), self.digest, self.content,
                          self.refusal.replace(_SEP, " ")))

    @classmethod
    def parse(cls, text: str | None) -> Call | None:
        if not text:
            return None
        kind, steps, digest, content, refusal = text.split(_SEP, 4)
        return cls(CallKind(kind), int(steps), digest, content, refusal)

    def said(self) -> str:
        """``called step (after 3 steps)``."""
        done = f"after {self.steps} step{'s' if self.steps != 1 else ''}"
        return f"called {self.kind.value} ({done})"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def values_checksum(p: torch.Tensor) -> str:
    """A checksum of a parameter's values (its bytes), compared once when it is added."""
    x = p.detach()
    if x.numel() == 0:
        return "empty"
    data = x.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()[:12]


def _hyper(group: dict[str, Any]) -> str:
    """A group's hyper-parameters as compared (everything but the parameters and their names)."""
    items = sorted((k, v) for k, v in group.items() if k not in ("params", "param_names"))
    return "; ".join(f"{k}={_plain(v)}" for k, v in items)


def _plain(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor({v.detach().cpu().tolist()!r})" if v.numel() <= 8 else repr(v.shape)
    return repr(v)


def describe_group(group: dict[str, Any], index: int, *, values: bool) -> list[str]:
    """One line per parameter of ``group`` (and one for its hyper-parameters): what the ranks
    compare. ``values``: with a checksum of each parameter's values."""
    names = group.get("param_names") or []
    lines = [f"param group {index}: hyper-parameters {_hyper(group)}"]
    for i, p in enumerate(group["params"]):
        name = f" {names[i]!r}" if i < len(names) else ""
        line = (f"param group {index}, parameter {i}{name}: shape {tuple(p.shape)}, {p.dtype}, "
                f"requires_grad={p.requires_grad}")
        if values:
            line += f", values {values_checksum(p)}"
        lines.append(line)
    return lines


def detachment(p: torch.Tensor, view_ptr: int, dtype: torch.dtype, device: torch.device,
               shape: tuple[int, ...]) -> str | None:
    """Why ``p`` is no longer the view of its bucket the optimizer holds (``view_ptr``: where
    that view starts, with its dtype, device and shape), or None when it still is. What a step
    updates is the bucket: a parameter whose ``.data`` was replaced (``p.data = ...``, a
    ``model.double()`` or ``.to(device)``) keeps values the optimizer no longer sees."""
    if p.dtype != dtype:
        return f"it was cast to {p.dtype} after the optimizer was built (it packed {dtype})"
    if p.device != device:
        return f"it was moved to {p.device} after the optimizer was built (it packed {device})"
    if tuple(p.shape) != shape:
        return f"its .data was replaced by a tensor of shape {tuple(p.shape)} (it packed {shape})"
    if p.numel() and p.data_ptr() != view_ptr:
        return ("its .data was replaced (p.data = ...) after the optimizer was built: it is no "
                "longer a view of the optimizer's bucket, so a step would not reach it")
    return None


# Marks a step's refusal as a detached parameter (see DistributedOptimizer._refuse), not a gradient.
DETACHED = "[detached from the optimizer]"

DETACHED_HINT = (
    "nothing was stepped on any rank. Write new values into a parameter in place "
    "(with torch.no_grad(): p.copy_(new); the torch.nn.init functions do) instead of assigning "
    "p.data, and cast or move the model (model.double(), model.to(...)) or change requires_grad "
    "before building the optimizer; to continue from here, build a new optimizer over the "
    "model's parameters (load_state_dict(old.state_dict()) keeps the state)"
)


def mismatch_error(texts: Sequence[str | None], op: str, hint_refusal: str) -> ConfigError | None:
    """The error every rank raises when the ranks' call values ``texts`` (in rank order) differ,
    or None when they do not differ in anything but the identity digest (the caller names the
    differing parameter: see ``identity_difference``)."""
    calls = [Call.parse(t) for t in texts]
    said = [f"rank {r} {c.said()}" if c else f"rank {r} made no optimizer call (a plain step)"
            for r, c in enumerate(calls)]
    kinds = [c.kind if c else None for c in calls]
    if CallKind.ATTACH in kinds and len(set(kinds)) > 1:
        # some ranks' parameters changed since their last step and the others' did not
        r = kinds.index(CallKind.ATTACH)
        changed = json.loads(calls[r].content)
        same = [q for q, k in enumerate(kinds) if k != CallKind.ATTACH]
        return ConfigError(
            f"the ranks' parameters differ: on rank {r} {changed[0]}, on rank {same[0]} it did "
            "not change since the last step",
            op=op,
            details=[f"rank {r}: {line}" for line in changed[1:4]] + said,
            hint="change a parameter (assign p.data, cast or move the model, unfreeze it) on "
            "every rank alike, as a model wrapped or moved by the same code on every rank is; "
            "nothing was stepped on any rank",
        )
    if CallKind.WRAPPED in kinds and len(set(kinds)) > 1:
        r = kinds.index(CallKind.WRAPPED)
        q = next(q for q, k in enumerate(kinds) if k != CallKind.WRAPPED)
        return ConfigError(
            f"rank {r}'s parameters are wrapped by DistributedDataParallel (it averages the "
            f"gradients) and rank {q}'s are not",
            op=op,
            details=said,
            hint="wrap the model alike on every rank; nothing was stepped on any rank",
        )
    if len(set(kinds)) > 1:
        first = next(r for r, k in enumerate(kinds) if k != kinds[0])
        # the usual way to get here: a checkpoint saved the single-process way, on rank 0 only
        checkpoint = (
            " To save a checkpoint from rank 0: call opt.state_dict() on every rank (it gathers "
            "the state, which is sliced over the ranks) and torch.save it on rank 0 only (what "
            "ZeroRedundancyOptimizer's consolidate_state_dict(to=0) asks too), or save each "
            "rank's opt.sharded_state_dict()."
            if CallKind.STATE_DICT in kinds else ""
        )
        return ConfigError(
            f"the ranks made different collective calls: rank {first} "
            f"{calls[first].said() if calls[first] else 'ran a step'} while rank 0 "
            f"{calls[0].said() if calls[0] else 'ran a step'}",
            op=op,
            details=said,
            hint="every rank must call step(), state_dict(), load_state_dict() and "
            "add_param_group() in the same order (a rank that skipped or repeated step() is a "
            "step behind or ahead); nothing was changed on any rank by this call."
            + checkpoint,
        )
    refusals = [(r, c.refusal) for r, c in enumerate(calls) if c and c.refusal]
    if refusals:
        r, why = refusals[0]
        return ConfigError(
            f"{kinds[0].value} was refused on rank {r}: {why}",
            op=op,
            details=[f"rank {q}: {w}" for q, w in refusals[1:4]]
            + ["nothing was changed on any rank (all ranks or none)"],
            hint=hint_refusal,
        )
    steps = sorted({c.steps for c in calls})
    if len(steps) > 1:
        return ConfigError(
            f"the ranks are at different steps of the optimizer ({', '.join(said)}): a rank "
            "skipped or repeated step()",
            op=op,
            details=said,
            hint="every rank must call step() the same number of times; this job's ranks have "
            "diverged: restart it from a checkpoint",
        )
    contents = [c.content for c in calls]
    if len(set(contents)) > 1:
        diff = first_difference([json.loads(c) if c.startswith("[") else [c] for c in contents])
        what = {CallKind.ADD_PARAM_GROUP: "the ranks hold different parameters",
                CallKind.LOAD_STATE_DICT: "the ranks load different state dicts",
                CallKind.ATTACH: "the ranks changed their parameters differently"}
        return ConfigError(
            f"{what.get(kinds[0], f'the ranks differ in {kinds[0].value}')}: {diff[0]}",
            op=op,
            details=diff[1:],
            hint="every rank must make the same call (the same parameters in the same order, "
            "with the same values and hyper-parameters; the same state dict); nothing was "
            "changed on any rank. Values that differ at construction are usually a seed that "
            "depends on the rank: seed the model's initialisation alike on every rank, or copy "
            "rank 0's weights into it first (what DDP's broadcast does); the optimizer does not "
            "broadcast them, so that two same-shaped parameters passed in another order are "
            "caught",
        )
    return None


def first_difference(lines_by_rank: Sequence[Sequence[str]]) -> list[str]:
    """The first line where the ranks' descriptions differ, as every rank has it."""
    first = lines_by_rank[0]
    for r, lines in enumerate(lines_by_rank[1:], 1):
        for j in range(max(len(first), len(lines))):
            a = first[j] if j < len(first) else "(nothing)"
            b = lines[j] if j < len(lines) else "(nothing)"
            if a != b:
                where = _where(a)
                if where != _where(b):  # a name differs: the whole lines
                    return [f"{where}: rank 0 has {a!r}, rank {r} has {b!r}",
                            f"rank 0: {a}", f"rank {r}: {b}"]
                return [f"{where}: rank 0 has {_what(a)}, rank {r} has {_what(b)}",
                        f"rank 0: {a}", f"rank {r}: {b}"]
    return ["(no difference found in the descriptions)"]


def _where(line: str) -> str:
    return line.split(": ", 1)[0]


def _what(line: str) -> str:
    return line.split(": ", 1)[1] if ": " in line else line


def masks_digest(masks: list[list[bool]], problems: list[str], rank: int,
                 frozen: Sequence[tuple[int, int]] = ()) -> str:  # fmt: skip
    """What the ranks compare at a step (``GRADIENTS_KEY``): which parameters have a gradient,
    the packed parameters frozen since, and a refusal made unique to this rank (so that a
    refusal always reaches the exchange, even when every rank refuses)."""
    text = ";".join("".join("1" if x else "0" for x in m) for m in masks)
    if frozen:
        text += f"|frozen {list(frozen)}"
    if problems:
        text += f"|refused by rank {rank}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's message, on one line: what a refusing rank tells its peers."""
    text = exc.message if isinstance(exc, CoconetError) else str(exc)
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class CallAgreement:
    """An optimizer's side of the call agreement (the module docstring): how many steps it has
    done, its param groups' description and digest (recomputed when they change, not per
    step), and the collective calls it makes. ``name``: the optimizer's, for errors."""

    def __init__(self, comm: Any, name: str, enabled: bool) -> None:
        self.comm, self.name = comm, name
        # a world of one has nobody to disagree with; with ddp= DDP's hook runs the steps
        self.enabled = enabled and comm.world > 1
        self.steps_done = 0
        self.lines: list[str] = []
        self.digest = digest("")

    def refresh(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """The param groups changed (a group added, a state dict loaded, a parameter taken in
        again): their description and digest, carried by every call from now on."""
        self.lines = [line for j, g in enumerate(param_groups)
                      for line in describe_group(g, j, values=False)]  # fmt: skip
        self.digest = digest("\n".join(self.lines))

    def text(self, kind: CallKind, content: str = "", refusal: BaseException | None = None
             ) -> str:  # fmt: skip
        """This rank's call value, as it rides in an agreement."""
        why = "" if refusal is None else first_line(refusal)
        return Call(kind, self.steps_done, self.digest, content, why).text()

    def agree(self, kind: CallKind, first_step: Any, content: str = "",
              refusal: BaseException | None = None) -> None:
        """Every rank makes this same collective call (``kind``, after as many steps, over the
        same param groups, with the same ``content``) and none refused it (``refusal``: this
        rank's reason), else the same ``ConfigError`` on every rank naming the difference.
        Through ``first_step``'s own agreement (the first bucket's compiled step: it pairs with
        a peer's ``step()``), or an exchange when there is no bucket. Raises ``refusal`` itself
        when every rank refused alike."""
        if not self.enabled:
            if refusal is not None:
                raise refusal
            return
        text = self.text(kind, content, refusal)
        if first_step is not None:
            reports = first_step.agree_call({CALL_KEY: text})
            texts = None if reports is None else [r.replicated.get(CALL_KEY) for r in reports]
        else:
            every = self.comm.exchange(text, CALL_KEY)
            texts = None if len(set(every)) == 1 else every
        if texts is not None and len(set(texts)) > 1:
            self.raise_mismatch(texts, kind, refusal)
        if refusal is not None:
            raise refusal

    def raise_mismatch(self, texts: Sequence[str | None], kind: CallKind,
                       refusal: BaseException | None = None) -> None:  # fmt: skip
        """The ranks' call values differ: the same error on every rank (each has every rank's
        values). Only the identity digests differ: the ranks exchange their descriptions (each
        decided so from the same values) to name the first parameter that differs."""
        op = f"coconet.optim.{self.name}.{kind.value}"
        hint = getattr(refusal, "hint", None) or (
            "fix the call on the rank named; nothing was changed on any rank")
        error = mismatch_error(texts, op, hint)
        if error is None:
            every = self.comm.exchange(self.lines, "coconet.optim: param groups")
            diff = first_difference(every)
            error = ConfigError(
                f"the ranks' optimizers hold different parameters: {diff[0]}",
                op=op,
                details=diff[1:],
                hint="build the same model on every rank and pass its parameters to the "
                "optimizer in the same order (named_parameters() names them in errors); "
                "nothing was changed on any rank",
            )
        raise error from refusal

    def raise_if_calls_differ(self, refused: CallRefused, kind: CallKind) -> None:
        """A step refused on every rank: when the ranks made different optimizer calls (or
        over other parameters), the error that names them (a typed look at the agreed values,
        never the message)."""
        if refused.differs(CALL_KEY):
            self.raise_mismatch(refused.values(CALL_KEY), kind)
