"""Whether a producer may claim now, and how many groups: the gate in front of its claims.

No claim while the producer obeys a weight-update pause, while its heartbeats fail, while it
holds a lease it could not hand back, while its engines back off after a fault (and until a
probe reaches one: a producer cut off from its engines claims nothing it cannot run), or
while every engine is on other weights; else what its slot pool allows. A claim that fails
on the storage (a dead mount, a full disk) is said once, and so is its recovery.

No claim either while a group it claimed is still loading its record: until then the group
demands a whole group's trajectories, and a resumed partial needs only its unfinished
samples. So a refill after a weight update — every slot claimed at once, mostly partials —
is followed by one claim of what the loaded partials left free, not by a claim of one
group as each partial loads (with ``queue.release_chunk`` = k, a claim of at least k takes
whole chunks). The wait is the loads' own (on the I/O threads the claims use too), and no
trajectory the pool has free is held back longer than that.

Before the first claim, two checks refuse a producer that could only burn the queue: a
first queued task its configuration cannot run (``check_first_task``), and an engine whose
weight version is not an integer (``check_engine_versions``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from strawq.errors import CorruptRecord, NotFound, StorageError
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.producers.bracket import PauseBracket
from strawq.producers.engine_client import EngineClient, optional_calls
from strawq.producers.engine_errors import EngineError, EngineProtocolError
from strawq.producers.engine_versions import VersionGuard
from strawq.producers.group_load import GroupLoader
from strawq.producers.handback import HandBack, MisconfiguredProducer
from strawq.producers.heartbeat import Heartbeat
from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload
from strawq.producers.slots import SlotPool
from strawq.tasks.queue import RunQueue

log = logging.getLogger(__name__)


async def check_first_task(queue: RunQueue, io: Offload, loader: GroupLoader,
                       producer_id: str) -> None:
    """``MisconfiguredProducer`` before any claim when the first queued task is one this
    producer's configuration cannot run (read only: a task claimed meanwhile, or an
    unreadable one, is left to the claims)."""
    keys = await io.call(queue.list_pending, 1)
    if not keys:
        return
    try:
        rec = records.decode(await io.call(queue.storage.read, keys[0]),
                             expect=Kind.TASK, name=keys[0])
    except (NotFound, CorruptRecord):
        return
    task = rec.meta.get("task")
    problem = loader.config_problem(task) if isinstance(task, dict) else None
    if problem is not None:
        raise MisconfiguredProducer(f"producer {producer_id} refuses to start, "
                                    f"claiming nothing: {problem.detail}", key=problem.key)


async def check_engine_versions(client: EngineClient | None, guard: VersionGuard,
                            producer_id: str) -> None:
    """Refuse to start on an engine whose weight version is not an integer (SGLang's
    ``"default"``): every sample would fault, and the producer would retry, then drop,
    every group while its slots looked busy. An engine unreachable now is left to the
    loop's own retries. Then take out of rotation every engine not on the run's
    version (``VersionGuard.probe_all``)."""
    probe = optional_calls(client).version if client is not None else None
    if probe is None or client is None:
        return  # a client without the version probe: nothing to check
    for url in client.worker_urls:
        try:
            await probe.weight_version(url)
        except EngineProtocolError:
            raise
        except EngineError as exc:
            log.warning("producer %s: could not read the weight version of %s yet: %s",
                        producer_id, url, exc)
    await guard.probe_all()


class FaultBackoff:
    """Engine faults in a row, and the claim back-off they set: ``backoff_s`` doubled per
    group handed back for an engine fault, at most 16 times; a group finished resets it."""

    def __init__(self, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff_s = backoff_s
        self.clock = clock
        #: no claims before this time
        self.until = 0.0
        #: groups handed back after an engine fault since the last one finished: while
        #: above 0 the producer claims only once a probe reaches an engine
        self.in_row = 0

    def back_off(self) -> float:
        """One more engine fault in a row: no claims for ``backoff_s`` doubled per fault,
        at most 16 times; returns the delay."""
        self.in_row += 1
        delay: float = self.backoff_s * min(2 ** (self.in_row - 1), 16)
        self.until = max(self.until, self.clock() + delay)
        return delay

    def reset(self) -> None:
        """A group finished: the engines answer."""
        self.in_row = 0


class ClaimGate:
    """One producer's claim gate (see the module's docstring)."""

    def __init__(self, *, producer_id: str, run_dir: str, handback: HandBack,
                 bracket: PauseBracket, heartbeat: Heartbeat, backoff: FaultBackoff,
                 guard: VersionGuard, pool: SlotPool, book: StatsBook,
                 loading: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.producer_id = producer_id
        self.run_dir = run_dir
        self.handback = handback
        self.bracket = bracket
        self.heartbeat = heartbeat
        self.backoff = backoff
        self.guard = guard
        self.pool = pool
        self.book = book
        #: groups claimed whose record is still loading (``GroupTable.loading``)
        self.loading = loading
        self.clock = clock
        #: the engine-fault back-off after which a probe last reached an engine
        self._probed_after = 0.0
        #: the run directory failed a claim (a dead mount, a full disk): since when
        self._unreachable_since: float | None = None

    async def groups(self) -> int:
        """Groups to claim now: none while pausing, heartbeats fail, a lease could not be
        handed back, engines back off or every engine is on other weights, or after an
        engine fault until a probe reaches an engine, or while a claimed group is still
        loading; else what the slot pool allows."""
        if self.handback.refusal is not None or self.bracket.pausing or \
                self.heartbeat.failing or self.handback.orphans or \
                self.clock() < self.backoff.until or self.guard.all_stale():
            return 0
        n = self.pool.claimable_groups()
        if n > 0 and self.loading():
            return 0  # claimed groups still loading: their demand is not known yet
        if n > 0 and self.backoff.in_row and \
                self._probed_after != self.backoff.until and \
                not await self._engines_answer():
            return 0
        return n

    async def _engines_answer(self) -> bool:
        """After a group was handed back for an engine fault, claim again only once a
        probe reaches an engine: a producer cut off from its engines (a partition) claims
        nothing it cannot run, and probes at the back-off's pace (doubling, 16x at most)."""
        if await self.guard.reachable():
            self._probed_after = self.backoff.until  # once per fault, not per pass
            return True
        self.book.bump("engine_probes_failed")
        delay = self.backoff.back_off()
        log.warning("producer %s: no engine answers; claiming nothing, probing again in "
                    "%.1fs", self.producer_id, delay)
        return False

    def storage_answers(self, exc: StorageError | None) -> None:
        """A claim failed on the storage (``exc``; a JuiceFS client that died answers
        ENOTCONN) or went through again (None): say so once each way. Meanwhile the
        producer claims only at the idle poll; its heartbeats fail too, so it gives up its
        leases, which the grantor hands to other producers; it rejoins when the run
        directory answers again (after a remount at the same path)."""
        if exc is None:
            if self._unreachable_since is not None:
                log.info("producer %s: the run directory answers again after %.0f s; "
                         "claiming again", self.producer_id,
                         self.clock() - self._unreachable_since)
                self._unreachable_since = None
            return
        if self._unreachable_since is None:
            self._unreachable_since = self.clock()
            log.error("producer %s: cannot claim from %s (%s); claiming nothing until it "
                      "answers: check its mount (a dead JuiceFS client: remount it at the "
                      "same path) or its free space; the grantor re-leases what this "
                      "producer holds once its heartbeats stop", self.producer_id,
                      self.run_dir, exc.strerror or exc)
