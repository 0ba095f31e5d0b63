"""Fused kernels: each ``fuse`` group's computation as one function, built ahead of time.

The generated module defines every kernel as plain Python over torch ops (``KERNELS``). With
fused kernels on, each kernel runs, per argument signature, as an AOTInductor package
(``coconet.codegen.aot``: Inductor's C++/OpenMP code built once, kept on disk under the build key,
loaded by later processes in milliseconds with no torch.compile); what cannot be packaged (a
non-tensor argument, an export failure: ``KernelSet.why_not``) runs under ``torch.compile``
(Inductor again, with its own FX-graph cache). With ``fused=False`` the same functions run
eagerly, op by op, which is what to debug with.

A kernel is built or loaded at its first call with a signature, and the time that first call
took is kept in ``KernelSet.first_call_seconds`` so compile costs can be reported. A step
compiles its kernels outside its collectives (so that a slow compile never counts against a
peer's timeout): ``recording()`` runs a rehearsal of the step with every kernel eager and keeps
each call's arguments, and ``compile_recorded()`` then replays those calls through the compiled
kernels, which compiles them for exactly the shapes, strides and aliasing of the real step.

A rehearsal costs an eager step (~100 ms of the first step of a nanoGPT-sized model), so its
outcome is kept: ``keep_manifest`` writes the names of the packages the rehearsal's calls used
(a small file beside them, keyed by the step's identity, rank and sizes), and a later process
with the same step ``preload``s them instead of rehearsing. Its first step then runs with
``no_builds`` set: a call whose arguments differ from those the kept packages were built for
(another alignment, say) runs eagerly instead of building inside a collective, says so in
``why_not``, sets ``unkept`` and removes the file; the step then rehearses at its next call, on
every rank, and builds the package there, outside its collectives. (Before, that kernel stayed
eager for the life of the process: a 16M Adam step ~4x slower, in about one run in eight here,
where a fresh tensor's 64-byte alignment differed from the kept package's.)

Measured on the 2-core development machine (torch 2.13 CPU, one process, Adam's update fused into
one kernel over 1M float32 elements): torch.compile's first call takes ~15.5 s with an empty
Inductor cache and ~2.6 s with a warm one, plus ~3.3 s once per process to import torch's
compiler; a package is built in about as long as the cold compile and is loaded in ~10 ms
(``benchmarks/first_step.py`` has the figures of a whole training script). After that a step
runs the kernel in ~8 ms against ~17 ms for the same ops eagerly.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from coconet import tracing
from coconet.cache import prune
from coconet.codegen import aot
from coconet.errors import headline
from coconet.progress import phase

__all__ = ["KernelSet"]

# Inductor computes 16-bit values in float32 and by default skips the rounding of a cast to a
# 16-bit dtype whose result is widened again (``x.to(bfloat16).to(float32)`` becomes ``x``):
# more precise, and not what the program says. A 16-bit reduction rounds once at its end (the
# simulator's ``reduce_values``) and a fused kernel that reads it widened must see the rounded
# value, bit for bit the simulator's; float32 kernels are unaffected.
_INDUCTOR = {"emulate_precision_casts": True}

# A kernel builds packages for at most this many argument signatures in one process; later new
# ones run under torch.compile, which turns to dynamic shapes at its second (an optimizer's
# kernel sees one or two signatures, a layer called at a growing length one per call).
BUILDS_PER_KERNEL = 2

# kept rehearsal outcomes (``KernelSet.keep_manifest``): their suffix, and how many are kept
_MANIFEST = ".kernels"
MAX_MANIFESTS = 256


class _Kernel:
    """One kernel: eager in a rehearsal or with fused kernels off; otherwise, per argument
    signature, an AOTInductor package (loaded from disk or built once: ``coconet.codegen.aot``),
    or torch.compile where a package cannot be made. Times its first call (its compile)."""

    def __init__(self, name: str, eager: Callable, owner: KernelSet) -> None:
        self.name = name
        self.eager = eager
        self.owner = owner
        # What the kernel runs outside a rehearsal when set: the eager function with fused
        # kernels off; a stand-in a test puts here (a slow compile, an injected failure); None:
        # the package or torch.compile, chosen per signature (``_implementation``).
        self.fn: Callable | None = None if owner.fused else eager
        self._compiled: Callable | None = None  # torch.compile's, made on first need
        # per signature: its package, or None (no package could be made: torch.compile); an
        # unknown signature under ``no_builds`` is not kept (eager for that call only)
        self._packages: dict[tuple, Callable | None] = {}
        self._names: dict[tuple, str] = {}  # the package name of each signature that has one
        self._builds = 0  # packages this kernel built in this process

    def __call__(self, *args):
        if tracing.active():
            with tracing.span("kernel", tracing.Category.KERNEL, self.name):
                return self._call(args)
        return self._call(args)

    def _call(self, args: tuple):
        owner = self.owner
        recorded = owner.recorded
        if recorded is not None:  # a rehearsal: eager, keeping the arguments for the compile
            recorded.append((self, args))
            return self.eager(*args)
        fn = self.fn
        if self.name in owner.first_call_seconds:
            return (fn or self._implementation(args))(*args)
        t0 = time.perf_counter()
        out = (fn or self._implementation(args))(*args)
        owner.first_call_seconds[self.name] = time.perf_counter() - t0
        return out

    def _implementation(self, args: tuple) -> Callable:
        directory = self.owner.aot_dir
        sig = aot.signature(args) if directory is not None else None
        if sig is not None:
            package = self._packages.get(sig, False)
            if package is False:
                package = self._package(directory, sig, args)
                if package is not self.eager:  # (the eager stand-in is for this call only)
                    self._packages[sig] = package
            if package is not None:
                return package
        elif directory is not None:
            self.owner.why_not.setdefault(self.name, "an argument is not a tensor")
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, dynamic=None, fullgraph=False,
                                           options=_INDUCTOR)  # fmt: skip
        return self._compiled

    def package_name(self, args: tuple) -> str | None:
        """The name of the package that runs this kernel for ``args`` (None: none does)."""
        sig = aot.signature(args)
        return None if sig is None else self._names.get(sig)

    def _package(self, directory, sig: tuple, args: tuple) -> Callable | None:
        """This signature's package: preloaded or loaded, else built (announced: it takes
        seconds), else None with the reason kept in ``why_not`` (torch.compile runs the kernel
        instead); under ``no_builds``, the eager function instead of a build."""
        owner = self.owner
        try:
            name = f"{owner.label}.{self.name}_{aot.key(self.eager, sig, _INDUCTOR)}"
        except OSError as exc:  # its source cannot be read (defined at a prompt): no key
            owner.why_not[self.name] = headline(exc)
            return None
        found = owner.preloaded.get(name) or aot.load(directory, name)
        if found is not None:
            owner.loaded += 1
            self._names[sig] = name
            return found
        if owner.no_builds:
            # inside a step that skipped its rehearsal: a build here would keep the peers
            # waiting in a collective for seconds
            owner.why_not[self.name] = (
                "its arguments differ from those of the packages kept for this step: its first "
                "call ran unfused, and the step rehearses again at its next call"
            )
            owner.unkept = True
            owner.forget_manifest()
            return self.eager
        if self._builds >= BUILDS_PER_KERNEL:
            # shapes that keep changing (a layer called at every new length): torch.compile's
            # dynamic shapes compile once for all of them, a package per shape would not
            owner.why_not[self.name] = (f"more than {BUILDS_PER_KERNEL} argument signatures "
                                        "built in this process: torch.compile's dynamic shapes")
            return None
        self._builds += 1
        what = f"coconet: building fused kernel {owner.label}.{self.name} for its shapes"
        try:
            with phase(what, why=f"once: kept in {directory} for later runs",
                       enabled=owner.announce, file=sys.stderr):  # fmt: skip
                built = aot.build(self.eager, args, directory, name, _INDUCTOR)
        except Exception as exc:  # noqa: BLE001 - torch.compile runs it instead, and says why
            owner.why_not[self.name] = headline(exc)
            return None
        owner.built += 1
        self._names[sig] = name
        return built


class KernelSet:
    """The kernels of one generated module, reachable as attributes: ``kernels.fused_1(...)``.

    ``aot_dir``: where the kernels' AOTInductor packages live (``<build key>/kernels``); None:
    torch.compile only. ``label`` names the kernels in what is printed and on disk (the
    program's name). ``announce``: print a line (to stderr) when a kernel is built, with its
    time; a rank other than 0 stays quiet."""

    def __init__(self, functions: Mapping[str, Callable], *, fused: bool,
                 aot_dir: str | Path | None = None, label: str = "kernels",
                 announce: bool = True) -> None:  # fmt: skip
        self.fused = fused
        self.aot_dir = Path(aot_dir) if fused and aot_dir is not None else None
        self.label = label
        self.announce = announce
        self.first_call_seconds: dict[str, float] = {}
        self.built = 0  # packages built by this process
        self.loaded = 0  # ... found on disk
        self.why_not: dict[str, str] = {}  # kernel -> why it runs under torch.compile instead
        self.rehearsals = 0  # rehearsals recorded (``recording``): none when ``preload`` did
        self.recorded: list[tuple[_Kernel, tuple]] | None = None  # calls of a rehearsal
        self._pending: list[tuple[_Kernel, tuple]] | None = None  # ... to compile
        # a kept rehearsal's outcome (``keep_manifest``, ``preload``)
        self.manifest: Path | None = None
        self.preloaded: dict[str, aot.Package] = {}
        self.no_builds = False  # a step that skipped its rehearsal: never build inside it
        # a call under ``no_builds`` found no kept package (it ran eagerly): the step rehearses
        # at its next call (``CompiledStep``), where the package is built outside any collective
        self.unkept = False
        self._replayed: set[str | None] = set()  # the packages compile_recorded's calls ran
        self._kernels = {name: _Kernel(name, fn, self) for name, fn in functions.items()}

    @contextlib.contextmanager
    def recording(self):
        """Within it, every kernel runs eagerly and its arguments are kept (a rehearsal)."""
        self.recorded = []
        self.rehearsals += 1
        try:
            yield
        except BaseException:
            self.recorded = None
            raise
        self._pending = self.recorded
        self.recorded = None

    def compile_recorded(self, announce: bool | None = None) -> None:
        """Replay the rehearsal's kernel calls through the compiled kernels (loading, building or
        compiling each for the arguments it was called with); the results are dropped.
        ``announce``: as the constructor's, for this replay."""
        if announce is not None:
            self.announce = announce
        calls, self._pending = self._pending or [], None
        names = set()
        for kernel, args in calls:
            kernel(*args)
            names.add(kernel.package_name(args))
        self._replayed = names

    def manifest_for(self, identity: str) -> Path | None:
        """Where the outcome of this step's rehearsal is kept, for ``identity`` (the step's
        identity, this rank and the sizes it runs at: what fixes its kernels' arguments); None
        without packages."""
        if self.aot_dir is None:
            return None
        digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
        return self.aot_dir / f"{self.label}.{digest}{_MANIFEST}"

    def preload(self, identity: str) -> bool:
        """Load the packages a rehearsal of this step kept (``keep_manifest``), and set
        ``no_builds``; False (nothing set) when there is no such record or a package it names
        is gone."""
        self.manifest = self.manifest_for(identity)
        if self.manifest is None:
            return False
        try:
            names = self.manifest.read_text().split()
        except OSError:
            return False
        loaded = {}
        for name in names:
            package = aot.load(self.aot_dir, name)
            if package is None:
                return False
            loaded[name] = package
        self.preloaded, self.no_builds = loaded, True
        return True

    def keep_manifest(self) -> None:
        """After ``compile_recorded``: record the packages its calls ran, when every call ran
        one (a call under torch.compile would compile inside a step that skips its rehearsal),
        at ``manifest`` (set by ``preload``); written whole or not at all."""
        names = self._replayed
        if self.manifest is None or not names or None in names:
            return
        tmp = self.manifest.with_name(f"{self.manifest.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text("".join(f"{n}\n" for n in sorted(names)))
            os.replace(tmp, self.manifest)
        except OSError:
            return  # a read-only cache: the next process rehearses, as before
        prune(self.aot_dir, max_files=MAX_MANIFESTS, max_bytes=1 << 20, suffix=_MANIFEST)

    def forget_manifest(self) -> None:
        """Remove the kept record (its packages did not fit this process's arguments)."""
        if self.manifest is not None:
            with contextlib.suppress(OSError):
                self.manifest.unlink()

    def __getattr__(self, name: str) -> _Kernel:
        kernels = self.__dict__.get("_kernels", {})
        if name in kernels:
            return kernels[name]
        raise AttributeError(f"no fused kernel named {name!r}; kernels: {sorted(kernels)}")

    def __len__(self) -> int:
        return len(self._kernels)

    def __repr__(self) -> str:
        mode = "compiled" if self.fused else "eager"
        return f"KernelSet({', '.join(self._kernels)}; {mode})"
