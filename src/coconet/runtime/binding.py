"""Binding a compiled step's call: this rank's inputs checked and turned into the generated
step's arguments (``InputBinding``, which ``CompiledStep`` is).

A call's inputs are checked on this rank alone (names, dtypes, devices, ranks, what an update
can write, aliasing between inputs) before the agreement compares them across the ranks
(``coconet.runtime.handshake``). The checks read only what ``step_inputs.signature`` (or
``read_signature``, for a step that writes no input) says, so a call whose inputs have the
signatures of the last call that passed them is bound again without them (``_rebind``): a
layer's step called once per token with its own weights, an optimizer's step with the same
buckets every step.
"""

from __future__ import annotations

from typing import Any

import torch

from coconet.ir.node import Node
from coconet.ir.types import format_shape
from coconet.runtime import step_inputs

__all__ = ["InputBinding"]


class InputBinding:
    """The binding half of ``CompiledStep``: it reads the step's ``program``, ``options``,
    ``_slots``, ``_input_names``, ``_numbers``, ``_checked``, ``_unaliased``, ``_signature``,
    ``_bound``, ``_differs``, ``_valued`` and ``_updated`` (set in ``CompiledStep.__init__``,
    which says what each holds)."""

    def _bind(self, given: dict[str, Any], comm) -> tuple[list, dict, dict, dict, str | None]:
        """Positional args for the generated step, local shapes and dtypes, the digests of the
        Replicated inputs compared across ranks, and the first problems found with this rank's
        inputs (None when they look right locally)."""
        bound = self._rebind(given)
        if bound is not None:
            return bound
        problems = []
        if not self._input_names.issuperset(given):
            names = [n.name for n in self.program.inputs]
            problems.append(
                f"{self.program.name} has no inputs named {sorted(set(given) - set(names))}; "
                f"its inputs are {names}"
            )
        args, shapes, dtypes, replicated = [], {}, {}, {}
        signatures: list[tuple] = []
        key: list[tuple] = []  # (``_rebind``'s)
        compare = comm.world > 1  # a world of one has no peer to compare Replicated inputs with
        for name, node, compared in self._slots:
            raw = given.get(name, _MISSING)
            if raw is _MISSING:
                problems.append(f"input {name!r} ({node.type}) is missing")
                args.append(None)
                continue
            if not isinstance(raw, torch.Tensor):
                key.append(step_inputs.number_key(raw))
            cached = self._numbers.get(name)
            # the same number as last time (NaN never is; -0.0 is not 0.0)
            if (cached is not None and type(raw) is cached[0] and raw == raw
                    and step_inputs.number_key(raw) == step_inputs.number_key(cached[1])):
                value = cached[2]
                args.append(value)
                shapes[name] = ()
                dtypes[name] = _dtype_name(value.dtype)
                if compare and compared:
                    replicated[name] = cached[3]
                continue
            fast = (step_inputs.float_scalar(node, raw, comm.device)
                    if type(raw) in (float, int) else None)  # fmt: skip
            if fast is not None:
                # a new finite float (a step-dependent scalar): made and named at once
                value, text = fast if compare else (fast[0], "")
                args.append(value)
                shapes[name] = ()
                dtypes[name] = _dtype_name(value.dtype)
                if compare and compared:
                    replicated[name] = text
                self._numbers[name] = (type(raw), raw, value, text)
                continue
            sig = self._signature(name, raw) if isinstance(raw, torch.Tensor) else None
            if sig is not None and sig in self._checked:
                value, problem = (raw.detach() if raw.requires_grad else raw), None
            else:
                value, problem = self._tensor(node, raw, comm)
                if sig is not None and problem is None:
                    if len(self._checked) > 64:  # many tensors in turn: keep the set small
                        self._checked.clear()
                    self._checked.add(sig)
            if sig is not None:
                signatures.append(sig)
                key.append(sig)
            if problem:
                problems.append(problem)
            args.append(value)
            if value is not None:
                shapes[name] = tuple(value.shape)
                dtypes[name] = _dtype_name(value.dtype)
                if compare and compared:
                    if node.type.rank == 0:
                        replicated[name] = step_inputs.scalar_text(value)
                    elif self.options.check_replicated:
                        replicated[name] = step_inputs.checksum(value)
                if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                    text = replicated.get(node.name) or (
                        step_inputs.scalar_text(value) if compare else ""
                    )
                    self._numbers[node.name] = (type(raw), raw, value, text)
        if not problems:
            together = tuple(signatures)
            if together not in self._unaliased:
                problems.extend(step_inputs.aliasing(
                    self.program.inputs, given, self._updated, set(self.options.donate)))
                if not problems:
                    if len(self._unaliased) > 16:
                        self._unaliased.clear()
                    self._unaliased.add(together)
        if problems:
            return args, shapes, dtypes, replicated, "; ".join(problems)
        numbers = {i: args[i] for i, (name, _, _) in enumerate(self._slots)
                   if not isinstance(given[name], torch.Tensor)}  # fmt: skip
        if len(given) == len(self._slots) and not self._valued.intersection(
                name for name, _, _ in self._slots if isinstance(given[name], torch.Tensor)):
            key.append(("inference_mode", torch.is_inference_mode_enabled()))
            self._bound = step_inputs.Bound(tuple(key), numbers, shapes, dtypes, dict(replicated))
        return args, shapes, dtypes, replicated, None

    def _rebind(self, given: dict[str, Any]) -> tuple[list, dict, dict, dict, None] | None:
        """``_bind`` of a call with the inputs of the last call that passed every check, by
        everything those checks read (each tensor's ``_signature``, each number's
        type and value, inference mode), or None for any other call: the same args but for the
        tensors (this call's own, with their shapes), and the same dtypes and agreed values."""
        bound = self._bound
        if bound is None or len(given) != len(self._slots):
            return None
        key = bound.key
        # the input that differed last time first: where calls differ, they mostly differ there
        # again (an optimizer's step count, its state swapped in at the commit), and a miss then
        # costs one comparison
        first = self._differs
        if first is not None and self._input_key(first, given, bound) != key[first]:
            return None
        if key[-1] != ("inference_mode", torch.is_inference_mode_enabled()):
            return None
        args, shapes = [], dict(bound.shapes)  # (a read-only step's key holds no sizes)
        for i, (name, _, _) in enumerate(self._slots):
            if self._input_key(i, given, bound) != key[i]:
                self._differs = i
                return None
            raw = given[name]
            if i in bound.numbers:
                args.append(bound.numbers[i])
            else:
                args.append(raw.detach() if raw.requires_grad else raw)
                shapes[name] = tuple(raw.shape)
        return args, shapes, bound.dtypes, dict(bound.replicated), None

    def _input_key(self, i: int, given: dict[str, Any], bound: step_inputs.Bound) -> tuple | None:
        """Input ``i`` of ``given`` as ``bound.key`` names it (None: not the kind it was)."""
        name = self._slots[i][0]
        raw = given.get(name, _MISSING)
        if i in bound.numbers:
            return step_inputs.number_key(raw)
        return self._signature(name, raw) if isinstance(raw, torch.Tensor) else None

    def _tensor(self, node: Node, value: Any, comm) -> tuple[torch.Tensor | None, str | None]:
        ty = node.type
        dtype = ty.dtype.torch
        device = comm.device
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if ty.rank != 0:
                return None, f"input {node.name!r} ({ty}) needs a tensor, got the number {value!r}"
            if node.name in self._updated:
                return None, (
                    f"input {node.name!r} is updated by the program: pass a tensor "
                    "that can be written, not a number"
                )
            return step_inputs.scalar(node, value, device)
        if not isinstance(value, torch.Tensor):
            # a scalar input also takes a Python number (the learning rate as a float)
            wanted = "a torch.Tensor or a Python number" if ty.rank == 0 else "a torch.Tensor"
            return None, f"input {node.name!r}: expected {wanted}, got {type(value).__name__}"
        if value.dtype != dtype:
            return None, (
                f"input {node.name!r} is {value.dtype}, the program declares "
                f"{ty.dtype.value} (pass {node.name}.to({dtype}))"
            )
        if (not value.is_cpu if device.type == "cpu" else value.device.type != device.type):
            return None, (
                f"input {node.name!r} is on {value.device}, this rank computes on {device}"
            )
        if value.dim() != ty.rank:
            return None, (
                f"input {node.name!r} has shape {list(value.shape)}, the program "
                f"declares {format_shape(ty.shape)} ({ty.layout})"
            )
        if node.name in self._updated:
            problem = step_inputs.unwritable(node.name, value)
            if problem:
                return None, problem
        # a tensor outside autograd needs no detached view (a few us per small step)
        return (value.detach() if value.requires_grad else value), None


_DTYPE_NAMES: dict[torch.dtype, str] = {}


_MISSING = object()  # an input the caller did not pass


def _dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for torch.float32 (remembered: the handshake names every input's dtype at
    every step)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name
