"""The cost model: what one step of a candidate should take, and why.

Every cost is a ``Curve``: seconds as a function of bytes, measured at a few sizes on the machine
at hand (``coconet.tune.calibrate``) or written from a cluster description
(``coconet.tune.cluster``), with the alpha-beta line fitted to the points (alpha: the latency,
seconds; beta: seconds per byte). Between two measured sizes the curve is the line through them
(a local alpha-beta: caches make bandwidth depend on size), outside them the fitted line.

A machine (``MachineModel``) has

- one curve per (transport, collective op, algorithm) in bytes of the full tensor (what a rank
  passes to an all_reduce or reduce_scatter, what an all_gather returns), and for shared memory
  a second one for an all_reduce that reduces in place (a donated buffer in symmetric memory);
  a reduction's arithmetic (CoCoNet's gamma) is inside what was measured;
- ``memory``: a fused kernel's pass (read and write) by bytes moved, every rank at once, since
  the ranks share the memory bus; ``eager``: the same for unfused ops run one after the other;
- ``op_overhead``: what every op or kernel call costs besides its data (dispatch), and
  ``step_overhead``: the fixed cost of one step call on each transport (binding and checking
  the inputs, the generated code's bookkeeping, the commit);
- ``flops``: one rank's matmul rate;
- ``control``: one round of the per-step agreement (the handshake, the commit vote);
- ``overlap``: the fraction of a collective that runs behind computation when both are in
  flight: 0 on a CPU host whose ranks fill the cores (communication needs the same cores), 1 on
  GPUs (copy engines, NVLink).

``predict`` walks the plan a candidate lowers to (``coconet.codegen.lower``) step by step, as the
generated code runs it: each eager op and fused kernel by its bytes moved and flops (the op
specs' model, ``Prop``/``work``), each collective by its curve, a fused collective over shared
memory as the one pass it is (its kernel reads every peer's slice: its bytes at ``memory``, plus
the gather's copy and two synchronisations), an overlapped chain as fill + (k-1) x max(compute,
comm) + drain (blended with the sum by ``overlap``), and the commit by what it copies.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coconet.accounting import Counter
from coconet.codegen.forms import Form, Forms, forms
from coconet.codegen.plan import (
    ChunkLoop,
    Compute,
    FusedCollective,
    Kernel,
    Start,
    Wait,
    lower,
)
from coconet.errors import ConfigError
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.opspec import CurveBytes, Prop, Traffic, spec
from coconet.options import Algorithm, CommitMode, TransportKind
from coconet.tune.candidates import Candidate

__all__ = ["Curve", "MachineModel", "Part", "Prediction", "collective_inputs", "predict"]


@dataclass(frozen=True)
class Curve:
    """Seconds by bytes: measured ``points`` (bytes ascending) and the alpha-beta line fitted to
    them (``fit``), or a line alone (a cluster description)."""

    alpha: float
    beta: float
    points: tuple[tuple[float, float], ...] = ()

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> Curve:
        """The alpha-beta line closest to ``points`` in relative error (each point weighs alike
        whatever its size: a 64 KiB time of 50 us matters as much as a 64 MiB one of 50 ms).

        Weighted least squares of ``t = alpha + beta * b`` with weights ``1 / t^2``; alpha and
        beta are kept >= 0 (a negative latency is noise)."""
        pts = tuple(sorted((float(b), float(t)) for b, t in points))
        if not pts:
            raise ConfigError("a curve needs at least one point", op="Curve.fit")
        if len(pts) == 1:
            b, t = pts[0]
            return cls(0.0, t / b if b else 0.0, pts)
        sw = swb = swbb = swt = swbt = 0.0
        for b, t in pts:
            w = 1.0 / max(t, 1e-12) ** 2
            sw += w
            swb += w * b
            swbb += w * b * b
            swt += w * t
            swbt += w * b * t
        det = sw * swbb - swb * swb
        beta = (sw * swbt - swb * swt) / det if det else 0.0
        alpha = (swt - beta * swb) / sw
        if alpha < 0:  # refit through the origin
            alpha, beta = 0.0, swbt / swbb
        if beta < 0:
            alpha, beta = swt / sw, 0.0
        return cls(alpha, beta, pts)

    def __call__(self, nbytes: float) -> float:
        pts = self.points
        if len(pts) >= 2 and pts[0][0] <= nbytes <= pts[-1][0]:
            i = min(max(bisect.bisect_left([b for b, _ in pts], nbytes), 1), len(pts) - 1)
            (b0, t0), (b1, t1) = pts[i - 1], pts[i]
            if b1 <= b0:
                return t1
            f = (nbytes - b0) / (b1 - b0)
            return min(max(t0 * (1 - f) + t1 * f, min(t0, t1)), max(t0, t1))
        if len(pts) >= 2 and nbytes > pts[-1][0]:
            # past the largest size: that size's time plus the fitted per-byte cost
            return pts[-1][1] + self.beta * (nbytes - pts[-1][0])
        line = self.alpha + self.beta * nbytes
        if pts and nbytes < pts[0][0]:
            # below the smallest size: never slower than that size (the line may pass above it)
            return min(line, pts[0][1])
        return line

    @property
    def bandwidth(self) -> float:
        """Bytes per second at large sizes (1 / beta)."""
        return 1.0 / self.beta if self.beta > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta, "points": [list(p) for p in self.points]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Curve:
        return cls(float(d["alpha"]), float(d["beta"]), tuple(tuple(p) for p in d["points"]))


CollectiveKey = tuple[TransportKind, Op, "Algorithm | None", bool]  # ..., in place


def _key_text(k: CollectiveKey) -> str:
    transport, op, algorithm, in_place = k
    return "|".join(
        [
            transport.value,
            op.value,
            algorithm.value if algorithm else "",
            "in place" if in_place else "",
        ]
    )


def _key_parse(text: str) -> CollectiveKey:
    transport, op, algorithm, in_place = text.split("|")
    return (
        TransportKind(transport),
        Op(op),
        Algorithm(algorithm) if algorithm else None,
        bool(in_place),
    )


@dataclass
class MachineModel:
    """What the cost model knows about a machine (see the module's docstring)."""

    description: str
    world: int
    collectives: dict[CollectiveKey, Curve]
    memory: Curve
    flops: float
    control: dict[TransportKind, float]
    op_overhead: float = 5e-6  # seconds per eager op or kernel call (Python and dispatch)
    overlap: float = 0.0
    eager: Curve | None = None  # unfused ops one after the other (None: as ``memory``)
    # the fixed cost of a step call on each transport (binding, checks, commit bookkeeping)
    step_overhead: dict[TransportKind, float] = field(default_factory=dict)
    # A cluster description's collectives: (op, transport, bytes, group size) -> seconds, used
    # instead of ``collectives`` when set (coconet.tune.cluster).
    formula: Any = field(default=None, repr=False)

    def collective(
        self,
        op: Op,
        transport: TransportKind,
        nbytes: float,
        group: int,
        algorithm: Algorithm | None = None,
        in_place: bool = False,
    ) -> tuple[float, Algorithm | None]:
        """(seconds, algorithm) of ``op`` on ``nbytes`` over ``group`` ranks: the given
        algorithm, else the fastest this machine has for it."""
        if group <= 1:
            return 0.0, None
        if self.formula is not None:
            return self.formula(op, transport, nbytes, group), algorithm
        options = [
            (curve(nbytes), a)
            for (t, o, a, ip), curve in self.collectives.items()
            if t is transport
            and o is op
            and (algorithm is None or a is algorithm)
            and ip == in_place
        ]
        if not options and in_place:
            return self.collective(op, transport, nbytes, group, algorithm, in_place=False)
        if not options and spec(op).comm_cost.traffic is not Traffic.RING:
            # not calibrated (rooted, point to point): like an all_gather of the whole tensor
            # (one copy of each byte)
            return self.collective(Op.ALL_GATHER, transport, nbytes, group)
        if not options:
            raise ConfigError(
                f"the cost model has no calibration for {op} on {transport.value}",
                op="coconet.tune.cost",
                hint="calibrate the machine again (coconet tune --retune)",
            )
        return min(options, key=lambda x: x[0])

    def compute(self, bytes_moved: float, flops: float, eager: bool = False) -> float:
        """Seconds of a local computation that moves ``bytes_moved`` and does ``flops``: a
        fused kernel's pass, or (``eager``) an unfused op."""
        curve = self.eager if eager and self.eager is not None else self.memory
        return max(curve(bytes_moved) if bytes_moved else 0.0, flops / self.flops)

    def to_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "world": self.world,
            "collectives": {_key_text(k): c.to_json() for k, c in self.collectives.items()},
            "memory": self.memory.to_json(),
            "flops": self.flops,
            "control": {t.value: s for t, s in self.control.items()},
            "op_overhead": self.op_overhead,
            "overlap": self.overlap,
            "eager": None if self.eager is None else self.eager.to_json(),
            "step_overhead": {t.value: s for t, s in self.step_overhead.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MachineModel:
        return cls(
            description=str(d["description"]),
            world=int(d["world"]),
            collectives={_key_parse(k): Curve.from_json(c) for k, c in d["collectives"].items()},
            memory=Curve.from_json(d["memory"]),
            flops=float(d["flops"]),
            control={TransportKind(t): float(s) for t, s in d["control"].items()},
            op_overhead=float(d.get("op_overhead", 5e-6)),
            overlap=float(d.get("overlap", 0.0)),
            eager=Curve.from_json(d["eager"]) if d.get("eager") else None,
            step_overhead={
                TransportKind(t): float(s) for t, s in d.get("step_overhead", {}).items()
            },
        )


@dataclass(frozen=True)
class Part:
    """One term of a prediction: what it is, its kind and its seconds."""

    what: str
    kind: str  # "compute", "communication", "commit", "control"
    seconds: float


@dataclass
class Prediction:
    """A candidate's predicted step time, term by term."""

    candidate: Candidate
    parts: list[Part]
    algorithms: dict[Op, Algorithm]  # the algorithm the model chose for each collective op

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def ms(self) -> float:
        return 1e3 * self.seconds

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.parts:
            out[p.kind] = out.get(p.kind, 0.0) + p.seconds
        return out


# -- the walk over the plan ---------------------------------------------------------------------


def collective_inputs(program) -> tuple[str, ...]:
    """The tensor inputs of ``program`` that a collective reads directly (a gradient): the
    ones a step can take in symmetric memory (``CompiledStep.input_buffer``)."""
    users = program.users()
    return tuple(
        n.name
        for n in program.inputs
        if n.type.rank
        and any(spec(u.op).has(Prop.COMMUNICATES) for u in users.get(n.name, ()))
    )


class _Walk:
    def __init__(
        self,
        model: MachineModel,
        mesh: Mesh,
        sizes: Mapping[str, int],
        transport: TransportKind,
        algorithms: Mapping[Op, Algorithm],
        donated: frozenset[str],
        registered: frozenset[str],
        unit_forms: Forms,
        replicas: frozenset[str] = frozenset(),
    ) -> None:
        self.model = model
        self.replicas = replicas  # inputs passed as host replicas (coconet.runtime.replica)
        self.forms = unit_forms  # the forms the emitter writes (coconet.codegen.forms)
        self.mesh = mesh
        self.counter = Counter(mesh, sizes)
        self.transport = transport
        self.fixed = dict(algorithms)
        self.chosen: dict[Op, Algorithm] = {}
        self.largest: dict[Op, int] = {}  # the bytes of each op's largest use so far
        self.donated = donated
        self.registered = registered
        self.rank = 0  # rank 0 holds the largest slice of an uneven split: the slowest rank

    def nbytes(self, node: Node) -> int:
        if node.type.rank == 0:
            return 0
        return self.counter.local_bytes(node.type, self.rank)

    def full_bytes(self, node: Node) -> int:
        return 0 if node.type.rank == 0 else self.counter.full_bytes(node.type)

    def group(self, node: Node) -> int:
        axis = node.attr("axis")
        return self.mesh.axis_size(axis) if axis is not None else self.mesh.size

    # -- terms -----------------------------------------------------------------------------------

    def compute(self, node: Node) -> float:
        if node.op is Op.SCATTER or not spec(node.op).has(Prop.KERNEL) or not node.type.rank:
            return self.model.op_overhead  # a view, or arithmetic on 0-d values: dispatch only
        work = self.counter.work(node, self.rank)
        return self.model.op_overhead + self.model.compute(
            work.bytes_moved, work.flops, eager=True
        )

    def kernel(self, k: Kernel, skip_reads: frozenset[str] = frozenset()) -> tuple[float, float]:
        """(seconds, bytes moved) of one fused kernel call: what it reads from outside and what
        it writes for later (its intermediates stay in registers)."""
        moved = sum(self.nbytes(n) for n in k.inputs if n.name not in skip_reads)
        moved += sum(self.nbytes(n) for n in k.outputs)
        flops = sum(self.counter.work(n, self.rank).flops for n in k.nodes)
        return self.model.op_overhead + self.model.compute(moved, flops), moved

    def collective(self, node: Node, in_place: bool = False) -> float:
        op = node.op
        keyed = spec(op).comm_cost.curve_bytes  # what the op's curve is measured by
        if keyed is CurveBytes.OUTPUT:
            nbytes = self.full_bytes(node)
        elif keyed is CurveBytes.OWN:
            nbytes = self.nbytes(node.inputs[0])
        else:
            nbytes = self.full_bytes(node.inputs[0]) if node.inputs[0].type.rank else 8
        fixed = self.fixed.get(op) if self.transport is TransportKind.TORCH_DISTRIBUTED else None
        seconds, algorithm = self.model.collective(
            op, self.transport, nbytes, self.group(node), fixed, in_place
        )
        if algorithm is not None and self.transport is TransportKind.TORCH_DISTRIBUTED:
            # one algorithm per op (CommOptions fixes it by op): the one of its largest use
            if nbytes >= self.largest.get(op, 0):
                self.chosen[op] = algorithm
                self.largest[op] = nbytes
        return self.model.op_overhead + seconds

    def staging(self, node: Node, parts: list[Part], where: str) -> None:
        """Over shared memory, an operand of a reduction that does not live in symmetric memory
        (a computed value, or an input passed as an ordinary tensor) is copied in first."""
        operand = node.inputs[0]
        if (
            self.transport is TransportKind.SHARED_MEMORY
            and node.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER)
            and operand.name not in self.registered
            and operand.type.rank
        ):
            what = f"{where}{operand.name} copied into symmetric memory"
            seconds = self.model.memory(2 * self.nbytes(operand))
            parts.append(Part(what, "communication", seconds))

    def sync(self) -> float:
        """One synchronisation of a shared-memory group (the latency of its collectives)."""
        curve = self.model.collectives.get(
            (TransportKind.SHARED_MEMORY, Op.ALL_REDUCE, None, False)
        )
        return curve.alpha if curve is not None else 0.0

    def steps(self, steps, parts: list[Part], where: str) -> None:
        for s in steps:
            if isinstance(s, Compute):
                parts.append(
                    Part(f"{where}{s.node.name} ({s.node.op})", "compute", self.compute(s.node))
                )
            elif isinstance(s, Start) and self.forms.of(s) is Form.READ_IN_PLACE:
                self.read_in_place(s.node, parts, where)
            elif isinstance(s, Start):
                operand = s.node.inputs[0].name
                in_place = (
                    self.transport is TransportKind.SHARED_MEMORY
                    and s.node.op is Op.ALL_REDUCE
                    and operand in self.donated
                    and operand in self.registered
                )
                self.staging(s.node, parts, where)
                parts.append(
                    Part(
                        f"{where}{s.node.name} ({s.node.op})",
                        "communication",
                        self.collective(s.node, in_place),
                    )
                )
            elif isinstance(s, Wait):
                continue
            elif isinstance(s, Kernel):
                parts.append(
                    Part(f"{where}{s.name} ({len(s.nodes)} ops)", "compute", self.kernel(s)[0])
                )
            elif isinstance(s, FusedCollective):
                self.fused(s, parts)
            elif isinstance(s, ChunkLoop):
                self.loop(s, parts)

    def read_in_place(self, node: Node, parts: list[Part], where: str) -> None:
        """An all_reduce whose consumer reads it where each slice's owner reduced it: the
        collective less its last pass, the copy of every owner's slice into this rank's tensor
        (read and written: twice the tensor's bytes), which the consumer kernel skips."""
        self.staging(node, parts, where)
        whole = self.collective(node)
        copy = self.model.memory(2 * self.full_bytes(node))
        seconds = max(whole - copy, self.model.op_overhead + 2 * self.sync())
        parts.append(Part(f"{where}{node.name} ({node.op}, read in place)", "communication",
                          seconds))

    def fused(self, unit: FusedCollective, parts: list[Part]) -> None:
        one = self.forms.one_pass(unit)
        if one is None:
            self.steps(unit.steps, parts, f"{unit.name}: ")
            return
        for s in one.scalars:
            parts.append(Part(f"{unit.name}: {s.node.name}", "compute", self.compute(s.node)))
        # The kernel reads every peer's rows of its slice of the reduce_scatter's input (the
        # slice's bytes, once per rank) instead of a reduced copy, and writes its gather slot.
        seconds, _ = self.kernel(one.kernel)
        if one.reduce_scatter is not None:
            rs = one.reduce_scatter
            self.staging(rs, parts, f"{unit.name}: ")
            extra = (self.group(rs) - 1) * self.nbytes(rs)  # the peers' rows besides the own
            seconds += self.model.memory(extra) if extra else 0.0
        parts.append(Part(f"{unit.name}: one pass ({one.kernel.name})", "compute", seconds))
        syncs = (one.reduce_scatter is not None) + (one.all_gather is not None)
        parts.append(Part(f"{unit.name}: synchronisation", "communication", syncs * self.sync()))
        if one.all_gather is not None:
            target = self.forms.commit_target(one.all_gather)
            if target is not None and target.name in self.replicas:
                # committed into a host replica: every rank wrote its slot in the spare buffer
                # (the kernel's write, counted above) and the commit flips it; nothing is copied
                return
            # every peer's slot read, the whole tensor written: by the gather, or by the commit
            # of a published one
            full = self.full_bytes(one.all_gather)
            parts.append(
                Part(
                    f"{unit.name}: gather {one.all_gather.name}",
                    "communication",
                    self.model.memory(2 * full),
                )
            )

    def loop(self, loop: ChunkLoop, parts: list[Part]) -> None:
        k = loop.chunks
        stage_compute: list[float] = []
        stage_comm: list[float] = []
        scale = 1.0 / k
        for stage in loop.stages:
            sub: list[Part] = []
            self.steps(stage, sub, "")
            # each chunk moves 1/k of the data and pays each call's fixed costs
            compute = sum(p.seconds for p in sub if p.kind == "compute")
            comm = sum(p.seconds for p in sub if p.kind == "communication")
            stage_compute.append(compute * scale + self.model.op_overhead)
            stage_comm.append(comm * scale + self.model.op_overhead)
        per_chunk = [c + m for c, m in zip(stage_compute, stage_comm, strict=True)]
        # fill: the first chunk through every stage; steady state: the slowest stage; drain
        fill = sum(per_chunk)
        slowest = max(per_chunk) if per_chunk else 0.0
        serial = sum(per_chunk)
        busy = self.model.overlap * slowest + (1 - self.model.overlap) * serial
        total = fill + (k - 1) * busy
        parts.append(
            Part(
                f"{loop.name} ({k} chunks: fill + {k - 1} x steady)",
                "compute" if not any(stage_comm) else "communication",
                total,
            )
        )


def predict(
    candidate: Candidate,
    sizes: Mapping[str, int],
    model: MachineModel,
    mesh: Mesh | int,
    *,
    donate: Sequence[str] = (),
    commit: CommitMode = CommitMode.COPY,
    commit_vote: bool = True,
    registered: Sequence[str] | None = None,
    replicas: Sequence[str] = (),
) -> Prediction:
    """The predicted step of ``candidate`` with ``sizes`` bound (``{"N": 16777216}``) on
    ``mesh`` (a Mesh or a world size) of ``model``'s machine.

    ``registered``: the inputs passed in symmetric memory (``CompiledStep.input_buffer``);
    None: every input a collective reads (what the tuner measures, and what ``coconet.optim``
    does with the gradient). ``replicas``: the inputs passed as host replicas
    (``CompiledStep.host_replica``: ``coconet.optim``'s ``param_storage="host-shared"``); a
    candidate whose published gather is committed into one copies nothing at its commit."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh.world(mesh)
    program = candidate.scheduled
    plan = lower(program, frozenset(donate))
    unit_forms = forms(plan, candidate.transport)
    if registered is None:
        registered = collective_inputs(candidate.program)
    walk = _Walk(
        model,
        mesh,
        sizes,
        candidate.transport,
        dict(candidate.algorithms),
        frozenset(donate),
        frozenset(registered),
        unit_forms,
        frozenset(replicas),
    )
    parts: list[Part] = []
    walk.steps(plan.body, parts, "")
    # The commit: a copy of each updated input's new value (swap: a published gather only,
    # the rest takes the new storage).
    published = unit_forms.published
    for u in program.updates:
        target, value = u.inputs
        if commit is CommitMode.SWAP and value.name not in published:
            continue
        if value.name in published:
            continue  # counted with the gather (the commit is where its copy happens)
        nbytes = walk.nbytes(target)
        if nbytes:
            parts.append(Part(f"commit {target.name}", "commit", model.memory(2 * nbytes)))
    control = model.control.get(candidate.transport, 0.0)
    rounds = 1 + bool(commit_vote) if mesh.size > 1 else 0
    parts.append(Part(f"agreement ({rounds} round(s))", "control", rounds * control))
    fixed = model.step_overhead.get(candidate.transport, 0.0)
    if fixed:
        parts.append(Part("the step call's fixed cost", "control", fixed))
    return Prediction(candidate, parts, dict(walk.chosen))
