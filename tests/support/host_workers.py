"""Rank bodies for tests/dist/test_hosts.py (run by ``support.hosts.Hosts``: each host its own
namespaces and /dev/shm, torchrun agents with --nnodes)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import coconet as cc
from coconet.ir.ops import Op
from coconet.options import CommOptions
from coconet.runtime import Communicator
from coconet.runtime.symmem import host_identity
from support import dist_workers


def where(comm: Communicator, mesh_axes: dict[str, int]) -> dict:
    """This rank's host as coconet's evidence sees it, and the transport of the world and of
    each axis of a ``mesh_axes`` mesh over the same processes (and the host count its
    algorithm choices are keyed by)."""
    mesh = Communicator(cc.Mesh(**mesh_axes), CommOptions(timeout=60))
    out = {
        "rank": comm.rank,
        "host": host_identity(),
        "world": comm.transport_of(None).value,
        "mesh": {axis: mesh.transport_of(axis).value for axis in mesh_axes},
        # the hosts its measured algorithm choices are keyed by (coconet.runtime.tuning)
        "key_hosts": {str(axis): mesh.tuning_key(Op.ALL_REDUCE, ">16MiB", axis).hosts
                      for axis in (None, *mesh_axes)},
    }
    mesh.close()
    return out


def _kill_my_host(kill) -> None:
    """Every process of this rank's host but its PID 1 (the torchrun agent, which cannot be
    killed from inside its PID namespace), this one last: the host's ranks die at once."""
    me = os.getpid()
    for entry in os.listdir("/proc"):  # the host's own procfs: its PID namespace only
        if entry.isdigit() and int(entry) not in (1, me):
            try:
                kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
    kill(me, signal.SIGKILL)


def _victim_kills_its_host(comm: Communicator, victim: int) -> None:
    """On rank ``victim``, its own SIGKILL (``os.kill(os.getpid(), SIGKILL)``) becomes its
    whole host's."""
    if comm.rank == victim:
        real = os.kill

        def kill(pid, sig):
            if pid == os.getpid() and sig == signal.SIGKILL:
                _kill_my_host(real)
            real(pid, sig)

        os.kill = kill


def host_dies(comm: Communicator, victim: int, where: str) -> dict:
    """Rank ``victim`` kills its whole host at ``where`` ("all_gather": mid-step; "commit":
    before the commit vote), in the fused Adam step (``dist_workers.fault_peer_dies``): the
    ranks of the other host must get a fault within the timeout, their tensors as they were."""
    _victim_kills_its_host(comm, victim)
    return dist_workers.fault_peer_dies(comm, victim, where)


def hierarchical_collectives(comm: Communicator) -> dict:
    """On 2 hosts x 1 or 2 ranks, or 2 + 1 / 1 + 2 (through leaders): the world runs
    hierarchically; each collective, over uneven sizes,
    both dims, 16- and 32-bit floats, sum and max, equals bitwise what ``reduce_order`` (the
    sum over hosts of each host's sum) computes from every rank's input, and the simulator's
    rank-ordered result within rounding; reduce_scatter's blocks are the flat split's; the
    rooted and point-to-point ops run flat; a communicator switched to "exact" runs flat."""
    import torch

    from coconet.ir.ops import ReduceOp
    from coconet.ir.semantics import reduce_values
    from coconet.runtime.hierarchy import HostLayout, reduce_order

    world = Communicator(cc.Mesh.world(comm.world), CommOptions(timeout=60))
    out: dict = {"transport": world.transport_of(None).value, "cases": []}
    handle = world.routes[None].group.handle
    out["plan"] = handle.plan.value if hasattr(handle, "plan") else None
    layout = HostLayout.of([h for h, _ in world.exchange((host_identity(), 0), "hosts")])
    out["layout"] = [list(layout.host_of), list(layout.local_of)]
    n, me = world.world, world.rank

    def inputs(case: int, shape, dtype) -> list:
        g = torch.Generator().manual_seed(1000 + case)
        return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]

    def wait(work):
        return world.wait(work)

    case = 0
    for shape, dim in (((13, 5), 0), ((3, 4), 0), ((6, 7), 1), ((1 << 16,), 0), ((2,), 0)):
        for dtype in (torch.float32, torch.bfloat16):
            for op in (ReduceOp.SUM, ReduceOp.MAX):
                case += 1
                xs = inputs(case, shape, dtype)
                two_levels = reduce_order(op, xs, layout)
                flat = reduce_values(op, xs)
                ar = wait(world.all_reduce_start(xs[me].clone(), op, axis=None, donate=False,
                                                 label="test all_reduce"))  # fmt: skip
                rs = wait(world.reduce_scatter_start(xs[me].clone(), op, dim=dim, axis=None,
                                                     donate=False, label="test rs"))  # fmt: skip
                block = torch.tensor_split(two_levels, n, dim)[me]
                parts = [p.shape[dim] for p in torch.tensor_split(xs[0], n, dim)]
                mine = torch.tensor_split(xs[me], n, dim)[me].contiguous()
                ag = wait(world.all_gather_start(mine, dim=dim, parts=parts, axis=None,
                                                 label="test all_gather"))  # fmt: skip
                gathered = torch.cat([torch.tensor_split(x, n, dim)[r] for r, x in
                                      enumerate(xs)], dim)  # fmt: skip
                scale = float(flat.float().abs().max()) or 1.0
                out["cases"].append({
                    "case": f"{tuple(shape)} dim {dim} {dtype} {op.value}",
                    "all_reduce": torch.equal(ar, two_levels),
                    "reduce_scatter": torch.equal(rs, block),
                    "all_gather": torch.equal(ag, gathered),
                    "vs_rank_order": float((ar.float() - flat.float()).abs().max()) / scale,
                })
    x = torch.arange(6.0) + me
    out["broadcast"] = wait(world.broadcast_start(x, root=n - 1, axis=None, donate=False,
                                                  label="test")).tolist()  # fmt: skip
    out["reduce"] = wait(world.reduce_start(x, ReduceOp.SUM, root=1, axis=None, donate=False,
                                            label="test")).tolist()  # fmt: skip
    out["send"] = wait(world.send_start(x, axis=None, label="test")).tolist()
    # switched to exact after routing: rank order, bitwise the simulator's
    world.options = dataclasses.replace(world.options, algorithms="exact")
    xs = inputs(99, (9, 3), torch.float32)
    ar = wait(world.all_reduce_start(xs[me].clone(), ReduceOp.SUM, axis=None, donate=False,
                                     label="test exact"))  # fmt: skip
    out["exact"] = torch.equal(ar, reduce_values(ReduceOp.SUM, xs))
    world.close()
    exact = Communicator(cc.Mesh.world(comm.world), CommOptions(timeout=60, algorithms="exact"))
    out["exact_transport"] = exact.transport_of(None).value
    exact.close()
    return out


def pretend_hosts(comm: Communicator, layout: str) -> dict:
    """``hierarchical_collectives`` with rank ``r`` pretending to run on host ``layout[r]``
    (``COCONET_HOST_ID``: one machine, so shared memory still works between pretend hosts,
    but routing takes the hosts as given): 3 hosts of 1, 1 and 2 ranks go through leaders
    with the exchange, not gloo's all_reduce (3 leaders)."""
    os.environ["COCONET_HOST_ID"] = f"pretend-{layout[comm.rank]}"
    return hierarchical_collectives(comm)


def _fault_in(fn) -> dict:
    """``fn()``, expected to raise a RuntimeFault: its message and how long it took to come."""
    from coconet.errors import RuntimeFault

    t0 = time.perf_counter()
    try:
        fn()
        return {"status": "no error"}
    except RuntimeFault as e:
        return {"status": "fault", "message": str(e), "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - the test names what came instead
        return {"status": f"{type(e).__name__}: {e}"}


def through_leaders(comm: Communicator, victim: int, where: str) -> dict:
    """On 2 hosts holding different numbers of ranks (2 + 1 or 1 + 2): the world goes through
    one leader per host: ``hierarchical_collectives``' cases; ``transport="hierarchical"``
    accepted (and refused with "exact"); ``coconet.optim.Adam`` against torch.optim.Adam; then
    rank ``victim`` kills its whole host inside a collective (``where``: "all_reduce", in the
    leaders' gloo all_reduce; "reduce_scatter", mid-transfer in the leaders' exchange, after
    a few chunks), and the other host's ranks (its leader across hosts, its other member over
    shared memory) must get a RuntimeFault within the timeout."""
    import torch

    from coconet.errors import ConfigError
    from coconet.ir.ops import ReduceOp
    from coconet.runtime import hierarchy
    from support import dropin_workers

    out = hierarchical_collectives(comm)
    mesh = cc.Mesh.world(comm.world)
    forced = Communicator(mesh, CommOptions(timeout=60, transport="hierarchical"))
    out["forced"] = forced.transport_of(None).value
    forced.close()
    try:
        Communicator(mesh, CommOptions(timeout=60, transport="hierarchical", algorithms="exact"))
        out["forced_exact"] = "accepted"
    except ConfigError as e:
        out["forced_exact"] = e.message
    ours, theirs, *_ = dropin_workers._run(comm, "Adam", {"lr": 1e-2, "weight_decay": 0.1}, 10)
    out["adam"] = dropin_workers._rel(ours, theirs)
    out["adam_transport"] = comm.transport_of(None).value
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(comm.rank))
    comm.wait(comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="warm"))
    if comm.rank == victim:
        if where == "all_reduce":  # entering the leaders' all_reduce
            import torch.distributed as dist

            dist.all_reduce = lambda *a, **k: _kill_my_host(os.kill)
        else:  # mid-transfer: after 3 chunks of the leaders' exchange
            real, calls = hierarchy._finish, [0]

            def finish(works):
                calls[0] += 1
                if calls[0] > 3:
                    _kill_my_host(os.kill)
                real(works)

            hierarchy._finish = finish
    if where == "all_reduce":
        out["fault"] = _fault_in(lambda: comm.wait(comm.all_reduce_start(
            x, ReduceOp.SUM, axis=None, donate=False, label="dies")))
    else:
        out["fault"] = _fault_in(lambda: comm.wait(comm.reduce_scatter_start(
            x, ReduceOp.SUM, dim=0, axis=None, donate=False, label="dies")))
    return out


def local_sgd(comm: Communicator, algo: dict, steps: int) -> dict:
    """``local_sgd_workers.train`` across the hosts (checkpointed after step 4 and resumed)."""
    from support import local_sgd_workers

    return local_sgd_workers.train(comm, algo, steps, 4)


def local_sgd_host_dies(comm: Communicator, victim: int) -> dict:
    """Rank ``victim`` kills its whole host while an Overlap Local-SGD average is in flight
    (``local_sgd_workers.dies_in_flight``): the other host's ranks fail at their next sync,
    within the timeout, with their local models as the local step left them."""
    from support import local_sgd_workers

    _victim_kills_its_host(comm, victim)
    return local_sgd_workers.dies_in_flight(comm, victim)
