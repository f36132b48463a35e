"""The in-flight journal: every held sequence's received tokens, group-committed per producer.

A producer that journals writes, once per window (``timing.journal_every_tokens`` /
``journal_every_s``), ONE record holding an *entry* for every group it holds whose
received tokens moved since its last record: what became durable-worthy since then. Not
one write per sequence: the cost is one publish per producer per window, whatever the
number of sequences. The record is a JOURNAL record (``strawq.ondisk.records``); an entry is
plain msgpack data (arrays as little-endian bytes), never code.

Layout (this module owns the key family; ``tests/test_keys.py``)::

    journal/<writer>/<incarnation>~<n>       n: the writer incarnation's record number
    journal/<writer>/<incarnation>~s<n>      a segment: records n, n+1, ... appended

**Segments.** On a store that can append (``Capabilities.append``: POSIX, memory) a writer
does not publish a file per record: it appends each record, framed (``frame``: a header
with the length and checksums, the record encoding inside), to its open *segment* and
fsyncs it: no create, rename or delete per window. A segment is created by ``publish``
holding its first frame (a reader never sees it empty) and starts at every *full* record
(every ``FULL_EVERY``-th, a park's, the first after a failed append), so a lease's chain
never spans two segments, and every segment but the open one is final. The older segments
are deleted once superseded, as records are. A reader stops at a torn or short tail frame
(a crash mid-append, or a read racing an append) without quarantining the segment; a frame
that fails its checks before an intact one is corruption: the segment is quarantined as a
record is. Record files (a store that cannot append, or a run upgraded mid-flight) stay
readable beside segments; both are ordered by ``(incarnation, n)``.

Fencing of a segment: its name carries the writer and its incarnation, its creating
``publish`` is exclusive (a name taken is skipped, as a record's), and only the
``JournalLog`` that created it appends to it (one process per incarnation, as for
records); readers never write to it (a quarantine renames it aside). A park's record
starts a new segment, so the next holder, on another client, reads a file created after
the park began, never one whose attributes its kernel may have cached while it grew.

An entry names its lease, ``(task, gen)``, and is either *full* (every sample of the group
from its first token, and the prompt: it rebuilds the group from the task record alone) or
a *delta* (per changed sample, the columns appended since the previous entry of that lease
and the sample's new status). A lease's first entry is full, so a journal never depends on
a ``.partial`` or on another holder's journal; every ``FULL_EVERY`` records the writer
writes full entries for every group it holds, after which its older records hold nothing
still needed and are deleted (the journal stays proportional to the work in flight:
docs/design.md, invariant 6).

**The resume point.** A lease's journal prefix is the newest full entry of ``(task, gen)``
followed by its deltas, up to the newest intact record: a record that fails its checks is
quarantined and the deltas newer than it are not applied (the prefix falls back to the
entries before it). It is found by the existing name: ``~r<resume>`` names the generation
whose prefix the next holder resumes from; the ``.partial`` of that generation if it exists,
else this journal. A task whose prefix is in a journal is queued as
``pending/a<minver>.<order>~<id>~g<gen+1>~a<att>~r<gen>~<writer>``: the holder slot of a
queued name carries the journal's writer (the claimer reads it before its claim renames the
holder slot to its own id; ``Lease.journal``). Two steps write such a name: the grantor's
expiry of a lease whose writer journaled it (``journaled``), and a park's yield
(``RunQueue.yield_journaled``). A queued name whose resume generation has neither a
``.partial`` nor a writer (a claimer of a journaled prefix that died before its own first
record) is found by ``find_writer``, which reads every writer's records: rare, and bounded
by what is in flight.

Fencing is a partial's: an entry is used only for the ``(task, gen)`` the name's resume
generation names, and a result of an older generation is fenced by the lease rename as
ever. A record is never rewritten (exclusive create at a new number).

**Garbage.** The writer deletes a record once every entry in it is superseded: its lease was
handed back (complete, ``.partial`` yield, drop, fail, release) or a newer full entry of the
same lease is durable. Entries whose lease was yielded into the journal (a park) stay: the
next holder resumes from them. ``sweep_journal`` (``strawq gc``, the collector's gc pass)
deletes every record and segment no live task name needs (a dead writer's, a parked
lease's once its next holder handed it back), except the newest segment of a writer with a
heartbeat file: it may still append to it (a departed writer's, whose heartbeat the
grantor deleted, is swept as any). The writer deletes its open segment itself once nothing
in it is needed; its next record, every entry a first one and so full, starts a new one.
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import TaskName, validate_id
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.heartbeats import heartbeat_states
from strawq.tasks.states import TaskState, names_in

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"
#: ``<incarnation>~<n>`` inside ``journal/<writer>/``
RECORDS = Numbered(sep="~")
#: ``<incarnation>~s<n>``: a segment whose first record is number ``n``
SEGMENTS = Numbered(sep="~s")
#: a frame's header: magic, the body's length, the body's xxh3_64, the CRC-32 of the
#: header's first 20 bytes
FRAME = struct.Struct("<4sQQI")
FRAME_MAGIC = b"SQJF"
#: a writer's every ``FULL_EVERY``-th record holds full entries of every group it holds
FULL_EVERY = 32
#: states whose task names may still need a journal entry (the resume point, or the holder)
LIVE = (TaskState.PENDING, TaskState.PARTIAL, TaskState.LEASED)

LeaseKey = tuple[str, int]


def journal_dir(writer: str) -> str:
    validate_id(writer, "producer id")
    return f"{JOURNAL_DIR}/{writer}"


def journal_key(writer: str, incarnation: int, n: int) -> str:
    return f"{journal_dir(writer)}/{RECORDS.name(incarnation, n)}"


def segment_key(writer: str, incarnation: int, n: int) -> str:
    return f"{journal_dir(writer)}/{SEGMENTS.name(incarnation, n)}"


def is_segment(key: str) -> bool:
    return SEGMENTS.pair(key.rpartition("/")[2]) is not None


def frame(chunks: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """A record's chunks framed for a segment: the header, then the chunks."""
    h = xxhash.xxh3_64()
    size = 0
    for c in chunks:
        h.update(c)
        size += len(memoryview(c).cast("B"))
    head = FRAME.pack(FRAME_MAGIC, size, h.intdigest(), 0)[:-4]
    return [head + struct.pack("<I", zlib.crc32(head)), *chunks]


def unframe(data: bytes | memoryview, key: str) -> tuple[list[memoryview], int]:
    """The intact frames' bodies of a segment, oldest first, and the bytes of a torn tail
    after them (0: none). A tail is torn when it is shorter than a header, its header is
    intact but its body runs past the end, its bytes are all zero (a size extended whose
    data never landed), or it is the last frame and its body fails the checksum; any other
    frame that fails its checks is ``CorruptRecord``: an intact frame may follow it."""
    view = memoryview(data).cast("B")
    out: list[memoryview] = []
    pos = 0
    while pos < len(view):
        rest = len(view) - pos
        if rest < FRAME.size or not any(view[pos:]):
            return out, rest
        magic, size, digest, crc = FRAME.unpack_from(view, pos)
        if magic != FRAME_MAGIC or zlib.crc32(view[pos:pos + FRAME.size - 4]) != crc:
            raise CorruptRecord(f"{key}: the frame header at byte {pos} is damaged")
        end = pos + FRAME.size + size
        if end > len(view):
            return out, rest
        body = view[pos + FRAME.size:end]
        if xxhash.xxh3_64_intdigest(body) != digest:
            if end == len(view):
                return out, rest
            raise CorruptRecord(f"{key}: the frame at byte {pos} fails its checksum, and "
                                "an intact frame may follow it")
        out.append(body)
        pos = end
    return out, 0


def _entries(rec: records.Record, key: str) -> list[dict[str, Any]]:
    entries = rec.meta.get("entries")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("task"), str)
            and isinstance(e.get("gen"), int) and isinstance(e.get("samples"), list)
            for e in entries):
        raise CorruptRecord(f"{key}: a journal record needs a list of entries, each with a "
                            "task, a gen and its samples")
    return entries


@dataclass
class JournalStats:
    """Storage operations and bytes of one writer's journal."""

    records: int = 0
    entries: int = 0
    bytes: int = 0
    deletes: int = 0
    conflicts: int = 0
    #: segments created (``publish``) and records appended to an open one
    segments: int = 0
    appends: int = 0

    def to_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass
class _Written:
    """What one published record holds that is still needed."""

    live: set[LeaseKey] = field(default_factory=set)
    #: entries of leases yielded into the journal: left for ``sweep_journal``
    kept: bool = False


class JournalLog:
    """The writer side: one producer incarnation's records (in segments on a store that
    can append, else a file each: ``segments``)."""

    def __init__(self, storage: Storage, writer: str, incarnation: int, *,
                 segments: bool | None = None) -> None:
        self.storage = storage
        self.writer = validate_id(writer, "producer id")
        self.incarnation = int(incarnation)
        self.segments = storage.capabilities.append if segments is None else bool(segments)
        self.stats = JournalStats()
        self.next = 0
        self._written: dict[int, _Written] = {}
        #: the open segment (its first record's number), None: none yet (or record files)
        self.open_segment: int | None = None
        #: an append failed: its segment may end in a torn frame; the next record is full
        #: and starts a new segment
        self._broken = False
        #: record number -> its file's number (the record's own, or its segment's)
        self._unit: dict[int, int] = {}
        #: files holding a kept entry (left for ``sweep_journal``)
        self._kept_units: set[int] = set()

    def _key(self, unit: int) -> str:
        return (segment_key if self.segments else journal_key)(self.writer, self.incarnation,
                                                                unit)

    def append(self, entries: list[dict[str, Any]], meta: Mapping[str, Any] | None = None,
               *, full: bool = False) -> int:
        """Make one record holding ``entries`` durable (written, fsync'd: a file published
        into place and its directory fsync'd, or a frame appended to the open segment);
        returns its number. ``full``: every held group's entry is full (a segment starts
        here)."""
        laid, blobs = _lay_out(entries)
        body = {**(meta or {}), "writer": self.writer, "incarnation": self.incarnation,
                "entries": laid}
        chunks = records.encode_blobs(Kind.JOURNAL, body, blobs)
        if self.segments:
            chunks = frame(chunks)
        while True:
            n = self.next
            roll = self.segments and (self.open_segment is None or full or self._broken)
            try:
                if roll or not self.segments:
                    self.storage.publish(self._key(n), chunks)
                else:
                    assert self.open_segment is not None
                    try:
                        self.storage.append(self._key(self.open_segment), chunks)
                    except BaseException:
                        self._broken = True  # a torn tail may end it: never append again
                        raise
            except AlreadyExists:  # not made by the protocol (one process per incarnation)
                self.stats.conflicts += 1
                self.next += 1
                continue
            self.next = n + 1
            break
        unit = n
        if roll:
            old, self.open_segment, self._broken = self.open_segment, n, False
            self.stats.segments += 1
            if old is not None:
                self.storage.end_append(self._key(old))
                self._drop_unit(old)
        elif self.segments:
            assert self.open_segment is not None
            unit = self.open_segment
            self.stats.appends += 1
        self.stats.records += 1
        self.stats.entries += len(entries)
        self.stats.bytes += sum(len(memoryview(c).cast("B")) for c in chunks)
        self._written[n] = _Written({(e["task"], int(e["gen"])) for e in entries})
        self._unit[n] = unit
        return n

    def full_due(self) -> bool:
        """Whether the next record should hold full entries of every held group."""
        return self._broken or (self.next > 0 and self.next % FULL_EVERY == 0)

    def superseded(self, keys: Iterable[LeaseKey], *, before: int | None = None,
                   keep: bool = False) -> int:
        """The entries of these leases (in records numbered below ``before``, or all) are
        no longer needed by this writer; ``keep``: they are a parked lease's resume point,
        left for ``sweep_journal``. Deletes every record file, and every segment but the
        open one, left with nothing needed; returns how many files."""
        keys = set(keys)
        gone = 0
        for n, w in sorted(self._written.items()):
            if before is not None and n >= before:
                continue
            hit = w.live & keys
            if not hit:
                continue
            w.live -= hit
            w.kept = w.kept or keep
            if not w.live:
                del self._written[n]
                unit = self._unit.pop(n)
                if w.kept:
                    self._kept_units.add(unit)
                gone += self._drop_unit(unit)
        return gone

    def _drop_unit(self, unit: int) -> int:
        """Delete file ``unit`` if none of its records holds a needed or kept entry; 1 if
        deleted. The open segment too: no held lease then has an entry anywhere (a full
        record starts every segment), so the next record, all first entries, starts a new
        one."""
        if unit in self._unit.values():
            return 0
        if unit in self._kept_units:
            if unit != self.open_segment:
                self._kept_units.discard(unit)
            return 0
        if unit == self.open_segment:
            self.storage.end_append(self._key(unit))
            self.open_segment = None
        self.storage.delete(self._key(unit))
        self.stats.deletes += 1
        return 1

    def close(self) -> None:
        """No more records: the open segment is no longer held open."""
        if self.open_segment is not None:
            self.storage.end_append(self._key(self.open_segment))

    def held_records(self) -> list[int]:
        """Numbers of the records this writer still tracks (tests, metrics)."""
        return sorted(self._written)


# -- the record's layout: what to find in the metadata, the columns in the payload -----------

#: an entry's byte fields, and a sample part's: in the payload, the metadata holding
#: ``[offset, length]``, so the metadata alone says which leases a record holds
ENTRY_BLOBS = ("prompt",)
PART_BLOBS = ("tokens", "logprobs", "versions", "mask")
#: bytes read first for the metadata alone (more when the header says so)
META_PREFIX = 16384


def _lay_out(entries: list[dict[str, Any]]
             ) -> tuple[list[dict[str, Any]], list[bytes | memoryview]]:
    blobs: list[bytes | memoryview] = []
    at = 0

    def put(b: Any) -> list[int]:
        nonlocal at
        data = bytes(b)
        blobs.append(data)
        at += len(data)
        return [at - len(data), len(data)]

    laid = []
    for e in entries:
        e2 = {k: (put(v) if k in ENTRY_BLOBS else v) for k, v in e.items()}
        e2["samples"] = [{k: (put(v) if k in PART_BLOBS else v) for k, v in part.items()}
                         for part in e["samples"]]
        laid.append(e2)
    return laid, [b for b in blobs if b]


def _fill(entries: list[dict[str, Any]], payload: memoryview, key: str) -> None:
    def get(ref: Any) -> bytes:
        if not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(x, int) for x in ref)
                and 0 <= ref[0] and ref[0] + ref[1] <= len(payload)):
            raise CorruptRecord(f"{key}: a journal column reference {ref!r:.40} is not "
                                f"[offset, length] within its {len(payload)}-byte payload")
        return bytes(payload[ref[0]:ref[0] + ref[1]])

    for e in entries:
        for k in ENTRY_BLOBS:
            if k in e:
                e[k] = get(e[k])
        for part in e["samples"]:
            for k in PART_BLOBS:
                if k in part:
                    part[k] = get(part[k])


# -- reading ----------------------------------------------------------------------------------

def _decode(body: bytes | memoryview, key: str, meta_only: bool) -> list[dict[str, Any]]:
    if meta_only:
        kind, meta, _ = records.decode_meta_only(bytes(body[:META_PREFIX]), name=key)
        if not meta:
            kind, meta, _ = records.decode_meta_only(bytes(body), name=key)
        if kind is not Kind.JOURNAL or not meta:
            raise CorruptRecord(f"{key}: not a whole journal record's metadata")
        return _entries(records.Record(kind, meta), key)
    rec = records.decode(body, expect=Kind.JOURNAL, name=key)
    entries = _entries(rec, key)
    _fill(entries, rec.payload, key)
    return entries


def _records_of(storage: Storage, key: str, meta_only: bool) -> list[list[dict[str, Any]]]:
    """The entries of each record in file ``key``, newest first (``CorruptRecord``,
    ``NotFound``): a record file's one, or a segment's intact frames before a torn tail."""
    if not is_segment(key):
        if not meta_only:
            return [_decode(storage.read(key), key, False)]
        kind, meta, need = records.decode_meta_only(storage.read_prefix(key, META_PREFIX),
                                                    name=key)
        if not meta:  # more metadata than the first read held
            kind, meta, need = records.decode_meta_only(storage.read_prefix(key, need),
                                                        name=key)
        if kind is not Kind.JOURNAL or not meta:
            raise CorruptRecord(f"{key}: not a whole journal record's metadata")
        return [_entries(records.Record(kind, meta), key)]
    if meta_only:
        return _segment_meta(storage, key)
    bodies, torn = unframe(storage.read(key), key)
    if torn:
        log.debug("journal segment %s ends in %d bytes of a torn frame (a crash mid-append, "
                  "or an append in progress): read up to it", key, torn)
    return [_decode(b, key, meta_only) for b in reversed(bodies)]


def _segment_meta(storage: Storage, key: str) -> list[list[dict[str, Any]]]:
    """The entries of each record in segment ``key``, newest first, their ``SCANNED_KEYS``
    alone, from each frame's header and the first bytes of its record (``read_range``:
    never the columns). A frame
    that runs past the file's size, or the last one unreadable, is a torn tail; a damaged
    header before it is ``CorruptRecord``. No checksum of the bodies beyond those read with
    their header: what a caller decides from it, a reader checks (``JournalReader``)."""
    return JournalReader(storage).segment_meta(key)


def _read(storage: Storage, key: str, quarantine: Callable[[str], object] | None, *,
          meta_only: bool = False, reader: JournalReader | None = None,
          ) -> list[list[dict[str, Any]]] | None:
    """The entries of each record in file ``key``, newest first; None when it is gone or
    corrupt (quarantined). ``meta_only``: their metadata, the columns left as references
    (a record file's prefix alone; of a segment's entries, their ``SCANNED_KEYS``, through
    ``reader`` if given; no checksum of the payload, nothing quarantined: what a caller
    decides from it, a reader checks)."""
    try:
        if meta_only and reader is not None and is_segment(key):
            return reader.segment_meta(key)
        return _records_of(storage, key, meta_only)
    except NotFound:
        return None
    except CorruptRecord as exc:
        if meta_only:
            return None
        log.error("journal record %s is corrupt (%s); quarantined, the prefix falls back to "
                  "the entries before it", key, exc)
        if quarantine is not None:
            quarantine(key)
        return None


# -- reading segments by offset ---------------------------------------------------------------

#: segments whose frames a ``JournalReader`` remembers (the oldest used forgotten first)
SCANNED_SEGMENTS = 64
#: bytes of verified frame bodies a ``JournalReader`` keeps (the oldest used dropped first)
BODY_CACHE_BYTES = 64 << 20
#: what a reader keeps of each entry of a scanned frame (which lease, whether full, its
#: oldest version): the rest of the metadata is read again with the body when needed
SCANNED_KEYS = ("task", "gen", "full", "min_version")


@dataclass(frozen=True)
class _Frame:
    """One frame of a segment: where it is, and of its record's metadata each entry's
    ``SCANNED_KEYS`` (not checked against the body's checksum, which a reader of the
    columns checks)."""

    pos: int
    length: int
    entries: list[dict[str, Any]]

    @property
    def end(self) -> int:
        return self.pos + FRAME.size + self.length

    def holds(self, lease: LeaseKey) -> tuple[bool, bool]:
        """Whether this record has an entry of ``lease``, and whether its last one is full."""
        mine = [e for e in self.entries if e["task"] == lease[0] and int(e["gen"]) == lease[1]]
        return bool(mine), bool(mine and mine[-1].get("full"))


@dataclass(frozen=True)
class _Scan:
    """What a reader found in one segment: its whole frames, oldest first, and the byte
    after the last of them (where the next scan starts)."""

    frames: tuple[_Frame, ...] = ()
    end: int = 0


class JournalReader:
    """Reads a writer's journal by offset: each segment is scanned frame by frame (the
    header and its record's first bytes: the metadata), and what was found is remembered,
    so that reading a segment again reads only the frames appended since (a ``size`` and
    a header each); a lease's prefix reads the bodies of only the frames that hold it,
    from its newest full entry on (contiguous ones in one ``read_range``), each checked
    against its checksum, and keeps them (``BODY_CACHE_BYTES``) for the next lease resumed
    from the same frame. A segment's frames are never rewritten (a writer only appends),
    so what a scan found stays true while the file exists; one that shrank is not the
    file scanned and is scanned again. Safe to share between threads."""

    def __init__(self, storage: Storage, *, body_cache_bytes: int = BODY_CACHE_BYTES) -> None:
        self.storage = storage
        self.body_cache_bytes = body_cache_bytes
        self._lock = threading.Lock()
        self._scans: OrderedDict[str, _Scan] = OrderedDict()
        self._bodies: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._body_bytes = 0

    # -- the cache -----------------------------------------------------------------------------

    def forget(self, key: str) -> None:
        """Drop what is known of segment ``key`` (gone, quarantined, or found corrupt)."""
        with self._lock:
            self._scans.pop(key, None)
            for k in [k for k in self._bodies if k[0] == key]:
                self._body_bytes -= len(self._bodies.pop(k))

    def _keep_body(self, key: str, pos: int, body: bytes) -> None:
        if len(body) > self.body_cache_bytes:
            return
        with self._lock:
            if (key, pos) in self._bodies:
                return
            self._bodies[(key, pos)] = body
            self._body_bytes += len(body)
            while self._body_bytes > self.body_cache_bytes:
                _, old = self._bodies.popitem(last=False)
                self._body_bytes -= len(old)

    def _body(self, key: str, pos: int) -> bytes | None:
        with self._lock:
            body = self._bodies.get((key, pos))
            if body is not None:
                self._bodies.move_to_end((key, pos))
            return body

    def prune(self, writer: str, keys: Iterable[str]) -> None:
        """Forget the segments of ``writer`` no longer listed."""
        live, d = set(keys), journal_dir(writer) + "/"
        with self._lock:
            gone = [k for k in self._scans if k.startswith(d) and k not in live]
        for key in gone:
            self.forget(key)

    # -- scanning ------------------------------------------------------------------------------

    def frames(self, key: str) -> tuple[tuple[_Frame, ...], int]:
        """The whole frames of segment ``key``, oldest first, and its size: those found
        before, then the frames after them (each header and its record's first bytes,
        ``read_range``). A frame that runs past the file's size, or the last one whose
        metadata or (read with it) body is unreadable, is a torn tail: left out, and
        looked at again by the next call. ``NotFound``; ``CorruptRecord``: a damaged
        header, or metadata, before an intact frame."""
        with self._lock:
            scan = self._scans.get(key, _Scan())
        try:
            size = self.storage.size(key)
            if size < scan.end:  # not the file scanned (never by the protocol): from its start
                self.forget(key)
                scan = _Scan()
            frames, end = self._scan(key, scan, size)
        except (NotFound, CorruptRecord):
            self.forget(key)
            raise
        with self._lock:
            old = self._scans.get(key)
            if old is None or old.end <= end:  # a racing scan of the same file found less
                self._scans[key] = _Scan(frames, end)
            self._scans.move_to_end(key)
            while len(self._scans) > SCANNED_SEGMENTS:
                self._scans.popitem(last=False)
        return frames, size

    def _scan(self, key: str, scan: _Scan, size: int) -> tuple[tuple[_Frame, ...], int]:
        frames = list(scan.frames)
        pos = scan.end
        while pos + FRAME.size <= size:
            head = self.storage.read_range(key, pos, FRAME.size + META_PREFIX)
            if len(head) < FRAME.size or not any(head[:FRAME.size]):
                break  # shorter than its size said (a racing truncation) or a zero-filled tail
            magic, length, digest, crc = FRAME.unpack_from(head)
            if magic != FRAME_MAGIC or zlib.crc32(head[:FRAME.size - 4]) != crc:
                raise CorruptRecord(f"{key}: the frame header at byte {pos} is damaged")
            end = pos + FRAME.size + length
            if end > size:
                break  # a torn tail
            body = head[FRAME.size:FRAME.size + length]
            whole = len(body) == length  # read with its header: checked now
            if whole and xxhash.xxh3_64_intdigest(body) != digest:
                if end == size:
                    break  # the last frame: a tail whose bytes never landed
                whole = False  # a reader of its columns finds it corrupt
            try:
                kind, meta, need = records.decode_meta_only(body, name=key)
                if not meta:  # more metadata than the first read held
                    kind, meta, need = records.decode_meta_only(
                        self.storage.read_range(key, pos + FRAME.size, min(need, length)),
                        name=key)
                if kind is not Kind.JOURNAL or not meta:
                    raise CorruptRecord(f"{key}: not a whole journal record's metadata at {pos}")
                frames.append(_Frame(pos, length, [
                    {k: e[k] for k in SCANNED_KEYS if k in e}
                    for e in _entries(records.Record(kind, meta), key)]))
            except CorruptRecord:
                if end == size:
                    break  # the last frame: a tail whose bytes never landed
                raise
            if whole:
                self._keep_body(key, pos, bytes(body))
            pos = end
        return tuple(frames), pos

    def segment_meta(self, key: str) -> list[list[dict[str, Any]]]:
        """Each record's entries in segment ``key``, newest first, their ``SCANNED_KEYS``
        alone (``frames``)."""
        return [f.entries for f in reversed(self.frames(key)[0])]

    # -- a lease's prefix ----------------------------------------------------------------------

    def _lease_records(self, key: str, lease: LeaseKey) -> list[list[dict[str, Any]]]:
        """The entries, columns as bytes, of the records of segment ``key`` a lease's
        prefix needs, newest first: those holding an entry of it, down to the newest with
        a full one (all of them when none is full). Only those frames' bodies are read,
        contiguous ones at once, each checked; the last one of the file failing its
        checksum is a torn tail (left out). ``NotFound``, ``CorruptRecord``."""
        frames, size = self.frames(key)
        wanted: list[_Frame] = []
        for f in reversed(frames):
            has, full = f.holds(lease)
            if has:
                wanted.append(f)
                if full:
                    break
        bodies: dict[int, bytes] = {}
        missing: list[_Frame] = []
        for f in sorted(wanted, key=lambda f: f.pos):
            cached = self._body(key, f.pos)
            if cached is not None:
                bodies[f.pos] = cached
            else:
                missing.append(f)
        runs: list[list[_Frame]] = []
        for f in missing:
            if runs and runs[-1][-1].end == f.pos:
                runs[-1].append(f)
            else:
                runs.append([f])
        for run in runs:
            data = memoryview(self.storage.read_range(key, run[0].pos, run[-1].end - run[0].pos))
            for f in run:
                at = f.pos - run[0].pos
                body = data[at + FRAME.size:at + FRAME.size + f.length]
                digest = FRAME.unpack_from(data, at)[2] if at + FRAME.size <= len(data) else None
                if len(body) == f.length and xxhash.xxh3_64_intdigest(body) == digest:
                    bodies[f.pos] = bytes(body)
                    self._keep_body(key, f.pos, bodies[f.pos])
                elif f.end == size and f is frames[-1]:
                    log.debug("journal segment %s ends in a torn frame at byte %d (a crash "
                              "mid-append, or an append in progress): read up to it", key, f.pos)
                else:
                    raise CorruptRecord(f"{key}: the frame at byte {f.pos} fails its checksum, "
                                        "and an intact frame may follow it")
        return [_decode(bodies[f.pos], key, False) for f in wanted if f.pos in bodies]

    def chain(self, writer: str, task: str, gen: int, *,
              quarantine: Callable[[str], object] | None = None) -> list[dict[str, Any]] | None:
        """``load_chain`` through this reader: the segments read by offset and only the
        frames the prefix of ``(task, gen)`` needs (a record file is read whole, as ever)."""
        keys = record_keys(self.storage, writer)
        self.prune(writer, keys)
        newer: list[dict[str, Any]] = []
        for key in keys:
            if is_segment(key):
                recs = self._segment_records(key, (task, gen), quarantine)
            else:
                recs = _read(self.storage, key, quarantine)
            if recs is None:
                newer = []  # a gap: nothing newer than it can be applied
                continue
            for entries in recs:
                mine = [e for e in entries if e["task"] == task and int(e["gen"]) == gen]
                if not mine:
                    continue
                e = mine[-1]
                if e.get("full"):
                    return [e, *reversed(newer)]
                newer.append(e)
        return None

    def _segment_records(self, key: str, lease: LeaseKey,
                         quarantine: Callable[[str], object] | None
                         ) -> list[list[dict[str, Any]]] | None:
        try:
            return self._lease_records(key, lease)
        except NotFound:
            self.forget(key)
            return None
        except CorruptRecord as exc:
            self.forget(key)
            log.error("journal record %s is corrupt (%s); quarantined, the prefix falls back "
                      "to the entries before it", key, exc)
            if quarantine is not None:
                quarantine(key)
            return None


def read_entries(storage: Storage, key: str) -> list[dict[str, Any]]:
    """The entries of one record file, or of every intact record of a segment oldest
    first, columns as bytes (``CorruptRecord``, ``NotFound``)."""
    return [e for rec in reversed(_records_of(storage, key, False)) for e in rec]


def record_keys(storage: Storage, writer: str) -> list[str]:
    """The writer's record files and segments, newest first (by incarnation and number)."""
    d = journal_dir(writer)
    names = storage.list(d)
    found = [((i, n), f"{d}/{RECORDS.name(i, n)}") for i, n in RECORDS.pairs(names)]
    found += [((i, n), f"{d}/{SEGMENTS.name(i, n)}") for i, n in SEGMENTS.pairs(names)]
    return [k for _, k in sorted(found, reverse=True)]


def load_chain(storage: Storage, writer: str, task: str, gen: int, *,
               quarantine: Callable[[str], object] | None = None,
               reader: JournalReader | None = None) -> list[dict[str, Any]] | None:
    """The journal prefix of lease ``(task, gen)``: its newest full entry followed by its
    deltas, oldest first, up to the newest intact record (deltas newer than a corrupt or
    vanished record are dropped: they may build on what it held). None: no full entry.
    Segments are read by ``reader`` (one kept between calls reads only what was appended
    since; without one, a reader for this call): only the frames that hold the lease."""
    return (reader or JournalReader(storage)).chain(writer, task, gen, quarantine=quarantine)


def journaled(storage: Storage, writer: str,
              quarantine: Callable[[str], object] | None = None, *,
              reader: JournalReader | None = None) -> dict[LeaseKey, int]:
    """Every lease with a full entry in ``writer``'s records, and the oldest weight
    version of its newest entry (the queue key's version: staleness first). The grantor
    reads it for the writer of each lease it expires (``reader``: its segments' frames
    scanned before are not read again)."""
    out: dict[LeaseKey, int] = {}
    keys = record_keys(storage, writer)
    if reader is not None:
        reader.prune(writer, keys)
    for key in keys:
        for entries in _read(storage, key, quarantine, meta_only=True, reader=reader) or []:
            for e in entries:
                k = (e["task"], int(e["gen"]))
                if e.get("full") and k not in out:
                    mv = e.get("min_version")
                    out[k] = int(mv) if isinstance(mv, int) else 0
    return out


def writers(storage: Storage) -> list[str]:
    return [w for w in storage.list(JOURNAL_DIR) if storage.is_dir(f"{JOURNAL_DIR}/{w}")]


def find_writer(storage: Storage, task: str, gen: int) -> str | None:
    """The writer whose records hold a full entry of ``(task, gen)`` (reads every writer's
    records: only for a queued name that lost its writer, see the module docstring)."""
    for w in writers(storage):
        for key in record_keys(storage, w):
            if any(e["task"] == task and int(e["gen"]) == gen and e.get("full")
                   for entries in _read(storage, key, None, meta_only=True) or []
                   for e in entries):
                return w
    return None


# -- garbage ----------------------------------------------------------------------------------

def _needed(names: Iterable[TaskName], state: TaskState) -> set[tuple[str, int, str | None]]:
    """(task, gen, writer) triples live names need: a lease's own entries (its holder
    writes them), and every resume generation (writer None: any writer's)."""
    out: set[tuple[str, int, str | None]] = set()
    for n in names:
        if state is TaskState.LEASED and n.producer is not None:
            out.add((n.id, n.gen, n.producer))
        if n.resume >= 0:
            out.add((n.id, n.resume, None))
    return out


def sweep_journal(storage: Storage, quarantine: Callable[[str], object] | None = None) -> int:
    """Delete every journal record file and segment no live task name needs (never a
    writer's newest segment: its writer may still append to it), and empty writer
    directories; returns how many files were deleted. The journal is listed *before* the state
    directories, and those twice (a task moving between two listings of one pass is seen
    in the other), so a record whose lease is alive at the first listing is kept."""
    listed = {w: record_keys(storage, w) for w in writers(storage)}
    if not listed:
        return 0
    beating = {p for p, _, _ in heartbeat_states(storage)}  # listed after the journal
    need: set[tuple[str, int, str | None]] = set()
    for _ in range(2):
        for state in LIVE:
            need |= _needed(names_in(storage, state), state)
    removed = 0
    for w, keys in listed.items():
        # a writer with a heartbeat may still append to its newest segment (a lease it
        # claimed after the listings); one without (departed: silent two lease timeouts,
        # holding no lease, its heartbeat deleted by the grantor) appends to none
        newest_segment = next((k for k in keys if is_segment(k)), None) if w in beating else None
        for key in keys:
            if key == newest_segment:
                continue  # its writer may still append to it
            recs = _read(storage, key, quarantine, meta_only=True)
            if recs is None:
                continue  # unreadable metadata: a reader quarantines it
            if any((e["task"], int(e["gen"]), w) in need or (e["task"], int(e["gen"]), None)
                   in need for entries in recs for e in entries):
                continue
            storage.delete(key)
            removed += 1
        storage.rmdir(journal_dir(w))
    return removed


__all__ = ["FULL_EVERY", "JOURNAL_DIR", "JournalLog", "JournalReader", "JournalStats",
           "find_writer", "frame",
           "is_segment", "journal_dir", "journal_key", "journaled", "load_chain", "read_entries",
           "record_keys", "segment_key", "sweep_journal", "unframe", "writers"]
