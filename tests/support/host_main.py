"""A rank of a namespace-hosts job (``support.hosts.Hosts.run``): ``host_main.py MODULE:FUNCTION
WORKDIR`` joins torchrun's job, calls ``MODULE.FUNCTION(comm, *args)`` (the arguments pickled in
WORKDIR/args.pkl; MODULE importable from tests/ or the job's ``path``) and writes what it
returned, or the exception it raised (its traceback as a note), to WORKDIR/rank<R>.pkl."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from pathlib import Path

from coconet import runtime
from coconet.runtime import CommOptions


def main() -> None:
    target, work = sys.argv[1], Path(sys.argv[2])
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    args = pickle.loads((work / "args.pkl").read_bytes())
    timeout = float(os.environ.get("COCONET_HOSTS_TIMEOUT", "60"))
    comm = runtime.init(options=CommOptions(timeout=timeout))
    rank = comm.rank
    try:
        result = fn(comm, *args)
    except Exception as exc:  # Hosts.run raises it, with this traceback, for the caller
        exc.add_note(traceback.format_exc())  # notes travel in the pickle, tracebacks do not
        traceback.print_exc()  # and into the host's log
        result = exc
    try:
        data = pickle.dumps(result)
    except Exception as exc:  # an unpicklable result: its text
        data = pickle.dumps(f"{type(result).__name__}: {result} (not picklable: {exc})")
    (work / f"rank{rank}.pkl").write_bytes(data)
    runtime.shutdown(comm)


if __name__ == "__main__":
    main()
