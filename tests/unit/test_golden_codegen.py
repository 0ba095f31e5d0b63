"""Golden files of generated code: every example x every named schedule, compiled for 2 ranks
(over torch.distributed; the schedules whose code differs over shared memory also in that form,
``*__shm.py``).

A change to lowering or emission shows up as a reviewed diff of ``tests/golden/*.py`` instead of
passing silently. After an intended change, regenerate them with::

    COCONET_UPDATE_GOLDEN=1 python -m pytest -q tests/unit/test_golden_codegen.py

and read the diff before committing it. The header line with the module's cache key (which
names the torch version and the CPU) is masked, so the files are the same on every machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support.examples_loader import EXAMPLES, load_example

import coconet as cc

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
NAMES = ("sgd", "adam", "adamw", "lamb", "tensor_parallel", "pipeline_parallel")
UPDATE = os.environ.get("COCONET_UPDATE_GOLDEN") == "1"


def _cases():
    for name in NAMES:
        for schedule in ("none", *load_example(name).SCHEDULES):
            yield name, schedule


def _world(name: str):
    # the pipeline example needs its pp x tp mesh; everything else runs on a world of 2
    return cc.Mesh(pp=2, tp=1) if name == "pipeline_parallel" else 2


def _normalise(source: str) -> str:
    source = re.sub(
        r"^# key: .*$", "# key:      <masked: depends on torch and the CPU>", source, flags=re.M
    )
    return source.replace(str(EXAMPLES) + os.sep, "examples/")


# Over shared memory these take the one-pass forms (coconet.codegen.plan): their code differs
SHARED_MEMORY = (
    ("adam", "AR_C"),
    ("adam", "fuse_RS_C_AG"),
    ("lamb", "fuse_RS_C_AG"),
    ("tensor_parallel", "ol_MM_fuse_RS_C_AG"),
)


@pytest.mark.parametrize(
    ("name", "schedule", "transport"),
    [(n, s, "torch.distributed") for n, s in _cases()]
    + [(n, s, "shared memory") for n, s in SHARED_MEMORY],
)
def test_generated_code_matches_golden(name, schedule, transport, tmp_path):
    mod = load_example(name)
    program = mod.program()
    target = program if schedule == "none" else mod.SCHEDULES[schedule](program)
    step = cc.compile(target, world=_world(name), cache_dir=tmp_path, transport=transport)
    source = _normalise(step.source)
    suffix = "__shm" if transport == "shared memory" else ""
    path = GOLDEN / f"{name}__{schedule}{suffix}.py"
    if UPDATE:
        path.write_text(source)
    assert path.exists(), f"no golden file {path.name}: run with COCONET_UPDATE_GOLDEN=1"
    assert source == path.read_text(), (
        f"generated code of {name} / {schedule} differs from {path.name}; if intended, "
        "regenerate with COCONET_UPDATE_GOLDEN=1 and review the diff"
    )
