"""The tests' tolerance table: what a comparison may differ by, and why (one place for all tiers).

What is exact and what re-associates is decided by ``coconet.sim.exactness`` (its docstring is
the rule book): data movement, correctly rounded pointwise ops and rank-ordered reductions are
bitwise equal on every CPU; ``sum``/``norm``/``matmul`` on other shapes or in chunks, and
``exp``/``log``/``gelu``/``pow``/``silu``/``tanh``/``sigmoid``/``erf`` on other slices, are
not. A comparison is exact (``0.0``) unless ``reassociations(original, scheduled)`` names a
reason, and then it gets the tolerance below for its dtype.

- a schedule vs its program, nothing re-associated: 0 (bitwise), in every dtype;
- a schedule vs its program with re-associated sums (LAMB's partial norms, an overlapped matmul):
  rtol 1e-5 in float32 (a reordered sum of n terms moves by ~n ulp), 1e-2 in bfloat16/float16
  (one ulp of bfloat16 is 2**-8), atol 1e-6 for values near zero;
- gloo's own ("native") reductions on 3+ ranks vs the simulator's rank order: rtol 1e-6;
- an example vs torch.optim / nn.Linear / a plain-torch reference: the example's ``TOLERANCE``
  (1e-6 for the optimizers, 1e-5 for the layers: another library's order of operations);
  ``coconet.optim`` vs torch.optim / pytorch_optimizer.Lamb: ``OPTIM_RTOL`` (1e-6, the same);
- fused (torch.compile) kernels vs the simulator: 1e-6 of the largest value (``FUSED_RTOL``:
  Inductor may contract ``a * b + c`` into FMAs, and its ``sqrt`` is the CPU's instruction, which
  IEEE rounds correctly, where torch's eager ``sqrt`` is MKL's, which on some CPUs is not: on an
  AMD EPYC, 15% of float32 square roots came out 1 ulp off, the same bits at every position and
  slice, so eager code still agrees with eager code; ``eager_sqrt_is_correctly_rounded``).

The distributed tiers measure a normwise relative error (max abs error / max |expected|).

Exact comparisons that must stay exact whatever the schedule use integer-valued data, whose
sums and products are exact in float32 in any order (``test_paper_schedules``' layer tests).
"""

from __future__ import annotations

import functools

from coconet.ir.program import Program
from coconet.sim.exactness import reassociations

# Relative tolerance of a comparison whose sums a schedule re-associated, by dtype.
REASSOCIATED_RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
REASSOCIATED_ATOL = 1e-6  # float32 values near 0 (a relative bound means nothing there)
# gloo's own reductions ("native" algorithms) on 3+ ranks add in gloo's order, not rank order.
NATIVE_GLOO_RTOL = 1e-6
# coconet.optim against torch.optim / pytorch_optimizer.Lamb on the same (averaged) gradient,
# normwise relative: the same maths, another library's order of operations and fused kernels
# (the examples' TOLERANCE for the optimizers).
OPTIM_RTOL = 1e-6
# fused (torch.compile) kernels against the simulator's eager ops: FMAs, the CPU's own sqrt
FUSED_RTOL = 1e-6


@functools.cache
def eager_sqrt_is_correctly_rounded() -> bool:
    """Whether torch's eager float32 ``sqrt`` on this CPU is IEEE's (correctly rounded), as the
    square root instruction Inductor's kernels use is: then a fused kernel whose only departure
    from the simulator's ops could be its ``sqrt`` gives the simulator's bits. Checked on 4096
    floats spread over 2**-20..2**20 against numpy's ``sqrt`` (IEEE's)."""
    import numpy as np
    import torch

    x = torch.logspace(-20, 20, 4096, base=2.0, dtype=torch.float64).float()
    x = x * (1 + torch.arange(4096) % 7 / 13)  # not only powers of two
    return bool(np.array_equal(torch.sqrt(x).numpy(), np.sqrt(x.numpy())))


def schedule_rtol(original: Program, scheduled: Program, dtype: str = "float32") -> float:
    """The relative error allowed between ``scheduled`` and ``original``: 0.0 when nothing is
    re-associated (bitwise equal by construction), else ``REASSOCIATED_RTOL[dtype]``."""
    return REASSOCIATED_RTOL[dtype] if reassociations(original, scheduled) else 0.0
