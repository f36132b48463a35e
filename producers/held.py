"""The groups a producer holds, and how their samples are stopped.

``GroupTable`` is the record of the leases held now (``ActiveGroup`` each) and of the rids
they have in flight (``live_rids``: what an abort names, ``strawq.producers.bracket``). It
is built before everything that reads it, so the aborter, the bracket and the runner each
get a narrow callable of it rather than of each other.

``GroupHalts`` stops samples: a whole group's siblings (a sample failed, a group dropped,
a lease lost), every held group (``park_all``: a bracket or a stop; ``hold_all``: a
bracket that keeps the leases, ``timing.hold_through_pause``; ``abandon_all``: the
heartbeats failed). Stopping aborts the exact rids on the engines until the requests came
back with their tokens; nothing is persisted here (the runner settles each group).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from strawq.producers.bracket import EngineAborter
from strawq.producers.group import GroupRun
from strawq.producers.meter import StatsBook
from strawq.producers.slots import SlotHold, SlotPool
from strawq.producers.turn_saver import TurnSaver
from strawq.tasks.queue import Lease

log = logging.getLogger(__name__)

#: how often ``hold_all`` looks whether every group reached its hold, in seconds
HOLD_POLL_S = 0.005


@dataclass(eq=False)
class ActiveGroup:
    """A lease the producer holds, and the tasks working on it."""

    lease: Lease
    hold: SlotHold = field(default_factory=SlotHold)
    run: GroupRun | None = None
    task: asyncio.Task[None] | None = None
    sample_tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    #: rids of this lease's ``/generate`` requests in flight now
    live_rids: set[str] = field(default_factory=set)
    parking: bool = False
    #: a pause holds it (``GroupHalts.hold_all``): its samples stop, its lease is kept
    holding: bool = False
    #: its task waits for the resume now (its samples stopped, its state in memory)
    held: bool = False
    abandoned: bool = False
    fault: BaseException | None = None
    #: hop timing (the producer's clock): claimed, first request sent, last sample final
    claimed_at: float = 0.0
    generating: bool = False
    final_at: float | None = None
    #: the queue's version when the group was loaded (appended tokens before any turn)
    version: int = 0
    #: (reason, message): the generate plugin asked to drop the group (``tools.on_failure``)
    drop: tuple[str, str] | None = None
    #: turn checkpoints of this lease (``strawq.producers.turn_saver``), None when off
    turns: TurnSaver | None = None
    #: its demand is known: its record loaded (a resumed partial then demands only its
    #: unfinished samples); until then it demands a whole group (``GroupTable.loading``)
    loaded: bool = False


class GroupTable:
    """The groups held now, by lease key."""

    def __init__(self) -> None:
        self.groups: dict[str, ActiveGroup] = {}
        #: the last pause held the groups (``GroupHalts.hold_all``): a lease whose claim
        #: was in flight at the pause is held too (``GroupRunner.start``)
        self.holding = False
        #: pauses that held the groups so far (the held groups of one read its version once)
        self.holds = 0

    def __len__(self) -> int:
        return len(self.groups)

    def live_rids(self) -> set[str]:
        """Every rid of this producer's requests in flight now."""
        return {rid for a in self.groups.values() for rid in a.live_rids}

    def held(self) -> int:
        """Groups waiting for a pause's resume with their leases (``GroupHalts.hold_all``)."""
        return sum(a.held for a in self.groups.values())

    def loading(self) -> int:
        """Groups claimed whose demand is not known yet (their record is loading)."""
        return sum(not a.loaded for a in self.groups.values())


class GroupHalts:
    """Stops the samples of held groups (their requests aborted, exactly, on the engines)."""

    def __init__(self, table: GroupTable, *, producer_id: str, pool: SlotPool,
                 aborter: EngineAborter, book: StatsBook) -> None:
        self.table = table
        self.producer_id = producer_id
        self.pool = pool
        self.aborter = aborter
        self.book = book
        #: siblings of a failed sample being aborted until they returned
        self._halting: set[asyncio.Task[None]] = set()

    async def park_all(self, why: str, *, deadline_s: float | None = None) -> int:
        """Stop every held group and hand it back; returns how many were yielded.
        ``deadline_s``: how long the aborted requests may take to come back (default: the
        aborter's ``abort_deadline_s``; a stop passes its share of the grace period)."""
        self.table.holding = False
        actives = list(self.table.groups.values())
        if not actives:
            return 0
        before = self.book.get("groups_yielded")
        for a in actives:
            a.parking = True
        self.pool.wake_all()
        pending = {t for a in actives for t in a.sample_tasks.values() if not t.done()}
        await self.aborter.abort_until_returned(pending, f"{self.producer_id}/", why,
                                                deadline_s=deadline_s)
        await asyncio.gather(*(a.task for a in actives if a.task is not None),
                             return_exceptions=True)
        return self.book.get("groups_yielded") - before

    async def hold_all(self, why: str, *, durable: Callable[[], Awaitable[bool]]) -> int:
        """Stop every held group's samples and keep its lease (a bracket with
        ``timing.hold_through_pause``); returns how many were yielded (0 unless it fell
        back to ``park_all``).

        Each group's requests are aborted until they came back with their tokens; a group
        whose samples are all final settles (completes) as at a park, the others wait in
        their tasks for the resume (``ActiveGroup.held``). ``durable`` then makes every held
        group's received state durable (one journal record); should it fail, every group
        is parked instead (the ack must not promise state that is only in memory)."""
        self.table.holding = True
        self.table.holds += 1
        actives = list(self.table.groups.values())
        if not actives:
            return 0
        for a in actives:
            a.holding = True
        self.pool.wake_all()
        pending = {t for a in actives for t in a.sample_tasks.values() if not t.done()}
        await self.aborter.abort_until_returned(pending, f"{self.producer_id}/", why)
        # every group settled (it left the table), waits for the resume, or went on already
        # (the pause was resumed without this ack: the trainer judged this producer dead)
        while any(not (a.held or not a.holding or a.parking or a.abandoned or a.task is None
                       or a.task.done()) for a in self.table.groups.values()):
            await asyncio.sleep(HOLD_POLL_S)
        if await durable():
            self.book.bump("groups_held", self.table.held())
            return 0
        log.warning("producer %s: the held groups' journal record failed; parking them",
                    self.producer_id)
        return await self.park_all(why)

    def abandon_all(self) -> None:
        """Stop work on every lease without persisting anything (the grantor re-queues)."""
        self.pool.wake_all()
        for a in list(self.table.groups.values()):
            if not a.abandoned:
                a.abandoned = True
                self.stop_samples(a, cancel=True)

    def stop_samples(self, a: ActiveGroup, keep: int | None = None, *,
                     cancel: bool = False) -> None:
        """Stop the group's other samples (all but ``keep``, the caller), which must already
        see the group halted (``a.fault`` / ``a.drop`` / ``a.abandoned`` set).

        Their requests are aborted on the engines until they came back (each reply carries
        the tokens generated so far, applied to its sample; past ``abort_deadline_s`` the
        aborter cancels them). ``cancel`` (a lease given up, nothing to persist) cancels the
        tasks at once instead."""
        self.pool.wake_all()  # siblings waiting for a trajectory see the halt
        others = {t for j, t in a.sample_tasks.items() if j != keep and not t.done()}
        prefix = a.run.rid_prefix(self.producer_id) if a.run is not None else None
        if cancel or prefix is None:
            for t in others:
                t.cancel()
            if prefix is not None:
                self.aborter.abort_soon(prefix)
            return
        task = asyncio.create_task(self.aborter.abort_until_returned(
            others, prefix, f"a sample of task {a.lease.task_id} failed"))
        self._halting.add(task)
        task.add_done_callback(self._halting.discard)
