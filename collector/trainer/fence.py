"""Exactly one rank-0 trainer per run: trainer epochs by exclusive create, a heartbeat, takeover.

The trainer decides what is trained (acks, commits, the weight-update bracket), so it is
fenced as the collector is (docs/design.md, invariant 8). Its records are in ``trainer/``
(spelled in ``strawq.tasks.trainer_epochs``)::

    holder-<E>          EPOCH record (host, boot, pid namespace, pid, wall time), exclusive
                        create: the claim
    beat-<E>~<counter>  the holder's heartbeat counter, advanced by a thread every
                        ``beat_interval_s`` while the process lives
    released-<E>        the holder stopped cleanly (``BatchReader.close``)

A newcomer reads the newest epoch E. With none it creates ``holder-1``; if E is released it
creates E+1 at once. Otherwise it judges E's holder with the collector's liveness machinery
(``strawq.liveness``): a holder known dead (same host, boot and pid namespace, its pid gone)
is taken over at once; else the newcomer watches E's heartbeat counter on its *own*
monotonic clock (never file times, never two hosts' clocks): the moment the counter moves it
refuses with ``TrainerBusy`` (naming host, pid, since when, and what to do); once the
counter stayed put for ``takeover_timeout_s`` it creates ``holder-<E+1>`` — an exclusive
create, the compare-and-swap: of two newcomers exactly one wins, the loser refuses.

Every rank-0 write of the trainer (an ack, a commit, a delivery mark, a bracket call) first
calls ``check()``: a newer epoch than its own means it was taken over, and it raises
``FencedOut`` naming who holds the run now. Non-zero ranks never write and hold no epoch.

The fence is per process: every rank-0 ``BatchReader`` of one run in one process shares one
epoch (``shared_fence``), so a process that opens a second reader (a restart inside a
notebook, a tool beside the trainer) is the same trainer. A second *process* is a second
trainer.

A holder that passes ``check()`` and then stalls past ``takeover_timeout_s`` before its
write can still write once after a takeover; those writes are harmless at the resource: an
ack is an exclusive create of a batch both trainers may ack, a commit only moves forward,
and a bracket's pause and resume records are exclusive creates per version.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable

from strawq.errors import AlreadyExists, FencedOut, StrawqError
from strawq.liveness import identity, known_dead
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.trainer_epochs import (
    DIR,
    TrainerHolder,
    beat_counter,
    beat_key,
    holder_key,
    list_names,
    prunable,
    read_trainer_holder,
    released_key,
    released_name,
    trainer_epochs,
)

log = logging.getLogger(__name__)

#: heartbeat silence after which a newcomer takes over a holder not known dead
TAKEOVER_TIMEOUT_S = 60.0
#: how often the holder's thread advances its heartbeat counter
BEAT_INTERVAL_S = 5.0
KEEP_EPOCHS = 2

__all__ = ["FenceUse", "TrainerBusy", "TrainerFence", "TrainerHolder", "read_trainer_holder",
           "shared_fence", "unshare_fence"]


class TrainerBusy(StrawqError, RuntimeError):
    """Another rank-0 trainer holds this run and its heartbeat still moves."""


def _who(storage: Storage) -> str:
    holder = read_trainer_holder(storage)
    return holder.describe() if holder is not None else "no trainer epoch"


class TrainerFence:
    """The fencing token of one rank-0 trainer process. Clock and sleep are injected for
    tests; ``beat_interval_s=None`` starts no heartbeat thread (call ``beat()``)."""

    def __init__(self, storage: Storage, *, takeover_timeout_s: float = TAKEOVER_TIMEOUT_S,
                 beat_interval_s: float | None = BEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.storage = storage
        self.timeout = takeover_timeout_s
        self.beat_interval_s = beat_interval_s
        self.clock = clock
        self.sleep = sleep
        self.epoch = 0
        #: set once a check found this trainer taken over (it never holds again)
        self.fenced = False
        self._counter = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: readers sharing this fence (``shared_fence``)
        self.users = 0
        #: the key of this process's shared fences it is filed under (``shared_fence``)
        self.shared_key: object = None
        storage.makedirs(DIR)

    # -- acquiring -----------------------------------------------------------------------------
    def acquire(self, *, wait: bool = True) -> int:
        """Become the run's rank-0 trainer; returns the epoch (at once if already held).
        ``TrainerBusy`` while another one lives; ``wait=False`` refuses a holder that did
        not release without watching its heartbeat."""
        if self.epoch:
            self.check()
            return self.epoch
        names = list_names(self.storage)
        known = trainer_epochs(names)
        newest = known[-1] if known else 0
        if newest and released_name(newest) not in names:
            self._watch(newest, wait)
        return self._create(newest + 1)

    def _busy(self, epoch: int, why: str) -> TrainerBusy:
        return TrainerBusy(
            f"this run already has a rank-0 trainer ({_who(self.storage)}); {why}. Exactly "
            "one trainer may train a run: stop that one first (a preempted job requeued while "
            "the old one still runs: cancel the old job), or wait for it to end; a trainer "
            f"that died is taken over once its heartbeat was silent for {self.timeout:.0f}s, "
            "at once if it ran on this host")

    def _watch(self, epoch: int, wait: bool) -> None:
        """Return once ``epoch``'s holder is known dead or its heartbeat stayed still for the
        timeout; else refuse."""
        try:
            meta = records.decode(self.storage.read(holder_key(epoch)), expect=Kind.EPOCH).meta
        except StrawqError:
            meta = None  # unreadable: the heartbeat's silence decides
        if known_dead(meta):
            # normal restart recovery (the holder crashed): INFO, as for the collector
            log.info("trainer epoch %d: its process (on this host) is gone; taking over "
                        "without waiting", epoch)
            return
        if _this_process(meta) and not _held_here(self.storage, epoch):
            # a reader of this very process dropped without close(): its fence was collected
            # and beats no more, and no live fence here holds the epoch
            log.info("trainer epoch %d: held by this process through a reader dropped "
                     "without close(); taking over without waiting", epoch)
            return
        if not wait:
            raise self._busy(epoch, "it did not release the run (started with wait=False, "
                             "its heartbeat was not watched)")
        start = self.clock()
        first = beat_counter(list_names(self.storage), epoch)
        poll = max(min(self.timeout / 20, 1.0), 0.01)
        log.info("trainer epoch %d did not release the run; watching its heartbeat (at %d) "
                 "for %.1fs before taking over", epoch, first, self.timeout)
        while True:
            names = list_names(self.storage)
            known = trainer_epochs(names)
            if known and known[-1] > epoch:
                raise self._busy(known[-1], "it took over while this one waited")
            counter = beat_counter(names, epoch)
            if counter != first:
                raise self._busy(epoch, f"its heartbeat moved ({first} -> {counter}) while "
                                 "this one watched")
            if released_name(epoch) in names:
                return
            if self.clock() - start >= self.timeout:
                log.warning("trainer epoch %d was silent for %.1fs (heartbeat %d); taking over",
                            epoch, self.clock() - start, counter)
                return
            self.sleep(poll)

    def _create(self, epoch: int) -> int:
        body = {"epoch": epoch, "owner": "trainer", **identity(), "at": time.time()}
        try:
            self.storage.publish(holder_key(epoch), records.encode(Kind.EPOCH, body))
        except AlreadyExists:
            raise self._busy(epoch, "it took the run first") from None
        self.epoch = epoch
        _HOLDING.add(self)
        for key in prunable(list_names(self.storage), epoch - KEEP_EPOCHS):
            self.storage.delete(key)
        self.beat()
        if self.beat_interval_s is not None and self.beat_interval_s > 0:
            self._thread = threading.Thread(
                target=_beat_loop, args=(weakref.ref(self), self._stop, self.beat_interval_s),
                daemon=True, name=f"strawq-trainer-epoch-{epoch}")
            self._thread.start()
        log.info("this process is the run's rank-0 trainer (trainer epoch %d)", epoch)
        return epoch

    # -- holding -------------------------------------------------------------------------------
    def check(self, names: list[str] | None = None) -> None:
        """Raise ``FencedOut`` (naming the holder now) unless this trainer holds the newest
        trainer epoch."""
        if not self.epoch:
            raise FencedOut("this trainer holds no trainer epoch: acquire() before writing")
        names = list_names(self.storage) if names is None else names
        known = trainer_epochs(names)
        newest = known[-1] if known else 0
        if newest != self.epoch or released_name(self.epoch) in names:
            self.fenced = True
            self._stop.set()
            raise FencedOut(
                f"this trainer (trainer epoch {self.epoch}) was taken over: the run is held by "
                f"{_who(self.storage)}. Its acks, commits and weight updates are refused; stop "
                "this trainer (what it trained since its last committed checkpoint is trained "
                "again by the holder)")

    def beat(self) -> int:
        """Check the fence, then advance the heartbeat counter; returns the counter."""
        with self._lock:
            names = list_names(self.storage)
            self.check(names)
            prev = self._counter or beat_counter(names, self.epoch)
            # the name is the data; the body (the wall time) is for display only
            self.storage.publish(beat_key(self.epoch, prev + 1), str(time.time()).encode(),
                                 sync_dir=False, sync_file=False)
            self._counter = prev + 1
            if prev:
                self.storage.delete(beat_key(self.epoch, prev))
            return self._counter

    def release(self) -> None:
        """Stop cleanly: a successor takes over without waiting."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if not self.epoch or self.fenced:
            return
        try:
            self.storage.publish(released_key(self.epoch), b"")
        except AlreadyExists:
            pass
        log.info("trainer epoch %d released the run", self.epoch)


#: every fence of this process that took an epoch (weakly: a dropped one leaves)
_HOLDING: weakref.WeakSet[TrainerFence] = weakref.WeakSet()


def _this_process(who: dict[str, object] | None) -> bool:
    """Whether an epoch record names this very process (host, boot, pid namespace, pid)."""
    if not who:
        return False
    me = identity()
    return all(who.get(k) == me[k] for k in ("host", "boot", "pidns", "pid"))


def _held_here(storage: Storage, epoch: int) -> bool:
    """Whether a live fence of this process holds ``epoch`` of the run of ``storage``."""
    run = _run_key(storage)
    return any(f.epoch == epoch and not f.fenced and _run_key(f.storage) == run
               for f in list(_HOLDING))


def _beat_loop(ref: weakref.ref[TrainerFence], stop: threading.Event, interval: float) -> None:
    """The heartbeat thread: holds its fence weakly, so an abandoned fence stops beating."""
    while not stop.wait(interval):
        fence = ref()
        if fence is None:
            return
        try:
            fence.beat()
        except FencedOut as exc:
            log.error("%s", exc)
            return
        except (StrawqError, OSError) as exc:  # a failing mount: the next beat retries
            log.warning("trainer epoch %d: heartbeat failed: %s", fence.epoch, exc)
        del fence


# -- one fence per run per process -----------------------------------------------------------
#: run -> this process's fence on it (held by its readers: a fence no reader holds any more is
#: collected, and its heartbeat thread ends with it)
_SHARED: weakref.WeakValueDictionary[object, TrainerFence] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _run_key(storage: Storage) -> object:
    """The run a shared fence is for: its path and its ``run.meta`` (a run removed and
    created again at the same path is another run, whose trainer epochs start over)."""
    root = getattr(storage, "root", None)
    if not isinstance(root, str):
        return id(storage)  # the fence keeps storage alive
    try:
        meta = hashlib.sha256(storage.read("run.meta")).hexdigest()
    except StrawqError:
        meta = ""
    return (root, meta)


def shared_fence(storage: Storage) -> TrainerFence:
    """This process's fence on the run of ``storage`` (one more user); acquire it to write."""
    key = _run_key(storage)
    with _SHARED_LOCK:
        fence = _SHARED.get(key)
        if fence is None or fence.fenced:
            fence = _SHARED[key] = TrainerFence(storage)
            fence.shared_key = key
        fence.users += 1
        return fence


def unshare_fence(fence: TrainerFence) -> None:
    """One user less; the last one releases the run (a successor need not wait)."""
    with _SHARED_LOCK:
        fence.users -= 1
        if fence.users > 0:
            return
        if _SHARED.get(fence.shared_key) is fence:
            del _SHARED[fence.shared_key]
    fence.release()


class FenceUse:
    """A rank-0 reader's use of the trainer fence: this process's shared one, taken at the
    first write (``shared_fence``) and given back at ``close`` (``unshare_fence``: the last
    user of the process releases the run), or an injected one (the caller's to release)."""

    def __init__(self, storage: Storage, fence: TrainerFence | None = None) -> None:
        self.storage = storage
        #: the fence in use (None until the first write, unless one was injected)
        self.taken = fence
        self._shared = fence is None
        self._users = 0

    @property
    def fence(self) -> TrainerFence:
        if self.taken is None:
            self.taken = shared_fence(self.storage)
            self._users = 1
        return self.taken

    def acquire(self) -> None:
        """Hold the run's trainer epoch (taking it at the first write: ``TrainerBusy`` while
        another trainer lives), or ``FencedOut`` if taken over."""
        self.fence.acquire()

    def close(self) -> None:
        if self.taken is not None and self._shared and self._users:
            self._users = 0
            unshare_fence(self.taken)
