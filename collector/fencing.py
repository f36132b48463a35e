"""Exactly one collector per run: epochs by exclusive create, a heartbeat counter, takeover.

Records in ``collector/`` (their names are spelled in ``strawq.tasks.epochs``)::

    epoch-<E>              EPOCH record (owner, host, pid), exclusive create: the claim
    hb-<E>~<counter>       the holder's heartbeat counter (the name is the data)
    closed-<E>             the holder stopped cleanly: a successor need not wait

A newcomer reads the newest epoch E. With no epoch it creates ``epoch-1``. If E is closed it
creates E+1 at once. Otherwise it watches E's heartbeat counter on *its own* monotonic clock
(docs/design.md, invariant 3: never mtimes, never two hosts' clocks): the moment the counter
moves it refuses with ``CollectorBusy``; if the counter stays put for ``takeover_timeout_s`` it
creates ``epoch-<E+1>`` (exclusive, so of two newcomers exactly one wins; the loser refuses). A
holder whose EPOCH record names a process on this host (same host, boot and pid namespace) that
no longer exists is known dead (``strawq.liveness``): the newcomer takes over at once. The
wait's length is a guess about liveness, never what keeps the run safe: the fencing below holds
whatever it is. Every collector action first calls ``check()`` (or ``beat()``, which checks):
an epoch newer than its own means it was taken over, and it raises ``FencedOut``.

A holder that passes ``check()`` and then stalls for longer than ``takeover_timeout_s``
before its next write can still write once after a takeover. Every such write is fenced
at the resource: a cursor commit is a compare-and-swap that a stale writer loses
(``strawq.data.feeder``), every group move is a rename with one winner, and a manifest it
publishes is *superseded* — readers refuse it and the successor sweeps it (below).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from strawq.collector.errors import CollectorBusy
from strawq.delivery.batches import BatchStore, Manifest, manifest_key
from strawq.errors import AlreadyExists, CorruptRecord, FencedOut, NotFound, StrawqError
from strawq.liveness import identity, known_dead
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.epochs import DIR as EPOCH_DIR
from strawq.tasks.epochs import (
    closed_key,
    closed_name,
    epoch_key,
    epoch_starts,
    epochs,
    heartbeat_counter,
    heartbeat_key,
    list_names,
    mark_epoch_start,
    prunable,
    superseded,
)
from strawq.tasks.states import TaskState, key_of, move

log = logging.getLogger(__name__)

KEEP_EPOCHS = 2


__all__ = ["EpochFence", "SupersededSweep", "epoch_starts", "mark_epoch_start", "superseded"]



def live_holder(storage: Storage) -> str | None:
    """The collector that may hold the run now, in words (None: none may). A newest epoch
    that did not close and whose process is not known gone (``strawq.liveness.known_dead``:
    a pid on this host that no longer runs, or a zombie) may be alive. Reads only."""
    names = list_names(storage)
    known = epochs(names)
    newest = known[-1] if known else 0
    if not newest or closed_name(newest) in names:
        return None
    try:
        who = records.decode(storage.read(epoch_key(newest)), expect=Kind.EPOCH).meta
    except StrawqError:
        who = {}
    if known_dead(who):
        return None
    where = (f" (owner {who.get('owner', '?')}, pid {who.get('pid', '?')} on "
             f"{who.get('host', '?')})") if who else ""
    return f"collector epoch {newest}{where} holds it and did not close"


class EpochFence:
    """The fencing token of one collector. Clock and sleep are injected for tests."""

    def __init__(self, storage: Storage, *, owner: str = "collector",
                 takeover_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.storage = storage
        self.owner = owner
        #: heartbeat silence after which a newcomer takes over. Not the run's shorter
        #: liveness timeout: the holder beats once per pass, and a long pass (a GC or a
        #: release on a slow mount) must not read as death; a holder known dead is taken
        #: over at once instead (``holder_gone``)
        self.timeout = takeover_timeout_s
        self.clock = clock
        self.sleep = sleep
        self.epoch = 0
        self._counter = 0
        storage.makedirs(EPOCH_DIR)

    # -- acquiring -----------------------------------------------------------------------------
    def acquire(self, *, wait: bool = True) -> int:
        """Become the run's collector; returns the epoch. ``CollectorBusy`` if one is alive.

        With ``wait=False`` a live-looking holder (not closed) is refused at once instead of
        being watched for ``takeover_timeout_s``.
        """
        names = list_names(self.storage)
        known = epochs(names)
        newest = known[-1] if known else 0
        if newest and closed_name(newest) not in names:
            if not wait:
                raise CollectorBusy(
                    f"collector epoch {newest} holds this run and did not close; expected no "
                    "live collector. Stop it (SIGTERM closes it cleanly), or start this one "
                    "without --no-wait (wait=True): it then watches the holder's heartbeat "
                    f"and takes over once it was silent for {self.timeout:.0f}s "
                    "(takeover_timeout_s)")
            self._watch(newest)
        return self._create(newest + 1)

    def holder_gone(self, epoch: int) -> bool:
        """Whether ``epoch``'s EPOCH record names a process on this host that is gone."""
        try:
            rec = records.decode(self.storage.read(epoch_key(epoch)), expect=Kind.EPOCH)
        except StrawqError:
            return False  # unreadable: the heartbeat's silence decides
        return known_dead(rec.meta)

    def _watch(self, epoch: int) -> None:
        """Return once ``epoch``'s heartbeat stayed still for the timeout, or at once if its
        holder's process is known gone; else refuse."""
        start = self.clock()
        first = heartbeat_counter(list_names(self.storage), epoch)
        if self.holder_gone(epoch):
            # a restart after a crash: normal recovery, not a fault of this collector's
            log.info("collector epoch %d: its process (on this host) is gone; taking over "
                     "without waiting", epoch)
            return
        poll = max(min(self.timeout / 20, 1.0), 0.01)
        log.info("collector epoch %d did not close; watching its heartbeat (at %d) for %.1fs "
                 "before taking over", epoch, first, self.timeout)
        while True:
            names = list_names(self.storage)
            newest = epochs(names)[-1] if epochs(names) else 0
            if newest > epoch:
                raise CollectorBusy(f"collector epoch {newest} took over this run while we "
                                    "waited; it is the live collector, refusing to start")
            counter = heartbeat_counter(names, epoch)
            if counter != first:
                raise CollectorBusy(
                    f"collector epoch {epoch} is alive (heartbeat moved {first} -> {counter}); "
                    "exactly one collector runs per run: stop it first, or use it")
            if closed_name(epoch) in names:
                return
            if self.clock() - start >= self.timeout:
                log.warning("collector epoch %d was silent for %.1fs (heartbeat %d); taking "
                            "over", epoch, self.clock() - start, counter)
                return
            self.sleep(poll)

    def _create(self, epoch: int) -> int:
        body = {"epoch": epoch, "owner": self.owner, **identity(), "at": time.time()}
        try:
            self.storage.publish(epoch_key(epoch),
                                 records.encode(Kind.EPOCH, body))
        except AlreadyExists:
            raise CollectorBusy(f"another collector created epoch {epoch} first; it is the "
                                "live collector, refusing to start") from None
        self.epoch = epoch
        self._counter = 0
        self._gc(epoch)
        self.beat()
        log.info("collector %s holds epoch %d", self.owner, epoch)
        return epoch

    def _gc(self, epoch: int) -> None:
        for key in prunable(list_names(self.storage), epoch - KEEP_EPOCHS):
            self.storage.delete(key)

    # -- holding -------------------------------------------------------------------------------
    def check(self, names: list[str] | None = None) -> None:
        """Raise ``FencedOut`` unless this collector still holds the newest epoch."""
        if not self.epoch:
            raise FencedOut("this collector holds no epoch: call acquire() before acting")
        names = list_names(self.storage) if names is None else names
        known = epochs(names)
        newest = known[-1] if known else 0
        if newest != self.epoch or closed_name(self.epoch) in names:
            raise FencedOut(f"collector epoch {self.epoch} was taken over (newest epoch "
                            f"{newest}); this collector must stop acting on the run")

    def beat(self) -> int:
        """Check the fence, then advance the heartbeat counter; returns the counter."""
        names = list_names(self.storage)
        self.check(names)
        prev = self._counter or heartbeat_counter(names, self.epoch)
        # The name is the data (an empty file): nothing to fsync, as for producers' beats.
        # An fsync here cost every collector pass ~8 ms on a local disk, on the path from
        # an ack to the next release. The counter moves only once the beat is written (a
        # beat that failed, on a full disk, leaves the previous one to be replaced).
        self.storage.publish(heartbeat_key(self.epoch, prev + 1), b"",
                             sync_dir=False, sync_file=False)
        self._counter = prev + 1
        if prev:
            self.storage.delete(heartbeat_key(self.epoch, prev))
        return self._counter

    def close(self) -> None:
        """Stop cleanly: a successor may start without waiting for the takeover timeout."""
        if not self.epoch:
            return
        try:
            self.storage.publish(closed_key(self.epoch), b"")
        except AlreadyExists:
            pass
        log.info("collector epoch %d closed", self.epoch)


# -- manifests from a superseded epoch -------------------------------------------------------
#
# A collector that passed ``check()`` and then stalled past the takeover timeout can publish
# one manifest after its successor took over. Each collector, right after taking its epoch
# and before recovering, records the first batch number it may use: ``start-<E>~<F>`` (the
# name is the data; F = the next batch number as listed then). A manifest stamped with an
# epoch e is *superseded* when some newer epoch E > e started at F <= its number: it was
# published after that successor listed ``batches/``. Readers never deliver it; the live
# collector puts the groups it moved back to ``ready/`` (``sweep_superseded``) and deletes it
# once none of its groups can still be moved by the stalled writer. Start records are kept
# (one tiny file per collector start): an old epoch's stalled writer is refused forever. The
# verdict is ``strawq.tasks.epochs.superseded`` (readers apply it too).


class SupersededSweep:
    """The live collector's cleanup of manifests published by a superseded epoch.

    Verdicts per manifest number are cached (a manifest never changes), so a pass reads
    only manifests it has not seen. Returns the refused numbers still present.
    """

    def __init__(self, batches: BatchStore) -> None:
        self.batches = batches
        self.storage = batches.storage
        self._verdict: dict[int, bool] = {}

    def refused(self, seqs: list[int], starts: list[tuple[int, int]]) -> dict[int, Manifest]:
        out: dict[int, Manifest] = {}
        for seq in seqs:
            if self._verdict.get(seq) is False:
                continue
            try:
                man = self.batches.read_manifest(seq)
            except (NotFound, CorruptRecord):
                continue  # gone, or quarantined by recover/gc
            by = superseded(seq, man.meta, starts)
            self._verdict[seq] = by is not None
            if by is not None:
                out[seq] = man
        return out

    def sweep(self) -> set[int]:
        """Return the groups of refused manifests to ``ready/``; delete finished ones."""
        starts = epoch_starts(self.storage)
        if len(starts) < 2:
            return set()
        seqs, _acked = self.batches.batch_seqs()
        refused = self.refused(seqs, starts)
        if not refused:
            return set()
        named: set[str] = set()
        for seq in seqs:
            if seq not in refused:
                try:
                    named.update(str(n) for n in self.batches.read_manifest(seq).groups)
                except (NotFound, CorruptRecord):
                    pass
        for seq, man in sorted(refused.items()):
            log.error("batch %d was published by collector epoch %s after epoch %s took over; "
                      "it is refused: readers skip it and its groups go back to ready",
                      seq, man.meta.get("epoch"), superseded(seq, man.meta, starts))
            self.batches.unname(seq)  # its groups, left in ready/, are scanned as ready
            live = False
            for name in man.groups:
                if str(name) in named:
                    continue
                # an older strawq's collector renamed a batch's groups to batched/
                if self.storage.exists(key_of(TaskState.BATCHED, name)):
                    try:
                        move(self.storage, name, TaskState.BATCHED, TaskState.READY)
                    except (NotFound, AlreadyExists):
                        pass
                live = live or self.storage.exists(key_of(TaskState.READY, name))
            if not live:
                # no group of it is left where the stalled writer could still move it
                self.batches.retire(seq)  # its number is never used again
                self._verdict.pop(seq, None)
        return {s for s in refused if self.storage.exists(manifest_key(s))}
