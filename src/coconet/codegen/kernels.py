"""Fused kernels: each ``fuse`` group's computation as one function, compiled with torch.compile.

The generated module defines every kernel as plain Python over torch ops (``KERNELS``). Here they
are wrapped with ``torch.compile`` (Inductor: C++/OpenMP on CPU, Triton on GPU), which caches its
compiled artifacts on disk (torch's own FX-graph cache, by default under
``/tmp/torchinductor_<user>``), so a second process pays a fraction of the first compile. With
``fused=False`` the same functions run eagerly, op by op, which is what to debug with.

Compilation happens on a kernel's first call, with the shapes it sees there; the time that first
call took is kept in ``KernelSet.first_call_seconds`` so compile costs can be reported. A step
compiles its kernels outside its collectives (so that a slow compile never counts against a
peer's timeout): ``recording()`` runs a rehearsal of the step with every kernel eager and keeps
each call's arguments, and ``compile_recorded()`` then replays those calls through the compiled
kernels, which compiles them for exactly the shapes, strides and aliasing of the real step.

Measured on the 2-core development machine (torch 2.13 CPU, one process, Adam's update fused into
one kernel over 1M float32 elements): the first call compiles in ~15.5 s with an empty Inductor
cache and ~2.6 s with a warm one, plus ~3.3 s once per process to import torch's compiler. Two
ranks compiling at once on an empty cache take ~30 s each. After that a step runs the kernel in
~8 ms against ~17 ms for the same ops eagerly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping

import torch

__all__ = ["KernelSet"]

# Inductor computes 16-bit values in float32 and by default skips the rounding of a cast to a
# 16-bit dtype whose result is widened again (``x.to(bfloat16).to(float32)`` becomes ``x``):
# more precise, and not what the program says. A 16-bit reduction rounds once at its end (the
# simulator's ``reduce_values``) and a fused kernel that reads it widened must see the rounded
# value, bit for bit the simulator's; float32 kernels are unaffected.
_INDUCTOR = {"emulate_precision_casts": True}


class _Kernel:
    """One kernel, timing its first call (which includes torch.compile's work)."""

    def __init__(self, name: str, fn: Callable, eager: Callable, owner: KernelSet) -> None:
        self.name = name
        self.fn = fn
        self.eager = eager
        self.owner = owner

    def __call__(self, *args):
        recorded = self.owner.recorded
        if recorded is not None:  # a rehearsal: eager, keeping the arguments for the compile
            recorded.append((self, args))
            return self.eager(*args)
        if self.name in self.owner.first_call_seconds:
            return self.fn(*args)
        t0 = time.perf_counter()
        out = self.fn(*args)
        self.owner.first_call_seconds[self.name] = time.perf_counter() - t0
        return out


class KernelSet:
    """The kernels of one generated module, reachable as attributes: ``kernels.fused_1(...)``."""

    def __init__(self, functions: Mapping[str, Callable], *, fused: bool) -> None:
        self.fused = fused
        self.first_call_seconds: dict[str, float] = {}
        self.recorded: list[tuple[_Kernel, tuple]] | None = None  # calls of a rehearsal
        self._pending: list[tuple[_Kernel, tuple]] | None = None  # ... to compile
        self._kernels: dict[str, _Kernel] = {}
        for name, fn in functions.items():
            compiled = (torch.compile(fn, dynamic=None, fullgraph=False, options=_INDUCTOR)
                        if fused else fn)  # fmt: skip
            self._kernels[name] = _Kernel(name, compiled, fn, self)

    @contextlib.contextmanager
    def recording(self):
        """Within it, every kernel runs eagerly and its arguments are kept (a rehearsal)."""
        self.recorded = []
        try:
            yield
        except BaseException:
            self.recorded = None
            raise
        self._pending = self.recorded
        self.recorded = None

    def compile_recorded(self) -> None:
        """Replay the rehearsal's kernel calls through the compiled kernels (compiling each for
        the shapes it was called with); the results are dropped."""
        calls, self._pending = self._pending or [], None
        for kernel, args in calls:
            kernel(*args)

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
