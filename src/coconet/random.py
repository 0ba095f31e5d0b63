"""Counter-based randomness: a value per (seed, step, global element index), nothing stateful.

Because the random number of an element depends only on its global index, a dropout mask is the
same whether the tensor is whole, sliced over ranks or processed chunk by chunk. That is what lets
schedules be checked against the unscheduled program. The hash is a few rounds of xor-shift and
multiply kept inside 31 bits, so every intermediate fits in int64 without overflow on any backend.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = [
    "derive_seed",
    "dropout_mask",
    "round_stochastic",
    "global_index",
    "keep_threshold",
    "random_bits",
    "uniform",
]

_M31 = (1 << 31) - 1
_MUL = 0x45D9F3B  # < 2**31: a 31-bit value times it stays below 2**62


def _mix(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = ((x ^ (x >> 16)) * _MUL) & _M31
    return x ^ (x >> 16)


def _key(seed: int | torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """A 31-bit key (a 0-d int64 tensor) from the seed and the step.

    Plain tensor arithmetic, no ``.item()``: inside a ``torch.compile``d kernel the seed and step
    stay runtime values and the graph does not break.
    """
    seed = torch.as_tensor(seed, dtype=torch.int64)
    step = torch.as_tensor(step, dtype=torch.int64)
    k = _mix((seed & _M31) ^ ((seed >> 31) & _M31))
    return _mix(k ^ ((step & _M31) ^ ((step >> 31) & _M31)))


def derive_seed(base: int, name: str) -> int:
    """A seed of its own for the stream ``name`` (a layer's module name, one of its dropouts)
    under the user's ``base`` seed: the same in every process (a hash of the text, never
    Python's salted ``hash``), and unrelated for different names, so two layers that share a
    base seed and a call count still draw different masks. 62 bits, what ``_key`` reads of a
    seed."""
    digest = hashlib.blake2b(f"{int(base)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def random_bits(
    seed: int | torch.Tensor, step: int | torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """31 random bits (int64 in [0, 2**31)) per element of the int64 ``index`` tensor."""
    x = (index ^ (index >> 31)) & _M31
    return _mix(x ^ _key(seed, step).to(index.device))


def uniform(seed: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1), float64, one per element of the int64 ``index`` tensor."""
    return random_bits(seed, step, index).to(torch.float64) / float(1 << 31)


def keep_threshold(p: float) -> int:
    """Elements whose random bits are at least this are kept: ``uniform >= p`` in integers.

    ``bits / 2**31 >= p`` holds exactly when ``bits >= ceil(p * 2**31)`` (the product is exact in
    double precision), so masks need no floating point at all, and none in float64 inside a
    compiled kernel (where Inductor would compute in double, element by element).
    """
    return math.ceil(p * (1 << 31))


def global_index(
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    offsets: tuple[int, ...] | None = None,
    device: torch.device | str | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-major global index of each element of a block of a tensor.

    The block has ``local_shape`` and starts at ``offsets`` (one per dim) in a tensor of
    ``global_shape``; with no offsets it is the whole tensor. ``rows`` (int64, one per row of the
    block) gives the global index along dim 0 explicitly, for blocks whose rows are not contiguous
    (the chunks of an overlapped chain).
    """
    offsets = offsets or tuple(0 for _ in global_shape)
    idx = torch.zeros(local_shape, dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(global_shape))):
        if d == 0 and rows is not None:
            ar = rows.to(device=device, dtype=torch.int64)
        else:
            ar = torch.arange(
                offsets[d], offsets[d] + local_shape[d], dtype=torch.int64, device=device
            )
        view = [1] * len(local_shape)
        view[d] = local_shape[d]
        idx = idx + ar.view(view) * stride
        stride *= global_shape[d]
    return idx


def dropout_mask(
    seed: int | torch.Tensor,
    step: int | torch.Tensor,
    p: float,
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...] | None = None,
    offsets: tuple[int, ...] | None = None,
    device: torch.device | str | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The boolean keep-mask coconet's dropout uses (True = keep) for a block of a tensor.

    Use it to build plain-PyTorch references: ``x * dropout_mask(...) / (1 - p)`` equals
    coconet's ``dropout(x, p, seed, step)``.
    """
    local_shape = tuple(global_shape) if local_shape is None else local_shape
    if math.prod(local_shape) == 0:
        return torch.ones(local_shape, dtype=torch.bool, device=device)
    index = global_index(tuple(global_shape), local_shape, offsets, device, rows)
    return random_bits(seed, step, index) >= keep_threshold(p)


def round_stochastic(
    x: torch.Tensor,
    seed: int | torch.Tensor,
    step: int | torch.Tensor,
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...] | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``x`` (a block of a tensor of ``global_shape`` at ``offsets``) rounded to
    bfloat16 stochastically: up or down (in magnitude) with probabilities proportional to the
    distance to each, the random 16 bits keyed by (seed, step, the element's global index) as
    dropout's mask is, so every slice, chunk and rank rounds an element alike.

    In integers, exactly: a bfloat16 is a float32 whose low 16 bits are zero, so adding 16
    random bits to the float32 pattern (its magnitude: the sign bit stays) and clearing them
    rounds up exactly when the random value reaches the dropped fraction. inf stays inf, a value
    next to the largest finite one may round to inf (as the rounding should); nan stays nan."""
    index = global_index(global_shape, tuple(x.shape), offsets, x.device, rows)
    bits = (random_bits(seed, step, index) & 0xFFFF).to(torch.int32)
    pattern = x.contiguous().view(torch.int32)
    rounded = ((pattern + bits) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)
