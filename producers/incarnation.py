"""A producer process's incarnation: unique even when an operator reuses a producer id.

At start a producer takes the next incarnation number of its id (``strawq.tasks.incarnations``,
an exclusive create) and, before it claims anything, hands back every lease still held under
its id: those are its predecessor's (a process of the same id that was killed, or still
runs), since this process has claimed nothing yet. Each goes back to the queue the way an
expired lease does (``RunQueue.fail`` with reason ``producer_restarted``: generation + 1,
the attempt counted, dropped with that reason after ``max_attempts``), so nothing waits
for a lease whose heartbeat the new process now moves, and nothing runs twice to effect:
the predecessor's later complete or yield of such a lease finds it gone (``LeaseLost``) and
is refused.

A predecessor still alive is fenced: before each claim, and once per heartbeat interval
otherwise, a producer checks that no newer incarnation of its id exists (two stats); once one
does it claims nothing more, stops, hands back the leases it still holds (any it claimed
between its successor's start and its own check) and ``Producer.run`` raises
``ProducerSuperseded`` naming the newer process. Until it notices, both processes answer to
the one id (a pause acknowledged by the old one counts for the id): an id is reused for a
restart, never for two processes at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

from strawq.errors import LeaseLost, NotFound, StrawqError
from strawq.tasks.incarnations import begin_incarnation, successor
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.states import TaskState, chunk_key, drop_drained_chunk, held_chunks, names_in

log = logging.getLogger(__name__)

REASON = "producer_restarted"


class ProducerSuperseded(StrawqError):
    """A newer process started under this producer's id; this one stopped."""


class Incarnation:
    """This process's incarnation of producer ``producer_id`` on ``queue``'s run."""

    def __init__(self, queue: RunQueue, producer_id: str) -> None:
        self.queue = queue
        self.producer_id = producer_id
        self.number = 0

    def begin(self) -> list[str]:
        """Take the next incarnation number, then hand back the predecessors' leases;
        returns the task ids handed back. Call it before the first claim."""
        self.number = begin_incarnation(self.queue.storage, self.producer_id)
        back = []
        for name in names_in(self.queue.storage, TaskState.LEASED):
            if name.producer != self.producer_id:
                continue
            try:
                self.queue.fail(Lease(name, {}), REASON,
                                f"producer {self.producer_id} restarted (incarnation "
                                f"{self.number}) while an earlier process of its id held "
                                "this lease")
            except (LeaseLost, NotFound):
                continue  # the predecessor finished or handed it back first
            back.append(name.id)
        # Chunks (range claims) of the predecessor left empty (it died between its last
        # task's rename and the directory's removal): removed now.
        for chunk in held_chunks(self.queue.storage):
            if chunk.producer == self.producer_id:
                key = chunk_key(chunk)
                drop_drained_chunk(self.queue.storage, key, self.queue.storage.list(key))
        if back:
            log.warning("producer %s (incarnation %d): handed back %d leases its earlier "
                        "process held: %s", self.producer_id, self.number, len(back),
                        ", ".join(sorted(back)[:10]) + (" ..." if len(back) > 10 else ""))
        elif self.number > 1:
            log.info("producer %s: incarnation %d (the id was used before; its earlier "
                     "process held no lease)", self.producer_id, self.number)
        return back

    def superseded(self) -> str | None:
        """Why this process must stop (a newer incarnation of its id), or None."""
        if not self.number:
            return None
        who = successor(self.queue.storage, self.producer_id, self.number)
        if who is None:
            return None
        at = who.get("at")
        since = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(at)) \
            if isinstance(at, (int, float)) else ""
        return (f"producer {self.producer_id} (incarnation {self.number}) was superseded: "
                f"incarnation {who.get('incarnation')} of the same id runs on host "
                f"{who.get('host', '?')}, pid {who.get('pid', '?')}{since}. It handed back "
                "this process's leases (their results from here are refused); this process "
                "stops. Run one process per producer id (omit --producer-id for a fresh one)")


class IncarnationFence:
    """The producer's check that no newer incarnation of its id exists: before each claim,
    and once per ``interval_s`` otherwise (``due``); ``superseded`` says why it must stop."""

    def __init__(self, incarnation: Incarnation, *,
                 io: Callable[[Callable[[], str | None]], Awaitable[str | None]],
                 interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.incarnation = incarnation
        self._io = io
        self.interval_s = interval_s
        self.clock = clock
        #: why a newer incarnation of this id stopped this one (None: it was not)
        self.superseded: str | None = None
        self._checked = -math.inf

    def due(self) -> bool:
        return self.clock() - self._checked >= self.interval_s

    async def check(self) -> bool:
        """Whether a newer incarnation of this id exists (``StorageError`` when the
        storage cannot say)."""
        self._checked = self.clock()
        self.superseded = await self._io(self.incarnation.superseded)
        if self.superseded is None:
            return False
        log.error("%s", self.superseded)
        return True
