"""Ctrl-C held back while a step commits, so that a step is applied on every rank or on none.

A compiled step that updates tensors is two-phase across the ranks: every rank finishes the
step and votes (nothing is written before every rank is ready to write), then every rank writes.
A ``KeyboardInterrupt`` raised between the vote and the last write would leave this rank half
written, or written where a peer was not. So from the moment a rank starts to vote until its
commit ends, SIGINT is held: the handler in force is replaced by one that remembers the signal,
and the remembered signal is handed to that handler once the commit is over. A ``KeyboardInterrupt``
then comes out of the step with a note saying whether the step was committed (every rank
committed it) or not.

The wait this puts on a Ctrl-C is bounded: the vote and the writes take microseconds to
milliseconds, and every wait in them has the communicator's deadline. A second Ctrl-C while one
is held is not held: it is handed over at once (the way out of a rank stuck past its deadline),
at the risk the first one avoids, and the note says so.

``coconet.optim`` keeps the hold over all of a step's buckets (``span``): once the first bucket
starts to commit, a Ctrl-C waits until the last bucket has committed, so an optimizer step with
several buckets is not split by one either.

Signal handlers belong to the process and run on its main thread, so the hold is the process's
too (``_HOLD``); on another thread a step cannot be interrupted by SIGINT and nothing is held.
SIG_DFL and SIG_IGN are left as they are (nothing Python can hold).
"""

from __future__ import annotations

import _signal  # the signal module's C core: its Python wrappers build enums, ~2 us a call
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["hold", "span"]

_SIGINT = int(signal.SIGINT)


class _Hold:
    """The process's hold of SIGINT (one: signal handlers are per process)."""

    def __init__(self) -> None:
        self.depth = 0  # holds open (a step between its vote and the end of its commit)
        self.spans = 0  # spans open (an optimizer step): keep holding between their holds
        self.previous: Any = None  # the handler in force before the hold, None: not installed
        self.pending: tuple[int, Any] | None = None  # the held signal and its frame
        self.note = ""  # what the step whose commit ended last did (for the KeyboardInterrupt)

    def install(self) -> None:
        if self.previous is not None or threading.current_thread() is not threading.main_thread():
            return
        current = _signal.getsignal(_SIGINT)
        if not callable(current):
            return  # SIG_DFL, SIG_IGN or a handler not set from Python: nothing to hold
        self.previous = current
        _signal.signal(_SIGINT, self._held)

    def _held(self, signum: int, frame: Any) -> None:
        if self.pending is None:
            self.pending = (signum, frame)
            return
        # a second Ctrl-C: handed over now (the way out of a rank that will not finish)
        self.pending = None
        try:
            self.previous(signum, frame)
        except BaseException as interrupt:
            interrupt.add_note("coconet: a second Ctrl-C arrived while a step was committing and "
                               "was not held: this rank may be half committed; restore a "
                               "checkpoint")
            raise

    def release(self, failing: BaseException | None) -> None:
        """Stop holding; hand a held signal to the handler it was meant for."""
        if self.previous is None:
            return
        pending, self.pending = self.pending, None
        previous, self.previous = self.previous, None
        _signal.signal(_SIGINT, previous)
        if pending is None:
            return
        try:
            previous(*pending)
        except BaseException as interrupt:
            interrupt.add_note(self.note)
            if failing is not None:
                failing.add_note("coconet: a Ctrl-C arrived while this step was committing")
                raise interrupt from failing
            raise


_HOLD = _Hold()


class hold:  # noqa: N801 - used as a context manager, named as the contextlib ones are
    """Hold SIGINT for the block (the vote and the commit of a step): a Ctrl-C in it is handed
    over when the block ends, with ``outcome()`` (what the step did: committed, declined) as a
    note, or when the enclosing ``span`` ends. (A class, not a generator: it runs at every step
    that updates, and a generator's context costs a few microseconds more.)"""

    __slots__ = ("outcome",)

    def __init__(self, outcome: Callable[[], str]) -> None:
        self.outcome = outcome

    def __enter__(self) -> None:
        _HOLD.depth += 1
        _HOLD.install()

    def __exit__(self, kind: Any, failing: BaseException | None, tb: Any) -> None:
        _HOLD.depth -= 1
        if _HOLD.pending is not None:
            _HOLD.note = self.outcome()
        if _HOLD.depth == 0 and _HOLD.spans == 0:
            _HOLD.release(failing)


class span:  # noqa: N801 - a context manager, named as the contextlib ones are
    """Keep holding from the first ``hold`` inside the block to its end (an optimizer step's
    buckets: none is left uncommitted because a Ctrl-C came after an earlier one committed).
    Before the first hold nothing is held."""

    __slots__ = ("outcome",)

    def __init__(self, outcome: Callable[[], str]) -> None:
        self.outcome = outcome

    def __enter__(self) -> None:
        _HOLD.spans += 1

    def __exit__(self, kind: Any, failing: BaseException | None, tb: Any) -> None:
        _HOLD.spans -= 1
        if _HOLD.pending is not None:
            _HOLD.note = self.outcome()
        if _HOLD.depth == 0 and _HOLD.spans == 0:
            _HOLD.release(failing)
