"""Group commit of a directory's fsync: concurrent writers of one directory share one.

A record is durable once its file is fsync'd and the directory entry that names it is
fsync'd too. Each put of the verl queue fsyncs its own file (in its own thread, overlapping
the others), renames it into place, and then calls ``DirSync.wait``: it returns once a
directory fsync that *began after that rename* has finished. The first writer to arrive
while no fsync runs makes it, for every rename made so far; writers that arrive while it
runs wait for the next one, which the first of them makes for all of them. So N concurrent
puts cost N file fsyncs that overlap and about two directory fsyncs instead of N, and a
put still returns only when its record survives a crash.

A failed fsync raises in the writer that made it; the writers it would have covered make
the next one themselves (each raises if its own fails): no put returns uncovered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class DirSync:
    """One directory's group-committed fsync (``sync()``: fsync the directory)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._cond = threading.Condition()
        self._written = 0  # renames announced so far (tickets)
        self._synced = 0  # every ticket up to this one is covered by a finished fsync
        self._syncing = False
        #: directory fsyncs made, and the puts they covered (for the stats and the tests)
        self.syncs = 0
        self.covered = 0

    def wait(self) -> None:
        """Return once a directory fsync begun after the caller's rename has finished."""
        with self._cond:
            self._written += 1
            ticket = self._written
            while self._synced < ticket:
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                upto = self._written
                self._cond.release()
                ok = False
                try:
                    self._sync()
                    ok = True
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    if ok:
                        self.syncs += 1
                        self.covered += upto - self._synced
                        self._synced = max(self._synced, upto)
                    self._cond.notify_all()
