"""Sharded checkpoints of ``coconet.optim``: each rank its own slice of the state, no gather.

Two forms, and when to use which:

- ``opt.state_dict()``: torch's format, whole tensors gathered from every rank (collective). Use
  it to move between world sizes, into ``torch.optim`` or out of it, and whenever the state fits
  in one process's memory: it is what ``torch.save`` of an optimizer usually holds.
- ``opt.sharded_state_dict()``: this rank's slices only (no communication, 1/world of the memory),
  each with its explicit offsets in its bucket. Use it for large models: each rank saves its own
  file; ``opt.load_state_dict(shard)`` on the same rank of a job of the same world size and
  parameters loads it back without any whole tensor; ``merge_shards([shard_0, ..., shard_n-1])``
  turns a complete set into torch's format (then any world size, or torch, can load it).
"""

from __future__ import annotations

from typing import Any

import torch

from coconet.errors import CoconetError, ConfigError
from coconet.optim import state
from coconet.optim.agreement import CallKind

__all__ = ["FORMAT", "apply_shard", "check_shard", "is_shard", "load", "load_shard",
           "merge_shards", "sharded_state_dict"]

# /2: step counts per parameter ("steps" a list, "extra" one entry per parameter); /1 (one count
# per bucket) is still read.
FORMAT = "coconet.optim.sharded/2"
_FORMATS = ("coconet.optim.sharded/1", FORMAT)


def is_shard(state_dict: dict[str, Any]) -> bool:
    return state_dict.get("format") in _FORMATS


def _per_param(saved: dict[str, Any]) -> tuple[list[int], list[dict[str, Any] | None]]:
    """A saved bucket's step counts and extra entries, one per parameter (either format)."""
    steps, extra = saved["steps"], saved["extra"]
    n = len(saved["params"])
    if isinstance(steps, int):  # format /1: the bucket's parameters were stepped together
        return [steps] * n, [extra if steps else None] * n
    return list(steps), list(extra)


def sharded_state_dict(opt: torch.optim.Optimizer, groups: list[dict], index: dict[int, int]):
    comm = opt.comm
    buckets = []
    for b in opt.buckets:
        lo, hi = b.bounds
        state = {}
        for name, key in b.names.items():
            x = b.state[name]
            whole = b.stores_whole(name)  # a schedule that keeps the state whole (AR_C)
            state[key] = (x[lo:hi] if whole else x).clone()
        buckets.append({
            "params": [index[id(p)] for p in b.params],
            "offsets": list(b.offsets),
            "shapes": [tuple(p.shape) for p in b.params],
            "size": b.numel,
            "start": lo,
            "stop": hi,
            "steps": list(b.steps),
            "extra": [opt.step_state(k) if k else None for k in b.steps],
            "state": state,
        })
    return {
        "format": FORMAT,
        "world": comm.world,
        "rank": comm.rank,
        "param_groups": groups,
        "buckets": buckets,
    }


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """A complete set of ``sharded_state_dict()``s (one per rank, any order) as one state dict
    in torch's format."""
    if not shards or any(not is_shard(s) for s in shards):
        raise ConfigError(
            "merge_shards takes the sharded_state_dict() of every rank",
            op="coconet.optim.merge_shards",
            hint="save opt.sharded_state_dict() on each rank, then merge the list of them",
        )
    world = shards[0]["world"]
    ranks = sorted(s["rank"] for s in shards)
    if ranks != list(range(world)) or any(s["world"] != world for s in shards):
        raise ConfigError(
            f"merge_shards got ranks {ranks} of a {world}-rank job",
            op="coconet.optim.merge_shards",
            hint=f"pass the shards of all {world} ranks",
        )
    by_rank = sorted(shards, key=lambda s: s["rank"])
    state: dict[int, dict[str, Any]] = {}
    for j, first in enumerate(by_rank[0]["buckets"]):
        steps, extras = _per_param(first)
        if not any(steps):
            continue
        pieces = [s["buckets"][j] for s in by_rank]
        whole = {}
        for key in first["state"]:
            flat = torch.empty(first["size"], dtype=first["state"][key].dtype)
            for piece in pieces:
                flat[piece["start"] : piece["stop"]].copy_(piece["state"][key])
            whole[key] = flat
        for i, off, shape, k, extra in zip(first["params"], first["offsets"], first["shapes"],
                                           steps, extras, strict=True):
            if not k:
                continue  # never stepped: no state, as torch
            numel = 1
            for d in shape:
                numel *= d
            entry = {key: (v.clone() if isinstance(v, torch.Tensor) else v)
                     for key, v in (extra or {}).items()}
            for key, flat in whole.items():
                entry[key] = flat[off : off + numel].view(shape).clone()
            state[i] = entry
    return {"state": state, "param_groups": by_rank[0]["param_groups"]}


def load_shard(opt: torch.optim.Optimizer, shard: dict[str, Any]) -> None:
    """This rank's shard back into the same rank of a job like the one that saved it."""
    check_shard(opt, shard)
    apply_shard(opt, shard)


def check_shard(opt: torch.optim.Optimizer, shard: dict[str, Any]) -> None:
    """A ``ConfigError`` when ``shard`` does not fit this rank of ``opt`` (nothing changed)."""
    comm = opt.comm
    name = f"coconet.optim.{type(opt).__name__}.load_state_dict"
    if shard["world"] != comm.world or shard["rank"] != comm.rank:
        raise ConfigError(
            f"this is rank {shard['rank']}'s shard of a {shard['world']}-rank job; this is rank "
            f"{comm.rank} of {comm.world}",
            op=name,
            hint="load each rank's own shard, or merge_shards() the set and load the result "
            "(any world size)",
        )
    if len(shard["buckets"]) != len(opt.buckets) or any(
        saved["size"] != b.numel or saved["offsets"] != b.offsets
        for saved, b in zip(shard["buckets"], opt.buckets, strict=False)
    ):
        raise ConfigError(
            "the shard's buckets do not match this optimizer's parameters",
            op=name,
            hint="build the optimizer over the same parameters and param groups as when saving",
        )
    for b in opt.buckets:
        if any(b.stores_whole(name) for name in b.state) and opt.comm.world > 1:
            # kept whole: the shard has only this rank's slice of it
            raise ConfigError(
                "this schedule keeps the state whole on every rank: a shard cannot restore it",
                op=name,
                hint="use state_dict() / load_state_dict() for this schedule",
            )
    for j, mine in enumerate(opt.param_groups):  # checked before anything changes
        new = {k: v for k, v in mine.items() if k != "params"}
        new.update({k: v for k, v in shard["param_groups"][j].items() if k != "params"})
        opt.check_group(new, f"param group {j} of the shard")
    for saved, b in zip(shard["buckets"], opt.buckets, strict=True):
        for key in b.names.values():
            x = saved["state"].get(key)
            want = b.state[next(n for n, k in b.names.items() if k == key)].shape
            if not isinstance(x, torch.Tensor) or x.shape != want:
                raise ConfigError(
                    f"the shard's {key!r} of a bucket is "
                    f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}, this rank keeps "
                    f"{tuple(want)}",
                    op=name,
                    hint="load each rank's own shard of a job built over the same parameters",
                )


def apply_shard(opt: torch.optim.Optimizer, shard: dict[str, Any]) -> None:
    """Load a shard ``check_shard`` accepted."""
    for mine, theirs in zip(opt.param_groups, shard["param_groups"], strict=True):
        for k, v in theirs.items():
            if k != "params":
                mine[k] = v
    for saved, b in zip(shard["buckets"], opt.buckets, strict=True):
        b.steps[:] = _per_param(saved)[0]
        for prog_name, key in b.names.items():
            b.state[prog_name].copy_(saved["state"][key])


def load(opt: Any, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict`` of torch's format or of a shard, after the pre-hooks.
    Collective: every rank checks all of it before anything changes, then the ranks agree on
    the verdict (and, torch's format, on loading the same state): all load or none."""
    shard = is_shard(state_dict)
    refusal: CoconetError | None = None
    checked = None
    try:
        if shard:
            check_shard(opt, state_dict)
        else:
            checked = state.check_torch_format(opt, state_dict)
    except CoconetError as e:
        refusal = e
    # a shard is this rank's own: only its verdict is compared
    content = ("a shard" if shard or refusal or not opt.agreement.enabled
               else state.state_digest(state_dict))  # fmt: skip
    opt.agree_call(CallKind.LOAD_STATE_DICT, content, refusal)
    if shard:
        apply_shard(opt, state_dict)
    else:
        state.apply_torch_format(opt, checked)
    opt.agreement.refresh(opt.param_groups)
    opt.after_load()
