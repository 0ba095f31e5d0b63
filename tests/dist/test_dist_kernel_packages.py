"""Fused kernels built ahead of time (``coconet.codegen.aot``): built once per signature, loaded
by a second process without torch.compile, equal to the eager kernel, and where no package can be
made, torch.compile instead with the reason said.

A build runs Inductor and a C++ compiler (~10 s here), so the tests share one package directory
(one build of the kernel below) and keep the others to what needs no build.
"""

from __future__ import annotations

import json
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
