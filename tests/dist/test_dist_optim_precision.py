"""16-bit parameters and ``reduce_dtype=`` in coconet.optim on 2, 3 and 4 ranks (uneven slices:
63 values), over shared memory and over torch.distributed (gloo), against torch's optimizer
over a float32 master copy (tests/support/precision_workers.py says how the reference averages
the gradient); a state dict saved on 2 ranks resumed on 3."""

from __future__ import annotations

import pytest
from support import precision_workers
from support.tolerances import OPTIM_RTOL, REASSOCIATED_RTOL

from coconet.runtime import CommOptions, spawn

TRANSPORTS = ["shared memory", "torch.distributed"]


@pytest.fixture(scope="module")
def saved():
    return {}


# 2 ranks on both transports, 3 over shared memory, 4 over gloo (both transports at 3 and 4
# ranks cost CI ~30 s a pass and add no path: the slices' arithmetic is each transport's at 2)
WORLDS = [(2, "shared memory"), (2, "torch.distributed"), (3, "shared memory"),
          (4, "torch.distributed")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "transport"), WORLDS)
def test_16bit_steps_follow_torch_over_a_float32_master(saved, world, transport):
    options = CommOptions(timeout=60, transport=transport)
    results = spawn(precision_workers.cases, world, options=options, timeout=280)
    for rank, out in enumerate(results):
        for label, case in out["cases"].items():
            # LAMB's norms over slices are partial sums (re-associated, as in float32)
            rtol = REASSOCIATED_RTOL["float32"] if label.startswith("LAMB") else OPTIM_RTOL
            assert case["rel"] <= rtol, (rank, label, case)
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


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_grad_scaler_skips_alike_on_every_rank(transport):
    """An inf in one rank's gradient only: every rank skips that step and backs its scaler off
    alike (float16 parameters, one bucket and two; float32 parameters with clipping)."""
    options = CommOptions(timeout=60, transport=transport)
    for dtype, groups, clip in [("float16", 1, None), ("float16", 2, None),
                                ("float32", 2, 0.5)]:
        import torch

        results = spawn(precision_workers.scaled, 2, getattr(torch, dtype), groups, clip,
                        options=options, timeout=180)
        for rank, out in enumerate(results):
            assert out["rel"] <= OPTIM_RTOL, (dtype, groups, rank, out)
            assert out["skipped"] == [False, False, True, False, False, False], out
            assert out["steps"] == 5.0
        scales = results[0]["scales"]
        assert results[1]["scales"] == scales
        assert scales[2] == scales[1] / 2 and scales[1] == 2 * scales[0], scales  # grew, backed off


@pytest.mark.timeout(200)
def test_stochastic_rounding_is_the_same_bits_at_every_world_size():
    """``rounding="stochastic"``: 1, 2 and 3 ranks (slices of 1001, 501/500, 334/334/333) over
    both transports: the same parameters bit for bit (coconet's counter-based bits are keyed by the
    element's place in the bucket, not by the rank that rounds it)."""
    seen = set()
    for world, transport in [(1, "shared memory"), (2, "torch.distributed"),
                             (3, "shared memory"), (3, "torch.distributed")]:
        options = CommOptions(timeout=60, transport=transport)
        out = spawn(precision_workers.stochastic, world, options=options, timeout=120)
        seen.update(out)
    assert len(seen) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("world", "fused"), [(2, True), (3, False)], ids=["2-compiled", "3"])
def test_16bit_programs_are_bitwise_the_simulators(world, fused, transport):
    options = CommOptions(timeout=60, transport=transport)
    results = spawn(precision_workers.exactness, world, fused, options=options, timeout=280)
    for rank, out in enumerate(results):
        assert all(out.values()), (rank, out)


@pytest.mark.timeout(200)
def test_a_bfloat16_tensor_parallel_model_follows_one_process():
    """bfloat16 parameters split over tp (ShardedParameters) and whole, stepped over dp with
    clipping: the losses follow one process's within bfloat16's rounding (the row-parallel
    layer's partial sums are reduced over tp, rounded once more than one process's matmul)."""
    from coconet.ir.mesh import Mesh

    results = spawn(precision_workers.tensor_parallel, Mesh(dp=1, tp=2),
                    options=CommOptions(timeout=60), timeout=180)  # fmt: skip
    for ours, theirs in results[0]:
        assert abs(ours - theirs) <= 2 * 2**-8 * abs(theirs), results[0]  # two bfloat16 ulps
