"""Fused kernels built ahead of time (``coconet.codegen.aot``): built once per signature, loaded
by a second process without torch.compile, equal to the eager kernel, and where no package can be
made, torch.compile instead with the reason said.

A build runs Inductor and a C++ compiler (~10 s here), so the tests share one package directory
(one build of the kernel below) and keep the others to what needs no build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from coconet.codegen import aot
from coconet.codegen.kernels import KernelSet


def update(beta, m, g, pieces, lr):
    """A kernel of the generated modules' kind: 0-d scalars, slices, and a list of pieces (a
    reduced gradient read where the transport left it)."""
    total = pieces[0] + pieces[1]
    m_new = beta * m + (1 - beta) * (g + total)
    return m_new, g - lr * m_new


def _args(n: int = 1000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    m, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    pieces = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    return (torch.tensor(0.9), m, g, pieces, torch.tensor(0.01))


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    """Inductor's cache of its own for a test that compiles with torch.compile outside a step
    (a step points Inductor at a directory keyed by the CPU capability: ``coconet.cache``; the
    default one would hand this pass kernels another capability's pass compiled)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """A package directory holding ``update``'s package for ``_args()``, built here once."""
    directory = tmp_path_factory.mktemp("kernels")
    kernels = KernelSet({"update": update}, fused=True, aot_dir=directory, label="t",
                        announce=False)  # fmt: skip
    out = kernels.update(*_args())
    assert kernels.built == 1 and kernels.loaded == 0 and not kernels.why_not
    left = sorted(p.name for p in directory.iterdir() if not p.name.endswith(".pt2"))
    assert left == [], left  # no lock file, no temporary file left behind
    expected = update(*_args())
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return directory


@pytest.mark.timeout(240)
def test_a_second_kernel_set_loads_the_package_and_matches_eager(packages):
    kernels = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                        announce=False)  # fmt: skip
    t0 = time.perf_counter()
    out = kernels.update(*_args(seed=1))  # other values, the same signature
    assert time.perf_counter() - t0 < 2.0  # loaded, not built (a build takes ~10 s)
    assert kernels.built == 0 and kernels.loaded == 1
    for got, want in zip(out, update(*_args(seed=1)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(240)
def test_a_second_process_loads_it_without_torch_compile(packages):
    code = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import torch
        from test_dist_kernel_packages import _args, update
        from coconet.codegen.kernels import KernelSet
        kernels = KernelSet({{"update": update}}, fused=True, aot_dir={str(packages)!r},
                            label="t", announce=False)
        t0 = time.perf_counter()
        out = kernels.update(*_args(seed=2))
        seconds = time.perf_counter() - t0
        ok = all(torch.allclose(a, b, rtol=1e-6, atol=1e-6)
                 for a, b in zip(out, update(*_args(seed=2))))
        print(json.dumps({{"built": kernels.built, "loaded": kernels.loaded, "ok": ok,
                          "seconds": seconds,
                          "dynamo": any(m.startswith("torch._dynamo") for m in sys.modules),
                          "inductor": any(m.startswith("torch._inductor") for m in sys.modules)}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["built"] == 0 and got["loaded"] == 1 and got["ok"], got
    # nothing of torch's compiler stack is imported to run it
    assert not got["dynamo"] and not got["inductor"], got
    assert got["seconds"] < 2.0, got


def test_the_signature_tells_apart_what_changes_the_code():
    base = aot.signature(_args())
    assert base == aot.signature(_args(seed=3))  # values do not matter
    assert base != aot.signature(_args(n=999))  # shapes do
    beta, m, g, pieces, lr = _args()
    assert base != aot.signature((beta, m, m, pieces, lr))  # two arguments share storage
    assert base != aot.signature((beta, m, g, pieces[:1] * 2, lr))  # (the same, in the list)
    assert base != aot.signature((beta, m, g, [pieces[0], pieces[1], pieces[0]], lr))  # nesting
    strided = torch.randn(2000)[::2]
    assert base != aot.signature((beta, m, strided, pieces, lr))  # strides
    assert base != aot.signature((beta, m.double(), g, pieces, lr))  # dtypes
    assert aot.signature((0.9, m, g, pieces, lr)) is None  # a number: no package
    key = aot.key(update, base, {})
    assert key != aot.key(update, base, {"emulate_precision_casts": True})  # Inductor's options
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert key != aot.key(update, base, {})  # the thread count is in the OpenMP pragmas
    finally:
        torch.set_num_threads(threads)


def test_a_broken_package_file_is_a_miss_not_a_failure(tmp_path):
    (tmp_path / "x.pt2").write_bytes(b"not a package")
    assert aot.load(tmp_path, "x") is None
    assert aot.load(tmp_path, "absent") is None


def _item(x, y):
    """Data-dependent control flow: torch.export cannot trace it; torch.compile can (a break)."""
    return x * 2 if float(x.sum()) > 0 else y


@pytest.mark.timeout(240)
def test_what_cannot_be_packaged_runs_under_torch_compile_and_says_why(tmp_path, inductor_cache):
    def scale(x, factor):
        return x * factor

    kernels = KernelSet({"scale": scale, "item": _item}, fused=True, aot_dir=tmp_path,
                        label="t", announce=False)  # fmt: skip
    x = torch.randn(64)
    torch.testing.assert_close(kernels.scale(x, 3.0), x * 3.0)
    assert kernels.why_not["scale"] == "an argument is not a tensor"
    y = torch.randn(64)
    torch.testing.assert_close(kernels.item(x.abs(), y), x.abs() * 2)
    assert "item" in kernels.why_not and kernels.built == 0, kernels.why_not
    assert not list(tmp_path.glob("*.pt2"))
    # a rehearsal whose calls did not all run from packages is not kept: a step skipping its
    # rehearsal would compile inside its collectives
    assert kernels.preload("step") is False
    with kernels.recording():
        kernels.scale(x, 3.0)
    kernels.compile_recorded()
    kernels.keep_manifest()
    assert not kernels.manifest.exists()


def test_the_option_defaults_to_the_environment_and_is_checked(monkeypatch):
    from coconet.errors import CompileOptionError
    from coconet.options import KERNEL_PACKAGES_ENV, CompileOptions

    monkeypatch.delenv(KERNEL_PACKAGES_ENV, raising=False)
    assert CompileOptions().kernel_packages is True  # a user's default
    monkeypatch.setenv(KERNEL_PACKAGES_ENV, "0")
    assert CompileOptions().kernel_packages is False
    assert CompileOptions(kernel_packages=True).kernel_packages is True  # the option wins
    with pytest.raises(CompileOptionError, match="kernel_packages must be True or False"):
        CompileOptions(kernel_packages="yes")


@pytest.mark.timeout(240)
def test_shapes_that_keep_changing_go_to_torch_compile_after_a_few_builds(packages, monkeypatch,
                                                                         inductor_cache):
    from coconet.codegen import kernels as kernels_module

    monkeypatch.setattr(kernels_module, "BUILDS_PER_KERNEL", 0)  # (each build costs ~7 s here)
    kernels = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                        announce=False)  # fmt: skip
    kernels.update(*_args())  # the fixture's package: loaded, whatever the limit
    assert kernels.loaded == 1 and not kernels.why_not
    for n in (999, 998):  # new shapes: no build, torch.compile
        out = kernels.update(*_args(n=n))
        for got, want in zip(out, update(*_args(n=n)), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert kernels.built == 0 and "dynamic shapes" in kernels.why_not["update"], kernels.why_not


def _rehearse(kernels: KernelSet, identity: str, args) -> None:
    """What a step's first call does with its kernels when it rehearses (``CompiledStep``)."""
    assert kernels.preload(identity) is False
    with kernels.recording():
        kernels.update(*args)
    kernels.compile_recorded()
    kernels.keep_manifest()


@pytest.mark.timeout(240)
def test_a_rehearsal_is_kept_and_a_later_set_preloads_it_instead(packages, tmp_path):
    first = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                      announce=False)  # fmt: skip
    _rehearse(first, "step A|rank 0", _args())
    assert first.rehearsals == 1 and first.manifest.exists()
    assert first.manifest.read_text().split() == [first.update.package_name(_args())]

    later = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                      announce=False)  # fmt: skip
    assert later.preload("step A|rank 0") is True
    assert later.no_builds and len(later.preloaded) == 1
    out = later.update(*_args(seed=3))
    assert later.built == 0 and later.loaded == 1 and not later.why_not
    for got, want in zip(out, update(*_args(seed=3)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # another step, rank or size has no record; a record naming a package that is gone is none
    other = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                      announce=False)  # fmt: skip
    assert other.preload("step A|rank 1") is False and not other.no_builds
    gone = other.manifest_for("step B")
    gone.write_text("t.update_0123456789abcdef0123\n")
    assert other.preload("step B") is False and not other.no_builds
    # without packages there is nothing to keep
    bare = KernelSet({"update": update}, fused=True, aot_dir=None)
    assert bare.manifest_for("step A|rank 0") is None and bare.preload("step A|rank 0") is False


@pytest.mark.timeout(240)
def test_under_no_builds_an_unknown_signature_runs_eagerly_and_drops_the_record(packages):
    kernels = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                        announce=False)  # fmt: skip
    if not kernels.preload("step A|rank 0"):  # (the test above kept it; alone, keep it here)
        _rehearse(kernels, "step A|rank 0", _args())
        kernels = KernelSet({"update": update}, fused=True, aot_dir=packages, label="t",
                            announce=False)  # fmt: skip
        assert kernels.preload("step A|rank 0")
    t0 = time.perf_counter()
    for seed in (1, 2):  # a size no package was built for: eager both times, never a build
        out = kernels.update(*_args(n=997, seed=seed))
        for got, want in zip(out, update(*_args(n=997, seed=seed)), strict=True):
            assert torch.equal(got, want)  # the eager function itself: the same bits
    assert time.perf_counter() - t0 < 2.0 and kernels.built == 0
    assert "its first call ran unfused" in kernels.why_not["update"]
    assert kernels.unkept  # the step rehearses at its next call (CompiledStep._rehearse_again)
    assert not kernels.manifest.exists()  # and so does the next process
    # the eager stand-in was for those calls only: outside no_builds the signature gets its
    # package (a step builds it in its second call's rehearsal, outside its collectives)
    kernels.no_builds = False
    out = kernels.update(*_args(n=997, seed=3))
    assert kernels.built + kernels.loaded == 1 and kernels.update.package_name(_args(n=997))
    for got, want in zip(out, update(*_args(n=997, seed=3)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(300)
def test_a_later_process_skips_the_rehearsal_only_when_every_rank_kept_it(tmp_path):
    """Process 1 rehearses and keeps the outcome; process 2 preloads on every rank and does not
    rehearse; process 3, where rank 1's record is gone, rehearses on both ranks (the ranks vote:
    a rehearsal runs collectives, so one rank alone cannot skip it). Same outputs, bit for bit,
    every time; nothing built after process 1. Process 4: a kept package that does not fit a
    rank's arguments is built at the step's second call, in a rehearsal of every rank."""
    from support import dist_workers

    from coconet.runtime import CommOptions, spawn

    def run():
        return spawn(dist_workers.kept_rehearsal, 2, str(tmp_path), timeout=280,
                     options=CommOptions(timeout=120))  # fmt: skip

    first = run()
    assert [r["rehearsals"] for r in first] == [1, 1], first
    assert all(not r["why_not"] for r in first), first
    second = run()
    assert [(r["rehearsals"], r["built"]) for r in second] == [(0, 0), (0, 0)], second
    assert all(r["preloaded"] > 0 and not r["no_builds_after"] for r in second), second
    os.remove(second[1]["manifest"])
    third = run()
    assert [(r["rehearsals"], r["built"]) for r in third] == [(1, 0), (1, 0)], third
    assert os.path.exists(second[1]["manifest"])  # kept again
    for runs in (second, third):
        for rank in (0, 1):
            for name, value in first[rank]["outputs"].items():
                assert torch.equal(runs[rank]["outputs"][name], value), (rank, name)
    # process 4: rank 1's kernel arguments unlike the kept packages' (another alignment): its
    # first call skips the rehearsal and runs its kernel eagerly; the second call rehearses on
    # both ranks and builds the package there (before, the kernel stayed eager for the
    # process's life: a 16M Adam step ~4x slower)
    fourth = spawn(dist_workers.kept_rehearsal_misaligned, 2, str(tmp_path), timeout=280,
                   options=CommOptions(timeout=120))  # fmt: skip
    assert [r["first"]["rehearsals"] for r in fourth] == [0, 0], fourth
    assert [r["first"]["unkept"] for r in fourth] == [False, True], fourth
    assert [(r["rehearsals"], r["unkept"]) for r in fourth] == [(1, False), (1, False)]
    assert [r["built"] for r in fourth] == [0, 1], fourth
    for rank in (0, 1):
        for out in fourth[rank]["outputs"]:
            for name, value in first[rank]["outputs"].items():
                torch.testing.assert_close(out[name], value, rtol=1e-5, atol=1e-6)
