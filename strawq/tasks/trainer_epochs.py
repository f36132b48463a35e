"""The trainer's epoch key family: who is the run's rank-0 trainer, read by anyone.

Records in ``trainer/`` (the protocol over them is ``strawq.collector.trainer.fence``)::

    holder-<E>             EPOCH record (owner "trainer", host, boot, pidns, pid, at),
                           exclusive create: trainer epoch E's claim on the run
    beat-<E>~<counter>     the holder's heartbeat counter (the name is the data; the body is
                           the holder's wall time, for display only)
    released-<E>           the holder stopped cleanly: a successor need not wait

``read_trainer_holder(storage)`` is the small reader a status page uses: the newest epoch,
who holds it, since when, its heartbeat counter and (for display, from the holder's own
clock) how long ago it last beat.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from strawq.errors import StrawqError
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage

DIR = "trainer"
HOLDERS = Numbered("holder-")
BEATS = Numbered("beat-", sep="~", tail_width=16)
RELEASED = Numbered("released-")
_PER_EPOCH = (HOLDERS, BEATS, RELEASED)


def holder_key(epoch: int) -> str:
    return f"{DIR}/{HOLDERS.name(epoch)}"


def beat_key(epoch: int, counter: int) -> str:
    return f"{DIR}/{BEATS.name(epoch, counter)}"


def released_key(epoch: int) -> str:
    return f"{DIR}/{RELEASED.name(epoch)}"


def released_name(epoch: int) -> str:
    """The listing name of ``released_key(epoch)`` inside ``trainer/``."""
    return RELEASED.name(epoch)


def list_names(storage: Storage) -> list[str]:
    """The listing of ``trainer/`` (pass it to the parsers below to list once)."""
    return storage.list(DIR)


def trainer_epochs(names: Iterable[str]) -> list[int]:
    """Every trainer epoch with a holder record, oldest first."""
    return HOLDERS.numbers(names)


def beat_counter(names: Iterable[str], epoch: int) -> int:
    """The newest heartbeat counter of trainer ``epoch`` (0: none)."""
    return max((c for e, c in BEATS.pairs(names) if e == epoch), default=0)


def prunable(names: Iterable[str], below_or_at: int) -> list[str]:
    """Keys of the holder, beat and released records of epochs ``<= below_or_at``."""
    names = list(names)
    return [f"{DIR}/{n}" for family in _PER_EPOCH for n in family.below(names, below_or_at + 1)]


@dataclass(frozen=True)
class TrainerHolder:
    """Trainer epoch ``epoch``'s holder, as its records say."""

    epoch: int
    host: str
    pid: int
    #: wall time (the holder's clock) it took the run
    started: float
    #: its newest heartbeat counter (0: none yet)
    counter: int
    #: it stopped cleanly (``released-<E>``): a successor takes over at once
    released: bool
    #: seconds since its last beat, by its own wall clock against this host's: for display
    #: only (two hosts' clocks are never compared to judge liveness); None when unknown
    heartbeat_age_s: float | None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) \
            if self.started else "an unknown time"
        age = f", last heartbeat {self.heartbeat_age_s:.0f}s ago" \
            if self.heartbeat_age_s is not None else ""
        state = " (released)" if self.released else ""
        return (f"trainer epoch {self.epoch}{state}: host {self.host}, pid {self.pid}, since "
                f"{since}{age}")


def read_trainer_holder(storage: Storage) -> TrainerHolder | None:
    """The newest trainer epoch's holder; None when no trainer ever held the run."""
    names = list_names(storage)
    known = trainer_epochs(names)
    if not known:
        return None
    epoch = known[-1]
    try:
        meta = records.decode(storage.read(holder_key(epoch)), expect=Kind.EPOCH).meta
    except StrawqError:
        meta = {}
    counter = beat_counter(names, epoch)
    age: float | None = None
    if counter:
        try:
            age = max(0.0, time.time() - float(storage.read(beat_key(epoch, counter))))
        except (StrawqError, ValueError):
            age = None
    pid = meta.get("pid")
    at = meta.get("at")
    return TrainerHolder(epoch=epoch, host=str(meta.get("host", "?")),
                         pid=pid if isinstance(pid, int) else -1,
                         started=float(at) if isinstance(at, (int, float)) else 0.0,
                         counter=counter, released=released_name(epoch) in names,
                         heartbeat_age_s=age)
