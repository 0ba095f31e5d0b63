"""16-bit parameters and ``reduce_dtype=`` in coconet.optim on 2 and 3 ranks (uneven slices:
63 values), over shared memory and over torch.distributed (gloo), against torch's optimizer
over a float32 master copy (tests/support/precision_workers.py says how the reference averages
the gradient); a state dict saved on 2 ranks resumed on 3."""

from __future__ import annotations

import pytest
from support import precision_workers
from support.tolerances import OPTIM_RTOL

from coconet.runtime import CommOptions, spawn

TRANSPORTS = ["shared memory", "torch.distributed"]


@pytest.fixture(scope="module")
def saved():
    return {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3])
def test_16bit_steps_follow_torch_over_a_float32_master(saved, world, transport):
    options = CommOptions(timeout=60, transport=transport)
    results = spawn(precision_workers.cases, world, options=options, timeout=280)
    for rank, out in enumerate(results):
        for label, case in out["cases"].items():
            assert case["rel"] <= OPTIM_RTOL, (rank, label, case)
            assert case["rounded"], (rank, label)
            assert case["norm"] <= OPTIM_RTOL, (rank, label, case)
    if world == 2:
        saved[transport] = results[0]["saved"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_state_dict_of_two_ranks_resumes_on_three(saved, transport):
    if transport not in saved:
        pytest.skip("needs the 2-rank case's state dict (run the file whole)")
    options = CommOptions(timeout=60, transport=transport)
    results = spawn(precision_workers.resume, 3, saved[transport], options=options, timeout=180)
    for rank, out in enumerate(results):
        assert out["rel"] <= OPTIM_RTOL, (rank, out)
        assert out["rounded"], rank
