"""The run directory and the producer-side operations: claim, heartbeat, complete, yield.

Layout of ``<root>/<run_id>/`` (see ``docs/protocol.md`` for the crash table)::

    run.meta                 RUN record: config, created_at (exclusive create)
    tmp/                     temporary files, ``<writer>.<uuid>`` (never read)
    staging/r-<seq>.<nonce>/ a release being prepared (not yet visible)
    cursor/<seq>             CURSOR records: the dataset cursor (latest wins)
    pending/<name>           partial (stage a) and returned (stage b) tasks
    pending/r-<seq>/<name>   fresh tasks of release <seq> (stage c), dataset order
    pending/r-<seq>/k-<j>~n<k>/  a chunk of k fresh tasks (``release_chunk``): their records
                             and ``rows``, all k rows in one record
    leased/<name>~<producer> tasks held by a producer
    leased/k-<seq>.<j>~n<k>~<producer>/<name>  a chunk held whole (range claims)
    ready/<name>~<producer>  finished groups; payload at data/<id>~g<gen>.group
    batched/<name>~<producer> groups referenced by a batch manifest
    batches/<seq>            MANIFEST records;  acked/<seq>: the trainer consumed it;
                             delivered/<seq>~<v>: delivered at version v (strawq.delivery.batches)
    dropped/<name>~<reason>  dropped with a reason; note at data/<id>~g<gen>.drop.<reason>
    data/<id>~g<gen>.<kind>  immutable payloads: group, partial, drop
    hb/<producer>~<counter>  heartbeat counters (the name is the data; the body names the process)
    versions/<v>             the weight version the collector has announced
    quarantine/              records that failed their checks, moved aside
    format/<n>               the run's on-disk format, raised by ``strawq upgrade``
                             (strawq.tasks.formats)

Every transition is one atomic rename made by ``strawq.tasks.states.move``, which also knows
which directory holds each state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from strawq.config import QueueConfig, from_dict, to_dict
from strawq.errors import (
    AlreadyExists,
    ConfigError,
    CorruptRecord,
    LeaseLost,
    NotFound,
    StorageError,
    TaskNotFound,
)
from strawq.ondisk import records
from strawq.ondisk.names import (
    STAGE_PARTIAL,
    TaskName,
    data_key,
    note_key,
    queue_key,
    ready_key,
    requeued_name,
    validate_id,
)
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.claims import TOP_LIST_INTERVAL_S, Claimer, Lease
from strawq.tasks.eta import EtaPolicy, PolicyCache
from strawq.tasks.formats import FormatCache, check_readable
from strawq.tasks.heartbeats import HeartbeatWriter, heartbeat_states
from strawq.tasks.states import DIRS as STATE_DIRS
from strawq.tasks.states import TaskState, entries, list_queued, move, queued_state

if TYPE_CHECKING:  # groups need numpy: loaded when a group is read (status reads none)
    from strawq.ondisk.groups import GroupData

log = logging.getLogger(__name__)

__all__ = ["DIRS", "RUN_KEY", "TOP_LIST_INTERVAL_S", "VERSIONS", "VERSIONS_DIR", "Lease",
           "RunQueue"]

DIRS = ("tmp", "staging", "cursor", *dict.fromkeys(STATE_DIRS.values()), "batches", "acked",
        "delivered", "data", "hb", "versions", "quarantine", "collector", "control")
RUN_KEY = "run.meta"
#: ``versions/<v>``: the weight version the collector announced (the name is the data)
VERSIONS = Numbered()
#: where the run's weight versions are announced (``versions/<v>``)
VERSIONS_DIR = "versions"
class RunQueue:
    """One run's queue on a store. Safe to use from many processes and hosts at once."""

    def __init__(self, storage: Storage, config: QueueConfig | None = None) -> None:
        self.storage = storage
        if config is None:
            config = self._load_config()
        self.config = config
        #: the run's format, which this queue's writers write (``strawq.tasks.formats``)
        self.formats = FormatCache(storage)
        #: this process's claims and their candidate cache (``strawq.tasks.claims``)
        self._claimer = Claimer(storage, self._read_record, self.quarantine)
        self._heartbeats = HeartbeatWriter(storage)
        self._policy: PolicyCache | None = None
        #: held chunk directory -> the leases this process claimed from it still in it
        self._in_chunks: dict[str, int] = {}

    # -- run lifecycle ---------------------------------------------------------------------
    @classmethod
    def create(cls, storage: Storage, config: QueueConfig | None = None, *,
               meta: dict[str, Any] | None = None) -> RunQueue:
        """Create the run layout; idempotent if the run exists with the same config."""
        config = config or QueueConfig()
        for d in DIRS:
            storage.makedirs(d)
        body = {"config": to_dict(config), "created_at": time.time(), "meta": meta or {}}
        try:
            storage.publish(RUN_KEY, records.encode(Kind.RUN, body))
        except AlreadyExists:
            existing = cls(storage)
            if to_dict(existing.config) != to_dict(config):
                raise ConfigError(
                    f"run at {storage.describe()} exists with config {to_dict(existing.config)}"
                    f"; refusing to reopen it with {to_dict(config)}") from None
            return existing
        return cls(storage, config)

    @classmethod
    def open(cls, storage: Storage) -> RunQueue:
        return cls(storage)

    def _load_config(self) -> QueueConfig:
        try:
            rec = records.decode(self.storage.read(RUN_KEY), expect=Kind.RUN, name=RUN_KEY)
        except NotFound:
            raise NotFound(2, f"no strawq run at {self.storage.describe()}: run "
                              "'strawq init' first") from None
        check_readable(self.storage)
        return from_dict(QueueConfig, rec.meta["config"], where=RUN_KEY)

    # -- reading task records ----------------------------------------------------------------
    def _read_record(self, key: str, expect: Kind) -> records.Record:
        data = self.storage.read(key)
        try:
            return records.decode(data, expect=expect, name=key)
        except CorruptRecord:
            self.quarantine(key)
            raise

    def quarantine(self, key: str) -> str | None:
        """Move a bad record aside (never delete it); returns its new key."""
        dst = f"quarantine/{key.replace('/', '+')}"
        try:
            self.storage.rename(key, dst)
        except (NotFound, AlreadyExists):
            return None
        log.error("quarantined corrupt record %s -> %s", key, dst)
        return dst

    # -- producer side -----------------------------------------------------------------------
    def list_pending(self, limit: int | None = None) -> list[str]:
        """Pending keys in claim order: partial, then returned, then fresh by release."""
        return list_queued(self.storage, limit)

    def claim(self, producer: str, n: int = 1) -> list[Lease]:
        """Lease up to ``n`` tasks in priority order. Exactly one claimer wins each task
        (``strawq.tasks.claims``). A chunk of a range release is leased whole; the tasks it
        held past ``n`` are released at once (gen + 1, no attempt spent: returned tasks,
        claimed first by the next claims)."""
        leases = self._claimer.claim(producer, n)
        for lease in leases:
            if lease.name.chunk is not None:
                d = lease.name.chunk.split("/", 1)[0]
                self._in_chunks[d] = self._in_chunks.get(d, 0) + 1
        for extra in leases[n:]:  # a chunk's tasks past the claim's size: given back
            try:
                self.release(extra)
            except LeaseLost:
                pass  # expired meanwhile (a claimer paused a lease timeout): re-queued
        return leases[:n]

    def _left_chunk(self, name: TaskName) -> None:
        """A lease of a chunk left it (or was found gone): once no lease this process took
        from the chunk is left in it, the directory is removed (rmdir refuses one that still
        holds a task: a lease the grantor is expiring, or this process lost track of). A
        lease from a chunk this process did not claim (an earlier incarnation's) tries it
        each time."""
        if name.chunk is None:
            return
        d = name.chunk.split("/", 1)[0]
        left = self._in_chunks.get(d, 1) - 1
        if left > 0:
            self._in_chunks[d] = left
            return
        self._in_chunks.pop(d, None)
        self.storage.rmdir(f"{STATE_DIRS[TaskState.LEASED]}/{d}")

    def heartbeat(self, producer: str, *, idle: bool = False) -> int:
        """Advance the producer's heartbeat counter; the grantor watches it move. ``idle``:
        the producer holds no lease and claims nothing until its next non-idle beat, so a
        weight-update bracket need not wait for its ack (``heartbeat_key``;
        ``strawq.tasks.heartbeats``)."""
        return self._heartbeats.beat(producer, idle=idle)

    def heartbeats(self) -> Iterator[tuple[str, int]]:
        """(producer, counter) of every heartbeat file (a producer may briefly have two)."""
        for p, c, _idle in self.heartbeat_states():
            yield p, c

    def heartbeat_states(self) -> Iterator[tuple[str, int, bool]]:
        """(producer, counter, idle) of every heartbeat file."""
        yield from heartbeat_states(self.storage)

    def still_held(self, lease: Lease) -> bool:
        """Whether the lease file is still ours (a hint: only the final rename fences)."""
        return self.storage.exists(lease.key)

    def load_partial(self, lease: Lease) -> GroupData | None:
        """The saved prefixes of a partial task, or None for a fresh one."""
        if not lease.has_partial:
            return None
        key = data_key(lease.task_id, lease.name.resume, "partial")
        rec = self._read_record(key, Kind.PARTIAL)
        from strawq.ondisk.groups import GroupData

        return GroupData.from_record(rec)

    def _move_lease(self, lease: Lease, dst: TaskState, new: TaskName) -> str:
        """The fencing step. Not fsync'd: if a power failure undoes it, the task is back in
        LEASED, expires and runs again; its payload was made durable before this rename.
        The collector fsyncs ``ready/`` before a manifest names a group (``publish_batch``).
        """
        if dst in (TaskState.PENDING, TaskState.PARTIAL):
            self._claimer.list_top_next()  # our own handback: list the top next time
        try:
            moved = move(self.storage, lease.name, TaskState.LEASED, dst, new, sync_dir=False)
        except NotFound:
            self._left_chunk(lease.name)
            raise LeaseLost(f"lease {lease.name} is no longer held by {lease.producer}: it "
                            "expired and was re-queued (or the task was dropped); its result "
                            "is discarded") from None
        self._left_chunk(lease.name)
        return moved

    def _publish_payload(self, lease: Lease, key: str, chunks: list[bytes]) -> None:
        """Publish a lease's payload; a failure on a lease no longer held is ``LeaseLost``.

        Written in place (``Storage.publish(in_place=True)``: no temporary name, no rename
        of its own): nobody reads ``data/<task>~g<gen>`` until the fencing rename that
        follows names it, and only the holder of generation ``gen`` writes it (an expired
        lease comes back as gen + 1). A crash mid-write leaves a partial file that no entry
        names; ``sweep_payloads`` deletes it once the task moves on, and the holder's own
        retry (a retried call, a recovered lease) rewrites it here."""
        for again in (False, True):
            try:
                self.storage.publish(key, chunks, in_place=True)
                return
            except AlreadyExists:
                if again or not self.still_held(lease):
                    raise LeaseLost(f"lease {lease.name} is no longer held: the task moved "
                                    "on") from None
                # our own earlier attempt, complete or cut off mid-write: written again
                self.storage.delete(key)
            except (StorageError, NotFound) as exc:
                if isinstance(exc, NotFound) or not self.still_held(lease):
                    raise LeaseLost(f"lease {lease.name} was lost while its payload was "
                                    f"being written ({exc}); the result is discarded"
                                    ) from exc
                raise

    def complete(self, lease: Lease, group: GroupData) -> str:
        """Publish a finished group and move the task to READY. ``LeaseLost`` if fenced."""
        name = lease.name.with_(key=ready_key(group.min_version(), lease.name.order))
        return self._persist(lease, group, Kind.GROUP, "group", TaskState.READY, name)

    def yield_partial(self, lease: Lease, group: GroupData) -> str:
        """Save the prefixes and return the task as PARTIAL (no attempt spent, gen + 1)."""
        name = lease.name.with_(
            key=queue_key(STAGE_PARTIAL, group.min_version(), lease.name.order),
            gen=lease.gen + 1, attempts=max(lease.name.attempts - 1, 0), resume=lease.gen,
            producer=None)
        return self._persist(lease, group, Kind.PARTIAL, "partial", TaskState.PARTIAL, name)

    def yield_journaled(self, lease: Lease, min_version: int) -> str:
        """Return the task as PARTIAL whose prefix is this holder's journal (a park's
        group commit, ``strawq.tasks.journal``): no payload, only the fencing rename to
        ``pending/a<minver>…~g<gen+1>~…~r<gen>~<holder>`` (no attempt spent). The caller made
        the lease's journal entries durable first. ``LeaseLost`` if fenced."""
        name = lease.name.with_(
            key=queue_key(STAGE_PARTIAL, min_version, lease.name.order),
            gen=lease.gen + 1, attempts=max(lease.name.attempts - 1, 0), resume=lease.gen,
            producer=lease.producer)
        moved = self._move_lease(lease, TaskState.PARTIAL, name)
        if lease.has_partial:  # superseded: the journal's first entry holds the prefix
            self.storage.delete(data_key(lease.task_id, lease.name.resume, "partial"))
        return moved

    def _persist(self, lease: Lease, group: GroupData, kind: Kind, suffix: str,
                 dst: TaskState, new: TaskName) -> str:
        """Payload first (durable), then the fencing rename; a fenced payload is removed."""
        self._check_group(lease, group)
        payload = data_key(lease.task_id, lease.gen, suffix)
        self._publish_payload(lease, payload, group.encode(kind, run_format=self.formats.get()))
        try:
            moved = self._move_lease(lease, dst, new)
        except LeaseLost:
            self.storage.delete(payload)
            raise
        if kind is Kind.PARTIAL and lease.has_partial:
            # the new prefixes include the old ones: the superseded partial is garbage
            self.storage.delete(data_key(lease.task_id, lease.name.resume, "partial"))
        return moved

    def regenerate(self, lease: Lease, reason: str, message: str = "") -> str:
        """Discard a claimed task's saved prefix: it is generated again from scratch.

        A producer calls this for a partial task past the η bound (``eta_mode="regenerate"``,
        ``strawq.tasks.eta``) before spending tokens on it. The semantics of the collector's
        ``regenerate`` of a ready group (``BatchStore.requeue_ready(refund=False)``): gen + 1,
        the attempt counted at claim refunded and one regeneration counted instead (a
        regeneration is not a failure: ``strawq.ondisk.names``), no prefix (``resume = -1``, so the
        next lease draws
        fresh sampling seeds), and a task that had a prefix keeps the partial stage's priority
        at version 0. The fencing rename comes first (a stale holder gets ``LeaseLost`` and
        writes nothing), then a ``fail`` note with the reason, then the superseded partial
        record is deleted.
        """
        validate_id(reason, "reason")
        new = requeued_name(lease.name, refund=False, drop_prefix=True, regenerated=True)
        moved = self._move_lease(lease, queued_state(new), new)
        try:
            self.write_note(lease.name, "fail", reason, message)
        except StorageError as exc:  # the move stands; the note is only the record of why
            log.warning("task %s regenerated (%s) but its note could not be written: %s",
                        lease.task_id, reason, exc)
        if lease.has_partial:
            self.storage.delete(data_key(lease.task_id, lease.name.resume, "partial"))
        return moved

    def eta_policy(self) -> EtaPolicy | None:
        """The collector's published η policy (``strawq.tasks.eta``; re-read every few seconds),
        or None when no collector has published one."""
        if self._policy is None:
            self._policy = PolicyCache(self.storage)
        return self._policy.get()

    def release(self, lease: Lease) -> str:
        """Give a task back untouched (no attempt spent, gen + 1)."""
        new = requeued_name(lease.name, refund=True)
        return self._move_lease(lease, queued_state(new), new)

    def fail(self, lease: Lease, reason: str, message: str = "", *,
             retryable: bool = True) -> str:
        """Record a failure; re-queue the task, or drop it after ``max_attempts``."""
        validate_id(reason, "reason")
        if retryable and lease.name.attempts < self.config.max_attempts:
            self.write_note(lease.name, "fail", reason, message)
            new = requeued_name(lease.name, refund=False)
            return self._move_lease(lease, queued_state(new), new)
        if retryable:
            reason = f"{reason}.max_attempts"
        return self.drop(lease, reason, message)

    def drop(self, lease: Lease, reason: str, message: str = "",
             summary: dict[str, Any] | None = None) -> str:
        """Drop a task with a recorded reason (e.g. a filter rejected the group)."""
        validate_id(reason, "reason")
        self.write_note(lease.name, "drop", reason, message, summary)
        return self._move_lease(lease, TaskState.DROPPED, lease.name.with_(producer=reason))

    def write_note(self, name: TaskName, kind: str, reason: str, message: str,
                    summary: dict[str, Any] | None = None) -> None:
        body = {"task_id": name.id, "gen": name.gen, "attempts": name.attempts,
                "reason": reason, "message": message, "at": time.time(),
                "summary": summary or {}}
        try:
            self.storage.publish(note_key(name.id, name.gen, kind, reason),
                                 records.encode(Kind.DROP if kind == "drop" else Kind.FAIL, body))
        except AlreadyExists:
            pass  # a retried call: the first note stands

    def _check_group(self, lease: Lease, group: GroupData) -> None:
        if group.task_id != lease.task_id:
            raise ConfigError(f"group is for task {group.task_id!r}, lease is for "
                              f"{lease.task_id!r}")

    # -- weight versions ---------------------------------------------------------------------
    def current_version(self) -> int:
        return VERSIONS.newest(self.storage.list(VERSIONS_DIR), 0)

    def set_version(self, version: int) -> None:
        """Announce weight version ``version`` (monotonic; older announcements are GC'd)."""
        current = self.current_version()
        if version < current:
            raise ConfigError(f"weight version must not go back: current {current}, "
                              f"asked {version}")
        try:
            self.storage.publish(f"versions/{VERSIONS.name(version)}", b"")
        except AlreadyExists:
            pass
        for n in VERSIONS.below(self.storage.list("versions"), version):
            self.storage.delete(f"versions/{n}")

    # -- lookups ------------------------------------------------------------------------------
    def locate(self, task_id: str) -> tuple[TaskState, str, TaskName]:
        """(state, key, name) of a task now (a scan: for tools and tests, not the hot path)."""
        for state in (TaskState.PENDING, TaskState.PARTIAL, TaskState.LEASED,
                      TaskState.READY, TaskState.BATCHED, TaskState.DROPPED):
            for key, name in entries(self.storage, state):
                if name.id == task_id:
                    return state, key, name
        raise TaskNotFound(f"task {task_id!r} is in no state of this run (trained and "
                           "garbage-collected, or never released)")

    def find(self, task_id: str) -> tuple[str, TaskName]:
        """(directory, name) of a task now: partial tasks are found in ``pending``."""
        state, _key, name = self.locate(task_id)
        return STATE_DIRS[state], name

    def read_group(self, task_id: str, gen: int) -> GroupData:
        from strawq.ondisk.groups import GroupData

        key = data_key(task_id, gen, "group")
        return GroupData.from_record(self._read_record(key, Kind.GROUP))
