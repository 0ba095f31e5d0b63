"""Reverse mode on the IR: ``coconet.grad(program, wrt)`` is the program of the gradients.

The result is an ordinary ``Program``, so schedules, the tuner, the simulator and the compiler
apply to backward unchanged. Its inputs are the forward program's inputs, the values named in
``saved`` (forward values the caller kept, so backward does not compute them again) and one
cotangent per float output, ``d_<output>``, of that output's type; its outputs are the
gradients ``d_<input>`` of the inputs in ``wrt``, each in its input's layout. Updates are not
differentiated (they are left out).

**What a gradient means across ranks.** A value is one variable per rank (Local), one per group
of its axis (Replicated; the whole world for ``axis=None``), or one per group split in parts
(Sliced). The loss the cotangents stand for counts each variable once: ``sum over ranks
<d_y_r, y_r>`` for a Local output, ``<d_y, y>`` once per group for a Replicated or Sliced one.
``coconet.simulate(..., differentiable=True)`` with ``torch.autograd`` over that loss is the
reference every rule is checked against.

**Layouts say what is partial.** Each op's rule (``coconet.ir.adjoints``, one per op in its op
spec) gives a contribution per operand; whether it is the operand's cotangent or a part of it
that the ranks' parts add up to is read from the layouts, never asked of the user:

- a Local operand: each rank's contribution is its own (exact);
- a Replicated operand: a contribution computed on Local values (a Local layout, or any layout
  when the consumer itself is Local) is partial, and the contributions are summed by one
  ``all_reduce`` over the operand's axis (Megatron's "f" in backward; DTensor's Partial); a
  Replicated contribution from a Replicated or Sliced consumer is exact;
- a Sliced operand: a Sliced contribution is exact, a Local one partial (``reduce_scatter``),
  a Replicated one is the whole cotangent (``scatter``: no communication).

Before an op's rule runs, its own cotangent is brought to that exact form, so the
communication a backward program needs appears exactly where the layouts require it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from coconet.errors import DifferentiationError, DSLError, UnknownNameError, capture_loc
from coconet.ir.adjoints import Builder
from coconet.ir.node import Node, make_node
from coconet.ir.ops import LEAVES, Op, ReduceOp
from coconet.ir.opspec import spec
from coconet.ir.program import Program
from coconet.ir.types import Layout

__all__ = ["grad"]


@dataclass(frozen=True)
class _Part:
    """One contribution to a value's cotangent; ``partial``: the ranks' values add up to it."""

    node: Node
    partial: bool


def grad(
    program: Program,
    wrt: Iterable[Any],
    *,
    saved: Iterable[Any] = (),
    name: str | None = None,
) -> Program:
    """The program of the gradients of ``program``'s outputs with respect to ``wrt``.

    ``wrt``: inputs of ``program`` (names, or the Tensors declared for them), float tensors.
    ``saved``: computed values of ``program`` (names or Tensors) that backward takes as inputs
    instead of computing them again (a layer's forward returns them; activations are the usual
    choice). The result is named ``name`` (``<program>_grad`` by default); see the module
    docstring for its inputs, outputs and meaning.
    """
    if not isinstance(program, Program):
        raise DifferentiationError(
            f"grad takes a Program, got {type(program).__name__} {program!r}",
            op="grad",
            loc=capture_loc(),
            hint="build the forward program first: grad(Program(name, inputs, outputs), wrt=[w])",
        )
    targets = _resolve(program, wrt, "wrt", inputs=True)
    if not targets:
        raise DifferentiationError(
            f"grad of {program.name}: wrt names no input",
            op="grad",
            loc=capture_loc(),
            hint=f"name the inputs to differentiate, from {[n.name for n in program.inputs]}",
        )
    for t in targets:
        if not t.type.dtype.is_float:
            raise DifferentiationError(
                f"grad of {program.name}: {t.describe()} is not a float tensor, so it has no "
                "gradient",
                op="grad",
                loc=capture_loc(),
                hint="differentiate with respect to float inputs only",
            )
    kept = _resolve(program, saved, "saved", inputs=False)
    return _Reverse(program, targets, kept).build(name or f"{program.name}_grad")


def _resolve(program: Program, refs: Iterable[Any], what: str, *, inputs: bool) -> list[Node]:
    if isinstance(refs, str) or not isinstance(refs, Iterable):
        raise DifferentiationError(
            f"grad's {what} is a list of names or Tensors, got {type(refs).__name__} {refs!r}",
            op="grad",
            loc=capture_loc(),
            hint=f"{what}=['w'] or {what}=[w]",
        )
    out: list[Node] = []
    for ref in refs:
        try:
            node = program.node(ref)
        except UnknownNameError as e:
            raise DifferentiationError(
                f"grad's {what} names {ref!r}, which program {program.name} does not have",
                op="grad",
                loc=capture_loc(),
                hint=e.hint,
            ) from None
        if inputs and node.op is not Op.INPUT:
            raise DifferentiationError(
                f"grad's wrt names {node.describe()}, a computed value, not an input",
                op="grad",
                loc=capture_loc(),
                hint="differentiate with respect to inputs; a computed value can be saved=",
            )
        if not inputs and (node.op in LEAVES or node.op is Op.UPDATE):
            raise DifferentiationError(
                f"grad's saved names {node.describe()}, which is not a computed value",
                op="grad",
                loc=capture_loc(),
                hint="inputs are inputs of the backward program anyway; save computed values",
            )
        if node in out:
            raise DifferentiationError(
                f"grad's {what} names {node.name!r} twice", op="grad", loc=capture_loc(),
                hint="list each value once",
            )  # fmt: skip
        out.append(node)
    return out


class _Reverse:
    def __init__(self, program: Program, wrt: list[Node], saved: list[Node]) -> None:
        self.program = program
        self.wrt = wrt
        self.saved = saved
        self.taken = {n.name for n in program.nodes}
        self.names: dict[int, str] = {}  # backward node -> the name it is given
        # the values that depend on an input in wrt (float values only: nothing else has one)
        self.active: set[int] = set()
        wrt_ids = {id(n) for n in wrt}
        for n in program.nodes:
            if not n.type.dtype.is_float:
                continue
            if id(n) in wrt_ids or any(id(i) in self.active for i in n.inputs):
                self.active.add(id(n))

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def build(self, name: str) -> Program:
        # the gradients' names first, so that they are d_<input> whatever else is named
        keys = {id(w): self.fresh(f"d_{w.name}") for w in self.wrt}
        parts: dict[int, list[_Part]] = {}
        cotangents: list[Node] = []
        for out in self.program.outputs:
            if not out.type.dtype.is_float:
                continue
            ct = make_node(
                Op.INPUT,
                (),
                {"dtype": out.type.dtype, "shape": out.type.shape, "layout": out.type.layout},
                name=self.fresh(f"d_{out.name}"),
                loc=out.loc,
            )
            cotangents.append(ct)
            if id(out) in self.active:
                parts.setdefault(id(out), []).append(_Part(ct, False))
        exact: dict[int, Node] = {}
        for n in reversed(self.program.nodes):
            if id(n) not in parts:
                continue
            try:
                ct = self.gather(n, parts.pop(id(n)))
            except DifferentiationError:
                raise
            except DSLError as e:
                raise self.no_layout(n, e) from None
            exact[id(n)] = ct
            if n.op is Op.INPUT:
                continue
            rule = spec(n.op).vjp
            if rule is None:  # pragma: no cover - missing_parts() refuses this at import
                raise DifferentiationError(f"{n.op} has no gradient rule", op=str(n.op), loc=n.loc)
            try:
                contributions = rule(n, ct, Builder(n.loc))
            except DifferentiationError:
                raise
            except DSLError as e:
                raise self.no_layout(n, e) from None
            for operand, c in zip(n.inputs, contributions, strict=True):
                if c is None or id(operand) not in self.active:
                    continue
                try:
                    c = _unbroadcast(c, operand, Builder(n.loc))
                except DSLError as e:
                    raise self.no_layout(n, e) from None
                parts.setdefault(id(operand), []).append(
                    _Part(c, self.is_partial(n, operand, c))
                )
        outputs: dict[str, Node] = {}
        returned: set[int] = set()
        for w in self.wrt:
            g = exact.get(id(w))
            b = Builder(w.loc)
            if g is None:  # no output depends on it: its gradient is zero
                g = b.expand_as(b.num(0.0, w), w)
            elif g.op is Op.INPUT or id(g) in returned:
                # a cotangent passed straight through, or the very gradient of another input
                # (x0 and x1 of x0 + x1): a copy, so that each output is a value of its own
                g = b.expand_as(g, g)
            returned.add(id(g))
            outputs[keys[id(w)]] = g
        return self.assemble(name, cotangents, outputs)

    # -- one value's cotangent from its contributions ----------------------------------------

    def gather(self, n: Node, parts: list[_Part]) -> Node:
        """``n``'s whole cotangent, in the layout that holds it (see the module docstring)."""
        b = Builder(n.loc)
        lay = n.type.layout
        exact = [p.node for p in parts if not p.partial]
        partial = [p.node for p in parts if p.partial]
        terms: list[Node] = []
        if lay.is_sliced:
            sliced = [c for c in exact if c.type.layout.is_sliced]
            whole = [c for c in exact if not c.type.layout.is_sliced]
            if sliced:
                terms.append(self.total(sliced, b))
            if whole:  # the whole cotangent on every rank: this rank's part of it
                terms.append(b.op(Op.SCATTER, self.total(whole, b), dim=lay.dim, axis=lay.axis))
            if partial:
                total = self.total(partial, b)
                if total.type.layout.is_replicated:  # the same on every rank: times the ranks
                    total = b.mul(total, b.world_size(lay.axis, total))
                    terms.append(b.op(Op.SCATTER, total, dim=lay.dim, axis=lay.axis))
                else:
                    rs = b.op(Op.REDUCE_SCATTER, total, reduce_op=ReduceOp.SUM, dim=lay.dim,
                              axis=lay.axis)  # fmt: skip
                    terms.append(self.label(rs, f"d_{n.name}_rs"))
        elif lay.is_replicated:
            takes_partial = spec(n.op).vjp_takes_partial
            if partial and not exact and takes_partial and not _all_replicated(partial):
                # the rule takes the partial sum as it is (all_gather: a reduce_scatter)
                return self.total(partial, b)
            if exact:
                terms.append(self.total(exact, b))
            if partial:
                total = self.total(partial, b)
                if total.type.layout.is_replicated:
                    terms.append(b.mul(total, b.world_size(lay.axis, total)))
                else:
                    ar = b.op(Op.ALL_REDUCE, total, reduce_op=ReduceOp.SUM, axis=lay.axis)
                    terms.append(self.label(ar, f"d_{n.name}_sum"))
        else:
            terms.append(self.total(exact + partial, b))
        ct = self.total(terms, b)
        if n.op is not Op.INPUT and ct.op is not Op.INPUT and id(ct) not in self.names:
            self.label(ct, f"d_{n.name}")  # an input's is named by its output key
        return ct

    def total(self, nodes: list[Node], b: Builder) -> Node:
        out = nodes[0]
        for c in nodes[1:]:
            out = b.add(out, c)
        return out

    def label(self, node: Node, base: str) -> Node:
        self.names[id(node)] = self.fresh(base)
        return node

    def is_partial(self, consumer: Node, operand: Node, c: Node) -> bool:
        """Whether the ranks' values of contribution ``c`` add up to ``operand``'s (rather than
        each being it); refuses what the layouts cannot say."""
        target, got = operand.type.layout, c.type.layout
        if target.is_local:
            return False
        if got.is_sliced:
            if not target.is_sliced:  # pragma: no cover - the rules never build one
                raise self.no_layout(consumer, None, c)
            return False
        if got.is_local:
            return True
        # A Replicated contribution: exact unless the consumer is a per-rank (Local) value.
        if consumer.type.layout.is_local:
            if not _covers(got, target.axis):
                raise self.no_layout(consumer, None, c)
            return True
        if consumer.type.layout.axis != target.axis and target.axis is None:
            # a world-Replicated operand used by values of one axis' groups: its gradient sums
            # over the groups, which no single collective of the program's axes expresses
            raise DifferentiationError(
                f"{operand.describe()} is Replicated over the whole world but "
                f"{consumer.describe()} is one value per group of axis "
                f"{consumer.type.layout.axis!r}: its gradient would sum over those groups",
                op=str(consumer.op),
                loc=consumer.loc,
                hint=f"declare {operand.name or 'it'} Replicated({consumer.type.layout.axis!r}) "
                "(one copy per group, as a tensor-parallel layer's parameters are); a "
                "data-parallel optimizer then averages it over the other axes",
            )
        return False

    def no_layout(self, n: Node, error: DSLError | None, c: Node | None = None) -> Exception:
        detail = f": {error.message}" if error is not None else ""
        return DifferentiationError(
            f"the gradient of {n.describe()} has no layout the layout rules can express"
            + detail,
            op=str(n.op),
            loc=n.loc,
            details=[f"operand {i}: {x.describe()}" for i, x in enumerate(n.inputs)]
            + ([f"contribution: {c.describe()}"] if c is not None else []),
            hint="differentiate a program whose layouts are those of the Megatron layers "
            "(column-parallel: Replicated x by w Sliced(1); row-parallel: x Sliced(-1) by w "
            "Sliced(0)); or all_gather an operand first",
        )

    # -- the program --------------------------------------------------------------------------

    def assemble(self, name: str, cotangents: list[Node], outputs: dict[str, Node]) -> Program:
        """Rebuild the backward graph with its names, the saved values as inputs."""
        saved_inputs: dict[int, Node] = {
            id(s): make_node(
                Op.INPUT,
                (),
                {"dtype": s.type.dtype, "shape": s.type.shape, "layout": s.type.layout},
                name=s.name,
                loc=s.loc,
            )
            for s in self.saved
        }
        memo: dict[int, Node] = dict(saved_inputs)
        for n in self.program.inputs:
            memo[id(n)] = n
        for c in cotangents:
            memo[id(c)] = c

        def rebuild(root: Node) -> Node:
            stack = [root]
            while stack:
                node = stack[-1]
                if id(node) in memo:
                    stack.pop()
                    continue
                pending = [i for i in node.inputs if id(i) not in memo]
                if pending:
                    stack.extend(pending)
                    continue
                stack.pop()
                memo[id(node)] = replace(
                    node,
                    inputs=tuple(memo[id(i)] for i in node.inputs),
                    name=self.names.get(id(node), node.name),
                )
            return memo[id(root)]

        outs = {k: rebuild(v) for k, v in outputs.items()}
        inputs = [*self.program.inputs, *saved_inputs.values(), *cotangents]
        return Program(name, inputs, outs)


def _all_replicated(nodes: list[Node]) -> bool:
    return all(c.type.layout.is_replicated for c in nodes)


def _covers(layout: Layout, axis: str | None) -> bool:
    """A Replicated value that is the same on every rank of ``axis``'s groups."""
    return layout.axis is None or layout.axis == axis


def _unbroadcast(c: Node, operand: Node, b: Builder) -> Node:
    """``c`` summed over the dims ``operand`` was broadcast along, to ``operand``'s shape."""
    shape, target = c.type.shape, operand.type.shape
    for _ in range(len(shape) - len(target)):
        c = b.sum(c, 0)
    for d, (got, want) in enumerate(zip(c.type.shape, target, strict=True)):
        # broadcast along d: a size-1 dim against a larger one, or against a dim that is sliced
        # over the ranks where the operand's is not (each rank's part of it, even when the whole
        # is one long: the ranks' sums of their parts are then partial, and summed as such)
        lay = c.type.layout
        across = lay.is_sliced and lay.dim == d and not operand.type.layout.is_sliced
        if want == 1 and (got != 1 or across):
            c = b.sum(c, d, keepdim=True)
    if c.type.dtype is not operand.type.dtype:  # pragma: no cover - rules keep dtypes
        c = b.op(Op.CAST, c, dtype=operand.type.dtype)
    return c
