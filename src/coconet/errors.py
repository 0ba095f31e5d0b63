"""The exceptions coconet raises, and the source location each one points at.

Every user-facing error is a ``CoconetError``. Errors about a program carry the op that failed, the
values involved, the user's own file and line (captured when the op was written) and a hint that
says what to do. They are plain exceptions: nothing here uses ``assert``.

The classes, by what went wrong:

- ``DSLError`` (``LayoutError``, ``ShapeError``, ``DTypeError``): a program that cannot be built.
  ``DSLValueError``, ``DSLTypeError`` and ``UnknownNameError`` are also ``ValueError``,
  ``TypeError`` and ``KeyError``: what ``Dim``, ``Sliced``, ``Mesh`` and ``Program.node`` raised
  before they raised coconet errors, so ``except KeyError`` around a lookup keeps working;
- ``DifferentiationError`` (a ``DSLError``): a program ``coconet.grad`` cannot differentiate;
- ``ScheduleError``: a schedule primitive that does not apply; ``SimulationError``: inputs that do
  not fit ``simulate``; ``CodegenError``: a program ``compile`` cannot turn into code;
- ``ConfigError``: a bad option or setup of the compiler or the runtime (``CompileOptionError``
  for ``compile``'s; ``ConfigValueError``, also a ``ValueError``, for a value out of range such as
  an optimizer's hyper-parameter; ``GradientError``, also a ``RuntimeError``, for a gradient an
  optimizer cannot step); ``RuntimeFault``: a fault of a running job (a dead or stalled peer).
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass

__all__ = [
    "CodegenError",
    "CoconetError",
    "CompileOptionError",
    "ConfigError",
    "ConfigValueError",
    "DSLError",
    "DSLTypeError",
    "DSLValueError",
    "DTypeError",
    "DifferentiationError",
    "GradientError",
    "LayoutError",
    "RuntimeFault",
    "ScheduleError",
    "ShapeError",
    "SimulationError",
    "SourceLoc",
    "UnknownNameError",
    "capture_loc",
    "headline",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class SourceLoc:
    """A place in the user's code: where a DSL op was written."""

    filename: str
    lineno: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def source_line(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()


def capture_loc() -> SourceLoc | None:
    """The innermost stack frame outside the coconet package and torch: the user's line.

    Frames of coconet itself are skipped so that an error raised deep inside a rule still points
    at the line the user wrote (``m1 = b1 * m + g``), not at coconet's internals; torch's own
    frames so that an error of a ``coconet.nn`` layer points at the user's ``model(x)``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if not _is_library_frame(frame):
            return SourceLoc(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def headline(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters: what a rank's abort
    tells its peers (short enough for the job's store), or why a fallback was taken."""
    text = str(exc).strip().splitlines()
    head = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return head if len(head) <= limit else head[: limit - 3] + "..."


def _is_library_frame(frame) -> bool:
    filename = frame.f_code.co_filename
    if os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
        return True
    # Code that dataclasses generate (the __init__ that calls a __post_init__ check) has no file
    # of its own ("<string>") but runs in the globals of the coconet module that defined the class;
    # dataclasses.replace(options, ...) calls that __init__ from the dataclasses module. Both are
    # on the way from the user's line to the check.
    module = frame.f_globals.get("__name__", "")
    if module == "dataclasses":
        return True
    # torch's own frames sit between the user's line and coconet's checks: its decorator
    # plumbing (``@torch.no_grad()`` on an optimizer's step), nn.Module's call machinery
    # (``model(x)`` -> ``_call_impl`` -> a layer's forward), ``torch.compiler.disable``'s
    # wrapper around a layer's call (torch/_dynamo/eval_frame.py), autograd's ``Function.apply``
    # and ``loss.backward()``, ``clip_grad_norm_``, a Sequential's loop. None of them is the
    # user's line: the user's is the one that called into torch.
    if module == "torch" or module.startswith("torch."):
        return True
    # a compiled step's generated module (``coconet.codegen.loader``: kept in the cache, or a
    # "<coconet generated ...>" file) is coconet's code, run on the way from the user's call
    if module.startswith("coconet_generated_"):
        return True
    return filename.startswith("<") and (module == "coconet" or module.startswith("coconet."))


class CoconetError(Exception):
    """Base of every error coconet raises on purpose.

    ``op`` names the operation, ``loc`` is the user's line, ``details`` lists the values involved
    (one per line) and ``hint`` says what to do about it.

    Errors about what the user wrote (every class but ``RuntimeFault``) that are raised without a
    ``loc`` (program-level checks such as "no outputs", bad ``simulate`` inputs, bad options)
    point at the innermost line of the user's own code on the stack: the ``Program(...)``,
    ``simulate(...)``, ``s.fuse(...)`` or ``CommOptions(...)`` call.
    """

    #: Fill in ``loc`` from the caller's stack when none is given.
    locate_caller = False

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        loc: SourceLoc | None = None,
        details: tuple[str, ...] | list[str] = (),
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.op = op
        if loc is None and self.locate_caller:
            loc = capture_loc()
        self.loc = loc
        self.details = tuple(details)
        self.hint = hint
        super().__init__(self._render())

    def __str__(self) -> str:
        # The rendered message, also for the subclasses that mix in KeyError (whose own __str__
        # would print the repr of the message, quotes and escaped newlines included).
        return self._render()

    def _render(self) -> str:
        head = f"{self.op}: {self.message}" if self.op else self.message
        lines = [head]
        if self.loc is not None:
            lines.append(f"  at {self.loc}")
            src = self.loc.source_line()
            if src:
                lines.append(f"    {src}")
        lines.extend(f"  {d}" for d in self.details)
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


class DSLError(CoconetError):
    """A program that cannot be built: misuse of the DSL."""

    locate_caller = True


class DSLValueError(DSLError, ValueError):
    """A DSL value given an argument of the right type but a value it cannot take
    (``Dim("1N")``, ``Mesh(tp=0)``, a rank outside the mesh). Also a ``ValueError``."""


class DSLTypeError(DSLError, TypeError):
    """A DSL value given an argument of the wrong type (``Dim(5)``, ``Sliced("0")``,
    ``Local("tp")``). Also a ``TypeError``."""


class UnknownNameError(DSLError, KeyError):
    """A name looked up where it does not exist: a program's value or input, a mesh axis.
    Also a ``KeyError``, so that ``except KeyError`` around a lookup keeps working."""


class LayoutError(DSLError):
    """Operands whose layouts (Local, Replicated, Sliced) cannot be combined by this op."""


class ShapeError(DSLError):
    """Operands whose shapes do not fit this op."""


class DTypeError(DSLError):
    """Operands whose element types do not fit this op."""


class DifferentiationError(DSLError):
    """A program ``coconet.grad`` cannot differentiate as asked: an input that is not a float
    tensor, an op without a gradient rule for these attributes, or a gradient whose layout the
    layout rules cannot express."""


class ScheduleError(CoconetError):
    """A schedule primitive that cannot be applied to this program, and why.

    Without a value's own line to point at, it points at the user's call of the primitive."""

    locate_caller = True


class SimulationError(CoconetError):
    """Inputs given to the simulator that do not fit the program."""

    locate_caller = True


class CodegenError(CoconetError):
    """A program or schedule the compiler cannot turn into code.

    Without a value's own line to point at, it points at the user's ``compile(...)`` call."""

    locate_caller = True


class ConfigError(CoconetError):
    """A bad option, argument or setup of the compiler or the runtime: ``CommOptions`` out of
    range, a step without a communicator, a mesh that does not fit the job. Nothing failed at run
    time and no peer is involved: fix the call (``RuntimeFault`` is for faults of a running job).
    """

    locate_caller = True


class ConfigValueError(ConfigError, ValueError):
    """A setting of the right type but a value it cannot take: an optimizer's hyper-parameter out
    of range (``lr=-1``, ``betas=(1.0, 0.9)``). Also a ``ValueError``, what ``torch.optim``
    raises for the same values, so ``except ValueError`` written for torch keeps working."""


class GradientError(ConfigError, RuntimeError):
    """A gradient a ``coconet.optim`` optimizer cannot step (sparse, or of another shape, dtype
    or device than its parameter). Also a ``RuntimeError``, what ``torch.optim`` raises for a
    sparse gradient."""


class CompileOptionError(ConfigError, CodegenError):
    """A bad option or argument of ``coconet.compile`` (``CompileOptions``): a ``ConfigError``,
    and a ``CodegenError`` since nothing could be compiled."""


class RuntimeFault(CoconetError):
    """A distributed step that failed: a dead or stalled rank, mismatched programs, bad inputs.

    Bad options and setup (no communicator, a mesh that does not fit the job) are ``ConfigError``.
    ``refused``: the step's agreement refused the call before any data moved (the same fault on
    every rank, or, for a step that communicates nothing, on this rank): it was not counted and
    the communicator stays usable.
    """

    refused = False
