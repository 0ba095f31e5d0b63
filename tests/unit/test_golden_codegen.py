"""Golden files of generated code: every example x every named schedule, compiled for 2 ranks.

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
from examples_loader import EXAMPLES, load_example

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


@pytest.mark.parametrize(("name", "schedule"), list(_cases()))
def test_generated_code_matches_golden(name, schedule, tmp_path):
    mod = load_example(name)
    program = mod.program()
    target = program if schedule == "none" else mod.SCHEDULES[schedule](program)
    source = _normalise(cc.compile(target, world=_world(name), cache_dir=tmp_path).source)
    path = GOLDEN / f"{name}__{schedule}.py"
    if UPDATE:
        path.write_text(source)
    assert path.exists(), f"no golden file {path.name}: run with COCONET_UPDATE_GOLDEN=1"
    assert source == path.read_text(), (
        f"generated code of {name} / {schedule} differs from {path.name}; if intended, "
        "regenerate with COCONET_UPDATE_GOLDEN=1 and review the diff"
    )
