"""``coconet.optim.SGD``, ``Adam``, ``AdamW`` (torch's constructors and defaults) and ``LAMB``
(``pytorch_optimizer.Lamb``'s), coconet's step.

Each is a ``DistributedOptimizer`` (``coconet.optim.base``: buckets, sliced state, all-or-nothing
updates, torch-format checkpoints) over a DSL program of ``coconet.optim.programs``. What torch
offers that these do not: ``amsgrad``, ``capturable`` and ``differentiable`` (refused with an
error); ``foreach`` and ``fused`` are accepted and ignored (they choose among torch's
implementations; coconet's step is its own compiled program).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from coconet.errors import ConfigError
from coconet.ir.program import Program
from coconet.ir.types import DType
from coconet.optim import programs
from coconet.optim.base import DistributedOptimizer

__all__ = ["LAMB", "SGD", "Adam", "AdamW"]


def _check(name: str, what: str, value: Any, ok: bool) -> None:
    if not ok:
        raise ConfigError(
            f"invalid {what}: {value!r}",
            op=f"coconet.optim.{name}",
            hint="the same ranges as torch.optim's",
        )


def _unsupported(name: str, **flags: Any) -> None:
    for flag, value in flags.items():
        if value:
            raise ConfigError(
                f"{flag}=True is not supported",
                op=f"coconet.optim.{name}",
                hint=f"use torch.optim.{name} for {flag}",
            )


def _f(x: Any) -> float:
    return float(x)  # a tensor lr (schedulers may set one) is read as its value


class _AdamFamily(DistributedOptimizer):
    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        comm,
        schedule=None,
        options=None,
        ddp=None,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        name = type(self).__name__
        _check(name, "learning rate", lr, _f(lr) >= 0.0)
        _check(name, "epsilon value", eps, eps >= 0.0)
        _check(name, "beta parameter at index 0", betas[0], 0.0 <= betas[0] < 1.0)
        _check(name, "beta parameter at index 1", betas[1], 0.0 <= betas[1] < 1.0)
        _check(name, "weight_decay value", weight_decay, weight_decay >= 0.0)
        _unsupported(name, amsgrad=amsgrad, capturable=capturable, differentiable=differentiable)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )
        super().__init__(
            params, defaults, comm=comm, schedule=schedule, options=options, ddp=ddp
        )

    def program(self, group: dict[str, Any], dtype: DType) -> Program:
        return programs.adam(dtype)

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        return {"m": "exp_avg", "v": "exp_avg_sq"}

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        lr, wd, eps = _f(group["lr"]), _f(group["weight_decay"]), _f(group["eps"])
        beta1, beta2 = (_f(b) for b in group["betas"])
        return {
            "grad_scale": (-1.0 if group["maximize"] else 1.0) / self._comm.world,
            "weight_decay": 0.0 if self._decoupled else wd,
            "decay": 1.0 - lr * wd if self._decoupled else 1.0,
            "beta1": beta1,
            "one_minus_beta1": 1.0 - beta1,
            "beta2": beta2,
            "one_minus_beta2": 1.0 - beta2,
            "eps": eps,
            "step_size": lr / (1.0 - beta1**step),
            "bc2_sqrt": math.sqrt(1.0 - beta2**step),
        }

    def step_state(self, steps: int) -> dict[str, Any]:
        import torch

        return {"step": torch.tensor(float(steps))}

    def steps_of(self, entries) -> int:
        steps = {int(float(e["step"])) for e in entries if e is not None and "step" in e}
        if len(steps) > 1:
            raise ConfigError(
                f"the parameters of one bucket were saved at different steps {sorted(steps)}",
                op=f"coconet.optim.{type(self).__name__}.load_state_dict",
                hint="coconet.optim steps a param group's parameters together",
            )
        return steps.pop() if steps else 0


class Adam(_AdamFamily):
    """``torch.optim.Adam`` (L2 weight decay), data-parallel: see ``coconet.optim``."""


class AdamW(_AdamFamily):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2), data-parallel."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(DistributedOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay), data-parallel."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        comm,
        schedule=None,
        options=None,
        ddp=None,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        _check("SGD", "learning rate", lr, _f(lr) >= 0.0)
        _check("SGD", "momentum value", momentum, momentum >= 0.0)
        _check("SGD", "weight_decay value", weight_decay, weight_decay >= 0.0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError(
                "Nesterov momentum requires a momentum and zero dampening",
                op="coconet.optim.SGD",
                hint="SGD(..., momentum=0.9, nesterov=True)",
            )
        _unsupported("SGD", differentiable=differentiable)
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
            fused=fused,
        )
        super().__init__(
            params, defaults, comm=comm, schedule=schedule, options=options, ddp=ddp
        )

    def program(self, group: dict[str, Any], dtype: DType) -> Program:
        return programs.sgd_momentum(dtype) if group["momentum"] else programs.sgd(dtype)

    def state_names(self, group: dict[str, Any]) -> dict[str, str]:
        return {"buf": "momentum_buffer"} if group["momentum"] else {}

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        out = {
            "grad_scale": (-1.0 if group["maximize"] else 1.0) / self._comm.world,
            "weight_decay": _f(group["weight_decay"]),
            "lr": _f(group["lr"]),
        }
        momentum = _f(group["momentum"])
        if momentum:
            first = step == 1
            out["buf_momentum"] = 0.0 if first else momentum
            out["buf_damp"] = 1.0 if first else 1.0 - _f(group["dampening"])
            out["a"], out["b"] = (1.0, momentum) if group["nesterov"] else (0.0, 1.0)
        return out

    def steps_of(self, entries) -> int:
        return 1  # torch keeps no step count for SGD: any saved buffer means "started"


class LAMB(_AdamFamily):
    """LAMB as ``pytorch_optimizer.Lamb`` (4.x) computes it, with its constructor and defaults
    (``eps=1e-6``, decoupled weight decay, the weight norm clamped at 10, the trust ratio
    ``|p| / (|u| + eps)`` per parameter tensor, no bias correction of the second moment), data
    parallel. ``adam=True`` drops the trust ratio; ``fixed_decay`` decays by ``weight_decay``
    alone; ``grad_averaging=False`` accumulates ``m`` with weight 1. Not supported (an error):
    ``rectify``, ``pre_norm``, ``weight_decouple=False``. Each parameter tensor is its own step
    (its norms are its own): a model of many small tensors pays one collective per tensor.
    """

    bucket_per_parameter = True

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
        comm,
        schedule=None,
        options=None,
        ddp=None,
    ) -> None:
        _check("LAMB", "learning rate", lr, _f(lr) >= 0.0)
        _check("LAMB", "betas", betas, all(0.0 <= b < 1.0 for b in betas))
        _check("LAMB", "weight_decay value", weight_decay, weight_decay >= 0.0)
        _check("LAMB", "epsilon value", eps, eps >= 0.0)
        _unsupported("LAMB", rectify=rectify, pre_norm=pre_norm)
        if not weight_decouple:
            raise ConfigError(
                "weight_decouple=False (L2 weight decay) is not supported",
                op="coconet.optim.LAMB",
                hint="use the decoupled decay (the default), or pytorch_optimizer.Lamb",
            )
        defaults = dict(
            lr=lr, betas=betas, weight_decay=weight_decay, weight_decouple=weight_decouple,
            fixed_decay=fixed_decay, rectify=rectify, grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm, adam=adam, eps=eps, foreach=foreach, maximize=maximize,
        )
        DistributedOptimizer.__init__(
            self, params, defaults, comm=comm, schedule=schedule, options=options, ddp=ddp
        )

    def program(self, group: dict[str, Any], dtype: DType) -> Program:
        return programs.lamb(dtype)

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        lr, wd = _f(group["lr"]), _f(group["weight_decay"])
        beta1, beta2 = (_f(b) for b in group["betas"])
        return {
            "grad_scale": (-1.0 if group["maximize"] else 1.0) / self._comm.world,
            "beta1": beta1,
            "beta3": 1.0 - beta1 if group["grad_averaging"] else 1.0,
            "beta2": beta2,
            "one_minus_beta2": 1.0 - beta2,
            "eps": _f(group["eps"]),
            "decay": 1.0 - wd * (1.0 if group["fixed_decay"] else lr),
            "step_size": lr / (1.0 - beta1**step),
            "use_trust": 0.0 if group["adam"] else 1.0,
        }
