"""The ``coconet`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from coconet import __version__

    p = argparse.ArgumentParser(
        prog="coconet",
        description="coconet: a DSL, compiler and runtime for distributed ML programs in which "
        "computation and communication are both first-class operations.",
    )
    p.add_argument("--version", action="version", version=f"coconet {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    pr = sub.add_parser("print", help="print a program defined in a Python file")
    pr.add_argument(
        "target",
        help="FILE.py:NAME, where NAME is a Program (or a function returning one) in FILE.py",
    )
    return p


def _load(target: str):
    import runpy

    from coconet.ir.program import Program

    path, _, attr = target.rpartition(":")
    if not path or not attr:
        raise SystemExit(f"coconet: expected FILE.py:NAME, got {target!r}")
    namespace = runpy.run_path(path, run_name="coconet_target")
    if attr not in namespace:
        raise SystemExit(f"coconet: {path} defines no {attr!r}")
    obj = namespace[attr]
    if callable(obj) and not isinstance(obj, Program):
        obj = obj()
    if not isinstance(obj, Program):
        raise SystemExit(f"coconet: {target} is a {type(obj).__name__}, not a Program")
    return obj


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 0
    if args.command == "print":
        print(_load(args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
