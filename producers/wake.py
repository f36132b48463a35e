"""What wakes a producer's main loop, when it lists ``pending/``, and its idle state.

New work (``pending/``) and the bracket (``control/``) wake the loop at once where this
host sees the change (inotify, ``DirWatch``); the polls of ``idle_poll_s`` /
``control_poll_s`` remain the fallback for changes made on other hosts. Where no event
comes, an idle poll stats ``pending/`` and ``control/`` and lists them only when they
changed (one cached getattr instead of listings, ``DirProbe``).

``drained``: the last claim found nothing left to claim (not merely lost races); until
``pending/`` changes, the loop stats it instead of listing it. **Idle** (nothing to claim,
no group held, ``timing.idle_after_s``): the heartbeat is marked idle, ``control/`` unread,
``pending/`` statted every ``idle_probe_s``; leaving idle unmarks the heartbeat first, then
reads ``control/`` afresh, so a bracket that paused meanwhile is seen before any claim.

``Claims`` makes the claims and keeps that state: a short claim marks the time (the next
listing waits an idle poll), an empty one with ``pending/`` empty marks it drained.

A run that has finished (the collector's ``finished`` record, ``strawq.tasks.finished``) releases
nothing again: an idle or drained producer that sees it stops (``run_finished``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

from strawq.errors import StorageError, StrawqError
from strawq.producers.bracket import PauseBracket
from strawq.producers.claim_gate import ClaimGate
from strawq.producers.heartbeat import Heartbeat
from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload
from strawq.producers.producer_config import TimingConfig
from strawq.storage import Storage
from strawq.storage.watch import IN_CREATE, IN_MOVED_TO, DirProbe, DirWatch
from strawq.tasks.finished import finished
from strawq.tasks.queue import Lease, RunQueue

log = logging.getLogger(__name__)


async def run_finished(io: Callable[..., Awaitable[object]],
                       storage: Storage) -> dict[str, object] | None:
    """The run's ``finished`` record, or None (not finished, or unreadable now: asked
    again at the next idle poll). One stat."""
    try:
        end = await io(finished, storage)
    except StrawqError:
        return None
    return end if isinstance(end, dict) else None


class Wakeup:
    """One producer's wake event, its watches of ``pending/`` and ``control/``, and its
    drained and idle state (see the module's docstring)."""

    def __init__(self, storage: Storage, producer_id: str, *, timing: TimingConfig,
                 heartbeat: Heartbeat, book: StatsBook, clock: Callable[[], float]) -> None:
        self.storage = storage
        self.producer_id = producer_id
        self.timing = timing
        #: the producer's bracket, from ``open`` on (a change of control/ polls it soon)
        self.bracket: PauseBracket | None = None
        self.heartbeat = heartbeat
        self.book = book
        self.clock = clock
        self.event: asyncio.Event | None = None
        self.drained = False
        self.last_empty_claim = -math.inf
        #: idle: heartbeat marked idle, control/ unread, pending/ statted every idle_probe_s
        self.idle = False
        self._work_changed: Callable[[], bool] = lambda: True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: DirWatch | None = None
        self._probes: list[DirProbe] = []
        self._fd: int | None = None

    def open(self, loop: asyncio.AbstractEventLoop, bracket: PauseBracket) -> None:
        """Inside ``run()``: the event, the inotify watch (where there is one), the probes;
        ``bracket``'s probe of control/ is set here."""
        self._loop = loop
        self.bracket = bracket
        self.event = asyncio.Event()
        self._watch = DirWatch(self.storage, ("pending", "control"),
                               mask=IN_CREATE | IN_MOVED_TO)
        self._fd = self._watch.fileno()
        if self._fd is not None:
            loop.add_reader(self._fd, self._on_change, self._watch)
        work = DirProbe(self.storage, ("pending",), clock=self.clock)
        control = DirProbe(self.storage, ("control",), clock=self.clock)
        self._probes = [work, control]
        bracket.probe = control.changed
        self._work_changed = work.changed

    def close(self) -> None:
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None
        if self._watch is not None:
            self._watch.close()
        for probe in self._probes:
            probe.close()
        self._probes = []

    def kick(self) -> None:
        """Wake the main loop now."""
        if self.event is not None:
            self.event.set()

    def _on_change(self, watch: DirWatch) -> None:
        """pending/ or control/ gained an entry: claim and read control/ now."""
        watch.drain()
        self.rearm()
        if self.bracket is not None:
            self.bracket.poll_soon()
        self.kick()

    def rearm(self) -> None:
        """List ``pending/`` at the next claim."""
        self.last_empty_claim = -math.inf
        self.drained = False

    def may_list(self) -> bool:
        """Whether to claim (list ``pending/``) now: an idle poll since the last empty
        claim, and ``pending/`` not drained or changed since."""
        return self.clock() - self.last_empty_claim >= self.timing.idle_poll_s and \
            (not self.drained or self._work_changed())

    async def wait(self, timeout: float) -> bool:
        """Wait for a kick or ``timeout``; whether it was a kick."""
        event = self.event
        if event is None:
            raise RuntimeError("the main loop runs only inside run()")
        try:
            await asyncio.wait_for(event.wait(), timeout)
            woken = True
        except asyncio.TimeoutError:
            woken = False
        event.clear()
        return woken

    def enter_idle(self) -> None:
        self.idle = True
        self.heartbeat.enter_idle()
        log.debug("producer %s is idle", self.producer_id)

    async def idle_step(self, stopping: Callable[[], bool],
                        finished_now: Callable[[], Awaitable[bool]]) -> bool:
        """While idle: wait for a change (this host: inotify at once; another host's
        release: a stat of pending/ every ``idle_probe_s``). True once the producer left
        idle (its heartbeat unmarked first, then ``control/`` read afresh: a bracket that
        paused meanwhile sees it live before it claims anything), or must stop."""
        woken = await self.wait(self.timing.idle_probe_s)
        if stopping():
            return True
        if not woken and not self._work_changed():
            return await finished_now()
        if not await self.heartbeat.leave_idle():
            return False  # claim nothing before a beat without the idle mark went through
        self.idle = False
        self.rearm()
        if self.bracket is not None:
            self.bracket.poll_soon()
            if await self.bracket.poll(force=True):
                self.book.bump("brackets")
        log.debug("producer %s leaves idle", self.producer_id)
        return True


class Claims:
    """A producer's claims: up to the gate's count, each lease started on the runner, and
    what an empty or short claim says of ``pending/`` (``Wakeup.drained``)."""

    def __init__(self, queue: RunQueue, producer_id: str, *, io: Offload, gate: ClaimGate,
                 wakeup: Wakeup, start: Callable[[Lease], object],
                 fenced: Callable[[], Awaitable[bool]], clock: Callable[[], float]) -> None:
        self.queue = queue
        self.producer_id = producer_id
        self.io = io
        self.gate = gate
        self.wakeup = wakeup
        self.start = start
        self.fenced = fenced
        self.clock = clock

    async def claim(self, n: int) -> bool | None:
        """Claim up to ``n`` groups and start them: True when all ``n`` came, False when
        fewer did (or the storage failed), None when a newer incarnation fenced this one."""
        w = self.wakeup
        try:
            if await self.fenced():
                return None
            leases = await self.io.call(self.queue.claim, self.producer_id, n)
            for lease in leases:
                self.start(lease)
            if leases:
                # Work was there: list again at the next claim. Claims empty a release
                # directory without moving pending/'s own mtime, so a producer left
                # "drained" would see the rest only at the probe's full listing.
                w.drained = False
            if len(leases) < n:
                w.last_empty_claim = self.clock()
                # Nothing left to claim (not merely lost races): until pending/ changes,
                # idle polls stat it instead of listing it.
                w.drained = not leases and not await self.io.call(self.queue.list_pending, 1)
                self.gate.storage_answers(None)
                return False
        except StorageError as exc:
            self.gate.storage_answers(exc)
            w.last_empty_claim = self.clock()
            return False
        self.gate.storage_answers(None)
        return True
