"""The grantor's side of ready groups: staleness-first scan, batch manifests, ack, GC.

A batch is a MANIFEST record that *references* ready groups (no payload copy). Publishing
``batches/<seq>`` is the commit point and the only step: the groups it names are BATCHED
from then on, their entries left in ``ready/`` (no rename per group). A scan lists
``batches/`` first, then ``ready/``, and skips every group a present manifest names
(``batched_names``), so a group enters at most one batch (docs/design.md, invariant 1).
``ack`` publishes ``acked/<seq>``; ``gc`` then deletes the payloads, the entries and finally
the manifest, so a crash mid-GC is simply redone. A run written by an older strawq may
still hold entries in ``batched/`` (the rename this replaced): they are read, dropped,
recovered and collected as before (``LEGACY_BATCHED``).

This module owns the batch key families; nothing else spells them::

    batches/<seq>            MANIFEST record (``manifest_key``)
    acked/<seq>              the trainer consumed batch ``seq`` (``ack_key``)
    delivered/<seq>~<v>      rank 0's reader delivered batch ``seq`` at weight version ``v``
                             (``mark_delivered``, ``delivered``; the name is the data)
    collector/bseq-<seq>     the highest batch number whose manifest was retired
                             (``high_water``, ``mark_high_water``): numbers are never reused

A manifest leaves the run one way, ``BatchStore.retire`` (high-water mark, then manifest and
ack), or is quarantined (``BatchStore.quarantine_manifest``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from strawq.data.history import record_attempts, trained_rows
from strawq.delivery.commits import committed_seq
from strawq.errors import AlreadyExists, ConfigError, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import TaskName, data_key, requeued_name
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import DIRS, Depths, TaskState, chunk_key, delete_trained, depths, \
    entries, held_chunks, key_of, move, names_in, queued_state, upstream_depths

S = TaskState

log = logging.getLogger(__name__)

_META_PROBE = 8192

MANIFEST_DIR = "batches"
ACK_DIR = "acked"
DELIVERED_DIR = "delivered"
HIGH_WATER_DIR = "collector"
_HIGH_WATER_PREFIX = "bseq-"
#: ``batches/<seq>``, ``acked/<seq>``, ``delivered/<seq>~<v>``, ``collector/bseq-<seq>``
MANIFESTS = Numbered()
ACKS = Numbered()
DELIVERIES = Numbered(sep="~")
HIGH_WATER = Numbered(_HIGH_WATER_PREFIX)


def manifest_key(seq: int) -> str:
    """``batches/<seq>``: the batch's MANIFEST record."""
    return f"{MANIFEST_DIR}/{MANIFESTS.name(seq)}"


def ack_key(seq: int) -> str:
    """``acked/<seq>``: the trainer consumed batch ``seq`` (empty; the name is the data)."""
    return f"{ACK_DIR}/{ACKS.name(seq)}"


def batch_seqs(storage: Storage) -> tuple[list[int], set[int]]:
    """(every manifest number present, the acked ones)."""
    seqs = _manifest_seqs(storage)
    return seqs, _acked(storage)


def _manifest_seqs(storage: Storage) -> list[int]:
    return MANIFESTS.numbers(storage.list(MANIFEST_DIR))


def _acked(storage: Storage) -> set[int]:
    return set(ACKS.numbers(storage.list(ACK_DIR)))


def high_water(storage: Storage) -> int:
    """The highest batch number whose manifest was retired (0: none yet)."""
    return HIGH_WATER.newest(storage.list(HIGH_WATER_DIR), 0)


def mark_high_water(storage: Storage, seq: int) -> None:
    """Record that batch numbers up to ``seq`` are used (never reused); prune lower marks."""
    try:
        storage.publish(f"{HIGH_WATER_DIR}/{HIGH_WATER.name(seq)}", b"")
    except AlreadyExists:
        pass
    for mark in HIGH_WATER.below(storage.list(HIGH_WATER_DIR), seq):
        storage.delete(f"{HIGH_WATER_DIR}/{mark}")


def mark_delivered(storage: Storage, seq: int, version: int) -> None:
    """Rank 0's reader delivered batch ``seq`` while the run announced weight ``version``:
    from now on the batch is being trained (``delivered``). Idempotent; a batch delivered
    again (a restored trainer) gets a second mark, and the newest version counts."""
    storage.makedirs(DELIVERED_DIR)
    try:
        storage.publish(f"{DELIVERED_DIR}/{DELIVERIES.name(seq, version)}", b"",
                        sync_file=False)
    except AlreadyExists:
        pass


def delivered(storage: Storage) -> dict[int, int]:
    """Batch number -> the newest weight version it was delivered at."""
    out: dict[int, int] = {}
    for seq, version in DELIVERIES.pairs(storage.list(DELIVERED_DIR)):
        out[seq] = max(out.get(seq, 0), version)
    return out


def forget_delivered(storage: Storage, seq: int) -> None:
    """Delete every delivery mark of batch ``seq``."""
    for n in storage.list(DELIVERED_DIR):
        if DELIVERIES.parse(n) == seq:
            storage.delete(f"{DELIVERED_DIR}/{n}")


def forget_delivered_after(storage: Storage, seq: int, *, acks: bool = False) -> int:
    """A trainer restored from a checkpoint covering batches ``<= seq`` trains every later
    batch again: their delivery marks go (they count as waiting until delivered again),
    and with ``acks`` their acks too (a checkpointing reader delivers them again, acked or
    not, so they are not consumed). Returns how many batches were marked delivered."""
    later = [s for s in delivered(storage) if s > seq]
    for s in later:
        forget_delivered(storage, s)
    if acks:
        for s, n in ACKS.named(storage.list(ACK_DIR)):
            if s > seq:
                storage.delete(f"{ACK_DIR}/{n}")
    return len(later)


def queue_depths(storage: Storage, *, store: BatchStore | None = None) -> Depths:
    """Tasks per state now (``strawq.tasks.states.depths``), a ready group that a manifest
    names counted BATCHED: listed upstream first, then ``batches/``, then ``ready/``.
    ``store``: one kept between calls reads each manifest once (``batched_names``)."""
    up = upstream_depths(storage)
    named = (store or BatchStore(RunQueue(storage))).batched_names()
    listed = names_in(storage, S.READY)
    n_batched = sum(1 for n in listed if str(n) in named)
    return depths(storage, upstream=up, ready=len(listed) - n_batched, batched=n_batched)


@dataclass(frozen=True)
class Manifest:
    seq: int
    groups: list[TaskName]
    summaries: list[dict[str, Any]]
    meta: dict[str, Any]


def decode_manifest(data: bytes, *, name: str) -> Manifest:
    """A manifest record; ``CorruptRecord`` for one that does not hold what a manifest does."""
    m = records.decode(data, expect=Kind.MANIFEST, name=name).meta
    try:
        groups = m["groups"]
        if not isinstance(groups, list) or not all(isinstance(n, str) for n in groups):
            raise TypeError("groups is not a list of task names")
        return Manifest(m["seq"], [TaskName.parse(n) for n in groups], m["summaries"],
                        m["meta"])
    except (KeyError, TypeError, ConfigError) as exc:
        raise CorruptRecord(f"{name}: not a valid manifest ({type(exc).__name__}: {exc})") \
            from exc


@dataclass
class GcReport:
    batches: int = 0
    payloads: int = 0
    stale: int = 0
    tmp: int = 0
    #: dropped entries folded into the drop audit (``strawq.delivery.retention``)
    drops: int = 0
    #: turn checkpoints of tasks that can no longer resume from them (``strawq.delivery.retention``)
    turns: int = 0
    #: journal records no live task needs (``strawq.tasks.journal.sweep_journal``)
    journal: int = 0
    #: kept task records of compacted drops that expired (``strawq.delivery.retention.expire_kept``)
    expired: int = 0
    #: orphaned rank shards deleted (``strawq.delivery.packed``)
    shards: int = 0
    details: list[str] = field(default_factory=list)


class BatchStore:
    def __init__(self, queue: RunQueue) -> None:
        self.queue = queue
        self.storage = queue.storage
        #: ``dropped/`` entries already recorded in the history (``gc``: record_drops)
        self._drops_recorded: set[str] = set()
        #: manifest number -> the groups it names (``batched_names``; manifests never change)
        self._named: dict[int, frozenset[str]] = {}
        #: whether ``_named`` was read from ``batches/`` (``batched_names``, ``recover``)
        self._loaded = False
        #: whether ``batched/`` holds an older strawq's entries (None: not listed yet)
        self._legacy: bool | None = None
        #: refused manifests, whose groups this store scans as ready (``unname``)
        self._unnamed: set[int] = set()
        #: ((known manifests, refused ones), the union of their groups): ``_named_now``
        self._union: tuple[tuple[frozenset[int], frozenset[int]], set[str]] | None = None
        #: entries of the last ``scan_ready`` listing that a manifest named (BATCHED)
        self.batched_in_ready = 0

    # -- ready ---------------------------------------------------------------------------------
    def scan_ready(self) -> list[TaskName]:
        """Ready groups no manifest names, oldest minimum weight version first (then dataset
        order). ``batched_in_ready``: how many entries of the listing a manifest named.

        The manifests are read from ``batches/`` at this store's first scan (or by
        ``recover``); after that the store knows what it publishes and retires itself, and
        does not list ``batches/`` again: the collector is the run's one publisher (its
        epoch fence), and a superseded one's late manifest is refused, its groups batched
        again (``unname``). A manifest another process retired took its entries first."""
        if not self._loaded:
            self.batched_names()  # batches/ listed before ready/: see batched_names
        named = self._named_now()
        listed = self.storage.list(DIRS[S.READY])  # names sort by <minver>.<order>
        fresh = [n for n in listed if n not in named]  # batched ones skipped unparsed
        parsed = [name for _key, name in entries(self.storage, S.READY, listed=fresh)]
        out = [n for n in parsed if str(n) not in named]  # a name spelled another way
        self.batched_in_ready = len(listed) - len(fresh) + len(parsed) - len(out)
        return out

    def batched_names(self) -> set[str]:
        """The groups the manifests in ``batches/`` name now (refused ones' excepted:
        ``unname``). Lists ``batches/`` and reads each manifest it has not read before (a
        manifest never changes and its number is never reused); call it BEFORE listing
        ``ready/``: GC deletes a group's entry before its manifest, so an entry listed after
        its manifest went is gone too, never taken for an unbatched one. An unreadable
        manifest names nothing here (``recover`` quarantines it: its groups go back)."""
        seqs = _manifest_seqs(self.storage)
        present = set(seqs)
        for seq in [s for s in self._named if s not in present]:
            del self._named[seq]
        for seq in seqs:
            if seq in self._named:
                continue
            try:
                man = self.read_manifest(seq)
            except NotFound:
                continue  # retired since the listing: its entries went before it
            except CorruptRecord as exc:
                log.error("batch manifest %d is unreadable (%s): its groups count as ready "
                          "until recovery quarantines it", seq, exc)
                continue
            self._named[seq] = frozenset(str(n) for n in man.groups)
        self._loaded = True
        return self._named_now()

    def _named_now(self) -> set[str]:
        """The union of the groups the known manifests name, refused ones' excepted
        (kept until ``_named`` or ``_unnamed`` changes)."""
        key = (frozenset(self._named), frozenset(self._unnamed))
        if self._union is None or self._union[0] != key:
            out: set[str] = set()
            for seq, names in self._named.items():
                if seq not in self._unnamed:
                    out |= names
            self._union = (key, out)
        return self._union[1]

    def unname(self, seq: int) -> None:
        """Batch ``seq`` was refused (a superseded collector's late manifest,
        ``strawq.collector.fencing``): its groups are ready again for this store's scans."""
        self._unnamed.add(seq)

    def read_summary(self, name: TaskName) -> dict[str, Any]:
        """A group's metadata from its record header, without reading the payload."""
        key = data_key(name.id, name.gen, "group")
        head = self.storage.read_prefix(key, _META_PROBE)
        kind, meta, need = records.decode_meta_only(head, name=key)
        if not meta:
            size = self.storage.size(key)
            if need > size:  # never read (allocate) what a damaged header claims
                raise CorruptRecord(f"{key}: header promises {need} bytes of metadata, the "
                                    f"file has {size} (torn or corrupt)")
            kind, meta, _ = records.decode_meta_only(self.storage.read_prefix(key, need), name=key)
        if kind != Kind.GROUP:
            raise CorruptRecord(f"{key}: expected a GROUP record, found {kind.name}")
        summary = meta.get("group")
        if not isinstance(summary, dict):
            raise CorruptRecord(f"{key}: its metadata holds no group summary")
        return summary

    # -- batches -------------------------------------------------------------------------------
    def publish_batch(self, seq: int, names: Sequence[TaskName],
                      summaries: Sequence[dict[str, Any]] | None = None,
                      meta: dict[str, Any] | None = None) -> Manifest:
        """Commit a batch (exclusive create of the manifest), then move its groups."""
        # producers' renames, made durable: both sides (a task leased in a chunk, range
        # claims, leaves its chunk's directory: those of the held chunks, from one listing)
        self.storage.sync_dirs([DIRS[S.READY], DIRS[S.LEASED]])
        if self.queue.config.release_chunk > 1:
            for c in held_chunks(self.storage):
                try:
                    self.storage.sync_dirs([chunk_key(c)])
                except FileNotFoundError:  # NotFound too
                    pass  # removed since the listing: its last task left it
        body = {"seq": seq, "groups": [str(n) for n in names],
                "summaries": list(summaries or []), "meta": meta or {}, "at": time.time()}
        self.storage.publish(manifest_key(seq), records.encode(Kind.MANIFEST, body))
        # the commit point and the only step: the groups are BATCHED where they lie
        self._named[seq] = frozenset(str(n) for n in names)
        return Manifest(seq, list(names), list(summaries or []), meta or {})

    def batch_seqs(self) -> tuple[list[int], set[int]]:
        """(all manifest seqs present, the acked ones)."""
        return batch_seqs(self.storage)

    def read_manifest(self, seq: int) -> Manifest:
        key = manifest_key(seq)
        return decode_manifest(self.storage.read(key), name=key)

    def recover(self) -> list[Manifest]:
        """Read the manifests; returns the unacked ones, oldest first.

        A batch's commit is its manifest alone, so no commit is left half done. A manifest
        that fails its checks is quarantined: its groups, no longer named, are ready again
        (possibly trained twice, never lost; logged as an error, since only storage
        corruption gets here). So is every ``batched/`` entry an older strawq left that no
        readable manifest names (``LEGACY_BATCHED``).
        """
        seqs, acked = self.batch_seqs()
        pending = []
        self._named.clear()
        for seq in seqs:
            try:
                man = self.read_manifest(seq)
            except CorruptRecord as exc:
                log.error("batch manifest %d is corrupt (%s): quarantined; its groups go back "
                          "to ready and may be trained twice", seq, exc)
                self.quarantine_manifest(seq)
                continue
            self._named[seq] = frozenset(str(n) for n in man.groups)
            if seq not in acked:
                pending.append(man)
        named = self.batched_names()
        for name in names_in(self.storage, S.BATCHED):  # an older strawq's batched/ entries
            if str(name) not in named:
                try:
                    move(self.storage, name, S.BATCHED, S.READY)
                except (NotFound, AlreadyExists):
                    pass
        return pending

    def next_seq(self) -> int:
        seqs, _ = self.batch_seqs()
        return max(max(seqs, default=0), high_water(self.storage)) + 1

    def ack(self, seq: int) -> None:
        """The trainer consumed batch ``seq``: its groups become garbage."""
        if not self.storage.exists(manifest_key(seq)):
            raise NotFound(2, f"batch {seq} has no manifest (never published, or already "
                              "garbage-collected)")
        try:
            self.storage.publish(ack_key(seq), b"")
        except AlreadyExists:
            pass

    # -- staleness bound ----------------------------------------------------------------------
    def drop_ready(self, name: TaskName, reason: str, message: str = "",
                   summary: dict[str, Any] | None = None) -> bool:
        """Move a ready group to DROPPED (e.g. staler than the bound η)."""
        return self.drop_from(S.READY, name, reason, message, summary)

    def drop_from(self, state: TaskState | str, name: TaskName, reason: str,
                  message: str = "", summary: dict[str, Any] | None = None) -> bool:
        """Drop a READY or BATCHED group with a recorded reason; False if it moved on.
        ``summary``: what the group came to, kept in the drop's note (its rewards reach the
        per-prompt history when the drop is compacted, ``strawq.data.history``). A BATCHED
        group's entry is in ``ready/`` (or, left by an older strawq, in ``batched/``)."""
        if state not in (S.READY, S.BATCHED):
            raise ValueError(f"drop_from: state must be 'ready' or 'batched', got {state!r}")
        src = S(state)
        self.queue.write_note(name, "drop", reason, message, summary)
        dropped = name.with_(producer=reason)
        try:
            move(self.storage, name, src, S.DROPPED, dropped, src_key=key_of(S.READY, name))
        except (NotFound, AlreadyExists):
            if src is not S.BATCHED:
                return False
            try:
                move(self.storage, name, S.BATCHED, S.DROPPED, dropped)
            except (NotFound, AlreadyExists):
                return False
        return True

    def requeue_ready(self, name: TaskName, *, refund: bool = True) -> bool:
        """Send a too-stale ready group back as fresh work (gen + 1; the attempt counted at
        its claim is refunded; ``refund=False``, the collector's ``regenerate``, counts one
        regeneration instead of keeping the attempt: a regeneration is not a failure)."""
        new = requeued_name(name, refund=refund, drop_prefix=True, regenerated=not refund)
        try:
            move(self.storage, name, S.READY, queued_state(new), new)
        except (NotFound, AlreadyExists):
            return False
        self.storage.delete(data_key(name.id, name.gen, "group"))
        return True

    # -- garbage collection --------------------------------------------------------------------
    def gc(self, *, full: bool = False, keep_batches: int = 0, sweep: bool = False,
           compact_drops_at: int | None = None, keep_drops_days: float | None = None
           ) -> GcReport:
        """Delete consumed batches.

        ``sweep`` (or ``full``) also deletes ``data/`` records no live entry needs
        (``strawq.delivery.retention.sweep_payloads``) and turn checkpoints no task can resume from
        (``sweep_turns``); ``compact_drops_at=N`` folds ``dropped/``
        into the drop audit once it holds at least N entries (0: always), and till then
        records its new entries in the per-prompt history (``record_drops``: the history's
        rules see a dropped group's rewards by the next pass). With ``compact_drops_at``,
        the task records of compacted drops kept longer than ``keep_drops_days`` (default
        ``retention.KEEP_DROPS_DAYS``; 0: all) are deleted: no longer requeueable.
        """
        rep = GcReport()
        # The acks first: an ack is published only once its manifest exists, so an ack whose
        # manifest the later listing misses was retired (an orphan, deleted below). Listed
        # the other way round, a batch published and acked between the two listings looked
        # like an orphan and lost its ack. Nothing acked: nothing to collect, and neither
        # ``batches/`` nor ``committed/`` is listed (an idle GC costs one listing).
        acked = _acked(self.storage)
        seqs = _manifest_seqs(self.storage) if acked else []
        if acked:
            # forget the manifests another process retired (one numbered above the listing's
            # newest may have been published since: kept)
            listed, newest = set(seqs), max(seqs, default=0)
            for seq in [s for s in self._named if s not in listed and s < newest]:
                del self._named[seq]
        # acked is consumed; trained (collectable) once a checkpoint covers it (commits.py)
        committed = committed_seq(self.storage) if acked else None
        done = sorted(s for s in seqs if s in acked and (committed is None or s <= committed))
        if keep_batches:
            done = done[:-keep_batches]
        manifests = []
        for seq in done:
            try:
                manifests.append(self.read_manifest(seq))
            except CorruptRecord as exc:
                log.error("manifest %s is corrupt (%s); quarantining", seq, exc)
                self.queue.quarantine(manifest_key(seq))
        legacy = False
        if manifests:  # the per-prompt history, before what it describes is deleted
            record_attempts(self.storage, trained_rows(manifests))
            legacy = self._legacy_entries()
        for man in manifests:
            seq = man.seq
            for name in man.groups:
                self.storage.delete(data_key(name.id, name.gen, "group"))
                if name.resume >= 0:
                    self.storage.delete(data_key(name.id, name.resume, "partial"))
                delete_trained(self.storage, name, legacy=legacy)
                rep.payloads += 1
            if man.meta.get("packed"):  # its rank shards (packed.py imports numpy: only
                from strawq.delivery import packed  # when there are shards; status stays light)

                packed.delete_named(self.storage, seq, man.meta)
            self.retire(seq)
            rep.batches += 1
        for seq in acked - set(seqs):
            # an ack whose manifest GC already removed (a crash between the two deletions)
            self.storage.delete(ack_key(seq))
        if compact_drops_at is not None:
            from strawq.delivery.retention import (
                KEEP_DROPS_DAYS,
                compact_drops,
                expire_kept,
                record_drops,
            )

            dropped = self.storage.list(DIRS[S.DROPPED])
            if dropped and len(dropped) >= compact_drops_at:
                rep.drops = compact_drops(self.storage)
            elif dropped:
                record_drops(self.storage, self._drops_recorded)
            rep.expired = expire_kept(self.storage, keep_days=KEEP_DROPS_DAYS
                                      if keep_drops_days is None else keep_drops_days)
        if full or sweep:
            from strawq.delivery.retention import sweep_turns

            rep.stale = self._gc_stale_generations()
            rep.turns = sweep_turns(self.storage)
            from strawq.tasks.journal import sweep_journal

            rep.journal = sweep_journal(self.storage)
            # rank shards whose batch has no manifest (a crash between the shards and the
            # manifest, a lost race for its number, a retired batch). Shards written for a
            # manifest not yet published by another process (an operator's ``strawq gc``
            # beside the collector) may go too: their readers then read the records
            from strawq.delivery import packed

            rep.shards = packed.sweep_orphans(self.storage, self.batch_seqs()[0])
        return rep

    def _legacy_entries(self) -> bool:
        """Whether ``batched/`` holds entries an older strawq moved there. Nothing moves a
        group there any more: once seen empty it is not listed again."""
        if self._legacy is not False:
            self._legacy = bool(self.storage.list(DIRS[S.BATCHED]))
        return self._legacy

    def retire(self, seq: int) -> None:
        """The one way a manifest leaves the run: mark its number used (numbers are never
        reused), then delete the manifest and its ack. Its groups' entries are the caller's
        (GC deletes them first; a superseded manifest's went back to ``ready/``). Delivery
        marks stay until ``prune_delivered`` finds them no longer needed."""
        mark_high_water(self.storage, seq)
        self.storage.delete(manifest_key(seq))
        self.storage.delete(ack_key(seq))
        self._named.pop(seq, None)

    def quarantine_manifest(self, seq: int) -> None:
        """Move an unreadable manifest aside (``quarantine/``) and forget its ack."""
        self.queue.quarantine(manifest_key(seq))
        self.storage.delete(ack_key(seq))

    def prune_delivered(self, version: int, present: Iterable[int], acked: Iterable[int]) -> None:
        """Delete delivery marks no projection needs: a batch delivered before ``version``
        (its gradient is in the weights) that is acked or retired."""
        live = set(present) - set(acked)
        for seq, at in delivered(self.storage).items():
            if at < version and seq not in live:
                forget_delivered(self.storage, seq)

    def _gc_stale_generations(self) -> int:
        """Payloads of fenced generations, and every record of a task no entry names."""
        from strawq.delivery.retention import sweep_payloads

        return sweep_payloads(self.storage)
