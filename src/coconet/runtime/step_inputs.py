"""What a compiled step checks and computes about its inputs, value by value (``CompiledStep``'s
``_bind``, ``_tensor`` and ``_commit`` call these): Python numbers as the program's scalars, the
text and checksum of a Replicated value that the ranks compare, whether a tensor can be written in
place, whether two tensors share memory, and what a call like the last good one binds to.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from coconet.ir.node import Node
from coconet.ir.types import format_shape

__all__ = [
    "Bound", "aliasing", "checksum", "float_scalar", "number_key", "overlap", "read_signature",
    "scalar", "scalar_text", "signature", "swappable", "unwritable",
]


def scalar(node: Node, value: int | float, device) -> tuple[torch.Tensor | None, str | None]:
    """A Python number as the 0-d tensor of the program's dtype, or why it does not fit it.

    torch.tensor would raise for some (an int NaN, 10**400) and silently change others (1.5 for
    an int scalar, 1e10 for a float16 one): either way the ranks must learn it together."""
    ty = node.type
    dtype = ty.dtype.torch
    where = f"input {node.name!r} ({ty.dtype.value})"
    if dtype.is_floating_point:
        finite = not (isinstance(value, float) and (value != value or abs(value) == float("inf")))
        try:
            t = torch.tensor(float(value), dtype=dtype, device=device)
        except OverflowError:
            return None, f"{where}: {_short(value)} does not fit a float"
        if finite and math.isinf(t.item()):  # (item: cheaper than a torch.isfinite here)
            return None, f"{where}: {_short(value)} overflows {ty.dtype.value} (it would be inf)"
        return t, None  # NaN and inf pass through, as in torch.optim
    if isinstance(value, float):
        if not value.is_integer():
            return None, f"{where}: {value!r} is not an integer (it would be truncated)"
        value = int(value)
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        return None, f"{where}: {_short(value)} is outside [{info.min}, {info.max}]"
    return torch.tensor(value, dtype=dtype, device=device), None


def _short(value: int | float) -> str:
    text = repr(value)
    return text if len(text) <= 30 else f"{text[:12]}...({len(text)} digits)"


_PACKED = {torch.float32: struct.Struct("=f")}  # (float16, bfloat16: the slow path)


def float_scalar(node: Node, raw: Any, device) -> tuple[torch.Tensor, str] | None:
    """A Python float or int for a 0-d float32 input, as ``scalar`` makes it and
    ``scalar_text`` names it, without reading the tensor back (those two cost ~15 us per
    scalar, and an optimizer passes two new ones every step); None for anything else (another
    dtype, a value that is not finite or does not fit: ``scalar`` words its problem).

    The text is ``scalar_text``'s exactly: ``struct`` rounds a double to float32 with the same
    C cast as ``torch.tensor``, so its bytes are the tensor's and ``repr`` of the rounded value
    is ``repr(t.item())`` (a rank taking the slow path names the same bits the same way)."""
    ty = node.type
    packer = _PACKED.get(ty.dtype.torch)
    if packer is None or ty.rank != 0 or type(raw) not in (float, int):
        return None
    try:
        x = float(raw)
        if not math.isfinite(x):
            return None
        bits = packer.pack(x)
    except (OverflowError, struct.error):
        return None
    rounded = packer.unpack(bits)[0]
    if not math.isfinite(rounded):
        return None
    return torch.tensor(x, dtype=ty.dtype.torch, device=device), f"{rounded!r} [{bits.hex()}]"


def scalar_text(t: torch.Tensor) -> str:
    """A 0-d Replicated input as the ranks compare it: its exact bits (NaN equals NaN)."""
    return f"{t.item()!r} [{bytes(t.detach().cpu().reshape(1).view(torch.uint8).tolist()).hex()}]"


def signature(name: str, t: torch.Tensor) -> tuple:
    """Everything the local checks of input ``name`` read from ``t`` (``_tensor``,
    ``unwritable``) and everything its aliasing with the other inputs depends on (``overlap``:
    its bytes' addresses, from the first element's address, the storage offset, shape, strides
    and dtype): equal signatures get equal verdicts."""
    return (name, t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device,
            t.requires_grad, t.is_inference())


def read_signature(name: str, t: torch.Tensor) -> tuple:
    """``signature`` for a step that writes none of its inputs: everything its local checks read
    from ``t`` (``_tensor``: dtype, device, rank; whether to detach it), without the addresses (no
    aliasing can lose a write that never happens) or the sizes: whether the sizes fit the program
    is the agreement's to say (``bind_sizes``, from every rank's shapes), so a layer called at a
    new length is, locally, the same call."""
    return (name, t.dim(), t.dtype, t.device, t.requires_grad)


def checksum(t: torch.Tensor) -> str:
    """A checksum of a tensor's bits (``check_replicated``): position-weighted sums of its
    elements' bit patterns, so equal bits give equal sums on every rank and a changed element
    almost surely does not."""
    flat = t.detach().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(width).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    plain, weighted = int(bits.sum()), int((bits * weights).sum())
    digest = hashlib.sha256(struct.pack("<qq", plain, weighted)).hexdigest()[:16]
    return f"{format_shape(tuple(t.shape))} checksum {digest}"


def unwritable(name: str, t: torch.Tensor) -> str | None:
    """Why the commit could not write updated input ``name`` in place (None: it can)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return (
            f"input {name!r} is updated but is an inference tensor (made under "
            "torch.inference_mode): it cannot be written outside it (pass a tensor made "
            f"outside inference_mode, or {name}.clone())"
        )
    if _self_overlapping(t):
        return (
            f"input {name!r} is updated but several of its elements are one memory location "
            f"(strides {list(t.stride())}, e.g. an expand()): pass {name}.clone()"
        )
    return None


def _self_overlapping(t: torch.Tensor) -> bool:
    verdict = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: too hard to tell
    if verdict != 2:
        return verdict == 1
    count = torch.zeros(_storage_elements(t), dtype=torch.int32)
    count.index_add_(0, _element_indices(t), torch.ones(t.numel(), dtype=torch.int32))
    return bool((count > 1).any())


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share an element's memory (exact, also for strided views)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    lo_a, hi_a = _byte_extent(a)
    lo_b, hi_b = _byte_extent(b)
    if hi_a <= lo_b or hi_b <= lo_a:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    marks = torch.zeros(a.untyped_storage().nbytes(), dtype=torch.bool)
    _byte_view(marks, a).fill_(True)
    return bool(_byte_view(marks, b).any())


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    steps = [(n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)]
    lo = t.storage_offset() + sum(d for d in steps if d < 0)
    hi = t.storage_offset() + sum(d for d in steps if d > 0)
    return lo * size, (hi + 1) * size


def _byte_view(marks: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements, as a view of ``marks`` (one bool per byte of its storage)."""
    e = t.element_size()
    return marks.as_strided(
        (*t.shape, e), (*(s * e for s in t.stride()), 1), t.storage_offset() * e
    )


def _storage_elements(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _element_indices(t: torch.Tensor) -> torch.Tensor:
    index = torch.arange(_storage_elements(t), dtype=torch.int64)
    return index.as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1)


def swappable(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``target`` can take ``value``'s storage (``CommitMode.SWAP``) instead of a copy:
    a whole tensor of its own (not a view, no autograd) and a fresh value of the same kind."""
    return (
        target._base is None
        and not target.requires_grad
        and target.is_contiguous()
        and value.is_contiguous()
        and value._base is None
        and value.shape == target.shape
        and value.dtype == target.dtype
        and value.device == target.device
        and target.storage_offset() == 0
        and value.storage_offset() == 0
        and target.untyped_storage().nbytes() == target.numel() * target.element_size()
    )


class Bound(NamedTuple):
    """A call's inputs that passed every local check (``CompiledStep._rebind``)."""

    key: tuple  # each input's signature or number key, in the program's order; inference mode
    numbers: dict[int, torch.Tensor]  # the tensors made of the numbers, by position
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    replicated: dict[str, str]


def number_key(raw: Any) -> tuple:
    """What tells a number input from another: its type and value, and a zero's sign (-0.0
    equals 0.0, and the tensor made of it differs). A NaN matches only the very same float
    object (tuple equality tests identity first), whose bits are the same."""
    if isinstance(raw, float) and raw == 0:
        return (float, raw, math.copysign(1.0, raw))
    return (type(raw), raw)


def aliasing(inputs: Sequence[Node], given: dict[str, Any], updated: set[str],
             donated: set[str]) -> list[str]:
    """Inputs whose memory makes the step lose an update or read what it wrote: two updated
    inputs that share elements (one write would be lost), or a donated input (overwritten
    mid-step) that shares elements with any other input. An updated input may share memory
    with inputs that are only read: every read happens before the commit writes."""
    if not updated and not donated:
        return []  # nothing is written: any sharing is harmless
    tensors = [(n.name, given[n.name]) for n in inputs]
    tensors = [(k, v) for k, v in tensors if isinstance(v, torch.Tensor) and v.numel()]
    problems = []
    for i, (a, ta) in enumerate(tensors):
        for b, tb in tensors[i + 1 :]:
            both_updated = a in updated and b in updated
            if not (both_updated or {a, b} & donated) or not overlap(ta, tb):
                continue
            if both_updated:
                why = "both are updated: one update would be lost"
            else:
                d = a if a in donated else b
                why = f"{d!r} is donated (overwritten mid-step): the other would read it"
            problems.append(
                f"inputs {a!r} and {b!r} share memory and {why} (pass separate tensors, "
                "e.g. .clone())"
            )
    return problems
