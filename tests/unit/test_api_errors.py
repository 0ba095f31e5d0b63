"""The error contract of the public API, walked with bad arguments.

Every call below is wrong in one way. Each must raise a ``CoconetError`` subclass (the one the
table names, exactly) whose message names the bad value, whose ``loc`` is the line of this file
the call is written on (or, for an error about a value of a program, the line that value was
written on: also in this file) and which carries a hint. Errors that mix in a builtin
(``DSLValueError`` is a ``ValueError``, ``UnknownNameError`` a ``KeyError``, ...) are also that
builtin, so code that caught the builtin before keeps working.

Each call is a one-line lambda, so the line it is written on is its code's first line.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import sys
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import coconet as cc
import coconet.ops
from coconet import dsl
from coconet.errors import SourceLoc
from coconet.runtime import CommOptions, Communicator, init, spawn
from coconet.runtime.launch import free_port
from coconet.schedule import AR_C, Schedule, check_fuse
from coconet.sim import reassociations
from coconet.testing import check_distributed, check_schedules, rank_inputs

N = cc.Dim("N")
x = cc.Tensor("x", cc.float32, [N], cc.Local)


def _opt() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [N], cc.Replicated)
    lr = cc.Scalar("lr")
    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (0.9 * m + g_sum).named("m_new")
    return cc.Program("opt", [g, p, m, lr], [cc.update(m, m_new), cc.update(p, p - lr * m_new)])


def _over_tp() -> cc.Program:
    t = cc.Tensor("t", cc.float32, [N], cc.Local)
    return cc.Program("tp_sum", [t], {"s": cc.all_reduce(t, axis="tp")})


def _opt4() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [4], cc.Local)
    return cc.Program("sum4", [g], {"s": cc.all_reduce(g, name="g_sum") * 2.0})


P = _opt()
P4 = _opt4()
TP = _over_tp()
INPUTS = {"g": torch.ones(4), "p": torch.ones(4), "m": torch.zeros(4), "lr": 0.1}
RESULT = cc.simulate(P, INPUTS, 2)
Y = cc.all_reduce(x)


class Where(enum.Enum):
    CALL = "the line of the call"
    VALUE = "the line a value of the program was written on (in this file)"


def case(
    label: str,
    call: Callable[[], object],
    cls: type[cc.CoconetError],
    *fragments: str,
    where: Where = Where.CALL,
    marks=(),
):
    """One row: ``call`` must raise exactly ``cls``, its message holding every fragment."""
    return pytest.param(call, cls, fragments, where, id=label, marks=marks)


no_process_group = pytest.mark.skipif(
    dist.is_available() and dist.is_initialized(), reason="a process group exists already"
)

CASES = [
    # -- declarations ---------------------------------------------------------------------------
    case("Tensor shape int", lambda: cc.Tensor("x", cc.float32, 5), cc.DSLError, "int 5"),
    case("Tensor shape None", lambda: cc.Tensor("x", cc.float32, None), cc.DSLError, "None"),
    case("Tensor shape str", lambda: cc.Tensor("x", cc.float32, "N"), cc.DSLError, "str 'N'"),
    case("Tensor name", lambda: cc.Tensor("1x", cc.float32, [N]), cc.DSLError, "'1x'"),
    case("Tensor name int", lambda: cc.Tensor(3, cc.float32, [N]), cc.DSLError, "got 3"),
    case("Tensor dtype", lambda: cc.Tensor("x", "float32", [N]), cc.DSLError, "'float32'"),
    case("Tensor size < 0", lambda: cc.Tensor("x", cc.float32, [N, -1]), cc.DSLError, "-1"),
    case("Tensor size bool", lambda: cc.Tensor("x", cc.float32, [True]), cc.DSLError, "True"),
    case("Tensor layout", lambda: cc.Tensor("x", cc.float32, [N], "Local"), cc.DSLError, "'Local'"),
    case(
        "Tensor sliced dim",
        lambda: cc.Tensor("x", cc.float32, [N], cc.Sliced(1)),
        cc.DSLError,
        "Sliced(dim=1)",
    ),
    case("Scalar dtype", lambda: cc.Scalar("lr", "float32"), cc.DSLError, "'float32'"),
    case("Scalar name", lambda: cc.Scalar("l r"), cc.DSLError, "'l r'"),
    case("Dim not identifier", lambda: cc.Dim("1N"), cc.DSLValueError, "'1N'"),
    case("Dim empty", lambda: cc.Dim(""), cc.DSLValueError, "''"),
    case("Dim int", lambda: cc.Dim(5), cc.DSLTypeError, "int 5"),
    case("Dim None", lambda: cc.Dim(None), cc.DSLTypeError, "None"),
    case("Sliced str", lambda: cc.Sliced("0"), cc.DSLTypeError, "'0'"),
    case("Sliced bool", lambda: cc.Sliced(True), cc.DSLTypeError, "True"),
    case("Sliced axis int", lambda: cc.Sliced(0, axis=3), cc.DSLTypeError, "got 3"),
    case("Local axis", lambda: cc.Local("tp"), cc.DSLTypeError, "'tp'"),
    case("Replicated axis int", lambda: cc.Replicated(3), cc.DSLTypeError, "got 3"),
    case("Sliced called", lambda: cc.Sliced(0)("tp"), cc.DSLTypeError, "'tp'"),
    case(
        "DType.from_torch",
        lambda: cc.DType.from_torch(torch.complex64),
        cc.DSLValueError,
        "complex64",
    ),
    # -- Mesh -----------------------------------------------------------------------------------
    case("Mesh no axis", lambda: cc.Mesh(), cc.DSLValueError, "at least one axis"),
    case("Mesh size 0", lambda: cc.Mesh(tp=0), cc.DSLValueError, "'tp'", "got 0"),
    case("Mesh size str", lambda: cc.Mesh(tp="2"), cc.DSLValueError, "got '2'"),
    case("Mesh positional int", lambda: cc.Mesh(4), cc.DSLTypeError, "got 4"),
    case("Mesh axis name", lambda: cc.Mesh({"1x": 2}), cc.DSLValueError, "'1x'"),
    case("Mesh.world 0", lambda: cc.Mesh.world(0), cc.DSLValueError, "got 0"),
    case("Mesh.axis_size", lambda: cc.Mesh(tp=2).axis_size("dp"), cc.UnknownNameError, "'dp'"),
    case("Mesh.coords", lambda: cc.Mesh(tp=2).coords(5), cc.DSLValueError, "rank 5"),
    case("Mesh.rank_of axes", lambda: cc.Mesh(tp=2).rank_of({"dp": 0}), cc.DSLValueError, "'dp'"),
    case("Mesh.rank_of range", lambda: cc.Mesh(tp=2).rank_of({"tp": 3}), cc.DSLValueError, "tp=3"),
    case("Mesh.group_of", lambda: cc.Mesh(tp=2).group_of(0, "dp"), cc.UnknownNameError, "'dp'"),
    case("Mesh.index_in", lambda: cc.Mesh(tp=2).index_in(0, "dp"), cc.UnknownNameError, "'dp'"),
    # -- ops ------------------------------------------------------------------------------------
    case("operand str", lambda: x + "a", cc.DSLError, "'a'"),
    case("no tensor operand", lambda: cc.maximum(1, 2), cc.DSLError, "1 and 2"),
    case("cast dtype", lambda: cc.cast(x, "float32"), cc.DSLError, "'float32'"),
    case("sum dim", lambda: cc.sum(x, dim="0"), cc.DSLError, "'0'"),
    case("reduce_scatter dim", lambda: cc.reduce_scatter(x, dim="0"), cc.DSLError, "'0'"),
    case("all_reduce op", lambda: cc.all_reduce(x, op="sum"), cc.DSLError, "'sum'"),
    case("all_reduce axis", lambda: cc.all_reduce(x, axis=3), cc.DSLError, "got 3"),
    case("all_reduce name", lambda: cc.all_reduce(x, name="1a"), cc.DSLError, "'1a'"),
    case("all_reduce name int", lambda: cc.all_reduce(x, name=3), cc.DSLError, "got 3"),
    case("send axis", lambda: cc.send(x, axis=None), cc.DSLError, "got None"),
    case("broadcast root", lambda: cc.broadcast(x, root=-1), cc.DSLError, "-1"),
    case("dropout p", lambda: cc.dropout(x, 1.5), cc.DSLError, "p=1.5"),
    case("dropout p str", lambda: cc.dropout(x, "0.1"), cc.DSLError, "'0.1'"),
    case("update target", lambda: cc.update(5, x), cc.DSLError, "got 5"),
    case("named", lambda: (x * 2.0).named("1a"), cc.DSLError, "'1a'"),
    case("named input", lambda: x.named("y"), cc.DSLError, "'x'"),
    case("truth value", lambda: bool(x), cc.DSLError, "truth value"),
    # -- Program --------------------------------------------------------------------------------
    case("Program name int", lambda: cc.Program(123, [x], [Y]), cc.DSLError, "got 123"),
    case("Program inputs Tensor", lambda: cc.Program("p", x, [Y]), cc.DSLError, "got Tensor"),
    case("Program outputs Tensor", lambda: cc.Program("p", [x], Y), cc.DSLError, "got Tensor"),
    case("Program inputs None", lambda: cc.Program("p", None, [Y]), cc.DSLError, "None"),
    case("Program output key int", lambda: cc.Program("p", [x], {1: Y}), cc.DSLError, "got 1"),
    case("Program output key", lambda: cc.Program("p", [x], {"1a": Y}), cc.DSLError, "'1a'"),
    case("Program input int", lambda: cc.Program("p", [x, 5], [Y]), cc.DSLError, "int: 5"),
    case("Program groups", lambda: cc.Program("p", [x], [Y], groups=[1]), cc.DSLError, "got 1"),
    case("Program.node name", lambda: P.node("nope"), cc.UnknownNameError, "'nope'"),
    case("Program.node int", lambda: P.node(42), cc.UnknownNameError, "42"),
    case("Program.input", lambda: P.input("nope"), cc.UnknownNameError, "'nope'"),
    case("Program groups int", lambda: cc.Program("p", [x], [Y], groups=5), cc.DSLError, "got 5"),
    case("SimResult.output", lambda: RESULT.output("nope"), cc.UnknownNameError, "'nope'"),
    case("SimResult.output input", lambda: RESULT.output("g"), cc.UnknownNameError, "'g'"),
    case("SimResult.updated", lambda: RESULT.updated("g"), cc.UnknownNameError, "'g'"),
    # -- Schedule -------------------------------------------------------------------------------
    case("Schedule of int", lambda: Schedule(123), cc.ScheduleError, "int 123"),
    case("Schedule name", lambda: Schedule(P, name=5), cc.ScheduleError, "int 5"),
    case("from_json dict", lambda: Schedule.from_json(P, {"a": 1}), cc.ScheduleError, "dict"),
    case("from_json program", lambda: Schedule.from_json("p", "{}"), cc.ScheduleError, "'p'"),
    case("from_json text", lambda: Schedule.from_json(P, "{x"), cc.ScheduleError, "not a schedule"),
    case(
        "from_json format",
        lambda: Schedule.from_json(P, "[]"),
        cc.ScheduleError,
        "coconet.schedule/1",
    ),
    case("fuse str", lambda: Schedule(P).fuse("m_new"), cc.ScheduleError, "str 'm_new'"),
    case("fuse int", lambda: Schedule(P).fuse(3), cc.ScheduleError, "int 3"),
    case("fuse empty", lambda: Schedule(P).fuse([]), cc.ScheduleError, "no nodes"),
    case("fuse unknown", lambda: Schedule(P).fuse(["m_new", "zz"]), cc.ScheduleError, "'zz'"),
    case("reorder str", lambda: Schedule(P).reorder("m_new", "g_sum"), cc.ScheduleError, "'m_new'"),
    case("overlap str", lambda: Schedule(P).overlap("g_sum"), cc.ScheduleError, "'g_sum'"),
    case(
        "overlap chunks",
        lambda: Schedule(P).overlap(["g_sum", "m_new"], chunks=1),
        cc.ScheduleError,
        "got 1",
    ),
    case(
        "overlap chunks huge",
        lambda: Schedule(P).overlap(["g_sum", "m_new"], chunks=10**12),
        cc.ScheduleError,
        "more than 1024",
    ),
    case(
        "overlap chunks > rows",
        lambda: Schedule(P4).overlap(["g_sum", "s"], chunks=5),
        cc.ScheduleError,
        "only 4 rows",
        where=Where.VALUE,
    ),
    case("split unknown", lambda: Schedule(P).split("nope"), cc.ScheduleError, "'nope'"),
    case(
        "split dim str",
        lambda: Schedule(P).split("g_sum", dim="0"),
        cc.ScheduleError,
        "'0'",
        where=Where.VALUE,
    ),
    case(
        "split dim range",
        lambda: Schedule(P).split("g_sum", dim=5),
        cc.ScheduleError,
        "dim=5",
        where=Where.VALUE,
    ),
    case(
        "split not all_reduce",
        lambda: Schedule(P).split("m_new"),
        cc.ScheduleError,
        "m_new",
        where=Where.VALUE,
    ),
    case("as_slice unknown", lambda: Schedule(P).as_slice("nope"), cc.ScheduleError, "'nope'"),
    case("downstream", lambda: Schedule(P).downstream("nope"), cc.ScheduleError, "'nope'"),
    case("computations", lambda: Schedule(P).computations(3), cc.ScheduleError, "3"),
    case("check_fuse str", lambda: check_fuse(P, "m_new"), cc.ScheduleError, "'m_new'"),
    case("AR_C of str", lambda: AR_C("opt"), cc.ScheduleError, "'opt'"),
    case("AR_C unknown", lambda: AR_C(P, "nope"), cc.ScheduleError, "'nope'"),
    # -- compile --------------------------------------------------------------------------------
    case("compile str", lambda: cc.compile("sgd", world=2), cc.CompileOptionError, "'sgd'"),
    case("compile world 0", lambda: cc.compile(P, world=0), cc.CompileOptionError, "got 0"),
    case("compile no ranks", lambda: cc.compile(P), cc.CompileOptionError, "no world="),
    case(
        "compile option",
        lambda: cc.compile(P, world=2, fused=False),
        cc.CompileOptionError,
        "'fused'",
    ),
    case(
        "compile donate str",
        lambda: cc.compile(P, world=2, donate="g"),
        cc.CompileOptionError,
        "'g'",
    ),
    case(
        "compile donate unknown",
        lambda: cc.compile(P, world=2, donate=("zz",)),
        cc.CompileOptionError,
        "'zz'",
    ),
    case(
        "compile options dict",
        lambda: cc.compile(P, world=2, options={}),
        cc.CompileOptionError,
        "dict",
    ),
    case(
        "compile device",
        lambda: cc.compile(P, world=2, device="tpu"),
        cc.CompileOptionError,
        "'tpu'",
    ),
    case(
        "compile cuda without a GPU",
        lambda: cc.compile(P, world=2, device="cuda"),
        cc.CompileOptionError,
        "no GPU",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there"),
    ),
    case("compile mesh axes", lambda: cc.compile(TP, world=2), cc.CodegenError, "['tp']"),
    case(
        "CompileOptions donate", lambda: cc.CompileOptions(donate="g"), cc.CompileOptionError, "'g'"
    ),
    case(
        "CompileOptions flag",
        lambda: cc.CompileOptions(commit_vote="no"),
        cc.CompileOptionError,
        "'no'",
    ),
    case(
        "CompileOptions cache_dir",
        lambda: cc.CompileOptions(cache_dir=5),
        cc.CompileOptionError,
        "5",
    ),
    # -- runtime --------------------------------------------------------------------------------
    case("measure_reps 0", lambda: CommOptions(measure_reps=0), cc.ConfigError, "got 0"),
    case(
        "algorithm policy", lambda: CommOptions(algorithms="fastest"), cc.ConfigError, "'fastest'"
    ),
    case(
        "algorithm of op",
        lambda: CommOptions(algorithms={"all_reduce": "ring"}),
        cc.ConfigError,
        "'ring'",
    ),
    case(
        "algorithm op",
        lambda: CommOptions(algorithms={"bcast": "native"}),
        cc.ConfigError,
        "'bcast'",
    ),
    case("timeout 0", lambda: CommOptions(timeout=0), cc.ConfigError, "got 0"),
    case("timeout str", lambda: CommOptions(timeout="60"), cc.ConfigError, "'60'"),
    case(
        "keep_buffers_mapped",
        lambda: CommOptions(keep_buffers_mapped="yes"),
        cc.ConfigError,
        "'yes'",
    ),
    case("CommOptions cache_dir", lambda: CommOptions(cache_dir=5), cc.ConfigError, "got 5"),
    case(
        "replace CommOptions",
        lambda: dataclasses.replace(CommOptions(), measure_reps=-1),
        cc.ConfigError,
        "got -1",
    ),
    case(
        "Communicator",
        lambda: Communicator(),
        cc.ConfigError,
        "not initialized",
        marks=no_process_group,
    ),
    case(
        "init backend", lambda: init(backend="mpi"), cc.ConfigError, "'mpi'", marks=no_process_group
    ),
    case("init mesh", lambda: init(mesh=4), cc.ConfigError, "got 4", marks=no_process_group),
    case(
        "init timeout", lambda: init(timeout=-1), cc.ConfigError, "got -1", marks=no_process_group
    ),
    case("spawn 0 ranks", lambda: spawn(print, 0), cc.ConfigError, "got 0"),
    case("spawn str ranks", lambda: spawn(print, "2"), cc.ConfigError, "'2'"),
    case("spawn failures", lambda: spawn(print, 2, failures="ignore"), cc.ConfigError, "'ignore'"),
    case("spawn timeout", lambda: spawn(print, 2, timeout=0), cc.ConfigError, "got 0"),
    case("spawn options", lambda: spawn(print, 2, options={}), cc.ConfigError, "{}"),
    case("check_distributed", lambda: check_distributed(P, INPUTS), cc.ConfigError, "communicator"),
    case("check_schedules", lambda: check_schedules(P, {}, INPUTS), cc.ConfigError, "communicator"),
    case("rank_inputs mesh", lambda: rank_inputs(P, INPUTS, "world", 0), cc.ConfigError, "'world'"),
    case(
        "rank_inputs rank",
        lambda: rank_inputs(P, INPUTS, cc.Mesh(world=2), 5),
        cc.DSLValueError,
        "rank 5",
    ),
    case(
        "rank_inputs per-rank list",
        lambda: rank_inputs(P, {"g": [torch.ones(4)]}, cc.Mesh(world=2), 1),
        cc.SimulationError,
        "1 per-rank values for 2 ranks",
    ),
    # -- the simulator --------------------------------------------------------------------------
    case("simulate str", lambda: cc.simulate("opt", INPUTS, 2), cc.SimulationError, "'opt'"),
    case("simulate inputs", lambda: cc.simulate(P, 5, 2), cc.SimulationError, "int"),
    case(
        "simulate unknown input",
        lambda: cc.simulate(P, {**INPUTS, "zz": 1}, 2),
        cc.SimulationError,
        "['zz']",
    ),
    case(
        "simulate mesh",
        lambda: cc.simulate(TP, {"t": torch.ones(2)}, cc.Mesh(dp=2)),
        cc.SimulationError,
        "['tp']",
    ),
    case("reassociations", lambda: reassociations(P, "opt"), cc.SimulationError, "'opt'"),
]


@pytest.mark.parametrize(("call", "cls", "fragments", "where"), CASES)
def test_bad_call_raises_a_coconet_error_at_the_callers_line(call, cls, fragments, where):
    with pytest.raises(cc.CoconetError) as info:
        call()
    e = info.value
    assert type(e) is cls, f"{type(e).__name__}, not {cls.__name__}: {e}"
    for fragment in fragments:
        assert fragment in e.message, f"{fragment!r} not in the message {e.message!r}"
    assert e.hint, f"no hint:\n{e}"
    assert e.loc is not None, f"no location:\n{e}"
    if where is Where.CALL:
        assert e.loc == SourceLoc(__file__, call.__code__.co_firstlineno), str(e)
    else:
        assert e.loc.filename == __file__, str(e)
    # the rendered message says it all: the op, the location with its source line, the hint
    text = str(e)
    assert text.startswith(f"{e.op}: {e.message}" if e.op else e.message)
    assert f"  at {e.loc}\n" in text and f"  hint: {e.hint}" in text


def test_the_table_covers_every_error_class_a_call_can_raise():
    raised = {c.values[1] for c in CASES}
    assert raised >= {
        cc.DSLError,
        cc.DSLValueError,
        cc.DSLTypeError,
        cc.UnknownNameError,
        cc.ScheduleError,
        cc.CodegenError,
        cc.CompileOptionError,
        cc.ConfigError,
        cc.SimulationError,
    }
    assert len(CASES) >= 100


# ---------------------------------------------------------------------------------------------
# what needs more than one line


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def test_a_step_without_a_communicator_is_a_config_error(tmp_path):
    step = cc.compile(P, world=2, cache_dir=tmp_path, fused_kernels=False)
    with pytest.raises(cc.ConfigError) as info:
        line = _next_line()
        step(**INPUTS)
    e = info.value
    assert type(e) is cc.ConfigError and not isinstance(e, cc.RuntimeFault)
    assert "opt: no communicator" in e.message and e.hint
    assert e.loc == SourceLoc(__file__, line)


@no_process_group
def test_init_without_a_rendezvous_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    options = CommOptions(keep_buffers_mapped=False)  # leave this process's malloc alone
    with pytest.raises(cc.ConfigError) as info:
        line = _next_line()
        init(options=options)
    e = info.value
    assert "WORLD_SIZE=2 but MASTER_ADDR is not set" in e.message and e.hint
    assert e.loc == SourceLoc(__file__, line)
    assert not dist.is_initialized()


@no_process_group
def test_init_when_a_peer_never_joins_is_a_runtime_fault(monkeypatch):
    # torch raises DistStoreError ("1/2 clients joined") after the timeout: a fault of the job.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(cc.RuntimeFault) as info:
        init(options=CommOptions(timeout=1, keep_buffers_mapped=False))
    e = info.value
    assert "rank 0 of 2 could not join" in e.message and "1/2 clients joined" in str(e)
    assert e.hint and not dist.is_initialized()


def test_errors_that_mix_in_a_builtin_are_that_builtin_too():
    with pytest.raises(KeyError) as lookup:
        P.node("nope")
    # str() is the rendered message, not KeyError's repr of it
    assert str(lookup.value).startswith("Program.node: program opt has no value named 'nope'\n")
    with pytest.raises(ValueError):
        cc.Dim("1N")
    with pytest.raises(TypeError):
        cc.Sliced("0")
    assert issubclass(cc.CompileOptionError, cc.ConfigError)
    assert issubclass(cc.CompileOptionError, cc.CodegenError)
    assert not issubclass(cc.ConfigError, cc.RuntimeFault)


def test_algorithm_policies_are_an_enum_and_their_strings():
    from coconet.ir.ops import Op
    from coconet.runtime import Algorithm, AlgorithmPolicy
    from coconet.runtime.torchdist import TorchDistributedTransport

    gloo = TorchDistributedTransport()
    assert CommOptions(algorithms="exact").algorithms is AlgorithmPolicy.EXACT
    assert CommOptions(algorithms=AlgorithmPolicy.EXACT).fixed_algorithm(Op.ALL_REDUCE, gloo) == (
        CommOptions(algorithms="exact").fixed_algorithm(Op.ALL_REDUCE, gloo)
    )
    assert CommOptions(algorithms="exact").fixed_algorithm(Op.REDUCE, gloo) == "all_to_all"
    assert CommOptions(algorithms="auto").fixed_algorithm(Op.REDUCE, gloo) is None
    table = CommOptions(algorithms={"reduce_scatter": "all_to_all"})
    assert table.algorithms == {Op.REDUCE_SCATTER: Algorithm.ALL_TO_ALL}
    assert table.fixed_algorithm(Op.REDUCE_SCATTER, gloo) == "all_to_all"
    assert table.fixed_algorithm(Op.ALL_GATHER, gloo) == "native"


# ---------------------------------------------------------------------------------------------
# the namespace


def test_a_star_import_shadows_no_builtin():
    scope: dict[str, object] = {}
    exec("from coconet import *", scope)  # noqa: S102
    assert not [name for name in scope if name != "__builtins__" and hasattr(builtins, name)]
    assert set(scope) - {"__builtins__"} == set(cc.__all__)
    assert "__version__" not in scope


def test_every_dsl_op_is_in_coconet_ops_and_on_coconet():
    ops = set(dsl.__all__) - {"Tensor", "Scalar"}
    assert set(coconet.ops.__all__) == ops
    for name in ops:
        assert getattr(coconet.ops, name) is getattr(cc, name) is getattr(dsl, name)
    # the builtin-shadowing ones are attributes, not star exports
    for name in ("sum", "max", "abs", "pow", "compile"):
        assert hasattr(cc, name) and name not in cc.__all__
    assert cc.sum is not builtins.sum


def test_everything_in_all_exists():
    assert all(hasattr(cc, name) for name in cc.__all__)
    assert len(cc.__all__) == len(set(cc.__all__))
