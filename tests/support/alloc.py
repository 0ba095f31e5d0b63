"""What a step that allocates one large temporary sees, round after round (the allocator tests)."""

from __future__ import annotations

import resource

import torch


def fault_rounds(rounds: int, numel: int = 16 << 20) -> list[int]:
    """Minor page faults of each of ``rounds`` allocations of ``numel`` float32 (64 MiB by
    default), each freed before the next, as a step's temporary is."""
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(numel)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del x
    return faults
