"""``Pipeline``: one stage of a pipeline-parallel model on this rank, running a proven schedule.

Each rank of the ``pp`` axis holds its stage (an ``nn.Module``); ``step(inputs, targets)`` splits
the batch into micro-batches and runs this rank's steps of the schedule (``gpipe`` or
``one_f_one_b``, proven by ``coconet.pipeline.check`` when the Pipeline is built, so a schedule
that could cross tensors or hang is refused before anything runs): forward and backward with
torch's autograd, activations and their gradients sent point to point between neighbouring
stages (untagged, each step's messages posted together and waited for with the communicator's
timeout). Parameter gradients accumulate over the micro-batches as with gradient accumulation;
the caller steps its optimizer afterwards.

**Which transport carries the messages** (``Pipeline.links``, one ``Link`` per (source,
destination) stage pair of the schedule: its ``TransportKind`` and why): the pipeline's messages
go through its communicator (``comm.p2p(axis, channels)``: ``coconet.runtime.p2p.PeerLinks``),
like every other communication, and routing decides the transport of each channel
(``coconet.runtime.routing.peer_plan``, with the host evidence every group is routed by):
between stages whose ranks share a host, shared memory (``coconet.runtime.p2p.PeerChannels``: a
ring of slots per direction in memory both ranks map, FIFO and untagged as gloo's pair
messages, so ``check``'s proof holds unchanged); otherwise torch.distributed's pair messages
(``isend``/``irecv``, gloo on CPU). ``CommOptions(transport="torch.distributed")`` forces gloo,
``"shared memory"`` insists on one host. Each ring holds every message one ``step()`` puts on
its channel (``coconet.pipeline.schedules.channel_sizes``: a send never waits for a message of
its own step); a ring that would need more than ``routing.RING_BYTES`` goes over gloo instead,
and ``Link.why`` says so. Building a Pipeline whose links include shared memory is collective
over the host's ranks of the axis (they map each other's rings: every one of them builds its
Pipeline at the same point, with the same schedule, which they compare). Every send and receive
runs under the communicator's fault guard (a dead or stalled peer is a ``RuntimeFault``). A rank
whose ``step`` raises (a dead or stalled peer, a wrong output, a Ctrl-C) tells its
shared-memory peers at once (their waits end with a ``RuntimeFault`` instead of at the timeout)
and refuses further steps.

``slice_over="tp"`` is the paper's sliced boundary (``RS_P2P_C_AG``'s point-to-point half): the
ranks of each stage's tp group hold the same activation, so each sends only its contiguous 1/T
of it (flattened) to its peer of the next stage, which all_gathers the slices over its own tp
group (``comm.along("tp")``, shared memory on one host); gradients go back the same way. Every
tp rank's pipeline runs the same steps, each proven by ``check`` with its slice's shape, and the
all_gathers join a stage's tp ranks at the same step of each, so the proof carries over.
With ``slice_dim`` the boundary is the paper's fused one (``ol_RS_fuse_P2P_C_AG`` in training):
the stage's output is already this rank's part along that dim, made by its last layer's
reduce_scatter with the bias, dropout and residual applied to the part alone
(``coconet.nn.RowParallelLinear(sequence_parallel=True)`` given the whole residual), so no rank
computes a whole activation only to send a slice of it; the part is sent as it is, the next
stage all_gathers the parts along that dim, and the gradient goes back as this rank's part of
the whole input gradient there.

The activations' shape and dtype are declared (``activation_shape``: one micro-batch's, or one
per boundary), as Megatron's ``tensor_shape``: the schedule is proven with them, the
shared-memory rings are sized by them, and an output that differs is refused before it is sent.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from coconet import tracing
from coconet.errors import ConfigError, RuntimeFault
from coconet.options import TransportKind
from coconet.pipeline.schedules import (
    Action,
    Kind,
    Step,
    channel_sizes,
    check,
    gpipe,
    one_f_one_b,
)
from coconet.runtime.p2p import Link, PeerLinks
from coconet.tracing import Category

__all__ = ["Pipeline"]

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


class Pipeline:
    """This rank's stage of a pipeline over mesh ``axis`` (the whole world for None).

    Its messages go over shared memory to a stage whose rank shares this rank's host, over
    torch.distributed (gloo) to any other, or to every stage when ``CommOptions(transport=
    "torch.distributed")`` forces it: ``links`` maps each (source, destination) stage pair this
    rank sends or receives on to a ``Link`` (its ``TransportKind`` and why), ``transport_to(peer)``
    gives one (see the module docstring). ``close()`` hands the shared memory back."""

    def __init__(
        self,
        stage: nn.Module,
        comm: Any,
        *,
        micro_batches: int,
        activation_shape: Sequence[int] | Sequence[Sequence[int]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        schedule: str | Sequence[Sequence[Step]] = "1f1b",
        axis: str | None = "pp",
        dtype: torch.dtype = torch.float32,
        slice_over: str | None = None,
        slice_dim: int | None = None,
    ) -> None:
        if not isinstance(stage, nn.Module):
            raise ConfigError(
                f"Pipeline takes this rank's stage as an nn.Module, got {type(stage).__name__}",
                op="Pipeline",
                hint="Pipeline(stage_module, comm, micro_batches=8, ...)",
            )
        if isinstance(schedule, str) and schedule not in SCHEDULES:
            raise ConfigError(f"Pipeline: schedule={schedule!r}", op="Pipeline",
                              hint=f"one of {sorted(SCHEDULES)}, or a schedule: one list of "
                                   "steps per stage")  # fmt: skip
        if axis is not None and axis not in comm.mesh.names:
            raise ConfigError(f"Pipeline: the mesh {comm.mesh} has no axis {axis!r}",
                              op="Pipeline", hint="axis=None pipelines over the whole world")
        self.stage, self.comm, self.loss_fn = stage, comm, loss_fn
        self.axis = axis
        self.ranks = comm.mesh.group_of(comm.rank, axis)
        self.index = comm.mesh.index_in(comm.rank, axis)
        self.stages = len(self.ranks)
        self.micro_batches = micro_batches
        self.dtype = dtype
        self.shapes = _boundary_shapes(activation_shape, self.stages)
        self.full_shapes = list(self.shapes)  # what crosses each boundary, logically
        self.slicer = self._slicer(slice_over, axis)
        self.slice_dim = _slice_dim(slice_dim, slice_over, self.full_shapes)
        if self.slicer is None:
            self.slice_dim = None  # one rank along slice_over: its part is the whole
        if self.slicer is not None and self.slice_dim is None:
            # each rank of the slicing group sends its contiguous 1/T of the flattened tensor
            self.parts = [_parts(math.prod(sh), self.slicer.world) for sh in self.full_shapes]
            self.shapes = [(p[self.slicer.rank],) for p in self.parts]
        elif self.slicer is not None:
            # the stage's output is already this rank's part along slice_dim: sent as it is
            d, rank = self.slice_dim, self.slicer.rank
            self.parts = [_parts(sh[d], self.slicer.world) for sh in self.full_shapes]
            self.shapes = [sh[:d] + (p[rank],) + sh[d + 1 :]
                           for sh, p in zip(self.full_shapes, self.parts, strict=True)]  # fmt: skip
            if any(0 in p for p in self.parts):
                raise ConfigError(
                    f"Pipeline: slice_dim={d} of {self.full_shapes} over "
                    f"{self.slicer.world} ranks leaves a rank nothing to send",
                    op="Pipeline",
                    hint="slice a dim at least as long as the slicing group (the sequence)",
                )
        if self.index == self.stages - 1 and loss_fn is None:
            raise ConfigError("Pipeline: the last stage needs loss_fn(output, target)",
                              op="Pipeline", hint="loss_fn=torch.nn.functional.cross_entropy")
        if isinstance(schedule, str):
            self.schedule = SCHEDULES[schedule](self.stages, micro_batches, self.shapes,
                                                str(dtype).removeprefix("torch."))  # fmt: skip
        else:
            self.schedule = _own_schedule(schedule, self.stages, micro_batches)
        check(self.schedule)  # refused here, naming both ranks' actions, never a hang later
        self.steps: list[Step] = self.schedule[self.index]
        self.broken: str | None = None  # why step() refuses to run (an earlier failure)
        # The channels of the schedule through the communicator (routing decides each one's
        # transport): collective over this host's ranks of the axis when any channel among them
        # runs on shared memory (the same on each of them: the schedule decides). What the
        # host's ranks must agree on before they map each other's rings: the schedule, the dtype.
        size = torch.empty((), dtype=self.dtype).element_size()
        identity = hashlib.sha256(repr((self.schedule, str(self.dtype))).encode()).hexdigest()
        self._p2p: PeerLinks | None = comm.p2p(
            axis, channel_sizes(self.schedule, size), identity=identity[:16], op="Pipeline.step",
            member="stage",
        )  # fmt: skip
        self.links: dict[tuple[int, int], Link] = {
            pair: link for pair, link in self._p2p.links.items() if self.index in pair
        }

    def transport_to(self, peer: int) -> TransportKind | None:
        """What carries this rank's messages to stage ``peer`` (None: the schedule sends it
        nothing)."""
        link = self.links.get((self.index, peer))
        return None if link is None else link.transport

    def close(self) -> None:
        """Hand back the shared-memory channels (the pipeline refuses further steps)."""
        if self.broken is None:
            self.broken = "closed"
        if self._p2p is not None:
            self._p2p.close()
            self._p2p = None

    def _slicer(self, slice_over: str | None, axis: str | None):
        """The communicator of this rank's group along ``slice_over`` (None: whole tensors)."""
        if slice_over is None:
            return None
        comm = self.comm
        if slice_over not in comm.mesh.names or slice_over == axis:
            raise ConfigError(
                f"Pipeline: slice_over={slice_over!r} must be another axis of {comm.mesh} than "
                f"the pipeline's ({axis!r})",
                op="Pipeline",
                hint="slice_over='tp': the tensor-parallel ranks of each stage hold the same "
                "activation, each sends its slice and the next stage all_gathers them",
            )
        if comm.mesh.axis_size(slice_over) == 1:
            return None
        return comm.along(slice_over)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def step(self, inputs: torch.Tensor | None = None,
             targets: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
        """One pass of the schedule: forward and backward of every micro-batch. The first stage
        takes ``inputs``, the last ``targets`` (split along dim 0 into the micro-batches; each
        micro-batch's loss is divided by their number, so the gradients are the whole batch's
        mean's when the loss is a mean). Returns the batch's loss on the last stage, None on the
        others.

        Anything raised here (a peer that died, a wrong output, a Ctrl-C) leaves the pipeline
        out of step with its peers: it is marked broken, its shared-memory peers are told at
        once (their waits fail now, not at the timeout) and later calls are refused."""
        if self.broken is not None:
            raise RuntimeFault(
                f"pipeline stage {self.index} is unusable after an earlier failure "
                f"({self.broken})",
                op="Pipeline.step",
                hint="end this job and start it again (the stages are out of step)",
            )
        try:
            return self._run(inputs, targets)
        except BaseException as exc:
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            self.broken = f"{type(exc).__name__}: {first}"
            if self._p2p is not None:
                self._p2p.abort()
            raise

    def _run(self, inputs: torch.Tensor | None, targets: torch.Tensor | None
             ) -> torch.Tensor | None:  # fmt: skip
        micro_in = self._split(inputs, "inputs") if self.is_first else None
        micro_tg = self._split(targets, "targets") if self.is_last else None
        received: dict[int, torch.Tensor] = {}  # activations in (they require grad)
        outputs: dict[int, torch.Tensor] = {}  # activations out, or the last stage's losses
        grads: dict[int, torch.Tensor] = {}  # gradients of the outputs, from the next stage
        total = None
        for step in self.steps:
            # (the span's text only while something records: a step is a stage's compute)
            detail = "; ".join(a.describe() for a in step) if tracing.active() else None
            with tracing.span(f"stage {self.index}", Category.PIPELINE, detail):
                total = self._act(step, micro_in, micro_tg, received, outputs, grads, total)
        return total

    def _act(self, step: Step, micro_in, micro_tg, received, outputs, grads,
             total: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """Run one step of the schedule (a compute action, or the messages posted together);
        returns the running total of the last stage's loss."""
        first = step[0]
        if first.kind is Kind.FORWARD:
            x = micro_in[first.micro_batch] if self.is_first else received[first.micro_batch]
            y = self.stage(x)
            if self.is_last:
                y = self.loss_fn(y, micro_tg[first.micro_batch]) / self.micro_batches
                total = y.detach() if total is None else total + y.detach()
            outputs[first.micro_batch] = y
        elif first.kind is Kind.BACKWARD:
            y = outputs.pop(first.micro_batch)
            if self.is_last:
                y.backward()
            else:
                torch.autograd.backward(y, grads.pop(first.micro_batch))
        else:
            self._communicate(step, received, outputs, grads)
        return total

    def _split(self, t: torch.Tensor | None, what: str) -> list[torch.Tensor]:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] % self.micro_batches:
            raise ConfigError(
                f"Pipeline.step: stage {self.index} needs {what} whose first dim splits into "
                f"{self.micro_batches} micro-batches, got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}",
                op="Pipeline.step",
                hint="the first stage passes inputs=, the last targets=; the batch size a "
                "multiple of micro_batches",
            )
        return list(t.chunk(self.micro_batches))

    def _communicate(self, step: Step, received, outputs, grads) -> None:
        """Post the step's sends and receives together, then wait for all of them (through the
        communicator's point-to-point channels: a shared-memory send is done when it is posted,
        its message in a ring that holds every message a step() puts on its channel, so none
        waits here for a message of this step)."""
        p2p = self._p2p
        works = []
        for a in step:
            what = self._what(a)
            if a.kind.is_send:
                if a.kind is Kind.SEND_ACTIVATION:
                    t = self._outgoing(outputs[a.micro_batch], a)
                else:
                    t = self._outgoing(received.pop(a.micro_batch).grad, a)
                works.append((a, p2p.send_start(t, a.peer, words=_words(a), label=what)))
            else:
                buf = torch.empty(a.shape, dtype=self.dtype)
                works.append((a, p2p.recv_start(buf, a.peer, words=_words(a), label=what)))
        landed = [(a, p2p.wait(work)) for a, work in works]
        for a, buf in landed:
            if a.kind is Kind.RECV_ACTIVATION:
                received[a.micro_batch] = self._whole(buf, a).requires_grad_()
            elif a.kind is Kind.RECV_GRADIENT:
                grads[a.micro_batch] = self._whole(buf, a)

    def _what(self, a: Action) -> str:
        return f"pipeline stage {self.index}: {a.describe()}"

    def _boundary_of(self, a: Action) -> int:
        """The boundary an action's message crosses (boundary b: between stages b and b + 1)."""
        forward = a.kind in (Kind.SEND_ACTIVATION, Kind.RECV_GRADIENT)
        return self.index if forward else self.index - 1

    def _whole(self, part: torch.Tensor, a: Action) -> torch.Tensor:
        """What crossed ``a``'s boundary: the message itself, or with ``slice_over`` the slices
        of the group's ranks all_gathered (the same on each of them)."""
        if self.slicer is None:
            return part
        if self.slice_dim is not None and a.kind is Kind.RECV_GRADIENT:
            return part  # the gradient of this rank's part: what its sliced output needs
        boundary = self._boundary_of(a)
        sub = self.slicer
        dim = 0 if self.slice_dim is None else self.slice_dim
        work = sub.all_gather_start(part, dim=dim, parts=self.parts[boundary],
                                    axis=sub.mesh.names[0], label=a.describe())  # fmt: skip
        return sub.wait(work).view(self.full_shapes[boundary])

    def _outgoing(self, t: torch.Tensor | None, a: Action) -> torch.Tensor:
        if self.slice_dim is not None and t is not None and a.kind is Kind.SEND_GRADIENT:
            # the gradient of the whole activation this stage received: this rank's part of it,
            # the gradient of the previous stage's sliced output
            full = self.full_shapes[self._boundary_of(a)]
            if tuple(t.shape) == full:
                d, parts = self.slice_dim, self.parts[self._boundary_of(a)]
                t = t.detach().narrow(d, sum(parts[: self.slicer.rank]), parts[self.slicer.rank])
        elif self.slicer is not None and self.slice_dim is None and t is not None:
            full = self.full_shapes[self._boundary_of(a)]
            if tuple(t.shape) != full or t.dtype != self.dtype:
                got = f"{list(t.shape)} {t.dtype}"
                raise ConfigError(
                    f"pipeline stage {self.index}: {a.describe()} is a slice of a {list(full)} "
                    f"{str(self.dtype).removeprefix('torch.')} tensor, but the stage gives {got}",
                    op="Pipeline.step",
                    hint="declare activation_shape as one micro-batch's activation at each "
                    "boundary (the schedule was proven with it)",
                )
            lo = sum(self.parts[self._boundary_of(a)][: self.slicer.rank])
            t = t.detach().reshape(-1)[lo : lo + a.shape[0]]
        if t is None or tuple(t.shape) != a.shape or t.dtype != self.dtype:
            got = "no gradient" if t is None else f"{list(t.shape)} {t.dtype}"
            raise ConfigError(
                f"pipeline stage {self.index}: {a.describe()}, but the stage gives {got}",
                op="Pipeline.step",
                hint="declare activation_shape as one micro-batch's activation at each "
                "boundary (the schedule was proven with it)",
            )
        return t.detach().contiguous()


# A message's kind in its shared-memory header (the receiver checks it against its receive's)
_KIND_WORD = {Kind.SEND_ACTIVATION: 1, Kind.RECV_ACTIVATION: 1, Kind.SEND_GRADIENT: 2,
              Kind.RECV_GRADIENT: 2}  # fmt: skip


def _words(a: Action) -> tuple[int, int]:
    """The two header words of ``a``'s message: its kind and micro-batch."""
    return _KIND_WORD[a.kind], a.micro_batch


def _slice_dim(dim: Any, slice_over: str | None, shapes: list[tuple[int, ...]]) -> int | None:
    """``slice_dim`` checked against every boundary's shape (made non-negative)."""
    if dim is None:
        return None
    if slice_over is None:
        raise ConfigError(
            "Pipeline: slice_dim needs slice_over (the axis whose ranks hold the parts)",
            op="Pipeline",
            hint="Pipeline(..., slice_over='tp', slice_dim=1): each tp rank's stage outputs its "
            "part of the sequence",
        )
    rank = min(len(sh) for sh in shapes)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        raise ConfigError(
            f"Pipeline: slice_dim={dim!r} is not a dim of every boundary's activation {shapes}",
            op="Pipeline",
            hint="the dim along which the stage's last layer reduce_scatters (the sequence)",
        )
    return dim % rank


def _parts(numel: int, n: int) -> list[int]:
    """``numel`` elements in ``n`` contiguous parts, as ``tensor_split`` cuts them."""
    return [numel // n + (1 if r < numel % n else 0) for r in range(n)]


def _own_schedule(schedule: Any, stages: int, micro_batches: int) -> list[list[Step]]:
    """A schedule the caller built (one list of steps per stage, as ``gpipe`` returns): it must
    have one list per stage and compute each micro-batch's forward and backward once on each;
    ``check`` proves the rest (matching, no wait cycle)."""
    if not isinstance(schedule, Sequence) or len(schedule) != stages:
        raise ConfigError(
            f"Pipeline: a schedule is one list of steps per stage ({stages} here), got "
            f"{type(schedule).__name__}" + (f" of {len(schedule)}" if isinstance(schedule,
                                                                              Sequence) else ""),
            op="Pipeline",
            hint="schedule='1f1b', 'gpipe', or coconet.pipeline.one_f_one_b(stages, m, shape)",
        )
    out = [[tuple(step) if isinstance(step, (tuple, list)) else (step,) for step in steps]
           for steps in schedule]  # fmt: skip
    compute = (Kind.FORWARD.value, Kind.BACKWARD.value)
    want = sorted((k, m) for k in compute for m in range(micro_batches))
    for index, steps in enumerate(out):
        done = sorted(
            (a.kind.value, a.micro_batch)
            for step in steps
            for a in step
            if isinstance(a, Action) and a.kind.value in compute
        )
        if done != want:
            raise ConfigError(
                f"Pipeline: stage {index} of the schedule does not run the forward and the "
                f"backward of each of the {micro_batches} micro-batches once",
                op="Pipeline",
                details=[f"it runs {[f'{k}{m}' for k, m in done]}"],
                hint="micro_batches= must be the number the schedule was built for",
            )
    return out


def _boundary_shapes(shape: Any, stages: int) -> list[tuple[int, ...]]:
    if isinstance(shape, Sequence) and shape and all(isinstance(s, int) for s in shape):
        return [tuple(shape)] * max(stages - 1, 1)
    if isinstance(shape, Sequence) and len(shape) == stages - 1 and all(
        isinstance(s, Sequence) and all(isinstance(d, int) for d in s) for s in shape
    ):
        return [tuple(s) for s in shape]
    raise ConfigError(
        f"Pipeline: activation_shape is one micro-batch's activation shape, or one per "
        f"boundary ({stages - 1} here), got {shape!r}",
        op="Pipeline",
        hint="activation_shape=(micro_batch_size, hidden)",
    )
