"""Lease expiry, judged by one grantor on its own monotonic clock (docs/design.md, invariant 3).

Producers never report time. They advance a heartbeat *counter* (``hb/<producer>~<n>``);
the grantor remembers, per producer, the value it last saw and *when it saw it change* on
its own clock. A lease expires when its producer's counter has not moved for
``lease_timeout_s`` (or, for a producer that never beat, since the grantor first saw the
lease). Expiry is a rename of the lease file — the same atomic step a completing producer
needs — so exactly one of "complete" and "expire" wins, and the loser is fenced.

A chunk held whole (range claims, ``queue.release_chunk``) is judged by its directory's name
(its holder), without listing it; expiring it lists it and expires each task in it by the
same rename as a lease of its own, so each task still has exactly one winner.

The clock is injected so tests (and the Hypothesis model) can drive it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from strawq.errors import AlreadyExists, NotFound
from strawq.ondisk.names import STAGE_PARTIAL, ChunkName, TaskName, heartbeat_key, queue_key, \
    requeued_name
from strawq.tasks.journal import JournalReader, journaled
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import DIRS, TaskState, chunk_key, chunk_leases, drop_drained_chunk, \
    held_chunks, move, queued_state

log = logging.getLogger(__name__)


@dataclass
class ScanResult:
    leases: int = 0
    expired: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    producers: dict[str, int] = field(default_factory=dict)
    #: producer -> seconds since its counter last moved, on the grantor's clock
    silence: dict[str, float] = field(default_factory=dict)


class LeaseMonitor:
    def __init__(self, queue: RunQueue, *, lease_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.timeout = lease_timeout_s or queue.config.lease_timeout_s
        self.clock = clock
        self._seen: dict[str, tuple[int, float]] = {}
        self._first_seen: dict[str, float] = {}
        #: producers whose latest heartbeat is marked idle (no leases, not claiming)
        self.idle: set[str] = set()
        self._idle_at: dict[str, bool] = {}
        #: per scan: the leases each expiring holder's journal holds (``_journaled_name``)
        self._journals: dict[str, dict[tuple[str, int], int]] = {}
        #: the writers' segments scanned so far: a later scan reads only their new frames
        self._journal_reader = JournalReader(queue.storage)

    def observe_heartbeats(self, now: float) -> dict[str, int]:
        latest: dict[str, int] = {}
        idle: dict[str, bool] = {}
        stale: list[str] = []
        for p, counter, is_idle in self.queue.heartbeat_states():
            if p in latest:
                if counter > latest[p]:
                    stale.append(heartbeat_key(p, latest[p], idle[p]))
                else:
                    stale.append(heartbeat_key(p, counter, is_idle))
                    continue
            latest[p] = counter
            idle[p] = is_idle
        for key in stale:  # left by a producer that died between publish and delete
            self.queue.storage.delete(key)
        self.idle = {p for p, i in idle.items() if i}
        self._idle_at.update(idle)
        for p, c in latest.items():
            prev = self._seen.get(p)
            if prev is None or prev[0] != c:
                self._seen[p] = (c, now)
        return latest

    def scan(self) -> ScanResult:
        """One pass: observe heartbeats, expire silent producers' leases."""
        now = self.clock()
        self._journals = {}
        res = ScanResult(producers=self.observe_heartbeats(now))
        res.silence = {p: now - t for p, (_c, t) in self._seen.items()}
        listed = self.queue.storage.list(DIRS[TaskState.LEASED])
        leased = [(n, n.producer) for x in listed
                  if (n := TaskName.try_parse(x)) is not None and n.producer is not None]
        # A chunk (a range claim) is judged by its name alone: its holder; it is listed
        # only to expire it, so a pass costs one listing however many chunks are held.
        chunks = held_chunks(self.queue.storage, listed)
        live = {str(n) for n, _p in leased} | {str(c) for c in chunks}
        for gone in [k for k in self._first_seen if k not in live]:
            del self._first_seen[gone]
        holders: set[str] = set()
        units: list[tuple[str, str, TaskName | ChunkName, int]] = [
            (str(n), p, n, 1) for n, p in leased]
        units += [(str(c), c.producer, c, c.size) for c in chunks if c.producer is not None]
        for unit, producer, what, size in units:
            holders.add(producer)
            res.leases += size  # a chunk: what it was released with (an upper bound)
            first = self._first_seen.setdefault(unit, now)
            beat = self._seen.get(producer)
            last_alive = max(first, beat[1]) if beat else first
            if now - last_alive >= self.timeout:
                # Its temporary files are left alone: on a shared mount the grantor cannot
                # know whether a write is still in flight (`strawq gc` removes them once their
                # writer is found dead: by pid on its host, else by age).
                if isinstance(what, ChunkName):
                    self._expire_chunk(what, res)
                else:
                    self._expire(what, res)
        self._forget_departed(now, holders)
        return res

    def _forget_departed(self, now: float, holders: set[str]) -> None:
        """Delete the heartbeat files of producers silent for two lease timeouts that hold
        no lease, so ``hb/`` stays proportional to live producers (docs/design.md, invariant 6). A
        producer that was only paused simply publishes its next counter when it wakes up."""
        for p, (counter, changed) in list(self._seen.items()):
            if p not in holders and now - changed >= 2 * self.timeout:
                self.queue.storage.delete(heartbeat_key(p, counter, self._idle_at.get(p, False)))
                del self._seen[p]
                self._idle_at.pop(p, None)
                log.info("producer %s departed (silent %.0fs, no leases); its heartbeat "
                         "file is removed", p, now - changed)

    def _expire_chunk(self, chunk: ChunkName, res: ScanResult) -> None:
        """Expire a held chunk: list it, expire each task still in it as a lease of its own
        (the same rename, so a holder completing one at the same time wins it or is fenced;
        a journaled one goes back partial, ``_journaled_name``), then remove the chunk's
        rows record and the directory (rmdir refuses it while a task is still in it: the
        next pass, or the holder, removes it)."""
        storage = self.queue.storage
        listed = storage.list(chunk_key(chunk))
        for name in chunk_leases(storage, chunk, listed):
            self._expire(name, res)
        drop_drained_chunk(storage, chunk_key(chunk), storage.list(chunk_key(chunk)))

    def _expire(self, name: TaskName, res: ScanResult) -> bool:
        q = self.queue
        if name.attempts >= q.config.max_attempts:
            q.write_note(name, "drop", "lease_expired.max_attempts",
                          f"producer {name.producer} went silent on attempt {name.attempts} "
                          f"of {q.config.max_attempts}")
            new = name.with_(producer="lease_expired.max_attempts")
            dst = TaskState.DROPPED
            target = res.dropped
        else:
            new = self._journaled_name(name) or requeued_name(name, refund=False)
            dst = queued_state(new)
            target = res.expired
        try:  # not fsync'd: lost in a power cut, the lease simply expires again
            move(q.storage, name, TaskState.LEASED, dst, new, sync_dir=False)
        except (NotFound, AlreadyExists):
            return False  # the holder finished (or handed it back) first: it won the race
        log.warning("lease %s of producer %s expired; task %s -> %s", name.gen, name.producer,
                    name.id, dst.value)
        target.append(name.id)
        return True

    def _journaled_name(self, name: TaskName) -> TaskName | None:
        """The queued name of an expiring lease whose holder journaled it
        (``strawq.tasks.journal``): resume from the expired generation, the holder slot
        naming the journal's writer; None when its journal holds no full entry of it (one
        listing of the writer's records per scan, and their reads: expiry is rare)."""
        writer = name.producer
        if writer is None:
            return None
        if writer not in self._journals:
            try:
                self._journals[writer] = journaled(self.queue.storage, writer,
                                                   self.queue.quarantine,
                                                   reader=self._journal_reader)
            except Exception as exc:  # noqa: BLE001 - unreadable: expire as before
                log.warning("journal of %s unreadable (%s); its leases expire without it",
                            writer, exc)
                self._journals[writer] = {}
        min_version = self._journals[writer].get((name.id, name.gen))
        if min_version is None:
            return None
        return requeued_name(name, refund=False).with_(
            key=queue_key(STAGE_PARTIAL, min_version, name.order), resume=name.gen,
            producer=writer)

    def key(self, producer: str) -> str | None:
        """The heartbeat file last seen of ``producer`` (None: never seen)."""
        seen = self._seen.get(producer)
        return None if seen is None else heartbeat_key(producer, seen[0],
                                                       self._idle_at.get(producer, False))

    def counter(self, producer: str) -> int | None:
        """The heartbeat counter last seen of ``producer`` (None: never seen)."""
        seen = self._seen.get(producer)
        return None if seen is None else seen[0]

    def silence(self, now: float | None = None) -> dict[str, float]:
        """Seconds since each producer's heartbeat counter last moved (grantor's clock)."""
        now = self.clock() if now is None else now
        return {p: now - t for p, (_c, t) in self._seen.items()}
