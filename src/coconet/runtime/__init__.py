"""The runtime: communicators over torch.distributed, compiled steps, launching and checking.

In a rank::

    comm = coconet.runtime.init()          # torchrun's environment, or `coconet run --nproc N`
    step = coconet.compile(program)        # see coconet.compiler
    outputs = step(**inputs)
    coconet.runtime.shutdown(exit_code=0)

From Python, ``spawn(fn, nproc, *args)`` runs ``fn(comm, *args)`` on local ranks;
``check_distributed`` compares a distributed step with the simulator.
"""

from coconet.runtime.check import (
    CheckReport,
    check_distributed,
    check_schedules,
    rank_inputs,
    run_distributed,
)
from coconet.runtime.comm import AlgorithmPolicy, CommOptions, Communicator, Work
from coconet.runtime.launch import RankFailure, current, init, run_script, shutdown, spawn
from coconet.runtime.step import CompiledStep
from coconet.runtime.tuning import AlgorithmTable, default_cache_dir

__all__ = [
    "AlgorithmPolicy",
    "AlgorithmTable",
    "CheckReport",
    "CommOptions",
    "CompiledStep",
    "Communicator",
    "RankFailure",
    "Work",
    "check_distributed",
    "check_schedules",
    "current",
    "default_cache_dir",
    "init",
    "rank_inputs",
    "run_distributed",
    "run_script",
    "shutdown",
    "spawn",
]
