"""``CompileOptions``: everything that changes what ``coconet.compile`` generates and how a
compiled step runs (a module of its own: the compiler and the runtime's ``CompiledStep`` both read
it, and nothing is read from the environment instead)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CompileOptions"]


@dataclass(frozen=True)
class CompileOptions:
    """What ``coconet.compile`` does.

    - ``fused_kernels``: compile each fused group with torch.compile (False: run it eagerly, op by
      op, for debugging; the results are the same up to floating-point contraction);
    - ``device``: ``"cpu"`` or ``"cuda"``; None takes the communicator's (cpu on gloo);
    - ``cache_dir``: the base of coconet's caches (generated modules, measured collective
      choices, Inductor's kernels), each under a subdirectory keyed by torch version and CPU
      (``coconet.cache``); None is ``$XDG_CACHE_HOME/coconet`` or ``~/.cache/coconet``;
    - ``check_every_step``: exchange the program hash and input shapes at every step (one tiny
      all_reduce), not only at the first; with False, shapes must not change between steps;
    - ``commit_vote``: before committing updates, all ranks confirm that the step succeeded
      everywhere (one tiny all_reduce), so that no rank commits a step that failed elsewhere;
    - ``donate``: names of inputs the step may overwrite, as DDP does with gradients: a donated
      input read only by a collective is reduced in place instead of on a copy. Its content is
      undefined after the step, even after a failed one (the other inputs stay untouched).
    """

    fused_kernels: bool = True
    device: str | None = None
    cache_dir: str | Path | None = None
    check_every_step: bool = True
    commit_vote: bool = True
    donate: tuple[str, ...] = ()
