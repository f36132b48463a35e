"""Handing a lease back to the queue: the one place a producer persists a transition.

Every way a held group leaves the producer is one ``RunQueue`` call on an I/O thread:
``complete`` (a ready group), ``yield_partial`` (prefixes kept, no attempt spent),
``drop`` (filtered, with its reason), ``fail`` (with a reason; retryable or not) and
``release`` (back to pending untouched) and ``regenerate`` (a claimed partial past the η
bound: its prefix discarded, generated afresh), and ``refuse`` (this producer's own
configuration cannot run the task: a ``producer_config`` note, the task released untouched
for a healthy producer, and this one claims nothing more). Failures never lose the task:

* ``LeaseLost`` — the grantor re-leased it (fencing): counted, logged, nothing else to do;
* any other error (storage trouble) — the lease is kept as an *orphan* and released again
  by ``retry_orphans`` until that succeeds. While orphans exist the producer claims
  nothing and does not acknowledge a pause (an ack would be a lie).

Counters are bumped only after the transition is persisted (metrics after state).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from strawq.errors import ConfigError, LeaseLost
from strawq.groups import GroupData
from strawq.queue import Lease, RunQueue
from strawq.turns import TurnLog

from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload

log = logging.getLogger(__name__)

#: the reason of the note a refused task carries (``HandBack.refuse``)
REFUSED_REASON = "producer_config"


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
        #: held leases' turn checkpoints (``strawq.turns``), by lease key: cleared once
        #: the lease is handed back with its group persisted (kept on a release: the next
        #: holder resumes from them)
        self.turn_logs: dict[str, TurnLog] = {}

    async def complete(self, lease: Lease, group: GroupData) -> None:
        await self._persist("complete", lease, "groups_completed",
                            lambda: self.io.call(self.queue.complete, lease, group))

    async def yield_partial(self, lease: Lease, group: GroupData) -> None:
        await self._persist("yield", lease, "groups_yielded",
                            lambda: self.io.call(self.queue.yield_partial, lease, group))

    async def drop(self, lease: Lease, reason: str, message: str,
                   summary: dict[str, Any] | None = None) -> None:
        if await self._persist("drop", lease, None, lambda: self.io.call(
                self.queue.drop, lease, reason, message, summary)):
            self.book.count_drop(reason)

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
                       call: Callable[[], Awaitable[Any]]) -> bool:
        """One persisting transition; True when it was persisted."""
        try:
            await call()
        except LeaseLost as exc:
            self.book.bump("leases_lost")
            log.warning("task %s: %s", lease.task_id, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - storage trouble: keep the lease on books
            log.error("task %s: %s failed (%s); will release it", lease.task_id, how, exc)
            self.orphans.append(lease)
            return False
        if counter is not None:
            self.book.bump(counter)
        turn_log = self.turn_logs.pop(lease.key, None)
        if turn_log is not None and how != "release":
            try:
                await self.io.call(turn_log.clear)
            except Exception as exc:  # noqa: BLE001 - garbage, not state: the move stands
                log.warning("task %s: its turn checkpoints could not be removed: %s",
                            lease.task_id, exc)
        return True

    async def retry_orphans(self) -> None:
        """Release every orphan again; those that fail stay for the next call."""
        for lease in list(self.orphans):
            try:
                await self.io.call(self.queue.release, lease)
            except LeaseLost:
                pass
            except Exception as exc:  # noqa: BLE001
                log.warning("release of %s failed again: %s", lease.task_id, exc)
                continue
            self.orphans.remove(lease)
            self.book.bump("groups_released")
