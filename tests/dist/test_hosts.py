"""Two hosts on one machine (``support.hosts``: network, UTS, PID and mount namespaces with a
private /dev/shm each, a bridge between them, torchrun agents with --nnodes 2): coconet sees two
hosts, runs the groups inside a host on shared memory, those across with 2 ranks on each host in
two levels (``coconet.runtime.hierarchy``), those over hosts holding 2 and 1 of their ranks
through one leader per host, and the others on torch.distributed; every example x schedule
equals the simulator there, ``coconet.optim`` equals torch, and a host that dies mid-step (or
mid-collective) gives the other host's ranks a fault within the timeout, tensors untouched.

2 hosts x 2 ranks oversubscribe this 2-core machine (4 ranks): correctness only. Skipped where
namespaces cannot be made (not root, no iproute2), with the reason."""

from __future__ import annotations

import pytest
from support import dist_workers
from support.hosts import Hosts
from support.tolerances import OPTIM_RTOL, REASSOCIATED_RTOL, schedule_rtol

WHY = Hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
MESH = {"pp": 2, "tp": 2}  # rank = 2 pp + tp: tp inside a host, pp across


@pytest.fixture(scope="module")
def hosts():
    with Hosts(2) as h:
        yield h


@pytest.mark.timeout(120)
def test_two_namespace_hosts_are_two_hosts_and_share_memory_inside(hosts):
    out = hosts.run("support.host_workers:where", MESH, nproc=2, timeout=100)
    ids = [o["host"] for o in out]
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2], ids
    for o in out:
        assert o["world"] == "hierarchical", o  # the world spans the hosts, 2 ranks on each
        # pp: one rank per host, two levels of which the inside one is nothing
        assert o["mesh"] == {"pp": "hierarchical", "tp": "shared memory"}, o
        # a choice measured inside one host is not reused across hosts
        assert o["key_hosts"] == {"None": 2, "pp": 2, "tp": 1}, o


def _rtol(name: str, schedule: str) -> float:
    if schedule == "(none)":
        return 0.0
    mod = dist_workers.load_example(name)
    program = mod.program()
    return schedule_rtol(program, mod.SCHEDULES[schedule](program).program, "float32")


@pytest.mark.timeout(400)
def test_every_example_and_schedule_on_two_hosts_equals_the_simulator(hosts):
    """2 x 2 ranks: the optimizers and the layer on the world (across hosts: rank-ordered
    sums, flat), the pipeline examples on the pp x tp mesh (tp over each host's shared memory,
    pp over gloo), the mesh programs; as test_dist_examples' 4-rank tier, with gloo's native
    algorithms and with two levels too."""
    out = hosts.run("support.dist_workers:run_world_and_mesh", (12, 7), MESH, True, nproc=2,
                    timeout=380)[0]
    for key in ("world", "native", "two_levels", "mesh"):
        assert out[key], key
        for r in out[key]:
            # gloo's own order (NATIVE_GLOO_RTOL); two levels: over hosts of each host's sum
            exact = 1e-6 if key in ("native", "two_levels") else 0.0
            assert r["status"] == "ok", (key, r)
            assert r["rel"] <= max(exact, _rtol(r["example"], r["schedule"])), (key, r)
    cases = {(r["example"], r["schedule"]) for r in out["world"]}
    expected = {(n, s) for n in dist_workers.OPTIMIZERS + dist_workers.LAYERS
                for s in ("(none)", *dist_workers.load_example(n).SCHEDULES)}
    assert cases == expected
    assert {r["world"] for r in out["mesh"]} == {"Mesh(pp=2, tp=2)"}
    for r in out["mesh_program"]:
        assert r["status"] == "ok" and r["abs"] == 0.0, r


@pytest.mark.timeout(300)
def test_coconet_optim_on_two_hosts_equals_torch(hosts):
    """One rank per host (the state sliced across hosts, every collective over gloo): the
    drop-in tier's cases against torch.optim / pytorch_optimizer.Lamb on the averaged
    gradient; 2 x 2 ranks: LAMB's buckets of rows."""
    for rank, out in enumerate(hosts.run("support.dropin_workers:dropin", nproc=1, timeout=280)):
        for label, rel in {**out["cases"], **out["missing"]}.items():
            rtol = REASSOCIATED_RTOL["float32"] if label.startswith("LAMB") else OPTIM_RTOL
            assert rel <= rtol, (rank, label, rel)
        assert out["compiled"] <= OPTIM_RTOL and out["from_torch"] <= OPTIM_RTOL
        assert out["steps"] == out["torch_steps"]
    for out in hosts.run("support.dropin_workers:lamb_rows", nproc=2, timeout=280):
        for label, rel in out["cases"].items():
            assert rel <= REASSOCIATED_RTOL["float32"], (label, rel)
        assert max(out["compiled"], out["from_lamb"], out["to_lamb"]) <= 1e-5


@pytest.mark.timeout(150)
@pytest.mark.parametrize("per_host", [2, 1])
def test_a_group_over_two_hosts_runs_in_two_levels_with_the_stated_order_and_blocks(
    hosts, per_host
):
    """2 x 2 ranks: the world runs in two levels (shared memory inside each host, point to
    point between; 2 x 1: the exchange alone); all_reduce, reduce_scatter and all_gather over
    uneven sizes, both dims, float32 and bfloat16, sum and max equal bitwise the sum over hosts
    of each host's sum (``hierarchy.reduce_order``), reduce_scatter's blocks are the flat
    split's, and within rounding of the simulator's rank order; broadcast, reduce and send run
    flat; "exact" is rank order (flat), whether asked for at construction or after."""
    out = hosts.run("support.host_workers:hierarchical_collectives", nproc=per_host,
                    timeout=130)
    n = len(out)
    layout = [[0, 0, 1, 1], [0, 1, 0, 1]] if per_host == 2 else [[0, 1], [0, 0]]
    for rank, o in enumerate(out):
        assert o["transport"] == "hierarchical", o["transport"]
        assert o["layout"] == layout, o["layout"]
        assert len(o["cases"]) == 20
        for c in o["cases"]:
            assert c["all_reduce"] and c["reduce_scatter"] and c["all_gather"], c
            bound = 1e-6 if "float32" in c["case"] else 1e-2  # a bfloat16 rounding: 2^-7
            if per_host == 1:
                bound = 0.0  # one rank per host: host order is rank order
            assert c["vs_rank_order"] <= bound, c
        x = [float(i) for i in range(6)]
        assert o["broadcast"] == [v + n - 1 for v in x]
        assert o["reduce"] == ([n * v + n * (n - 1) / 2 for v in x] if rank == 1 else [0.0] * 6)
        assert o["send"] == ([v + rank - 1 for v in x] if rank else [0.0] * 6)
        assert o["exact"] and o["exact_transport"] == "torch.distributed"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("per_host", "victim", "where"), [((2, 1), 2, "all_reduce"), ((1, 2), 0, "reduce_scatter")]
)
def test_hosts_with_different_rank_counts_go_through_leaders(hosts, per_host, victim, where):
    """2 + 1 and 1 + 2 ranks: the world goes through one leader per host; all_reduce,
    reduce_scatter and all_gather (uneven sizes, both dims, float32 and bfloat16, sum and max)
    equal bitwise the sum over hosts of each host's sum (``hierarchy.reduce_order``: on 1 + 2
    not rank order, x0 + (x1 + x2)) and within rounding of rank order, with the flat split's
    blocks; transport="hierarchical" takes it ("exact" is refused); coconet.optim.Adam equals
    torch's; then a host dies inside a collective (2 + 1: the single-rank host, in the leaders'
    gloo all_reduce; 1 + 2: mid-transfer in the leaders' exchange of a reduce_scatter) and the
    other host's leader and member both get a RuntimeFault within the timeout (60 s)."""
    out = hosts.run("support.host_workers:through_leaders", victim, where, nproc=per_host,
                    timeout=130, dead={victim})  # fmt: skip
    layout = [[0, 0, 1], [0, 1, 0]] if per_host == (2, 1) else [[0, 1, 1], [0, 0, 1]]
    survivors = [r for r in range(3) if r != victim]
    member = 1 if per_host == (2, 1) else 2  # the surviving host's member that does not lead
    assert out[victim] is None
    for rank in survivors:
        o = out[rank]
        assert o["transport"] == "hierarchical" and o["plan"] == "through one leader per host"
        assert o["layout"] == layout, o["layout"]
        assert len(o["cases"]) == 20
        for c in o["cases"]:
            assert c["all_reduce"] and c["reduce_scatter"] and c["all_gather"], c
            bound = 1e-6 if "float32" in c["case"] else 1e-2  # a bfloat16 rounding: 2^-7
            assert c["vs_rank_order"] <= bound, c
        x = [float(i) for i in range(6)]
        assert o["broadcast"] == [v + 2 for v in x]
        assert o["reduce"] == ([3 * v + 3 for v in x] if rank == 1 else [0.0] * 6)
        assert o["send"] == ([v + rank - 1 for v in x] if rank else [0.0] * 6)
        assert o["exact"] and o["exact_transport"] == "torch.distributed"
        assert o["forced"] == "hierarchical"
        assert "cannot run over its hosts hierarchically" in o["forced_exact"], o["forced_exact"]
        assert o["adam_transport"] == "hierarchical" and o["adam"] <= OPTIM_RTOL, o["adam"]
        fault = o["fault"]
        assert fault["status"] == "fault", fault
        assert "peer" in fault["message"], fault["message"]
        assert fault["seconds"] < 30, fault
        if rank == member:  # it waited for its leader over shared memory: it says so
            assert "leader" in fault["message"], fault["message"]
    if per_host == (1, 2):  # host order is not rank order here: somewhere the bits differ
        assert any(c["vs_rank_order"] > 0 for c in out[1]["cases"] if "float32" in c["case"])


@pytest.mark.timeout(200)
def test_tune_on_two_hosts_weighs_flat_against_two_levels(hosts):
    """coconet.tune over 2 x 2 ranks: every schedule is a candidate flat (torch.distributed)
    and in two levels, the cost model calibrated for both; the baseline (unscheduled, on the
    transport the ranks use: two levels) is measured; every rank picks the same winner."""
    out = hosts.run("support.tune_workers:tune_adam", 1 << 16, 4, nproc=2, timeout=180)
    first = out[0]
    assert first["own_transport"] == "hierarchical"
    by_transport = {}
    for r in first["rows"]:
        by_transport.setdefault(r["transport"], []).append(r)
    assert set(by_transport) == {"hierarchical", "torch.distributed"}
    # every schedule on both (on torch.distributed, once per algorithm choice too)
    names = {t: {r["label"].split(" [")[0] for r in rows} for t, rows in by_transport.items()}
    assert names["hierarchical"] == names["torch.distributed"], names
    baseline = next(r for r in by_transport["hierarchical"] if r["unscheduled"])
    assert baseline["measured"] and baseline["measured_ms"] > 0
    assert all(o["winner"] == first["winner"] for o in out)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["all_gather", "commit"])
def test_a_host_that_dies_mid_step_gives_the_other_host_a_fault(hosts, where):
    """Rank 3 kills its whole host (ranks 2 and 3) inside the fused Adam step: ranks 0 and 1
    get a fault well within the timeout (60 s), their tensors as they were."""
    out = hosts.run("support.host_workers:host_dies", 3, where, nproc=2, timeout=150,
                    env={"COCONET_HOSTS_TIMEOUT": "60"}, dead={2, 3})
    for survivor in out[:2]:
        assert survivor["status"] == "fault", survivor
        assert "peer" in survivor["message"], survivor["message"]
        assert survivor["seconds"] < 30, survivor
        assert survivor["unchanged"], "a survivor committed part of a failed step"
    assert out[2:] == [None, None]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo", [
    {"name": "overlap", "inner": "sgd", "period": 3, "pull": 0.5, "momentum": 0.5},
    {"name": "local", "inner": "adamw", "period": 4, "host_period": 2},
])  # fmt: skip
def test_local_sgd_across_hosts_follows_plain_torch(hosts, algo):
    """Overlap Local-SGD's average in two levels (shared memory inside a host, in flight over
    torch.distributed across), and Local SGD with a host level every 2 steps, against
    ``local_sgd_workers.reference`` (the hosts' sums are over each host's sum: to rounding);
    each run checkpointed and resumed with the same bits."""
    import torch
    from support import local_sgd_workers

    out = hosts.run("support.host_workers:local_sgd", algo, 8, nproc=2, timeout=180)
    ref = local_sgd_workers.reference(4, algo, 8, hosts=2)
    for rank, got in enumerate(out):
        for mine, want in zip(got["params"], ref["params"][rank], strict=True):
            for a, b in zip(mine, want, strict=True):
                torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-5, atol=1e-6)
        for a, b in zip(got["resumed"], got["params"][-1], strict=True):
            assert (a == b).all(), rank
    if algo["name"] == "overlap":
        assert "two levels" in out[0]["explain"], out[0]["explain"]


@pytest.mark.timeout(200)
def test_a_host_dead_with_a_local_sgd_average_in_flight_fails_the_other(hosts):
    """Both ranks of the other host fail well within the timeout (60 s), their models as the
    local step left them. One of them may see its leg across hosts complete (it finished
    before the death) where its host peer's failed: that peer aborts the host's communicator,
    so the first does not wait for it in the host's gather until the timeout."""
    out = hosts.run("support.host_workers:local_sgd_host_dies", 3, nproc=2, timeout=150,
                    env={"COCONET_HOSTS_TIMEOUT": "60"}, dead={2, 3})  # fmt: skip
    for survivor in out[:2]:
        assert survivor["status"] == "fault", survivor
        assert survivor["seconds"] < 30, survivor
        assert survivor["intact"], survivor
        assert survivor["steps"] in (4, 6), survivor
    assert out[2:] == [None, None]
