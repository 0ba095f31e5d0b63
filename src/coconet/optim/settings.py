"""The coconet arguments of an optimizer's constructor, checked: ``comm=``, ``param_storage=``,
``max_grad_norm=``, ``reduce_dtype=`` (each a clear error naming the value and what to give
instead)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from coconet.errors import ConfigError, ConfigValueError
from coconet.options import ParamStorage, Rounding
from coconet.runtime.comm import Communicator

__all__ = ["PARAM_DTYPES", "checked_max_grad_norm", "checked_reduce_dtype", "default_comm",
           "param_storage", "rounding"]

# The parameter dtypes an optimizer steps: float32 as torch.optim does; 16-bit ones through a
# float32 master copy of this rank's slice (coconet.optim.programs.Precision)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_comm(comm: Any, name: str) -> Communicator:
    """``comm``, or the communicator of ``coconet.runtime.init()`` (made once per process):
    the job of an initialised torch.distributed, torchrun's environment, or a world of one."""
    if comm is None:
        from coconet.runtime import launch

        return launch.current() or launch.init()
    if not isinstance(comm, Communicator):
        raise ConfigError(
            f"{name} needs a communicator, got comm={comm!r}",
            op=f"coconet.optim.{name}",
            hint="comm = coconet.runtime.init(); opt = coconet.optim."
            f"{name}(model.parameters(), comm=comm), or leave comm out for that default",
        )
    return comm


def checked_max_grad_norm(value: Any, name: str, ddp: Any, supported: bool) -> float | None:
    """``max_grad_norm=``: None (no clipping) or a finite number > 0; refused with ``ddp=``
    and for an optimizer whose program cannot clip."""
    if value is None:
        return None
    op = f"coconet.optim.{name}"
    if not supported:
        raise ConfigError(
            f"{name}: max_grad_norm={value!r} is not supported: its program does not clip",
            op=op,
            hint="give its program a clip= parameter (see coconet.optim.programs.adam) and "
            "set supports_grad_clip = True, or leave max_grad_norm out",
        )
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{name}: max_grad_norm={value!r} is not a number",
            op=op,
            hint="max_grad_norm=1.0 (the gradients' global norm is clipped to it), or None "
            "for no clipping",
        )
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ConfigValueError(
            f"{name}: max_grad_norm={value!r} must be a finite number > 0",
            op=op,
            hint="max_grad_norm=1.0 (nanoGPT's grad_clip); None turns clipping off (not 0, "
            "which would zero every gradient, and not inf)",
        )
    if ddp is not None:
        raise ConfigError(
            f"{name}: max_grad_norm= cannot be combined with ddp=: with ddp= each DDP bucket "
            "is updated inside backward() as soon as its gradients are ready, before the "
            "other buckets' gradients exist, so the global norm is not known when a bucket is "
            "updated (and a clip_grad_norm_ after backward() would come too late: the update "
            "has happened)",
            op=op,
            hint="leave ddp= out and the model unwrapped: coconet.optim averages the gradients "
            "in its step and clips them there by the global norm (max_grad_norm=); backward() "
            "writes straight into its buckets",
        )
    return value


def param_storage(storage: Any, name: str, ddp: Any) -> ParamStorage:
    """``param_storage=``, checked: a ``ParamStorage`` or its value."""
    if storage is None:
        return ParamStorage.PER_RANK
    try:
        storage = ParamStorage(storage)
    except ValueError:
        raise ConfigError(
            f"{name}: param_storage={storage!r} is not one of "
            f"{[s.value for s in ParamStorage]}",
            op=f"coconet.optim.{name}",
            hint="param_storage='host-shared' (one copy per host) or 'per-rank' (the default)",
        ) from None
    if storage is ParamStorage.HOST_SHARED and ddp is not None:
        raise ConfigError(
            f"{name}: param_storage='host-shared' cannot be combined with ddp=: DDP's buckets "
            "are its own",
            op=f"coconet.optim.{name}",
            hint="leave ddp= out (backward() then fills the optimizer's gradient bucket "
            "directly), or keep per-rank storage",
        )
    return storage


def checked_reduce_dtype(value: Any, name: str, ddp: Any) -> torch.dtype | None:
    """``reduce_dtype=``: the dtype the gradients are sent and reduced in (FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=)``; Megatron's ``grad_reduce_in_fp32`` is
    ``reduce_dtype=torch.float32`` with 16-bit parameters). None: the gradients' own dtype. A
    16-bit reduction accumulates in float32 and rounds once."""
    if value is None:
        return None
    op = f"coconet.optim.{name}"
    if not isinstance(value, torch.dtype) or value not in PARAM_DTYPES:
        raise ConfigError(
            f"{name}: reduce_dtype={value!r} is not one of torch.float32, torch.bfloat16, "
            "torch.float16",
            op=op,
            hint="reduce_dtype=torch.bfloat16 sends the gradients in bfloat16 (half the bytes "
            "of float32); None (the default) reduces them in their own dtype",
        )
    if ddp is not None:
        raise ConfigError(
            f"{name}: reduce_dtype= cannot be combined with ddp=: with ddp= DDP reduces the "
            "gradients (its communication hook hands them over in their dtype)",
            op=op,
            hint="leave ddp= out: coconet.optim reduces the gradients in its step, in "
            "reduce_dtype",
        )
    return value


def rounding(value: Any, name: str) -> Rounding:
    """``rounding=``: a ``Rounding`` or its value (``"nearest"``, the default;
    ``"stochastic"``)."""
    if value is None:
        return Rounding.NEAREST
    try:
        return Rounding(value)
    except ValueError:
        raise ConfigError(
            f"{name}: rounding={value!r} is not one of {[r.value for r in Rounding]}",
            op=f"coconet.optim.{name}",
            hint="rounding='stochastic' rounds the float32 master into bfloat16 parameters "
            "up or down at random (unbiased); 'nearest' is the default",
        ) from None
