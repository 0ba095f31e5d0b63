"""Parameters split over a group of ranks, whose gradients' norms are the whole tensor's.

A tensor-parallel layer keeps this rank's part of its weight (``coconet.nn``). To everything
that steps or saves parameters (torch's optimizers, DDP, ``state_dict``) that part is an
ordinary parameter. Two things must not take a part for the whole, and this module is where
they learn the difference:

- **torch's own norms of the gradients.** ``ShardedParameter.grad`` reads as a
  ``ShardedGrad``: the same memory, whose *full* norms (``torch.linalg.vector_norm``,
  ``torch.linalg.norm``, ``torch.norm`` and ``Tensor.norm`` without ``dim``, and
  ``torch._foreach_norm``) are the whole tensor's: this rank's norm combined with the group's
  in one control round (exact: every rank gets the same bits). So
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` on a parallelized model computes
  the one-process norm and clips every rank by the same factor; the replicated parameters
  (LayerNorms, embeddings: the same on every rank) count once, as plain tensors. Every other op
  on a ``ShardedGrad`` is this rank's part, as on a plain tensor (and returns a plain tensor).
  ``GradScaler``'s inf check of the parts is combined over the group too, so that no rank of
  the group skips a step the others take.
- **``coconet.optim``**, which reads ``placement`` to count a parameter's squares over its
  group under ``max_grad_norm=`` and to refuse a data-parallel communicator that would average
  different parts of one tensor.

Why a parameter subclass rather than torch's ``DTensor``: ``clip_grad_norm_`` refuses to mix
DTensors with plain tensors, so every parameter of the model (its LayerNorms, its embeddings)
would have to become one, and the model's own modules then compute with DTensors; a layer that
swaps only its own linears (``parallelize``) must leave the rest of the model as it was.

A norm is a collective: every rank of the group must take it (as ``clip_grad_norm_`` on every
rank does). Taken on one rank only (a log line under ``if rank == 0``), it waits for the others
and fails at the communicator's timeout: log ``clip_grad_norm_``'s result instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from coconet.errors import ConfigError

__all__ = ["Placement", "ShardedGrad", "ShardedParameter", "placement_of"]

# torch's own attribute (a getset descriptor): the gradient autograd accumulates into
_GRAD = torch._C.TensorBase.grad


class Placement(NamedTuple):
    """Where a parameter's values live: this rank holds part ``index`` of ``parts`` of a tensor
    of ``shape``, split along ``dim`` over the ranks of ``comm`` (a ``Communicator``: the
    tensor-parallel group). ``comm`` is None for a parameter unpickled without its group
    (``coconet.nn.attach`` gives it back)."""

    comm: Any
    dim: int
    shape: tuple[int, ...]

    @property
    def key(self) -> tuple:
        """What tells groups apart: the job's ranks of the group (one communicator per group)."""
        return () if self.comm is None else tuple(self.comm.members)

    def describe(self) -> str:
        ranks = "no communicator" if self.comm is None else f"ranks {list(self.comm.members)}"
        return f"split along dim {self.dim} of {tuple(self.shape)} over {ranks}"


def placement_of(p: torch.Tensor) -> Placement | None:
    """A parameter's placement when it is split over a group of more than one rank, else
    None (a whole tensor: the same on every rank that holds it)."""
    placement = getattr(p, "placement", None)
    if not isinstance(placement, Placement):
        return None
    if placement.comm is not None and placement.comm.world == 1:
        return None
    return placement


class ShardedParameter(nn.Parameter):
    """This rank's part of a parameter split over a group (see the module docstring): an
    ``nn.Parameter`` whose ``placement`` says how, and whose ``.grad`` reads as a
    ``ShardedGrad`` (a view of the same memory: writes through it are the gradient's)."""

    placement: Placement

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True,
                placement: Placement | None = None) -> ShardedParameter:  # fmt: skip
        p = super().__new__(cls, data, requires_grad)
        p.placement = placement if placement is not None else Placement(None, 0, tuple(p.shape))
        return p

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        g = _GRAD.__get__(self)
        if g is None or type(g) is not torch.Tensor:
            return g
        view = g.as_subclass(ShardedGrad)
        view.placement = self.placement
        return view

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if isinstance(value, ShardedGrad):
            value = value.as_subclass(torch.Tensor)
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__set__(self, None)

    def __deepcopy__(self, memo: dict) -> ShardedParameter:
        # a copy (an EMA model, a snapshot) is split over the same group: it shares the
        # communicator, and copies the values
        if id(self) in memo:
            return memo[id(self)]
        copied = type(self)(self.data.clone(memory_format=torch.preserve_format),
                            self.requires_grad, self.placement)  # fmt: skip
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        # saved without the communicator (it cannot be pickled): coconet.nn.attach gives the
        # loaded model its group back
        return (_rebuild, (self.data, self.requires_grad, self.placement.dim,
                           tuple(self.placement.shape)))  # fmt: skip

    def __repr__(self) -> str:
        return f"ShardedParameter({self.placement.describe()}):\n{self.data!r}"


def _rebuild(data: torch.Tensor, requires_grad: bool, dim: int, shape: tuple[int, ...]
             ) -> ShardedParameter:  # fmt: skip
    return ShardedParameter(data, requires_grad, Placement(None, dim, tuple(shape)))


class ShardedGrad(torch.Tensor):
    """The gradient of a ``ShardedParameter`` as ``.grad`` reads it: this rank's part, whose
    full norms are the whole tensor's (module docstring)."""

    placement: Placement

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        whole = _WHOLE.get(func)
        if whole is not None:
            result = whole(args, kwargs)
            if result is not NotImplemented:
                return result
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, ShardedGrad) else t


def _order(value: Any) -> float | None:
    """A norm's order as a float (``'fro'`` is 2), or None for one this module cannot combine
    from the parts (``'nuc'``, matrix norms)."""
    if value is None or value == "fro":
        return 2.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _combine(order: float, parts: Sequence[float]) -> float:
    """The whole tensor's norm of ``order`` from its parts' norms (float64, in rank order)."""
    if order == math.inf:
        return max(parts)
    if order == -math.inf:
        return min(parts)
    if order == 0.0:
        return sum(parts)
    return sum(x**order for x in parts) ** (1.0 / order)


def _comm(t: ShardedGrad, what: str):
    comm = t.placement.comm
    if comm is None:
        raise ConfigError(
            f"{what} of a sharded parameter's gradient that has no communicator (the model was "
            "unpickled): its norm is the whole tensor's, over ranks this process does not know",
            op="coconet.ShardedGrad",
            hint="give the loaded model its group first: coconet.nn.attach(model, comm)",
        )
    return comm


def _local_norm(order: float, t: torch.Tensor, dtype: Any) -> torch.Tensor:
    if t.numel() == 0:  # an uneven split's empty part: the identity of its combination
        value = math.inf if order == -math.inf else 0.0
        return torch.tensor(value, dtype=dtype or t.dtype, device=t.device)
    return torch.linalg.vector_norm(t, order, dtype=dtype)


def _whole_norm(t: ShardedGrad, order: float, dtype: Any = None) -> torch.Tensor:
    """``t``'s norm of ``order`` as if taken over the whole tensor on one process."""
    comm = _comm(t, "the norm")
    with torch._C.DisableTorchFunctionSubclass():
        local = _local_norm(order, _plain(t), dtype)
        parts = [row[0] for row in comm.gather_floats([float(local)], "the norm of a part")]
        return torch.tensor(_combine(order, parts), dtype=local.dtype, device=local.device)


def _full_norm(args: tuple, kwargs: dict, order_name: str, matrices: bool) -> Any:
    """A norm call on a ``ShardedGrad``, the whole tensor's when it reduces over every dim:
    ``order_name``: the order's argument (``ord``, torch.norm's ``p``); ``matrices``: whether
    the function takes a matrix norm of a 2-D input (torch.linalg.norm, torch.norm)."""
    x, *rest = args
    given = {**dict(zip((order_name, "dim", "keepdim"), rest, strict=False)), **kwargs}
    order_given = given.get(order_name, given.get("ord", 2 if order_name == "ord" else None))
    if given.get("dim") is not None or given.get("out") is not None or not isinstance(
        x, ShardedGrad
    ):
        return NotImplemented  # a reduction over some dims: this rank's part
    if matrices and x.dim() > 1 and order_given not in (None, "fro"):
        # a matrix norm (spectral, nuclear, max row sum...): not a function of the parts' norms
        raise ConfigError(
            f"the matrix norm ord={order_given!r} of a sharded parameter's gradient cannot be "
            "computed from its parts",
            op="coconet.ShardedGrad",
            hint="take a vector norm of it (torch.linalg.vector_norm), or gather the whole "
            "tensor (the layer's to_full())",
        )
    order = _order(order_given)
    if order is None:
        return NotImplemented
    out = _whole_norm(x, order, given.get("dtype"))
    return out.reshape((1,) * x.dim()) if given.get("keepdim") else out


def _vector_norm(args: tuple, kwargs: dict) -> Any:
    # torch.linalg.vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None)
    return _full_norm(args, kwargs, "ord", matrices=False)


def _linalg_norm(args: tuple, kwargs: dict) -> Any:
    # torch.linalg.norm(x, ord=None, dim=None, keepdim=False, *, out=None, dtype=None)
    return _full_norm(args, kwargs, "ord", matrices=True)


def _norm(args: tuple, kwargs: dict) -> Any:
    # torch.norm(x, p='fro', dim=None, keepdim=False, out=None, dtype=None); Tensor.norm alike
    return _full_norm(args, kwargs, "p", matrices=True)


def _foreach_norm(args: tuple, kwargs: dict) -> Any:
    # torch._foreach_norm(tensors, ord=2, dtype=None): what clip_grad_norm_ calls with foreach
    tensors, *rest = args
    order = _order(rest[0] if rest else kwargs.get("ord", 2))
    dtype = rest[1] if len(rest) > 1 else kwargs.get("dtype")
    if order is None:
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        norms = [_local_norm(order, _plain(t), dtype) for t in tensors]
    # one round per group, the groups in order of first appearance (the same on every rank)
    by_group: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, ShardedGrad):
            by_group.setdefault(t.placement.key, []).append(i)
    for members in by_group.values():
        comm = _comm(tensors[members[0]], "the norm")
        every = comm.gather_floats([float(norms[i]) for i in members], "the norms of parts")
        for k, i in enumerate(members):
            value = _combine(order, [row[k] for row in every])
            norms[i] = torch.tensor(value, dtype=norms[i].dtype, device=norms[i].device)
    return norms


def _unscale(args: tuple, kwargs: dict) -> Any:
    # torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale): GradScaler
    # skips a step when any rank of the group found an inf in its part
    grads, found_inf, *_ = args
    with torch._C.DisableTorchFunctionSubclass():
        torch._amp_foreach_non_finite_check_and_unscale_(*args, **kwargs)
    by_group: dict[tuple, Any] = {}
    for g in grads:
        if isinstance(g, ShardedGrad):
            by_group.setdefault(g.placement.key, _comm(g, "GradScaler's inf check"))
    for comm in by_group.values():
        every = comm.gather_floats([float(found_inf)], "GradScaler: an inf in a part")
        found_inf.fill_(max(row[0] for row in every))
    return None


_WHOLE = {
    torch.linalg.vector_norm: _vector_norm,
    torch.linalg.norm: _linalg_norm,
    torch.norm: _norm,
    torch.Tensor.norm: _norm,
    torch._foreach_norm: _foreach_norm,
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale,
}
