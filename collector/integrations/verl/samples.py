"""The durable FIFO under verl's queue: ``DurableSampleQueue`` (``docs/verl.md``).

Its records and their moves are declared in the core's table (``strawq.tasks.states.VERL_SAMPLES``):

* a put is durable when it returns: one record (strawq's framing, ``strawq.ondisk.records``:
  msgpack metadata, an Arrow column of the sample's bytes, a checksum) published through
  ``strawq.storage`` (temporary file, fsync, rename without replacing) as
  ``samples/<seq>~<sample id>``, then the directory fsync'd — one fsync shared by the puts
  running at once (``group_sync.DirSync``: group commit) — READY; ``put`` in one call, or
  in steps (``begin``: id, sequence number and record, no I/O; ``write``: a batch made
  durable; ``finish`` or ``abort``) for a caller that batches;
* a get hands the oldest sample out under a lease held in memory, in hand-out order —
  BATCHED, the record left in place;
* ``commit(consumed)``: a checkpoint of the trainer covers the first ``consumed``
  hand-outs: ``commits/<consumed>`` is published, then the records it covers are deleted
  — TRAINED;
* a put past ``max_size`` (the oldest not handed out), an unreadable record, ``clear`` —
  DROPPED, renamed to ``drops/<name>~<reason>``.

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
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,120}")
#: ``samples/<seq>~<sample id>``: the put order, then the (name-safe) id
SAMPLE_NAMES = Numbered(sep="~")
#: ``commits/<consumed>``: how many hand-outs a checkpoint covers
COMMIT_NAMES = Numbered()
#: the store's directories (``strawq.tasks.states.VERL_SAMPLES``)
SAMPLES = VERL_SAMPLES.dir_of(S.READY)
COMMITTED = VERL_SAMPLES.others[0]


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


def _name_part(sample_id: str) -> str:
    """A sample id as a file-name component: as it is when safe, else a digest of it."""
    if _SAFE.fullmatch(sample_id):
        return sample_id
    return "h" + hashlib.blake2b(sample_id.encode(), digest_size=10).hexdigest()


@dataclass
class Pending:
    """A put begun (``DurableSampleQueue.begin``): its sequence number and name reserved,
    its record encoded, not yet durable."""

    seq: int
    part: str
    key: str
    record: list[bytes]
    blob: bytes


@dataclass(frozen=True)
class Held:
    """A sample the queue holds: its sequence number, record key and sample id."""

    seq: int
    key: str
    sample_id: str

    @property
    def name(self) -> str:
        """The record's name in ``samples/``."""
        return self.key.rpartition("/")[2]


class DurableSampleQueue:
    """The durable FIFO under ``StrawqMessageQueue`` (synchronous; one writer: the queue).

    ``put`` → ``samples/<seq>~<id>`` (durable on return); ``get`` hands the oldest out and
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
        self._recent: deque[set[str]] = deque(maxlen=self.keep_commits)
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
            self._leased.clear()
            self._ids.clear()
            self._recent.clear()
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
            for name in self.storage.list(SAMPLES):
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
                self._ready.append(Held(seq, key, sid))
                self._ids.add(sid)
            self._seq = max(self._seq, last_seq + 1)
            self._committed_seq = last_seq
            self.recovered = len(self._ready)
            return self.recovered

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
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"a verl queue sample is bytes (ray.cloudpickle.dumps of a "
                            f"RolloutSample), found {type(blob).__name__}")
        blob = bytes(blob)
        epoch: int | None = None
        if sample_id is None:
            sample_id, epoch = sample_identity(blob)
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
            body: dict[str, Any] = {"verl": "sample", "sample_id": sample_id, "seq": seq,
                                    "at": time.time(), **(dict(meta) if meta else {})}
            if epoch is not None:
                body.setdefault("epoch", epoch)
            pending.record = records.encode(Kind.STATE, body,
                                            {"s": {"b": np.frombuffer(blob, dtype=np.uint8)}})
        except BaseException:
            self.abort(pending)
            raise
        return pending

    def write(self, pending: Sequence[Pending]) -> list[BaseException | None]:
        """Make begun puts durable, in the order given: each record published (temporary
        file, fsync, rename: ``Storage.publish``), then the directory fsync'd once for them
        all — shared with the puts other threads write at the same time (group commit,
        ``group_sync.DirSync``). Returns, for each, None when it is durable or the error
        that kept it from being so (one failed publish fails only its own put). Thread-safe;
        it takes no lock of the queue's, so hand-outs go on while it runs."""
        errors: list[BaseException | None] = [None] * len(pending)
        for i, p in enumerate(pending):
            try:
                self.storage.publish(p.key, p.record, sync_dir=False)
            except Exception as exc:  # noqa: BLE001 (handed to that put's caller)
                errors[i] = exc
        if any(e is None for e in errors):
            try:
                self._dir_sync.wait()
            except Exception as exc:  # noqa: BLE001 (every put it would have covered fails)
                errors = [e if e is not None else exc for e in errors]
        with self._lock:
            self.batches += 1
        return errors

    def finish(self, pending: Pending) -> bool:
        """A put ``write`` made durable joins the queue, in sequence order. Returns False
        when the queue was full and its oldest sample not yet handed out was dropped."""
        with self._lock:
            self._inflight.discard(pending.seq)
            self._insert(Held(pending.seq, pending.key, pending.part))
            self._cache[pending.seq] = pending.blob
            self.produced += 1
            self.bytes_put += sum(len(c) for c in pending.record)
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
        """Move a sample to ``drops/<name>~<reason>``: kept, with its reason, never trained."""
        self.storage.makedirs(VERL_SAMPLES.dir_of(S.DROPPED))
        try:
            VERL_SAMPLES.move(self.storage, held.name, S.READY, S.DROPPED,
                              f"{held.name}~{reason}")
        except (NotFound, AlreadyExists):
            pass
        self._ids.discard(held.sample_id)
        self._cache.pop(held.seq, None)
        self.dropped += 1
        log.warning("verl queue full (%d): dropped its oldest sample %s", self.max_size,
                    held.sample_id)

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
                if cached is not None:
                    self.handed += 1
                    self._leased.append((self.handed, held))
                    return held, cached
                try:
                    rec = records.decode(self.storage.read(held.key), expect=Kind.STATE,
                                         name=held.key)
                    blob = rec.tables()["s"].column("b").to_numpy().tobytes()
                except (CorruptRecord, NotFound, KeyError) as exc:
                    log.error("verl queue: sample %s unreadable (%s): dropped", held.key, exc)
                    self._drop(held, "corrupt")
                    continue
                self.handed += 1
                self._leased.append((self.handed, held))
                return held, blob
            return None

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
                VERL_SAMPLES.retire(self.storage, h.name,
                                    S.BATCHED if i < n_leased else S.READY, S.TRAINED)
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
                    "dir": self.storage.describe()}
