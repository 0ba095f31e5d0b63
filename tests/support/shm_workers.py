"""Rank functions for the shared-memory transport's tests (``test_dist_shm.py``).

Every rank can rebuild every other rank's input from (seed, rank, ...), so each checks its own
results against the op's group meaning (``coconet.ir.semantics.COLLECTIVES``, what the simulator
runs) without moving more data than the collective itself.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time

import torch

import coconet as cc
from coconet.errors import ConfigError
from coconet.ir import semantics
from coconet.ir.node import make_node
from coconet.ir.ops import Op, ReduceOp
from coconet.ir.types import slice_bounds
from coconet.runtime import Communicator
from coconet.testing import check_distributed, rank_inputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _value(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _node(op: Op, dtype: torch.dtype, rows: int, **attrs):
    """A collective node of the right type, whose attributes the group meanings read."""
    N = cc.Dim("N")
    lay = cc.Sliced(0) if op is Op.ALL_GATHER else cc.Local
    x = cc.Tensor("x", cc.DType.from_torch(dtype), [N, 3], lay).node
    return make_node(op, (x,), {"axis": None, **attrs})


def collectives_vs_meaning(comm: Communicator, sizes, dtypes) -> list[dict]:
    """Every collective, in every dtype and size, against its group meaning, bit for bit."""
    n, me = comm.world, comm.rank
    rows = []
    seed = 0
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for size in sizes:
            seed += 1
            shape = (size, 3)
            xs = [_value(seed, r, shape, dtype) for r in range(n)]
            cases = {
                "all_reduce": (_node(Op.ALL_REDUCE, dtype, size, reduce_op=ReduceOp.SUM), None),
                "all_reduce_max": (
                    _node(Op.ALL_REDUCE, dtype, size, reduce_op=ReduceOp.MAX),
                    None,
                ),
                "reduce_scatter": (
                    _node(Op.REDUCE_SCATTER, dtype, size, reduce_op=ReduceOp.SUM, dim=0),
                    None,
                ),
                "broadcast": (_node(Op.BROADCAST, dtype, size, root=n - 1), None),
                "reduce": (_node(Op.REDUCE, dtype, size, reduce_op=ReduceOp.SUM, root=1 % n), None),
            }
            for name, (node, _) in cases.items():
                want = semantics.COLLECTIVES[node.op](node, xs)[me]
                x = xs[me].clone()
                if node.op is Op.ALL_REDUCE:
                    w = comm.all_reduce_start(
                        x, node.attr("reduce_op"), axis=None, donate=False, label=name
                    )
                elif node.op is Op.REDUCE_SCATTER:
                    w = comm.reduce_scatter_start(
                        x, ReduceOp.SUM, dim=0, axis=None, donate=False, label=name
                    )
                elif node.op is Op.BROADCAST:
                    w = comm.broadcast_start(x, root=n - 1, axis=None, donate=False, label=name)
                else:
                    w = comm.reduce_start(
                        x, ReduceOp.SUM, root=1 % n, axis=None, donate=False, label=name
                    )
                got = comm.wait(w)
                rows.append(_row(name, dtype_name, size, got, want, x, xs[me]))
            # a donated all_reduce of a tensor in symmetric memory of its own (a gradient
            # bucket) is reduced in place, without an output area
            sym = comm.symmetric_tensor(shape, dtype)
            for name, op in (("all_reduce_in_place", ReduceOp.SUM), ("in_place_max", ReduceOp.MAX)):
                node = _node(Op.ALL_REDUCE, dtype, size, reduce_op=op)
                want = semantics.COLLECTIVES[Op.ALL_REDUCE](node, xs)[me]
                sym.copy_(xs[me])
                got = comm.wait(comm.all_reduce_start(sym, op, axis=None, donate=True, label=name))
                row = _row(name, dtype_name, size, got, want, None, None)
                row["in_place"] = got.data_ptr() == sym.data_ptr()
                rows.append(row)
            # all_gather of uneven parts
            parts = [hi - lo for lo, hi in (slice_bounds(size, n, r) for r in range(n))]
            pieces = [_value(seed + 500, r, (parts[r], 3), dtype) for r in range(n)]
            node = _node(Op.ALL_GATHER, dtype, size)
            want = semantics.COLLECTIVES[Op.ALL_GATHER](node, pieces)[me]
            w = comm.all_gather_start(
                pieces[me].clone(), dim=0, parts=parts, axis=None, label="all_gather"
            )
            rows.append(_row("all_gather", dtype_name, size, comm.wait(w), want, None, None))
            # send: rank i gets rank i-1's value, the first rank zeros
            w = comm.send_start(xs[me].clone(), axis=None, label="send")
            want = xs[me - 1] if me > 0 else torch.zeros_like(xs[me])
            rows.append(_row("send", dtype_name, size, comm.wait(w), want, None, None))
    return rows


def _row(name, dtype, size, got, want, x_after, x_before) -> dict:
    return {
        "op": name,
        "dtype": dtype,
        "size": size,
        "equal": bool(got.dtype == want.dtype and torch.equal(got, want)),
        "input_untouched": x_after is None or bool(torch.equal(x_after, x_before)),
    }


def stress(comm: Communicator, steps: int, seed: int) -> dict:
    """``steps`` collectives of changing sizes with random per-rank delays between them; every
    result is checked exactly (integer-valued data: sums are exact in any order)."""
    rng = random.Random(seed * 31 + comm.rank)
    n, me = comm.world, comm.rank
    bad = []
    t0 = time.perf_counter()
    for step in range(steps):
        size = (1, 5, 257, 4096, 70_000)[step % 5]
        x = torch.full((size,), float(me + step % 7))
        if rng.random() < 0.3:
            time.sleep(rng.random() * 3e-4)  # a late rank: peers must wait, not read stale data
        want_sum = sum(float(r + step % 7) for r in range(n))
        if step % 3 == 0:
            got = comm.wait(
                comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="s")
            )
            ok = bool((got == want_sum).all())
        elif step % 3 == 1:
            got = comm.wait(
                comm.reduce_scatter_start(
                    x, ReduceOp.SUM, dim=0, axis=None, donate=False, label="s"
                )
            )
            lo, hi = slice_bounds(size, n, me)
            ok = got.shape == (hi - lo,) and bool((got == want_sum).all())
        else:
            parts = [hi - lo for lo, hi in (slice_bounds(size, n, r) for r in range(n))]
            mine = torch.full((parts[me],), float(step * 10 + me))
            got = comm.wait(comm.all_gather_start(mine, dim=0, parts=parts, axis=None, label="s"))
            want = torch.cat([torch.full((parts[r],), float(step * 10 + r)) for r in range(n)])
            ok = bool(torch.equal(got, want))
        if not ok:
            bad.append(step)
    return {"bad": bad, "seconds": time.perf_counter() - t0, "transport": comm.transport_of(None)}


def split_hosts(comm: Communicator, sizes) -> dict:
    """Pretend ranks 0-1 and 2-3 are two hosts: a pp x tp mesh whose tp groups stay on a host
    (shared memory) while its pp groups and the world cross hosts (torch.distributed); the
    pipeline example's schedules still equal the simulator."""
    from support.examples_loader import load_example

    os.environ["COCONET_HOST_ID"] = f"host{comm.rank // 2}"
    mesh = cc.Mesh(pp=2, tp=2)
    comm2 = Communicator(mesh, dataclasses.replace(comm.options, algorithms="exact"))
    out = {
        "world": comm2.transport_of(None).value,
        "pp": comm2.transport_of("pp").value,
        "tp": comm2.transport_of("tp").value,
        "rows": [],
    }
    mod = load_example("pipeline_parallel")
    program = mod.program()
    for size in sizes:
        inputs = mod.program_inputs(mod.make_inputs(mesh, size))
        for name, make in {"(none)": None, **mod.SCHEDULES}.items():
            target = program if make is None else make(program)
            r = check_distributed(
                target, inputs, comm=comm2, reference=program, verbose=False, fused_kernels=False
            )
            out["rows"].append((name, size, r.max_abs_error))
    try:
        Communicator(mesh, dataclasses.replace(comm.options, transport="shared memory"))
        out["forced"] = "accepted"
    except ConfigError as e:
        out["forced"] = e.message
    return out


def job_script(steps: int, tag: float) -> str:
    """A ``coconet run`` script: ``steps`` all_reduces of values that name this job (``tag``)."""
    return f"""
import sys, torch
from coconet import runtime
from coconet.ir.ops import ReduceOp
comm = runtime.init(timeout=30)
assert comm.transport_of(None).value == "shared memory"
bad = 0
for step in range({steps}):
    x = torch.full((1000 + step,), {tag} + comm.rank)
    got = comm.wait(comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="x"))
    bad += int(not bool((got == {tag} * comm.world + sum(range(comm.world))).all()))
print(f"rank {{comm.rank}} bad={{bad}}", flush=True)
runtime.shutdown(comm, exit_code=0 if bad == 0 else 1)
"""


def raise_after_one(comm: Communicator) -> str:
    """One collective, then rank 1 raises."""
    comm.wait(
        comm.all_reduce_start(torch.ones(10), ReduceOp.SUM, axis=None, donate=False, label="x")
    )
    if comm.rank == 1:
        raise ValueError("injected")
    return "ok"


def killed_mid_collective(comm: Communicator) -> str:
    """Rank 1 dies between two collectives; the other must get a RuntimeFault, not hang."""
    x = torch.ones(10)
    comm.wait(comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="x"))
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.wait(comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="x"))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


def registered_gradient(comm: Communicator, size: int, steps: int) -> dict:
    """Adam's (and LAMB's fused) schedules fed a gradient that lives in symmetric memory
    (``input_buffer``) give bit for bit what they give with an ordinary gradient tensor (copied
    in), over many steps with random per-rank delays (the buffer is rewritten right after each
    step returns)."""
    from support.examples_loader import load_example

    rng = random.Random(comm.rank)
    out = {}
    for example, name in (
        ("adam", "AR_C"),
        ("adam", "RS_C_AG"),
        ("adam", "fuse_RS_C_AG"),
        ("lamb", "fuse_RS_C_AG"),  # a one-pass half that ends without a gather
    ):
        mod = load_example(example)
        program = mod.program()
        sched = mod.SCHEDULES[name](program)
        step = cc.compile(sched, comm=comm, fused_kernels=False)
        buffer = step.input_buffer("g", (size,))
        state = {}
        for label in ("registered", "plain"):
            full = mod.make_inputs(comm.world, size, seed=3, step=1)
            state[label] = rank_inputs(sched.program, full, comm.mesh, comm.rank)
        for k in range(steps):
            grad = _value(k, comm.rank, (size,), torch.float32)
            for label in ("registered", "plain"):
                mine = state[label]
                mine["step"] = float(k + 1)
                if label == "registered":
                    if rng.random() < 0.3:
                        time.sleep(rng.random() * 2e-3)
                    buffer.copy_(grad)  # what backward would do: write the gradient in place
                    mine["g"] = buffer
                else:
                    mine["g"] = grad.clone()
                step(**mine)
        out[f"{example}/{name}"] = {
            "equal": all(
                torch.equal(state["registered"][k], state["plain"][k]) for k in ("p", "m", "v")
            ),
            "in_symmetric_memory": buffer.data_ptr() in comm.route(None)[1].handle.registered,
        }
    return out


def swap_commit(comm: Communicator, size: int) -> dict:
    """Adam's fuse_RS_C_AG committed by swapping storage gives bit for bit what the copying
    commit gives; the state tensors are the same Python objects with new storage, while the
    parameters (a published gather) are written in place."""
    from support.examples_loader import load_example

    mod = load_example("adam")
    program = mod.program()
    sched = mod.SCHEDULES["fuse_RS_C_AG"](program)
    out = {}
    for commit in ("copy", "swap"):
        step = cc.compile(sched, comm=comm, fused_kernels=False, commit=commit)
        full = mod.make_inputs(comm.world, size, seed=4, step=1)
        mine = rank_inputs(sched.program, full, comm.mesh, comm.rank)
        m_object, p_ptr = mine["m"], mine["p"].data_ptr()
        moved = []
        for k in range(3):
            mine["step"] = float(k + 1)
            mine["g"] = _value(k, comm.rank, (size,), torch.float32)
            before = mine["m"].data_ptr()
            step(**mine)
            # step by step: the allocator may hand a later step the storage an earlier one freed
            moved.append(mine["m"].data_ptr() != before)
        out[commit] = {
            "state": {k: mine[k].clone() for k in ("p", "m", "v")},
            "same_object": mine["m"] is m_object,
            "m_moved": all(moved) if commit == "swap" else any(moved),
            "p_in_place": mine["p"].data_ptr() == p_ptr,
        }
    return {
        "equal": all(
            torch.equal(out["copy"]["state"][k], out["swap"]["state"][k]) for k in ("p", "m", "v")
        ),
        "copy": {k: v for k, v in out["copy"].items() if k != "state"},
        "swap": {k: v for k, v in out["swap"].items() if k != "state"},
    }


ONE_SHOT_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16)


def _ints_or_floats(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    # wide enough that sums and products wrap: torch's and the C reduction's must wrap alike
    return torch.randint(-(2**30), 2**30, shape, generator=gen, dtype=torch.int64).to(dtype)


def one_shot_vs_meaning(comm: Communicator) -> list[dict]:
    """The one-round all_reduce (small inputs, ``shmem.one_shot_bytes``) against its group
    meaning, bit for bit: every dtype and reduction (C computes some, Python the others), sizes
    that do not divide by the world, just under and just over the one-round limit (the two-round
    form), plain, donated, in symmetric memory (donated or not: untouched then), strided and 2-D
    inputs; and the agreement's int64 words (``all_reduce_words``)."""
    from coconet.runtime.shmem import one_shot_bytes

    n, me = comm.world, comm.rank
    transport, group = comm.route(None)
    rows = []
    seed = 0
    for dtype in ONE_SHOT_DTYPES:
        width = torch.empty((), dtype=dtype).element_size()
        limit = one_shot_bytes(n) // width
        for size in (1, 5, 1001, limit, limit + 1):
            sym = comm.symmetric_tensor((size,), dtype)  # one per size: each is a rendezvous
            strided = torch.zeros(2 * size, dtype=dtype)
            for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN):
                seed += 1
                xs = [_ints_or_floats(seed, r, (size,), dtype) for r in range(n)]
                # (coconet has no float64 element type; the group meaning reads only the
                # reduction, so a float32 node stands for it)
                kind = cc.float32 if dtype is torch.float64 else cc.DType.from_torch(dtype)
                node = make_node(
                    Op.ALL_REDUCE,
                    (cc.Tensor("x", kind, [cc.Dim("N")], cc.Local).node,),
                    {"axis": None, "reduce_op": op},
                )
                want = semantics.COLLECTIVES[Op.ALL_REDUCE](node, xs)[me]
                name = f"{dtype} {op.value} {size}"
                for mode in ("plain", "donated", "symmetric", "symmetric donated", "strided"):
                    if mode.startswith("symmetric"):
                        x = sym
                        x.copy_(xs[me])
                    elif mode == "strided":
                        x = strided[::2]
                        x.copy_(xs[me])
                    else:
                        x = xs[me].clone()
                    donate = mode.endswith("donated")
                    w = comm.all_reduce_start(x, op, axis=None, donate=donate, label=name)
                    got = comm.wait(w)
                    row = _row(f"{name} {mode}", str(dtype), size, got, want,
                               None if donate else x, xs[me])
                    if donate:
                        row["in_place"] = got.data_ptr() == x.data_ptr()
                    rows.append(row)
                # 2-D: the same values as rows x 1
                x = xs[me].clone().view(size, 1)
                got = comm.wait(comm.all_reduce_start(x, op, axis=None, donate=False, label=name))
                rows.append(_row(f"{name} 2-D", str(dtype), size, got, want.view(size, 1), x,
                                 xs[me].view(size, 1)))
    for length in (1, 10, 32):
        mine = [(me + 1) * (k - 16) * 1_000_003 for k in range(length)]
        want = [max((r + 1) * (k - 16) * 1_000_003 for r in range(n)) for k in range(length)]
        got = transport.all_reduce_words(mine, group, reduce_op=ReduceOp.MAX)
        rows.append({"op": f"words {length}", "equal": got == want, "input_untouched": True})
    return rows


def one_shot_repeated(comm: Communicator) -> list[dict]:
    """The same kind of one-round all_reduce called again and again (the second call on reuses
    ``ShmGroup.one_shot_plans``): new data every call, in every mode (plain, donated, in symmetric
    memory donated or not, 2-D), interleaved with each other; then after a second tensor is
    registered (the plans are dropped) and after a large all_reduce grew the segment (they
    viewed the old one). Every result bit for bit the rank-order sum; a result that is not the
    input is a new tensor every call."""
    n, me = comm.world, comm.rank
    _, group = comm.route(None)
    size = 3001
    sym = comm.symmetric_tensor((size,), torch.float32)
    plain = torch.zeros(size)
    rows: list[dict] = []

    def rounds(tag: str, seed0: int) -> None:
        previous: dict[str, torch.Tensor] = {}
        for call in range(4):
            for mode in ("plain", "donated", "symmetric", "symmetric donated", "2-D"):
                seed = seed0 + call * 10 + len(mode)
                xs = [_ints_or_floats(seed, r, (size,), torch.float32) for r in range(n)]
                want = xs[0].clone()
                for r in range(1, n):
                    want = want + xs[r]
                x = sym if mode.startswith("symmetric") else plain
                x.copy_(xs[me])
                donate = mode.endswith("donated")
                y = x.view(size, 1) if mode == "2-D" else x
                got = comm.wait(comm.all_reduce_start(y, ReduceOp.SUM, axis=None, donate=donate,
                                                      label=mode)).reshape(-1)  # fmt: skip
                row = _row(f"{tag} {mode} call {call}", "float32", size, got, want,
                           None if donate else x, xs[me])  # fmt: skip
                if donate:
                    row["in_place"] = got.data_ptr() == x.data_ptr()
                else:
                    row["fresh"] = got.data_ptr() != x.data_ptr() and all(
                        got.data_ptr() != p.data_ptr() for p in previous.values()
                    )
                    previous[mode] = got
                rows.append(row)

    rounds("first", 0)
    plans = len(group.handle.one_shot_plans)
    comm.symmetric_tensor((7,), torch.float32)  # a registration drops the plans
    rows.append({"op": "plans made, then dropped by a registration", "equal": plans > 0
                 and not group.handle.one_shot_plans, "input_untouched": True})  # fmt: skip
    rounds("after a registration", 1000)
    big = torch.ones(4 << 20)  # past the segment's first size: it grows
    got = comm.wait(comm.all_reduce_start(big, ReduceOp.SUM, axis=None, donate=True,
                                          label="big"))  # fmt: skip
    rows.append({"op": "growth", "equal": bool(torch.all(got == n)), "input_untouched": True})
    rounds("after growth", 2000)
    # the one-round limit lowered at run time (a benchmark times two rounds so): a kind of call
    # with a plan takes two rounds then, and its plan again once the limit is back
    from coconet.runtime import shmem

    transport, _ = comm.route(None)
    again = transport._one_shot_again
    used: list[int] = []
    transport._one_shot_again = lambda *a: used.append(1) or again(*a)
    saved = shmem.ONE_SHOT_BYTES
    results = []
    try:
        for limit in (saved, 0, saved):
            shmem.ONE_SHOT_BYTES = limit
            plain.fill_(float(me + 1))
            got = comm.wait(comm.all_reduce_start(plain, ReduceOp.SUM, axis=None, donate=True,
                                                  label="limit"))  # fmt: skip
            results.append((len(used), bool(torch.all(got == n * (n + 1) / 2))))
    finally:
        shmem.ONE_SHOT_BYTES = saved
        del transport._one_shot_again
    rows.append({"op": "a lowered one-round limit is obeyed", "input_untouched": True,
                 "equal": results == [(1, True), (1, True), (2, True)], "seen": results})
    return rows


def one_shot_fault(comm: Communicator, how: str, words: bool) -> str:
    """Rank 1 fails between two small all_reduces (``how``: it aborts its step, stalls, or is
    killed), the one-round form over a tensor or the agreement's words; the other must get a
    RuntimeFault within the timeout. Returns what rank 0 saw and how long it took."""
    transport, group = comm.route(None)
    x = torch.ones(10)

    def one() -> None:
        if words:
            comm.agree_max([comm.rank, 1, 2], "words")
        else:
            comm.wait(comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="x"))

    one()
    if comm.rank == 1:
        if how == "abort":
            comm.abort("rank 1 failed its step (the test)")
            return "aborted"
        if how == "stall":
            time.sleep(4.5)  # past the peer's 3 s timeout
            return "stalled"
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        one()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"
    return "no error"


def uneven_symmetric(comm) -> dict:
    """``comm.symmetric_tensor`` with a different shape on each rank (a sequence's uneven
    slices): every rank gets its tensor (none fails alone and leaves the others in a collective),
    the collectives that read it equal their meaning (it is copied in, not read in place with
    this rank's size taken for the peers'), and a later even one is read in place as before."""
    rows = [3 + r for r in range(comm.world)]  # 3, 4, ...: uneven
    t = comm.symmetric_tensor((rows[comm.rank], 5), torch.float32)
    t.copy_(torch.arange(rows[comm.rank] * 5, dtype=torch.float32).view(-1, 5) + 100 * comm.rank)
    whole = comm.wait(comm.all_gather_start(t, dim=0, parts=rows, axis=None, label="uneven"))
    want = torch.cat([torch.arange(n * 5, dtype=torch.float32).view(-1, 5) + 100 * r
                      for r, n in enumerate(rows)])  # fmt: skip
    even = comm.symmetric_tensor((4, 5), torch.float32)
    even.fill_(comm.rank + 1.0)
    total = comm.wait(comm.all_reduce_start(even, ReduceOp.SUM, axis=None, donate=True,
                                            label="even"))  # fmt: skip
    st = comm.route(None)[1].handle  # the world's shared-memory group
    return {
        "gathered": bool(torch.equal(whole, want)),
        "reduced": bool(torch.equal(total, torch.full((4, 5), comm.world * (comm.world + 1) / 2))),
        "uneven_read_in_place": t.data_ptr() in st.registered,
        "even_read_in_place": even.data_ptr() in st.registered,
    }
