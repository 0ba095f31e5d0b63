"""Functions that run inside spawned ranks (``coconet.runtime.spawn``) for the tests/dist tier.

Each takes the rank's communicator first and returns plain data (rows of results) that the tests
assert on in the parent process. They live in a module of their own so that the spawned children
import only this, not pytest's test modules.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import time
import traceback

import torch

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.options import TransportKind
from coconet.runtime import CommOptions, Communicator
from coconet.testing import check_distributed
from support.examples_loader import load_example

OPTIMIZERS = ("sgd", "adam", "adamw", "lamb")
LAYERS = ("tensor_parallel",)
PIPELINES = ("pipeline_parallel",)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _kind(e: BaseException) -> str:
    """An exception's kind as the tests compare it: every RuntimeFault (a CallRefused too:
    the typed refusal the agreement raises) as "RuntimeFault"."""
    return "RuntimeFault" if isinstance(e, RuntimeFault) else type(e).__name__


def _row(**kw):
    return kw


def _check(comm, target, inputs, reference, **compile_options):
    """(status, abs error, rel error, per-value errors) of one distributed step."""
    try:
        r = check_distributed(
            target, inputs, comm=comm, reference=reference, verbose=False, **compile_options
        )
        return "ok", r.max_abs_error, r.max_rel_error, dict(r.errors)
    except Exception:  # noqa: BLE001 - reported to the test
        return f"error: {traceback.format_exc()}", None, None, {}


# -- every example x every named schedule ---------------------------------------------------------


def run_examples(comm: Communicator, names, sizes, dtypes, algorithms="exact") -> list[dict]:
    comm.options = dataclasses.replace(comm.options, algorithms=algorithms)
    rows = []
    for name in names:
        mod = load_example(name)
        for dtype in dtypes:
            program = mod.program(dtype=getattr(cc, dtype))
            schedules = {"(none)": program}
            for sname, make in getattr(mod, "SCHEDULES", {}).items():
                schedules[sname] = make(program)
            for size in sizes:
                if name in PIPELINES:
                    inputs = mod.program_inputs(
                        mod.make_inputs(comm.mesh, size, dtype=TORCH_DTYPES[dtype])
                    )
                else:
                    inputs = mod.make_inputs(comm.world, size, step=2, dtype=TORCH_DTYPES[dtype])
                for sname, target in schedules.items():
                    status, abs_err, rel_err, errors = _check(
                        comm, target, inputs, program, fused_kernels=False
                    )
                    rows.append(
                        _row(
                            example=name,
                            schedule=sname,
                            size=size,
                            dtype=dtype,
                            world=str(comm.mesh),
                            status=status,
                            abs=abs_err,
                            rel=rel_err,
                            errors=errors,
                        )
                    )
                    if status.startswith("error") and comm.broken:
                        return rows
    return rows


def run_world_and_mesh(comm: Communicator, sizes, mesh_axes, two_levels: bool = False) -> dict:
    """On 4 ranks: the optimizer and layer examples on the world, then the pipeline example and
    a mesh program on a 2-D mesh (a second communicator over the same processes).
    ``two_levels`` (2 hosts x 2 ranks): the optimizers on the world in two levels too."""
    from support import dist_programs as dp

    out = {"world": run_examples(comm, OPTIMIZERS + LAYERS, sizes, ["float32"])}
    # gloo's own algorithms: a communicator on torch.distributed (the default on one host is
    # shared memory, which reduces in rank order)
    gloo = Communicator(
        comm.mesh, CommOptions(algorithms="native", timeout=60, transport="torch.distributed")
    )
    out["native"] = run_examples(gloo, ("adam", "lamb"), sizes[:1], ["float32"], "native")
    if two_levels:
        levels = Communicator(comm.mesh, CommOptions(timeout=60))
        assert levels.transport_of(None).value == "hierarchical", levels.transport_of(None)
        out["two_levels"] = run_examples(levels, ("adam", "lamb"), sizes[:1], ["float32"], "auto")
    mesh_comm = Communicator(cc.Mesh(**mesh_axes), CommOptions(algorithms="exact", timeout=60))
    out["mesh"] = run_examples(mesh_comm, PIPELINES, sizes, ["float32", "bfloat16"])
    rows = []
    cases = [("mesh_program", dp.mesh_program, dp.mesh_program_inputs),
             ("mesh_program_grad", dp.mesh_program_grad, dp.mesh_program_grad_inputs)]  # fmt: skip
    for (name, build, make), size in itertools.product(cases, (4, 5)):
        status, abs_err, rel_err, errors = _check(
            mesh_comm,
            build(),
            make(mesh_comm.mesh, size),
            None,
            fused_kernels=False,
        )
        rows.append(
            _row(
                example=name,
                schedule="(none)",
                size=size,
                dtype="float32",
                world=str(mesh_comm.mesh),
                status=status,
                abs=abs_err,
                rel=rel_err,
                errors=errors,
            )
        )
    out["mesh_program"] = rows
    return out


# -- the handwritten programs, under every algorithm --------------------------------------------


def run_programs(comm: Communicator, sizes, policies) -> list[dict]:
    from support import dist_programs as dp

    rows = []
    for policy in policies:
        comm.options = dataclasses.replace(comm.options, algorithms=policy)
        for name, (build, make) in dp.PROGRAMS.items():
            for size in sizes:
                for dtype in ("float32", "bfloat16") if name == "collectives" else ("float32",):
                    kwargs = {"dtype": getattr(cc, dtype)} if name == "collectives" else {}
                    inputs = make(comm.world, size, dtype=TORCH_DTYPES[dtype])
                    status, abs_err, rel_err, errors = _check(
                        comm, build(**kwargs), inputs, None, fused_kernels=False
                    )
                    rows.append(
                        _row(
                            program=name,
                            size=size,
                            dtype=dtype,
                            policy=str(policy),
                            status=status,
                            abs=abs_err,
                            rel=rel_err,
                            errors=errors,
                        )
                    )
    return rows


# -- the compiled (torch.compile) path --------------------------------------------------------


def run_compiled(comm: Communicator, cache_dir: str) -> dict:
    """One fused Adam step and the fused mix program compiled, against eager and the simulator;
    reports the first-call (compile) time of each kernel. Every kernel runs from its package
    (``kernel_packages=True``, whatever the environment says: the default path), the
    one-pass forms' kernels that write into the peers' slots included."""
    from support import dist_programs as dp

    adam = load_example("adam")
    program = adam.program()
    schedule = adam.SCHEDULES["fuse_RS_C_AG"](program)
    inputs = adam.make_inputs(comm.world, 1000, step=3)
    out = {}
    for label, target, ins, ref in (
        ("adam", schedule, inputs, program),
        ("fused_mix", dp.fused_mix(), dp.fused_mix_inputs(comm.world, 9), None),
    ):
        t0 = time.perf_counter()
        r = check_distributed(
            target, ins, comm=comm, reference=ref, verbose=False, cache_dir=cache_dir,
            kernel_packages=True,
        )
        step = cc.compile(target, comm=comm, cache_dir=cache_dir, kernel_packages=True)
        out[label] = dict(
            abs=r.max_abs_error,
            rel=r.max_rel_error,
            seconds=time.perf_counter() - t0,
            kernels=len(step.kernels),
        )
    # A second step of the same compiled program reuses the kernel: no recompilation.
    step = cc.compile(schedule, comm=comm, cache_dir=cache_dir, kernel_packages=True)
    from coconet.testing import rank_inputs

    mine = rank_inputs(schedule.program, inputs, comm.mesh, comm.rank)
    t0 = time.perf_counter()
    step(**mine)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(**mine)
    out["adam_again_seconds"] = (first, time.perf_counter() - t0)
    out["first_call_seconds"] = dict(step.kernels.first_call_seconds)
    out["compiled"] = step.kernels.fused
    out["packaged"] = (step.kernels.built + step.kernels.loaded, dict(step.kernels.why_not))
    # The other one-pass forms over shared memory, compiled (their kernels mutate the peers'
    # slots and slices of outputs, which torch.compile must write through).
    out["one_pass"] = {}
    for name, sname, marker in ONE_PASS_CASES:
        mod = load_example(name)
        program = mod.program()
        target = mod.SCHEDULES[sname](program)
        kwargs = {} if name == "tensor_parallel" else {"step": 2}
        ins = mod.make_inputs(comm.world, 13, **kwargs)
        r = check_distributed(
            target, ins, comm=comm, reference=program, verbose=False, cache_dir=cache_dir,
            kernel_packages=True,
        )
        step = cc.compile(target, comm=comm, cache_dir=cache_dir, kernel_packages=True)
        step(**rank_inputs(target.program, ins, comm.mesh, comm.rank))  # its packages, loaded
        packaged = (step.kernels.built + step.kernels.loaded, dict(step.kernels.why_not))
        out["one_pass"][f"{name}/{sname}"] = dict(
            rel=r.max_rel_error, form=marker in step.source, compiled=step.kernels.fused,
            packaged=packaged,
        )
    return out


# (example, schedule, what its generated code calls over shared memory)
ONE_PASS_CASES = (
    ("adam", "AR_C", ".reduce_in_place("),
    ("lamb", "fuse_RS_C_AG", "_channel.end("),
    ("tensor_parallel", "ol_MM_fuse_RS_C_AG", "_channel.begin("),
)


# -- faults -----------------------------------------------------------------------------------


def _adam_case(comm, size=1000):
    adam = load_example("adam")
    program = adam.program()
    schedule = adam.SCHEDULES["fuse_RS_C_AG"](program)
    inputs = adam.make_inputs(comm.world, size, step=2)
    from coconet.testing import rank_inputs

    mine = rank_inputs(schedule.program, inputs, comm.mesh, comm.rank)
    return schedule, mine


def _step_expecting_fault(step, mine: dict) -> dict:
    """Run ``step`` on this rank's inputs ``mine``: "no error", or a RuntimeFault's message, the
    seconds until it came and whether every tensor of ``mine`` was left as it was."""
    before = {k: v.clone() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    t0 = time.perf_counter()
    try:
        step(**mine)
        return dict(status="no error")
    except RuntimeFault as e:
        unchanged = all(torch.equal(before[k], mine[k]) for k in before)
        return dict(
            status="fault", message=str(e), seconds=time.perf_counter() - t0, unchanged=unchanged
        )


def fault_peer_dies(comm: Communicator, victim: int, where: str, commit: str = "copy") -> dict:
    """``victim`` kills itself at ``where`` ("all_gather": mid-step, between the reduce_scatter
    and the all_gather; "commit": after every collective, before the commit vote). The others
    must get a RuntimeFault quickly and keep their tensors as they were (``commit``: the
    CommitMode the step is compiled with)."""
    schedule, mine = _adam_case(comm)
    step = cc.compile(schedule, comm=comm, fused_kernels=False, commit=commit)
    step(**mine)  # one good step first: the fault happens on a warm, agreed program
    if comm.rank == victim:
        if where == "all_gather":  # (over shared memory, a one-pass unit's gather)
            comm.all_gather_start = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            for channel in _one_pass_channels(comm):
                channel.finish = comm.all_gather_start
        else:
            real = comm.agree_max

            def agree(values, label, op="handshake"):
                if op == "commit vote":
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(values, label, op)

            comm.agree_max = agree
    return _step_expecting_fault(step, mine)


def _one_pass_channels(comm: Communicator) -> list:
    """The world's one-pass channel where it runs on shared memory (the one generated code gets
    from ``comm.one_pass``: it is made once per axis)."""
    return [comm.one_pass(None)] if comm.transport_of(None) is TransportKind.SHARED_MEMORY else []


def fault_peer_stalls(comm: Communicator, victim: int, sleep: float) -> dict:
    """``victim`` stalls ``sleep`` seconds before its all_gather; the others must time out with a
    RuntimeFault after the communicator's timeout, their tensors unchanged."""
    schedule, mine = _adam_case(comm)
    step = cc.compile(schedule, comm=comm, fused_kernels=False)
    if comm.rank == victim:
        # either form of the gather: a collective, or the end of a one-pass unit
        for obj, name in [(comm, "all_gather_start")] + [
            (channel, "finish") for channel in _one_pass_channels(comm)
        ]:
            real = getattr(obj, name)

            def slow(*a, real=real, **k):
                time.sleep(sleep)
                return real(*a, **k)

            setattr(obj, name, slow)
    return _step_expecting_fault(step, mine)


def late_sender(comm: Communicator, delay: float) -> dict:
    """Rank 0 sends to rank 1 ``delay`` seconds late (the pipeline's point-to-point send), then
    every rank runs an all_reduce on the same connections. Rank 1's wait spans many of the
    communicator's wait slices: a slice that ended inside gloo's recv would close the
    connection (what the pipeline hit under load)."""
    import torch.distributed as dist

    from coconet.ir.ops import Op, ReduceOp

    x = torch.arange(1000, dtype=torch.float32) + 100 * comm.rank
    # the ranks leave the barrier together: rank 1's wait is measured from rank 0's sleep's
    # start (without it, a rank that reaches here later measures less than the delay)
    dist.barrier()
    start = time.monotonic()
    try:
        if comm.rank == 0:
            time.sleep(delay)
        got = comm.wait(comm.start(Op.SEND, x, label="late send", axis=None))
        waited = time.monotonic() - start
        total = comm.wait(
            comm.start(
                Op.ALL_REDUCE,
                torch.ones(10),
                label="after",
                axis=None,
                reduce_op=ReduceOp.SUM,
                donate=False,
            )
        )
    except RuntimeFault as e:
        return {"status": "fault", "message": e.message, "seconds": time.monotonic() - start}
    return {
        "status": "ok",
        "transport": comm.transport_of(None).value,
        "received": got.tolist()
        == (torch.arange(1000.0) if comm.rank == 1 else torch.zeros(1000)).tolist(),
        "waited": waited,
        "after": total.tolist() == [float(comm.world)] * 10,
    }


def fault_local_error(comm: Communicator, victim: int) -> dict:
    """A computation fails on ``victim`` mid-step (after the reduce_scatter). The victim gets
    its own error, every rank keeps its tensors, and the victim's exit tells the others."""
    schedule, mine = _adam_case(comm)
    step = cc.compile(schedule, comm=comm, fused_kernels=False)
    before = {k: v.clone() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    if comm.rank == victim:

        def boom(*args):
            raise ValueError("injected failure in the fused kernel")

        step.kernels._kernels["fused_1"].fn = boom
    t0 = time.perf_counter()
    try:
        step(**mine)
        status, message = "no error", ""
    except Exception as e:  # noqa: BLE001
        status, message = _kind(e), str(e)
    unchanged = all(torch.equal(before[k], mine[k]) for k in before)
    result = dict(
        status=status,
        message=message,
        unchanged=unchanged,
        seconds=time.perf_counter() - t0,
        broken=comm.broken,
    )
    return result


def handshake_faults(comm: Communicator) -> dict:
    """Mismatched programs and bad inputs fail on every rank before any communication, with a
    message naming the difference, and leave the communicator usable."""
    schedule, mine = _adam_case(comm, size=10)
    out = {}

    def attempt(label, target, inputs):
        try:
            cc.compile(target, comm=comm, fused_kernels=False)(**inputs)
            out[label] = "no error"
        except RuntimeFault as e:
            out[label] = str(e)

    sgd = load_example("sgd")
    other = sgd.program() if comm.rank == 1 else schedule
    other_inputs = (
        __import__("coconet.testing", fromlist=["rank_inputs"]).rank_inputs(
            sgd.program(), sgd.make_inputs(comm.world, 10), comm.mesh, comm.rank
        )
        if comm.rank == 1
        else mine
    )
    attempt("program", other, other_inputs)
    bad = dict(mine)
    if comm.rank == 1:
        bad["g"] = mine["g"].double()
    attempt("dtype", schedule, bad)
    bad = dict(mine)
    if comm.rank == 1:
        bad["g"] = torch.zeros(11)
    attempt("local_size", schedule, bad)
    bad = dict(mine)
    if comm.rank == 0:
        bad["m"] = torch.zeros(4)  # its slice of 10 is 5
    attempt("slice_size", schedule, bad)
    bad = dict(mine)
    if comm.rank == 1:
        del bad["lr"]
    attempt("missing", schedule, bad)
    before = {k: v.clone() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    out["unchanged"] = all(torch.equal(before[k], mine[k]) for k in before)
    attempt("good", schedule, mine)  # the communicator still works
    out["changed_after_good"] = not torch.equal(before["p"], mine["p"])
    return out


# -- donated inputs ------------------------------------------------------------------------------


def run_donated_output(comm: Communicator, numel: int) -> dict:
    """A one-all_reduce program whose input is donated and placed in the step's input buffer:
    its output is the buffer itself (reduced in place, no copy), at every size, bitwise the
    rank-order sum; the output of the step without donation is a tensor of its own."""
    n = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [n], cc.Local)
    program = cc.Program("donated_all_reduce", [g], [cc.all_reduce(g, name="total")])
    placed = cc.compile(program, comm=comm, donate=("g",))
    plain = cc.compile(program, comm=comm)
    data = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    buf = placed.input_buffer("g", (numel,))
    buf.copy_(data[comm.rank])
    total = placed(g=buf)["total"]
    mine = data[comm.rank].clone()
    other = plain(g=mine)["total"]
    return {
        "same memory": total.data_ptr() == buf.data_ptr(),
        "sum": torch.equal(total, data[0] + data[1]),
        "plain own memory": other.data_ptr() != mine.data_ptr() and torch.equal(other, total),
        "plain input kept": torch.equal(mine, data[comm.rank]),
    }


def run_donated(comm: Communicator, size: int) -> dict:
    """Adam's AR_C with the gradient donated: the same result as without, and the gradient buffer
    reduced in place (what donation is for)."""
    mod = load_example("adam")
    program = mod.program()
    sched = mod.SCHEDULES["AR_C"](program)
    inputs = mod.make_inputs(comm.world, size, seed=5)
    want = cc.simulate(program, inputs, comm.world)
    mine = {k: (v[comm.rank] if isinstance(v, list) else v) for k, v in inputs.items()}
    mine = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in mine.items()}
    g_before = mine["g"].clone()
    step = cc.compile(sched, comm=comm, fused_kernels=False, donate=("g",))
    step(**mine)
    return {
        "equal": all(torch.equal(mine[k], want.updated(k)) for k in ("p", "m", "v")),
        "g_reduced_in_place": torch.equal(mine["g"], sum(inputs["g"][1:], inputs["g"][0])),
        "g_changed": not torch.equal(mine["g"], g_before),
    }


def kept_rehearsal_misaligned(comm: Communicator, cache_dir: str) -> dict:
    """``kept_rehearsal``'s step in a later process, called twice, where rank 1's kernel
    arguments differ from those the kept packages were built for (as another alignment of its
    tensors would make them: its argument signatures carry one more element here): its first
    call skips the rehearsal (every rank preloaded) and runs that rank's kernel eagerly; the
    second rehearses on every rank and builds rank 1's package outside the collectives."""
    from coconet.codegen import aot
    from coconet.testing import rank_inputs

    if comm.rank == 1:
        real = aot.signature
        aot.signature = lambda args: (None if (sig := real(args)) is None
                                      else (*sig, "another alignment"))  # fmt: skip
    adam = load_example("adam")
    schedule = adam.SCHEDULES["fuse_RS_C_AG"](adam.program())
    inputs = adam.make_inputs(comm.world, 1000, step=3)
    step = cc.compile(schedule, comm=comm, cache_dir=cache_dir, kernel_packages=True)
    mine = rank_inputs(schedule.program, inputs, comm.mesh, comm.rank)
    k = step.kernels
    first = step(**{n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in mine.items()})
    after_first = dict(rehearsals=k.rehearsals, built=k.built, unkept=k.unkept,
                       why_not=dict(k.why_not))  # fmt: skip
    second = step(**mine)
    return dict(first=after_first, rehearsals=k.rehearsals, built=k.built, unkept=k.unkept,
                outputs=[{n: t.clone() for n, t in out.items()} for out in (first, second)])


def kept_rehearsal(comm: Communicator, cache_dir: str) -> dict:
    """One step of fused Adam (``fuse_RS_C_AG``, its kernels from packages) in a process of its
    own: whether it rehearsed or preloaded what an earlier process kept, and its outputs."""
    from coconet.testing import rank_inputs

    adam = load_example("adam")
    schedule = adam.SCHEDULES["fuse_RS_C_AG"](adam.program())
    inputs = adam.make_inputs(comm.world, 1000, step=3)
    step = cc.compile(schedule, comm=comm, cache_dir=cache_dir, kernel_packages=True)
    out = step(**rank_inputs(schedule.program, inputs, comm.mesh, comm.rank))
    k = step.kernels
    return dict(
        rehearsals=k.rehearsals, preloaded=len(k.preloaded), built=k.built,
        why_not=dict(k.why_not), manifest=str(k.manifest), no_builds_after=k.no_builds,
        outputs={name: t.clone() for name, t in out.items()},
    )
