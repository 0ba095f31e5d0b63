"""The check that a parallelized model's replicated parameters still agree across its group.

A tensor-parallel model holds two kinds of parameters: the layers' parts (``ShardedParameter``:
each rank its own) and everything else, which every rank of the group holds whole and must keep
bitwise equal (LayerNorms, embeddings, a row-parallel layer's bias). Nothing in the forward
pass would notice if they drifted apart (a clip by a per-rank norm, a rank that loaded another
checkpoint, a dropout drawn differently): each rank would go on training its own replica, and
the model would be silently wrong.

``ReplicaCheck`` makes such a drift an error at the next training forward: a strided sample of
each replicated parameter (at most ``SAMPLE`` elements, the same positions on every rank) is
hashed into one digest, carried in the agreement that the first ``coconet.nn`` layer call of
the forward makes anyway (no collective of its own). Ranks that differ fail together, before
anything moves, with a ``ConfigError`` naming the first parameter that differs (the ranks then
exchange one digest per parameter). A drift changes nearly every element (it comes from a
different factor, a different update), so a sample catches it; a single element flipped alone
would go unseen. Eval-mode forwards (decoding) are not checked: they change nothing.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from coconet.errors import ConfigError, RuntimeFault
from coconet.runtime.handshake import CallRefused

__all__ = ["SAMPLE", "ReplicaCheck"]

SAMPLE = 64  # elements sampled per replicated parameter
KEY = "coconet.nn: the replicated parameters (a sample)"


class ReplicaCheck:
    """The replicated parameters of a model parallelized over ``comm`` (its layers' group),
    checked at each training forward (see the module docstring)."""

    def __init__(self, comm: Any, params: list[tuple[str, nn.Parameter]]) -> None:
        self.comm = comm
        self.params = params
        self._armed = False
        self.checks = 0  # forwards checked (tests and benchmarks read it)
        self._views: list[torch.Tensor] = []  # each parameter's sample (a strided view)
        self._where: list[int] | None = None  # the parameters' data pointers when sampled

    def arm(self, module: nn.Module, args: Any) -> None:
        """The model's forward pre-hook: the next layer call carries the digest."""
        self._armed = module.training and bool(self.params) and self.comm is not None

    def take(self) -> dict[str, str] | None:
        """What the next layer call adds to its agreement (once per armed forward)."""
        if not self._armed:
            return None
        self._armed = False
        self.checks += 1
        return {KEY: self.digest()}

    def _samples(self) -> list[torch.Tensor]:
        """Each parameter's sample, as views kept from one check to the next (an update in
        place shows through them; a parameter re-pointed is sampled anew). A fully sharded
        parameter (``coconet.fsdp``: its values are there only while its block is gathered)
        is sampled in this rank's stored part of it, which the tp ranks of one data-parallel
        index hold alike."""
        sources = [_stored(p) for _, p in self.params]
        where = [s.data_ptr() for s in sources]
        if where != getattr(self, "_where", None):
            views = []
            for flat in sources:
                stride = max(1, flat.numel() // SAMPLE)
                views.append(flat[::stride][:SAMPLE])
            self._views, self._where = views, where
        return self._views

    def digest(self) -> str:
        if not self.params:
            return ""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for v in self._samples():
            by_dtype.setdefault(v.dtype, []).append(v)
        h = hashlib.blake2b(digest_size=8)
        with torch.no_grad():
            for views in by_dtype.values():  # one gather of every sample of a dtype (strided)
                h.update(torch.cat(views).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def explain(self, fault: RuntimeFault, op: str) -> ConfigError | None:
        """The error every rank raises when the fault of a layer call is this check's (the
        ranks' digests differ), None otherwise: the ranks exchange one digest per parameter
        and name the first that differs (collective: every rank got the same fault)."""
        if not isinstance(fault, CallRefused) or not fault.differs(KEY):
            return None
        mine = [hashlib.blake2b(v.contiguous().view(torch.uint8).numpy().tobytes(),
                                digest_size=8).hexdigest() for v in self._samples()]
        every = self.comm.exchange(mine, "coconet.nn: the replicated parameters, one by one")
        for j, (name, p) in enumerate(self.params):
            differ = [r for r, digests in enumerate(every) if digests[j] != every[0][j]]
            if differ:
                return ConfigError(
                    f"the replicated parameter {name!r} (shape {tuple(p.shape)}) differs between "
                    f"the ranks of the group: rank {differ[0]}'s is not rank 0's",
                    op=op,
                    details=[f"ranks whose sample differs from rank 0's: {differ}",
                             f"the group: the job's ranks {list(self.comm.members)}"],
                    hint="every rank of a tensor-parallel group must update the parameters it "
                    "holds whole alike: clip by the global norm (torch's clip_grad_norm_ on the "
                    "parallelized model, or coconet.optim's max_grad_norm=), load the same "
                    "checkpoint on every rank, seed torch alike (dropout); nothing was computed",
                )  # fmt: skip
        return None

    def __deepcopy__(self, memo: dict) -> ReplicaCheck:
        # a copy of the model (an EMA model) is not checked: its hook holds an inert check
        return ReplicaCheck(None, [])

    def __reduce__(self) -> Any:
        return (ReplicaCheck, (None, []))  # saved without the group (coconet.nn.attach)


def _stored(p: nn.Parameter) -> torch.Tensor:
    """What this rank holds of ``p`` for good, flattened: its values, or its stored part of a
    fully sharded parameter (the block it belongs to says which)."""
    block = getattr(p, "_coconet_fsdp_block", None)
    return p.detach().reshape(-1) if block is None else block.stored_part(p)
