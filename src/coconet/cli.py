"""The ``coconet`` command.

- ``coconet print FILE.py:NAME``: print a program;
- ``coconet show FILE.py:NAME [--schedule S [--state m,v]] [--world N | --mesh pp=2,tp=2]``:
  print the code generated for it, and the collective algorithms measured on this machine;
  with ``--timeline step.png --size N=1048576`` also run it on local ranks and draw its timeline;
- ``coconet run --nproc N SCRIPT [args]``: run a script as N local ranks (gloo on CPU); with
  ``--nnodes`` it hands over to torchrun's rendezvous;
- ``coconet calibrate --nproc N``: measure the collective algorithms once, for every size class;
- ``coconet tune FILE.py:NAME --nproc N --size N=16777216 [--json out.json]``: choose the
  program's schedule and transport by prediction and measurement, and explain the choice;
- ``coconet plan FILE.py:NAME --cluster dgx-a100-ib --world 64``: predicted step times at world
  sizes that cannot be run here, from a cluster description;
- ``coconet trace merge DIR -o step.json [--png step.png] [--per-step]``, ``coconet trace
  plot``: the ranks' traces (``COCONET_TRACE=DIR``) on one timeline, who waited on whom, each
  collective's exposed and hidden time; ``coconet trace why DIR``: who stopped where,
  from the flight recorder's dumps.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import subprocess
import sys
import time
from typing import Any

from coconet import schedule as schedules
from coconet.cache import keyed_cache_dir
from coconet.compiler import compile
from coconet.errors import CoconetError
from coconet.ir.mesh import Mesh
from coconet.ir.program import Program
from coconet.options import TransportKind
from coconet.progress import phase
from coconet.runtime.algorithm_choice import choose_all_locally
from coconet.runtime.allocator import rank_environment
from coconet.runtime.launch import run_script
from coconet.runtime.tuning import AlgorithmTable
from coconet.version import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(
        prog="coconet",
        description="coconet: a DSL, compiler and runtime for distributed ML programs in which "
        "computation and communication are both first-class operations.",
    )
    p.add_argument("--version", action="version", version=f"coconet {__version__}")
    p.set_defaults(func=_no_command)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pr = sub.add_parser(
        "print",
        help="print a program defined in a Python file",
        description="Print the program NAME of a Python file (or module) in coconet's text form: "
        "its inputs with their types and layouts, one line per op, its outputs and updates. "
        "Nothing is compiled or run. Example: coconet print examples/adam.py:program",
    )
    pr.add_argument("target", help=_TARGET_HELP)
    pr.set_defaults(func=_print)

    sh = sub.add_parser(
        "show",
        help="print the code generated for a program and schedule",
        description="Print the per-rank Python module that coconet.compile generates for the "
        "program NAME (with --schedule, for that schedule of it) on --world ranks or a --mesh: "
        "one line and one comment per DSL op, the collectives' start/wait, the fused kernels' "
        "members; then the collective algorithms measured on this machine. Nothing runs, "
        "unless --timeline: then the step runs on --world local ranks at --size, and its "
        "timeline is drawn. "
        "Example: coconet show examples/adam.py:program --schedule fuse_RS_C_AG --world 2",
    )
    sh.add_argument("target", help=_TARGET_HELP)
    sh.add_argument(
        "--schedule",
        help="a schedule by name: from the module's SCHEDULES dict, a function of the module, "
        "or coconet.schedule (e.g. RS_C_AG), applied to the program",
    )
    sh.add_argument(
        "--state",
        help="for coconet.schedule's RS_C_AG and fuse_RS_C_AG: the optimizer state to store "
        "sliced, comma separated (e.g. m,v), as state= in Python",
    )
    world = sh.add_mutually_exclusive_group()
    world.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    world.add_argument("--mesh", help="a mesh with named axes, e.g. pp=2,tp=2")
    sh.add_argument("--cache-dir", help="where measured collective choices are kept "
                    f"(default {keyed_cache_dir(None)})")
    sh.add_argument(
        "--transport",
        choices=[t.value for t in TransportKind],
        default=TransportKind.TORCH_DISTRIBUTED.value,
        help="what runs the collectives: torch.distributed (the default; across hosts) or "
        "'shared memory' (what ranks on one host use: fused collectives as one pass)",
    )
    sh.add_argument("--timeline", metavar="PNG",
                    help="also run the step on --world local ranks (random inputs at --size; "
                    "two steps to warm up, then --steps traced) and draw its per-rank "
                    "timeline here, with where each rank's time went and each collective's "
                    "exposed and hidden time (needs matplotlib)")  # fmt: skip
    sh.add_argument("--size", action="append", default=[], metavar="DIM=N",
                    help="with --timeline: the size of a Dim, e.g. N=1048576 (repeatable)")
    sh.add_argument("--steps", type=int, default=3,
                    help="with --timeline: the steps traced (default 3)")
    sh.add_argument("--predicted", metavar="TUNE.json",
                    help="with --timeline: a 'coconet tune --json' file: its winner's predicted "
                    "time of each collective beside the measured one")  # fmt: skip
    sh.set_defaults(func=_show)

    rn = sub.add_parser(
        "run",
        help="run a script as N ranks (the script calls coconet.runtime.init())",
        description="Run SCRIPT as --nproc local ranks with torchrun's environment variables set "
        "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). With --nnodes > 1, hand over "
        "to torchrun (c10d rendezvous at --rdzv-endpoint); start one such command per node.",
    )
    rn.add_argument("--nproc", type=int, default=2, help="ranks on this node (default 2)")
    rn.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    rn.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, for --nnodes > 1")
    rn.add_argument("--rdzv-id", default="coconet", help="job id for the rendezvous")
    rn.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name")
    rn.add_argument("script", help="the Python file (or module, with -m) to run")
    rn.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rn.set_defaults(func=_run)

    ca = sub.add_parser(
        "calibrate",
        help="measure the collective algorithms on this machine",
        description="Start --nproc local ranks and time each way torch.distributed can run each "
        "collective (gloo's own reduce_scatter and all_gather, or through all_reduce or "
        "all_to_all, ...) for every size class, keep the fastest of each, and print the table. "
        "The runtime otherwise measures a size class the first time a step needs it; this does "
        "it all up front. The choices are kept per (op, size class, backend, group size) in the "
        "cache folder; --force measures again what is already known. (The tuner's cost model "
        "is calibrated by coconet tune itself: see its --recalibrate.)",
    )
    ca.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ca.add_argument("--classes", help="size classes, comma separated (default: all)")
    ca.add_argument("--cache-dir", help="where to keep the choices (default "
                    f"{keyed_cache_dir(None)}: $XDG_CACHE_HOME/coconet, else ~/.cache/coconet, "
                    "then a folder per torch version and CPU)")
    ca.add_argument("--force", action="store_true", help="measure again what is already known")
    ca.set_defaults(func=_calibrate)

    tu = sub.add_parser(
        "tune",
        help="choose a program's schedule and transport by prediction and measurement",
        description="Enumerate the legal schedules of the program on every transport the ranks "
        "can use, predict each with the cost model (calibrated once per machine and cached), "
        "measure the best predicted and the unscheduled program on --nproc local ranks, and "
        "print the table with the winner and why. The result is cached: the same command again "
        "reads it; --retune measures the candidates again, --recalibrate the cost model too. "
        "Example: coconet tune examples/adam.py:program --nproc 2 --size N=1048576",
    )
    tu.add_argument("target", help=_TARGET_HELP)
    _size_args(tu)
    tu.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    tu.add_argument("--top", type=int, default=4, help="measure the N best predicted (default 4)")
    tu.add_argument("--all", action="store_true", help="measure every candidate")
    tu.add_argument("--reps", type=int, default=7, help="timed steps per candidate (default 7)")
    tu.add_argument("--rematch-within", type=float, default=0.5, metavar="FRACTION",
                    help="time the two best again, their steps interleaved, when the runner-up "
                    "is within this fraction of the winner (default 0.5; 0: never)")
    tu.add_argument("--donate", help="inputs the step may overwrite, comma separated (e.g. g)")
    tu.add_argument("--commit", choices=["copy", "swap"], default="copy",
                    help="how updates are committed (CompileOptions.commit; default copy)")
    tu.add_argument("--eager", action="store_true", help="no torch.compile (fused_kernels=False)")
    tu.add_argument("--scalar", action="append", default=[], metavar="NAME=VALUE",
                    help="a scalar's value while measuring (default 0.5 for each)")
    tu.add_argument("--json", help="write the candidates and the winner to this file")
    tu.add_argument("--retune", action="store_true",
                    help="ignore a cached result for this program, sizes and settings: measure "
                    "the candidates again (the cost model's calibration is kept: "
                    "--recalibrate)")
    tu.add_argument("--recalibrate", action="store_true",
                    help="calibrate the cost model again on this machine before predicting (it "
                    "is calibrated once and cached; one taken while other jobs loaded the "
                    "machine predicts badly on a quiet one, and the reverse); implies --retune")
    tu.add_argument("--cache-dir", help="where the calibration and results are kept (default "
                    f"{keyed_cache_dir(None)})")
    tu.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds the whole tuning may take (default 1800)")
    tu.set_defaults(func=_tune)

    pl = sub.add_parser(
        "plan",
        help="predicted step times at world sizes beyond this machine, from a cluster description",
        description="Predict each schedule's step time for the program NAME at world sizes this "
        "machine cannot run, from a cluster description (ranks per node, intra- and inter-node "
        "bandwidth and latency, memory bandwidth, peak flops): the cost model of coconet tune, "
        "without measuring anything. Predicted, not measured. Example: coconet plan "
        "examples/adam.py:program --cluster dgx-a100-ib --size N=334000000 --world 8",
    )
    pl.add_argument("target", help=_TARGET_HELP)
    _size_args(pl)
    pl.add_argument("--cluster", default="dgx-a100-ib",
                    help="a cluster description: a JSON file, or dgx-a100-ib / cpu-2core "
                    "(default dgx-a100-ib)")
    pl.add_argument("--world", type=int, action="append",
                    help="world size(s) to predict (repeatable; default 8,16,32,64,128,256)")
    pl.add_argument("--json", help="write the table to this file")
    pl.set_defaults(func=_plan)

    tr = sub.add_parser(
        "trace",
        help="merge the ranks' traces into one timeline, plot one, read a failure's dumps",
        description="Record with COCONET_TRACE=DIR (or coconet.trace.record(DIR) in the "
        "script): each rank writes DIR/rank<r>.trace.json. 'coconet trace merge DIR -o "
        "step.json' puts them on one clock, a track per rank (open it at ui.perfetto.dev), and "
        "prints where each rank's time went and each collective's exposed and hidden time; "
        "'coconet trace plot step.json -o step.png' draws it; 'coconet trace why DIR' reads "
        "the flight recorder's dumps of a failed job.",
    )
    trs = tr.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    tm = trs.add_parser("merge", help="merge DIR's rank traces into one file")
    tm.add_argument("directory", help="the folder the ranks wrote their traces to")
    tm.add_argument("-o", "--out", default=None,
                    help="the merged trace (default DIR/merged.trace.json)")
    tm.add_argument("--png", help="also draw it as a PNG here (needs matplotlib)")
    tm.add_argument("--predicted", metavar="TUNE.json",
                    help="a 'coconet tune --json' file: its winner's predicted time of each "
                    "collective beside the measured one")  # fmt: skip
    tm.add_argument("--per-step", action="store_true",
                    help="the overlap report per step too (each rank's outermost spans: "
                    "compiled steps, optimizer steps, layer calls, pipeline actions)")
    tm.set_defaults(func=_trace_merge)
    tp = trs.add_parser("plot", help="draw a trace (merged or one rank's) as a PNG")
    tp.add_argument("trace", help="a trace file")
    tp.add_argument("-o", "--out", required=True, help="the PNG to write")
    tp.set_defaults(func=_trace_plot)
    tw = trs.add_parser("why", help="who stopped where: read the flight recorder's dumps",
                        description="Read the rank<r>.flight.json dumps that failing ranks wrote "
                        "(the folder their error names; $COCONET_FLIGHT_DIR sets it) and say, "
                        "per communicator, each rank's last call and which ranks had not "
                        "reached the call the others stopped in.")  # fmt: skip
    tw.add_argument("directory", help="the folder of the dumps")
    tw.set_defaults(func=_trace_why)
    return p


def _size_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", action="append", default=[], metavar="DIM=N",
                   help="the size of a Dim, e.g. N=16777216 (repeatable; or N=1024,M=64)")
    p.add_argument("--state", help="inputs the schedules may store sliced, comma separated "
                   "(default: the module's STATE tuple, if it has one)")


_TARGET_HELP = (
    "FILE.py:NAME or package.module:NAME, where NAME is a Program, a Schedule, or a function "
    "returning one"
)


# -- loading programs ---------------------------------------------------------------------------


def _namespace(target: str) -> tuple[dict[str, Any], str]:
    import runpy

    path, _, attr = target.rpartition(":")
    if not path or not attr:
        raise SystemExit(f"coconet: expected FILE.py:NAME or module:NAME, got {target!r}")
    if path.endswith(".py") or os.path.exists(path):
        if not os.path.isfile(path):
            raise SystemExit(
                f"coconet: no such file: {path} (from {target!r}; expected FILE.py:NAME, e.g. "
                "examples/adam.py:program)"
            )
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        try:
            namespace = runpy.run_path(path, run_name="coconet_target")
        except (CoconetError, SystemExit, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - the user's module failed: say where, briefly
            raise SystemExit(f"coconet: loading {path} raised {_where(e, path)}") from None
    else:
        try:
            namespace = vars(importlib.import_module(path))
        except ImportError as e:
            raise SystemExit(f"coconet: cannot import {path!r}: {e}") from None
    if attr not in namespace:
        raise SystemExit(f"coconet: {path} defines no {attr!r}")
    return namespace, attr


def _where(exc: BaseException, path: str) -> str:
    """``exc`` in one line, at the innermost line of ``path`` in its traceback."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]  # fmt: skip
    at = f" at {path}:{frames[-1].lineno}" if frames else ""
    if isinstance(exc, SyntaxError) and exc.lineno:
        at = f" at {path}:{exc.lineno}"
    return f"{type(exc).__name__}: {exc}{at}"


def _load(target: str):

    namespace, attr = _namespace(target)
    obj = namespace[attr]
    if callable(obj) and not isinstance(obj, Program):
        obj = obj()
    if not isinstance(obj, Program) and not isinstance(getattr(obj, "program", None), Program):
        raise SystemExit(f"coconet: {target} is a {type(obj).__name__}, not a Program")
    return obj, namespace


def _schedule(program, name: str, namespace: dict[str, Any], state: str | None = None):

    table = namespace.get("SCHEDULES", {})
    found = table.get(name) if isinstance(table, dict) else None
    if found is None and callable(namespace.get(name)):
        found = namespace[name]
    library = False
    if found is None and name in getattr(schedules, "__all__", ()):
        found, library = getattr(schedules, name), True
    if found is None:
        known = sorted(table) if isinstance(table, dict) else []
        raise SystemExit(
            f"coconet: no schedule named {name!r} (the module's SCHEDULES: "
            f"{', '.join(known) or 'none'}; coconet.schedule's: {', '.join(_library_schedules())})"
        )
    takes_state = library and "state" in inspect.signature(found).parameters
    if state is not None:
        if not takes_state:
            why = (
                "takes no state"
                if library
                else "comes from the module's SCHEDULES, which already says which state it "
                "slices"
            )
            raise SystemExit(
                f"coconet: --state is for coconet.schedule's RS_C_AG and fuse_RS_C_AG; "
                f"{name!r} {why}: drop --state {state} to use it as the "
                f"module defines it (or give a schedule of coconet.schedule's with --state)"
            )
        return found(program, state=tuple(s.strip() for s in state.split(",") if s.strip()))
    if takes_state:
        # The module's own schedules say which state they slice; the library's cannot know.
        print(
            f"coconet: note: {name} from coconet.schedule, applied with no optimizer state "
            "stored sliced (state=()); if your step uses state=(...), pass --state to see its "
            "code",
            file=sys.stderr,
        )
    return found(program) if callable(found) else found


def _library_schedules() -> list[str]:
    """The names in coconet.schedule that are schedules (functions of a program), not the
    primitives' check_/apply_ functions or the classes."""
    names = getattr(schedules, "__all__", ())
    return [n for n in names if inspect.isfunction(getattr(schedules, n, None))
            and not n.startswith(("apply_", "check_"))]  # fmt: skip


def _mesh(args):

    if not args.mesh:
        return args.world
    try:
        axes = {k.strip(): int(v) for k, v in (a.split("=") for a in args.mesh.split(","))}
    except ValueError:
        raise SystemExit(f"coconet: --mesh takes axis=size pairs, got {args.mesh!r}") from None
    return Mesh(axes)


# -- commands -----------------------------------------------------------------------------------


def _no_command(args) -> int:
    _parser().print_help(sys.stderr)
    print("\ncoconet: error: give a command (print, show, run, calibrate, tune, plan)",
          file=sys.stderr)  # fmt: skip
    return 2


def _print(args) -> int:
    obj, _ = _load(args.target)
    print(obj)
    return 0


def _show(args) -> int:

    obj, namespace = _load(args.target)
    if args.schedule:
        program = getattr(obj, "original", None) or getattr(obj, "program", obj)
        obj = _schedule(program, args.schedule, namespace, args.state)
    elif args.state:
        raise SystemExit("coconet: --state needs --schedule RS_C_AG or fuse_RS_C_AG")
    if not args.timeline and (args.size or args.predicted):
        raise SystemExit("coconet show: --size and --predicted go with --timeline PNG (without "
                         "it nothing runs)")  # fmt: skip
    world = _mesh(args)
    step = compile(obj, world=world, cache_dir=args.cache_dir, transport=args.transport)
    print(step.source, end="")
    table = AlgorithmTable.load(keyed_cache_dir(args.cache_dir))
    print()
    for line in table.format("gloo").splitlines():
        print(f"# {line}")
    if args.timeline:
        _timeline(args)
    return 0


def _timeline(args) -> None:
    """``coconet show --timeline``: the step run and traced on local ranks, merged and drawn."""
    import tempfile

    from coconet import trace
    from coconet.options import CommOptions
    from coconet.runtime.launch import spawn

    sizes = _sizes(args.size)
    predicted = trace.predictions(args.predicted) if args.predicted else None  # read first
    if args.steps < 1:
        raise SystemExit(f"coconet show: --steps must be at least 1, got {args.steps}")
    world = _mesh(args)
    with tempfile.TemporaryDirectory(prefix="coconet-timeline-") as folder:
        with phase(f"coconet show: {args.world if args.mesh is None else args.mesh} ranks run "
                   f"{args.target} for a timeline", why="compiling the step, 2 warm-up steps, "
                   f"then {args.steps} traced", file=sys.stderr):  # fmt: skip
            spawn(_timeline_worker, world, args.target, args.schedule, args.state, sizes,
                  args.steps, folder, options=CommOptions(cache_dir=args.cache_dir,
                                                          transport=args.transport),
                  timeout=600)  # fmt: skip
        merged = trace.merge(folder)
    print()
    print(trace.summary(merged))
    print("\neach collective's time in flight, exposed (the rank waited in it) and hidden "
          "(the rank computed meanwhile), per traced step:")
    print(trace.format_overlap(trace.overlap(merged, per_step=True), predicted))
    title = f"{args.target}" + (f" ({args.schedule})" if args.schedule else "")
    print(f"\ntimeline drawn to {trace.plot(merged, args.timeline, title=title)}")


def _timeline_worker(comm, target: str, schedule: str | None, state: str | None,
                     sizes: dict[str, int], steps: int, folder: str) -> None:  # fmt: skip
    from coconet import trace
    from coconet.compiler import resolve_target
    from coconet.tune.measure import program_inputs

    obj, namespace = _load(target)
    if schedule:
        obj = _schedule(getattr(obj, "original", None) or getattr(obj, "program", obj),
                        schedule, namespace, state)  # fmt: skip
    step = compile(obj, comm=comm)
    inputs = program_inputs(resolve_target(obj)[0], sizes, comm, {}, seed=1234)
    for _ in range(2):  # the first call compiles its kernels and rehearses; the second settles
        step(**inputs)
    with trace.record(folder, comm=comm):
        for _ in range(steps):
            step(**inputs)


def _run(args) -> int:

    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.nproc < 1:
        raise SystemExit(f"coconet run: --nproc must be at least 1, got {args.nproc}")
    if args.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(args.script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise SystemExit(f"coconet run: no module named {args.script!r} (with -m, SCRIPT is "
                             "a module name on sys.path)")  # fmt: skip
    elif not os.path.isfile(args.script):
        raise SystemExit(f"coconet run: no such file: {args.script} (nothing was started)")
    if args.nnodes > 1:
        if not args.rdzv_endpoint:
            raise SystemExit("coconet run: --nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={args.nnodes}",
            f"--nproc-per-node={args.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
            *(["-m"] if args.module else []),
            args.script,
            *script_args,
        ]
        print(f"coconet run: node of a {args.nnodes}-node job, {args.nproc} rank(s) here, "
              f"rendezvous at {args.rdzv_endpoint} (every node runs this command)",
              file=sys.stderr, flush=True)  # fmt: skip
        return _forward(cmd, rank_environment(os.environ),  # glibc's tcache off
                        f"the rendezvous at {args.rdzv_endpoint} and the ranks' start")
    # said at once: the ranks' own first lines come after Python and torch start in each
    print(f"coconet run: {args.nproc} local rank(s) of {args.script}", file=sys.stderr, flush=True)
    return run_script([args.script, *script_args], args.nproc, module=args.module)


def _forward(cmd: list[str], env: dict[str, str], waiting_for: str) -> int:
    """Run ``cmd`` with its standard output passed on line by line; while it has printed
    nothing for ``progress.EVERY_S`` seconds, say on stderr what it is waiting for (a rendezvous
    waits for every node; a silent wait looks like a hang)."""
    import threading

    from coconet.progress import EVERY_S

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    began = last = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        nonlocal last
        while not done.wait(1.0):
            if time.monotonic() - last >= EVERY_S:
                last = time.monotonic()
                print(f"coconet run: ... waiting for {waiting_for}: "
                      f"{last - began:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    threading.Thread(target=beat, daemon=True).start()
    try:
        for line in proc.stdout:
            last = time.monotonic()
            sys.stdout.write(line)
            sys.stdout.flush()
        return proc.wait()
    except KeyboardInterrupt:  # torchrun got the signal too (same process group): let it end
        return proc.wait()
    finally:
        done.set()


def _calibrate(args) -> int:

    classes = args.classes.split(",") if args.classes else None
    with phase(f"coconet calibrate: {args.nproc} ranks time every collective algorithm per size "
               "class", why="1-3 minutes the first time; known classes are read back",
               file=sys.stderr):  # fmt: skip
        table = choose_all_locally(args.nproc, classes, args.cache_dir, force=args.force)
    print(table)
    return 0


def _sizes(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        for part in item.split(","):
            name, eq, value = part.partition("=")
            try:
                out[name.strip()] = int(value.replace("_", ""))
            except ValueError:
                eq = ""
            if not eq or not name.strip():
                raise SystemExit(f"coconet: --size takes DIM=N (e.g. N=16777216), got {part!r}")
    return out


def _state(args, namespace: dict[str, Any]) -> tuple[str, ...]:
    if args.state is not None:
        return tuple(s.strip() for s in args.state.split(",") if s.strip())
    state = namespace.get("STATE", ())
    return tuple(state) if isinstance(state, (tuple, list)) else ()


def _program_of(obj) -> Program:
    if isinstance(obj, Program):
        return obj
    return getattr(obj, "original", None) or obj.program


def _tune_worker(comm, target: str, sizes, settings: dict) -> tuple[str, dict] | None:
    import torch

    from coconet.options import CompileOptions
    from coconet.tune import tune

    torch.set_num_threads(settings.pop("threads"))
    obj, namespace = _load(target)
    options = CompileOptions(**settings.pop("compile"))
    result = tune(_program_of(obj), comm, sizes, options=options, progress=comm.rank == 0,
                  **settings)
    return (result.explain(), result.to_json(), result.seconds) if comm.rank == 0 else None


def _tune(args) -> int:
    import json

    from coconet.options import CommOptions
    from coconet.runtime.launch import spawn

    sizes = _sizes(args.size)
    obj, namespace = _load(args.target)  # errors here, before any process starts
    if not sizes:
        raise SystemExit("coconet tune: give the sizes to tune for, e.g. --size N=16777216")
    if not 0 <= args.rematch_within < float("inf"):
        raise SystemExit(
            f"coconet tune: --rematch-within takes a fraction >= 0, got {args.rematch_within}"
        )
    scalars = {}
    for item in args.scalar:
        name, _, value = item.partition("=")
        try:
            scalars[name.strip()] = float(value)
        except ValueError:
            raise SystemExit(f"coconet tune: --scalar takes NAME=VALUE, got {item!r}") from None
    settings = {
        "threads": 1,
        "compile": {
            "fused_kernels": not args.eager,
            "donate": tuple(d.strip() for d in (args.donate or "").split(",") if d.strip()),
            "commit": args.commit,
            "cache_dir": args.cache_dir,
        },
        "state": _state(args, namespace),
        "scalars": scalars,
        "top": args.top,
        "measure_all": args.all,
        "reps": args.reps,
        "rematch_within": args.rematch_within,
        "retune": args.retune or args.recalibrate,
        "recalibrate": args.recalibrate,
    }
    options = CommOptions(cache_dir=args.cache_dir)
    began = time.perf_counter()
    with phase(f"coconet tune: {args.nproc} ranks tune {args.target} for "
               + ", ".join(f"{k}={v:,}" for k, v in sizes.items()),
               why="the ranks report each phase below", file=sys.stderr):  # fmt: skip
        text, doc, seconds = spawn(_tune_worker, args.nproc, args.target, sizes, settings,
                                   options=options, timeout=args.timeout)[0]
    print(text)
    # a cached result is read in about a second; the rest is starting the ranks (Python, torch)
    print(f"\n({args.nproc} ranks started, tuned and stopped in "
          f"{time.perf_counter() - began:.1f} s; the tuning itself took {seconds:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nJSON written to {args.json}")
    return 0


def _plan(args) -> int:
    import json

    from coconet.tune.cluster import load_description
    from coconet.tune.cluster_plan import plan

    obj, namespace = _load(args.target)
    sizes = _sizes(args.size)
    if not sizes:
        raise SystemExit("coconet plan: give the sizes, e.g. --size N=334000000 (BERT-large)")
    worlds = args.world or [8, 16, 32, 64, 128, 256]
    if any(w < 1 for w in worlds):
        raise SystemExit(f"coconet plan: world sizes must be >= 1, got {worlds}")
    table = plan(_program_of(obj), sizes, load_description(args.cluster), worlds,
                 state=_state(args, namespace))
    print(table.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table.to_json(), f, indent=1)
        print(f"\nJSON written to {args.json}")
    return 0


def _trace_merge(args) -> int:
    from coconet import trace

    out = args.out or os.path.join(args.directory, "merged.trace.json")
    merged = trace.merge(args.directory, out)
    print(trace.summary(merged))
    print("\neach collective's time in flight, exposed (the rank waited in it) and hidden "
          "(the rank computed meanwhile):")
    predicted = trace.predictions(args.predicted) if args.predicted else None
    print(trace.format_overlap(trace.overlap(merged), predicted))
    if args.per_step:
        print("\nper step (each rank's n-th outermost span):")
        print(trace.format_overlap(trace.overlap(merged, per_step=True), predicted))
    print(f"\nmerged trace written to {out} (open it at https://ui.perfetto.dev)")
    if args.png:
        print(f"timeline drawn to {trace.plot(merged, args.png)}")
    return 0


def _trace_plot(args) -> int:
    from coconet import trace

    print(f"timeline drawn to {trace.plot(args.trace, args.out)}")
    return 0


def _trace_why(args) -> int:
    from coconet.runtime.flight import verdict

    print(verdict(args.directory))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `coconet show ... | head`: the reader left; that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CoconetError as e:  # a clear message, not a traceback: it names the op and the line
        name = f"coconet {args.command}" if getattr(args, "command", None) else "coconet"
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
