"""The durable FIFO under verl's queue: ``DurableSampleQueue`` (``docs/verl.md``).

Its records and their moves are declared in the core's table (``strawq.tasks.states.VERL_SAMPLES``):

* a put is durable when it returns: one record (strawq's framing, ``strawq.ondisk.records``:
  msgpack metadata, an Arrow column of the sample's bytes, a checksum) published through
  ``strawq.storage`` (temporary file, fsync, rename without replacing), then the directory
  fsync'd — one fsync shared by the puts running at once (``group_sync.DirSync``: group
  commit) — READY. A put written alone is its own file, ``samples/<seq>~<sample id>``; the
  puts of one ``write`` (a caller that batches: ``begin``: id, sequence number and record,
  no I/O; ``write``: a batch made durable; ``finish`` or ``abort``) share ONE batch file,
  ``samples/<first seq>~<last seq>~batch``: an index record (each sample's sequence number,
  id, offset and size), then the samples' records back to back, each 64-byte aligned — one
  create, write, fsync and rename for the whole batch;
* a put its putter wrote itself (verl's Rollouter, a large sample: ``IncomingWriter``,
  ``StrawqMessageQueueClient``) is durable in ``incoming/`` — PENDING — before the queue hears
  of it; ``begin_written`` and ``write`` name it ``samples/<seq>~<sample id>`` (one rename,
  then ``incoming/`` and ``samples/`` fsync'd once for the puts named together) — READY;
  ``recover`` names those no put named;
* a get hands the oldest sample out under a lease held in memory, in hand-out order —
  BATCHED, the record left in place (a batch file not in the cache is read once, and its
  samples not yet handed out are kept in memory until their turn);
* ``commit(consumed)``: a checkpoint of the trainer covers the first ``consumed``
  hand-outs: ``commits/<consumed>`` is published, then the records it covers are deleted
  — TRAINED; a batch file is deleted once every sample in it is trained or dropped (a
  partly committed one stays; a restart skips its samples the newest commit covers);
* a put past ``max_size`` (the oldest not handed out), an unreadable record, ``clear`` —
  DROPPED: a sample's own file is renamed to ``drops/<name>~<reason>``; a sample inside a
  batch file is copied there, ``drops/<seq>~<sample id>~<reason>`` (its record's bytes),
  and a restart does not hand out a batch's sample that ``drops/`` names; an unreadable
  batch file is renamed to ``drops/<name>~corrupt`` whole, its samples dropped.

Hand-outs follow put order, so "the first n hand-outs" is always "the n oldest samples not
yet committed", and a commit needs no lease records: a restart (``recover``) re-derives
every lease from the samples still on disk. A put whose sample id is already held (on disk,
or committed in one of the last ``keep_commits`` commits) is a duplicate: accepted, not
stored, counted. The sample's bytes are stored as they come and never unpickled here
(docs/design.md, invariant 7); its id and epoch are read from the pickle's opcodes without
executing it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickletools
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strawq.collector.integrations.verl.group_sync import DirSync
from strawq.errors import AlreadyExists, ConfigError, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage, open_storage
from strawq.tasks.states import VERL_SAMPLES, TaskState

log = logging.getLogger(__name__)

S = TaskState
#: reason of a sample dropped because the queue was full (verl's own overflow rule)
QUEUE_FULL = "queue_full"
#: reason of a place in a putter's batch file whose sample the queue held already
DUPLICATE = "duplicate"
_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,120}")
#: ``samples/<seq>~<sample id>``: the put order, then the (name-safe) id
SAMPLE_NAMES = Numbered(sep="~")
#: ``samples/<first seq>~<last seq>~batch``: a batch file's tail (a ``~`` no sample id
#: holds, so no id is taken for it); sorted with the single files by its first seq
BATCH_MARK = "batch"
#: ``commits/<consumed>``: how many hand-outs a checkpoint covers
COMMIT_NAMES = Numbered()
#: the store's directories (``strawq.tasks.states.VERL_SAMPLES``)
SAMPLES = VERL_SAMPLES.dir_of(S.READY)
COMMITTED = VERL_SAMPLES.others[0]
#: records a putter wrote itself (``IncomingWriter``), not yet named by the queue
INCOMING = VERL_SAMPLES.dir_of(S.PENDING)


def sample_identity(blob: bytes) -> tuple[str | None, int | None]:
    """``(sample_id, epoch)`` of a pickled verl ``RolloutSample``, read from the pickle's
    opcodes (nothing is executed); ``(None, None)`` for bytes that are not one.

    The dataclass's state is pickled after its ``full_batch``, so the last ``'sample_id'``
    key followed by a string is the sample's own (a key of that name inside the batch comes
    earlier).
    """
    # verl's pickle ends with the dataclass's state: scanning from the last ``'sample_id'``
    # key reads a dozen opcodes instead of the whole pickle (~0.6 ms of the actor's CPU per
    # put, issue 40). Trusted only when that tail parses to the pickle's own final STOP and
    # yields both fields; anything else is read from the start, as before.
    at = blob.rfind(_SID_OP)
    if at > 0 and blob.endswith(b"."):
        sid, epoch, stop = _scan(blob, at)
        if sid is not None and epoch is not None and stop == len(blob) - 1:
            return sid, epoch
    sid, epoch, _ = _scan(blob, 0)
    return sid, epoch


#: ``SHORT_BINUNICODE 'sample_id'``: the key as pickle protocols 4 and 5 write it
_SID_OP = b"\x8c\x09sample_id"


def _scan(blob: bytes, start: int) -> tuple[str | None, int | None, int]:
    """``(sample_id, epoch, position of STOP)`` read from the opcodes at ``start`` on;
    ``(None, None, -1)`` when they are not a pickle's."""
    sid: str | None = None
    epoch: int | None = None
    want: str | None = None
    stop = -1
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(memoryview(blob)[start:])):
            if op.name == "STOP":
                stop = start + int(pos or 0)
            if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                continue
            if want is not None:
                if want == "sample_id" and isinstance(arg, str):
                    sid = arg
                elif want == "epoch" and isinstance(arg, int) and not isinstance(arg, bool):
                    epoch = arg
                want = None
                continue
            if isinstance(arg, str) and arg in ("sample_id", "epoch"):
                want = arg
    except Exception:  # not a pickle: pickletools raises several unrelated types
        return None, None, -1
    return sid, epoch, stop


def batch_name(first: int, last: int) -> str:
    """The name of a batch file holding sequence numbers ``first`` to ``last``."""
    return SAMPLE_NAMES.name(first, f"{last:0{SAMPLE_NAMES.tail_width}d}~{BATCH_MARK}")


def batch_range(name: str) -> tuple[int, int] | None:
    """``(first seq, last seq)`` of a batch file's name, None for any other name."""
    got = SAMPLE_NAMES.split(name)
    if got is None:
        return None
    last, _, mark = got[1].partition("~")
    if mark != BATCH_MARK or not (last.isascii() and last.isdigit()):
        return None
    return got[0], int(last)


def _name_part(sample_id: str) -> str:
    """A sample id as a file-name component: as it is when safe, else a digest of it."""
    if _SAFE.fullmatch(sample_id):
        return sample_id
    return "h" + hashlib.blake2b(sample_id.encode(), digest_size=10).hexdigest()


def sample_record(blob: bytes, sample_id: str, *, seq: int | None = None,
                  epoch: int | None = None,
                  meta: Mapping[str, Any] | None = None) -> list[bytes]:
    """A sample's record: its metadata (id, sequence number when known, time, ``meta``)
    and its bytes as one Arrow column, in strawq's framing (``strawq.ondisk.records``)."""
    body: dict[str, Any] = {"verl": "sample", "sample_id": sample_id, "at": time.time(),
                            **(dict(meta) if meta else {})}
    if seq is not None:
        body["seq"] = seq
    if epoch is not None:
        body.setdefault("epoch", epoch)
    return records.encode(Kind.STATE, body, {"s": {"b": np.frombuffer(blob, dtype=np.uint8)}})


def incoming_name(sample_id: str) -> str:
    """A written put's name in ``incoming/``: ``<ns since the epoch>.<random>~<id part>``
    (written order first, unique across putters)."""
    return f"{time.time_ns():020d}.{secrets.token_hex(4)}~{_name_part(sample_id)}"


def incoming_part(name: str) -> str | None:
    """The sample id part of an ``incoming/`` name, None for any other name."""
    order, sep, part = name.partition("~")
    stamp, dot, nonce = order.partition(".")
    if not (sep and dot and stamp.isascii() and stamp.isdigit() and nonce.isalnum()
            and _SAFE.fullmatch(part)):
        return None
    return part


def incoming_batch_name(count: int) -> str:
    """A putter's batch file's name in ``incoming/``: ``<ns>.<random>~<count>~batch`` (a
    ``~`` no sample id part holds: never read as a single put's name)."""
    return f"{time.time_ns():020d}.{secrets.token_hex(4)}~{count}~{BATCH_MARK}"


def incoming_batch(name: str) -> int | None:
    """How many samples a putter's batch file named ``name`` holds; None for any other name."""
    order, sep, tail = name.partition("~")
    stamp, dot, nonce = order.partition(".")
    count, sep2, mark = tail.partition("~")
    if not (sep and sep2 and dot and stamp.isascii() and stamp.isdigit() and nonce.isalnum()
            and mark == BATCH_MARK and count.isascii() and count.isdigit() and int(count)):
        return None
    return int(count)


def _stamp(name: str) -> str:
    """A written put's or batch file's ``incoming/`` name's unique part, ``<ns>.<random>``."""
    return name.partition("~")[0]


def _duplicate_origin(reason: str) -> tuple[str, int] | None:
    """``(stamp, place)`` of a duplicate's drop reason ``duplicate.<ns>.<random>.<place>``
    (a place of a putter's batch file, recorded before the file was renamed); None for any
    other reason."""
    head, dot, rest = reason.partition(".")
    stamp, dot2, place = rest.rpartition(".")
    if head != DUPLICATE or not (dot and dot2 and place.isascii() and place.isdigit()):
        return None
    return stamp, int(place)


def pack_batch(recs: Sequence[list[bytes]], index: Mapping[str, Any]
               ) -> tuple[list[bytes], list[tuple[int, int]]]:
    """A batch file's bytes: its index record (``index`` plus each record's offset and size
    after it, padded to 64 bytes), then the records, each 64-byte aligned; and each record's
    ``(offset, size)`` in the file."""
    offsets: list[int] = []
    sizes: list[int] = []
    body: list[bytes] = []
    at = 0
    for rec in recs:
        size = sum(len(c) for c in rec)
        pad = -size % records.ALIGN
        offsets.append(at)
        sizes.append(size)
        body += [*rec, b"\0" * pad] if pad else rec
        at += size + pad
    head = b"".join(records.encode(Kind.STATE, {**index, "verl": "batch", "offsets": offsets,
                                                "sizes": sizes, "at": time.time()}))
    head += b"\0" * (-len(head) % records.ALIGN)
    return [head, *body], [(len(head) + o, n) for o, n in zip(offsets, sizes, strict=True)]


def _identified(blob: Any, sample_id: str | None) -> tuple[bytes, str | None, int | None]:
    """A put's sample as bytes, its id (``sample_id``, else read from the pickle: None when
    it is not a verl sample's) and its epoch (read with the id)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"a verl queue sample is bytes (ray.cloudpickle.dumps of a "
                        f"RolloutSample), found {type(blob).__name__}")
    blob = bytes(blob)
    if sample_id is not None:
        return blob, sample_id, None
    found, epoch = sample_identity(blob)
    return blob, found, epoch


def _sample_bytes(data: bytes | memoryview, key: str, *, seq: int | None = None,
                  part: str = "") -> bytes:
    """The sample's bytes from its record (``CorruptRecord`` when it is not one; ``seq``:
    the sequence number a batch file's index gives it, checked)."""
    rec = records.decode(data, expect=Kind.STATE, name=key)
    # a putter's batch file numbers its records by place (the queue names the file): a
    # record there holds no seq, and its id is checked instead
    if seq is not None and rec.meta.get("seq", seq) != seq:
        raise CorruptRecord(f"{key}: sample {part} at the place of seq {seq}")
    if part and _name_part(str(rec.meta.get("sample_id", ""))) != part:
        raise CorruptRecord(f"{key}: the record at the place of sample {part} holds "
                            f"{rec.meta.get('sample_id')!r}")
    fast = records.decode_tables_fast(rec.meta.get("tables", {}), rec.payload)
    if fast is not None and "b" in fast.get("s", {}):  # numpy views: no Arrow objects
        return bytes(fast["s"]["b"].tobytes())
    return bytes(rec.tables()["s"].column("b").to_numpy().tobytes())


@dataclass(frozen=True)
class Written:
    """A put its putter wrote (``IncomingWriter.write``): what the queue is told."""

    name: str
    sample_id: str
    size: int


@dataclass(frozen=True)
class WrittenBatch:
    """Puts its putter wrote as one batch file (``IncomingWriter.write_batch``): what the
    queue is told. ``parts``: each sample's id as a name part, in the file's order."""

    name: str
    parts: tuple[str, ...]
    size: int


class IncomingWriter:
    """The putter's half of a put written where the sample is made (verl's Rollouter,
    through ``StrawqMessageQueueClient``): the record is encoded and published in
    ``incoming/`` by the putter's own process — temporary file, fsync, rename, then the
    directory fsync'd, shared by the puts written at once (``DirSync``) — so it is durable
    before the queue hears of it, and only its name travels to the queue, whose
    ``begin_written`` and ``write`` name it ``samples/<seq>~<id>`` (one rename). Thread-safe."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._dir_sync = DirSync(lambda: self.storage.sync_dirs([INCOMING]))
        self.storage.makedirs(INCOMING)

    def write(self, blob: bytes, *, sample_id: str | None = None,
              meta: Mapping[str, Any] | None = None) -> Written:
        """Write one sample's record durably in ``incoming/``."""
        blob, sample_id, epoch = _identified(blob, sample_id)
        if sample_id is None:
            sample_id = "c" + secrets.token_hex(8)
        record = sample_record(blob, sample_id, epoch=epoch, meta=meta)
        name = incoming_name(sample_id)
        self.storage.publish(VERL_SAMPLES.key(S.PENDING, name), record, sync_dir=False)
        self._dir_sync.wait()
        return Written(name, sample_id, sum(len(c) for c in record))

    def write_batch(self, puts: Sequence[tuple[Any, str | None, Mapping[str, Any] | None]]
                    ) -> tuple[WrittenBatch | None, dict[int, Exception]]:
        """Write many samples ``(bytes, sample id or None, meta)`` durably as ONE batch file
        in ``incoming/`` (group commit: one create, write, fsync and rename for them all):
        an index of their ids, offsets and sizes, then their records. No sequence numbers:
        the queue gives the file's samples consecutive ones when it names the file
        (``DurableSampleQueue.begin_written_batch``). Returns the file (None when no put
        could be encoded) and, by place in ``puts``, the error of each put whose record
        could not be made (not a sample's bytes, metadata msgpack cannot hold): that put
        fails alone, the file holds the others."""
        recs: list[list[bytes]] = []
        parts: list[str] = []
        failed: dict[int, Exception] = {}
        for i, (blob, sample_id, meta) in enumerate(puts):
            try:
                blob, sample_id, epoch = _identified(blob, sample_id)
                if sample_id is None:
                    sample_id = "c" + secrets.token_hex(8)
                rec = sample_record(blob, sample_id, epoch=epoch, meta=meta)
            except Exception as exc:  # noqa: BLE001 (handed to that put's caller)
                failed[i] = exc
                continue
            parts.append(_name_part(sample_id))
            recs.append(rec)
        if not recs:
            return None, failed
        data, _ = pack_batch(recs, {"ids": parts})
        name = incoming_batch_name(len(parts))
        self.storage.publish(VERL_SAMPLES.key(S.PENDING, name), data, sync_dir=False)
        self._dir_sync.wait()
        return WrittenBatch(name, tuple(parts), sum(len(c) for c in data)), failed

    def discard(self, name: str) -> None:
        """Delete a written record no queue will name (the queue's process cannot see it)."""
        VERL_SAMPLES.retire(self.storage, name, S.PENDING, S.TRAINED)


@dataclass
class Pending:
    """A put begun (``DurableSampleQueue.begin``): its sequence number and name reserved,
    its record encoded, not yet durable."""

    seq: int
    part: str
    key: str
    record: list[bytes]
    blob: bytes
    #: set by ``write`` when the put went into a batch file: (offset, size) of its record
    span: tuple[int, int] | None = None
    #: a record its putter wrote itself (``IncomingWriter``): its name in ``incoming/``,
    #: which ``write`` renames to ``key``, and its size
    src: str | None = None
    size: int = 0
    #: a sample of a putter's batch file (``begin_written_batch``): the file being named
    batch: NamedBatch | None = None


@dataclass
class NamedBatch:
    """A putter's batch file the queue is naming (``begin_written_batch``): ``incoming/<src>``
    becomes ``key`` (``samples/<first>~<last>~batch``), its samples numbered by place."""

    src: str
    key: str
    first: int
    parts: tuple[str, ...]
    #: ``(seq, part)`` of the places whose sample the queue held already: never handed out
    #: (``drops/<seq>~<part>~duplicate``, recorded before the file is renamed into place)
    dups: list[tuple[int, str]]
    #: the puts of its other places, in order
    live: list[Pending] = field(default_factory=list)
    #: set once ``write`` named it (or failed to: ``error``)
    done: bool = False
    error: BaseException | None = None

    @property
    def last(self) -> int:
        return self.first + len(self.parts) - 1


@dataclass(frozen=True)
class Held:
    """A sample the queue holds: its sequence number, record key and sample id."""

    seq: int
    key: str
    sample_id: str
    #: a sample inside a batch file (``key``): (offset, size) of its record there
    span: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        """The name in ``samples/`` of the file that holds the record."""
        return self.key.rpartition("/")[2]


class DurableSampleQueue:
    """The durable FIFO under ``StrawqMessageQueue`` (synchronous; one writer: the queue).

    ``put`` → ``samples/<seq>~<id>``, ``write`` of many → one batch file (durable on
    return); ``get`` hands the oldest out and
    keeps it leased; ``commit(n)`` marks the first ``n`` hand-outs since the run began as
    trained; a new instance on the same directory (``recover``, run by the constructor)
    hands out again every sample no commit covers.
    """

    def __init__(self, storage: Storage | str, *, max_size: int = 1000, keep_commits: int = 8,
                 fsync: bool = True) -> None:
        if isinstance(storage, str):
            storage = open_storage(storage, writer_id="verlq", fsync=fsync)
        if max_size < 1:
            raise ConfigError(f"max_queue_size must be at least 1, found {max_size}")
        self.storage = storage
        self.max_size = int(max_size)
        self.keep_commits = max(1, int(keep_commits))
        self._lock = threading.RLock()
        #: the group-committed fsync of ``samples/`` that every put waits for
        self._dir_sync = DirSync(lambda: self.storage.sync_dirs([SAMPLES]))
        self._ready: deque[Held] = deque()
        self._leased: deque[tuple[int, Held]] = deque()
        self._ids: set[str] = set()
        self._inflight: set[int] = set()
        #: the bytes of samples put by this process and not yet handed out (verl's queue holds
        #: as much in memory); a restarted queue reads them from their records
        self._cache: dict[int, bytes] = {}
        #: batch file key -> its samples not yet trained nor dropped (the file is deleted
        #: when none is left)
        self._batches: dict[str, set[int]] = {}
        self._recent: deque[set[str]] = deque(maxlen=self.keep_commits)
        #: a putter's file (its ``incoming/`` stamp) -> its places recorded as duplicates in
        #: ``drops/`` (read by ``recover``): a file the queue died before renaming keeps them
        #: at its adoption, whatever the commits still remember
        self._copies: dict[str, set[int]] = {}
        self._seq = 0
        self._committed_seq = -1
        self.handed = 0
        self.consumed = 0
        self.produced = 0
        self.duplicates = 0
        self.dropped = 0
        self.bytes_put = 0
        #: ``write`` calls: the puts' trips to storage (a put alone is one)
        self.batches = 0
        #: files ``write`` published (a batch file, or a put's own file)
        self.files = 0
        #: puts whose putter wrote the record (``begin_written``), named by ``write``
        self.named = 0
        #: putters' batch files named (``begin_written_batch``)
        self.named_files = 0
        self.recovered = 0
        #: verl's checkpoint (tracker number) the newest commit stands for, if known
        self.version: int | None = None
        self.recover()

    # -- recovery --------------------------------------------------------------------------
    def recover(self) -> int:
        """Read the directory: the newest commit, then every sample it does not cover."""
        with self._lock:
            self.storage.makedirs(SAMPLES)
            self.storage.makedirs(COMMITTED)  # drops/ is made by the first drop
            self._ready.clear()
            self._cache.clear()
            self._batches.clear()
            self._leased.clear()
            self._ids.clear()
            self._recent.clear()
            self._copies.clear()
            listing = self.storage.list(COMMITTED)
            stale = set(COMMIT_NAMES.prune(listing, self.keep_commits))
            last_seq = -1
            for _, name in COMMIT_NAMES.named(listing):
                if name in stale:
                    continue
                meta = self._read_meta(VERL_SAMPLES.other_key(COMMITTED, name))
                if meta is None:
                    continue
                self.consumed = max(self.consumed, int(meta["consumed"]))
                if meta.get("version") is not None:
                    self.version = max(self.version if self.version is not None else -1,
                                       int(meta["version"]))
                last_seq = max(last_seq, int(meta["seq"]))
                self._recent.append(set(meta.get("ids", [])))
            for name in sorted(stale):
                self.storage.delete(VERL_SAMPLES.other_key(COMMITTED, name))
            self.handed = self.consumed
            dropped = self._dropped_samples()
            ready: list[Held] = []
            for name in self.storage.list(SAMPLES):
                if batch_range(name) is not None:
                    ready += self._recover_batch(name, last_seq, dropped)
                    continue
                got = SAMPLE_NAMES.split(name)
                if got is None:
                    log.warning("verl queue: %s/%s is not a sample name; left alone", SAMPLES, name)
                    continue
                seq, sid = got
                key = VERL_SAMPLES.key(S.READY, name)
                self._seq = max(self._seq, seq + 1)
                if seq <= last_seq:  # a commit whose deletions a crash interrupted
                    VERL_SAMPLES.retire(self.storage, name, S.READY, S.TRAINED)
                    continue
                if sid in self._ids:  # a second file of one sample: the first seq stands
                    log.warning("verl queue: %s/%s holds a sample an earlier file holds; "
                                "deleted", SAMPLES, name)
                    VERL_SAMPLES.retire(self.storage, name, S.READY, S.TRAINED)
                    continue
                ready.append(Held(seq, key, sid))
                self._ids.add(sid)
            self._seq = max(self._seq, last_seq + 1)
            ready += self._adopt_incoming(last_seq)
            self._ready.extend(sorted(ready, key=lambda h: h.seq))
            self._committed_seq = last_seq
            self.recovered = len(self._ready)
            return self.recovered

    def _adopt_incoming(self, last_seq: int) -> list[Held]:
        """The records putters wrote that no put named (the queue died first, or a power cut
        undid the rename): each named now, after every sample on disk, in the order they
        were written; one whose sample id is held or recently committed is a duplicate and
        deleted. None of them was handed out (a put returns, and its sample is handed out,
        only once its rename is fsync'd), so no commit counts them."""
        held: list[Held] = []
        for name in self.storage.list(INCOMING):
            count = incoming_batch(name)
            if count is not None:
                held += self._adopt_batch(name, count, last_seq)
                continue
            part = incoming_part(name)
            if part is None:
                log.warning("verl queue: %s/%s is not a written put's name; left alone",
                            INCOMING, name)
                continue
            if part in self._ids or any(part in s for s in self._recent):
                VERL_SAMPLES.retire(self.storage, name, S.PENDING, S.TRAINED)
                continue
            seq = self._seq = max(self._seq, last_seq + 1)
            self._seq += 1
            new = SAMPLE_NAMES.name(seq, part)
            try:
                VERL_SAMPLES.move(self.storage, name, S.PENDING, S.READY, new, sync_dir=False)
            except NotFound:  # another queue named it: it is in samples/ already
                continue
            held.append(Held(seq, VERL_SAMPLES.key(S.READY, new), part))
            self._ids.add(part)
        if held:
            self.storage.sync_dirs([INCOMING, SAMPLES])
        return held

    def _adopt_batch(self, name: str, count: int, last_seq: int) -> list[Held]:
        """A putter's batch file no put named: numbered after every sample on disk, its
        places whose sample is held recorded as duplicates, then renamed into ``samples/``
        (``_adopt_incoming``); a file of duplicates only is deleted. An unreadable one is
        left where it is, logged."""
        src = VERL_SAMPLES.key(S.PENDING, name)
        first = max(self._seq, last_seq + 1)
        try:
            data = self.storage.read(src)
            members = self._read_index(src, data, first, first + count - 1)
        except NotFound:
            return []  # another queue named it
        except CorruptRecord as exc:
            log.error("verl queue: %s is not a readable batch of puts (%s); left alone", src, exc)
            return []
        self._seq = first + count
        stamp = _stamp(name)
        recorded = {first + place for place in self._copies.get(stamp, ())}
        held, dups = self._sort_members(members, last_seq, set(), recorded=recorded)
        # raises: the recovery fails, nothing handed out
        self._record_duplicates(dups, origin=(stamp, first))
        if not held:  # every place a duplicate: nothing in it to hand out
            VERL_SAMPLES.retire(self.storage, name, S.PENDING, S.TRAINED)
            return []
        new = batch_name(first, first + count - 1)
        try:
            VERL_SAMPLES.move(self.storage, name, S.PENDING, S.READY, new, sync_dir=False)
        except NotFound:
            return []
        key = VERL_SAMPLES.key(S.READY, new)
        self._ids.update(part for _, part, _ in held)
        self._batches[key] = {seq for seq, _, _ in held}
        return [Held(seq, key, part, span) for seq, part, span in held]

    def _dropped_samples(self) -> set[tuple[int, str]]:
        """``(seq, id)`` of the samples ``drops/`` names (a sample dropped out of a batch
        file is still in it); no sequence number of theirs is given out again. The places
        of putters' files it records as duplicates go to ``_copies``."""
        out: set[tuple[int, str]] = set()
        for name in self.storage.list(VERL_SAMPLES.dir_of(S.DROPPED)):
            got = SAMPLE_NAMES.split(name)
            if got is None:
                continue
            seq, tail = got
            part, _, rest = tail.partition("~")
            out.add((seq, part))
            origin = _duplicate_origin(rest)
            if origin is not None:
                self._copies.setdefault(origin[0], set()).add(origin[1])
            batch = rest.startswith(BATCH_MARK + "~") and part.isascii() and part.isdigit()
            top = int(part) if batch else seq
            self._seq = max(self._seq, top + 1)
        return out

    def _recover_batch(self, name: str, last_seq: int,
                       dropped: set[tuple[int, str]]) -> list[Held]:
        """The samples of batch file ``name`` no commit covers and ``drops/`` does not name;
        the file is deleted when none is left, set aside when its index is unreadable."""
        first, last = batch_range(name) or (0, -1)
        key = VERL_SAMPLES.key(S.READY, name)
        self._seq = max(self._seq, last + 1)
        if last <= last_seq:  # a commit whose deletions a crash interrupted
            VERL_SAMPLES.retire(self.storage, name, S.READY, S.TRAINED)
            return []
        try:
            members = self._read_index(key, self.storage.read_prefix(key, 1 << 14), first, last)
        except (CorruptRecord, NotFound) as exc:
            self._set_aside(key, exc)
            return []
        held = self._members_held(key, members, last_seq, dropped)
        if not held:  # every sample trained or dropped: a deletion a crash interrupted
            self.storage.delete(key)
            return []
        self._batches[key] = {h.seq for h in held}
        return held

    def _members_held(self, key: str, members: Sequence[tuple[int, str, tuple[int, int]]],
                      last_seq: int, dropped: set[tuple[int, str]]) -> list[Held]:
        """The samples of batch file ``key`` (in ``samples/``) to hand out: those no commit
        covers, ``drops/`` does not name, and whose id no earlier sample (on disk, or in a
        recent commit) holds — a second copy (a put whose write failed after its file was
        published, then put again; a putter's batch file naming a sample twice) is a
        duplicate, recorded in ``drops/`` before anything is handed out (a failure to record
        it fails the recovery: handed out, a later restart that no longer remembers the
        sample it copies would hand it out again)."""
        held, dups = self._sort_members(members, last_seq, dropped)
        self._record_duplicates(dups)
        self._ids.update(part for _, part, _ in held)
        return [Held(seq, key, part, span) for seq, part, span in held]

    def _sort_members(self, members: Sequence[tuple[int, str, tuple[int, int]]],
                      last_seq: int, dropped: set[tuple[int, str]], *,
                      recorded: set[int] | frozenset[int] = frozenset()
                      ) -> tuple[list[tuple[int, str, tuple[int, int]]], list[tuple[int, str]]]:
        """A batch file's places to hand out, and its duplicates ``(seq, part)``
        (``_members_held``; ``recorded``: the seqs of places recorded as duplicates
        before); no side effect."""
        held: list[tuple[int, str, tuple[int, int]]] = []
        dups: list[tuple[int, str]] = []
        seen: set[str] = set()
        for seq, part, span in members:
            if seq <= last_seq or (seq, part) in dropped:
                continue
            if (seq in recorded or part in seen or part in self._ids
                    or any(part in s for s in self._recent)):
                dups.append((seq, part))
                continue
            held.append((seq, part, span))
            seen.add(part)
        return held, dups

    def _record_duplicates(self, dups: Sequence[tuple[int, str]], *,
                           origin: tuple[str, int] | None = None) -> None:
        """Record places of batch files whose sample the queue holds already
        (``drops/<seq>~<part>~duplicate``), durably, so that no restart hands them out —
        whatever commits later forget of the samples they copy. ``origin``: a putter's file
        not yet renamed, ``(its incoming/ stamp, its first seq)``: each record also names
        the file and the place (``duplicate.<stamp>.<place>``), which its adoption keeps
        should the queue die before the rename. Raises when it cannot: the caller must not
        hand out, nor publish into ``samples/``, what they stand beside."""
        if not dups:
            return
        drops = VERL_SAMPLES.dir_of(S.DROPPED)
        VERL_SAMPLES.check(S.READY, S.DROPPED)
        self.storage.makedirs(drops)
        for seq, part in dups:
            reason = (DUPLICATE if origin is None
                      else f"{DUPLICATE}.{origin[0]}.{seq - origin[1]}")
            name = f"{SAMPLE_NAMES.name(seq, part)}~{reason}"
            try:
                self.storage.publish(VERL_SAMPLES.key(S.DROPPED, name), records.encode(
                    Kind.STATE, {"verl": "drop", "seq": seq, "sample_id": part,
                                 "reason": DUPLICATE}), sync_dir=False)
            except AlreadyExists:
                pass
        self.storage.sync_dirs([drops])

    def _read_index(self, key: str, data: bytes, first: int,
                    last: int) -> list[tuple[int, str, tuple[int, int]]]:
        """``(seq, id, (offset, size))`` of each sample of a batch file, from its index (the
        record at its start; ``data``: at least the index's bytes, re-read when short)."""
        _, _, need = records.decode_meta_only(data, name=key)
        if len(data) < need:
            data = self.storage.read_prefix(key, need)
        meta = records.decode(memoryview(data)[:need], expect=Kind.STATE, name=key).meta
        body = need + (-need % records.ALIGN)
        try:
            parts = [str(x) for x in meta["ids"]]
            # a putter's batch file holds no seqs: its places are numbered from the name's
            seqs = ([int(x) for x in meta["seqs"]] if "seqs" in meta
                    else list(range(first, first + len(parts))))
            spans = [(body + int(o), int(n)) for o, n in zip(meta["offsets"], meta["sizes"],
                                                               strict=True)]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"{key}: not a batch index ({exc})") from None
        if (meta.get("verl") != "batch" or not seqs
                or len({len(seqs), len(parts), len(spans)}) != 1
                or (min(seqs), max(seqs)) != (first, last)):
            raise CorruptRecord(f"{key}: its index does not match its name")
        return list(zip(seqs, parts, spans, strict=True))

    def _set_aside(self, key: str, exc: BaseException) -> None:
        """An unreadable batch file: renamed to ``drops/<name>~corrupt``, its samples not
        handed out dropped (the bytes of those handed out in this life are with the trainer)."""
        name = key.rpartition("/")[2]
        gone = [h for h in self._ready if h.key == key]
        if gone:
            self._ready = deque(h for h in self._ready if h.key != key)
        for h in gone:
            self._ids.discard(h.sample_id)
            self._cache.pop(h.seq, None)
        self._batches.pop(key, None)
        self.dropped += len(gone)
        self.storage.makedirs(VERL_SAMPLES.dir_of(S.DROPPED))
        try:
            VERL_SAMPLES.move(self.storage, name, S.READY, S.DROPPED, f"{name}~corrupt")
        except (NotFound, AlreadyExists):
            pass
        log.error("verl queue: batch file %s unreadable (%s): set aside in %s/, its %d "
                  "samples not handed out dropped", key, exc,
                  VERL_SAMPLES.dir_of(S.DROPPED), len(gone))

    def _read_meta(self, key: str) -> dict[str, Any] | None:
        try:
            return records.decode(self.storage.read(key), expect=Kind.STATE, name=key).meta
        except (CorruptRecord, NotFound) as exc:
            log.warning("verl queue: %s unreadable (%s); skipped", key, exc)
            return None

    # -- producer side ---------------------------------------------------------------------
    def is_held(self, sample_id: str) -> bool:
        """Whether ``sample_id`` is on disk or in one of the recent commits."""
        part = _name_part(sample_id)
        with self._lock:
            return part in self._ids or any(part in s for s in self._recent)

    def put(self, blob: bytes, *, sample_id: str | None = None,
            meta: Mapping[str, Any] | None = None) -> bool:
        """Store one sample durably. Returns False when the queue was full and its oldest
        sample not yet handed out was dropped (verl's ``put_sample`` contract); a duplicate
        sample id returns True and stores nothing. (``begin``, ``write`` and ``finish`` in
        one call: the thread that calls it writes.)"""
        pending = self.begin(blob, sample_id=sample_id, meta=meta)
        if pending is None:
            return True
        try:
            error = self.write([pending])[0]
            if error is not None:
                raise error
        except BaseException:
            self.abort(pending)
            raise
        return self.finish(pending)

    def begin(self, blob: bytes, *, sample_id: str | None = None,
              meta: Mapping[str, Any] | None = None) -> Pending | None:
        """A put's first step, no I/O: read the sample's id, reserve its sequence number
        and id (hand-outs wait for it from now on), encode its record. None for a duplicate
        (counted; nothing to write). Every ``Pending`` returned must reach ``finish`` (after
        ``write`` made it durable) or ``abort``."""
        blob, sample_id, epoch = _identified(blob, sample_id)
        with self._lock:  # reserve a sequence number and the id; write outside the lock
            seq = self._seq
            if sample_id is None:
                sample_id = f"q{seq}"
            part = _name_part(sample_id)
            if part in self._ids or any(part in s for s in self._recent):
                self.duplicates += 1
                return None
            self._seq = seq + 1
            self._inflight.add(seq)
            self._ids.add(part)
        pending = Pending(seq, part, VERL_SAMPLES.key(S.READY, SAMPLE_NAMES.name(seq, part)),
                          [], blob)
        try:
            pending.record = sample_record(blob, sample_id, seq=seq, epoch=epoch, meta=meta)
        except BaseException:
            self.abort(pending)
            raise
        return pending

    def begin_written(self, name: str, *, sample_id: str, size: int) -> Pending | None:
        """A put whose putter wrote the record itself (``IncomingWriter``: durable in
        ``incoming/<name>``): reserve its sequence number and id, as ``begin``; ``write``
        renames it to ``samples/<seq>~<id>``. None for a duplicate (counted; the copy is
        deleted)."""
        part = incoming_part(name)
        if part is None or part != _name_part(sample_id):
            raise ValueError(f"verl queue: {INCOMING}/{name!r} is not the record of a put "
                             f"of sample {sample_id!r}")
        with self._lock:
            if part in self._ids or any(part in s for s in self._recent):
                self.duplicates += 1
                duplicate = True
            else:
                duplicate = False
                seq = self._seq
                self._seq = seq + 1
                self._inflight.add(seq)
                self._ids.add(part)
        if duplicate:
            VERL_SAMPLES.retire(self.storage, name, S.PENDING, S.TRAINED)
            return None
        return Pending(seq, part, VERL_SAMPLES.key(S.READY, SAMPLE_NAMES.name(seq, part)),
                       [], b"", src=name, size=int(size))

    def begin_written_batch(self, name: str, parts: Sequence[str], size: int) -> list[Pending]:
        """Puts its putter wrote as one batch file (``IncomingWriter.write_batch``: durable in
        ``incoming/<name>``, ``parts`` its samples' ids as name parts, in order): reserve one
        sequence number a place, consecutive, as ``begin``; ``write`` renames the file to
        ``samples/<first>~<last>~batch``. Returns the puts of the places whose sample the
        queue does not hold; the others are duplicates (counted; ``write`` records them in
        ``drops/`` before it renames the file, so no restart hands them out). No puts: every
        place a duplicate, and the file is deleted."""
        parts = tuple(str(p) for p in parts)
        if incoming_batch(name) != len(parts) or not all(_SAFE.fullmatch(p) for p in parts):
            raise ValueError(f"verl queue: {INCOMING}/{name!r} is not a batch file of "
                             f"{len(parts)} puts")
        with self._lock:
            seen: set[str] = set()
            dup_places: set[int] = set()
            for i, part in enumerate(parts):
                if part in seen or part in self._ids or any(part in s for s in self._recent):
                    dup_places.add(i)
                seen.add(part)
            self.duplicates += len(dup_places)
            if len(dup_places) == len(parts):
                first = -1
            else:
                first = self._seq
                self._seq = first + len(parts)
                for i, part in enumerate(parts):
                    if i not in dup_places:
                        self._inflight.add(first + i)
                        self._ids.add(part)
        if first < 0:  # its places answered "stored already": the deletion made durable,
            # or a power cut could bring the file back for a restart to adopt
            VERL_SAMPLES.retire(self.storage, name, S.PENDING, S.TRAINED)
            self.storage.sync_dirs([INCOMING])
            return []
        key = VERL_SAMPLES.key(S.READY, batch_name(first, first + len(parts) - 1))
        plan = NamedBatch(name, key, first, parts,
                          [(first + i, parts[i]) for i in sorted(dup_places)])
        each = max(1, int(size) // len(parts))
        plan.live = [Pending(first + i, part, key, [], b"", src=name, size=each, batch=plan)
                     for i, part in enumerate(parts) if i not in dup_places]
        return plan.live

    def write(self, pending: Sequence[Pending]) -> list[BaseException | None]:
        """Make begun puts durable: one put alone as its own file, more as ONE batch file
        (``_batch``); either published whole (temporary file, fsync, rename:
        ``Storage.publish``), then the directory fsync'd — shared with the puts other
        threads write at the same time (group commit, ``group_sync.DirSync``). Returns, for
        each, None when it is durable or the error that kept it from being so (a failed
        publish fails every put of its file). Thread-safe; it takes the queue's lock only
        to count and to register a batch file's samples (before any of them can be
        committed), so hand-outs go on while it runs. A put its putter wrote
        (``begin_written``, or a putter's batch file: ``begin_written_batch``) is renamed
        into place instead, and ``incoming/`` and ``samples/`` are fsync'd once for those
        named (``_name_written``, ``_name_batch``)."""
        errors: list[BaseException | None] = [None] * len(pending)
        own = [i for i, p in enumerate(pending) if p.src is None]
        written = [i for i, p in enumerate(pending) if p.src is not None]
        for i in written:
            plan = pending[i].batch
            if plan is None:
                errors[i] = self._name_written(pending[i])
                continue
            if not plan.done:
                plan.error, plan.done = self._name_batch(plan), True
            errors[i] = plan.error
        named = [i for i in written if errors[i] is None]
        if named:
            try:  # the renames durable before any of these puts returns: one fsync of each
                self.storage.sync_dirs([INCOMING, SAMPLES])
            except Exception as exc:  # noqa: BLE001 (every put it would have covered fails)
                for i in named:
                    errors[i] = exc
        if own:
            for i, error in zip(own, self._write_own([pending[i] for i in own]), strict=True):
                errors[i] = error
        return errors

    def _name_written(self, p: Pending) -> BaseException | None:
        """A written put's one step here: the rename ``incoming/<src>`` → ``samples/<seq>~<id>``
        (``NotFound``: this process cannot see the putter's file, unless the rename is found
        made: a retried rename on a shared mount). ``write`` fsyncs both directories once for
        the puts it named, before any of them returns: its hand-outs, and the commits that
        count them, rest on that name and sequence number. Then the record is read back, so
        its hand-out is from memory, as a put's."""
        assert p.src is not None
        try:
            VERL_SAMPLES.move(self.storage, p.src, S.PENDING, S.READY,
                              SAMPLE_NAMES.name(p.seq, p.part), sync_dir=False)
        except NotFound as exc:
            if not self.storage.exists(p.key):
                return exc
        except Exception as exc:  # noqa: BLE001 (handed to the put's caller)
            return exc
        with self._lock:
            self.named += 1
        try:
            p.blob = _sample_bytes(self.storage.read(p.key), p.key)
        except Exception:  # noqa: BLE001 (its hand-out reads it again, and drops it if unreadable)
            p.blob = b""
        return None

    def _name_batch(self, plan: NamedBatch) -> BaseException | None:
        """A putter's batch file's one step here: read it (its index must name the places
        the putter said, and every live place's record must be its sample's), then rename
        ``incoming/<src>`` → ``samples/<first>~<last>~batch`` (``NotFound``: this process
        cannot see the file, unless the rename is found made). Its samples' bytes are kept
        for their hand-outs, as a put's are."""
        src = VERL_SAMPLES.key(S.PENDING, plan.src)
        made = False
        try:
            try:
                data = self.storage.read(src)
            except NotFound as exc:
                if not self.storage.exists(plan.key):
                    return exc
                data, made = self.storage.read(plan.key), True
            members = self._read_index(src, data, plan.first, plan.last)
            if tuple(part for _, part, _ in members) != plan.parts:
                raise CorruptRecord(f"{src}: its index names other samples than its put did")
            view = memoryview(data)
            places = {p.seq: p for p in plan.live}
            for seq, part, (offset, size) in members:
                p = places.get(seq)
                if p is not None:
                    p.blob = _sample_bytes(view[offset:offset + size], src, seq=seq, part=part)
                    p.span, p.size = (offset, size), size
            if not made:
                # its duplicate places recorded first: once in samples/, the file is handed
                # out from at every restart, and a commit meanwhile may forget the samples
                # they copy
                try:
                    self._record_duplicates(plan.dups, origin=(_stamp(plan.src), plan.first))
                except Exception:
                    self._discard_failed(plan.src)
                    raise
                try:
                    VERL_SAMPLES.move(self.storage, plan.src, S.PENDING, S.READY,
                                      plan.key.rpartition("/")[2], sync_dir=False)
                except NotFound as exc:
                    if not self.storage.exists(plan.key):
                        return exc
        except Exception as exc:  # noqa: BLE001 (handed to the callers of its puts)
            return exc
        with self._lock:  # before any ``finish``: no commit deletes it early
            self._batches[plan.key] = {p.seq for p in plan.live}
            self.named += len(plan.live)
            self.named_files += 1
        return None

    def _discard_failed(self, src: str) -> None:
        """A putter's batch file whose puts fail before it is named: deleted, durably (best
        effort: a file left is adopted by the rules of its restart, as any put that did not
        return)."""
        try:
            VERL_SAMPLES.retire(self.storage, src, S.PENDING, S.TRAINED)
            self.storage.sync_dirs([INCOMING])
        except Exception as exc:  # noqa: BLE001 (the put's own error is what its caller sees)
            log.error("verl queue: %s/%s, whose puts failed, could not be deleted (%s)",
                      INCOMING, src, exc)

    def _write_own(self, pending: Sequence[Pending]) -> list[BaseException | None]:
        """``write`` of puts whose records the queue encoded (``begin``)."""
        errors: list[BaseException | None] = [None] * len(pending)
        try:
            if len(pending) == 1:  # its own file, the layout a batch of one gains nothing on
                p = pending[0]
                p.key = VERL_SAMPLES.key(S.READY, SAMPLE_NAMES.name(p.seq, p.part))
                p.span = None
                key, data = p.key, p.record
            else:
                key, data = self._batch(pending)
            self.storage.publish(key, data, sync_dir=False)
        except Exception as exc:  # noqa: BLE001 (handed to the callers of the file's puts)
            errors = [exc] * len(pending)
        else:
            with self._lock:
                self.files += 1
                if len(pending) > 1:  # before any ``finish``: no commit deletes it early
                    self._batches[key] = {p.seq for p in pending}
            try:
                self._dir_sync.wait()
            except Exception as exc:  # noqa: BLE001 (every put it would have covered fails)
                errors = [exc] * len(pending)
        with self._lock:
            self.batches += 1
        return errors

    def _batch(self, pending: Sequence[Pending]) -> tuple[str, list[bytes]]:
        """A batch file's key and bytes: its index record (padded to 64 bytes), then each
        put's record, 64-byte aligned; sets each put's ``key`` and ``span``."""
        seqs = [p.seq for p in pending]
        data, spans = pack_batch([p.record for p in pending],
                                 {"seqs": seqs, "ids": [p.part for p in pending]})
        key = VERL_SAMPLES.key(S.READY, batch_name(min(seqs), max(seqs)))
        for p, span in zip(pending, spans, strict=True):
            p.key, p.span = key, span
        return key, data

    def finish(self, pending: Pending) -> bool:
        """A put ``write`` made durable joins the queue, in sequence order. Returns False
        when the queue was full and its oldest sample not yet handed out was dropped."""
        with self._lock:
            self._inflight.discard(pending.seq)
            self._insert(Held(pending.seq, pending.key, pending.part, pending.span))
            if pending.blob:  # a written put's unread bytes are read at its hand-out
                self._cache[pending.seq] = pending.blob
            self.produced += 1
            self.bytes_put += pending.size or sum(len(c) for c in pending.record)
            full = len(self._ready) > self.max_size
            if full:
                self._drop(self._ready.popleft(), QUEUE_FULL)
            return not full

    def abort(self, pending: Pending) -> None:
        """A begun put that was not made durable: its reservation goes (hand-outs stop
        waiting for it; its id may be put again)."""
        with self._lock:
            self._inflight.discard(pending.seq)
            self._ids.discard(pending.part)
            if pending.span is not None:  # its batch file may be on disk: left as it is
                live = self._batches.get(pending.key)
                if live is not None:
                    live.discard(pending.seq)
                    if not live:
                        del self._batches[pending.key]

    def _insert(self, held: Held) -> None:
        """Keep ``_ready`` in sequence order (concurrent puts finish in any order)."""
        i = len(self._ready)
        while i and self._ready[i - 1].seq > held.seq:
            i -= 1
        self._ready.insert(i, held)

    def in_flight(self) -> int:
        """Puts that have a sequence number and have not returned yet."""
        with self._lock:
            return len(self._inflight)

    def _drop(self, held: Held, reason: str) -> None:
        """Set a sample aside in ``drops/<seq>~<id>~<reason>``: kept, with its reason, never
        trained. Its own file is renamed there; a sample in a batch file is copied there
        (its record's bytes), which is what keeps a restart from handing it out again."""
        drops = VERL_SAMPLES.dir_of(S.DROPPED)
        self.storage.makedirs(drops)
        if held.span is None:
            try:
                VERL_SAMPLES.move(self.storage, held.name, S.READY, S.DROPPED,
                                  f"{held.name}~{reason}")
            except (NotFound, AlreadyExists):
                pass
        else:
            VERL_SAMPLES.check(S.READY, S.DROPPED)
            offset, size = held.span
            try:
                record: bytes | list[bytes] = self.storage.read_range(held.key, offset, size)
            except NotFound:
                record = b""
            if len(record) != size:  # its batch file is gone or short: the drop alone
                record = records.encode(Kind.STATE, {"verl": "drop", "seq": held.seq,
                                                     "sample_id": held.sample_id,
                                                     "batch": held.name, "reason": reason})
            name = f"{SAMPLE_NAMES.name(held.seq, held.sample_id)}~{reason}"
            try:
                self.storage.publish(VERL_SAMPLES.key(S.DROPPED, name), record)
            except AlreadyExists:
                pass
            self._leave_batch(held)
        self._ids.discard(held.sample_id)
        self._cache.pop(held.seq, None)
        self.dropped += 1
        log.warning("verl queue: dropped sample %s (%s)", held.sample_id, reason)

    def _leave_batch(self, held: Held) -> bool:
        """A sample of a batch file is trained or dropped: True when it was the file's last,
        which the caller deletes (``_retire``) or this does (a drop)."""
        live = self._batches.get(held.key)
        if live is None:
            return False
        live.discard(held.seq)
        if live:
            return False
        del self._batches[held.key]
        self.storage.delete(held.key)
        return True

    def _retire(self, held: Held, src: TaskState) -> None:
        """A sample a commit covers: its own file deleted; a batch file once its last
        sample is gone."""
        if held.span is None:
            VERL_SAMPLES.retire(self.storage, held.name, src, S.TRAINED)
        else:
            VERL_SAMPLES.check(src, S.TRAINED)
            self._leave_batch(held)

    # -- consumer side ---------------------------------------------------------------------
    def size(self) -> int:
        """Samples not yet handed out (verl's ``get_queue_size``)."""
        with self._lock:
            return len(self._ready)

    def leased(self) -> int:
        """Samples handed out and not yet covered by a commit."""
        with self._lock:
            return len(self._leased)

    def get(self) -> tuple[Held, bytes] | None:
        """Hand the oldest sample out (leased until a commit covers it); None when empty."""
        with self._lock:
            while self._ready:
                if self._inflight and min(self._inflight) < self._ready[0].seq:
                    return None  # an older put is still being written: hand-outs keep order
                held = self._ready.popleft()
                cached = self._cache.pop(held.seq, None)
                if cached is None and held.span is not None:
                    try:
                        cached = self._load_batch(held)
                    except (CorruptRecord, NotFound, KeyError) as exc:
                        self._ready.appendleft(held)
                        self._set_aside(held.key, exc)
                        continue
                if cached is not None:
                    self.handed += 1
                    self._leased.append((self.handed, held))
                    return held, cached
                try:
                    blob = _sample_bytes(self.storage.read(held.key), held.key)
                except (CorruptRecord, NotFound, KeyError) as exc:
                    log.error("verl queue: sample %s unreadable (%s): dropped", held.key, exc)
                    self._drop(held, "corrupt")
                    continue
                self.handed += 1
                self._leased.append((self.handed, held))
                return held, blob
            return None

    def _load_batch(self, held: Held) -> bytes:
        """Read ``held``'s batch file once: its bytes, and those of the file's other samples
        not handed out yet, kept in the cache until their turn."""
        data = self.storage.read(held.key)
        first, last = batch_range(held.name) or (0, -1)
        want = {h.seq for h in self._ready if h.key == held.key} | {held.seq}
        out: bytes | None = None
        view = memoryview(data)
        for seq, part, (offset, size) in self._read_index(held.key, data, first, last):
            if seq not in want or (seq != held.seq and seq in self._cache):
                continue
            blob = _sample_bytes(view[offset:offset + size], held.key, seq=seq, part=part)
            if seq == held.seq:
                out = blob
            else:
                self._cache[seq] = blob
        if out is None:
            raise CorruptRecord(f"{held.key}: its index does not hold seq {held.seq}")
        return out

    def commit(self, consumed: int, *, version: int | None = None) -> int:
        """A checkpoint covers the first ``consumed`` hand-outs since the run began: publish
        ``commits/<consumed>``, then delete the samples it covers. Returns how many this
        call committed (0 when an earlier commit already covered them). ``version``: verl's
        checkpoint (its tracker's number) the commit stands for, kept in the record."""
        with self._lock:
            if version is not None:
                self.version = max(self.version if self.version is not None else -1,
                                   int(version))
            if consumed <= self.consumed:
                return 0
            covered: list[Held] = []
            while self._leased and self._leased[0][0] <= consumed:
                covered.append(self._leased.popleft()[1])
            # hand-outs of an earlier life of the queue: the oldest samples, in order
            n_leased = len(covered)
            n = self.consumed + n_leased
            while n < consumed and self._ready and not self._leased:
                covered.append(self._ready.popleft())
                n += 1
            last_seq = max([self._committed_seq, *(h.seq for h in covered)])
            ids = [h.sample_id for h in covered]
            self.storage.publish(VERL_SAMPLES.other_key(COMMITTED, COMMIT_NAMES.name(consumed)),
                                 records.encode(Kind.STATE, {"verl": "commit",
                                                             "consumed": consumed,
                                                             "seq": last_seq, "ids": ids,
                                                             "version": self.version,
                                                             "at": time.time()}))
            self.consumed = consumed
            self._committed_seq = last_seq
            self.handed = max(self.handed, consumed)
            self._recent.append(set(ids))
            for i, h in enumerate(covered):  # this life's hand-outs, then an earlier one's
                self._retire(h, S.BATCHED if i < n_leased else S.READY)
                self._ids.discard(h.sample_id)
            for name in COMMIT_NAMES.prune(self.storage.list(COMMITTED), self.keep_commits):
                self.storage.delete(VERL_SAMPLES.other_key(COMMITTED, name))
            return len(covered)

    def rewind(self) -> int:
        """Return every lease no commit covers to the front, oldest first (a trainer restored
        from its checkpoint beside a queue that lived on). Returns how many."""
        with self._lock:
            n = len(self._leased)
            for _, held in reversed(self._leased):
                self._ready.appendleft(held)
            self._leased.clear()
            self.handed = self.consumed
            return n

    def clear(self) -> int:
        """Forget the samples not yet handed out, durably (they are dropped with reason
        ``cleared``). Not what verl's ``clear_queue`` does here: see ``StrawqMessageQueue``."""
        with self._lock:
            n = len(self._ready)
            while self._ready:
                self._drop(self._ready.popleft(), "cleared")
            return n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"queue_size": len(self._ready), "total_produced": self.produced,
                    "total_consumed": self.handed, "dropped_samples": self.dropped,
                    "max_queue_size": self.max_size, "leased": len(self._leased),
                    "committed": self.consumed, "duplicates": self.duplicates,
                    "recovered": self.recovered, "bytes_put": self.bytes_put,
                    "dir_syncs": self._dir_sync.syncs, "write_batches": self.batches,
                    "files_written": self.files, "puts_written_by_putter": self.named,
                    "files_written_by_putter": self.named_files,
                    "dir": self.storage.describe()}
