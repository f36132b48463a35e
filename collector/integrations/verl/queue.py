"""verl's fully-async ``MessageQueue``, durable: ``StrawqMessageQueue`` (``docs/verl.md``).

verl's fully-async policy puts every finished ``RolloutSample`` (pickled by the Rollouter with
``ray.cloudpickle``) into a ``MessageQueue`` Ray actor and the Trainer takes them one by one;
the actor's deque dies with it. ``StrawqMessageQueue`` has the same methods and the same
constructor ``(config, max_queue_size)``, and keeps the samples in a strawq storage directory:

* a put is durable when it returns: one record (strawq's framing, ``strawq.records``: msgpack
  metadata, an Arrow column of the sample's bytes, a checksum) published through
  ``strawq.storage`` (temporary file, fsync, rename without replacing, directory fsync) as
  ``samples/<seq>~<sample id>``;
* a get hands the oldest sample out under a lease (held by the queue, in hand-out order);
* a sample counts as consumed only when a checkpoint of the trainer covers it:
  ``commit(consumed)`` (or, for verl's own trainer, the queue reading verl's checkpoint
  tracker, ``latest_checkpointed_iteration.txt``: the checkpoint holds the gets handed out
  when the queue first sees the tracker move, verl making none between its save and its
  next step; at least v · ppo_mini_batch_size · require_batches ·
  trigger_parameter_sync_step at version v) publishes
  ``commits/<consumed>`` and deletes the samples it covers. A queue that starts again
  hands every sample not covered out again, oldest first; ``rewind()`` does the same for a
  trainer restarted beside a queue that lived on.

Hand-outs follow put order, so "the first n hand-outs" is always "the n oldest samples not yet
committed", and a commit needs no lease records: a restart re-derives every lease from the
samples still on disk. A put whose sample id is already held (on disk, or committed in one of
the last ``keep_commits`` commits) is a duplicate: accepted, not stored, counted. The
sample's bytes are stored as they come and never unpickled here (docs/design.md,
invariant 7); its id and epoch are read from the pickle's opcodes without executing it.

verl's queue is a Ray actor by verl's design: ``actor_class()`` wraps this class with
``ray.remote`` (the one place this module needs Ray, imported there), and ``install()`` puts
it where verl's ``fully_async_main`` looks for ``MessageQueue`` (run in every Ray worker by
``ray_kwargs.ray_init.runtime_env.worker_process_setup_hook``: the one-line switch).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import pickletools
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from strawq import records
from strawq.collector.integrations.verl.config import _cfg, queue_dir
from strawq.errors import AlreadyExists, ConfigError, CorruptRecord, NotFound
from strawq.numbered import Numbered
from strawq.records import Kind
from strawq.storage import PosixStorage, Storage, open_storage

log = logging.getLogger(__name__)

SAMPLES = "samples"
COMMITTED = "commits"
DROPPED = "drops"
#: reason of a sample dropped because the queue was full (verl's own overflow rule)
QUEUE_FULL = "queue_full"
#: verl's checkpoint tracker, written by the trainer after every checkpoint it saves
TRACKER = "latest_checkpointed_iteration.txt"
_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,120}")
#: ``samples/<seq>~<sample id>``: the put order, then the (name-safe) id
SAMPLE_NAMES = Numbered(sep="~")
#: ``commits/<consumed>``: how many hand-outs a checkpoint covers
COMMIT_NAMES = Numbered()


def samples_per_version(config: Any) -> int | None:
    """Gets one verl weight version takes: the trainer's ``required_samples`` (ppo mini-batch
    size × ``require_batches``) × ``trigger_parameter_sync_step``; None if the config lacks one."""
    mini = _cfg(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    req = _cfg(config, "async_training.require_batches", 1)
    trig = _cfg(config, "async_training.trigger_parameter_sync_step")
    if mini is None or trig is None:
        return None
    return int(mini) * int(req) * int(trig)


def strawq_settings(config: Any) -> dict[str, Any]:
    """verl's fully-async staleness settings as strawq's collector settings (docs/verl.md).

    A verl ``RolloutSample`` (one prompt, ``rollout.n`` responses) is one strawq group; the
    trainer's step (``required_samples`` of them) one batch; ``trigger_parameter_sync_step``
    steps one weight version. verl's Rollouter stops generating at ``max_required_samples =
    required_samples · (staleness_threshold + 1) · trigger_parameter_sync_step`` samples in
    flight or queued: strawq's admission window ``(η + 1) · u · B`` (docs/design.md,
    "Admission"), with ``admission_batches`` carrying a fractional threshold exactly.
    """
    mini = _cfg(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    trig = _cfg(config, "async_training.trigger_parameter_sync_step")
    if mini is None or trig is None:
        raise ConfigError("strawq_settings: expected actor_rollout_ref.actor.ppo_mini_batch_size "
                          "and async_training.trigger_parameter_sync_step in the verl config")
    required = int(mini) * int(_cfg(config, "async_training.require_batches", 1))
    threshold = float(_cfg(config, "async_training.staleness_threshold", 1))
    if threshold < 0:
        raise ConfigError(f"staleness_threshold must be >= 0, found {threshold}")
    window = (threshold + 1) * int(trig)
    return {"batch_groups": required, "batches_per_version": int(trig),
            "admission_batches": window, "max_staleness": math.ceil(threshold),
            "eta_mode": "train", "group_size": int(_cfg(config, "actor_rollout_ref.rollout.n",
                                                          1)),
            "partial_rollout": bool(_cfg(config, "async_training.partial_rollout", True)),
            "max_queue_size": int(required * window)}


def sample_identity(blob: bytes) -> tuple[str | None, int | None]:
    """``(sample_id, epoch)`` of a pickled verl ``RolloutSample``, read from the pickle's
    opcodes (nothing is executed); ``(None, None)`` for bytes that are not one.

    The dataclass's state is pickled after its ``full_batch``, so the last ``'sample_id'``
    key followed by a string is the sample's own (a key of that name inside the batch comes
    earlier).
    """
    sid: str | None = None
    epoch: int | None = None
    want: str | None = None
    try:
        for op, arg, _pos in pickletools.genops(blob):
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
        return None, None
    return sid, epoch


def _name_part(sample_id: str) -> str:
    """A sample id as a file-name component: as it is when safe, else a digest of it."""
    if _SAFE.fullmatch(sample_id):
        return sample_id
    return "h" + hashlib.blake2b(sample_id.encode(), digest_size=10).hexdigest()


@dataclass(frozen=True)
class Held:
    """A sample the queue holds: its sequence number, record key and sample id."""

    seq: int
    key: str
    sample_id: str


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
        self.recovered = 0
        #: verl's checkpoint (tracker number) the newest commit stands for, if known
        self.version: int | None = None
        self.recover()

    # -- recovery --------------------------------------------------------------------------
    def recover(self) -> int:
        """Read the directory: the newest commit, then every sample it does not cover."""
        with self._lock:
            self.storage.makedirs(SAMPLES)
            self.storage.makedirs(COMMITTED)
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
                meta = self._read_meta(f"{COMMITTED}/{name}")
                if meta is None:
                    continue
                self.consumed = max(self.consumed, int(meta["consumed"]))
                if meta.get("version") is not None:
                    self.version = max(self.version if self.version is not None else -1,
                                       int(meta["version"]))
                last_seq = max(last_seq, int(meta["seq"]))
                self._recent.append(set(meta.get("ids", [])))
            for name in sorted(stale):
                self.storage.delete(f"{COMMITTED}/{name}")
            self.handed = self.consumed
            for name in self.storage.list(SAMPLES):
                got = SAMPLE_NAMES.split(name)
                if got is None:
                    log.warning("verl queue: %s/%s is not a sample name; left alone", SAMPLES, name)
                    continue
                seq, sid = got
                key = f"{SAMPLES}/{name}"
                self._seq = max(self._seq, seq + 1)
                if seq <= last_seq:  # a commit whose deletions a crash interrupted
                    self.storage.delete(key)
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
        sample id returns True and stores nothing."""
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
                return True
            self._seq = seq + 1
            self._inflight.add(seq)
            self._ids.add(part)
        key = f"{SAMPLES}/{SAMPLE_NAMES.name(seq, part)}"
        try:
            body: dict[str, Any] = {"verl": "sample", "sample_id": sample_id, "seq": seq,
                                    "at": time.time(), **(dict(meta) if meta else {})}
            if epoch is not None:
                body.setdefault("epoch", epoch)
            rec = records.encode(Kind.STATE, body,
                                 {"s": {"b": np.frombuffer(blob, dtype=np.uint8)}})
            self.storage.publish(key, rec)
        except BaseException:
            with self._lock:
                self._inflight.discard(seq)
                self._ids.discard(part)
            raise
        with self._lock:
            self._inflight.discard(seq)
            self._insert(Held(seq, key, part))
            self._cache[seq] = blob
            self.produced += 1
            self.bytes_put += sum(len(c) for c in rec)
            full = len(self._ready) > self.max_size
            if full:
                self._drop(self._ready.popleft(), QUEUE_FULL)
            return not full

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
        self.storage.makedirs(DROPPED)
        name = held.key.rpartition("/")[2]
        try:
            self.storage.rename(held.key, f"{DROPPED}/{name}~{reason}")
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
            n = self.consumed + len(covered)
            while n < consumed and self._ready and not self._leased:
                covered.append(self._ready.popleft())
                n += 1
            last_seq = max([self._committed_seq, *(h.seq for h in covered)])
            ids = [h.sample_id for h in covered]
            self.storage.publish(f"{COMMITTED}/{COMMIT_NAMES.name(consumed)}",
                                 records.encode(Kind.STATE, {"verl": "commit",
                                                             "consumed": consumed,
                                                             "seq": last_seq, "ids": ids,
                                                             "version": self.version,
                                                             "at": time.time()}))
            self.consumed = consumed
            self._committed_seq = last_seq
            self.handed = max(self.handed, consumed)
            self._recent.append(set(ids))
            for h in covered:
                self.storage.delete(h.key)
                self._ids.discard(h.sample_id)
            for name in COMMIT_NAMES.prune(self.storage.list(COMMITTED), self.keep_commits):
                self.storage.delete(f"{COMMITTED}/{name}")
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
                    "dir": self.storage.describe()}


class StrawqMessageQueue:
    """verl's ``MessageQueue`` contract over a ``DurableSampleQueue`` (same constructor, same
    async methods; ``actor_class()`` makes it the Ray actor verl expects).

    Beyond verl's methods: ``commit(consumed)``, ``commit_version(v)``, ``rewind()``,
    ``put_partial``/``get_partial``/``finish_partial`` (``strawq.collector.integrations.
    verl.partial``). ``clear_queue`` (verl's task runner calls it in a ``finally`` after any
    failure) keeps the durable samples: clearing them would lose exactly what this queue
    exists to keep; ``drop_all()`` is the durable clear.
    """

    def __init__(self, config: Any = None, max_queue_size: int | None = 1000, *,
                 path: str | None = None, fsync: bool = True) -> None:
        if max_queue_size is None:
            raise ValueError(f"max_queue_size cannot be None, got: {max_queue_size}")
        self.config = config
        self.path = path or queue_dir(config)
        self._tracker_dir = _cfg(config, "trainer.default_local_dir")
        self._per_version = samples_per_version(config)
        fresh = not os.path.isdir(os.path.join(self.path, SAMPLES))
        resume_mode = str(_cfg(config, "trainer.resume_mode", "auto"))
        self.storage = PosixStorage(self.path, writer_id="verlq", fsync=fsync)
        self.q = DurableSampleQueue(self.storage, max_size=int(max_queue_size))
        if resume_mode == "disable" and not fresh and (self.q.size() or self.q.consumed):
            raise ConfigError(
                f"StrawqMessageQueue: trainer.resume_mode=disable starts training from scratch, "
                f"but the queue at {self.path} holds {self.q.size()} samples and "
                f"{self.q.consumed} committed hand-outs of an earlier run; remove that "
                "directory, name a new one (+async_training.strawq_queue_dir=...), or resume "
                "(trainer.resume_mode=auto)")
        self._tracker_seen: tuple[float, int] | None = None
        self._val: deque[Any] = deque()
        self._sentinels: deque[int] = deque()  # hand-out positions of verl's end-of-stream None
        self.running = True
        #: bumped by ``rewind``: gets still waiting from before it return None
        self._generation = 0
        self._cond: asyncio.Condition | None = None
        self._partials: Any = None
        self._watch_checkpoint(live=False)
        from strawq.collector.integrations.verl.partial import PartialStore

        self._partials = PartialStore(self.storage)
        self._partials.recover()
        log.info("StrawqMessageQueue at %s: %d samples to hand out, %d committed", self.path,
                 self.q.size(), self.q.consumed)

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _watch_checkpoint(self, *, live: bool = True) -> None:
        """Commit what verl's newest checkpoint covers (its tracker file, read when it moved).

        verl's trainer makes no get between its save and the tracker write, nor between the
        tracker write and its next step's first get: the gets handed out when the queue
        first sees the tracker move (at a get, a statistics call, ``rewind``, ``clear_queue``
        or ``shutdown``) are exactly the gets the checkpoint holds, mid-version included
        (verl's forced save at the end of ``fit``, an expiry save). A queue that starts
        after the tracker moved unseen (the job died between the tracker write and the
        queue's next call) commits the version's count, a lower bound: nothing is lost, the
        gets of a partial version in that checkpoint are handed out again."""
        if not self._tracker_dir or not self._per_version:
            return
        path = os.path.join(str(self._tracker_dir), TRACKER)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        seen = (st.st_mtime, st.st_size)
        if seen == self._tracker_seen:
            return
        try:
            with open(path, encoding="utf-8") as f:
                version = int(f.read().strip())
        except (OSError, ValueError):
            return  # being written; read again at the next call
        self._tracker_seen = seen
        if self.q.version is not None and version <= self.q.version:
            return  # this checkpoint is committed already
        floor = version * self._per_version
        self.q.commit(max(floor, self.q.handed) if live else floor, version=version)

    # -- verl's MessageQueue methods ---------------------------------------------------------
    async def put_sample(self, sample: Any, **meta: Any) -> bool:
        cond = self._condition()
        if sample is None:  # verl's end-of-stream signal: in memory only
            async with cond:
                self._sentinels.append(self.q.handed + self.q.size() + self.q.in_flight())
                cond.notify_all()
            return True
        # the write (fsync'd file and directory) runs in a thread: concurrent puts overlap
        ok = await asyncio.to_thread(self.q.put, sample, sample_id=meta.pop("sample_id", None),
                                     meta=meta)
        async with cond:
            cond.notify_all()
        return ok

    async def get_sample(self) -> Any | None:
        cond = self._condition()
        async with cond:
            self._watch_checkpoint()
            generation = self._generation
            while True:
                if generation != self._generation:
                    return None  # a get of the trainer ``rewind`` replaced: its caller is gone
                if self._sentinels and self._sentinels[0] <= self.q.handed:
                    self._sentinels.popleft()
                    return None, self.q.size()
                got = self.q.get() if self.q.size() else None
                if got is not None:
                    return got[1], self.q.size()
                if not self.running:
                    return None
                await cond.wait()

    async def get_queue_size(self) -> int:
        return self.q.size()

    async def pid(self) -> int:
        """The queue's process id (what a crash test kills)."""
        return os.getpid()

    async def get_statistics(self) -> dict[str, Any]:
        self._watch_checkpoint()
        return {**self.q.stats(), "pid": os.getpid(), **self._partials.count()}

    async def clear_queue(self) -> None:
        self._watch_checkpoint()  # verl's task runner calls it after fit's forced save
        log.info("clear_queue: the %d samples not handed out stay durable in %s (drop_all() "
                 "deletes them)", self.q.size(), self.path)

    async def drop_all(self) -> int:
        return self.q.clear()

    async def shutdown(self) -> None:
        self._watch_checkpoint()
        cond = self._condition()
        async with cond:
            self.running = False
            cond.notify_all()

    async def get_memory_usage(self) -> dict[str, Any]:
        return {"queue_samples": self.q.size(), "estimated_memory_bytes": 0,
                "estimated_memory_mb": 0.0}

    async def put_validate(self, data: Any) -> None:
        self._val.append(data)

    async def get_validate(self) -> Any | None:
        return self._val.popleft() if self._val else None

    # -- strawq's additions ----------------------------------------------------------------
    async def commit(self, consumed: int) -> int:
        """A durable trainer checkpoint covers the first ``consumed`` gets of the run."""
        return self.q.commit(int(consumed))

    async def commit_version(self, version: int) -> int:
        """verl's trainer saved the checkpoint of weight version ``version``."""
        if not self._per_version:
            raise ConfigError("commit_version needs actor_rollout_ref.actor.ppo_mini_batch_size "
                              "and async_training.trigger_parameter_sync_step in the config; "
                              "call commit(consumed) with the number of gets instead")
        return self.q.commit(int(version) * self._per_version)

    async def rewind(self) -> int:
        """A trainer restored from its newest checkpoint: commit what that checkpoint covers,
        then hand every other lease out again, oldest first."""
        cond = self._condition()
        async with cond:
            self._watch_checkpoint()
            self._generation += 1
            cond.notify_all()
            return self.q.rewind()

    async def is_held(self, sample_id: str) -> bool:
        return self.q.is_held(sample_id)

    async def put_partial(self, key: str, prefix: Any) -> str:
        return str(self._partials.put(key, prefix))

    async def get_partial(self, key: str) -> Any | None:
        return self._partials.claim(key)

    async def finish_partial(self, handle: str) -> None:
        self._partials.finish(handle)


def actor_class(**options: Any) -> Any:
    """``StrawqMessageQueue`` as a Ray actor class, with verl's options (``num_cpus=2``,
    ``max_concurrency=20``) unless ``options`` says otherwise."""
    import ray  # verl's queue is a Ray actor: the one import of Ray here

    opts = {"num_cpus": 2, "max_concurrency": 20, **options}
    return ray.remote(**opts)(StrawqMessageQueue)


def install() -> None:
    """Make verl's fully-async entry point create ``StrawqMessageQueue`` (and the durable
    partial-rollout client). Run in every Ray worker by
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=strawq.collector.integrations.verl.queue.install``,
    or call it before ``fully_async_main.main()`` in a driver that runs the task runner."""
    from verl.experimental.fully_async_policy import fully_async_main, message_queue

    actor = actor_class()
    for module in (message_queue, fully_async_main):
        setattr(module, "MessageQueue", actor)  # noqa: B010 (mypy: a class name)
    try:
        from strawq.collector.integrations.verl.client import install_partial_client
    except ImportError:  # pragma: no cover - verl without its rollout client
        return
    install_partial_client()
