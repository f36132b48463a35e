"""A producer process's drain on SIGTERM or SIGINT, bounded by the grace period.

A preemption notice, a Slurm requeue (``scancel``, ``--signal``) or a Kubernetes pod deletion
sends SIGTERM, then SIGKILL once its own grace runs out. On the first SIGTERM or SIGINT the
producer drains (``Producer.request_stop``): it claims nothing more, aborts every request
it has in flight by exact rid (each aborted reply carries every token generated so far, and
is applied to its sample), completes the groups whose samples are all final and yields the
others as partials with all their tokens, then exits 0. The aborted requests get
``Producer.stop_abort_s`` (at most half of ``timing.grace_period_s``) to come back; one that
does not is cancelled and its sample keeps its earlier segments.

The whole drain ends within ``timing.grace_period_s`` of the first signal. Past it (a hung
filesystem, a reward call that never returns) the process exits at once with
``EXIT_DRAIN_OVERRUN`` (3), as a kill would: every group handed back so far is durable (each
hand-back is one atomic publish), the leases not handed back stay until the grantor expires
them (``queue.lease_timeout_s``) and those tasks resume from their last saved partial.

A second SIGTERM is logged and the drain goes on (a launcher may repeat SIGTERM; the grace
period already bounds the drain). A second SIGINT (Ctrl-C again at a terminal) exits at once
with ``EXIT_INTERRUPTED`` (130), keeping what the drain handed back so far, as above.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: exit status of a drain still running at the end of the grace period
EXIT_DRAIN_OVERRUN = 3
#: exit status of a second SIGINT during the drain (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130


def hard_exit(code: int) -> None:
    """End the process now, whatever its threads are blocked in (``os._exit``), after
    flushing what it printed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class Drain:
    """One drain of one producer process: begun once (a signal, ``--max-seconds``, stdin
    closed), bounded by ``grace_s``, ended by ``finish`` when ``run()`` returned."""

    def __init__(self, request_stop: Callable[[], None], grace_s: float, *, who: str,
                 exit: Callable[[int], None] = hard_exit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._request_stop = request_stop
        self.grace_s = grace_s
        self.who = who
        self._exit = exit
        self._clock = clock
        #: when the drain began (None: it has not)
        self.began_at: float | None = None
        #: what began it
        self.why = ""
        self._finished = threading.Event()
        self._timer: threading.Timer | None = None

    @property
    def draining(self) -> bool:
        return self.began_at is not None and not self._finished.is_set()

    def begin(self, why: str) -> None:
        """Start the drain (once; a later call does nothing) and its grace-period watchdog."""
        if self.began_at is not None:
            return
        self.began_at = self._clock()
        self.why = why
        log.warning("%s: %s: draining (every request in flight aborted and its tokens kept, "
                    "every held group handed back) within the %.0f s grace period",
                    self.who, why, self.grace_s)
        if math.isfinite(self.grace_s):
            self._timer = threading.Timer(self.grace_s, self._overrun)
            self._timer.daemon = True
            self._timer.start()
        self._request_stop()

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        """The SIGTERM / SIGINT handler: the first begins the drain (see the module)."""
        name = signal.Signals(signum).name
        if self.began_at is None:
            self.begin(name)
        elif self._finished.is_set():
            return
        elif signum == signal.SIGINT:
            log.error("%s: SIGINT during the drain: exiting now (%d); the groups handed back "
                      "so far are saved, the other leases expire after the lease timeout and "
                      "their tasks resume from their last saved partial", self.who,
                      EXIT_INTERRUPTED)
            self._exit(EXIT_INTERRUPTED)
        else:
            left = self.grace_s - (self._clock() - self.began_at)
            log.warning("%s: %s again: the drain goes on (at most %.0f s left of the grace "
                        "period)", self.who, name, max(left, 0.0))

    def finish(self) -> float | None:
        """``run()`` returned: the watchdog stands down. Returns the drain's length in
        seconds (None: no drain began)."""
        self._finished.set()
        if self._timer is not None:
            self._timer.cancel()
        if self.began_at is None:
            return None
        took = self._clock() - self.began_at
        log.info("%s: drained in %.2f s (%s)", self.who, took, self.why)
        return took

    def _overrun(self) -> None:
        if self._finished.is_set():
            return
        log.error("%s: the drain did not end within the %.0f s grace period "
                  "(timing.grace_period_s); exiting with %d: the groups handed back so far are "
                  "saved, the other leases expire after the lease timeout and their tasks "
                  "resume from their last saved partial", self.who, self.grace_s,
                  EXIT_DRAIN_OVERRUN)
        self._exit(EXIT_DRAIN_OVERRUN)

    @contextlib.contextmanager
    def signals(self) -> Iterator[Drain]:
        """SIGTERM and SIGINT handled by ``on_signal`` (main thread only) while inside."""
        old = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)
