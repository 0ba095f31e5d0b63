"""The ``coconet`` command.

- ``coconet print FILE.py:NAME``: print a program;
- ``coconet show FILE.py:NAME [--schedule S [--state m,v]] [--world N | --mesh pp=2,tp=2]``:
  print the code generated for it, and the collective algorithms measured on this machine;
- ``coconet run --nproc N SCRIPT [args]``: run a script as N local ranks (gloo on CPU); with
  ``--nnodes`` it hands over to torchrun's rendezvous;
- ``coconet calibrate --nproc N``: measure the collective algorithms once, for every size class.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import subprocess
import sys
from typing import Any

from coconet import schedule as schedules
from coconet.cache import keyed_cache_dir
from coconet.compiler import compile
from coconet.ir.mesh import Mesh
from coconet.ir.program import Program
from coconet.runtime.calibrate import calibrate_local
from coconet.runtime.launch import run_script
from coconet.runtime.transport import TransportKind
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
    p.set_defaults(func=lambda args: (_parser().print_help(), 0)[1])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pr = sub.add_parser("print", help="print a program defined in a Python file")
    pr.add_argument("target", help=_TARGET_HELP)
    pr.set_defaults(func=_print)

    sh = sub.add_parser("show", help="print the code generated for a program and schedule")
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
    sh.add_argument("--cache-dir", help="where measured collective choices are kept")
    sh.add_argument(
        "--transport",
        choices=[t.value for t in TransportKind],
        default=TransportKind.TORCH_DISTRIBUTED.value,
        help="what runs the collectives: torch.distributed (the default; across hosts) or "
        "'shared memory' (what ranks on one host use: fused collectives as one pass)",
    )
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

    ca = sub.add_parser("calibrate", help="measure the collective algorithms on this machine")
    ca.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ca.add_argument("--classes", help="size classes, comma separated (default: all)")
    ca.add_argument("--cache-dir", help="where to keep the choices (default ~/.cache/coconet)")
    ca.add_argument("--force", action="store_true", help="measure again what is already known")
    ca.set_defaults(func=_calibrate)
    return p


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
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        namespace = runpy.run_path(path, run_name="coconet_target")
    else:
        try:
            namespace = vars(importlib.import_module(path))
        except ImportError as e:
            raise SystemExit(f"coconet: cannot import {path!r}: {e}") from None
    if attr not in namespace:
        raise SystemExit(f"coconet: {path} defines no {attr!r}")
    return namespace, attr


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
            f"coconet: no schedule named {name!r} (module SCHEDULES: {known}; or one of "
            f"coconet.schedule's: {', '.join(getattr(schedules, '__all__', ()))})"
        )
    takes_state = library and "state" in inspect.signature(found).parameters
    if state is not None:
        if not takes_state:
            raise SystemExit(
                f"coconet: --state is for coconet.schedule's RS_C_AG and fuse_RS_C_AG; "
                f"{name!r} {'takes no state' if library else 'comes from the module'}"
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


def _mesh(args):

    if not args.mesh:
        return args.world
    try:
        axes = {k.strip(): int(v) for k, v in (a.split("=") for a in args.mesh.split(","))}
    except ValueError:
        raise SystemExit(f"coconet: --mesh takes axis=size pairs, got {args.mesh!r}") from None
    return Mesh(axes)


# -- commands -----------------------------------------------------------------------------------


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
    world = _mesh(args)
    step = compile(obj, world=world, cache_dir=args.cache_dir, transport=args.transport)
    print(step.source, end="")
    table = AlgorithmTable.load(keyed_cache_dir(args.cache_dir))
    print()
    for line in table.format("gloo").splitlines():
        print(f"# {line}")
    return 0


def _run(args) -> int:

    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
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
        return subprocess.call(cmd)
    return run_script([args.script, *script_args], args.nproc, module=args.module)


def _calibrate(args) -> int:

    classes = args.classes.split(",") if args.classes else None
    print(calibrate_local(args.nproc, classes, args.cache_dir, force=args.force))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `coconet show ... | head`: the reader left; that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
