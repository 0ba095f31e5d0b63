"""``coconet.fsdp.fully_shard`` with ``coconet.optim`` on 1-4 ranks, both transports, against
DDP's arithmetic with ``torch.optim`` on one process (tests/support/fsdp_workers.py): the
losses, the parameters and torch's state dict after several steps; clipping by the global
norm; checkpoints moved across world sizes and to and from ``torch.optim.AdamW``; 16-bit
parameters against the same optimizer unsharded; a rank killed in a gather or in a fused
update; what is refused."""

from __future__ import annotations

import pytest
from support import fsdp_workers
from support.tolerances import OPTIM_RTOL

from coconet.runtime import CommOptions, RankFailure, spawn

# the model's sizes are uneven over 3 and 4 ranks; blocks of 3 layers, a tied root
CASES = [
    # (world, transport, optimizer, param groups, reshard after forward, max_grad_norm)
    (1, "shared memory", "AdamW", True, True, None),
    (2, "shared memory", "AdamW", True, True, None),
    (2, "torch.distributed", "AdamW", True, True, 0.5),
    (2, "shared memory", "AdamW", True, False, 0.5),
    (3, "shared memory", "SGD", True, True, 0.5),
    (3, "torch.distributed", "Adam", False, True, None),
    (4, "shared memory", "SGD", True, True, None),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {"dcp": str(tmp_path_factory.mktemp("dcp"))}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "transport", "optimizer", "groups", "reshard", "clip"), CASES)
def test_follows_ddp_and_torch_optim(saved, world, transport, optimizer, groups, reshard, clip):
    options = CommOptions(timeout=60, transport=transport)
    two = (world, optimizer, clip) == (2, "AdamW", None)
    results = spawn(fsdp_workers.follows_torch, world, optimizer, 6, groups, reshard, None,
                    clip, saved["dcp"] if two else None, options=options,
                    timeout=180)  # fmt: skip
    for rank, out in enumerate(results):
        # (float32 sums in another order: the reference sums the ranks' gradients itself)
        assert out["loss"] <= 1e-5, (rank, out["loss"])
        assert out["params"] <= 1e-5, (rank, out["params"])
        assert out["state"] <= 1e-5, (rank, out["state"])
        assert out["same_keys"], rank
        assert out["freed"] and out["no_grads"], rank
        assert out["memory"]["slices"] <= out["memory"]["whole"] / world + 64 * world, out
        if clip is not None:
            assert out["clipped"], "the case must clip (max_grad_norm below the norm)"
    if two:
        saved["two"] = results[0]["saved"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "transport"), [(3, "shared memory"),
                                                  (1, "torch.distributed")])
def test_a_checkpoint_of_two_ranks_resumes_at_another_world_size(saved, world, transport):
    """The optimizer's state dict (torch's format) and the whole model saved on 2 ranks, loaded
    at another world size: the next steps follow torch.optim.AdamW loaded from the same."""
    if "two" not in saved:
        pytest.skip("needs the 2-rank case's checkpoint (run the file whole)")
    options = CommOptions(timeout=60, transport=transport)
    results = spawn(fsdp_workers.resume, world, saved["two"], 6, options=options, timeout=180)
    for rank, out in enumerate(results):
        assert out["params"] <= 1e-5, (rank, out)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [3, 1])
def test_a_distributed_checkpoint_of_the_slices_loads_at_another_world_size(saved, world):
    """torch.distributed.checkpoint of each rank's slices (model and optimizer) saved on 2
    ranks, loaded into a model initialised otherwise at another world size: the next steps
    follow torch.optim.AdamW from the gathered state saved alongside; the param groups'
    settings come back too."""
    if "two" not in saved:
        pytest.skip("needs the 2-rank case's checkpoint (run the file whole)")
    results = spawn(fsdp_workers.dcp_resume, world, saved["dcp"], saved["two"], 6,
                    options=CommOptions(timeout=60), timeout=180)  # fmt: skip
    for rank, out in enumerate(results):
        assert out["params"] <= 1e-5, (rank, out)
        assert out["lr"] == 1e-2, out


@pytest.mark.timeout(200)
def test_a_torch_adamw_checkpoint_loads_and_clips_alike():
    """torch.optim.AdamW's state dict of one process, loaded into 2 fully sharded ranks with
    max_grad_norm=: the next steps follow torch's clip_grad_norm_ + AdamW."""
    state = fsdp_workers.torch_state(4)
    results = spawn(fsdp_workers.resume, 2, state, 4, 3, 0.5,
                    options=CommOptions(timeout=60), timeout=180)  # fmt: skip
    for rank, out in enumerate(results):
        assert out["params"] <= 1e-5, (rank, out)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_steps_like_the_optimizer_unsharded(dtype):
    """The same model and batches fully sharded and not: the same programs, one with the
    parameters sliced (fuse_RS_C) and one gathering them (fuse_RS_C_AG)."""
    results = spawn(fsdp_workers.like_unsharded, 2, dtype, options=CommOptions(timeout=60),
                    timeout=180)  # fmt: skip
    for rank, out in enumerate(results):
        assert out["params"] <= OPTIM_RTOL, (rank, out)
        assert out["state"] <= OPTIM_RTOL, (rank, out)
        if dtype == "bfloat16":
            assert "master_param" in out["keys"], out["keys"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shared memory", "torch.distributed"])
@pytest.mark.parametrize("where", ["gather", "update"])
def test_a_rank_killed_mid_step_fails_the_others(where, transport):
    options = CommOptions(timeout=30, transport=transport)
    results = spawn(fsdp_workers.dies, 2, 1, where, options=options, timeout=80,
                    failures="return")  # fmt: skip
    survivor, victim = results
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "fault", survivor
    assert "died" in survivor["message"] or "closed" in survivor["message"], survivor
    assert survivor["seconds"] < 25, survivor
    # the slices of layers 0, 1, 2 and the root's: a death in the forward's gathers leaves
    # them all as they were; one in the second update of the backward (layer 1's) leaves layer
    # 2 a step ahead (its update was committed on every rank) and the others as they were
    expected = [False] * 4 if where == "gather" else [False, False, True, False]
    assert survivor["changed"] == expected, survivor


@pytest.mark.timeout(120)
def test_what_is_refused():
    out = spawn(fsdp_workers.refusals, 2, options=CommOptions(timeout=60), timeout=100)[0]
    assert "mixes fully sharded parameters with others" in out["mixed"]
    assert "LAMB" in out["lamb"] and "fully sharded" in out["lamb"]
    assert "fully sharded already" in out["twice"]
    assert "no coconet.optim optimizer steps it" in out["no optimizer"]
    assert "the ranks shard different models" in out["different models"]
    assert out["gathered"] == {"whole": True, "same": True, "freed": True}


@pytest.mark.timeout(240)
def test_compiled_blocks_follow_eager():
    """Each layer of the fully sharded model ``compile()``d: its gathers and frees are graph
    breaks, and the losses are the eager model's (float32: the compiled kernels' own
    roundings)."""
    out = spawn(fsdp_workers.compiled_blocks, 2, options=CommOptions(timeout=120),
                timeout=220)[0]  # fmt: skip
    for a, b in zip(out["eager"], out["compiled"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), out


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "clip"), [(2, None), (3, 0.5)])
def test_gradients_accumulated_over_micro_batches(world, clip):
    """``update_in_backward=False``: three backwards a step (each reduce_scattered into the
    slice's sum), one update at ``opt.step()``: DDP's accumulation, to 1e-5."""
    results = spawn(fsdp_workers.accumulated, world, 3, 3, clip,
                    options=CommOptions(timeout=60), timeout=180)  # fmt: skip
    for rank, out in enumerate(results):
        assert out["params"] <= 1e-5, (rank, out)
