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
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping, Sequence

from coconet.codegen.names import Namer
from coconet.codegen.plan import (
    ChunkLoop,
    Compute,
    FusedCollective,
    Kernel,
    OnePass,
    Plan,
    Start,
    Wait,
)
from coconet.errors import CodegenError
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.opspec import Arg, Lowering, spec
from coconet.ir.types import DType

__all__ = ["emit"]

_INDENT = "    "
_SHARED_MEMORY = "shared memory"  # TransportKind.SHARED_MEMORY's value (codegen sits below runtime)

GeoRef = Callable[[Node, str], str]  # (node, "shapes"|"offsets"|"bounds"|"parts") -> code


def emit(
    plan: Plan, header: Sequence[str], transports: Mapping[str | None, str] | None = None
) -> str:
    """The module's source. ``header`` lines go first, as comments (program, schedule, key...);
    ``transports`` names what runs each mesh axis's collectives (said at each fused collective;
    default torch.distributed)."""
    return _Emitter(plan, dict(transports or {})).module(header)


class _Emitter:
    def __init__(self, plan: Plan, transports: dict[str | None, str]) -> None:
        self.plan = plan
        self.transports = transports
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
        self.work = {s.node.name: namer.claim(f"{self.var[s.node.name]}_work") for s in starts}
        # per kernel: (node, geometry field, parameter name) for the sizes a kernel is passed
        self._geo_cache: dict[str, list[tuple[Node, str, str]]] = {}
        self._one_pass_vars: dict[str, tuple[str, str]] = {}

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
        # a one-pass unit's kernel is written in its one-pass form only (the other is never run)
        one_pass = {u.one_pass.kernel.name: u.one_pass for u in self._one_pass_units()}
        names = []
        for k in self.plan.kernels:
            if k.name in one_pass:
                out += ["", ""] + self.one_pass_kernel_def(one_pass[k.name])
                names.append((k.name, f"{k.name}_one_pass"))
            else:
                out += ["", ""] + self.kernel_def(k)
                names.append((k.name, k.name))
        entries = ", ".join(f'"{name}": _kernel_{fn}' for name, fn in names)
        out += ["", "", f"KERNELS = {{{entries}}}", "", ""]
        out += self.step_def()
        return "\n".join(out) + "\n"

    def kernel_def(self, k: Kernel) -> list[str]:
        params = [self.var[i.name] for i in k.inputs] + [p for _, _, p in self._geo_params(k)]
        geo = {(n.name, f): p for n, f, p in self._geo_params(k)}
        lines = [
            f"def _kernel_{k.name}({', '.join(params)}):",
            f'{_INDENT}"""{_short(k.group)}: one kernel (torch.compile, or eager)."""',
        ]
        for n in k.nodes:
            lines += [_INDENT + c for c in self.node_lines(n, lambda n, f: geo.get((n.name, f)))]
        outs = ", ".join(self.var[n.name] for n in k.outputs)
        lines.append(f"{_INDENT}return ({outs}{',' if len(k.outputs) == 1 else ''})")
        return lines

    def _geo_params(self, k: Kernel) -> list[tuple[Node, str, str]]:
        if k.name not in self._geo_cache:
            self._geo_cache[k.name] = [
                (n, f, self.namer.claim(f"{self.var[n.name]}_{f[:-1]}"))
                for n in k.nodes
                if n.op is Op.DROPOUT
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
        outs = ", ".join(f"{n.name!r}: {self.var[n.name]}" for n in self.program.outputs)
        ups = ", ".join(
            f"{u.inputs[0].name!r}: {self.var[u.inputs[1].name]}" for u in self.program.updates
        )
        body.append(f"return {{{outs}}}, {{{ups}}}")
        return lines + [_INDENT + b for b in body]

    def step_lines(self, s: Compute | Kernel | Start | Wait, geo: GeoRef) -> list[str]:
        if isinstance(s, Compute):
            return self.node_lines(s.node, geo)
        if isinstance(s, Kernel):
            return self.kernel_call(s, geo)
        if isinstance(s, Start):
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
        axis = unit.collectives[0].attr("axis")
        transport = self.transports.get(axis, "torch.distributed")
        if unit in self._one_pass_units():
            return self.one_pass_lines(unit, parts, transport)
        lines = _comment_lines(
            f"{unit.name}: {', '.join(parts)} -- one fused collective; {transport} runs "
            "its collectives and kernels one after the other",
            "# ",
        )
        for s in unit.steps:
            lines += self.step_lines(s, _env_geo)
        return lines + [f"# end of {unit.name}"]

    # -- one-pass fused collectives over shared memory -------------------------------------------

    def _one_pass_units(self) -> list[FusedCollective]:
        """Fused collectives that run as one pass: shared memory along their axis, and the
        ``OnePass`` form."""
        out = []
        for unit in self.plan.fused_collectives:
            axis = unit.collectives[0].attr("axis")
            if self.transports.get(axis) == _SHARED_MEMORY and unit.one_pass is not None:
                out.append(unit)
        return out

    def _communicates_after(self, unit: FusedCollective) -> bool:
        """Whether communication starts after ``unit``: a published gather holds the peers'
        slots until the commit, so a later collective over them would wait for it forever."""
        body = list(self.plan.body)
        later = body[body.index(unit) + 1 :]
        return any(isinstance(s, (Start, FusedCollective, ChunkLoop)) for s in later)

    def _one_pass_names(self, op: OnePass) -> tuple[str, str]:
        """(the peers' slices parameter, the gather slot parameter) of a one-pass kernel."""
        key = op.kernel.name
        if key not in self._one_pass_vars:
            self._one_pass_vars[key] = (
                self.namer.claim(f"{self.var[op.reduce_scatter.name]}_parts"),
                self.namer.claim(f"{self.var[op.all_gather.inputs[0].name]}_slot"),
            )
        return self._one_pass_vars[key]

    def _one_pass_outputs(self, op: OnePass) -> list[Node]:
        """The kernel's outputs, less the gather's input when only the gather reads it (the
        kernel writes it into the slot instead)."""
        returned = {n.name for n in self.program.outputs} | {
            u.inputs[1].name for u in self.program.updates
        }
        given = op.all_gather.inputs[0]
        users = self.program.users()[given.name]
        only_gathered = given.name not in returned and all(u is op.all_gather for u in users)
        return [n for n in op.kernel.outputs if not (only_gathered and n is given)]

    def one_pass_kernel_def(self, op: OnePass) -> list[str]:
        """The kernel, reading every peer's slice of the reduce_scatter's input (it reduces them
        in rank order, as the simulator does) and writing the gather's input into its slot."""
        k = op.kernel
        parts, slot = self._one_pass_names(op)
        rs = op.reduce_scatter
        params = [parts if i is rs else self.var[i.name] for i in k.inputs]
        params += [p for _, _, p in self._geo_params(k)] + [slot]
        geo = {(n.name, f): p for n, f, p in self._geo_params(k)}
        lines = [
            f"def _kernel_{k.name}_one_pass({', '.join(params)}):",
            f'{_INDENT}"""{_short(k.group)}: one pass over shared memory (torch.compile, or '
            'eager)."""',
            f"{_INDENT}# {rs.name}: this rank's slice, reduced from every peer's in rank order",
            f"{_INDENT}{self.var[rs.name]} = _ops.reduce_values("
            f"ReduceOp.{rs.attr('reduce_op').name}, {parts})",
        ]
        for n in k.nodes:
            lines += [_INDENT + c for c in self.node_lines(n, lambda n, f: geo.get((n.name, f)))]
        given = op.all_gather.inputs[0]
        lines.append(f"{_INDENT}{slot}.copy_({self.var[given.name]})  # where the peers read it")
        outs = [self.var[n.name] for n in self._one_pass_outputs(op)]
        tail = "," if len(outs) == 1 else ""
        lines.append(f"{_INDENT}return ({', '.join(outs)}{tail})")
        return lines

    def one_pass_lines(self, unit: FusedCollective, parts: list[str], transport: str) -> list[str]:
        op = unit.one_pass
        rs, ag, k = op.reduce_scatter, op.all_gather, op.kernel
        names = self._one_pass_names(op)
        lines = _comment_lines(
            f"{unit.name}: {', '.join(parts)} -- one fused collective; {transport} runs it as "
            f"one pass: kernel {k.name} reads every peer's slice of {rs.inputs[0].name}, "
            f"reduces them in rank order, computes, and writes {ag.inputs[0].name} where the "
            "peers read it for the gather",
            "# ",
        )
        for s in op.scalars:
            lines += self.step_lines(s, _env_geo)
        dtype = _dtype(ag.type.dtype)
        gather = [
            f"gather_shape={_env_ref(ag, 'shapes')}",
            f"gather_dtype={dtype}",
            f"gather_parts={_env_ref(ag, 'parts')}",
        ]
        lines += [self.comment(rs)]
        lines += _call(
            ", ".join(names),
            "comm.fused_reduce_scatter_start",
            [
                self.var[rs.inputs[0].name],
                f"axis={rs.attr('axis')!r}",
                *gather,
                f"label={rs.name!r}",
            ],
        )
        args = [names[0] if i is rs else self.var[i.name] for i in k.inputs]
        args += [_env_geo(n, f) or "None" for n, f, _ in self._geo_params(k)] + [names[1]]
        outs = [self.var[n.name] for n in self._one_pass_outputs(op)]
        if outs:
            target = f"({outs[0]},)" if len(outs) == 1 else ", ".join(outs)
            lines += _call(target, f"kernels.{k.name}", args)
        else:  # everything the kernel computes goes to the gather's slot
            lines += _call("_", f"kernels.{k.name}", args)
        # Read only by updates: the gather stays in the peers' slots and the commit copies it
        # straight into the caller's tensor (the gather is the commit).
        published = (
            ag.name not in {n.name for n in self.program.outputs}
            and all(u.op is Op.UPDATE for u in self.program.users()[ag.name])
            and not self._communicates_after(unit)
        )
        lines += [self.comment(ag) + ("  (published: the commit copies it)" if published else "")]
        lines += _call(
            self.var[ag.name],
            "comm.fused_all_gather_finish",
            [
                f"axis={ag.attr('axis')!r}",
                f"shape={_env_ref(ag, 'shapes')}",
                f"dtype={dtype}",
                f"parts={_env_ref(ag, 'parts')}",
                f"label={ag.name!r}",
                *(["published=True"] if published else []),
            ],
        )
        return lines + [f"# end of {unit.name}"]

    # -- overlapped chains ----------------------------------------------------------------------

    def loop_lines(self, loop: ChunkLoop) -> list[str]:
        """The chain as stage functions of one chunk, run as a software pipeline over chunks.

        Stage s of chunk c runs at tick c + s, after stage s - 1 of chunk c + 1 started that
        chunk's collectives: chunk c's communication is in flight while chunk c + 1 computes.
        """
        k, name = loop.chunks, loop.name
        members = ", ".join(loop.group.members)
        lines = _comment_lines(
            f"overlap({members}, chunks={k}): the chain runs in {k} chunks of rows, as a "
            f"pipeline of {len(loop.stages)} stages; each chunk's values live in {name}[c]",
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
                    body += self.step_lines(s, geo)
                lines += [f"def {fn}(c, v):", *[_INDENT + b for b in body]]
        finally:
            self.var, self.work = saved
        ticks = k + len(loop.stages) - 1
        lines += [
            f"{name} = [{{}} for _ in range({k})]",
            f"for _t in range({ticks}):  # stage s works on chunk _t - s",
            f"{_INDENT}for _s, _stage in enumerate(({', '.join(stage_names)},)):",
            f"{_INDENT * 2}if 0 <= _t - _s < {k}:",
            f"{_INDENT * 3}_stage(_t - _s, {name}[_t - _s])",
        ]
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
        args += [geo(n, f) for n, f, _ in self._geo_params(k)]
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


# -- the code of each lowering form and each transport argument (coconet.ir.opspec) -------------


def _reduction_expr(n: Node, a: list[str], geo: GeoRef) -> str:
    e = f"_ops.reduction(Op.{n.op.name}, {a[0]}, {n.attr('dim')!r}, {n.attr('keepdim')!r})"
    # torch sums small ints and bools into int64; the program's type says otherwise.
    if not n.type.dtype.is_float and n.type.dtype is not DType.int64:
        e += f".to({_dtype(n.type.dtype)})"
    return e


def _dropout_expr(n: Node, a: list[str], geo: GeoRef) -> str:
    rows = geo(n, "rows")
    return (
        f"_ops.apply_dropout({a[0]}, {n.attr('p')!r}, {a[1]}, {a[2]}, "
        f"{geo(n, 'shapes')}, {geo(n, 'offsets')}{', ' + rows if rows else ''})"
    )


_EXPRESSIONS: dict[Lowering, Callable[[Node, list[str], GeoRef], str]] = {
    Lowering.CAST: lambda n, a, geo: f"{a[0]}.to({_dtype(n.type.dtype)})",
    Lowering.DROPOUT: _dropout_expr,
    Lowering.POINTWISE: lambda n, a, geo: f"_{n.op.value}({', '.join(a)})",
    Lowering.REDUCTION: _reduction_expr,
    Lowering.MATMUL: lambda n, a, geo: f"torch.matmul({a[0]}, {a[1]})",
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
}


def _call(target: str, fn: str, args: Sequence[str], width: int = 96) -> list[str]:
    """``target = fn(args)`` on one line, or with the arguments wrapped when that is too long."""
    line = f"{target} = {fn}({', '.join(args)})"
    if len(line) <= width:
        return [line]
    wrapped = textwrap.wrap(", ".join(args), width - len(_INDENT), break_long_words=False)
    return [f"{target} = {fn}(", *[_INDENT + w for w in wrapped], ")"]


def _comment_lines(text: str, prefix: str, width: int = 96) -> list[str]:
    return [prefix + w for w in textwrap.wrap(text, width, subsequent_indent="  ")] or [prefix]


def _short(group) -> str:
    m = group.members
    names = ", ".join(m) if len(m) <= 6 else f"{', '.join(m[:3])}, ..., {m[-1]} ({len(m)} values)"
    return f"{group.kind.value}([{names}])"


def _env_ref(n: Node, field: str) -> str:
    return f"env.{field}[{n.name!r}]"


def _env_geo(n: Node, field: str) -> str | None:
    """Geometry outside chunk loops: no explicit rows (blocks are contiguous)."""
    return None if field == "rows" else _env_ref(n, field)


def _step_label(s) -> str:
    if isinstance(s, Kernel):
        return f"kernel {s.name}"
    if isinstance(s, Start):
        return f"start {s.node.name}"
    if isinstance(s, Wait):
        return f"wait {s.node.name}"
    return s.node.name


def _dtype(d: DType) -> str:
    return f"torch.{d.torch}".replace("torch.torch.", "torch.")


def _where(n: Node) -> str:
    path = n.loc.filename
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else os.path.basename(path)
    except ValueError:  # another drive on Windows
        path = os.path.basename(path)
    return f"{path}:{n.loc.lineno}"
