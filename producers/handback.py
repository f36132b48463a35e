"""Handing a lease back to the queue: the one place a producer persists a transition.

Every way a held group leaves the producer is one ``RunQueue`` call on an I/O thread:
``complete`` (a ready group), ``yield_partial`` (prefixes kept, no attempt spent),
``drop`` (filtered, with its reason), ``fail`` (with a reason; retryable or not) and
``release`` (back to pending untouched) and ``regenerate`` (a claimed partial past the η
bound: its prefix discarded, generated afresh), and ``refuse`` (this producer's own
configuration cannot run the task: a ``producer_config`` note, the task released untouched
for a healthy producer, and this one claims nothing more). Failures never lose the task:

* ``LeaseLost`` — the grantor re-leased it (fencing): counted, logged, nothing else to do;
* ``StorageFull`` (ENOSPC, EDQUOT: the disk or quota is full) — the lease is kept as an
  *orphan* with its transition (the finished group stays in memory) and ``retry_orphans``
  tries that same transition again, backing off up to ``FULL_RETRY_MAX_S``, until space
  returns: a full disk throws no work away and spends no attempt;
* any other error (storage trouble) — the lease is kept as an *orphan* and released again
  by ``retry_orphans`` until that succeeds. While orphans exist the producer claims
  nothing and does not acknowledge a pause (an ack would be a lie).

Counters are bumped only after the transition is persisted (metrics after state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strawq.errors import ConfigError, LeaseLost, StorageFull
from strawq.ondisk.groups import GroupData
from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.turns import TurnLog

if TYPE_CHECKING:
    from strawq.producers.journal_flush import JournalFlush

log = logging.getLogger(__name__)

#: the reason of the note a refused task carries (``HandBack.refuse``)
REFUSED_REASON = "producer_config"
#: the first and the longest wait between retries of a hand-back that met a full disk
FULL_RETRY_MIN_S = 0.05
FULL_RETRY_MAX_S = 2.0


@dataclass
class _Deferred:
    """A transition that met a full disk, kept to be retried as it was."""

    how: str
    counter: str | None
    call: Callable[[], Awaitable[Any]]
    on_done: Callable[[], None] | None
    turn_log: TurnLog | None
    wait_s: float = FULL_RETRY_MIN_S
    retry_at: float = 0.0


class MisconfiguredProducer(ConfigError):
    """This producer cannot run a task for a reason of its own configuration, not the
    task's (no tokenizer for a text or chat prompt, the engine refusing its API key, a
    reward plugin whose module is missing here). ``key`` names the configuration key to
    fix. The task is handed back untouched (``HandBack.refuse``) and the producer stops
    (``Producer.run`` raises this error once every held group is handed back)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(f"{message}; fix {key} in this producer's configuration and "
                         "restart it")
        #: what is wrong, without the advice
        self.detail = message
        self.key = key


class HandBack:
    """Persists held leases back into ``queue``; keeps the ones it could not hand back."""

    def __init__(self, queue: RunQueue, io: Offload, book: StatsBook) -> None:
        self.queue = queue
        self.io = io
        self.book = book
        #: leases whose hand-back failed: released again by ``retry_orphans``
        self.orphans: list[Lease] = []
        #: the first configuration error met (``refuse``): the producer claims nothing more
        self.refusal: MisconfiguredProducer | None = None
        #: held leases' turn checkpoints (``strawq.tasks.turns``), by lease key: cleared once
        #: the lease is handed back with its group persisted (kept on a release: the next
        #: holder resumes from them)
        self.turn_logs: dict[str, TurnLog] = {}
        #: orphans whose transition met a full disk, by lease key: retried as they were
        self._deferred: dict[str, _Deferred] = {}
        #: the in-flight journal (``strawq.producers.journal_flush``), None when off: a park
        #: yields into it, and each hand-back supersedes the lease's entries
        self.journal: JournalFlush | None = None

    async def complete(self, lease: Lease, group: GroupData) -> None:
        await self._persist("complete", lease, "groups_completed",
                            lambda: self.io.call(self.queue.complete, lease, group))

    async def yield_partial(self, lease: Lease, group: GroupData) -> None:
        if self.journal is not None:  # a park: yielded into the journal, no .partial
            min_version = await self.journal.park_point(lease)
            if min_version is not None:
                if await self._persist("yield_journal", lease, "groups_yielded",
                                       lambda: self.io.call(self.queue.yield_journaled, lease,
                                                            min_version)):
                    self.book.bump("groups_yielded_journal")
                return
        await self._persist("yield", lease, "groups_yielded",
                            lambda: self.io.call(self.queue.yield_partial, lease, group))

    async def drop(self, lease: Lease, reason: str, message: str,
                   summary: dict[str, Any] | None = None) -> None:
        await self._persist("drop", lease, None, lambda: self.io.call(
            self.queue.drop, lease, reason, message, summary),
            on_done=lambda: self.book.count_drop(reason))

    async def fail(self, lease: Lease, reason: str, message: str, *,
                   retryable: bool = True) -> None:
        await self._persist("fail", lease, "groups_failed", lambda: self.io.call(
            self.queue.fail, lease, reason, message, retryable=retryable))

    async def regenerate(self, lease: Lease, reason: str, message: str) -> None:
        await self._persist("regenerate", lease, "partials_regenerated", lambda: self.io.call(
            self.queue.regenerate, lease, reason, message))

    async def refuse(self, lease: Lease, error: MisconfiguredProducer) -> None:
        """Hand a task back that this producer's configuration cannot run: a note with
        reason ``producer_config`` (no attempt spent), then ``release``; from now on the
        producer claims nothing (``refusal``)."""
        if self.refusal is None:
            self.refusal = error
            log.error("task %s: %s; claiming nothing more", lease.task_id, error)
        try:
            await self.io.call(self.queue.write_note, lease.name, "fail", REFUSED_REASON,
                               str(error)[:500])
        except Exception as exc:  # noqa: BLE001 - the note is the record of why, not the move
            log.warning("task %s: its %s note could not be written: %s", lease.task_id,
                        REFUSED_REASON, exc)
        await self.release(lease)

    async def release(self, lease: Lease) -> None:
        await self._persist("release", lease, "groups_released",
                            lambda: self.io.call(self.queue.release, lease))

    async def _persist(self, how: str, lease: Lease, counter: str | None,
                       call: Callable[[], Awaitable[Any]],
                       on_done: Callable[[], None] | None = None) -> bool:
        """One persisting transition; True when it was persisted."""
        try:
            await call()
        except LeaseLost as exc:
            self.book.bump("leases_lost")
            log.warning("task %s: %s", lease.task_id, exc)
            await self._journal_done(lease, keep=True)  # the grantor may resume from it
            return False
        except StorageFull as exc:
            # Nothing was published (``publish`` removes its temporary file): keep the
            # group and try the same transition again once space returns.
            log.error("task %s: %s failed: %s; the group is kept and handed back once space "
                      "returns (retrying every %.0f s at most)", lease.task_id, how, exc,
                      FULL_RETRY_MAX_S)
            self._deferred[lease.key] = _Deferred(
                how, counter, call, on_done, self.turn_logs.pop(lease.key, None),
                retry_at=time.monotonic() + FULL_RETRY_MIN_S)
            self.orphans.append(lease)
            return False
        except Exception as exc:  # noqa: BLE001 - storage trouble: keep the lease on books
            log.error("task %s: %s failed (%s); will release it", lease.task_id, how, exc)
            self.orphans.append(lease)
            return False
        await self._persisted(lease, how, counter, on_done, self.turn_logs.pop(lease.key, None))
        return True

    async def _persisted(self, lease: Lease, how: str, counter: str | None,
                         on_done: Callable[[], None] | None, turn_log: TurnLog | None) -> None:
        await self._journal_done(lease, keep=how == "yield_journal")
        if counter is not None:
            self.book.bump(counter)
        if on_done is not None:
            on_done()
        if turn_log is not None and how != "release":
            try:
                await self.io.call(turn_log.clear)
            except Exception as exc:  # noqa: BLE001 - garbage, not state: the move stands
                log.warning("task %s: its turn checkpoints could not be removed: %s",
                            lease.task_id, exc)

    async def _journal_done(self, lease: Lease, *, keep: bool) -> None:
        if self.journal is not None:
            await self.journal.handed_back(lease, keep=keep)

    async def retry_orphans(self) -> None:
        """Release every orphan again (retry the transition of one that met a full disk,
        when its back-off has passed); those that fail stay for the next call."""
        for lease in list(self.orphans):
            deferred = self._deferred.get(lease.key)
            if deferred is not None:
                await self._retry_deferred(lease, deferred)
                continue
            try:
                await self.io.call(self.queue.release, lease)
            except LeaseLost:
                await self._journal_done(lease, keep=True)
            except Exception as exc:  # noqa: BLE001
                log.warning("release of %s failed again: %s", lease.task_id, exc)
                continue
            else:
                await self._journal_done(lease, keep=False)
            self.orphans.remove(lease)
            self.book.bump("groups_released")

    async def _retry_deferred(self, lease: Lease, d: _Deferred) -> None:
        now = time.monotonic()
        if now < d.retry_at:
            return
        try:
            await d.call()
        except LeaseLost as exc:
            self.book.bump("leases_lost")
            log.warning("task %s: %s", lease.task_id, exc)
        except Exception as exc:  # noqa: BLE001 - still full, or other storage trouble
            d.wait_s = min(2 * d.wait_s, FULL_RETRY_MAX_S)
            d.retry_at = now + d.wait_s
            log.debug("task %s: %s failed again: %s", lease.task_id, d.how, exc)
            return
        else:
            log.info("task %s: %s went through once space returned", lease.task_id, d.how)
            await self._persisted(lease, d.how, d.counter, d.on_done, d.turn_log)
        del self._deferred[lease.key]
        self.orphans.remove(lease)
