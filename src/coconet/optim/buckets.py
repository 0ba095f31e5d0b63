"""Buckets: the parameters an optimizer steps, packed into flat vectors its programs step.

A ``Bucket`` is one param group's parameters of one dtype (and one kind of placement: whole
tensors apart from the parts of tensors split over other ranks), as one flat vector: each
parameter's ``.data`` is a view of the bucket's flat parameter tensor and its ``.grad`` a view of
the bucket's flat gradient, which lives in symmetric memory where the transport has it
(``CompiledStep.input_buffer``). ``backward()`` accumulates straight into it; a step hands the
whole bucket to the program; nothing is copied per step. A bucket keeps a compiled step per way
of clipping it runs (``forms``: its own way, ``clip``, and those a step's clip plan asks for).

``Buckets`` is an optimizer's list of them, with where each parameter is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from coconet.ir.program import Program
from coconet.ir.types import slice_bounds
from coconet.optim import agreement
from coconet.optim.programs import MASTER, Clip
from coconet.runtime.replica import HostReplica
from coconet.runtime.shards import Placement

__all__ = ["ROW_ELEMENTS", "Bucket", "Buckets", "is_sliced", "master_values", "pack",
           "reattach", "tensor_buckets"]

# The largest tensor (elements) of a bucket of rows (``tensor_buckets``): 1 MiB of float32, about
# what a step's fixed cost (~1 ms of agreement, waits and launches) moves at the copy bandwidth;
# a slice of whole rows leaves a rank at most one tensor of this size more than its peer.
ROW_ELEMENTS = 1 << 18


@dataclass(eq=False)  # a bucket is itself: `in` and `==` by identity (its fields are tensors)
class Bucket:
    """One param group's parameters of one dtype, as one flat vector the program steps."""

    group: int  # index into param_groups
    params: list[torch.nn.Parameter]
    offsets: list[int]
    size: int  # elements
    # the compiled steps of this bucket, by how each clips the gradient (max_grad_norm=): its
    # own way (``clip``) and the others a step's clip plan asks for, compiled when first needed
    forms: dict[Clip, Any]
    bounds: tuple[int, int]  # this rank's slice of the bucket (the state it keeps)
    names: dict[str, str]  # state: program input -> torch's state key
    clip: Clip = Clip.OFF  # how this bucket's own step clips (the clip plan's default for it)
    # elements per row of a bucket of equal-sized tensors, one per row (``programs.lamb(
    # rows=True)``; its slices are whole rows); 0: a flat bucket
    row: int = 0
    clipped_last: bool = False  # whether the last step clipped (a speculative bucket's guess)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # program name -> this slice
    # Per parameter: how many times it was stepped (torch's per-parameter ``step``; 0: no state
    # yet, as torch has none before a parameter's first step).
    steps: list[int] = field(default_factory=list)
    # Per parameter: whether it has a gradient (torch's ``p.grad is not None``). The list
    # object is shared with the parameters' post-accumulate-grad hooks: mutate it in place.
    has_grad: list[bool] = field(default_factory=list)
    # the parameters, flat (each param's .data a view of it), and the gradients, flat (symmetric
    # memory where the transport has it; each .grad a view of it)
    flat: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    # with ParamStorage.HOST_SHARED: the host's one copy of the parameters, double-buffered
    # (``flat`` is its live buffer, re-pointed by each step's commit)
    replica: HostReplica | None = None
    # per parameter: its shape when it was packed (what its view of the bucket has)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    # [the gradient buffer's version counter after the last backward() accumulation into it,
    # whether a backward() reached it since the last step or zero_grad]: shared with the
    # post-accumulate-grad hooks (mutated in place), to see a gradient changed in place
    # between backward() and step() (a clip_grad_norm_ of the local gradient)
    seen: list = field(default_factory=lambda: [0, False])
    # parts of tensors split over other ranks (tensor-parallel weights: coconet.runtime.shards),
    # all over one group; None: whole tensors (the same on the ranks of such a group). Their
    # squares count over that group in the global norm (max_grad_norm=).
    placement: Placement | None = None
    # the gradients arrive averaged (a DDP wrapper reduced them): the step communicates nothing
    averaged: bool = False
    # 16-bit parameters: the state holds a float32 master copy of them (``programs.MASTER``,
    # this rank's slice like the rest of the state; in ``names`` as ``programs.MASTER_STATE_KEY``)
    # which the step updates, the parameters its rounding
    master: bool = False
    # the dtype the gradients are reduced in (None: their own)
    reduce: Any = None
    # rounding="stochastic" of 16-bit parameters: the seed of this bucket's random bits (None:
    # rounded to nearest)
    round_seed: int | None = None
    # each parameter's version counter when the master copy last matched it (``sync_master``;
    # a parameter's ``.data`` set to a view keeps a counter of its own, not ``flat``'s)
    written: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.steps:
            self.steps = [0] * len(self.params)
        if not self.has_grad:
            self.has_grad = [False] * len(self.params)
        if not self.shapes:
            self.shapes = [tuple(p.shape) for p in self.params]

    @property
    def step_fn(self) -> Any:
        """The compiled step of this bucket's own way of clipping (``clip``)."""
        return self.forms[self.clip]

    def detached(self) -> set[int]:
        """The parameters no longer attached to this bucket (see ``detachment``): the per-step
        check, kept to what tells (a replaced ``.data`` is a new pointer, whatever its dtype,
        device or shape), ~0.5 us a parameter; ``detachment`` says why for the ones found.
        ``requires_grad`` is not attachment: a packed parameter frozen on every rank is skipped
        as torch skips it."""
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
        return agreement.detachment(self.params[i], start, flat.dtype, flat.device,
                                    self.shapes[i])  # fmt: skip

    @torch.no_grad()
    def sync_master(self) -> None:
        """16-bit parameters written in place since the master copy last matched them (a
        model's ``load_state_dict``, an in-place re-initialisation, on every rank alike): their
        master copy takes the new values wherever a parameter is no longer the master's
        rounding; the master would otherwise overwrite them at the next step. One integer
        compared per parameter (~0.1 us); a pass over a parameter's part of this rank's slice
        only when it was written."""
        if not self.master or self.flat is None:
            return
        versions = [p._version for p in self.params]
        if versions == self.written:
            return
        master = self.state[MASTER]
        for i in range(len(self.params)):
            if i < len(self.written) and versions[i] == self.written[i]:
                continue
            here = self.local(MASTER, i)
            if here is None:
                continue
            lo = self.bounds[0] if master.numel() != self.size else 0
            params = self.flat[here.start + lo : here.stop + lo]
            moved = params != master[here].to(params.dtype)
            if bool(moved.any()):
                master[here][moved] = params[moved].float()
        self.written = versions

    def mark_written(self) -> None:
        """The master copy matches the parameters as they are now (``sync_master``)."""
        if self.master:
            self.written = [p._version for p in self.params]

    def stores_whole(self, name: str) -> bool:
        """Whether state ``name`` is kept whole on every rank (a schedule that does not slice
        it: ``AR_C``, gradients averaged before the step), from the step's program: the same
        answer on every rank. (Not from the size this rank holds: a rank whose slice is the
        whole bucket, its peers' empty, holds as many elements as a whole state.)"""
        return not is_sliced(self.step_fn.program, name)

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

    def state_range(self, i: int) -> tuple[int, int]:
        """The elements of parameter ``i`` (flattened) whose state this rank holds."""
        start, stop = self.span(i)
        name = next(iter(self.state), None)
        if name is None or self.state[name].numel() == self.size:
            return 0, stop - start
        lo, hi = self.bounds
        a, z = max(start, lo), min(stop, hi)
        return (a - start, z - start) if a < z else (0, 0)

    def label(self, param_groups: list[dict[str, Any]], i: int) -> str:
        """``param group 0, parameter 2 ('fc.weight', shape (4, 4))``, for errors."""
        group = param_groups[self.group]
        p = self.params[i]
        j = next((k for k, q in enumerate(group["params"]) if q is p), i)
        names = group.get("param_names") or []
        name = f"{names[j]!r}, " if j < len(names) else ""
        return f"param group {self.group}, parameter {j} ({name}shape {self.shapes[i]})"


class Buckets:
    """An optimizer's buckets, in the order every rank made them, and where each parameter is
    (rebuilt when the buckets change)."""

    def __init__(self) -> None:
        self._all: list[Bucket] = []
        self._key: tuple[int, ...] = ()
        self._where: dict[int, tuple[Bucket, int]] = {}

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, i: int) -> Bucket:
        return self._all[i]

    def append(self, b: Bucket) -> None:
        self._all.append(b)

    def remove(self, b: Bucket) -> None:
        self._all.remove(b)

    def find(self, p: Any) -> tuple[Bucket, int] | None:
        """(the bucket of parameter ``p``, its index there), or None: not packed."""
        key = tuple(id(b) for b in self._all)
        if key != self._key:
            self._where = {id(q): (b, i) for b in self._all for i, q in enumerate(b.params)}
            self._key = key
        return self._where.get(id(p))

    def params(self) -> list[torch.nn.Parameter]:
        return [p for b in self._all for p in b.params]

    def has_parts(self) -> bool:
        """Whether a bucket holds parts of tensors split over other ranks (tensor parallel)."""
        return any(b.placement is not None for b in self._all)

    def parts_group(self) -> Any:
        """The communicator of the group the parts are split over (None: no parts)."""
        return next((b.placement.comm for b in self._all if b.placement is not None), None)


def tensor_buckets(params: list[torch.nn.Parameter], host_shared: bool, world: int
                   ) -> list[list[torch.nn.Parameter]]:  # fmt: skip
    """The buckets of an optimizer whose norms are each tensor's own (LAMB): the tensors of one
    size together, one per row, where that pays and holds, every other tensor alone. Rows pay
    for small tensors, whose step is mostly its fixed cost (a nanoGPT-sized model's 27 tensors
    are 27 steps otherwise): at most ``ROW_ELEMENTS`` elements each, at least one per rank (a
    row bucket's slices are whole rows: every rank updates whole tensors, so the norms need no
    collective). A large tensor keeps its own flat step, sliced evenly whatever the tensor
    count. Not with host-shared parameters (one flat copy per host)."""
    if host_shared:
        return [[p] for p in params]
    by_size: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        by_size.setdefault(p.numel(), []).append(p)
    buckets: list[list[torch.nn.Parameter]] = []
    for n, same in by_size.items():  # in the order of first appearance: the same on every rank
        if 0 < n <= ROW_ELEMENTS and len(same) >= max(2, world):
            buckets.append(same)
        else:
            buckets.extend([p] for p in same)
    return buckets


def pack(bucket: Bucket, comm: Any, host_shared: bool) -> list[Any]:
    """Make ``bucket``'s parameters views of one flat tensor (a host replica's live buffer when
    ``host_shared``: written by the host's first rank) and their gradients views of its flat
    gradient buffer, which the program reads in place; returns the post-accumulate-grad hooks'
    handles (they mark a parameter as having a gradient). Collective with ``host_shared``."""
    total = bucket.size
    shared = host_shared and comm.world > 1
    params = bucket.params
    dtype = params[0].dtype
    if shared:
        # one copy per host, written by its first rank (the values are the same on every
        # rank: compared when the group was added)
        bucket.replica = bucket.step_fn.host_replica("p", (total,))
        flat = bucket.replica.live()
    else:
        flat = torch.empty(total, dtype=dtype, device=comm.device)
    writes = not shared or comm.rank == 0
    step_fn = bucket.step_fn
    if step_fn.collective_reads("g"):  # in symmetric memory where the transport has it
        grad = step_fn.input_buffer("g", bucket.shape).view(-1)
    else:  # cast first (reduce_dtype=), or averaged before the step: an ordinary tensor
        grad = torch.empty(total, dtype=dtype, device=comm.device)
    grad.zero_()
    hooks = []
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
            hooks.append(p.register_post_accumulate_grad_hook(
                _marker(bucket.has_grad, i, bucket.seen, grad)))
    bucket.flat, bucket.grad = flat, grad
    bucket.mark_written()  # (the master copy was made from these values)
    if shared:  # the first rank's writes are in before any rank reads them
        comm.control.barrier("coconet.optim: host-shared parameters written")
    return hooks


@torch.no_grad()
def reattach(bucket: Bucket, i: int, comm: Any) -> None:
    """Parameter ``i`` of ``bucket`` (its ``.data`` replaced, alike on every rank) a view of
    its place in the bucket again, holding its new values (collective with a host replica)."""
    p = bucket.params[i]
    start, stop = bucket.span(i)
    view = bucket.flat[start:stop].view_as(p)
    if bucket.replica is None or comm.rank == 0:  # host-shared: one writer per host
        view.copy_(p.detach())
    p.data = view
    if bucket.master:  # its master copy starts again from the new values
        bucket.sync_master()  # (first any other parameter written in place)
        here = bucket.local(MASTER, i)
        if here is not None:
            bucket.state[MASTER][here].copy_(master_values(bucket, i))
        bucket.mark_written()
    if bucket.replica is not None:
        comm.control.barrier("coconet.optim: a parameter taken in again")


def _marker(flags: list[bool], i: int, seen: list, grad: torch.Tensor
            ) -> Callable[[torch.Tensor], None]:  # fmt: skip
    """A post-accumulate-grad hook: parameter ``i`` got a gradient from ``backward()`` (and
    the bucket's gradient buffer is at this version now: autograd accumulates into the view in
    place, which counts on the buffer's shared version counter)."""

    def mark(_param: torch.Tensor) -> None:
        flags[i] = True
        seen[0] = grad._version
        seen[1] = True

    return mark


@torch.no_grad()
def master_values(bucket: Bucket, i: int | None = None) -> torch.Tensor:
    """The float32 master copy of ``bucket``'s parameters as they are now (widened; one
    parameter's part of this rank's slice with ``i``), as this rank stores it: what a master
    copy starts from when none was given (a new bucket, a state dict without one)."""
    lo, hi = bucket.bounds if bucket.state[MASTER].numel() != bucket.size else (0, bucket.size)
    if i is not None:
        start, stop = bucket.span(i)
        lo, hi = max(lo, start), min(hi, stop)
        if lo >= hi:
            return torch.empty(0, dtype=torch.float32, device=bucket.state[MASTER].device)
    if bucket.flat is not None:
        return bucket.flat[lo:hi].float()
    whole = torch.cat([p.detach().reshape(-1) for p in bucket.params])
    return whole[lo:hi].float()


def is_sliced(program: Program, name: str) -> bool:
    """Whether ``program`` (as scheduled) stores input ``name`` sliced over the ranks."""
    return program.input(name).type.layout.is_sliced
