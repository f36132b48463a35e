"""The collector's epoch key family: the one place its names are spelled and parsed.

Records in ``collector/`` (beside the batch high-water marks of ``strawq.delivery.batches`` and the
η policy of ``strawq.tasks.eta``)::

    epoch-<E>              EPOCH record (owner, host, pid), exclusive create: the claim
    hb-<E>~<counter>       the holder's heartbeat counter (the name is the data)
    closed-<E>             the holder stopped cleanly: a successor need not wait
    start-<E>~<F>          epoch E publishes batches from number F on (the name is the data)

The protocol over them (who creates which, takeover, fencing) is
``strawq.collector.fencing``; readers use ``epochs``, ``epoch_starts`` and ``superseded``
from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from strawq.errors import AlreadyExists
from strawq.ondisk.numbered import Numbered
from strawq.storage import Storage

DIR = "collector"
_EPOCH = "epoch-"
_HB = "hb-"
_CLOSED = "closed-"
_START = "start-"
EPOCHS = Numbered(_EPOCH)
HEARTBEATS = Numbered(_HB, sep="~", tail_width=16)
CLOSED = Numbered(_CLOSED)
STARTS = Numbered(_START, sep="~")
#: the per-epoch records a newer epoch garbage-collects (``prunable``)
_PER_EPOCH = (EPOCHS, HEARTBEATS, CLOSED)


def epoch_key(epoch: int) -> str:
    return f"{DIR}/{EPOCHS.name(epoch)}"


def closed_key(epoch: int) -> str:
    return f"{DIR}/{CLOSED.name(epoch)}"


def closed_name(epoch: int) -> str:
    """The listing name of ``closed_key(epoch)`` inside ``collector/``."""
    return CLOSED.name(epoch)


def heartbeat_key(epoch: int, counter: int) -> str:
    return f"{DIR}/{HEARTBEATS.name(epoch, counter)}"


def start_key(epoch: int, first_seq: int) -> str:
    return f"{DIR}/{STARTS.name(epoch, first_seq)}"


def list_names(storage: Storage) -> list[str]:
    """The listing of ``collector/`` (pass it to the parsers below to list once)."""
    return storage.list(DIR)


def epochs(names: Iterable[str]) -> list[int]:
    """Every epoch with an EPOCH record, oldest first."""
    return EPOCHS.numbers(names)


def heartbeat_counter(names: Iterable[str], epoch: int) -> int:
    """The newest heartbeat counter of ``epoch`` (0: none)."""
    return max((c for e, c in HEARTBEATS.pairs(names) if e == epoch), default=0)


def prunable(names: Iterable[str], below_or_at: int) -> list[str]:
    """Keys of the epoch, heartbeat and closed records of epochs ``<= below_or_at``."""
    names = list(names)
    return [f"{DIR}/{n}" for family in _PER_EPOCH
            for n in family.below(names, below_or_at + 1)]


def mark_epoch_start(storage: Storage, epoch: int, first_seq: int) -> None:
    """Record that collector ``epoch`` publishes batches from ``first_seq`` on."""
    try:
        storage.publish(start_key(epoch, first_seq), b"")
    except AlreadyExists:
        pass


def epoch_starts(storage: Storage, names: list[str] | None = None) -> list[tuple[int, int]]:
    """(epoch, first batch number) of every collector start, oldest epoch first."""
    out = [pair for n in (storage.list(DIR) if names is None else names)
           if (pair := STARTS.pair(n)) is not None]
    return sorted(out)


def superseded(seq: int, meta: Mapping[str, Any], starts: list[tuple[int, int]]) -> int | None:
    """The newer epoch that supersedes manifest ``seq`` (stamped ``meta['epoch']``), or None.

    A manifest without an epoch (written by tools, not by a collector) is never refused.
    """
    epoch = meta.get("epoch")
    if not isinstance(epoch, int):
        return None
    for e, first in starts:
        if e > epoch and first <= seq:
            return e
    return None
