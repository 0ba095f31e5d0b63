"""coconet.optim as a drop-in on 2 ranks: the unit tier's adapted torch (TestOptimRenewed, CPU
float32) and pytorch_optimizer (Lamb) cases with the state sliced, a parameter straddling the
two ranks' slices, and gradients missing on some ranks or on all (tests/support/dropin_workers.py:
one spawned group for everything; the reference is torch on the averaged gradient)."""

from __future__ import annotations

import pytest
from support import dropin_workers
from support.tolerances import OPTIM_RTOL, REASSOCIATED_RTOL

from coconet.runtime import CommOptions, spawn

# On 2 ranks LAMB's norms are partial sums over each rank's slice plus an all_reduce, where
# pytorch_optimizer.Lamb sums the whole tensor: the sums are re-associated (coconet.sim.exactness),
# so those comparisons get the re-associated tolerance (seen: 1.2e-6 with ATEN_CPU_CAPABILITY=
# default, 1e-7 with AVX-512).
LAMB_RTOL = REASSOCIATED_RTOL["float32"]


def _rtol(label: str) -> float:
    return LAMB_RTOL if label.startswith("LAMB") else OPTIM_RTOL


@pytest.mark.timeout(400)
def test_the_drop_in_cases_on_two_ranks():
    results = spawn(dropin_workers.dropin, 2, options=CommOptions(timeout=60), timeout=380)
    for rank, out in enumerate(results):
        for label, rel in {**out["cases"], **out["missing"]}.items():
            assert rel <= _rtol(label), (rank, label, rel)
        assert out["compiled"] <= OPTIM_RTOL, rank
        # opt.state: this rank's slices (rank 0: the first 32 of 63 values, rank 1 the rest)
        assert out["state_view"] <= OPTIM_RTOL, rank
        assert out["state_ranges"] == ([(0, 32), (0, 0), (0, 0)] if rank == 0
                                       else [(32, 50), (0, 10), (0, 3)]), rank
        assert out["steps"] == out["torch_steps"] and len(set(out["steps"])) > 1
        assert out["from_torch"] <= OPTIM_RTOL
        assert out["lamb_group_step"] == 3
        assert out["lamb_from_lamb"] <= LAMB_RTOL and out["lamb_to_lamb"] <= LAMB_RTOL
        assert out["frozen_unchanged"]
        assert "does not support sparse gradients" in out["sparse"] if rank == 1 else (
            "another rank holds a gradient it cannot step" in out["sparse"])
        assert out["sparse"].startswith("GradientError") and out["sparse_unchanged"]
        assert out["usable_after"]
        assert out["default_world"] == 2
        assert "amsgrad=True is not supported (param group 0)" in out["amsgrad_group"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_lamb_steps_equal_sized_tensors_as_rows_of_one_bucket(world):
    """LAMB's small tensors of one size share a step, one per row, each rank updating whole
    tensors (their norms need no collective): equal to pytorch_optimizer.Lamb on the averaged
    gradient with rows missing gradients on some ranks or on all, with pre_norm, and through
    checkpoints both ways (3 ranks: the two 7-element tensors are fewer than the ranks and
    step alone, the four of 24 are sliced 2 / 1 / 1)."""
    results = spawn(dropin_workers.lamb_rows, world, options=CommOptions(timeout=60),
                    timeout=280)
    rows = [[0, 2, 5, 7], [1, 4]] if world == 2 else [[0, 2, 5, 7]]
    for rank, out in enumerate(results):
        for label, rel in out["cases"].items():
            assert rel <= LAMB_RTOL, (rank, label, rel)
        assert [b for b, r in zip(out["buckets"], out["rows"], strict=True) if r] == rows
        assert sorted(i for b in out["buckets"] for i in b) == list(range(8))
        assert out["state_view"] <= LAMB_RTOL
        assert max(out["compiled"], out["from_lamb"], out["to_lamb"]) <= LAMB_RTOL, out
