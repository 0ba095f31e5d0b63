"""``coconet.optim.SGD``, ``Adam``, ``AdamW`` (torch's constructors and defaults) and ``LAMB``
(``pytorch_optimizer.Lamb``'s), coconet's step.

Each is a ``DistributedOptimizer`` (``coconet.optim.base``: buckets, sliced state, all-or-nothing
updates, torch-format checkpoints) over a DSL program of ``coconet.optim.programs``. What torch
offers that these do not: ``amsgrad``, ``capturable`` and ``differentiable`` (refused with an
error, in the constructor, in a param group's dict and in a loaded state dict); ``foreach`` and
``fused`` are accepted and ignored (they choose among torch's implementations; coconet's step is
its own compiled program). ``Adam(decoupled_weight_decay=True)`` (torch 2.13) is AdamW's update,
honoured per group (a torch ``AdamW`` checkpoint carries it).

``max_grad_norm=`` (SGD, Adam, AdamW; None: off) clips the averaged gradient by its global norm
inside the step, as ``torch.nn.utils.clip_grad_norm_`` after DDP's average: use it instead of
calling ``clip_grad_norm_`` before ``step()`` (which would clip each rank's local gradient).
``LAMB``'s ``max_grad_norm`` is ``pytorch_optimizer.Lamb``'s: read with ``pre_norm=True``, its
global scaling (Lamb's ``eps``, 0 is off), done the same way.

Hyper-parameters out of range raise ``ConfigValueError`` (a ``ConfigError`` and a
``ValueError``) with torch's message ("Invalid learning rate: -1"), checked for the constructor's
values, for every param group added and for every group of a loaded state dict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from coconet.errors import ConfigError, ConfigValueError
from coconet.ir.program import Program
from coconet.ir.types import DType
from coconet.optim import programs
from coconet.optim.base import DistributedOptimizer
from coconet.optim.buckets import Bucket
from coconet.optim.programs import Clip

__all__ = ["LAMB", "SGD", "Adam", "AdamW"]


def _check(name: str, where: str, what: str, value: Any, ok: bool) -> None:
    if not ok:
        raise ConfigValueError(
            f"Invalid {what}: {value!r}" + (f" ({where})" if where else ""),
            op=f"coconet.optim.{name}",
            hint="the same ranges as torch.optim's (pytorch_optimizer's for LAMB)",
        )


def _unsupported(name: str, where: str, group: dict[str, Any], *flags: str,
                 instead: str = "") -> None:
    for flag in flags:
        if group.get(flag):
            raise ConfigError(
                f"{flag}={group[flag]!r} is not supported" + (f" ({where})" if where else ""),
                op=f"coconet.optim.{name}",
                hint=f"leave {flag} off, or use {instead or f'torch.optim.{name}'} for it",
            )


def _f(x: Any) -> float:
    return float(x)  # a tensor lr (schedulers may set one) is read as its value


def _check_lr(name: str, where: str, lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ConfigValueError(
            f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}"
            + (f" ({where})" if where else ""),
            op=f"coconet.optim.{name}",
            hint="lr=torch.tensor(1e-3), or a float",
        )
    _check(name, where, "learning rate", lr, _f(lr) >= 0.0)


def _check_betas(name: str, where: str, betas: Any) -> None:
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ConfigValueError(
            "betas must be either both floats or both Tensors" + (f" ({where})" if where else ""),
            op=f"coconet.optim.{name}",
            hint="betas=(0.9, 0.999)",
        )
    for k in (0, 1):
        _check(name, where, f"beta parameter at index {k}", betas[k], 0.0 <= _f(betas[k]) < 1.0)


class _AdamFamily(DistributedOptimizer):
    _decoupled = False
    supports_grad_clip = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        comm=None,
        schedule=None,
        options=None,
        ddp=None,
        param_storage=None,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = None,
        rounding: str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=bool(decoupled_weight_decay),
        )
        self.check_group(defaults, "")
        super().__init__(
            params, defaults, comm=comm, schedule=schedule, options=options, ddp=ddp,
            param_storage=param_storage, max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
            rounding=rounding,
        )

    def check_group(self, group: dict[str, Any], where: str) -> None:
        name = type(self).__name__
        _check_lr(name, where, group["lr"])
        _check(name, where, "epsilon value", group["eps"], _f(group["eps"]) >= 0.0)
        _check_betas(name, where, group["betas"])
        _check(name, where, "weight_decay value", group["weight_decay"],
               _f(group["weight_decay"]) >= 0.0)
        _unsupported(name, where, group, "amsgrad", "capturable", "differentiable")

    def program(self, group: dict[str, Any], dtype: DType, clip: Clip = Clip.OFF,
                averaged: bool = False, reduce: DType | None = None,
                stochastic: bool = False) -> Program:  # fmt: skip
        return programs.adam(dtype, clip, averaged, reduce, stochastic)

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        return {"m": "exp_avg", "v": "exp_avg_sq"}

    SCALAR_SOURCES = {
        "grad_scale": "maximize (and the world size)",
        "weight_decay": "weight_decay",
        "decay": "lr and weight_decay (decay = 1 - lr * weight_decay)",
        "beta1": "betas[0]",
        "one_minus_beta1": "betas[0]",
        "beta2": "betas[1]",
        "one_minus_beta2": "betas[1]",
        "eps": "eps",
        "step_size": "lr (step_size = lr / (1 - beta1 ** step))",
        "bc2_sqrt": "betas[1] (bc2_sqrt = sqrt(1 - beta2 ** step))",
    }

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        lr, wd, eps = _f(group["lr"]), _f(group["weight_decay"]), _f(group["eps"])
        beta1, beta2 = (_f(b) for b in group["betas"])
        decoupled = bool(group.get("decoupled_weight_decay", self._decoupled))
        return {
            "grad_scale": (-1.0 if group["maximize"] else 1.0) / self.comm.world,
            "weight_decay": 0.0 if decoupled else wd,
            "decay": 1.0 - lr * wd if decoupled else 1.0,
            "beta1": beta1,
            "one_minus_beta1": 1.0 - beta1,
            "beta2": beta2,
            "one_minus_beta2": 1.0 - beta2,
            "eps": eps,
            "step_size": lr / (1.0 - beta1**step),
            "bc2_sqrt": math.sqrt(1.0 - beta2**step),
        }

    def step_state(self, steps: int) -> dict[str, Any]:
        return {"step": torch.tensor(float(steps))}  # torch's: a float32 0-d tensor

    def step_of(self, entry: dict[str, Any]) -> int:
        if "step" not in entry:
            return 1 if entry.get("exp_avg") is not None else 0
        return int(float(entry["step"]))


class Adam(_AdamFamily):
    """``torch.optim.Adam`` (L2 weight decay; ``decoupled_weight_decay=True``: AdamW's),
    data-parallel: see ``coconet.optim``.

    **Gradient clipping: use ``max_grad_norm=``, not ``torch.nn.utils.clip_grad_norm_``.**
    ``max_grad_norm=1.0`` clips as ``clip_grad_norm_(params, 1.0)`` does after DDP's average:
    the gradient is multiplied by ``min(1.0 / (norm + 1e-6), 1)``, ``norm`` the 2-norm of the
    *averaged* gradient over every parameter of every param group, computed inside the step
    (a sum of squares of this rank's slice after the reduce_scatter, one scalar all_reduce);
    ``opt.last_grad_norm`` is that norm (a 0-d tensor, what ``clip_grad_norm_`` returns).
    ``clip_grad_norm_`` between ``backward()`` and ``step()`` clips each rank's *local*
    gradient before the step averages it: a different, wrong update, and nothing can tell.
    """


class AdamW(_AdamFamily):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2), data-parallel.
    ``max_grad_norm=``: global-norm clipping of the averaged gradient in the step, as ``Adam``
    (use it, not ``torch.nn.utils.clip_grad_norm_``)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs) -> None:
        if "decoupled_weight_decay" in kwargs:  # as torch's AdamW, which has no such argument
            raise TypeError("AdamW.__init__() got an unexpected keyword argument "
                            "'decoupled_weight_decay' (AdamW's decay is always decoupled)")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                         decoupled_weight_decay=True, **kwargs)


class SGD(DistributedOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay), data-parallel.

    ``max_grad_norm=``: clips the averaged gradient by its global norm inside the step, as
    ``Adam`` does (see there): use it, not ``torch.nn.utils.clip_grad_norm_``."""

    supports_grad_clip = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        comm=None,
        schedule=None,
        options=None,
        ddp=None,
        param_storage=None,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = None,
        rounding: str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
            fused=fused,
        )
        self.check_group(defaults, "")
        super().__init__(
            params, defaults, comm=comm, schedule=schedule, options=options, ddp=ddp,
            param_storage=param_storage, max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
            rounding=rounding,
        )

    def check_group(self, group: dict[str, Any], where: str) -> None:
        _check_lr("SGD", where, group["lr"])
        _check("SGD", where, "momentum value", group["momentum"], _f(group["momentum"]) >= 0.0)
        _check("SGD", where, "weight_decay value", group["weight_decay"],
               _f(group["weight_decay"]) >= 0.0)
        # torch checks this of the constructor's values only: in a group, nesterov without
        # momentum is plain SGD, and with dampening the program computes what torch does
        constructor = not where
        if constructor and group["nesterov"] and (
            _f(group["momentum"]) <= 0 or _f(group["dampening"]) != 0
        ):
            raise ConfigValueError(
                "Nesterov momentum requires a momentum and zero dampening",
                op="coconet.optim.SGD",
                hint="SGD(..., momentum=0.9, nesterov=True)",
            )
        _unsupported("SGD", where, group, "differentiable")

    def program(self, group: dict[str, Any], dtype: DType, clip: Clip = Clip.OFF,
                averaged: bool = False, reduce: DType | None = None,
                stochastic: bool = False) -> Program:  # fmt: skip
        if group["momentum"]:
            return programs.sgd_momentum(dtype, clip, averaged, reduce, stochastic)
        return programs.sgd(dtype, clip, averaged, reduce, stochastic)

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        return {"buf": "momentum_buffer"} if group["momentum"] else {}

    SCALAR_SOURCES = {
        "grad_scale": "maximize (and the world size)",
        "weight_decay": "weight_decay",
        "lr": "lr",
        "buf_momentum": "momentum",
        "buf_damp": "dampening",
        "a": "nesterov and momentum",
        "b": "nesterov and momentum",
    }

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        out = {
            "grad_scale": (-1.0 if group["maximize"] else 1.0) / self.comm.world,
            "weight_decay": _f(group["weight_decay"]),
            "lr": _f(group["lr"]),
        }
        momentum = _f(group["momentum"])
        if momentum:
            first = step == 1  # the parameter's first step: torch starts its buffer at d
            out["buf_momentum"] = 0.0 if first else momentum
            out["buf_damp"] = 1.0 if first else 1.0 - _f(group["dampening"])
            out["a"], out["b"] = (1.0, momentum) if group["nesterov"] else (0.0, 1.0)
        return out

    def step_of(self, entry: dict[str, Any]) -> int:
        # torch keeps no step count for SGD: a saved buffer means "started" (a None buffer, as
        # torch saves without momentum, does not)
        return 1 if entry.get("momentum_buffer") is not None else 0

    def required_state(self, names: dict[str, str]) -> list[str]:
        return []  # torch's SGD reads its buffer with state.get: a missing one starts afresh


class LAMB(_AdamFamily):
    """LAMB as ``pytorch_optimizer.Lamb`` (4.x) computes it, with its constructor and defaults
    (``eps=1e-6``, decoupled weight decay, the weight norm clamped at 10, the trust ratio
    ``|p| / (|u| + eps)`` per parameter tensor, no bias correction of the second moment), data
    parallel. ``adam=True`` drops the trust ratio; ``fixed_decay`` decays by ``weight_decay``
    alone; ``grad_averaging=False`` accumulates ``m`` with weight 1. ``pre_norm=True`` with
    ``max_grad_norm`` (> 0; 0 is off, as Lamb reads it) scales the *averaged* gradient by
    ``min(max_grad_norm / (norm + eps), 1)``, ``norm`` its global norm over every parameter,
    as Lamb does on one process (or after DDP's average): inside the step, after a norm pass
    over every bucket (``coconet.optim.base``). Not supported (an error, in the constructor, a
    group or a loaded state dict): ``rectify``, ``weight_decouple=False``, ``adanorm``,
    ``adam_debias``. The norms are each tensor's own: the small
    tensors of one size (at most ``base.ROW_ELEMENTS`` elements, at least one per rank) share one
    step, one tensor per row, each rank updating whole tensors; every other tensor is a step of
    its own (a model of many small tensors of different sizes still pays a step per size).

    As Lamb, the step count is its param group's (``param_groups[i]["step"]``, counted at every
    ``step()``, also for parameters without a gradient, which are skipped), so checkpoints move
    to and from ``pytorch_optimizer.Lamb`` either way. Lamb's per-parameter diagnostics are in
    each stepped parameter's state as Lamb keeps them (``weight_norm``, ``adam_norm``,
    ``trust_ratio``: 0-d tensors, outputs of the fused step), saved and loaded with it. As Lamb,
    the step leaves each gradient scaled in place by the global factor (``pre_norm``) and negated
    (``maximize``): a gradient accumulated into without ``zero_grad()`` starts from that.
    """

    bucket_per_parameter = True
    # pre_norm: Lamb's global scaling, with its eps (not torch's 1e-6) and its max_grad_norm;
    # the factor is computed on the host from the norm pass (clip_factor), whatever the buckets
    supports_grad_clip = True
    clip_in_step = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        weight_decouple: bool = True,
        fixed_decay: bool = False,
        rectify: bool = False,
        degenerated_to_sgd: bool = False,
        n_sma_threshold: int = 5,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        adam: bool = False,
        pre_norm: bool = False,
        eps: float = 1e-6,
        foreach: bool | None = None,
        maximize: bool = False,
        *,
        comm=None,
        schedule=None,
        options=None,
        ddp=None,
        param_storage=None,
        reduce_dtype: torch.dtype | None = None,
        rounding: str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, weight_decay=weight_decay, weight_decouple=weight_decouple,
            fixed_decay=fixed_decay, rectify=rectify, grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm, adam=adam, eps=eps, foreach=foreach, maximize=maximize,
        )
        self.check_group(defaults, "")
        # Lamb scales by the global norm only with pre_norm, and reads 0 as off
        self.pre_norm = bool(pre_norm)
        scaling = self.pre_norm and _f(max_grad_norm) > 0.0
        DistributedOptimizer.__init__(
            self, params, defaults, comm=comm, schedule=schedule, options=options, ddp=ddp,
            param_storage=param_storage, max_grad_norm=max_grad_norm if scaling else None,
            reduce_dtype=reduce_dtype, rounding=rounding,
        )

    def clip_factor(self, norm: torch.Tensor) -> torch.Tensor:
        # Lamb's get_global_gradient_norm: the constructor's max_grad_norm and eps (its
        # defaults, not a group's), clamp(max_grad_norm / (norm + eps), max=1)
        return torch.clamp(self.max_grad_norm / (norm + _f(self.defaults["eps"])), max=1.0)

    def check_group(self, group: dict[str, Any], where: str) -> None:
        _check_lr("LAMB", where, group["lr"])
        _check_betas("LAMB", where, group["betas"])
        _check("LAMB", where, "weight_decay value", group["weight_decay"],
               _f(group["weight_decay"]) >= 0.0)
        _check("LAMB", where, "epsilon value", group["eps"], _f(group["eps"]) >= 0.0)
        _check("LAMB", where, "max_grad_norm", group.get("max_grad_norm", 0.0),
               _f(group.get("max_grad_norm", 0.0)) >= 0.0)
        _unsupported("LAMB", where, group, "rectify", "adanorm", "adam_debias",
                     instead="pytorch_optimizer.Lamb")
        if not group.get("weight_decouple", True):
            raise ConfigError(
                "weight_decouple=False (L2 weight decay) is not supported"
                + (f" ({where})" if where else ""),
                op="coconet.optim.LAMB",
                hint="use the decoupled decay (the default), or pytorch_optimizer.Lamb",
            )

    def program(self, group: dict[str, Any], dtype: DType, clip: Clip = Clip.OFF,
                rows: bool = False, averaged: bool = False,
                reduce: DType | None = None, stochastic: bool = False) -> Program:  # fmt: skip
        return programs.lamb(dtype, clip, rows, averaged, reduce, stochastic)

    SCALAR_SOURCES = {
        "grad_scale": "maximize (and the world size)",
        "beta1": "betas[0]",
        "beta3": "betas[0] and grad_averaging",
        "beta2": "betas[1]",
        "one_minus_beta2": "betas[1]",
        "eps": "eps",
        "decay": "lr, weight_decay and fixed_decay (decay = 1 - weight_decay * lr)",
        "step_size": "lr (step_size = lr / (1 - beta1 ** step))",
        "use_trust": "adam",
    }

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        lr, wd = _f(group["lr"]), _f(group["weight_decay"])
        beta1, beta2 = (_f(b) for b in group["betas"])
        return {
            "grad_scale": (-1.0 if group["maximize"] else 1.0) / self.comm.world,
            "beta1": beta1,
            "beta3": 1.0 - beta1 if group["grad_averaging"] else 1.0,
            "beta2": beta2,
            "one_minus_beta2": 1.0 - beta2,
            "eps": _f(group["eps"]),
            "decay": 1.0 - wd * (1.0 if group["fixed_decay"] else lr),
            "step_size": lr / (1.0 - beta1**step),
            "use_trust": 0.0 if group["adam"] else 1.0,
        }

    # the step count is the group's, as Lamb keeps it
    def next_steps(self, b: Bucket) -> list[int]:
        return [int(self.param_groups[b.group].get("step", 0)) + 1] * len(b.params)

    def before_bucket(self, b: Bucket) -> None:
        # a bucket of rows: the norm of each row whose state this rank holds (whole tensors),
        # before the step writes them (Lamb's weight_norm is the decayed weight's, before the
        # update)
        self._row_norms = None
        if b.row:
            lo, hi = _held(b)
            # the weights the step reads: the float32 master copy of 16-bit parameters
            weights = b.state[programs.MASTER] if b.master else b.flat[lo:hi]
            self._row_norms = weights.view(-1, b.row).norm(dim=1).double()

    def after_bucket(self, b: Bucket, outputs: dict[str, torch.Tensor], stepped: list[int]
                     ) -> None:  # fmt: skip
        # Lamb's per-tensor diagnostics in each stepped parameter's state, as Lamb keeps them
        # (0-d tensors): a flat bucket's are its step's outputs; a bucket of rows' are computed
        # here from the rows this rank holds whole, then gathered (one control round)
        if b.row:
            values = self._row_diagnostics(b)
        elif "weight_norm" in outputs:
            values = [[outputs[k].reshape(()).clone()
                       for k in ("weight_norm", "adam_norm", "trust_ratio")]]  # fmt: skip
        else:
            return
        view = self.state
        for i in stepped:
            kept = view.extra.setdefault(id(b.params[i]), {})
            row = values[i] if b.row else values[0]
            kept.update(zip(("weight_norm", "adam_norm", "trust_ratio"), row, strict=True))

    def _row_diagnostics(self, b: Bucket) -> list[list[torch.Tensor]]:
        """Each row's (weight_norm, adam_norm, trust_ratio) of a bucket of rows, every rank's
        rows (gathered): Lamb's arithmetic on the rows this rank stepped."""
        group = self.param_groups[b.group]
        lr, wd, eps = _f(group["lr"]), _f(group["weight_decay"]), _f(group["eps"])
        decay = 1.0 - wd * (1.0 if group["fixed_decay"] else lr)
        m, v = (b.state[name].view(-1, b.row).double() for name in ("m", "v"))
        adam = (m / (v.sqrt() + eps)).norm(dim=1)
        weight = (decay * self._row_norms).clamp(max=programs.LAMB_WEIGHT_NORM_CLAMP)
        trust = torch.where((weight > 0) & (adam > 0), weight / (adam + eps),
                            torch.ones_like(weight))  # fmt: skip
        mine = torch.stack([weight, adam, trust], dim=1).reshape(-1).tolist()
        if _held(b) == (0, b.size):  # the state whole here (AR_C; gradients averaged by DDP)
            rows = mine
        else:
            # every rank's rows, in rank order (a rank's are contiguous), padded to one count
            comm = self.comm
            counts = [(hi - lo) // b.row for lo, hi in (b.bounds_of(r, comm.world)
                                                        for r in range(comm.world))]  # fmt: skip
            width = 3 * max(counts)
            every = comm.gather_floats(mine + [0.0] * (width - len(mine)),
                                       "coconet.optim.LAMB: the rows' diagnostics")  # fmt: skip
            rows = [x for r, values in enumerate(every) for x in values[: 3 * counts[r]]]
        dtype = b.state["m"].dtype  # (Lamb's: its state's, float32 for 16-bit parameters)
        return [[torch.tensor(rows[3 * k + j], dtype=dtype) for j in range(3)]
                for k in range(len(rows) // 3)]

    def after_step(self) -> None:
        for group in self.param_groups:
            group["step"] = int(group.get("step", 0)) + 1
        # Lamb's own effect on the gradients: it scales each gradient in place by the global
        # factor (pre_norm) and negates it (maximize), so that a gradient accumulated into
        # without zero_grad() afterwards starts from those values. The same here, on this
        # rank's gradient (what backward() accumulates into: linear, so averaged as under DDP).
        coef = self.last_clip_coef if self.pre_norm else None
        for b in self.buckets:
            sign = -1.0 if self.param_groups[b.group]["maximize"] else 1.0
            if coef is None and sign == 1.0:
                continue
            factor = coef * sign if coef is not None else torch.tensor(sign)
            if all(b.has_grad):
                b.grad.mul_(factor)
                continue
            for i, has in enumerate(b.has_grad):  # (a parameter without a gradient: None in
                if has:                          # Lamb, untouched)
                    b.grad[slice(*b.span(i))].mul_(factor)

    def step_state(self, steps: int) -> dict[str, Any]:
        return {}  # Lamb's state has no per-parameter step

    def step_of(self, entry: dict[str, Any]) -> int:
        # a checkpoint of coconet's LAMB before it kept Lamb's format has a per-parameter step
        if "step" in entry:
            return int(float(entry["step"]))
        return 1 if entry.get("exp_avg") is not None else 0

    def after_load(self) -> None:
        # such an old checkpoint has no group step: its parameters' count is the group's
        for b in self.buckets:
            group = self.param_groups[b.group]
            if "step" not in group and any(b.steps):
                group["step"] = max(max(bb.steps) for bb in self.buckets
                                    if bb.group == b.group)


def _held(b: Bucket) -> tuple[int, int]:
    """The elements of ``b`` whose state this rank holds: its slice, or all of it."""
    state = next(iter(b.state.values()), None)
    return (0, b.size) if state is None or state.numel() == b.size else b.bounds
