"""The optimizer's state as torch shows it: ``opt.state`` (``StateView``), and torch's state
dict format (whole tensors gathered from every rank's slice) saved and loaded.

``opt.state[p]`` reads a parameter's state in torch's keys from its bucket at each access and
writes through to it; ``torch_state`` builds torch's format (collective: every rank gathers);
``check_torch_format`` checks a state dict before anything changes and ``apply_torch_format``
loads what it checked. The sharded format (each rank its slices, no communication) is
``coconet.optim.checkpoint``'s.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from coconet.errors import ConfigError
from coconet.optim import agreement
from coconet.optim.buckets import Bucket, master_values
from coconet.optim.programs import MASTER, MASTER_STATE_KEY

__all__ = ["Entry", "StateView", "TorchLoad", "apply_torch_format", "check_torch_format",
           "packed_groups", "state_digest", "torch_state", "whole", "with_master_weights",
           "write_state"]


@dataclass
class TorchLoad:
    """What loading a state dict in torch's format changes, checked (``check_torch_format``):
    the merged param groups, each bucket's (bucket, saved entries, step counts), and the keys
    that are not parameters."""

    groups: list[dict[str, Any]]
    buckets: list[tuple[Bucket, list, list[int]]]
    others: dict[Any, Any]


def packed_groups(param_groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                               dict[int, int]]:  # fmt: skip
    """param_groups as torch saves them (parameters as indices), and the index of each."""
    index: dict[int, int] = {}
    groups = []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        ids = []
        for p in g["params"]:
            index.setdefault(id(p), len(index))
            ids.append(index[id(p)])
        packed["params"] = ids
        groups.append(packed)
    return groups, index


def whole(comm: Any, b: Bucket, name: str) -> torch.Tensor:
    """State ``name`` of ``b`` whole (gathered from every rank's slice: collective)."""
    x = b.state[name]
    if b.stores_whole(name):
        return x
    bounds = (b.bounds_of(r, comm.world) for r in range(comm.world))
    parts = [hi - lo for lo, hi in bounds]
    work = comm.all_gather_start(x, dim=0, parts=parts, axis=None, label=f"state {name}")
    return comm.wait(work)


def torch_state(opt: Any) -> dict[str, Any]:
    """``opt``'s state dict in torch's format (``{'state': {index: {...}}, 'param_groups':
    [...]}``), whole tensors gathered from every rank's slice: collective, the same on every
    rank, loadable into the torch optimizer or into a coconet one at any world size."""
    groups, index = packed_groups(opt.param_groups)
    state: dict[Any, dict[str, Any]] = {}
    view = opt.state
    for b in opt.buckets:
        # (the steps are the same on every rank: every rank gathers the same buckets)
        full = {name: whole(opt.comm, b, name) for name in b.names} if any(b.steps) else {}
        for i, p in enumerate(b.params):
            extra = view.extra.get(id(p), {})
            if not b.steps[i] and not extra:
                continue  # as torch: no state before a parameter's first step
            entry: dict[str, Any] = {}
            if b.steps[i]:
                start, stop = b.span(i)
                entry = opt.step_state(b.steps[i])
                for name, key in b.names.items():
                    # (state in its own dtype: float32 moments of 16-bit parameters, as
                    # torch's load_state_dict casts them to the parameter's dtype)
                    entry[key] = full[name][start:stop].view(p.shape).clone()
            state[index[id(p)]] = {**entry, **extra}
    for p in (q for g in opt.param_groups for q in g["params"]):
        if opt.buckets.find(p) is None and view.extra.get(id(p)):
            state[index[id(p)]] = dict(view.extra[id(p)])  # never stepped: kept as given
    state.update(view.other)  # keys that are not parameters, as torch saves them
    return {"state": state, "param_groups": groups}


def check_torch_format(opt: Any, state_dict: dict[str, Any]) -> TorchLoad:
    """What loading torch's format changes (the merged groups, each bucket's saved state and
    steps), every tensor's shape and every parameter checked first: a ``ConfigError`` and
    nothing changed when anything does not fit."""
    where = f"coconet.optim.{type(opt).__name__}.load_state_dict"
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise ConfigError(
            f"the state dict has {len(groups) if isinstance(groups, list) else 'no'} param "
            f"groups, this optimizer {len(opt.param_groups)}",
            op=where,
            hint="load a checkpoint of an optimizer built over the same param groups",
        )
    for mine, theirs in zip(opt.param_groups, groups, strict=True):
        if len(mine["params"]) != len(theirs["params"]):
            raise ConfigError(
                f"a param group has {len(theirs['params'])} parameters in the state dict, "
                f"{len(mine['params'])} here",
                op=where,
                hint="load a checkpoint of an optimizer built over the same parameters",
            )
    # the groups as they will be, checked before anything changes
    merged = []
    for j, (mine, theirs) in enumerate(zip(opt.param_groups, groups, strict=True)):
        new = {k: v for k, v in mine.items() if k != "params"}
        new.update(copy.deepcopy({k: v for k, v in theirs.items() if k != "params"}))
        opt.check_group(new, f"param group {j} of the state dict")
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
    params = [p for g in opt.param_groups for p in g["params"]]
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
    for b in opt.buckets:
        saved = [entries.get(mine_ids[id(p)]) for p in b.params]
        for i, (p, e) in enumerate(zip(b.params, saved, strict=True)):
            if e is not None and not isinstance(e, Mapping):
                raise ConfigError(
                    f"the state dict's entry for {b.label(opt.param_groups, i)} is a "
                    f"{type(e).__name__}", op=where,
                    hint="load a checkpoint saved by state_dict()")
            # an entry of a master copy alone (``with_master_weights`` of a parameter that has
            # no state yet) requires nothing more
            state_names = {n: k for n, k in b.names.items() if n != MASTER}
            only_master = e is not None and set(e) <= {MASTER_STATE_KEY}
            missing = [] if e is None or only_master else [
                k for k in opt.required_state(state_names) if k not in e]
            if missing:
                raise ConfigError(
                    f"the state dict's entry for {b.label(opt.param_groups, i)} has no "
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
                        f"the state dict's {key!r} of {b.label(opt.param_groups, i)} is "
                        f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}"
                        f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}; "
                        f"it must be a floating-point tensor of shape {tuple(p.shape)}",
                        op=where,
                        hint="load a checkpoint of an optimizer built over the same "
                        "parameters, in the same order",
                    )
        try:
            steps = [opt.step_of(e) if e is not None and set(e) - {MASTER_STATE_KEY} else 0
                     for e in saved]  # fmt: skip
        except (TypeError, ValueError, KeyError, RuntimeError) as exc:
            raise ConfigError(f"the state dict's step counts cannot be read: {exc}",
                              op=where, hint="load a checkpoint saved by state_dict()") from exc
        loads.append((b, saved, steps))
    return TorchLoad(merged, loads, others)



def apply_torch_format(opt: Any, load: TorchLoad) -> None:
    """Load what ``check_torch_format`` checked (nothing here can refuse)."""
    merged, loads, others = load.groups, load.buckets, load.others
    for mine, new in zip(opt.param_groups, merged, strict=True):
        mine.update(new)
    view = opt.state
    view.other = dict(others)
    view.extra = {}
    for b, saved, steps in loads:
        b.steps[:] = steps
        # the entries' other keys (a Lamb checkpoint's diagnostics, a hook's marks)
        kept = {*b.names.values(), *opt.step_state(1)}
        for p, e in zip(b.params, saved, strict=True):
            extra = {k: v for k, v in (e or {}).items() if k not in kept}
            if extra:
                view.extra[id(p)] = extra
        lo, hi = b.bounds
        for name, key in b.names.items():
            target = b.state[name]
            whole = torch.zeros(b.numel, dtype=target.dtype, device=target.device)
            if name == MASTER:
                # a parameter without a saved master copy (a float32 optimizer's checkpoint,
                # torch's): its master starts from the parameter as it is (widened)
                whole.copy_(b.flat.float())
            for i, e in enumerate(saved):
                if e is not None and e.get(key) is not None:
                    start, stop = b.span(i)
                    whole[start:stop].copy_(e[key].reshape(-1))
            target.copy_(whole if target.numel() == b.numel else whole[lo:hi])



def write_state(opt: Any, b: Bucket, i: int, name: str, value: Any) -> None:
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
            f"opt.state[p][{key!r}] for {b.label(opt.param_groups, i)} must be a floating-point "
            f"tensor of the parameter's shape {tuple(p.shape)} (or of the {size} elements "
            f"this rank holds), got {type(value).__name__} "
            f"{tuple(getattr(value, 'shape', ()))}",
            op=f"coconet.optim.{type(opt).__name__}.state",
            hint="write a tensor like the parameter: opt.state[p][key] = torch.zeros_like(p)",
        )
    flat = value.detach().reshape(-1)
    if value.numel() == p.numel() and size != p.numel():
        start, stop = b.state_range(i)
        flat = flat[start:stop]
    if here is not None:
        b.state[name][here].copy_(flat)
    if not b.steps[i]:
        b.steps[i] = 1  # it has state now (a step count given later replaces this)



class StateView(MutableMapping):
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

    def __init__(self, opt: Any) -> None:
        self._opt = opt
        self.other: dict[Any, Any] = {}  # keys that are not parameters, as torch keeps them
        self.extra: dict[int, dict[str, Any]] = {}  # id(param) -> its keys besides the state

    def _param(self, key: Any) -> bool:
        return isinstance(key, torch.Tensor) and any(
            key is q for g in self._opt.param_groups for q in g["params"])

    def __getitem__(self, key: Any) -> Any:
        found = self._opt.buckets.find(key) if isinstance(key, torch.Tensor) else None
        if found is not None or self._param(key):
            return Entry(self, key, found)
        if key not in self.other:
            self.other[key] = {}  # torch's state is a defaultdict(dict)
        return self.other[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        found = self._opt.buckets.find(key) if isinstance(key, torch.Tensor) else None
        if found is None and not self._param(key):
            self.other[key] = value
            return
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"opt.state[p] takes a mapping of the parameter's state, got "
                f"{type(value).__name__}",
                op=f"coconet.optim.{type(self._opt).__name__}.state",
                hint="opt.state[p] = {'step': torch.tensor(3.0), 'exp_avg': ..., ...}",
            )
        entry = Entry(self, key, found)
        entry.reset()
        for k, v in value.items():
            entry[k] = v

    def __delitem__(self, key: Any) -> None:
        found = self._opt.buckets.find(key) if isinstance(key, torch.Tensor) else None
        if found is None and not self._param(key):
            del self.other[key]
            return
        Entry(self, key, found).reset()

    def _stepped(self) -> list[Any]:
        params = [p for b in self._opt.buckets for p, s in zip(b.params, b.steps, strict=True)
                  if s or self.extra.get(id(p))]
        known = {id(p) for p in params}
        params += [p for g in self._opt.param_groups for p in g["params"]
                   if id(p) not in known and self.extra.get(id(p))]
        return [*params, *self.other]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._stepped())

    def __len__(self) -> int:
        return len(self._stepped())

    def __contains__(self, key: object) -> bool:
        if isinstance(key, torch.Tensor):
            return any(key is p for p in self._stepped())
        return key in self.other

    def __repr__(self) -> str:
        return f"<coconet.optim state of {len(self)} parameters>"


class Entry(MutableMapping):
    """``opt.state[p]``: one parameter's state, read from and written to its bucket."""

    def __init__(self, view: StateView, p: torch.Tensor, found: tuple[Bucket, int] | None
                 ) -> None:  # fmt: skip
        self._view, self._p, self._found = view, p, found
        self._opt = view._opt

    def _extra(self, create: bool = False) -> dict[str, Any]:
        extra = self._view.extra.get(id(self._p))
        if extra is None:
            extra = {}
            if create:
                self._view.extra[id(self._p)] = extra
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
                        entry[key] = x[here].view(b.params[i].shape)
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
            write_state(self._opt, b, i, names[key], value)
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
        self._view.extra.pop(id(self._p), None)
        if self._found is not None:
            b, i = self._found
            for name in b.names:
                here = b.local(name, i)
                if here is not None:
                    if name == MASTER:  # the master copy is the parameter's, not state
                        b.state[name][here].copy_(master_values(b, i))
                    else:
                        b.state[name][here].zero_()
            b.steps[i] = 0



def state_digest(state_dict: dict[str, Any]) -> str:
    """A digest of torch's format as the ranks compare it before loading (the same checkpoint
    on every rank): its groups and every entry, each tensor by shape, dtype and values."""
    h = hashlib.sha256()

    def add(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"T{tuple(v.shape)}{v.dtype}{agreement.values_checksum(v)}".encode())
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


def with_master_weights(state_dict: dict[str, Any], params: Any) -> dict[str, Any]:
    """A copy of ``state_dict`` (torch's format: a ``torch.optim`` optimizer's, or coconet's)
    whose every parameter carries ``weights``' value as its float32 master copy (key
    ``"master_param"``), for an optimizer over the same parameters in 16-bit: loading it starts
    the master copies from the float32 weights rather than from the 16-bit parameters'
    rounding (``opt.load_state_dict(with_master_weights(torch.load("adamw.pt"),
    fp32_model.parameters()))``). ``params``: the float32 parameters, in the order of the state
    dict's param groups (the model's ``parameters()``, as the optimizer was built over them)."""
    where = "coconet.optim.with_master_weights"
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list):
        raise ConfigError("the state dict has no 'param_groups' list", op=where,
                          hint="pass an optimizer's state_dict() (torch's format)")
    ids = [i for g in groups for i in g["params"]]
    weights = [p.detach() if isinstance(p, torch.Tensor) else p for p in params]
    if len(weights) != len(ids) or not all(isinstance(w, torch.Tensor) for w in weights):
        raise ConfigError(
            f"{len(weights)} weights for the state dict's {len(ids)} parameters",
            op=where,
            hint="pass the float32 model's parameters, in the order the optimizer was built "
            "over them: with_master_weights(sd, fp32_model.parameters())",
        )
    out = dict(state_dict)
    entries = {k: dict(v) if isinstance(v, Mapping) else v
               for k, v in state_dict.get("state", {}).items()}  # fmt: skip
    for i, w in zip(ids, weights, strict=True):
        entries.setdefault(i, {})[MASTER_STATE_KEY] = w.to(torch.float32, copy=True)
    out["state"] = entries
    return out
