"""Fused kernels built ahead of time: one AOTInductor package per kernel and argument signature,
kept on disk, and loaded by the next process without torch.compile.

Why: torch.compile's on-disk cache (Inductor's FX-graph cache) still costs a second process
seconds at its first step: importing dynamo and Inductor (~2.3 s on the 2-core development
machine), then tracing each kernel again and looking it up (~1.7 s a kernel; issue 47 measured
4-19 s first iterations of a nanoGPT port in every run). A package built by
``torch._inductor.aoti_compile_and_package`` holds the same Inductor C++ kernel plus a C++
wrapper; torch's C++ loader (``torch._C._aoti.AOTIModelPackageLoader``) maps it in ~10 ms and
imports nothing of the compiler stack. (torch's Python loader, ``aoti_load_package``, imports
dynamo: 3 s. The C++ class it wraps is what is used here, with its ``run`` on a flat list.)

A package is named by everything that changes the code Inductor writes for it (``key``): the
kernel's source and the generated module's prelude it reads (its helpers and constants),
coconet's own source digest (the helpers' meaning), each argument's shape, strides, dtype,
device, 64-byte alignment and which arguments share storage, the torch thread count (Inductor
writes it into the OpenMP pragmas) and Inductor's options; it lives under the build key's
directory (``coconet.cache``: torch version, ATen capability, CPU model), bounded like the
generated modules (``prune``).

What is not packaged runs under torch.compile as before, and ``why_not`` says why: an argument
that is not a tensor (export would bake its value into the code), or an export or AOTInductor
failure (its first line).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import inspect
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from coconet.cache import prune, source_digest

__all__ = ["Package", "build", "flatten", "key", "load", "signature"]

# The bound on ``<build key>/kernels``: a package is 1-3 MiB (the kernel and its wrapper), so this
# keeps the kernels of a few dozen programs and shapes.
MAX_FILES = 128
MAX_BYTES = 512 << 20
_SUFFIX = ".pt2"
# package metadata: how the kernel returns ("tuple", "single", or "none": it only writes into
# its arguments, as the one-pass forms' kernels write into the peers' slots)
_OUTPUTS = "coconet.outputs"


def flatten(args: Sequence[object]) -> list[object]:
    """``args`` with lists and tuples of arguments spread in place (a kernel that reads a
    reduced gradient where the transport left it takes its pieces as a list), as torch.export
    flattens them: the order a package takes its tensors in."""
    flat: list[object] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            flat.extend(flatten(a))
        else:
            flat.append(a)
    return flat


def signature(args: Sequence[object]) -> tuple | None:
    """What a package is specialised to (None when an argument is no tensor): how lists nest,
    then per tensor its shape, strides, dtype, device, whether its data is 64-byte aligned, and
    the index of the first tensor sharing its storage (the package assumes the aliasing it was
    built with)."""
    sig: list[object] = [_nesting(args)]
    storages: dict[int, int] = {}
    for i, a in enumerate(flatten(args)):
        if not isinstance(a, torch.Tensor):
            return None
        at = a.untyped_storage().data_ptr()
        sig.append((tuple(a.shape), a.stride(), a.dtype, a.device.type, a.device.index,
                    a.data_ptr() % 64 == 0, storages.setdefault(at, i)))  # fmt: skip
    return tuple(sig)


def _nesting(args: Sequence[object]) -> tuple:
    return tuple(_nesting(a) if isinstance(a, (list, tuple)) else 0 for a in args)


@functools.cache
def _prelude(module_file: str) -> str:
    """The generated module's text before its first kernel, comments dropped: the imports,
    helpers and constants a kernel reads (its header comments name the program and schedule,
    which do not change a kernel's code)."""
    text = Path(module_file).read_text()
    head = text.split("\ndef ", 1)[0]
    return "\n".join(ln for ln in head.splitlines() if not ln.lstrip().startswith("#"))


def key(fn: Callable, sig: tuple, options: dict) -> str:
    """The package's name for ``fn`` called with arguments of signature ``sig``."""
    module = inspect.getmodule(fn)
    prelude = _prelude(module.__file__) if module and getattr(module, "__file__", None) else ""
    parts = [
        source_digest(), prelude, inspect.getsource(fn), repr(sig), repr(sorted(options.items())),
        f"threads={torch.get_num_threads()}",
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:20]


class Package:
    """A loaded package: called like the kernel (tensors in, a tensor or a tuple out)."""

    def __init__(self, path: Path) -> None:
        # (path, model name, run single-threaded, runners, device index): what torch's own
        # aoti_load_package passes; the single runner is enough (a step calls it from one thread)
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self._returns = self._loader.get_metadata().get(_OUTPUTS, "tuple")
        self.path = path

    def __call__(self, *args):
        out = self._loader.run(flatten(args))
        if self._returns == "tuple":
            return tuple(out)
        return out[0] if self._returns == "single" else None


def load(directory: Path, name: str) -> Package | None:
    """The package ``name`` from ``directory``, or None when there is none (or it does not load:
    a truncated file from a killed process, which the next build replaces)."""
    path = directory / f"{name}{_SUFFIX}"
    if not path.exists():
        return None
    try:
        package = Package(path)
    except Exception:  # noqa: BLE001 - a bad file is a miss: rebuilt, never fatal
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used: kept longest by prune
    return package


def _returns(exported) -> str:
    """How the exported function returns (``_OUTPUTS``), from its output spec: a tuple, one
    tensor, or nothing (an export records a None output as a None user output)."""
    if exported.call_spec.out_spec.type is tuple:
        return "tuple"
    return "none" if exported.graph_signature.user_outputs == (None,) else "single"


class _AsModule(torch.nn.Module):
    """``fn`` as a module's forward: what torch.export takes."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def build(fn: Callable, args: Sequence[torch.Tensor], directory: Path, name: str,
          options: dict) -> Package:  # fmt: skip
    """Export ``fn`` on ``args``, compile it with AOTInductor into ``directory/name.pt2`` and load
    it. One builder per package at a time (a lock file named after it, removed once the package is
    in place): a second process that needs the same package (the other rank of a job with the
    same slices) waits and loads what the first wrote, while builds of different packages (the
    ranks' different slices) run side by side. Written to a temporary file and renamed, so a
    reader never sees half a package. Raises what export or Inductor raise."""
    directory.mkdir(parents=True, exist_ok=True)
    # (a process that opened the lock file before its removal may build the package again: the
    # same bytes, renamed into place again; wasted work, never a wrong package)
    lock_path = directory / f".{name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            found = load(directory, name)
            if found is not None:
                return found
            with torch.no_grad(), warnings.catch_warnings():
                # torch's own deprecation notices from inside export and Inductor: nothing the
                # user's code did or can change
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                exported = torch.export.export(_AsModule(fn), tuple(args), strict=False)
                configs = dict(options)
                configs["aot_inductor.metadata"] = {_OUTPUTS: _returns(exported)}
                fd, tmp = tempfile.mkstemp(suffix=_SUFFIX, dir=directory, prefix=".build-")
                os.close(fd)
                try:
                    torch._inductor.aoti_compile_and_package(
                        exported, package_path=tmp, inductor_configs=configs
                    )
                    os.replace(tmp, directory / f"{name}{_SUFFIX}")
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            fcntl.flock(lock, fcntl.LOCK_UN)
    prune(directory, max_files=MAX_FILES, max_bytes=MAX_BYTES, suffix=_SUFFIX)
    return Package(directory / f"{name}{_SUFFIX}")
