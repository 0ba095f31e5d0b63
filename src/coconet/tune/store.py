"""The tuner's cache: calibrated machine models and tuning results, as JSON files.

They live under ``<cache_dir>/<build key>/tune`` (``coconet.cache.keyed_cache_dir``: another
torch, coconet or CPU never reads them). A result is keyed by everything that changes what the
tuner would find: the program's digest, the sizes, the mesh, the transports, the backend and
device, the torch and coconet versions (through the build key and explicitly), how many hosts the
ranks span and the tuner's settings (compile options, how many candidates are measured). Rank 0
reads and writes the files; every rank gets rank 0's copy, so all of them agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from coconet.cache import keyed_cache_dir
from coconet.ir.program import Program
from coconet.options import TransportKind
from coconet.runtime.comm import Communicator
from coconet.version import __version__

__all__ = ["load_machine", "load_result", "result_key", "save_machine", "save_result"]


def _dir(comm: Communicator) -> Path:
    return keyed_cache_dir(comm.options.cache_dir) / "tune"


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _where(comm: Communicator) -> dict[str, Any]:
    return {
        "mesh": str(comm.mesh),
        "backend": comm.backend,
        "device": str(comm.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "coconet": __version__,
        "transport": comm.transport_of(None).value,
    }


def result_key(
    program: Program,
    sizes: Mapping[str, int],
    comm: Communicator,
    transports: Sequence[TransportKind],
    settings: Mapping[str, Any],
) -> str:
    return _digest(
        {
            "program": program.digest(),
            "sizes": dict(sizes),
            **_where(comm),
            "transports": [t.value for t in transports],
            "settings": dict(settings),
            "calibration": CALIBRATION,  # a result holds the model's predictions
        }
    )


# What the calibration measures and how (coconet.tune.calibrate): a cached model measured
# otherwise is not this one. 2: memory probes with their operands out of cache; 3: the step's
# fixed cost measured with the caches flushed too; 4: every probe started at one instant on every
# rank (``Communicator.aligned_start``), the fixed cost measured once, on shared memory.
CALIBRATION = 4


def _machine_key(comm: Communicator, transports: Sequence[TransportKind]) -> str:
    return _digest({**_where(comm), "transports": [t.value for t in transports],
                    "calibration": CALIBRATION})


def _read(comm: Communicator, path: Path) -> dict | None:
    """Rank 0's copy of the JSON file at ``path`` (None if absent or unreadable), on every
    rank. Collective."""
    doc = None
    if comm.rank == 0:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = None
    return comm.exchange(doc, "tuning cache")[0] if comm.world > 1 else doc


def _write(comm: Communicator, path: Path, doc: dict | None) -> None:
    if comm.rank != 0 or doc is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError:
        pass  # an unwritable cache costs a new tune next time, nothing more


def load_result(comm: Communicator, key: str) -> dict | None:
    return _read(comm, _dir(comm) / f"result-{key}.json")


def save_result(comm: Communicator, key: str, doc: dict | None) -> None:
    _write(comm, _dir(comm) / f"result-{key}.json", doc)


def load_machine(comm: Communicator, transports: Sequence[TransportKind]) -> dict | None:
    return _read(comm, _dir(comm) / f"machine-{_machine_key(comm, transports)}.json")


def save_machine(comm: Communicator, transports: Sequence[TransportKind], doc: dict) -> None:
    _write(comm, _dir(comm) / f"machine-{_machine_key(comm, transports)}.json", doc)
