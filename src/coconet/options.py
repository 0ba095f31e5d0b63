"""The options and enums every layer reads: ``CompileOptions`` (what ``coconet.compile``
generates and how a compiled step runs), ``CommOptions`` (how a communicator runs), and the names
of transports and collective algorithms (``TransportKind``, ``TransportPolicy``, ``Algorithm``,
``AlgorithmPolicy``).

A module of its own, below codegen, runtime and tune: the compiler, the emitter (which names the
transport a fused collective runs on), the runtime and the cost model all speak of transports and
algorithms, and none of them may import the runtime's implementation to do so. Nothing here is
read from the environment.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coconet.errors import CompileOptionError, ConfigError
from coconet.ir.ops import Op

__all__ = [
    "Algorithm",
    "AlgorithmPolicy",
    "CommOptions",
    "CommitMode",
    "CompileOptions",
    "ParamStorage",
    "TransportKind",
    "TransportPolicy",
]


class CommitMode(str, enum.Enum):
    """How a step's updates reach the caller's tensors, once every rank has succeeded."""

    COPY = "copy"  # copied into the caller's tensors (views of them see the new values)
    # The caller's tensor takes the new value's storage (``Tensor.set_``): no copy. Only for
    # whole tensors that nothing else views (optimizer state the caller owns): a view made
    # before the step keeps the old values. Others are copied.
    SWAP = "swap"


class Rounding(str, enum.Enum):
    """How a ``coconet.optim`` optimizer rounds the float32 master copy of 16-bit parameters
    into them."""

    NEAREST = "nearest"  # round to nearest even (``Tensor.to``): the default, as everyone's
    # up or down at random, with the probabilities of the distance to each (unbiased: small
    # updates survive on average); the random bits are coconet's counter-based ones, keyed by
    # the element's place in the bucket and the step: the same on every rank and schedule
    STOCHASTIC = "stochastic"


class ParamStorage(str, enum.Enum):
    """Where a ``coconet.optim`` optimizer keeps the parameters it packs into a bucket."""

    # Each rank its own copy (as torch and DDP do): the step's all_gather copies every peer's new
    # slice into it.
    PER_RANK = "per-rank"
    # One copy per host, which every rank of the host maps, double-buffered
    # (``coconet.runtime.replica``): each rank writes only its slice of the new parameters and the
    # commit flips the buffers, so there is no all_gather and no commit copy. Every rank of the
    # host sees one memory (a write on one rank is a write on all), and the parameters' ``.data``
    # moves between the two buffers at every step: views taken before a step go stale. Needs the
    # ranks on one host over shared memory and a schedule that gathers in one pass.
    HOST_SHARED = "host-shared"


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
      ``SWAP`` (state tensors the caller owns take the new values' storage: no copy);
    - ``kernel_packages``: run each fused kernel from a package built ahead of time and kept on
      disk (``coconet.codegen.aot``): built once per kernel and argument shapes (about as long
      as a cold torch.compile, ~10 s here), loaded by every later process in milliseconds, so
      a script's next run starts at once; False: torch.compile in every process (its own
      cache brings a later process's compile down to a few seconds). None (the default) is
      True unless the environment has ``COCONET_KERNEL_PACKAGES=0``.

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
    kernel_packages: bool | None = None

    def __post_init__(self) -> None:
        if self.kernel_packages is None:
            off = os.environ.get(KERNEL_PACKAGES_ENV, "1").strip().lower() in ("0", "false", "no")
            object.__setattr__(self, "kernel_packages", not off)
        try:
            object.__setattr__(self, "commit", CommitMode(self.commit))
        except ValueError:
            raise CompileOptionError(
                f"unknown commit mode {self.commit!r}",
                op="CompileOptions",
                hint=f"commit is one of {[m.value for m in CommitMode]}",
            ) from None
        for flag in ("fused_kernels", "check_every_step", "commit_vote", "check_replicated",
                     "kernel_packages"):
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
# The environment's say on ``CompileOptions.kernel_packages`` when it is left None ("0": off).
KERNEL_PACKAGES_ENV = "COCONET_KERNEL_PACKAGES"


# -- transports and collective algorithms ------------------------------------------------------


class TransportKind(str, enum.Enum):
    """What runs a group's collectives (a ``str`` enum: ``CommOptions(transport=...)`` takes
    either form)."""

    TORCH_DISTRIBUTED = "torch.distributed"  # gloo on CPU, NCCL on GPU, across hosts
    SHARED_MEMORY = "shared memory"  # symmetric memory among the ranks of one host
    # shared memory inside each host, torch.distributed between hosts (coconet.runtime.hierarchy)
    HIERARCHICAL = "hierarchical"


class TransportPolicy(str, enum.Enum):
    """Which transport a group uses (``CommOptions.transport``)."""

    # shared memory when every rank of the group is on one host; hierarchical when it spans
    # hosts (in two levels where each holds as many of its ranks, through one leader per host
    # otherwise) and reductions need not be in rank order (algorithms is not "exact"); else
    # torch.distributed
    AUTO = "auto"
    SHARED_MEMORY = "shared memory"  # shared memory, or a ConfigError when the group spans hosts
    TORCH_DISTRIBUTED = "torch.distributed"  # always torch.distributed (flat across hosts)
    # as auto, but a ConfigError for a group over hosts that cannot run hierarchically
    # (algorithms="exact", or a host's ranks of the group out of increasing order)
    HIERARCHICAL = "hierarchical"


class Algorithm(str, enum.Enum):
    """How a transport runs a collective (not every op has every algorithm). A ``str`` enum:
    ``"all_to_all"`` and ``Algorithm.ALL_TO_ALL`` are the same."""

    NATIVE = "native"  # the library's own collective
    ALL_REDUCE = "all_reduce"  # built from the library's all_reduce (fast on gloo)
    ALL_TO_ALL = "all_to_all"  # built from all_to_all; reduces in rank order: exact

    def __str__(self) -> str:
        return self.value


class AlgorithmPolicy(str, enum.Enum):
    """Which algorithm the communicator uses when a policy, not a fixed choice, is given. A
    ``str`` enum: ``"auto"`` and ``AlgorithmPolicy.AUTO`` are the same policy."""

    AUTO = "auto"  # measure once per size class and keep the fastest (the same on every rank)
    NATIVE = "native"  # the library's own collective always
    EXACT = "exact"  # rank-ordered reductions: results bitwise equal to the simulator's

    def __str__(self) -> str:
        return self.value


class _ExactAlgorithms(Protocol):
    """What ``CommOptions.fixed_algorithm`` asks of a transport."""

    def exact_algorithm(self, op: Op) -> Algorithm | None: ...


# -- the communicator's options ----------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class CommOptions:
    """How the communicator runs.

    - ``timeout``: seconds a collective may wait for a peer before failing with ``RuntimeFault``;
    - ``algorithms``: an ``AlgorithmPolicy`` (or its name): ``AUTO`` (measure once per size
      class, cache the choice), ``NATIVE`` (the library's own collective always), ``EXACT`` (the
      forms that reduce in rank order: results bitwise equal to the simulator's); or a mapping
      that fixes an ``Algorithm`` per op, such as ``{Op.REDUCE_SCATTER: Algorithm.ALL_TO_ALL}``
      (names are accepted too: ``{"reduce_scatter": "all_to_all"}``; other ops stay native);
    - ``cache_dir``: the base of coconet's caches; the measured choices are kept under its
      build-keyed subdirectory (``coconet.cache.keyed_cache_dir``);
    - ``measure_reps``: timed repetitions per candidate when measuring (2-3x that for the small
      size classes, whose timings are noisier);
    - ``keep_buffers_mapped``: ``init()`` tunes glibc's malloc so that the large buffers a step
      allocates stay mapped between steps instead of page-faulting every step (process-wide;
      see ``coconet.runtime.allocator``), and ``spawn`` starts its ranks with glibc's
      per-thread cache off (``GLIBC_TUNABLES``, which only a process's start reads). False
      leaves the allocator alone;
    - ``flight_recorder``: how many of its last calls each communicator keeps on this rank for
      when the job stops (``coconet.runtime.flight``: dumped, and a verdict in the error, when a
      call fails); 0 turns it off.

    Every field is checked when the options are made: a bad one is a ``ConfigError`` there, not
    a failure at the job's first collective.
    """

    timeout: float = 60.0
    algorithms: AlgorithmPolicy | Mapping[Op, Algorithm] = AlgorithmPolicy.AUTO
    cache_dir: str | Path | None = None
    measure_reps: int = 5
    keep_buffers_mapped: bool = True
    transport: TransportPolicy = TransportPolicy.AUTO
    flight_recorder: int = 1024

    def __post_init__(self) -> None:
        # Checked here, where the options are written, not at the first collective of a job.
        try:
            object.__setattr__(self, "transport", TransportPolicy(self.transport))
        except ValueError:
            raise ConfigError(
                f"unknown transport {self.transport!r}",
                op="CommOptions",
                hint=f"use one of {[p.value for p in TransportPolicy]}",
            ) from None
        if not _is_number(self.timeout) or not self.timeout > 0:
            raise ConfigError(
                f"timeout must be a positive number of seconds, got {self.timeout!r}",
                op="CommOptions",
                hint="CommOptions(timeout=60.0)",
            )
        object.__setattr__(self, "algorithms", _policy(self.algorithms))
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ConfigError(
                f"cache_dir must be a path or None, got {self.cache_dir!r}",
                op="CommOptions",
                hint="CommOptions(cache_dir='~/.cache/coconet'); None is the default place",
            )
        reps = self.measure_reps
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise ConfigError(
                f"measure_reps must be an int >= 1, got {reps!r}",
                op="CommOptions",
                hint="CommOptions(measure_reps=5): timed repetitions per candidate algorithm",
            )
        if not isinstance(self.keep_buffers_mapped, bool):
            raise ConfigError(
                f"keep_buffers_mapped must be True or False, got {self.keep_buffers_mapped!r}",
                op="CommOptions",
                hint="CommOptions(keep_buffers_mapped=False) leaves malloc alone",
            )
        size = self.flight_recorder
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(
                f"flight_recorder must be an int >= 0 (calls kept), got {size!r}",
                op="CommOptions",
                hint="CommOptions(flight_recorder=1024); 0 turns the flight recorder off",
            )

    def fixed_algorithm(self, op: Op, transport: _ExactAlgorithms) -> Algorithm | None:
        """The algorithm these options fix for ``op`` (None: measure and choose)."""
        if isinstance(self.algorithms, Mapping):
            return self.algorithms.get(op, Algorithm.NATIVE)
        if self.algorithms is AlgorithmPolicy.NATIVE:
            return Algorithm.NATIVE
        if self.algorithms is AlgorithmPolicy.EXACT:
            return transport.exact_algorithm(op) or Algorithm.NATIVE
        return None


def _policy(value: Any) -> AlgorithmPolicy | dict[Op, Algorithm]:
    try:
        if isinstance(value, Mapping):
            return {Op(op): Algorithm(a) for op, a in value.items()}
        return AlgorithmPolicy(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"unknown algorithm policy {value!r} ({exc})",
            op="CommOptions",
            hint=f"use one of {[p.value for p in AlgorithmPolicy]} or a mapping "
            f"{{op: algorithm}} with algorithms from {[a.value for a in Algorithm]}",
        ) from None
