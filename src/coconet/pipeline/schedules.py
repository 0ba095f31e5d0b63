"""Pipeline schedules as per-rank action lists, and the proof that their sends match and cannot
deadlock, checked before anything runs.

A schedule is, for each pipeline rank, the list of its steps in order; a step is one action
(compute a stage's forward or backward of one micro-batch) or several sends and receives posted
together and waited for together (as ``batch_isend_irecv``: Megatron's
``send_forward_recv_backward``). ``gpipe``
(every forward, then every backward) and ``one_f_one_b`` (warm-up forwards, then one forward
and one backward in turn, then the remaining backwards: at most ``stages - rank`` micro-batches'
activations held at once) build them; ``format_table`` prints them side by side.

``check`` proves a schedule before it runs. It executes every rank's steps over
per-(source, destination) FIFO channels **without tags**, as NCCL and gloo pair point-to-point
messages: the sends a rank posts to a peer pair with the receives that peer posts from it, in
the order each side posted them, whatever they carry. A send is a rendezvous (it completes when
its receive is posted: large messages on NCCL and gloo do not complete before), so a schedule
that passes here cannot wait forever on any transport that buffers more (1F1B with a plain
blocking send in its steady state fails here, as it can hang for real: its sends and receives
must be posted together). It refuses, naming both ranks' actions:

- a receive that meets a message of another kind, micro-batch, shape or dtype (Megatron-LM
  #5271: with two stages the previous and next peer are one rank, and two untagged receives of
  equal byte size took each other's tensors);
- a wait cycle: every rank that has work left is blocked on a peer that is blocked too (the
  ranks and the action each waits in are listed);
- a message sent and never received, an action on a rank outside the pipeline, a stage
  computed before its input arrived.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from coconet.errors import ScheduleError

__all__ = [
    "Action",
    "Kind",
    "Shape",
    "Step",
    "channel_sizes",
    "check",
    "format_table",
    "gpipe",
    "one_f_one_b",
    "peak_activations",
]

Shape = tuple[int, ...]


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACTIVATION = "send act"
    RECV_ACTIVATION = "recv act"
    SEND_GRADIENT = "send grad"
    RECV_GRADIENT = "recv grad"

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACTIVATION, Kind.SEND_GRADIENT)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACTIVATION, Kind.RECV_GRADIENT)

    @property
    def payload(self) -> str:
        return "activation" if self in (Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION) else \
            "gradient"  # fmt: skip


@dataclass(frozen=True)
class Action:
    """One thing a pipeline rank does: ``kind`` of ``micro_batch``; a send or receive names its
    ``peer`` rank and the message's ``shape`` and ``dtype``."""

    kind: Kind
    micro_batch: int
    peer: int | None = None
    shape: Shape = ()
    dtype: str = "float32"

    def __str__(self) -> str:
        if self.peer is None:
            return f"{self.kind.value}{self.micro_batch}"
        arrow = "->" if self.kind.is_send else "<-"
        return f"{self.kind.value} {self.micro_batch} {arrow} {self.peer}"

    def describe(self) -> str:
        if self.peer is None:
            return f"{self.kind.name.lower()} of micro-batch {self.micro_batch}"
        way = "to" if self.kind.is_send else "from"
        return (f"{self.kind.name.lower()} of micro-batch {self.micro_batch} {way} rank "
                f"{self.peer} ({list(self.shape)} {self.dtype})")  # fmt: skip


def _check_sizes(stages: int, micro_batches: int, who: str) -> None:
    for what, v in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ScheduleError(f"{who}: {what} must be a positive int, got {v!r}", op=who,
                                hint=f"{who}(stages=2, micro_batches=8)")  # fmt: skip


def _shapes(shapes: Shape | Sequence[Shape], stages: int) -> list[Shape]:
    """The activation shape leaving each stage (one shape for all, or one per boundary)."""
    if shapes and isinstance(shapes[0], int):
        return [tuple(shapes)] * stages  # type: ignore[arg-type]
    return [tuple(s) for s in shapes] + [()] * (stages - len(shapes))


Step = tuple[Action, ...]  # actions posted together (one compute action, or sends/receives)


class _Builder:
    def __init__(self, stages: int, shapes: list[Shape], dtype: str) -> None:
        self.stages, self.shapes, self.dtype = stages, shapes, dtype
        self.lists: list[list[Step]] = [[] for _ in range(stages)]

    def recv_act(self, s: int, m: int) -> Action | None:
        return Action(Kind.RECV_ACTIVATION, m, s - 1, self.shapes[s - 1], self.dtype) \
            if s > 0 else None  # fmt: skip

    def send_act(self, s: int, m: int) -> Action | None:
        return Action(Kind.SEND_ACTIVATION, m, s + 1, self.shapes[s], self.dtype) \
            if s < self.stages - 1 else None  # fmt: skip

    def recv_grad(self, s: int, m: int) -> Action | None:
        return Action(Kind.RECV_GRADIENT, m, s + 1, self.shapes[s], self.dtype) \
            if s < self.stages - 1 else None  # fmt: skip

    def send_grad(self, s: int, m: int) -> Action | None:
        return Action(Kind.SEND_GRADIENT, m, s - 1, self.shapes[s - 1], self.dtype) \
            if s > 0 else None  # fmt: skip

    def step(self, s: int, *actions: Action | None) -> None:
        posted = tuple(a for a in actions if a is not None)
        if posted:
            self.lists[s].append(posted)

    def compute(self, s: int, kind: Kind, m: int) -> None:
        self.lists[s].append((Action(kind, m),))


def gpipe(stages: int, micro_batches: int, shapes: Shape | Sequence[Shape] = (1,),
          dtype: str = "float32") -> list[list[Step]]:  # fmt: skip
    """GPipe: each rank runs every micro-batch's forward, then every backward (in reverse)."""
    _check_sizes(stages, micro_batches, "gpipe")
    b = _Builder(stages, _shapes(shapes, stages), dtype)
    for s in range(stages):
        for m in range(micro_batches):
            b.step(s, b.recv_act(s, m))
            b.compute(s, Kind.FORWARD, m)
            b.step(s, b.send_act(s, m))
        for m in reversed(range(micro_batches)):
            b.step(s, b.recv_grad(s, m))
            b.compute(s, Kind.BACKWARD, m)
            b.step(s, b.send_grad(s, m))
    return b.lists


def one_f_one_b(stages: int, micro_batches: int, shapes: Shape | Sequence[Shape] = (1,),
                dtype: str = "float32") -> list[list[Step]]:  # fmt: skip
    """1F1B (PipeDream-flush, Megatron's): rank s warms up with ``stages - 1 - s`` forwards,
    then runs one forward and one backward in turn (each forward's send posted with the next
    backward's receive, each backward's send with the next forward's receive), then the
    remaining backwards. It holds at most ``stages - s`` micro-batches' activations at once
    (GPipe: all of them). Fewer micro-batches than stages shortens the warm-up (torchtitan
    #775)."""
    _check_sizes(stages, micro_batches, "one_f_one_b")
    b = _Builder(stages, _shapes(shapes, stages), dtype)
    for s in range(stages):
        warm = min(stages - 1 - s, micro_batches)
        steady = micro_batches - warm
        for m in range(warm):
            b.step(s, b.recv_act(s, m))
            b.compute(s, Kind.FORWARD, m)
            b.step(s, b.send_act(s, m))
        if steady:
            b.step(s, b.recv_act(s, warm))
        for i in range(steady):
            m, back = warm + i, i
            b.compute(s, Kind.FORWARD, m)
            b.step(s, b.send_act(s, m), b.recv_grad(s, back))
            b.compute(s, Kind.BACKWARD, back)
            if i == steady - 1:
                b.step(s, b.send_grad(s, back))
            else:
                b.step(s, b.send_grad(s, back), b.recv_act(s, m + 1))
        for back in range(steady, micro_batches):
            b.step(s, b.recv_grad(s, back))
            b.compute(s, Kind.BACKWARD, back)
            b.step(s, b.send_grad(s, back))
    return b.lists


def peak_activations(steps: Sequence[Step]) -> int:
    """The most micro-batches whose forward ran and whose backward has not, on one rank."""
    live = peak = 0
    for a in (a for step in steps for a in step):
        if a.kind is Kind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind is Kind.BACKWARD:
            live -= 1
    return peak


def channel_sizes(schedule: Sequence[Sequence[Step]], element_size: int
                  ) -> dict[tuple[int, int], tuple[int, int]]:  # fmt: skip
    """(messages, largest message's bytes) per (source, destination) stage pair of the
    schedule: what one pass of it puts on each channel (``Communicator.p2p`` sizes a
    shared-memory ring to hold them all, so a send never waits for a message of its own pass:
    the ring adds no wait that ``check``'s proof did not allow)."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for src, steps in enumerate(schedule):
        for step in steps:
            for a in step:
                if a.peer is not None and a.kind.is_send:
                    count, most = out.get((src, a.peer), (0, 0))
                    out[(src, a.peer)] = (count + 1, max(most, math.prod(a.shape) * element_size))
    return out


def format_table(schedule: Sequence[Sequence[Step]]) -> str:
    """The ranks' compute actions side by side, one column per rank, in each rank's order."""
    cols = [[str(a) for step in steps for a in step if a.peer is None] for steps in schedule]
    width = max([len(c) for col in cols for c in col] + [len(f"rank {len(cols)}")]) + 2
    rows = max((len(c) for c in cols), default=0)
    head = "".join(f"rank {r}".ljust(width) for r in range(len(cols)))
    lines = [head.rstrip()]
    for i in range(rows):
        lines.append("".join((c[i] if i < len(c) else "").ljust(width) for c in cols).rstrip())
    return "\n".join(lines)


def _expects(recv: Action, sent: Action) -> bool:
    kinds = {Kind.RECV_ACTIVATION: Kind.SEND_ACTIVATION, Kind.RECV_GRADIENT: Kind.SEND_GRADIENT}
    return (kinds[recv.kind] is sent.kind and recv.micro_batch == sent.micro_batch
            and recv.shape == sent.shape and recv.dtype == sent.dtype)  # fmt: skip


def check(schedule: Sequence[Sequence[Step]]) -> None:
    """Prove that every receive of ``schedule`` (one list of steps per pipeline rank) matches
    its send in order, kind, micro-batch, shape and dtype, that no rank waits forever, that no
    message is left unreceived and that each stage computes only what arrived; raise a
    ``ScheduleError`` naming the ranks and actions otherwise (see the module docstring)."""
    n = len(schedule)
    steps = [[tuple(step) if isinstance(step, (tuple, list)) else (step,) for step in ranks]
             for ranks in schedule]  # fmt: skip
    for r, ranks in enumerate(steps):
        for step in ranks:
            for a in step:
                if not isinstance(a, Action):
                    raise ScheduleError(f"rank {r}: {a!r} is not a pipeline Action",
                                        op="pipeline schedule",
                                        hint="build schedules with gpipe() or one_f_one_b()")
                if a.peer is not None and not (0 <= a.peer < n and a.peer != r):
                    raise ScheduleError(
                        f"rank {r}: {a.describe()}: there is no rank {a.peer} to talk to",
                        op="pipeline schedule",
                        hint=f"the pipeline has ranks 0..{n - 1}; a rank does not send to itself",
                    )
                if a.peer is None and len(step) > 1:
                    raise ScheduleError(f"rank {r}: {a} is posted with sends and receives",
                                        op="pipeline schedule",
                                        hint="a compute action is a step of its own")
    pos = [0] * n
    # per (source, destination): the posted, unpaired sends and receives, in posting order
    sends: dict[tuple[int, int], deque[tuple[int, Action]]] = {}
    recvs: dict[tuple[int, int], deque[tuple[int, Action]]] = {}
    pending: list[set[int]] = [set() for _ in range(n)]  # unpaired members of the current step
    posted = [False] * n
    arrived: list[set[tuple[str, int]]] = [set() for _ in range(n)]
    done_forward: list[set[int]] = [set() for _ in range(n)]
    done_backward: list[set[int]] = [set() for _ in range(n)]

    def step_of(r: int) -> Step | None:
        return steps[r][pos[r]] if pos[r] < len(steps[r]) else None

    while True:
        progressed = False
        for r in range(n):
            step = step_of(r)
            if step is None:
                continue
            if step[0].peer is None:  # a compute action
                a = step[0]
                _check_compute(r, a, arrived[r], done_forward[r], n)
                (done_forward if a.kind is Kind.FORWARD else done_backward)[r].add(a.micro_batch)
                pos[r] += 1
                progressed = True
                continue
            if not posted[r]:
                posted[r] = True
                pending[r] = set(range(len(step)))
                for a in step:
                    if a.kind.is_send:
                        _check_send(r, a, done_forward[r], done_backward[r])
                for k, a in enumerate(step):
                    key = (r, a.peer) if a.kind.is_send else (a.peer, r)
                    (sends if a.kind.is_send else recvs).setdefault(key, deque()).append((k, a))
                progressed = True
            for a in step:  # pair what both sides posted, in order, on this rank's channels
                key = (r, a.peer) if a.kind.is_send else (a.peer, r)
                while sends.get(key) and recvs.get(key):
                    (ks, sent), (kr, got) = sends[key].popleft(), recvs[key].popleft()
                    src, dst = key
                    if not _expects(got, sent):
                        raise ScheduleError(
                            f"rank {dst}'s {got.describe()} would receive rank {src}'s "
                            f"{sent.describe()}: untagged messages pair in order",
                            op="pipeline schedule",
                            details=[f"rank {src}, step {pos[src]}: {sent}",
                                     f"rank {dst}, step {pos[dst]}: {got}"],
                            hint="order each pair of ranks' sends as the receiver posts its "
                            "receives (same micro-batch, kind, shape and dtype)",
                        )  # fmt: skip
                    pending[src].discard(ks)
                    pending[dst].discard(kr)
                    arrived[dst].add((got.kind.payload, got.micro_batch))
                    progressed = True
            if posted[r] and not pending[r]:
                pos[r] += 1
                posted[r] = False
                progressed = True
        if all(step_of(r) is None for r in range(n)):
            break
        if not progressed:
            raise _deadlock(steps, pos, step_of)


def _check_send(r: int, a: Action, done_forward: set, done_backward: set) -> None:
    """A rank sends only what it has computed: a micro-batch's activation after its forward,
    its gradient after its backward (found by the randomized run: a send moved before its
    compute passes the matching and only fails when the tensor is not there)."""
    made, what = ((done_forward, "forward") if a.kind is Kind.SEND_ACTIVATION
                  else (done_backward, "backward"))  # fmt: skip
    if a.micro_batch not in made:
        raise ScheduleError(
            f"rank {r} posts its {a.describe()} before running the {what} of micro-batch "
            f"{a.micro_batch}",
            op="pipeline schedule",
            hint=f"send a micro-batch's {a.kind.payload} after the {what} that computes it",
        )


def _check_compute(r: int, a: Action, arrived: set, done_forward: set, n: int) -> None:
    if a.kind is Kind.FORWARD and r > 0 and ("activation", a.micro_batch) not in arrived:
        raise ScheduleError(
            f"rank {r} runs the forward of micro-batch {a.micro_batch} before receiving its "
            "activation",
            op="pipeline schedule",
            hint="receive the previous stage's activation first",
        )
    if a.kind is Kind.BACKWARD:
        if a.micro_batch not in done_forward:
            raise ScheduleError(
                f"rank {r} runs the backward of micro-batch {a.micro_batch} before its forward",
                op="pipeline schedule",
                hint="a micro-batch's backward follows its forward on every stage",
            )
        if r < n - 1 and ("gradient", a.micro_batch) not in arrived:
            raise ScheduleError(
                f"rank {r} runs the backward of micro-batch {a.micro_batch} before receiving "
                "its gradient",
                op="pipeline schedule",
                hint="receive the next stage's gradient first",
            )


def _deadlock(steps, pos, step_of) -> ScheduleError:
    waits = []
    for r in range(len(steps)):
        step = step_of(r)
        if step is None:
            continue
        peers = []
        for a in step:
            other = step_of(a.peer)
            peers.append(f"rank {a.peer} is at {', '.join(map(str, other))}" if other
                         else f"rank {a.peer} has finished")  # fmt: skip
        waits.append(f"rank {r}, step {pos[r]}: {', '.join(map(str, step))} (waits: "
                     f"{'; '.join(peers)})")  # fmt: skip
    return ScheduleError(
        "the schedule deadlocks: every rank with work left waits on a peer that waits too",
        op="pipeline schedule",
        details=waits,
        hint="a send completes only when its receive is posted (as on NCCL and gloo): post a "
        "pair's opposite sends and receives together in one step, or order them so that one "
        "side's send meets the other's receive",
    )
