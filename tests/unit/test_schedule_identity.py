"""A schedule's identity: ``Schedule.digest``, a hash of its JSON document, is what the compile
cache and the ranks' handshake key on. The printed text (``str(schedule)``) is for people: it
elides lists longer than 8 names, so two different schedules can print alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from support.examples_loader import load_example

import coconet as cc
from coconet.runtime import handshake
from coconet.schedule import Schedule, fuse_RS_C_AG

SRC = Path(cc.__file__).resolve().parents[1]


def sgd_fused(order=lambda names: names) -> Schedule:
    """SGD's fuse_RS_C_AG, with its 12-name fuse step listed in ``order``."""
    program = load_example("sgd").program()
    doc = json.loads(fuse_RS_C_AG(program, ("buf",)).to_json())
    fuse = doc["steps"][-1]
    assert fuse["primitive"] == "fuse"
    fuse["nodes"] = order(fuse["nodes"])
    return Schedule.from_json(program, json.dumps(doc))


def swap_middle(names: list[str]) -> list[str]:
    names[5], names[6] = names[6], names[5]  # inside the elided part of the printed list
    return names


def test_schedules_that_print_alike_have_different_digests():
    a, b = sgd_fused(), sgd_fused(swap_middle)
    assert len(a.steps[-1].nodes) > 8  # long enough to be elided when printed
    assert str(a) == str(b)
    assert a.to_json() != b.to_json()
    assert a.digest != b.digest


def test_schedules_that_print_alike_have_different_cache_keys(tmp_path):
    a, b = sgd_fused(), sgd_fused(swap_middle)
    key_a = cc.compile(a, world=2, cache_dir=tmp_path).key
    key_b = cc.compile(b, world=2, cache_dir=tmp_path).key
    assert key_a != key_b
    # ... while the same schedule, built again, finds its module in the cache.
    assert cc.compile(sgd_fused(), world=2, cache_dir=tmp_path).key == key_a


def test_the_handshake_tells_schedules_that_print_alike_apart(tmp_path):
    comm = types.SimpleNamespace(options=types.SimpleNamespace(algorithms=None))
    a, b = (
        cc.compile(s, world=2, cache_dir=tmp_path) for s in (sgd_fused(), sgd_fused(swap_middle))
    )
    ida, idb = dict(a.identity(comm)), dict(b.identity(comm))
    assert ida["schedule"] == idb["schedule"]  # the text, shown when the ranks disagree
    assert ida["schedule digest"] == a.schedule_digest != idb["schedule digest"]
    assert handshake.identity_hash(a.identity(comm)) != handshake.identity_hash(b.identity(comm))


def test_a_bare_program_has_no_schedule_digest(tmp_path):
    step = cc.compile(load_example("sgd").program(), world=2, cache_dir=tmp_path)
    comm = types.SimpleNamespace(options=types.SimpleNamespace(algorithms=None))
    assert step.schedule_digest == ""
    assert dict(step.identity(comm))["schedule digest"] == "(none)"


def test_the_name_is_part_of_the_identity():
    # The name is printed in the generated module's header: two names, two modules.
    a = sgd_fused()
    b = sgd_fused()
    b.name = "mine"
    assert a.digest != b.digest


def paper_schedules():
    for name in ("sgd", "adam", "adamw", "lamb", "tensor_parallel", "pipeline_parallel"):
        mod = load_example(name)
        for sname, make in mod.SCHEDULES.items():
            yield pytest.param(mod, make, id=f"{name}:{sname}")


@pytest.mark.parametrize(("mod", "make"), list(paper_schedules()))
def test_the_digest_survives_a_replay_from_json(mod, make):
    s = make(mod.program())
    again = Schedule.from_json(mod.program(), s.to_json())  # a freshly built, equal program
    assert again.digest == s.digest
    assert Schedule.from_json(mod.program(), again.to_json()).digest == s.digest


def test_the_digest_is_the_same_in_another_process():
    # Ranks are separate processes: nothing in the digest may depend on hash seeds or ids.
    code = textwrap.dedent(
        """
        from support.examples_loader import load_example
        from coconet.schedule import fuse_RS_C_AG
        print(fuse_RS_C_AG(load_example("adam").program(), ("m", "v")).digest)
        """
    )
    tests = str(Path(__file__).resolve().parents[1])  # where the support package is
    path = os.pathsep.join([str(SRC), tests])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    here = fuse_RS_C_AG(load_example("adam").program(), ("m", "v")).digest
    assert out.stdout.strip() == here
