"""``torch.amp.GradScaler`` inside the step: ``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()`` works unchanged, and on several ranks every rank skips the
same steps.

A ``coconet.optim`` optimizer declares ``_step_supports_amp_scaling`` (as torch's fused Adam
does), so ``scaler.step(opt)`` calls ``opt.step(grad_scaler=scaler)`` instead of unscaling the
gradients itself and checking each rank's own for infs (a pass over every gradient, and a
verdict per rank: a rank whose local gradient overflowed would skip a step its peers take, and
its scale would drift from theirs). Here:

- **the unscale** is a factor of the step's ``grad_scale`` (``1 / scale``, a power of two:
  exact), applied inside the fused pass; a scaler whose ``unscale_`` the user called already
  (to log or clip the local gradient) gives 1;
- **the inf/nan check** is the averaged gradient's norm, computed inside the step (the clip
  plan's speculative pass: ``coconet.optim.clip``), the same value on every rank (all-reduced):
  an inf or nan on any rank makes it non-finite everywhere. Such a step is **skipped on every
  rank** with the parameters, the state and the step counts untouched (torch's ``found_inf``);
- **the scaler's record**: its ``found_inf`` for this optimizer is set to that agreed verdict,
  so ``scaler.update()`` backs off (or grows) alike on every rank.

torch marks passing the scaler to ``step`` as deprecated (a ``FutureWarning`` once per
process) in favour of ``grad_scale``/``found_inf`` attributes, which carry the rank's own
verdict and leave the scaler's record out of reach: coconet keeps the keyword while torch
does. The scaler's record is its ``_per_optimizer_states`` (the tests run the real
``GradScaler``, so a change in torch shows there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from coconet.errors import ConfigError

__all__ = ["Float16WithoutScalerWarning", "Scaling", "warn_unscaled"]


class Float16WithoutScalerWarning(UserWarning):
    """float16 parameters stepped without ``torch.amp.GradScaler``: float16's range ends at
    65504 and its smallest normal is 6e-5, so gradients overflow to inf or vanish; an inf makes
    the step's update, then the master copy and the parameters, non-finite (as torch's optimizer
    would). Use ``scaler.step(opt)``, or bfloat16 (float32's range: no scaler needed)."""


def warn_unscaled(opt: Any) -> None:
    """Warn once per optimizer when it steps float16 parameters without a GradScaler."""
    if opt.watch.warned_unscaled:
        return
    if any(b.flat is not None and b.flat.dtype == torch.float16 for b in opt.buckets):
        import warnings

        from coconet.optim.params import user_stacklevel

        opt.watch.warned_unscaled = True
        warnings.warn(
            f"coconet.optim.{type(opt).__name__}: float16 parameters stepped without "
            "torch.amp.GradScaler: a gradient that overflows float16 makes the parameters "
            "non-finite, as with torch's optimizers. Scale the loss (scaler = "
            "torch.amp.GradScaler(); scaler.scale(loss).backward(); scaler.step(opt); "
            "scaler.update()) or use bfloat16.",
            Float16WithoutScalerWarning,
            stacklevel=user_stacklevel(),
        )


@dataclass
class Scaling:
    """One step's ``GradScaler``: the factor that unscales the averaged gradient, and the
    scaler whose record of this optimizer's verdict ``finish`` writes."""

    scaler: Any
    unscale: float  # 1 / scale, or 1 when the user unscaled already

    @classmethod
    def begin(cls, scaler: Any, opt: Any) -> Scaling | None:
        """The scaling of a ``step(grad_scaler=scaler)`` (None: no scaler, or a disabled one)."""
        if scaler is None:
            return None
        from torch.amp.grad_scaler import GradScaler, OptState

        if not isinstance(scaler, GradScaler):
            raise ConfigError(
                f"grad_scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}",
                op=f"coconet.optim.{type(opt).__name__}.step",
                hint="scaler = torch.amp.GradScaler(); scaler.step(opt) (it passes itself)",
            )
        if not scaler.is_enabled():
            return None
        if opt.ddp is not None:
            raise ConfigError(
                "GradScaler.step(opt) with ddp=: the update already happened inside "
                "backward(), before the scaler could check the gradients",
                op=f"coconet.optim.{type(opt).__name__}.step",
                hint="leave ddp= out (the step then unscales and checks the gradients itself), "
                "or use bfloat16, which needs no scaler",
            )
        stage = scaler._per_optimizer_states[id(opt)]["stage"]
        unscale = 1.0 if stage is OptState.UNSCALED else 1.0 / float(scaler.get_scale())
        return cls(scaler, unscale)

    @staticmethod
    def finite(norm: torch.Tensor) -> bool:
        """Whether the averaged gradient, whose norm this is, holds no inf and no nan (any
        such value makes the norm inf or nan)."""
        return math.isfinite(float(norm))

    def finish(self, opt: Any, skipped: bool) -> None:
        """Record the agreed verdict as the scaler's ``found_inf`` for ``opt`` (every device
        entry it holds, or one on the optimizer's device), for ``scaler.update()``."""
        state = self.scaler._per_optimizer_states[id(opt)]
        found = state["found_inf_per_device"]
        value = 1.0 if skipped else 0.0
        if found:
            for t in found.values():  # (unscale_ was called: its per-rank verdicts)
                t.fill_(value)
        else:
            device = self.scaler._scale.device if self.scaler._scale is not None else "cpu"
            found[torch.device(device)] = torch.full((), value, dtype=torch.float32,
                                                     device=device)  # fmt: skip
