"""The shared-memory transport's lowering forms, as source (``coconet.codegen.forms``).

The generic emitter (``coconet.codegen.emit``) writes every unit in its default lowering; a unit
that ``forms()`` gives a form of shared memory's is written here, by the overrides of
``SharedMemoryEmission`` (``coconet.codegen.lowering.Emission``):

- a fused collective as one pass (``OnePass``): ``chan = comm.one_pass(axis)``, then
  ``chan.begin(x, ...)`` (every peer's rows of this rank's slice of ``x``, and this rank's slot
  of the gather), one kernel that reduces the rows in rank order, computes and writes its slot,
  and ``chan.finish(...)`` (the gather) or ``chan.end()`` (no gather); a unit without a
  reduce_scatter opens with ``chan.slot(...)``;
- each chunk of an overlapped chain as such a unit, the chunks one after the other;
- an all_reduce read in place (``ReadInPlace``): ``chan.reduce_in_place(x, op)`` leaves the
  result where each slice's owner reduced it, and the consumer kernel runs on it slice by slice;
- a published gather's commit target (``Form.PUBLISHED``): ``REPLICA_INPUTS`` names the inputs a
  host replica may be passed as.

The calls go to ``coconet.runtime.channels.OnePassChannel``, which the communicator hands out.
"""

from __future__ import annotations

from coconet.codegen.forms import OnePass, ReadInPlace
from coconet.codegen.lowering import ChunkLoopLowering, Emission, Emitter
from coconet.codegen.plan import ChunkLoop, Compute, FusedCollective, Kernel, Start, Wait
from coconet.codegen.source import (
    INDENT,
    GeoRef,
    call,
    comment_lines,
    dtype,
    env_geo,
    env_ref,
    short,
)
from coconet.ir.node import Node
from coconet.options import TransportKind

__all__ = ["SharedMemoryEmission"]


class SharedMemoryEmission(Emission):
    """Writes the units of one module that run in a shared-memory form."""

    kind = TransportKind.SHARED_MEMORY

    def __init__(self, e: Emitter) -> None:
        super().__init__(e)
        forms = e.forms
        namer = e.namer
        self._parts_var = {
            name: namer.claim(f"{e.var[name]}_parts") for name in forms.in_place
        }
        self._out_params = {
            (r.kernel.name, n.name): namer.claim(f"{e.var[n.name]}_out")
            for r in forms.in_place.values()
            for n in r.kernel.outputs
        }
        self._one_pass_vars: dict[str, tuple[str | None, str | None]] = {}
        self._channels: dict[str, str] = {}  # unit or loop name -> its channel's variable

    def _channel(self, unit: str) -> str:
        if unit not in self._channels:
            self._channels[unit] = self.e.namer.claim(f"{unit}_channel")
        return self._channels[unit]

    # -- the overrides (``Emission``): which units are in a form of shared memory's -------------

    def declarations(self) -> list[str]:
        """``REPLICA_INPUTS``: the inputs a published gather is committed into. A host replica
        passed as one is written in its spare buffer and flipped by the commit
        (``coconet.runtime.replica``)."""
        forms, program = self.e.forms, self.e.program
        gathers = [program.node(name) for name in forms.published]
        flips = sorted(
            {t.name for ag in gathers
             if self.mine(ag.attr("axis")) and (t := forms.commit_target(ag)) is not None}
        )  # fmt: skip
        if not flips:
            return []
        listed = ", ".join(repr(n) for n in flips)
        return [f"REPLICA_INPUTS = ({listed}{',' if len(flips) == 1 else ''})"]

    def kernel_def(self, k: Kernel) -> tuple[str, list[str]] | None:
        """A one-pass unit's kernel in its one-pass form only (the other is never run); an
        all_reduce's reader in its by-parts form."""
        op = self.e.forms.one_pass_kernels.get(k.name)
        if op is not None and self.mine(op.axis):
            return f"{k.name}_one_pass", self.one_pass_kernel_def(op)
        read = self.e.forms.kernels_in_place.get(k.name)
        if read is not None and self.mine(_axis(read)):
            return f"{k.name}_by_parts", self.by_parts_kernel_def(read)
        return None

    def step_lines(self, s: Kernel | Start | Wait, geo: GeoRef) -> list[str] | None:
        """An all_reduce read in place: its start, its reader's call, and no wait (complete at
        its start; its kernel reads it where it was reduced)."""
        forms = self.e.forms
        if isinstance(s, Kernel):
            read = forms.kernels_in_place.get(s.name)
            if read is not None and self.mine(_axis(read)):
                return self.by_parts_call(read)
            return None
        read = forms.in_place.get(s.node.name)
        if read is None or not self.mine(_axis(read)):
            return None
        return self.reduce_in_place_lines(read) if isinstance(s, Start) else []

    def fused_collective_lines(self, unit: FusedCollective, parts: list[str]) -> list[str] | None:
        op = self.e.forms.one_pass(unit)
        if op is None or not self.mine(op.axis):
            return None
        return self.one_pass_lines(unit, op, parts)

    def chunk_loop(self, loop: ChunkLoop) -> ChunkLoopLowering | None:
        op = self.e.forms.one_pass(loop)
        if op is None or not self.mine(op.axis):
            return None
        return _OnePassLoop(self, loop, op)

    # -- an all_reduce read in place by its kernel -----------------------------------------------

    def reduce_in_place_lines(self, r: ReadInPlace) -> list[str]:
        e, ar = self.e, r.all_reduce
        lines = [e.comment(ar)]
        lines += comment_lines(
            f"  over shared memory: left where each slice's owner reduced it; kernel "
            f"{r.kernel.name} reads it there, slice by slice (no copy into a tensor of its own)"
        )
        args = [
            e.var[ar.inputs[0].name],
            f"ReduceOp.{ar.attr('reduce_op').name}",
            f"label={ar.name!r}",
        ]
        channel = f"comm.one_pass({ar.attr('axis')!r}).reduce_in_place"
        return lines + call(self._parts_var[ar.name], channel, args)

    def by_parts_kernel_def(self, r: ReadInPlace) -> list[str]:
        """The kernel on one slice of everything it reads, writing its results into the
        matching slices of its outputs (``<output>_out``)."""
        e, k = self.e, r.kernel
        outs = [self._out_params[(k.name, n.name)] for n in k.outputs]
        params = [e.var[i.name] for i in k.inputs] + outs
        lines = [
            f"def _kernel_{k.name}_by_parts({', '.join(params)}):",
            f'{INDENT}"""{short(k.group)}: one kernel (torch.compile, or eager), on one slice '
            f'of {r.all_reduce.name} where its owner reduced it."""',
        ]
        for n in k.nodes:
            lines += [INDENT + c for c in e.node_lines(n, lambda n, f: None)]
        for n, o in zip(k.outputs, outs, strict=True):
            lines.append(f"{INDENT}{o}.copy_({e.var[n.name]})")
        return lines

    def by_parts_call(self, r: ReadInPlace) -> list[str]:
        e, k, ar = self.e, r.kernel, r.all_reduce
        parts = self._parts_var[ar.name]
        lo, hi = e.namer.claim("lo"), e.namer.claim("hi")
        shape = e.var[ar.inputs[0].name] + ".shape"
        members = ", ".join(n.name for n in k.nodes)
        lines = comment_lines(
            f"{k.group.kind.value}: {members}  (one kernel, run on each slice of {ar.name} "
            "where its owner reduced it)"
        )
        for n in k.outputs:
            lines.append(f"{e.var[n.name]} = torch.empty({shape}, dtype={dtype(n.type.dtype)})")
        args = [
            e.var[i.name] if i is ar or i.type.rank == 0
            else f"{e.var[i.name]}.reshape(-1)[{lo}:{hi}]"
            for i in k.inputs
        ]
        args += [f"{e.var[n.name]}.view(-1)[{lo}:{hi}]" for n in k.outputs]
        body = call("", f"kernels.{k.name}", args)
        lines += [
            f"{lo} = 0",
            f"for {e.var[ar.name]} in {parts}.pieces:",
            f"{INDENT}{hi} = {lo} + {e.var[ar.name]}.numel()",
            *[INDENT + b for b in body],
            f"{INDENT}{lo} = {hi}",
            f"{parts}.release()  # every slice read: the peers may reuse their segments",
        ]
        return lines

    # -- one-pass kernels -------------------------------------------------------------------------

    def _one_pass_names(self, op: OnePass) -> tuple[str | None, str | None]:
        """(the peers' slices parameter, the gather slot parameter) of a one-pass kernel (None
        for the half it does not have)."""
        key = op.kernel.name
        if key not in self._one_pass_vars:
            e, rs, ag = self.e, op.reduce_scatter, op.all_gather
            self._one_pass_vars[key] = (
                e.namer.claim(f"{e.var[rs.name]}_parts") if rs is not None else None,
                e.namer.claim(f"{e.var[ag.inputs[0].name]}_slot") if ag is not None else None,
            )
        return self._one_pass_vars[key]

    def _one_pass_outputs(self, op: OnePass) -> list[Node]:
        """The kernel's outputs, less the gather's input when only the gather reads it (the
        kernel writes it into the slot instead)."""
        if op.all_gather is None:
            return list(op.kernel.outputs)
        program = self.e.program
        returned = {n.name for n in program.outputs} | {u.inputs[1].name for u in program.updates}
        given = op.all_gather.inputs[0]
        users = program.users()[given.name]
        only_gathered = given.name not in returned and all(u is op.all_gather for u in users)
        return [n for n in op.kernel.outputs if not (only_gathered and n is given)]

    def one_pass_kernel_def(self, op: OnePass) -> list[str]:
        """The kernel, reading every peer's slice of the reduce_scatter's input (it reduces them
        in rank order, as the simulator does) and/or writing the gather's input into its slot."""
        e, k = self.e, op.kernel
        parts, slot = self._one_pass_names(op)
        rs, ag = op.reduce_scatter, op.all_gather
        params = [parts if i is rs else e.var[i.name] for i in k.inputs]
        params += [p for _, _, p in e.geo_params(k)] + ([slot] if slot else [])
        geo = {(n.name, f): p for n, f, p in e.geo_params(k)}
        lines = [
            f"def _kernel_{k.name}_one_pass({', '.join(params)}):",
            f'{INDENT}"""{short(k.group)}: one pass over shared memory (torch.compile, or '
            'eager)."""',
        ]
        if rs is not None:
            lines += [
                f"{INDENT}# {rs.name}: this rank's slice, reduced from every peer's in rank order",
                f"{INDENT}{e.var[rs.name]} = _ops.reduce_values("
                f"ReduceOp.{rs.attr('reduce_op').name}, {parts})",
            ]
        for n in k.nodes:
            lines += [INDENT + c for c in e.node_lines(n, lambda n, f: geo.get((n.name, f)))]
        if ag is not None:
            given = e.var[ag.inputs[0].name]
            lines.append(f"{INDENT}{slot}.copy_({given})  # where the peers read it")
        outs = [e.var[n.name] for n in self._one_pass_outputs(op)]
        tail = "," if len(outs) == 1 else ""
        lines.append(f"{INDENT}return ({', '.join(outs)}{tail})")
        return lines

    def _commit_target(self, ag: Node) -> str | None:
        """The variable of the input a published gather is committed into, if it has one."""
        target = self.e.forms.commit_target(ag)
        return self.e.var[target.name] if target is not None else None

    def _kernel_call(self, op: OnePass, args: list[str]) -> list[str]:
        outs = [self.e.var[n.name] for n in self._one_pass_outputs(op)]
        # with no outputs, everything the kernel computes goes to the gather's slot
        target = (f"({outs[0]},)" if len(outs) == 1 else ", ".join(outs)) if outs else "_"
        return call(target, f"kernels.{op.kernel.name}", args)

    # -- a fused collective as one pass -----------------------------------------------------------

    def one_pass_lines(self, unit: FusedCollective, op: OnePass, parts: list[str]) -> list[str]:
        e = self.e
        rs, ag, k = op.reduce_scatter, op.all_gather, op.kernel
        names = self._one_pass_names(op)
        chan = self._channel(unit.name)
        what = []
        if rs is not None:
            what.append(
                f"kernel {k.name} reads every peer's slice of {rs.inputs[0].name}, reduces them "
                "in rank order, computes"
            )
        else:
            what.append(f"kernel {k.name} computes")
        if ag is not None:
            what.append(f"and writes {ag.inputs[0].name} where the peers read it for the gather")
        lines = comment_lines(
            f"{unit.name}: {', '.join(parts)} -- one fused collective; shared memory runs it as "
            f"one pass: {' '.join(what)}"
        )
        lines.append(f"{chan} = comm.one_pass({op.axis!r})")
        for s in op.scalars:
            lines += e.step_lines(s, env_geo)
        if ag is not None:
            geometry = [
                f"shape={env_ref(ag, 'shapes')}",
                f"dtype={dtype(ag.type.dtype)}",
                f"parts={env_ref(ag, 'parts')}",
            ]
        # A published gather names the input it is committed into: where that input is a host
        # replica (coconet.runtime.replica), the slot is the replica's spare buffer and the
        # commit flips it instead of copying.
        into = self._commit_target(ag) if ag is not None and e.forms.is_published(ag) else None
        if rs is not None:
            lines += [e.comment(rs)]
            gather = [f"gather_{g}" for g in geometry] if ag is not None else []
            gather += [f"gather_into={into}"] if into is not None else []
            lines += call(
                f"{names[0]}, {names[1] or '_'}",
                f"{chan}.begin",
                [e.var[rs.inputs[0].name], *gather, f"label={rs.name!r}"],
            )
        else:
            target = [f"into={into}"] if into is not None else []
            lines += call(names[1], f"{chan}.slot", [*geometry, *target, f"label={ag.name!r}"])
        args = [names[0] if i is rs else e.var[i.name] for i in k.inputs]
        args += [env_geo(n, f) or "None" for n, f, _ in e.geo_params(k)]
        args += [names[1]] if ag is not None else []
        lines += self._kernel_call(op, args)
        if ag is None:
            lines += call("", f"{chan}.end", [f"label={rs.name!r}"])
            return lines + [f"# end of {unit.name}"]
        # Read only by updates: the gather stays in the peers' slots and the commit copies it
        # straight into the caller's tensor (the gather is the commit; ``forms`` decides when).
        published = e.forms.is_published(ag)
        lines += [e.comment(ag) + ("  (published: the commit copies it)" if published else "")]
        lines += call(
            e.var[ag.name],
            f"{chan}.finish",
            [*geometry, f"label={ag.name!r}", *(["published=True"] if published else [])],
        )
        return lines + [f"# end of {unit.name}"]

    # -- each chunk of a loop as one pass ---------------------------------------------------------

    def loop_channel_lines(self, loop: ChunkLoop, op: OnePass) -> list[str]:
        """The channel the loop's chunks share (opened once, before the stage functions)."""
        return [f"{self._channel(loop.name)} = comm.one_pass({op.axis!r})"]

    def loop_step_lines(
        self,
        loop: ChunkLoop,
        s: Compute | Kernel | Start | Wait,
        op: OnePass,
        geo: GeoRef,
    ) -> list[str]:
        """A step of a chunk loop whose chunks run as one pass."""
        e = self.e
        rs, ag, k = op.reduce_scatter, op.all_gather, op.kernel
        parts, slot = (f"v[{name!r}]" for name in self._one_pass_names(op))
        chan = self._channel(loop.name)
        rows = geo(ag, "parts")
        geometry = [
            f"shape=(sum({rows}), *{env_ref(ag, 'shapes')}[1:])",
            f"dtype={dtype(ag.type.dtype)}",
            f"parts={rows}",
        ]
        if isinstance(s, Start) and s.node is rs:
            return [
                e.comment(rs),
                *call(
                    f"{parts}, {slot}",
                    f"{chan}.begin",
                    [
                        e.var[rs.inputs[0].name],
                        *(f"gather_{g}" for g in geometry),
                        f"label={rs.name!r}",
                    ],
                ),
            ]
        if isinstance(s, Kernel) and s is k:
            args = [parts if i is rs else e.var[i.name] for i in k.inputs]
            args += [geo(n, f) for n, f, _ in e.geo_params(k)] + [slot]
            members = ", ".join(n.name for n in k.nodes)
            return [
                *comment_lines(
                    f"{k.group.kind.value}: {members}  (one kernel: reads every peer's rows of "
                    f"{rs.inputs[0].name}, reduces them, writes {ag.inputs[0].name} into its slot)"
                ),
                *self._kernel_call(op, args),
            ]
        if isinstance(s, Start) and s.node is ag:
            return [e.comment(ag), "#   (its input is in its slot: the kernel wrote it there)"]
        if isinstance(s, Wait) and s.node is ag:
            return call(e.var[ag.name], f"{chan}.finish", [*geometry, f"label={ag.name!r}"])
        if isinstance(s, Wait) and s.node is rs:
            return []  # read by the kernel from the peers' rows
        return e.step_lines(s, geo)

    def loop_schedule_lines(
        self, loop: ChunkLoop, op: OnePass, stage_names: list[str]
    ) -> list[str]:
        """The chunks one after the other: over shared memory a chunk's collectives complete
        where they start, so there is nothing in flight to pipeline, and a one-pass chunk holds
        its group's epoch from its reduce_scatter to its gather."""
        k, name = loop.chunks, loop.name
        lines = comment_lines(
            f"over shared memory each chunk runs as one pass (kernel {op.kernel.name} "
            f"reads the peers' rows of {op.reduce_scatter.inputs[0].name} and writes "
            f"{op.all_gather.inputs[0].name} into its slot), the chunks one after the other"
        )
        return lines + [
            f"{name} = [{{}} for _ in range({k})]",
            f"for _c in range({k}):",
            f"{INDENT}for _stage in ({', '.join(stage_names)},):",
            f"{INDENT * 2}_stage(_c, {name}[_c])",
        ]


class _OnePassLoop:
    """A chunk loop whose chunks each run as one pass (``ChunkLoopLowering``), one after the
    other."""

    how = "one after the other, each as one pass over shared memory"

    def __init__(self, em: SharedMemoryEmission, loop: ChunkLoop, op: OnePass) -> None:
        self.em, self.loop, self.op = em, loop, op

    def prologue(self) -> list[str]:
        return self.em.loop_channel_lines(self.loop, self.op)

    def step_lines(self, s: Compute | Kernel | Start | Wait, geo: GeoRef) -> list[str]:
        return self.em.loop_step_lines(self.loop, s, self.op, geo)

    def schedule(self, stage_names: list[str]) -> list[str]:
        return self.em.loop_schedule_lines(self.loop, self.op, stage_names)


def _axis(r: ReadInPlace) -> str | None:
    return r.all_reduce.attr("axis")
