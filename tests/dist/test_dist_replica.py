"""Host replicas (``coconet.runtime.replica``): one double-buffered copy per host of a Replicated
tensor, written slice by slice by a one-pass gather and committed by a flip.

- Adam's, AdamW's, SGD's and LAMB's fuse_RS_C_AG with ``p`` a host replica compute bit for bit
  what the same step computes on per-rank tensors, over many steps with random per-rank delays,
  on 2 and 3 ranks (an uneven split), and their first step is bitwise the simulator's; the
  tensor passed as ``p`` flips between the two buffers at every commit;
- a rank killed after writing its slice of the spare buffer, before or after it posted it, fails
  the step on every survivor within the timeout, with their parameters and state as before;
- a step that computes ``p`` on every rank (AR_C), and a communicator over torch.distributed,
  refuse a host replica with a ConfigError;
- ``coconet.optim.Adam(param_storage="host-shared")`` follows one process's torch.optim.Adam,
  including the mixed path (a layer without gradients for its first steps).
"""

from __future__ import annotations

import pytest
from support import replica_workers
from support.tolerances import OPTIM_RTOL

from coconet.runtime import CommOptions, RankFailure, spawn

OPTIONS = CommOptions(timeout=30)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("example", ["adam", "adamw", "sgd", "lamb"])
def test_a_replica_step_equals_the_per_rank_step(example, nproc):
    results = spawn(
        replica_workers.equals_per_rank, nproc, example, 1001, 12, options=OPTIONS, timeout=200
    )
    for rank, out in enumerate(results):
        assert out == {"equal": True, "simulator": True, "flips": True, "holds": True}, rank


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("where", ["kernel", "gather"])
def test_a_rank_killed_before_the_flip_leaves_every_survivor_as_it_was(where, nproc):
    victim = nproc - 1
    results = spawn(
        replica_workers.killed_before_flip, nproc, victim, where, options=OPTIONS, timeout=80,
        failures="return",
    )
    assert isinstance(results[victim], RankFailure) and results[victim].exit_code == -9
    for rank, out in enumerate(results[:victim]):
        assert out["status"] == "fault", (rank, out)
        # the first survivor to see the death aborts; a later one may hear that first
        assert "a peer rank died" in out["message"] or "aborted" in out["message"], out
        assert "a peer rank died" in " ".join(o["message"] for o in results[:victim])
        assert out["seconds"] < 15
        assert out["unchanged"] and out["live_unchanged"] and out["holds"], (rank, out)


@pytest.mark.timeout(90)
def test_what_cannot_be_a_host_replica_is_refused():
    for out in spawn(replica_workers.refusals, 2, options=OPTIONS, timeout=80):
        assert "cannot be a host replica" in out["AR_C"]
        assert "fuse_RS_C_AG" in out["AR_C"]
        assert "needs the group along None on shared memory" in out["gloo"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen_steps", [0, 2])
def test_host_shared_parameters_follow_torch_adam(frozen_steps):
    results = spawn(
        replica_workers.optimizer_matches_torch, 2, frozen_steps, options=OPTIONS, timeout=100
    )
    for out in results:
        assert out["same_start"]
        assert out["max_rel_err"] <= OPTIM_RTOL, out["max_rel_err"]
        assert out["attached"]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert a == b
