"""Packing: an optimizer's parameters made into buckets, and each bucket's compiled steps.

``Packer`` makes a bucket of a group's parameters (the ranks agree on the shapes first, then
compile its step through the optimizer's recipes and pack its views), compiles a bucket's step
of another clip mode at its first use, and turns every bucket to the form of gradients averaged
before the step (a DDP wrapper's). Collective throughout: every rank packs the same buckets at
the same point.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from coconet.errors import ConfigError
from coconet.ir.program import Program
from coconet.ir.types import DType
from coconet.optim import state
from coconet.optim.buckets import Bucket, is_sliced, master_values, pack, tensor_buckets
from coconet.optim.programs import MASTER, MASTER_STATE_KEY, Clip, Precision
from coconet.options import ParamStorage, Rounding
from coconet.random import derive_seed
from coconet.runtime.shards import placement_of

__all__ = ["Packer"]


def _dtype(dtype: torch.dtype | None) -> DType | None:
    return None if dtype is None else DType.from_torch(dtype)


class Packer:
    """Makes an optimizer's buckets and their compiled steps (see the module docstring);
    ``opt``: the optimizer, through its public surface."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def pack_group(self, index: int, dtype: torch.dtype, params: list) -> None:
        """Pack ``params`` (trainable, of one dtype and kind) of group ``index`` into buckets:
        one, or one per tensor (or per row of equal-sized tensors) for an optimizer whose
        norms are each tensor's own."""
        opt = self.opt
        host_shared = opt.storage is ParamStorage.HOST_SHARED
        if opt.bucket_per_parameter:
            makes = tensor_buckets(params, host_shared, opt.comm.world)
        else:
            makes = [params]
        for members in makes:
            b = self.new_bucket(index, dtype, members)
            opt.hooks.extend(pack(b, opt.comm, host_shared))
            opt.buckets.append(b)

    def new_bucket(self, index: int, dtype: torch.dtype, params: list) -> Bucket:
        """The step of ``params`` as one flat vector, its state zero, not packed yet (the
        ranks agree on the shapes, then compile)."""
        opt = self.opt
        comm = opt.comm
        self.agree_on_shapes(index, dtype, params)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        clip = opt.clipper.mode_of_new_bucket(opt.buckets)
        # several tensors in a bucket of an optimizer with per-tensor norms: one per row
        row = params[0].numel() if opt.bucket_per_parameter and len(params) > 1 else 0
        names = dict(opt.state_names(opt.param_groups[index]))
        precision = Precision.of(DType.from_torch(dtype), _dtype(opt.reduce_dtype))
        if precision.master:
            names[MASTER] = MASTER_STATE_KEY
        b = Bucket(index, params, offsets, total, {}, (0, total), names, clip, row)
        b.placement = placement_of(params[0])
        b.averaged = opt.gradients_averaged_by is not None
        b.master, b.reduce = precision.master, _dtype(opt.reduce_dtype)
        if b.master and opt.rounding is Rounding.STOCHASTIC:
            if dtype != torch.bfloat16:
                raise ConfigError(
                    f"param group {index}: rounding='stochastic' rounds into bfloat16 "
                    f"parameters, these are {dtype}",
                    op=f"coconet.optim.{type(opt).__name__}",
                    hint="model.to(torch.bfloat16), or leave rounding= out for float16 (round "
                    "to nearest)",
                )
            # (a stream of its own per bucket: the same on every rank, which make the same
            # buckets in the same order)
            b.round_seed = derive_seed(0, f"coconet.optim bucket {len(opt.buckets)}")
        b.forms[clip] = step_fn = self.compile_form(b, clip)
        if b.master and MASTER not in {n.name for n in step_fn.program.inputs}:
            raise ConfigError(
                f"param group {index}: parameters of dtype {dtype} need a float32 master copy, "
                f"and {type(opt).__name__}.program has no input {MASTER!r}",
                op=f"coconet.optim.{type(opt).__name__}",
                hint="build the program with coconet.optim.programs' helpers (their dtype= "
                "takes 16-bit parameters), or keep the parameters in float32",
            )
        b.bounds = b.bounds_of(comm.rank, comm.world)
        n = b.bounds[1] - b.bounds[0]
        for name in names:
            size = n if is_sliced(step_fn.program, name) else total
            b.state[name] = torch.zeros(size, dtype=precision.math.torch, device=comm.device)
        if b.master:
            b.state[MASTER].copy_(master_values(b))  # (``pack`` records the version)
        return b

    def compile_form(self, b: Bucket, clip: Clip, averaged: bool | None = None) -> Any:
        """``b``'s compiled step that clips as ``clip`` says (``averaged``: of gradients
        averaged before the step; None: as the bucket is)."""
        opt = self.opt
        group = opt.param_groups[b.group]
        dtype = DType.from_torch(b.params[0].dtype)
        # (``reduce=`` and ``stochastic=`` only where asked for: a subclass's program may not
        # take them)
        extra: dict[str, Any] = {} if b.reduce is None else {"reduce": b.reduce}
        if b.round_seed is not None:
            extra["stochastic"] = True

        def program(**kwargs: Any) -> Program:
            try:
                return opt.program(group, dtype, **extra, **kwargs)
            except TypeError as e:
                missing = [k for k in extra if k in str(e)]
                if not missing:
                    raise
                raise ConfigError(
                    f"{type(opt).__name__}.program takes no {missing[0]}= (asked for by "
                    f"{'reduce_dtype=' if missing[0] == 'reduce' else 'rounding='})",
                    op=f"coconet.optim.{type(opt).__name__}",
                    hint=f"give its program a {missing[0]}= parameter (see coconet.optim."
                    "programs.adam), or leave the option out",
                ) from e

        averaged = b.averaged if averaged is None else averaged
        return opt.recipes.compile(program, tuple(b.names), b.size, clip, b.row, averaged)

    def form(self, b: Bucket, clip: Clip) -> Any:
        """``b``'s step of clip mode ``clip``, compiled at its first use (the ranks decline,
        and guess, alike: every rank compiles it at the same point)."""
        if clip not in b.forms:
            b.forms[clip] = self.compile_form(b, clip)
        return b.forms[clip]

    def settle_clipping(self) -> None:
        """The buckets changed: each one's way of clipping again (``Clipper.settle``)."""
        self.opt.clipper.settle(self.opt.buckets, self.compile_form)

    def averaged_forms(self) -> bool:
        """Every bucket's step in the form of gradients averaged before it (a DDP wrapper's:
        no collective; the state whole on every rank, gathered now); False when a program has
        no such form (a subclass's ``program`` without ``averaged=``)."""
        opt = self.opt
        try:
            forms = [self.compile_form(b, b.clip, averaged=True) for b in opt.buckets]
        except TypeError:
            return False
        for b, step_fn in zip(opt.buckets, forms, strict=True):
            full = {name: state.whole(opt.comm, b, name) for name in b.names}
            b.forms, b.bounds, b.averaged, b.state = {b.clip: step_fn}, (0, b.size), True, full
        opt.clipper.norm_passes.clear()
        return True

    def agree_on_shapes(self, index: int, dtype: torch.dtype, params: list) -> None:
        """Every rank packs the same shapes in the same order, else all of them fail."""
        text = f"{index}|{dtype}|" + ";".join(str(tuple(p.shape)) for p in params)
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        low, high = self.opt.comm.agree_max([digest, -digest], "optimizer parameters")
        if low != digest or -high != digest:
            raise ConfigError(
                f"param group {index} ({dtype}): the ranks hold different parameters "
                f"({len(params)} here, shapes {[tuple(p.shape) for p in params][:4]}...)",
                op=f"coconet.optim.{type(self.opt).__name__}",
                hint="build the same model on every rank and pass its parameters in the same "
                "order",
            )
