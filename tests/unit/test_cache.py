"""Caches are keyed by what changes the compiled result: torch's version, the ATen CPU capability
in force, and the CPU (Inductor builds with -march=native). Machines sharing a home directory, or
one machine run with another ATEN_CPU_CAPABILITY, never load each other's entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from coconet import cache


def _in_child(capability: str | None, env_extra: dict[str, str] | None = None) -> dict:
    """build_key() and the Inductor directory coconet picks in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    env.update(env_extra or {})
    code = (
        "import json, torch; from coconet import cache;"
        "print(json.dumps({'key': cache.build_key(),"
        " 'cap': torch.backends.cpu.get_cpu_capability(),"
        " 'inductor': str(cache.use_inductor_cache())}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_build_key_names_torch_and_capability():
    key = cache.build_key()
    assert key.startswith("torch-" + torch.__version__.replace("+", "_"))
    assert torch.backends.cpu.get_cpu_capability().lower() in key


def test_keyed_dir_is_under_the_base(tmp_path):
    assert cache.keyed_cache_dir(tmp_path) == tmp_path / cache.build_key()


def test_another_capability_gets_other_caches(tmp_path):
    """The suite's hazard: a native run then a ATEN_CPU_CAPABILITY=default run sharing one home
    and one temp directory. Each gets its own Inductor and coconet directories, including when
    the second process inherits the first one's TORCHINDUCTOR_CACHE_DIR (as spawned ranks do)."""
    home = {"XDG_CACHE_HOME": str(tmp_path)}
    native = _in_child(None, home)
    default = _in_child("default", home)
    assert default["cap"] == "DEFAULT"
    if native["cap"] != "DEFAULT":
        assert native["key"] != default["key"]
        assert native["inductor"] != default["inductor"]
        inherited = _in_child(
            "default",
            {
                **home,
                "TORCHINDUCTOR_CACHE_DIR": native["inductor"],
                "COCONET_SET_TORCHINDUCTOR_CACHE_DIR": native["inductor"],
            },
        )
        assert inherited["inductor"] == default["inductor"]
    for got in (native, default):
        assert got["inductor"] == str(tmp_path / "coconet" / got["key"] / "inductor")


def test_an_explicit_inductor_dir_is_respected(tmp_path, monkeypatch):
    mine = str(tmp_path / "my-inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", mine)
    monkeypatch.delenv("COCONET_SET_TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert str(cache.use_inductor_cache(tmp_path)) == mine


def test_torchs_own_default_is_replaced(tmp_path, monkeypatch):
    """torch writes its default back into the environment the first time it compiles; that is
    not the user's choice, so coconet still keys it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv("COCONET_SET_TORCHINDUCTOR_CACHE_DIR", raising=False)
    got = cache.use_inductor_cache(tmp_path)
    assert got == tmp_path / cache.build_key() / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(got)
