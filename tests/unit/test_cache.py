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


def test_generated_modules_are_bounded_least_recently_used_first(tmp_path, monkeypatch):
    """300 programs differing in one constant used to leave 300 files: the directory keeps at
    most GENERATED_MAX_FILES (here 5), and a module compiled again is kept as recently used."""
    import coconet as cc

    monkeypatch.setattr(cache, "GENERATED_MAX_FILES", 5)
    generated = cache.keyed_cache_dir(tmp_path) / "generated"

    def program(k: int) -> cc.Program:
        x = cc.Tensor("x", cc.float32, [4], cc.Local)
        return cc.Program(f"p{k}", [x], {"y": cc.all_reduce(x) * float(k)})

    first = cc.compile(program(0), world=2, cache_dir=tmp_path)
    for k in range(1, 12):
        cc.compile(program(k), world=2, cache_dir=tmp_path)
        if k % 3 == 0:  # program 0 is used again now and then
            cc.compiler._MODULES.pop(first.key)
            cc.compile(program(0), world=2, cache_dir=tmp_path)
    files = sorted(p.name for p in generated.glob("*.py"))
    assert len(files) == 5, files
    assert any(name.startswith("p0_") for name in files), files
    assert any(name.startswith("p11_") for name in files), files
    assert not any(name.startswith("p1_") for name in files), files


def test_prune_keeps_the_newest_and_respects_the_byte_bound(tmp_path):
    for i in range(4):
        path = tmp_path / f"m{i}.py"
        path.write_text("x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "notes.txt").write_text("not a module")
    removed = cache.prune(tmp_path, max_files=10, max_bytes=2500)
    assert sorted(p.name for p in removed) == ["m0.py", "m1.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m2.py", "m3.py", "notes.txt"]
    # the newest file stays even when it alone is over the bound
    assert cache.prune(tmp_path, max_files=1, max_bytes=10) == [tmp_path / "m2.py"]
    assert (tmp_path / "m3.py").exists()


def test_an_algorithm_choice_is_keyed_by_the_hosts_its_group_spans(tmp_path):
    """A choice measured on one host's loopback is not taken for a group across hosts: the key
    carries the host count (older files, without it, read as one host; a foreign key is
    skipped, never an error)."""
    from coconet.ir.ops import Op
    from coconet.options import Algorithm
    from coconet.runtime.tuning import AlgorithmTable, Choice, TuningKey

    one = TuningKey(Op.REDUCE_SCATTER, ">16MiB", "gloo", 2)
    two = TuningKey(Op.REDUCE_SCATTER, ">16MiB", "gloo", 2, hosts=2)
    assert one.text() == "reduce_scatter|>16MiB|gloo|2"  # the format older files have
    assert two.text() == "reduce_scatter|>16MiB|gloo|2|hosts=2"
    assert TuningKey.parse(one.text()) == one and TuningKey.parse(two.text()) == two
    table = AlgorithmTable(tmp_path / AlgorithmTable.FILENAME)
    table.put(one, Choice(Algorithm.ALL_TO_ALL, {Algorithm.ALL_TO_ALL: 19.0}))
    table.save()
    back = AlgorithmTable.load(tmp_path)
    assert back.get(one) is not None and back.get(two) is None
    back.put(two, Choice(Algorithm.NATIVE, {Algorithm.NATIVE: 600.0}))
    back.save()
    both = AlgorithmTable.load(tmp_path)
    assert both.get(one).algorithm is Algorithm.ALL_TO_ALL
    assert both.get(two).algorithm is Algorithm.NATIVE
    assert "hosts=2" in both.format()
    raw = json.loads((tmp_path / AlgorithmTable.FILENAME).read_text())
    raw["choices"]["reduce_scatter|>16MiB|gloo|2|racks=3"] = raw["choices"][one.text()]
    (tmp_path / AlgorithmTable.FILENAME).write_text(json.dumps(raw))
    assert AlgorithmTable.load(tmp_path).entries == {}  # a foreign file: measured again
