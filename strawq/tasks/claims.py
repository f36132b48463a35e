"""Claiming tasks: the one rename per task that exactly one claimer wins, and the
per-process cache of candidates that keeps a claim cheap on a shared mount.

Claim order: partial tasks, then returned ones (both at the top of ``pending/``), then fresh
ones by release (``pending/r-<seq>/``), in dataset order (``strawq.tasks.states.list_queued``
states it without a cache). A release staged longest-predicted-first
(``queue.longest_first``, ``strawq.data.prompt_policy``) gives each fresh task a claim rank
in its key (``strawq.ondisk.names.fresh_key``): the fresh tasks a claimer has listed are
claimed by rank — the release's weight version (an earlier one is due earlier), then the
longest predicted first, whatever release holds them (``by_rank``) —, and a claimer that
has seen a rank lists ``RANKED_LOOKAHEAD`` names ahead instead of a few, so a long prompt
of a later release does not wait behind the short ones of earlier releases.
Partial and returned tasks keep their priority (they are the oldest work). ``RunQueue.claim``
is this module's ``Claimer.claim``.

Range claims (``queue.release_chunk`` > 1, docs/protocol.md §5): a release directory then
holds chunk directories of fresh tasks. A claim leases a chunk whole by one rename into
``leased/`` (``_claim_chunk``); what it holds past the claim's size is given back
(``RunQueue.claim``), never taken out of the queued chunk by its path.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import CHUNK_PREFIX, CHUNK_ROWS, ChunkName, TaskName, claim_rank, \
    validate_id
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.states import DIRS as STATE_DIRS
from strawq.tasks.states import RELEASE_PREFIX, RELEASES, TaskState, chunk_key, chunk_leases, \
    key_of, move, queued_state

log = logging.getLogger(__name__)

#: How long a claimer trusts its listing of the top of ``pending/`` (partial and returned
#: tasks) while it still has cached fresh candidates; its own monotonic clock.
TOP_LIST_INTERVAL_S = 0.1
#: Fresh names a claimer caches once it has seen a claim rank (a release staged by
#: predicted length): enough to see past the first release directories, each listed once
#: while its names last (without ranks: ``max(4n, 16)``, dataset order needs no more).
RANKED_LOOKAHEAD = 256


def by_rank(keys: list[str]) -> tuple[list[str], bool]:
    """Fresh candidate keys in claim order: by claim rank (``claim_rank``: release
    version, then the longest predicted first), ties — every name of an unranked release —
    in the order given (release, then dataset order); and whether any name had a rank."""
    ranks = {}
    for k in keys:
        name = TaskName.try_parse(k.rsplit("/", 1)[1])
        ranks[k] = claim_rank(name) if name is not None else 0
    if not any(ranks.values()):
        return keys, False
    return sorted(keys, key=ranks.__getitem__), True


@dataclass(frozen=True)
class Lease:
    """A claimed task: what a producer needs to work on it and to hand it back."""

    name: TaskName
    task: dict[str, Any]
    #: the producer whose journal holds the prefix of the resume generation (the holder
    #: slot of the queued name it was claimed from: ``strawq.tasks.journal``); None: the
    #: prefix, if any, is the resume generation's ``.partial``
    journal: str | None = None

    @property
    def task_id(self) -> str:
        return self.name.id

    @property
    def gen(self) -> int:
        return self.name.gen

    @property
    def producer(self) -> str:
        if self.name.producer is None:  # pragma: no cover - leases always carry one
            raise ValueError("lease without a producer")
        return self.name.producer

    @property
    def key(self) -> str:
        return key_of(TaskState.LEASED, self.name)

    @property
    def has_partial(self) -> bool:
        return self.name.resume >= 0



class Claimer:
    """One process's claims on one run: ``claim`` and the candidate cache it keeps.
    ``read_record`` reads a claimed task's record (quarantining a corrupt one),
    ``quarantine`` moves a bad record aside (``RunQueue``'s own)."""

    def __init__(self, storage: Storage, read_record: Callable[[str, Kind], records.Record],
                 quarantine: Callable[[str], object]) -> None:
        self.storage = storage
        self._read_record = read_record
        self._quarantine = quarantine
        self._fresh: _OrderedSet = _OrderedSet()
        #: release directories whose whole listing went into ``_fresh`` and where this
        #: claimer has lost no race since: a release directory never gains a name, so its
        #: cached names are all it holds, and it is not listed again
        self._complete: set[str] = set()
        self._contended = False
        #: races lost at the last claim, halved at each claim that lost none: how far past
        #: the head of the fresh list this claimer starts (``_spread_out``)
        self._spread = 0
        self._top_files: list[str] = []
        self._top_listed_at = float("-inf")
        #: this claimer has listed a fresh task with a claim rank (``by_rank``)
        self._ranked = False

    def list_top_next(self) -> None:
        """List the top of ``pending/`` at the next claim (this process handed a task back
        there)."""
        self._top_listed_at = float("-inf")

    def candidates(self, producer: str, n: int) -> list[str]:
        """Claim candidates in priority order.

        Partial and returned tasks sit at the top of ``pending/`` (few), listed at a claim
        unless this claimer listed it less than ``TOP_LIST_INTERVAL_S`` ago and still has
        cached fresh names enough for the claim. Fresh tasks come from a per-process cache
        of the release directories' listings, refilled when it runs low: a claim costs one
        small listing plus its renames, not a listing of every release directory (on JuiceFS
        a listing of a few hundred names costs milliseconds). A release directory never
        gains a name, so one this claimer listed whole is not listed again while its cached
        names last and no race was lost in it; once they are used up it is removed by
        ``rmdir`` alone (which refuses a directory that still holds a task, and then it is
        listed). Once a claimer has lost races, it starts at its own offset within a head of
        the fresh list as wide as its contention (``_spread_out``), so concurrent claimers
        stop racing for the same first tasks (dataset order then holds within that window
        only).
        """
        want = max(4 * n, RANKED_LOOKAHEAD if self._ranked else 16)
        now = time.monotonic()
        if (not self._contended and len(self._fresh) >= n
                and now - self._top_listed_at < TOP_LIST_INTERVAL_S):
            # Enough fresh work for this claim is cached and the top was listed a moment
            # ago: a partial task, or a new release, that appeared since waits at most
            # TOP_LIST_INTERVAL_S for its turn. (The cache is refilled towards ``want`` at
            # the next listing; a release is never claimed ahead of older cached names.)
            # After a lost race the cache is known stale: listed again (below).
            return self._top_files + self._spread_out(producer, n, list(self._fresh))
        pending = STATE_DIRS[TaskState.PENDING]
        top = self.storage.list(pending)
        self._top_listed_at = now
        files = [f"{pending}/{x}" for x in top if not x.startswith(RELEASE_PREFIX)]
        self._top_files = files
        dirs = sorted(x for x in top if x.startswith(RELEASE_PREFIX))
        live = set(dirs)
        self._complete &= live
        fresh = [k for k in self._fresh if k.split("/", 2)[1] in live]
        if self._contended:
            # A release directory where this claimer lost a race (no longer ``_complete``)
            # is listed again, and its cached names kept only where still there: others
            # claim in the same order, so the names after a lost one are likely gone too.
            for d in sorted({k.split("/", 2)[1] for k in fresh} - self._complete):
                still = set(self.storage.list(f"{pending}/{d}"))
                fresh = [k for k in fresh
                         if k.split("/", 2)[1] != d or k.split("/")[2] in still]
                self._complete.add(d)
        if len(fresh) < want:
            have = set(fresh)
            cached = {k.split("/", 2)[1] for k in fresh}
            for d in dirs:
                if len(fresh) >= want:
                    break
                if d in self._complete:
                    if d in cached:
                        continue  # all its names are cached already
                    # Every name it held was tried by this claimer: drained, unless a claim
                    # failed on the way (then rmdir refuses, and it is listed again).
                    self._complete.discard(d)
                    if self.storage.rmdir(f"{pending}/{d}"):
                        continue
                inside = self.storage.list(f"{pending}/{d}")
                if not inside:
                    # Drained: safe to remove (rmdir refuses a non-empty directory, and a
                    # release directory is never refilled: each release has a new seq).
                    self.storage.rmdir(f"{pending}/{d}")
                    continue
                self._complete.add(d)
                fresh += [k for k in (f"{pending}/{d}/{x}" for x in inside) if k not in have]
        fresh, ranked = by_rank(fresh)
        self._ranked = self._ranked or ranked
        self._fresh = _OrderedSet(fresh)
        return files + self._spread_out(producer, n, fresh)

    def _spread_out(self, producer: str, n: int, fresh: list[str]) -> list[str]:
        """``fresh`` rotated to start at this claimer's own offset within its head, while it
        has lost races lately: ``2n + 2`` names times one more than the races it lost at
        its last claim (halved at each claim that lost none). Claimers that raced for the
        same names spread over a head as wide as their contention, instead of walking the
        same four names one lost race after another."""
        window = min(len(fresh), (2 * n + 2) * (1 + self._spread))
        if window <= 1 or not self._spread:
            return fresh
        off = zlib.crc32(producer.encode()) % window
        return fresh[off:window] + fresh[:off] + fresh[window:]

    def claim(self, producer: str, n: int = 1) -> list[Lease]:
        """Lease up to ``n`` tasks in priority order. Exactly one claimer wins each task.

        A chunk directory of a release (``queue.release_chunk``) is leased whole by one
        rename (``_claim_chunk``), even when it holds more tasks than the claim still
        wants: then more than ``n`` leases are returned, and ``RunQueue.claim`` gives the
        ones past ``n`` back."""
        validate_id(producer, "producer id")
        if n <= 0:
            return []
        won: list[tuple[str, TaskName, str | None]] = []
        chunks: list[Lease] = []
        #: claim order: an index into ``won``, or a lease of a chunk
        order: list[int | Lease] = []
        lost = 0
        todo = self.candidates(producer, n)
        for again in (False, True):
            if again:
                if won or chunks or not lost:
                    break
                # Every candidate was gone: names others claimed since this claimer
                # listed them, while a release directory it has not listed may hold
                # tasks. List again (as after any lost race) and try once more, rather
                # than come back empty with work queued.
                self._contended = True
                todo = self.candidates(producer, n)
            while todo and len(won) + len(chunks) < n:
                src = todo.pop(0)
                if src in self._top_files:
                    self._top_files.remove(src)
                last = src.rsplit("/", 1)[1]
                chunk = (ChunkName.try_parse(last, RELEASES.parse(src.split("/")[1]))
                         if src.count("/") == 2 and last.startswith(CHUNK_PREFIX) else None)
                if chunk is not None:
                    # Leased whole, by one rename, even when it holds more tasks than the claim
                    # still wants (the caller gives those back: ``RunQueue.claim``). A task is
                    # never taken out of a queued chunk by its path: such a rename could resolve
                    # the chunk's directory just before another claimer renamed the whole chunk,
                    # and move the task out of the chunk that claimer then held and had listed.
                    self._fresh.discard(src)
                    got = self._claim_chunk(src, chunk.held_by(producer))
                    if got is None:
                        lost += 1
                        self._complete.discard(src.split("/", 2)[1])
                    chunks += got or []
                    order += got or []
                    continue
                self._fresh.discard(src)
                name = TaskName.try_parse(last)
                if name is None:
                    log.warning("ignoring a foreign file in the queue: %s", src)
                    continue
                held = name.with_(attempts=name.attempts + 1, producer=producer)
                try:
                    dst = move(self.storage, name, queued_state(name), TaskState.LEASED, held,
                               src_key=src, sync_dir=False)
                except NotFound:
                    lost += 1
                    if src.count("/") >= 2:  # in a release directory: its listing is stale
                        self._complete.discard(src.split("/", 2)[1])
                    continue  # another producer won it
                except AlreadyExists:
                    # Not a state the protocol makes: the same task is live twice. Skip it and
                    # move this copy aside (its twin runs); never take the producer down.
                    log.error("claim of %s: %s is already held, so this task is live twice (a "
                              "second copy at %s); skipping it and moving the copy to "
                              "quarantine/ for inspection", name.id, key_of(TaskState.LEASED,
                                                                            held), src)
                    self._quarantine(src)
                    continue
                order.append(len(won))
                won.append((dst, held, name.producer if name.resume >= 0 else None))
        self._contended = lost > 0
        self._spread = max(lost, self._spread // 2)
        # No directory fsync: a claim lost to a power failure puts the task back in pending,
        # which only means it runs again (execution is at-least-once).
        leases = []
        for i in order:
            if isinstance(i, Lease):
                leases.append(i)
                continue
            dst, held, journal = won[i]
            try:
                rec = self._read_record(dst, Kind.TASK)
            except CorruptRecord as exc:
                log.error("claimed task %s has a corrupt record (%s); quarantined", held.id, exc)
                continue
            except NotFound:
                log.error("claimed task %s is gone from %s before it was read (moved by "
                          "someone else); skipping it", held.id, dst)
                continue
            leases.append(Lease(held, rec.meta["task"], journal))
        return leases

    def _claim_chunk(self, src: str, chunk: ChunkName) -> list[Lease] | None:
        """Lease a whole chunk directory: one rename into ``leased/`` under a name naming
        the holder (None: another claimer won it), then one listing of it — what it holds
        now: tasks claimed out of it one by one before are gone — and one read of its rows
        record, deleted once read (no one reads it again). Each task then leaves the chunk
        by the rename of its own entry, fenced as any lease (``TaskName.chunk``)."""
        dst = chunk_key(chunk)
        try:
            self.storage.rename(src, dst, sync_dir=False)
        except NotFound:
            return None
        except AlreadyExists:  # not a state the protocol makes: leave the chunk queued
            log.error("claim of chunk %s: %s exists already; leaving it queued", src, dst)
            return []
        listed = self.storage.list(dst)
        names = chunk_leases(self.storage, chunk, listed)
        rows: dict[str, Any] = {}
        if names:
            try:
                rows = self._read_record(f"{dst}/{CHUNK_ROWS}", Kind.TASK).meta["rows"]
            except (CorruptRecord, NotFound) as exc:
                log.error("chunk %s: its rows record is unreadable (%s); reading each "
                          "task's own record", dst, exc)
        leases = []
        for held in names:
            entry = held.chunk.rsplit("/", 1)[1] if held.chunk else ""
            task = rows.get(entry)
            if task is None:
                try:
                    task = self._read_record(key_of(TaskState.LEASED, held), Kind.TASK
                                             ).meta["task"]
                except (CorruptRecord, NotFound) as exc:
                    log.error("claimed task %s of chunk %s is unreadable (%s); skipping it",
                              held.id, dst, exc)
                    continue
            leases.append(Lease(held, task))
        if CHUNK_ROWS in listed:
            self.storage.delete(f"{dst}/{CHUNK_ROWS}")
        if not names:
            self.storage.rmdir(dst)  # drained before it was claimed
        return leases


class _OrderedSet(dict[str, None]):
    """Insertion-ordered set of keys (the fresh-task cache)."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        super().__init__((k, None) for k in keys)

    def discard(self, key: str) -> None:
        self.pop(key, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.keys()))
