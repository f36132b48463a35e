"""The producer's heartbeat: keep its leases alive only while its event loop makes progress.

A task on the producer's own event loop schedules each beat; the file write runs on a
dedicated thread so that slow payload fsyncs (on the producer's I/O threads) never delay
it. Because the *loop* schedules the beats, a producer whose loop is blocked stops beating
and its leases expire — it cannot keep a lease alive while making no progress, which a
free-running thread would. If no beat succeeded for ``give_up_after_s`` (the lease timeout
less a margin) the heartbeat reports ``failing`` and calls the producer's ``give_up``
after every beat until one succeeds again: the producer then stops work on every lease
(the grantor is about to re-queue them) and claims nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from strawq.errors import StrawqError
from strawq.tasks.queue import RunQueue

log = logging.getLogger(__name__)

#: ``give_up(silent_s, first)``: no beat succeeded for ``silent_s``; ``first`` on the beat
#: that crossed the deadline (later calls repeat while beats keep failing)
GiveUp = Callable[[float, bool], None]


class Heartbeat:
    """Beats ``queue.heartbeat(producer_id)`` every ``interval_s`` from the event loop."""

    def __init__(self, queue: RunQueue, producer_id: str, *, interval_s: float,
                 give_up_after_s: float, idle_interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.producer_id = producer_id
        self.interval_s = interval_s
        self.give_up_after_s = give_up_after_s
        #: the cadence while idle (``enter_idle``): no lease to keep alive, only presence
        self.idle_interval_s = idle_interval_s or interval_s
        self.clock = clock
        #: beats carry the idle mark (``RunQueue.heartbeat(idle=True)``)
        self.idle = False
        self._nudge: asyncio.Event | None = None
        self._rearm = False
        #: True from the deadline until a beat succeeds again (claim nothing meanwhile)
        self.failing = False
        self.last_ok = clock()
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the beat's own writer thread (``run`` and ``beat_once`` need it)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{self.producer_id}-hb")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def beat_once(self) -> bool:
        """One beat; a storage failure is logged and leaves ``last_ok`` where it was (an
        idle beat never moves ``last_ok``: it keeps no lease alive). True if it went
        through."""
        loop = asyncio.get_running_loop()
        started = self.clock()  # a lease is safe for T from *before* its renewal
        idle = self.idle
        try:
            # queue.heartbeat is looked up per beat: tests swap it for a failing one.
            beat = self.queue.heartbeat
            if idle:
                await loop.run_in_executor(self._pool, lambda: beat(self.producer_id,
                                                                    idle=True))
            else:
                await loop.run_in_executor(self._pool, beat, self.producer_id)
        except StrawqError as exc:
            log.warning("producer %s: heartbeat failed: %s", self.producer_id, exc)
            return False
        if not idle:
            self.last_ok = started
        if self.failing and not idle:
            log.info("producer %s: heartbeats succeed again", self.producer_id)
            self.failing = False
        return True

    def enter_idle(self) -> None:
        """Beat with the idle mark now, then once per ``idle_interval_s`` (the producer
        holds no lease and claims nothing until ``leave_idle``)."""
        self.idle = True
        self._poke()

    async def leave_idle(self) -> bool:
        """One beat without the mark, before anything is claimed; then the usual cadence.
        False (still idle) if the beat failed: the producer claims nothing yet."""
        self.idle = False
        if not await self.beat_once():
            self.idle = True
            return False
        self._rearm = True  # just beat: the loop waits a full interval before the next
        self._poke()
        return True

    def _poke(self) -> None:
        if self._nudge is not None:
            self._nudge.set()

    async def run(self, give_up: GiveUp) -> None:
        """Beat until cancelled. A beat slower than the interval is not stacked: the next
        one starts only when it returned, and the deadline is checked meanwhile."""
        nudge = self._nudge = asyncio.Event()
        beat: asyncio.Task[bool] | None = None
        while True:
            t0 = self.clock()
            interval = self.idle_interval_s if self.idle else self.interval_s
            if self._rearm:
                self._rearm = False  # leave_idle just beat
            elif beat is None or beat.done():
                beat = asyncio.create_task(self.beat_once())
                await asyncio.wait({beat}, timeout=interval)
            if not self.idle:  # idle: no lease to give up, and claims wait for leave_idle
                self._check_deadline(give_up)
            try:
                await asyncio.wait_for(nudge.wait(),
                                       max(0.0, interval - (self.clock() - t0)))
            except asyncio.TimeoutError:
                pass
            nudge.clear()

    def _check_deadline(self, give_up: GiveUp) -> None:
        silent = self.clock() - self.last_ok
        if silent < self.give_up_after_s:
            return
        first = not self.failing
        self.failing = True
        give_up(silent, first)
