"""The shared-memory transport: collectives among the ranks of one host, through symmetric memory.

Every rank of a group maps every peer's segment (``coconet.runtime.symmem``). A collective is one
epoch of the group (the same count on every rank: ranks run the same collectives in the same
order) and moves through the segments' signals:

- every rank waits until its peers have finished reading its segment for the previous epoch
  (``CONSUMED``), then writes its input into its segment's input area and posts ``READY``;
- each rank owns one slice (``torch.tensor_split`` bounds) and reduces that slice of every peer's
  input **in rank order 0, 1, ..., n-1**, accumulating 16-bit floats in float32, exactly as the
  simulator's ``semantics.reduce_values`` does: results are bitwise the simulator's and the same on
  every rank; an all_reduce writes its slice to its output area and posts ``REDUCED``, and every
  rank copies the slices it needs from the owners;
- when a rank has read what it needed from the peers, it posts ``CONSUMED``.

Data is written before a release store of the signal and read after an acquire load of it; every
wait has the communicator's deadline and checks that the peer it waits for is alive. Segments
grow (collectively: every rank sees the same sizes) when a collective needs more room.

The work happens when the collective starts (``Pending`` is already complete): on a CPU the
copying is the work, and there is no idle core for it to overlap with.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from coconet.errors import RuntimeFault
from coconet.ir import semantics
from coconet.ir.ops import ReduceOp
from coconet.ir.types import slice_bounds
from coconet.options import Algorithm, TransportKind
from coconet.runtime import symmem
from coconet.runtime.replica import HostReplica
from coconet.runtime.shm_group import CONTROL_WORDS, ShmGroup, head_bytes, numel_of
from coconet.runtime.symmem import Phase, SymmetricMemory
from coconet.runtime.transport import (
    Group,
    Pending,
    Published,
    Transport,
    into,
    ready,
)

__all__ = ["RoundKind", "ShmGroup", "SharedMemoryTransport", "control_area", "head_bytes"]

# An all_reduce of at most this many bytes per rank (of a group of two; the bound shrinks with the
# group, since every rank reads every input) runs in one round of signals (``_all_reduce_one_shot``)
# instead of two. On 2 ranks of the 2-core machine (``benchmarks/small_steps.py``, in symmetric
# memory; results/small_steps.txt): one round 110 us against two 146 us at 512 KiB, 0.68 against
# 0.40 ms at 4 MiB, where reading every whole input costs more than the second round saves; an
# earlier run at load 3-4: 300 vs 406 us at 1 MiB, 372 vs 461 us at 2 MiB.
ONE_SHOT_BYTES = 1 << 20

# The dtypes and reductions cn_one_shot computes (shm_sync.c's codes); floats only SUM and PROD
_NATIVE = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3}
_NATIVE_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}


def one_shot_bytes(size: int) -> int:
    """The largest all_reduce (bytes per rank) a group of ``size`` runs in one round."""
    return ONE_SHOT_BYTES * 2 // max(size, 2)


class RoundKind(enum.IntEnum):
    """What a control round is (its first word): ranks in different kinds of rounds at the same
    epoch are out of step, which every rank sees at once instead of reading the wrong words."""

    AGREEMENT = 1  # a step's per-step agreement (coconet.runtime.handshake), maybe with a payload
    WORDS = 2  # any other MAX of words: the commit vote, readiness, a control-channel scalar


def control_area(size: int) -> int:
    """The data area a control group reserves so that no round ever grows it (``reserve``): the
    words and the largest payload that may ride along (``one_shot_bytes``)."""
    return head_bytes(size) + one_shot_bytes(size)


_INTO = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.PROD: torch.mul,
}


def _round_name(word: int) -> str:
    """How a control round's first word reads in an error: its kind and number of words."""
    kind, n = word & 0xFF, word >> 8
    name = RoundKind(kind).name.lower() if kind in RoundKind._value2member_map_ else f"kind {kind}"
    return f"a {name} round of {n} words"


class OneShotPlan(NamedTuple):
    """What one kind of ``cn_one_shot`` all_reduce passes (``ShmGroup.one_shot_plans``): the
    second call of a kind goes from the transport's entry to the C call without deciding again
    where its data lives (a few microseconds of Python, as much as the C call of a small one)."""

    args: tuple  # ShmGroup.one_shot_args
    src: int | None  # copied into this rank's input area (None: registered, read in place)
    dst: int | None  # where a registered, donated input's result is copied (it is the result)
    # a registered input's result goes to this rank's output area first (its peers read the
    # input); None: into the input itself when donated, else into a new tensor
    scratch: torch.Tensor | None
    wait: symmem.WaitPolicy  # the policy args were made under
    limit: int  # ONE_SHOT_BYTES when it was made (a benchmark lowers it to time two rounds)


def _one_shot_out(st: ShmGroup, flat: torch.Tensor, registered: bool, in_place: bool
                  ) -> torch.Tensor:
    """Where a one-round all_reduce writes: a registered input's scratch (this rank's output
    area: its peers still read the input), the input itself when it is donated, or a new
    tensor."""
    if registered:
        return st.areas(flat.dtype, flat.numel(), st.area)[st.index]
    return flat if in_place else torch.empty_like(flat)


def _accumulate(
    parts: Sequence[torch.Tensor], op: ReduceOp, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``parts`` reduced in rank order into ``out`` (a new tensor by default), as the simulator's
    ``semantics.reduce_values`` does: ((p0 . p1) . p2) ..., 16-bit floats in float32. Full-width
    dtypes reduce straight into ``out``: one pass, no temporary."""
    if dtype in (torch.float16, torch.bfloat16) or len(parts) == 1:
        total = semantics.reduce_values(op, parts)
        if out is None:
            return total
        return out.copy_(total)
    if out is None:
        out = torch.empty_like(parts[0])
    combine = _INTO[op]
    combine(parts[0], parts[1], out=out)
    for p in parts[2:]:
        combine(out, p, out=out)
    return out


class SharedMemoryTransport(Transport):
    """Collectives through symmetric memory, for groups whose ranks share one host; it also runs
    the one-pass forms (``coconet.runtime.channels``), maps memory every peer reads in place
    (``symmetric_tensor``, ``host_replica``) and sums in rank order whatever it runs."""

    kind = TransportKind.SHARED_MEMORY
    one_pass = True
    symmetric_memory = True

    # -- the communication ops (``Transport``): one way each, in rank order, so ``algorithm``
    # (what the communicator chooses on transports that have several) is always None here -----

    def all_reduce(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        st: ShmGroup = group.handle
        plan = st.one_shot_plans.get((x.data_ptr(), x.numel(), x.dtype, reduce_op, donate))
        if (plan is not None and plan.wait is symmem.WAIT and plan.limit == ONE_SHOT_BYTES
                and x.is_contiguous()):  # fmt: skip
            # a kind of call made before (``OneShotPlan``): a contiguous input is its own flat
            # view, donated is in place
            out = self._one_shot_again(st, plan, x, donate)
            return ready(out if out is x or x.dim() == 1 else out.view(x.shape))
        flat = x if x.dim() == 1 else x.reshape(-1)  # (a reshape costs ~1 us, a view ~2 us)
        in_place = donate and flat.data_ptr() == x.data_ptr()
        if flat.numel() * flat.element_size() <= one_shot_bytes(st.size):
            out = self._all_reduce_one_shot(flat, st, reduce_op, in_place)
            return ready(out if x.dim() == 1 else out.view(x.shape))
        if in_place and st.peer_views(flat) is not None:
            return ready(self._all_reduce_in_place(flat, st, reduce_op).view(x.shape))
        parts = self.all_reduce_parts(flat, group, reduce_op=reduce_op)
        # A donated input (a gradient reduced in place, as DDP does) receives the result: its
        # content is already in the segment.
        out = flat if in_place else torch.empty_like(flat)
        parts.copy_into(out)
        return ready(out.view(x.shape))

    def _all_reduce_one_shot(
        self, flat: torch.Tensor, st: ShmGroup, reduce_op: ReduceOp, in_place: bool
    ) -> torch.Tensor:
        """A small all_reduce in one round of signals: every rank publishes its whole input
        (a registered tensor in place, any other copied into its input area) and posts
        ``READY``; once every peer has, each rank reduces **all** of every rank's input itself,
        in rank order 0, 1, ..., n-1 (the simulator's order, so every rank computes the same
        bits), and posts ``CONSUMED``. The two-round form (each rank reduces one slice, then
        copies the others' slices) waits twice and moves less data per rank: it wins for large
        inputs (``one_shot_bytes``).

        The result goes into ``flat`` when donated. A registered ``flat`` is what the peers read,
        so the result is reduced into this rank's output area first and copied into ``flat``
        only after every peer posted ``CONSUMED`` (a second wait, which also lets the caller
        overwrite ``flat`` as soon as this returns); an unregistered input is read by the peers
        from this rank's input area, which the next collective overwrites only after every peer
        posted ``CONSUMED`` (its ``begin``).

        Full-width dtypes whose reduction is exact elementwise (sums and products of floats and
        integers, integer MAX and MIN) run in one C call (``cn_one_shot``: the signals, the copy
        and the rank-order arithmetic), since the Python around a few microseconds of work cost
        more than the work; the others (16-bit floats, float MAX and MIN, strided inputs) take
        the same steps in Python."""
        numel, dtype = flat.numel(), flat.dtype
        key = (flat.data_ptr(), numel, dtype, reduce_op, in_place)
        plan = st.one_shot_plans.get(key)
        if plan is not None and plan.wait is symmem.WAIT and flat.is_contiguous():
            return self._one_shot_again(st, plan, flat, in_place)
        copies = st.peer_copies(flat)
        registered = copies is not None
        code = _NATIVE.get(dtype), _NATIVE_OPS.get(reduce_op)
        native = None not in code and (dtype.is_floating_point is False or code[1] < 2)
        if not native or not flat.is_contiguous():
            return self._one_shot_python(flat, st, reduce_op, in_place, copies)
        previous = self._next_epoch(st, numel * flat.element_size())
        args = st.one_shot_args(copies, dtype, numel, code)
        out = _one_shot_out(st, flat, registered, in_place)
        src = None if registered else flat.data_ptr()
        dst = flat.data_ptr() if registered and in_place else None
        if len(st.one_shot_plans) > 64:  # many kinds in turn: keep the cache small
            st.one_shot_plans.clear()
        st.one_shot_plans[key] = OneShotPlan(
            args, src, dst, out if registered else None, symmem.WAIT, ONE_SHOT_BYTES
        )
        self._one_shot_call(st, previous, args, src, out.data_ptr(), dst)
        if registered:
            return flat if in_place else out.clone()
        return out

    def _one_shot_again(self, st: ShmGroup, plan: OneShotPlan, flat: torch.Tensor,
                        in_place: bool) -> torch.Tensor:  # fmt: skip
        """``_all_reduce_one_shot`` of a kind of call made before: ``plan`` says where its data
        lives (plans are dropped when the segment grows, so its areas are still large enough and
        the call waits for the previous epoch itself)."""
        st.epoch += 1
        out = plan.scratch
        if out is None:
            out = flat if in_place else torch.empty_like(flat)
        self._one_shot_call(st, 1, plan.args, plan.src, out.data_ptr(), plan.dst)
        if plan.scratch is None:
            return out
        return flat if in_place else out.clone()

    @staticmethod
    def _next_epoch(st: ShmGroup, nbytes: int) -> int:
        """Start ``st``'s next epoch for a ``cn_one_shot`` call of ``nbytes`` per area: its
        ``previous`` argument (1: the call waits for the previous epoch's ``CONSUMED`` itself;
        0: ``begin`` waited, since the segment had to grow, collectively, first)."""
        if st.mem is None or nbytes > st.area:
            st.begin(nbytes)
            return 0
        st.epoch += 1
        return 1

    @staticmethod
    def _one_shot_call(st: ShmGroup, previous: int, args, src, out, dst, words_in=None,
                       words_out=None) -> None:  # fmt: skip
        """One ``cn_one_shot`` call in ``st``'s current epoch (see ``_all_reduce_one_shot``);
        ``args``: ``st.one_shot_args``; ``words_in``/``words_out``: the addresses of the control
        words of a ``words_round``. A peer that died, aborted or stalled is a ``RuntimeFault``
        naming the signal it missed."""
        mem, e = st.mem, st.epoch
        late = mem.lib.cn_one_shot(args[1], src, out, dst, e, previous, words_in, words_out)
        if late >= 0:
            fixed = args[0]
            if fixed.why == 4:
                raise ValueError(f"cn_one_shot has no reduction coded {fixed.dtype, fixed.op}")
            phase = Phase.READY if fixed.stage == 1 else Phase.CONSUMED
            mem._fail(late, phase, e - 1 if fixed.stage == 0 else e, fixed.why)

    def all_reduce_words(
        self, values: Sequence[int], group: Group, *, reduce_op: ReduceOp
    ) -> list[int]:
        """All-reduce a short vector of int64 words (the commit vote, readiness, a scalar of the
        control channel): a ``words_round`` of kind ``WORDS``, reduced here. Only MAX and MIN
        (what the control channel needs: words are compared, not summed)."""
        if reduce_op not in (ReduceOp.MAX, ReduceOp.MIN):
            raise ValueError(f"all_reduce_words: {reduce_op} is not MAX or MIN")
        gathered, _ = self.words_round(values, group, kind=RoundKind.WORDS)
        pick = max if reduce_op is ReduceOp.MAX else min
        return [pick(column) for column in zip(*gathered, strict=True)]

    @staticmethod
    def round_read(group: Group) -> None:
        """Wait until every peer has read the group's last round (posted its ``CONSUMED``): a
        ``RuntimeFault`` when one aborted, died or stalled first (``ControlChannel.votes_counted``).
        """
        st: ShmGroup = group.handle
        st.mem.wait(Phase.CONSUMED, st.epoch)

    def words_round(
        self,
        values: Sequence[int],
        group: Group,
        *,
        kind: RoundKind,
        payload: torch.Tensor | None = None,
        reduce_op: ReduceOp = ReduceOp.SUM,
        donate: bool = False,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """One round of signals in which every rank publishes a few int64 words and, optionally,
        a small tensor to all_reduce (``payload``, riding along: ``can_carry``): every rank's
        words, by rank, and the payload's reduction (rank order, bitwise the one-shot
        all_reduce's; None without a payload).

        Every rank reads every rank's words before any posts ``CONSUMED``, so each learns all of
        them from one round. The first word of each is the round's ``kind`` and length: a rank in
        another kind of round at this epoch is a ``RuntimeFault`` on every rank (they are out of
        step). The payload area of a rank that sent none holds stale bytes, which the reduction
        reads too: a caller uses the result only where every rank's words say that all carried
        the same payload (``coconet.runtime.handshake``). Values outside int64 are a
        ``ValueError`` (a bug: the callers' words fit)."""
        st: ShmGroup = group.handle
        n = len(values)
        if n > max(CONTROL_WORDS, st.size):
            raise ValueError(f"words_round: {n} words, at most {max(CONTROL_WORDS, st.size)}")
        if n and (min(values) < -(1 << 63) or max(values) >= 1 << 63):
            raise ValueError(f"words_round: {list(values)} do not fit int64")
        width = n + 1
        arrays = st.words.get(width)
        if arrays is None:
            src, out = (ctypes.c_int64 * width)(), (ctypes.c_int64 * (width * st.size))()
            arrays = st.words[width] = (src, out, ctypes.addressof(src), ctypes.addressof(out))
        src, out, src_at, out_at = arrays
        src[0] = int(kind) | (n << 8)
        src[1:] = values
        if payload is None:
            numel, dtype, code, data, result = 0, torch.int64, (3, 2), None, None
        else:
            flat = payload if payload.dim() == 1 else payload.reshape(-1)
            numel, dtype = flat.numel(), flat.dtype
            code = (_NATIVE[dtype], _NATIVE_OPS[reduce_op])
            data = flat.data_ptr()
            result = flat if donate else torch.empty_like(flat)
        nbytes = head_bytes(st.size) + numel * (8 if dtype in (torch.int64, torch.float64) else 4)
        # grows the segment (collectively) only where it is too small: never on a control group,
        # which reserved room for the largest round (``reserve``), so rounds of different sizes
        # on different ranks (a payload riding on one, none on another) still pair
        previous = self._next_epoch(st, nbytes)
        args = st.one_shot_args(None, dtype, numel, code, head_words=width)
        # without a payload nothing is reduced (0 elements): any valid address does for `out`
        into = out_at if result is None else result.data_ptr()
        self._one_shot_call(st, previous, args, data, into, None, src_at, out_at)
        words = out[:]
        kinds = words[::width]
        if kinds.count(kinds[0]) != len(kinds):
            raise RuntimeFault(
                "the ranks are out of step on the control channel: they reached different "
                "control rounds at the same point",
                op="control channel",
                details=[f"rank {r}: {_round_name(k)}" for r, k in enumerate(kinds)],
                hint="every rank must run the same steps in the same order; this job's ranks "
                "have diverged: restart it",
            )
        if result is not None and payload is not None and payload.dim() != 1:
            result = result.view(payload.shape)
        return [words[r * width + 1 : (r + 1) * width] for r in range(st.size)], result

    @staticmethod
    def can_carry(x: torch.Tensor, group: Group, reduce_op: ReduceOp) -> bool:
        """Whether ``words_round`` can all_reduce ``x`` along with its words over ``group`` (a
        control group: ``reserve``d for one-shot sizes): a contiguous tensor of a dtype and
        reduction ``cn_one_shot`` computes, of at most ``one_shot_bytes``."""
        code = _NATIVE.get(x.dtype), _NATIVE_OPS.get(reduce_op)
        if None in code or (x.dtype.is_floating_point and code[1] >= 2):
            return False
        return x.is_contiguous() and x.numel() * x.element_size() <= one_shot_bytes(group.size)

    def _one_shot_python(
        self,
        flat: torch.Tensor,
        st: ShmGroup,
        reduce_op: ReduceOp,
        in_place: bool,
        copies: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """``_all_reduce_one_shot``'s steps in Python (what C does not reduce)."""
        numel, dtype = flat.numel(), flat.dtype
        registered = copies is not None
        mem, e = st.begin(numel * flat.element_size())
        if copies is None:
            copies = st.areas(dtype, numel)
            copies[st.index].copy_(flat)
        mem.post(Phase.READY, e)
        mem.wait(Phase.READY, e)
        out = _one_shot_out(st, flat, registered, in_place)
        _accumulate(copies, reduce_op, dtype, out=out)
        mem.post(Phase.CONSUMED, e)
        if registered:
            mem.wait(Phase.CONSUMED, e)
            return flat.copy_(out) if in_place else out.clone()
        return out

    def _all_reduce_in_place(
        self, flat: torch.Tensor, st: ShmGroup, reduce_op: ReduceOp
    ) -> torch.Tensor:
        """A donated input that lives in symmetric memory of its own (a gradient bucket) receives
        the result in place, with no output area: each rank reduces its slice straight into its
        own copy's slice (the peers never read that slice of it: they read only their own
        slices), then copies each peer's reduced slice out of the peer's copy into the same
        place of its own once that peer posted ``REDUCED`` (the peer has finished reading this
        rank's copy of that slice then). One pass fewer than reducing into an output area."""
        n, i = st.size, st.index
        peer = st.peer_views(flat)
        mem, e = st.begin(0)
        mem.post(Phase.READY, e)
        mem.wait(Phase.READY, e)
        bounds = [slice_bounds(flat.numel(), n, r) for r in range(n)]
        lo, hi = bounds[i]
        mine = [peer(j)[lo:hi] for j in range(n)]
        if i < 2:
            # rank order, straight into this rank's own slice: ((x_0 . x_1) . x_2) ...; its
            # first write reads x_i's slice in the same element (exact aliasing is safe) and no
            # later term reads it; no peer reads this slice of it
            _accumulate(mine, reduce_op, flat.dtype, out=flat[lo:hi])
        else:  # x_i is a later term: the first write would overwrite it before it is added
            flat[lo:hi].copy_(_accumulate(mine, reduce_op, flat.dtype))
        mem.post(Phase.REDUCED, e)
        for j, (a, b) in enumerate(bounds):
            if j != i:
                mem.wait(Phase.REDUCED, e, [j])
                flat[a:b].copy_(peer(j)[a:b])
        mem.post(Phase.CONSUMED, e)
        # the caller may overwrite its buffer as soon as this returns: every peer must be done
        # copying its slice out of it
        mem.wait(Phase.CONSUMED, e)
        return flat

    def all_reduce_parts(self, x, group: Group, *, reduce_op: ReduceOp) -> Published:
        """All-reduce flattened ``x``, leaving the result where the owners reduced it: a
        ``Published`` of the owners' slices (flat, in order; ``torch.tensor_split`` bounds) that
        a consumer reads in place. Nothing else may run on the group until it is released: the
        peers cannot reuse their segments before every rank is done reading them."""
        st: ShmGroup = group.handle
        flat = x.reshape(-1)
        n, i = st.size, st.index
        mem, e = st.begin(flat.numel() * flat.element_size())
        peer, _ = st.publish(mem, flat)
        mem.post(Phase.READY, e)
        mem.wait(Phase.READY, e)
        bounds = [slice_bounds(flat.numel(), n, r) for r in range(n)]
        lo, hi = bounds[i]
        mine = [peer(j)[lo:hi] for j in range(n)]
        slot = mem.buffer(i, flat.dtype, flat.numel(), st.area)[lo:hi]
        _accumulate(mine, reduce_op, flat.dtype, out=slot)
        mem.post(Phase.REDUCED, e)
        # every peer has reduced its slice, so every peer is done reading this rank's input
        mem.wait(Phase.REDUCED, e)
        pieces = [mem.buffer(j, flat.dtype, flat.numel(), st.area)[a:b] for j, (a, b) in
                  enumerate(bounds)]
        return Published(pieces, lambda: mem.post(Phase.CONSUMED, e), (flat.numel(),), flat.dtype)

    def reduce_scatter(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        dim: int,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        x0 = x.movedim(dim, 0).contiguous()
        st: ShmGroup = group.handle
        rows = [slice_bounds(x0.shape[0], st.size, st.index)]
        return ready(self.reduce_rows(x0, group, reduce_op=reduce_op, rows=rows).movedim(0, dim))

    def reduce_rows(
        self,
        x0: torch.Tensor,
        group: Group,
        *,
        reduce_op: ReduceOp,
        rows: Sequence[tuple[int, int]],
    ) -> torch.Tensor:
        """The group's reduction of the ``[start, stop)`` row ranges ``rows`` of contiguous
        ``x0`` (each rank names its own), concatenated in the order given: a reduce_scatter
        (one range: the rank's slice), or the hierarchical transport's first phase, where a
        rank reduces the blocks its counterparts on the other hosts own
        (``coconet.runtime.hierarchy``)."""
        st: ShmGroup = group.handle
        n = st.size
        mem, e = st.begin(x0.numel() * x0.element_size())
        peer, registered = st.publish(mem, x0)
        mem.post(Phase.READY, e)
        mem.wait(Phase.READY, e)
        if len(rows) == 1:
            ((lo, hi),) = rows
            out = _accumulate([peer(j)[lo:hi] for j in range(n)], reduce_op, x0.dtype)
        else:
            out = x0.new_empty((sum(hi - lo for lo, hi in rows), *x0.shape[1:]))
            at = 0
            for lo, hi in rows:  # each range straight into its place: no concatenation pass
                part = out[at : at + hi - lo]
                _accumulate([peer(j)[lo:hi] for j in range(n)], reduce_op, x0.dtype, part)
                at += hi - lo
        # ``out`` is a new tensor, never the segment itself
        mem.post(Phase.CONSUMED, e)
        if registered:
            # the caller may overwrite x as soon as this returns: the peers must be done with it
            mem.wait(Phase.CONSUMED, e)
        return out

    def all_gather(
        self,
        x,
        group: Group,
        *,
        dim: int,
        parts: Sequence[int],
        algorithm: Algorithm | None = None,
        out: torch.Tensor | None = None,
    ) -> Pending:
        x0 = x.movedim(dim, 0).contiguous()
        starts = [sum(parts[:r]) for r in range(len(parts))]
        rows = [[(starts[r], starts[r] + parts[r])] for r in range(len(parts))]
        target = out if out is not None and dim == 0 and out.is_contiguous() else None
        whole = self.gather_rows(x0, group, rows=rows, out=target).movedim(0, dim)
        return ready(into(whole, out))

    def gather_rows(
        self, x0: torch.Tensor, group: Group, *, rows: Sequence[Sequence[tuple[int, int]]],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The whole of which each rank's contiguous ``x0`` fills the ``[start, stop)`` row
        ranges ``rows[rank]``, in order (its ``x0`` is their concatenation): an all_gather (one
        range per rank, in rank order), or the hierarchical transport's last phase; written into
        ``out`` where given (contiguous, the whole's shape)."""
        st: ShmGroup = group.handle
        n, i = st.size, st.index
        total = max((hi for ranges in rows for _, hi in ranges), default=0)
        shape = (total, *x0.shape[1:])
        numel = numel_of(shape)
        mem, e = st.begin(numel * x0.element_size())
        mine = mem.buffer(i, x0.dtype, numel).view(shape)
        at = 0
        for lo, hi in rows[i]:
            mine[lo:hi].copy_(x0[at : at + hi - lo])
            at += hi - lo
        mem.post(Phase.READY, e)
        mem.wait(Phase.READY, e)
        out = torch.empty(shape, dtype=x0.dtype) if out is None else out.view(shape)
        for j in range(n):
            theirs = mem.buffer(j, x0.dtype, numel).view(shape)
            for lo, hi in rows[j]:
                out[lo:hi].copy_(theirs[lo:hi])
        mem.post(Phase.CONSUMED, e)
        return out

    def broadcast(self, x, group: Group, *, root: int, donate: bool) -> Pending:
        st: ShmGroup = group.handle
        flat = x.reshape(-1)
        mem, e = st.begin(flat.numel() * flat.element_size())
        if st.index == root:
            mem.buffer(root, flat.dtype, flat.numel()).copy_(flat)
            mem.post(Phase.READY, e)
            out = flat.clone()
        else:
            mem.post(Phase.READY, e)
            mem.wait(Phase.READY, e, [root])
            out = mem.buffer(root, flat.dtype, flat.numel()).clone()
        mem.post(Phase.CONSUMED, e)
        return ready(out.view(x.shape))

    def reduce(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        root: int,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        """The group's ``root``-th rank gets the reduction; the others get zeros."""
        st: ShmGroup = group.handle
        flat = x.reshape(-1)
        mem, e = st.begin(flat.numel() * flat.element_size())
        mem.buffer(st.index, flat.dtype, flat.numel()).copy_(flat)
        mem.post(Phase.READY, e)
        if st.index == root:
            mem.wait(Phase.READY, e)
            parts = [mem.buffer(j, flat.dtype, flat.numel()) for j in range(st.size)]
            out = _accumulate(parts, reduce_op, flat.dtype)
        else:
            out = torch.zeros_like(flat)
        mem.post(Phase.CONSUMED, e)
        return ready(out.view(x.shape))

    # -- a fused collective as one pass (coconet.codegen.plan.OnePass) -------------------------

    def fused_reduce_scatter(
        self,
        x: torch.Tensor,
        group: Group,
        *,
        gather_shape: Sequence[int] | None = None,
        gather_dtype: torch.dtype | None = None,
        gather_parts: Sequence[int] | None = None,
        gather_into: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Open the unit's epoch: publish ``x`` (dim 0 is scattered) and return every peer's
        rows of this rank's slice, in rank order (the fused kernel reduces them itself), and this
        rank's slot of the gather's output area (the kernel writes its result there; None without
        ``gather_shape``: the unit has no gather and ends with ``fused_reduce_scatter_end``).
        An ``x`` that lives in symmetric memory of its own (``register``) is read in place.
        ``gather_into``: the tensor the gather's result is committed into; when it is a host
        replica's live buffer, the slot is this rank's rows of the replica's spare buffer."""
        st: ShmGroup = group.handle
        x0 = x.contiguous()
        n, i = st.size, st.index
        out_bytes = 0
        if gather_shape is not None:
            out_numel = numel_of(gather_shape)
            out_bytes = out_numel * gather_dtype.itemsize
        mem, e = st.begin(max(x0.numel() * x0.element_size(), out_bytes))
        peer, st.open_registered = st.publish(mem, x0)
        mem.post(Phase.READY, e)
        mem.wait(Phase.READY, e)
        lo, hi = slice_bounds(x0.shape[0], n, i)
        # the peers' rows stay valid until the gather (or the end): every rank reads them before
        # it posts REDUCED (CONSUMED), and a peer overwrites its segment only after it saw that
        owner = st.published_owner(mem, x0, st.open_registered)
        key = ("rows", x0.data_ptr() if st.open_registered else 0, x0.dtype, tuple(x0.shape),
               lo, hi)
        peers = st.views(key, owner, lambda: [peer(j)[lo:hi] for j in range(n)])
        if gather_shape is None:
            st.open_replica = None
            return peers, None
        return peers, self._slot(st, mem, gather_shape, gather_dtype, gather_parts, gather_into)

    def fused_reduce_scatter_end(self, group: Group) -> None:
        """Close a unit that has no gather: this rank is done reading the peers' rows. When its
        input lives in symmetric memory of its own, also wait until the peers are done with it:
        the caller may overwrite it as soon as this returns."""
        st: ShmGroup = group.handle
        mem, e = st.mem, st.epoch
        mem.post(Phase.CONSUMED, e)
        if st.open_registered:
            mem.wait(Phase.CONSUMED, e)

    def fused_all_gather_begin(
        self,
        group: Group,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        parts: Sequence[int],
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Open a unit that has no reduce_scatter: this rank's slot of the gather, for the kernel
        to write its rows into (``fused_all_gather`` closes it; ``into`` as for
        ``fused_reduce_scatter``'s ``gather_into``)."""
        st: ShmGroup = group.handle
        numel = numel_of(shape)
        mem, _ = st.begin(numel * dtype.itemsize)
        return self._slot(st, mem, shape, dtype, parts, into)

    @staticmethod
    def _slot(
        st: ShmGroup, mem: SymmetricMemory, shape, dtype, parts, into: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's rows of a gather of ``shape``: in its segment's output area, or in the
        spare buffer of the host replica ``into`` is (then the peers write theirs there too and
        nothing is gathered: the commit flips the replica)."""
        start = sum(parts[: st.index])
        replica = st.replica_of(into) if into is not None else None
        if replica is not None and (replica.shape != tuple(shape) or replica.dtype != dtype):
            replica = None  # a gather of another shape: the ordinary slot
        st.open_replica = replica
        rows = parts[st.index]

        def slot() -> list[torch.Tensor]:
            if replica is not None:
                out = replica.spare()
            else:
                out = mem.buffer(st.index, dtype, numel_of(shape), st.area).view(tuple(shape))
            return [out[start : start + rows]]

        which = ("replica", replica.spare_index) if replica is not None else ("area", st.area)
        key = ("slot", which, tuple(shape), dtype, start, rows)
        return st.views(key, replica if replica is not None else mem, slot)[0]

    def fused_all_gather(
        self,
        group: Group,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        parts: Sequence[int],
        published: bool = False,
    ) -> torch.Tensor | Published:
        """Close the unit's epoch: every rank's slot is written; gather them. With
        ``published``, the slots stay where they are (a ``Published``) until the commit copies
        them into the caller's tensor, and the epoch ends then."""
        st: ShmGroup = group.handle
        mem, e = st.mem, st.epoch
        mem.post(Phase.REDUCED, e)
        mem.wait(Phase.REDUCED, e)
        shape = tuple(shape)
        numel = numel_of(shape)
        replica, st.open_replica = st.open_replica, None

        def slots() -> list[torch.Tensor]:
            pieces, start = [], 0
            for j, rows in enumerate(parts):
                whole = replica.spare() if replica is not None else (
                    mem.buffer(j, dtype, numel, st.area).view(shape)
                )
                pieces.append(whole[start : start + rows])
                start += rows
            return pieces

        # (a replica's spare buffer alternates: one entry for each)
        which = ("replica", replica.spare_index) if replica is not None else ("area", st.area)
        key = ("gather", which, shape, dtype, tuple(parts))
        pieces = st.views(key, replica if replica is not None else mem, slots)
        result = Published(
            pieces, lambda: mem.post(Phase.CONSUMED, e), shape, dtype, replica=replica
        )
        return result if published else result.materialize()

    def host_replica(
        self, group: Group, shape: Sequence[int], dtype: torch.dtype
    ) -> HostReplica:
        """A ``HostReplica`` of ``shape`` over the group (collective over the group)."""
        st: ShmGroup = group.handle
        return st.replica(shape, dtype)

    def signal_groups(self, group: Group) -> list[Group]:
        """The group itself: a peer's abort word ends its waits (``ControlChannel.abort``)."""
        return [group]

    def close(self, group: Group) -> None:
        """Unmap and hand back the group's segments."""
        st: ShmGroup = group.handle
        st.close()

    def symmetric_tensor(
        self, group: Group, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor every peer maps (collective over the group): pass it to a collective and it is
        read in place, not copied in."""
        st: ShmGroup = group.handle
        return st.register(shape, dtype)

    def send(self, x, group: Group, reverse: bool = False) -> Pending:
        """Rank i of the group receives rank i-1's ``x``; the first rank gets zeros.
        ``reverse``: rank i receives rank i+1's, the last gets zeros."""
        st: ShmGroup = group.handle
        flat = x.reshape(-1)
        mem, e = st.begin(flat.numel() * flat.element_size())
        i = st.index
        mem.buffer(i, flat.dtype, flat.numel()).copy_(flat)
        mem.post(Phase.READY, e)
        frm = i + 1 if reverse else i - 1
        if 0 <= frm < st.size:
            mem.wait(Phase.READY, e, [frm])
            out = mem.buffer(frm, flat.dtype, flat.numel()).clone()
        else:
            out = torch.zeros_like(flat)
        mem.post(Phase.CONSUMED, e)
        return ready(out.view(x.shape))


def torch_gather(pg) -> Callable[[object], list[object]]:
    """The control channel of a shared-memory group: all_gather_object over its process group."""

    def gather(obj: object) -> list[object]:
        out: list[object] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(out, obj, group=pg)
        return out

    return gather
