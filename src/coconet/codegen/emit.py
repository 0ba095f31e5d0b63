"""Python source for a lowered program: one readable module per (program, schedule, world, ...).

The module defines ``step(comm, env, kernels, <inputs...>)``, which runs one step on the calling
rank and returns ``(outputs, updates)``, both dicts of tensors; the caller commits the updates. Each
DSL op is one line with a comment giving the op as the program prints it and the user's file:line.
Local ops call the definitions the simulator uses (``coconet.ir.semantics``), so the generated
code and the reference cannot drift apart; the form each op takes is its spec's ``Lowering``
(``coconet.ir.opspec``). Collectives are explicit start/wait pairs on ``comm``, calling the
transport operation and arguments their spec names; ``env`` holds this rank's sizes
(``coconet.codegen.geometry``); ``kernels`` holds the fused kernels, compiled or not
(``coconet.codegen.kernels``).

This is the default lowering: every unit's steps one after the other, a chunk loop as a software
pipeline. It knows no transport: a transport whose forms (``coconet.codegen.forms``) write some
units otherwise overrides them in its ``Emission`` (``coconet.codegen.lowering``), registered in
``coconet.codegen.emissions.EMISSIONS``; the emitter asks those overrides first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from coconet.codegen.emissions import EMISSIONS
from coconet.codegen.forms import Form, Forms, forms
from coconet.codegen.lowering import ChunkLoopLowering, Emission
from coconet.codegen.names import Namer
from coconet.codegen.plan import (
    ChunkLoop,
    Compute,
    FusedCollective,
    Kernel,
    Plan,
    Start,
    Wait,
)
from coconet.codegen.source import INDENT as _INDENT
from coconet.codegen.source import GeoRef
from coconet.codegen.source import call as _call
from coconet.codegen.source import comment_lines as _comment_lines
from coconet.codegen.source import dtype as _dtype
from coconet.codegen.source import env_geo as _env_geo
from coconet.codegen.source import env_ref as _env_ref
from coconet.codegen.source import short as _short
from coconet.errors import CodegenError
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.opspec import Arg, Lowering, spec
from coconet.ir.types import DType

__all__ = ["EMISSIONS", "emit"]

_T = TypeVar("_T")


def emit(plan: Plan, header: Sequence[str], unit_forms: Forms | None = None) -> str:
    """The module's source. ``header`` lines go first, as comments (program, schedule, key...);
    ``unit_forms`` (``coconet.codegen.forms.forms(plan, transports)``) says what runs each mesh
    axis's collectives and in which form each unit runs there (default: torch.distributed, every
    unit plainly)."""
    return _Emitter(plan, unit_forms if unit_forms is not None else forms(plan)).module(header)


class _Emitter:
    def __init__(self, plan: Plan, unit_forms: Forms) -> None:
        if unit_forms.plan is not plan:
            raise CodegenError(
                "internal: the forms were found for another plan",
                op="emit",
                hint="a coconet bug: call emit(plan, header, forms(plan, transports))",
            )
        self.plan = plan
        self.forms = unit_forms
        self.program = plan.program
        namer = Namer()
        self.namer = namer
        self.var: dict[str, str] = {}
        for n in self.program.nodes:
            if n.op is Op.CONST:
                continue
            self.var[n.name] = namer.claim(n.name)
        # one module-level tensor per distinct (value, dtype): `1 - beta1` and `1 - beta2` share
        self.const_names: dict[tuple, list[str]] = {}
        for n in plan.constants:
            key = (repr(n.attr("value")), n.type.dtype)
            if key not in self.const_names:
                self.const_names[key] = []
            self.const_names[key].append(n.name)
            self.var[n.name] = f"_c{list(self.const_names).index(key) + 1}"
        starts = [s for s in plan.steps if isinstance(s, Start)]
        starts += [
            s for loop in plan.loops for st in loop.stages for s in st if isinstance(s, Start)
        ]
        starts += [Start(d.collective, donate=True) for d in plan.deferred]
        self.work = {s.node.name: namer.claim(f"{self.var[s.node.name]}_work") for s in starts}
        # per kernel: (node, geometry field, parameter name) for the sizes a kernel is passed
        self._geo_cache: dict[str, list[tuple[Node, str, str]]] = {}
        # the overrides of each transport that has forms of its own (coconet.codegen.forms)
        self._emissions: list[Emission] = [make(self) for make in EMISSIONS.values()]

    def override(self, hook: Callable[[Emission], _T | None]) -> _T | None:
        """The first transport override's answer for a unit (None: the default lowering)."""
        for emission in self._emissions:
            answer = hook(emission)
            if answer is not None:
                return answer
        return None

    # -- the module -----------------------------------------------------------------------------

    def module(self, header: Sequence[str]) -> str:
        out: list[str] = [f'"""coconet: the generated step of program {self.program.name}."""', ""]
        for h in header:
            out += _comment_lines(h, "# ") if h else ["#"]
        out += [
            "",
            "import torch",
            "",
            "from coconet.ir.ops import Op, ReduceOp  # noqa: F401",
            "from coconet.ir import semantics as _ops",
            *(["from coconet.ir import chunks as _chunked"] if self.plan.loops else []),
            "",
        ]
        if self.const_names:
            out.append("# the program's constants: 0-d tensors of their dtype, as in the simulator")
            for k, ((value, dtype), users) in enumerate(self.const_names.items(), start=1):
                out.append(
                    f"_c{k} = torch.tensor({value}, dtype={_dtype(dtype)})  # {', '.join(users)}"
                )
            out.append("")
        used = sorted(
            {n.op for n in self.program.nodes if spec(n.op).lowering is Lowering.POINTWISE},
            key=lambda op: op.value,
        )
        if used:
            out.append(
                "# each op's local meaning, shared with the simulator (coconet.ir.semantics)"
            )
            out += [f"_{op.value} = _ops.POINTWISE[Op.{op.name}]" for op in used]
            out.append("")
        names = ", ".join(repr(n.name) for n in self.program.inputs)
        out.append("# the program's inputs, in the order step() takes them")
        out.append(f"INPUTS = ({names}{',' if len(self.program.inputs) == 1 else ''})")
        for emission in self._emissions:
            out += emission.declarations()
        rides = self.agreement_rides()
        if rides is not None:
            out += [
                "# the step's first communication is this all_reduce: the step's agreement may",
                "# ride with it, one round for both (coconet.runtime.handshake)",
                f"AGREEMENT = {rides.node.name!r}",
            ]
        # each kernel in its transport's form where it has one (written in that form only: the
        # other is never run), else as it is
        names = []
        for k in self.plan.kernels:
            own = self.override(lambda emission, k=k: emission.kernel_def(k))
            fn, lines = own if own is not None else (k.name, self.kernel_def(k))
            out += ["", "", *lines]
            names.append((k.name, fn))
        entries = ", ".join(f'"{name}": _kernel_{fn}' for name, fn in names)
        out += ["", "", f"KERNELS = {{{entries}}}", "", ""]
        out += self.step_def()
        if self.plan.deferred:
            out += ["", "", *self.deferred_defs()]
        return "\n".join(out) + "\n"

    def agreement_rides(self) -> Start | None:
        """The step's first communication when it is an all_reduce run plainly (a start of
        its own: not read in place, not on the control channel, not in a fused unit or a chunk
        loop), which the step's agreement may ride with; None otherwise."""
        for s in self.plan.body:
            if isinstance(s, (Compute, Kernel)):
                continue
            if isinstance(s, Start) and s.node.op is Op.ALL_REDUCE and (
                self.forms.of(s) is Form.PLAIN
            ):
                return s
            return None
        return None

    def kernel_def(self, k: Kernel) -> list[str]:
        params = [self.var[i.name] for i in k.inputs] + [p for _, _, p in self.geo_params(k)]
        geo = {(n.name, f): p for n, f, p in self.geo_params(k)}
        lines = [
            f"def _kernel_{k.name}({', '.join(params)}):",
            f'{_INDENT}"""{_short(k.group)}: one kernel (torch.compile, or eager)."""',
        ]
        for n in k.nodes:
            lines += [_INDENT + c for c in self.node_lines(n, lambda n, f: geo.get((n.name, f)))]
        outs = ", ".join(self.var[n.name] for n in k.outputs)
        lines.append(f"{_INDENT}return ({outs}{',' if len(k.outputs) == 1 else ''})")
        return lines

    def geo_params(self, k: Kernel) -> list[tuple[Node, str, str]]:
        if k.name not in self._geo_cache:
            self._geo_cache[k.name] = [
                (n, f, self.namer.claim(f"{self.var[n.name]}_{f[:-1]}"))
                for n in k.nodes
                if spec(n.op).lowering is Lowering.RANDOM
                for f in ("shapes", "offsets", "rows")
                if f != "rows" or k.chunked
            ]
        return self._geo_cache[k.name]

    def step_def(self) -> list[str]:
        params = ["comm", "env", "kernels"] + [self.var[n.name] for n in self.program.inputs]
        lines = [
            f"def step({', '.join(params)}):",
            f'{_INDENT}"""One step on this rank: (outputs, updates); the caller commits."""',
        ]
        body: list[str] = []
        # sizes known once the step's input shapes are bound (x / N, world_size): 0-d tensors
        for n in self.program.nodes:
            if spec(n.op).lowering is Lowering.SIZE:
                value = f"env.values[{n.name!r}], dtype={_dtype(n.type.dtype)}"
                body += [self.comment(n), f"{self.var[n.name]} = torch.tensor({value})"]
        for s in self.plan.body:
            if isinstance(s, ChunkLoop):
                body += self.loop_lines(s)
            elif isinstance(s, FusedCollective):
                body += self.fused_collective_lines(s)
            else:
                body += self.step_lines(s, _env_geo)
        outs = [f"{n.name!r}: {self.var[n.name]}" for n in self.program.outputs]
        for d in self.plan.deferred:  # handed to start_deferred once the step has committed
            x = self.var[d.operand.name]
            outs.append(f"{d.collective.name!r}: {x}.clone()" if d.snapshot else
                        f"{d.collective.name!r}: {x}")
        landed = {u.name for d in self.plan.deferred for u in d.updates}
        ups = ", ".join(
            f"{u.inputs[0].name!r}: {self.var[u.inputs[1].name]}"
            for u in self.program.updates
            if u.name not in landed
        )
        body.append(f"return {{{', '.join(outs)}}}, {{{ups}}}")
        return lines + [_INDENT + b for b in body]

    def deferred_defs(self) -> list[str]:
        """``DEFERRED`` (each deferred collective -> the inputs it lands in), ``start_deferred``
        (run once the step has committed on every rank) and ``land`` (run at the next call's
        start, before anything else): the two halves of ``coconet.schedule.defer``."""
        lands = ", ".join(f"{d.collective.name!r}: {d.lands_in!r}" for d in self.plan.deferred)
        start = [
            "def start_deferred(comm, env, kernels, operands):",
            f'{_INDENT}"""The deferred collectives, started from their snapshots (schedule: '
            'defer)."""',
        ]
        for d in self.plan.deferred:
            s = Start(d.collective, donate=True)  # the snapshot is the collective's alone
            start += [_INDENT + f"{self.var[d.operand.name]} = operands[{d.collective.name!r}]"]
            start += [_INDENT + b for b in self.start_lines(s, _env_geo)]
        works = ", ".join(f"{d.collective.name!r}: {self.work[d.collective.name]}"
                          for d in self.plan.deferred)
        start.append(f"{_INDENT}return {{{works}}}")
        land = [
            "def land(comm, env, kernels, works):",
            f'{_INDENT}"""The previous call\'s deferred collectives waited for, and their values '
            'up to the inputs they update."""',
        ]
        body: list[str] = []
        for d in self.plan.deferred:
            c = d.collective.name
            body.append(f"{self.var[c]} = comm.wait(works[{c!r}])")
            reads = {i.name for n in (*d.prelude, *d.chain) for i in n.inputs}
            for n in self.program.nodes:
                if n.name in reads and spec(n.op).lowering is Lowering.SIZE:
                    value = f"env.values[{n.name!r}], dtype={_dtype(n.type.dtype)}"
                    body += [self.comment(n), f"{self.var[n.name]} = torch.tensor({value})"]
            for n in (*d.prelude, *d.chain):
                body += self.node_lines(n, _env_geo)
        ups = ", ".join(f"{u.inputs[0].name!r}: {self.var[u.inputs[1].name]}"
                        for d in self.plan.deferred for u in d.updates)
        body.append(f"return {{{ups}}}")
        return [
            f"# each deferred collective -> the inputs its landing updates\nDEFERRED = {{{lands}}}",
            "",
            "",
            *start,
            "",
            "",
            *land,
            *(_INDENT + b for b in body),
        ]

    def step_lines(self, s: Compute | Kernel | Start | Wait, geo: GeoRef) -> list[str]:
        if isinstance(s, Compute):
            return self.node_lines(s.node, geo)
        own = self.override(lambda emission: emission.step_lines(s, geo))
        if own is not None:
            return own
        if isinstance(s, Kernel):
            return self.kernel_call(s, geo)
        if isinstance(s, Start):
            if self.forms.of(s) is Form.CONTROL:
                return self.control_lines(s)
            return self.start_lines(s, geo)
        name = s.node.name
        return [f"{self.var[name]} = comm.wait({self.work[name]})"]

    def fused_collective_lines(self, unit: FusedCollective) -> list[str]:
        """A fused collective: a header naming its collectives and kernels, then its steps."""
        parts = []
        for s in unit.steps:
            if isinstance(s, Start):
                parts.append(f"{s.node.op} {s.node.name}")
            elif isinstance(s, Kernel):
                parts.append(f"kernel {s.name}")
        own = self.override(lambda emission: emission.fused_collective_lines(unit, parts))
        if own is not None:
            return own
        transport = self.forms.transport(unit.collectives[0].attr("axis"))
        lines = _comment_lines(
            f"{unit.name}: {', '.join(parts)} -- one fused collective; {transport.value} runs "
            "its collectives and kernels one after the other",
            "# ",
        )
        for s in unit.steps:
            lines += self.step_lines(s, _env_geo)
        return lines + [f"# end of {unit.name}"]

    # -- overlapped chains ----------------------------------------------------------------------

    def loop_lines(self, loop: ChunkLoop) -> list[str]:
        """The chain as stage functions of one chunk, run as a software pipeline over chunks.

        Stage s of chunk c runs at tick c + s, after stage s - 1 of chunk c + 1 started that
        chunk's collectives: chunk c's communication is in flight while chunk c + 1 computes.
        """
        k, name = loop.chunks, loop.name
        members = ", ".join(loop.group.members)
        form: ChunkLoopLowering = (
            self.override(lambda emission: emission.chunk_loop(loop)) or _Pipelined(self, loop)
        )
        lines = _comment_lines(
            f"overlap({members}, chunks={k}): the chain runs in {k} chunks of rows, {form.how}; "
            f"each chunk's values live in {name}[c]",
            "# ",
        )
        outer = dict(self.var)
        saved = dict(self.var), dict(self.work)
        for n in (*loop.chunked, *(self.program.node(m) for m in loop.group.members)):
            self.var[n.name] = f"v[{n.name!r}]"
        for st in loop.stages:
            for s in st:
                if isinstance(s, Start):
                    self.work[s.node.name] = f"v[{s.node.name + '_work'!r}]"

        def geo(n: Node, field: str) -> str:
            key = f"{name}/{n.name}"
            chunk_field = {
                "rows": "chunk_global_rows",
                "bounds": "chunk_bounds",
                "parts": "chunk_parts",
            }.get(field)
            return f"env.{chunk_field}[{key!r}][c]" if chunk_field else _env_ref(n, field)

        stage_names = [self.namer.claim(f"{name}_stage_{i}") for i in range(len(loop.stages))]
        lines += form.prologue()
        try:
            for i, (stage, fn) in enumerate(zip(loop.stages, stage_names, strict=True)):
                what = ", ".join(_step_label(s) for s in stage)
                body = [f'"""Chunk c, stage {i}: {what}."""']
                if i == 0:
                    for x in loop.chunked:
                        body.append(
                            f"v[{x.name!r}] = {outer[x.name]}.index_select(0, "
                            f"env.chunk_rows[{name + '/' + x.name!r}][c])"
                        )
                for s in stage:
                    body += form.step_lines(s, geo)
                lines += [f"def {fn}(c, v):", *[_INDENT + b for b in body]]
        finally:
            self.var, self.work = saved
        lines += form.schedule(stage_names)
        for n in loop.outputs:
            key = f"{name}/{n.name}"
            lines += _call(
                self.var[n.name],
                "_chunked.assemble_rows",
                [f"[v[{n.name!r}] for v in {name}]", f"env.chunk_order[{key!r}]"],
            )
        return lines

    # -- one op ---------------------------------------------------------------------------------

    def comment(self, n: Node) -> str:
        text = self.program.format_node(n)
        return f"# {text}" + (f"  at {_where(n)}" if n.loc is not None else "")

    def node_lines(self, n: Node, geo: GeoRef) -> list[str]:
        if n.op is Op.UPDATE:
            return [self.comment(n) + "  (committed after the step succeeds)"]
        return [self.comment(n), f"{self.var[n.name]} = {self.expr(n, geo)}"]

    def expr(self, n: Node, geo: GeoRef) -> str:
        """The right-hand side of a local op, in the form its spec's lowering names."""
        form = _EXPRESSIONS.get(spec(n.op).lowering)
        if form is None:
            raise CodegenError(f"no code generation rule for {n.op}", op=str(n.op), loc=n.loc)
        return form(n, [self.var[i.name] for i in n.inputs], geo)

    def kernel_call(self, k: Kernel, geo: GeoRef) -> list[str]:
        args = [self.var[i.name] for i in k.inputs]
        args += [geo(n, f) for n, f, _ in self.geo_params(k)]
        outs = ", ".join(self.var[n.name] for n in k.outputs)
        target = f"({outs},)" if len(k.outputs) == 1 else outs
        members = ", ".join(n.name for n in k.nodes)
        return [
            *_comment_lines(f"{k.group.kind.value}: {members}  (one kernel)", "# "),
            *_call(target, f"kernels.{k.name}", args),
        ]

    def start_lines(self, s: Start, geo: GeoRef) -> list[str]:
        """``<node>_work = comm.<transport>_start(x, <the spec's arguments>, label=...)``."""
        n = s.node
        op = spec(n.op)
        args = [self.var[n.inputs[0].name]]
        for arg in op.arguments:
            args += _ARGUMENTS[arg](n, s, geo)
        args.append(f"label={n.name!r}")
        return [self.comment(n), *_call(self.work[n.name], f"comm.{op.transport}_start", args)]

    def control_lines(self, s: Start) -> list[str]:
        """A scalar all_reduce over the control channel (``Form.CONTROL``): a published gather
        before it holds its group's epoch open until the commit."""
        n = s.node
        args = [self.var[n.inputs[0].name], f"ReduceOp.{n.attr('reduce_op').name}",
                f"label={n.name!r}"]
        return [self.comment(n) + "  (on the control channel)",
                *_call(self.work[n.name], "comm.all_reduce_control_start", args)]


# -- the code of each lowering form and each transport argument (coconet.ir.opspec) -------------


def _reduction_expr(n: Node, a: list[str], geo: GeoRef) -> str:
    e = f"_ops.reduction(Op.{n.op.name}, {a[0]}, {n.attr('dim')!r}, {n.attr('keepdim')!r})"
    # torch sums small ints and bools into int64; the program's type says otherwise.
    if not n.type.dtype.is_float and n.type.dtype is not DType.int64:
        e += f".to({_dtype(n.type.dtype)})"
    return e


def _random_expr(n: Node, a: list[str], geo: GeoRef) -> str:
    rows = geo(n, "rows")
    where = f"{geo(n, 'shapes')}, {geo(n, 'offsets')}{', ' + rows if rows else ''}"
    if n.op is Op.ROUND_STOCHASTIC:
        return (f"_ops.apply_round_stochastic({a[0]}, {_dtype(n.type.dtype)}, {a[1]}, {a[2]}, "
                f"{where})")
    return f"_ops.apply_dropout({a[0]}, {n.attr('p')!r}, {a[1]}, {a[2]}, {where})"


_EXPRESSIONS: dict[Lowering, Callable[[Node, list[str], GeoRef], str]] = {
    Lowering.CAST: lambda n, a, geo: f"{a[0]}.to({_dtype(n.type.dtype)})",
    Lowering.RANDOM: _random_expr,
    Lowering.POINTWISE: lambda n, a, geo: f"_{n.op.value}({', '.join(a)})",
    Lowering.REDUCTION: _reduction_expr,
    Lowering.MATMUL: lambda n, a, geo: f"torch.matmul({a[0]}, {a[1]})",
    Lowering.FUNCTION: lambda n, a, geo: f"_ops.FUNCTIONS[Op.{n.op.name}]("
    + ", ".join([*a, *(f"{k}={v!r}" for k, v in n.attrs)])
    + ")",
    Lowering.SCATTER: lambda n, a, geo: f"{a[0]}.narrow({n.type.layout.dim}, *{geo(n, 'bounds')})",
}

_ARGUMENTS: dict[Arg, Callable[[Node, Start, GeoRef], list[str]]] = {
    Arg.REDUCE_OP: lambda n, s, geo: [f"ReduceOp.{n.attr('reduce_op').name}"],
    Arg.DIM: lambda n, s, geo: [f"dim={n.type.layout.dim}"],
    Arg.GATHER_DIM: lambda n, s, geo: [
        f"dim={n.inputs[0].type.layout.dim}",
        f"parts={geo(n, 'parts')}",
    ],
    Arg.ROOT: lambda n, s, geo: [f"root={n.attr('root')}"],
    Arg.AXIS: lambda n, s, geo: [f"axis={n.attr('axis')!r}"],
    Arg.DONATE: lambda n, s, geo: [f"donate={s.donate}"],
    Arg.REVERSE: lambda n, s, geo: ["reverse=True"] if n.attr("reverse") else [],
}


def _step_label(s) -> str:
    if isinstance(s, Kernel):
        return f"kernel {s.name}"
    if isinstance(s, Start):
        return f"start {s.node.name}"
    if isinstance(s, Wait):
        return f"wait {s.node.name}"
    return s.node.name


class _Pipelined:
    """The default lowering of a chunk loop (``ChunkLoopLowering``): stage s of chunk c runs at
    tick c + s, so chunk c's communication is in flight while chunk c + 1 computes."""

    def __init__(self, e: _Emitter, loop: ChunkLoop) -> None:
        self.e, self.loop = e, loop
        self.how = f"as a pipeline of {len(loop.stages)} stages"

    def prologue(self) -> list[str]:
        return []

    def step_lines(self, s: Compute | Kernel | Start | Wait, geo: GeoRef) -> list[str]:
        return self.e.step_lines(s, geo)

    def schedule(self, stage_names: list[str]) -> list[str]:
        k, name = self.loop.chunks, self.loop.name
        ticks = k + len(self.loop.stages) - 1
        return [
            f"{name} = [{{}} for _ in range({k})]",
            f"for _t in range({ticks}):  # stage s works on chunk _t - s",
            f"{_INDENT}for _s, _stage in enumerate(({', '.join(stage_names)},)):",
            f"{_INDENT * 2}if 0 <= _t - _s < {k}:",
            f"{_INDENT * 3}_stage(_t - _s, {name}[_t - _s])",
        ]


def _where(n: Node) -> str:
    path = n.loc.filename
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else os.path.basename(path)
    except ValueError:  # another drive on Windows
        path = os.path.basename(path)
    return f"{path}:{n.loc.lineno}"
