"""``CompileOptions``: everything that changes what ``coconet.compile`` generates and how a
compiled step runs (a module of its own: the compiler and the runtime's ``CompiledStep`` both read
it, and nothing is read from the environment instead)."""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from coconet.errors import CompileOptionError

__all__ = ["CommitMode", "CompileOptions"]


class CommitMode(str, enum.Enum):
    """How a step's updates reach the caller's tensors, once every rank has succeeded."""

    COPY = "copy"  # copied into the caller's tensors (views of them see the new values)
    # The caller's tensor takes the new value's storage (``Tensor.set_``): no copy. Only for
    # whole tensors that nothing else views (optimizer state the caller owns): a view made
    # before the step keeps the old values. Others are copied.
    SWAP = "swap"


@dataclass(frozen=True)
class CompileOptions:
    """What ``coconet.compile`` does.

    - ``fused_kernels``: compile each fused group with torch.compile (False: run it eagerly, op by
      op, for debugging; the results are the same up to floating-point contraction);
    - ``device``: ``"cpu"`` or ``"cuda"``; None takes the communicator's (cpu on gloo);
    - ``cache_dir``: the base of coconet's caches (generated modules, measured collective
      choices, Inductor's kernels), each under a subdirectory keyed by torch version and CPU
      (``coconet.cache``); None is ``$XDG_CACHE_HOME/coconet`` or ``~/.cache/coconet``;
    - ``check_every_step``: compare input shapes across ranks at every step, not only at the
      first; with False, shapes must not change between steps (a change fails every rank). The
      per-step agreement on the program, the options, which compiled step it is, its call count
      and the Replicated scalars runs either way (one tiny all_reduce before any data moves);
    - ``commit_vote``: before committing updates, all ranks confirm that the step succeeded
      everywhere (one tiny all_reduce), so that no rank commits a step that failed elsewhere;
    - ``check_replicated``: also compare a checksum of every Replicated tensor input across the
      ranks at every step (a pass over those inputs' bytes), so that parameters that drifted
      apart fail every rank instead of staying different; off by default;
    - ``compile_timeout``: seconds the ranks wait for each other to compile a step's fused
      kernels, at its first call (12-16 s with an empty Inductor cache). The kernels are
      compiled outside the step's collectives, after a rehearsal of the step that runs them
      eagerly, and the ranks agree that every one is ready before the step runs: a slow
      compile never counts against ``CommOptions.timeout``;
    - ``donate``: names of inputs the step may overwrite, as DDP does with gradients: a donated
      input read only by a collective is reduced in place instead of on a copy. Its content is
      undefined after the step, even after a failed one (the other inputs stay untouched);
    - ``commit``: how updates reach the caller's tensors (``CommitMode``): ``COPY`` (default) or
      ``SWAP`` (state tensors the caller owns take the new values' storage: no copy).

    Every field is checked when the options are made (a ``CompileOptionError``); the donated
    names are checked against the program's inputs by ``compile``.
    """

    fused_kernels: bool = True
    device: str | None = None
    cache_dir: str | Path | None = None
    check_every_step: bool = True
    commit_vote: bool = True
    check_replicated: bool = False
    compile_timeout: float = 600.0
    donate: tuple[str, ...] = ()
    commit: CommitMode = CommitMode.COPY

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "commit", CommitMode(self.commit))
        except ValueError:
            raise CompileOptionError(
                f"unknown commit mode {self.commit!r}",
                op="CompileOptions",
                hint=f"commit is one of {[m.value for m in CommitMode]}",
            ) from None
        for flag in ("fused_kernels", "check_every_step", "commit_vote", "check_replicated"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise CompileOptionError(
                    f"{flag} must be True or False, got {value!r}",
                    op="CompileOptions",
                    hint=f"CompileOptions({flag}=False)",
                )
        t = self.compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise CompileOptionError(
                f"compile_timeout must be a positive number of seconds, got {t!r}",
                op="CompileOptions",
                hint="CompileOptions(compile_timeout=600.0)",
            )
        if self.device not in _DEVICES:
            raise CompileOptionError(
                f"unknown device {self.device!r}",
                op="CompileOptions",
                hint='device="cpu" or "cuda"; None takes the communicator\'s',
            )
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise CompileOptionError(
                f"cache_dir must be a path or None, got {self.cache_dir!r}",
                op="CompileOptions",
                hint="CompileOptions(cache_dir='~/.cache/coconet'); None is the default place",
            )
        donate = self.donate
        listed = isinstance(donate, Iterable) and not isinstance(donate, str)
        names = tuple(donate) if listed else ()
        if not listed or not all(isinstance(n, str) for n in names):
            raise CompileOptionError(
                f"donate takes a tuple of input names, got {self.donate!r}",
                op="CompileOptions",
                hint='donate=("g",)',
            )
        # Stored as a tuple: a list (or a generator, read once) would make the options unhashable.
        object.__setattr__(self, "donate", names)


_DEVICES = (None, "cpu", "cuda")
