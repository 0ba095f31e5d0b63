"""The runtime: communicators and their transports, compiled steps, launching.

In a rank::

    comm = coconet.runtime.init()              # torchrun's environment, or `coconet run --nproc N`
    step = coconet.compile(program, comm=comm)  # see coconet.compiler
    outputs = step(**inputs)
    coconet.runtime.shutdown(comm, exit_code=0)

From Python, ``spawn(fn, nproc, *args)`` runs ``fn(comm, *args)`` on local ranks. The harness
that compares a distributed step with the simulator is ``coconet.testing``.
"""

from coconet.options import Algorithm, AlgorithmPolicy, CommOptions, TransportKind
from coconet.runtime.comm import Communicator, Work
from coconet.runtime.launch import RankFailure, current, init, run_script, shutdown, spawn
from coconet.runtime.step import CompiledStep
from coconet.runtime.transport import Transport
from coconet.runtime.tuning import AlgorithmTable, TuningKey, default_cache_dir

__all__ = [
    "Algorithm",
    "AlgorithmPolicy",
    "AlgorithmTable",
    "CommOptions",
    "CompiledStep",
    "Communicator",
    "RankFailure",
    "Transport",
    "TransportKind",
    "TuningKey",
    "Work",
    "current",
    "default_cache_dir",
    "init",
    "run_script",
    "shutdown",
    "spawn",
]
