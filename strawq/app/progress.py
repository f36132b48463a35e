"""Progress of a long command: a line redrawn in place on a terminal, log lines elsewhere.

``Progress(what, stream)`` is called as ``progress(done, total)``. On a TTY it redraws one
line (``releasing: 4,500 / 20,000 rows (22 %)``) at most every ``tty_every_s``; otherwise
(a log file, a CI job, a pipe) it writes a plain line at most every ``log_every_s``, so a
20,000-row release on a slow mount says it is working without flooding the log.
``done()`` ends the line. A quiet command (``-q``) passes no stream: nothing is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """Throttled progress lines for ``done`` of ``total`` items."""

    def __init__(self, what: str, stream: TextIO | None, *, unit: str = "rows",
                 tty_every_s: float = 0.2, log_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.stream = stream
        self.unit = unit
        self.clock = clock
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.every_s = tty_every_s if self.tty else log_every_s
        self._start = clock()
        self._last = self._start
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self.stream is None or now - self._last < self.every_s:
            return
        self._last = now
        pct = f" ({100 * done // total} %)" if total else ""
        line = (f"{self.what}: {done:,} / {total:,} {self.unit}{pct}, "
                f"{now - self._start:.0f} s")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        """End the redrawn line (on a terminal) so the next output starts on its own."""
        if self.stream is not None and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
