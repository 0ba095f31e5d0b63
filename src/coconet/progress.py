"""What coconet's commands and examples print while they work: no phase is a silent wait.

``phase("training 2 ranks")`` prints what starts, then, while it runs, a line every few seconds
saying it is still at it (on a terminal: one line redrawn with ``\\r``; in a log or a pipe: plain
lines, never ``\\r`` frames), and when it ends how long it took. ``say`` prints one line at once
(flushed: a pipe would otherwise hold it back until the end). ``file=sys.stderr`` sends both
where a command's progress goes when its standard output is its result (``coconet show``).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["EVERY_S", "phase", "say"]

EVERY_S = 4.0  # at most this long without a line, below the 5 s a user waits in silence


def say(msg: str = "", file: TextIO | None = None) -> None:
    """Print ``msg`` now (to ``file``, standard output by default)."""
    print(msg, file=file or sys.stdout, flush=True)


class phase:  # noqa: N801 - used as a function: ``with phase("..."):``
    """A long step: announced, kept alive with a line every ``EVERY_S`` seconds, timed."""

    def __init__(self, what: str, *, why: str = "", every: float = EVERY_S,
                 enabled: bool = True, file: TextIO | None = None) -> None:  # fmt: skip
        self.what, self.why, self.every, self.enabled = what, why, every, enabled
        self.file = file or sys.stdout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tty = _isatty(self.file)
        self.began = 0.0

    def __enter__(self) -> phase:
        self.began = time.perf_counter()
        if self.enabled:
            say(f"{self.what}..." + (f" ({self.why})" if self.why else ""), self.file)
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            line = f"  ... {self.what}: {time.perf_counter() - self.began:.0f} s"
            if self._tty:
                self.file.write("\r" + line)
                self.file.flush()
            else:
                say(line, self.file)

    def __exit__(self, kind, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self._tty:
                self.file.write("\r\033[K")
            if kind is None:
                say(f"  done in {time.perf_counter() - self.began:.1f} s: {self.what}", self.file)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.began


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
