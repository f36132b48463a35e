"""The weight-update bracket's control channel, on the queue's own filesystem.

The trainer (rank 0, through ``strawq.collector.trainer.bracket.WeightUpdateBracket``) announces;
producers acknowledge; nothing needs a live connection between them, and a restarted party
reads where the bracket stands::

    control/pause-<v>              trainer: stop claiming, abort, persist partials, ack
    control/ack-<v>~<producer>     producer: paused; holds no leases (or ``held`` ones, their
                                   state in its journal); partials persisted
    control/resume-<v>             trainer: weights of version v are live; carry on

The bracket for version ``v`` is open while ``pause-<v>`` exists without ``resume-<v>``.
Producers poll ``list("control")`` (one cheap listing) on their loop cadence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from strawq.errors import AlreadyExists, StrawqError
from strawq.ondisk import records
from strawq.ondisk.names import validate_id
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)

KEEP = 4
#: ``control/pause-<v>``, ``control/ack-<v>~<producer>``, ``control/resume-<v>``
PAUSES = Numbered("pause-")
ACKS = Numbered("ack-", sep="~")
RESUMES = Numbered("resume-")


@dataclass(frozen=True)
class ControlState:
    #: newest version announced by a pause (0: never paused)
    pause_version: int
    #: newest version resumed
    resume_version: int
    #: producers that acknowledged the open pause
    acks: frozenset[str]

    @property
    def paused(self) -> bool:
        return self.pause_version > self.resume_version


class Control:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        storage.makedirs("control")

    def state(self) -> ControlState:
        return read_state(self.storage)

    def _put(self, name: str, body: dict[str, object]) -> None:
        try:
            self.storage.publish(f"control/{name}",
                                 records.encode(Kind.STATE, {"at": time.time(), **body}))
        except AlreadyExists:
            pass  # idempotent: a retried announcement

    def pause(self, version: int, *, reason: str = "weight update") -> None:
        self._put(PAUSES.name(version), {"version": version, "reason": reason})

    def ack(self, version: int, producer: str, *, partials: int = 0, held: int = 0) -> None:
        """``held``: leases the producer keeps through the pause (its producers'
        ``timing.hold_through_pause``; their state is durable in its journal); written
        only when > 0."""
        validate_id(producer, "producer id")
        body: dict[str, object] = {"version": version, "partials": partials}
        if held:
            body["held"] = held
        self._put(ACKS.name(version, producer), body)

    def held(self, version: int, producer: str) -> int:
        """The leases ``producer``'s ack of ``version`` says it holds through the pause
        (0: none, or no readable ack)."""
        key = f"control/{ACKS.name(version, producer)}"
        try:
            meta = records.decode(self.storage.read(key), expect=Kind.STATE, name=key).meta
        except StrawqError:
            return 0
        held = meta.get("held", 0)
        return held if isinstance(held, int) else 0

    def resume(self, version: int) -> None:
        self._put(RESUMES.name(version), {"version": version})
        self._gc(version)

    def _gc(self, version: int) -> None:
        names = self.storage.list("control")
        for family in (PAUSES, ACKS, RESUMES):
            for n in family.below(names, version - KEEP + 1):
                self.storage.delete(f"control/{n}")


def read_state(storage: Storage) -> ControlState:
    """The bracket's state from the names in ``control/`` (reads only; ``Control()`` would
    create the directory)."""
    names = storage.list("control")
    pause, resume = PAUSES.newest(names, 0), RESUMES.newest(names, 0)
    acks = frozenset(got[1] for n in names
                     if (got := ACKS.split(n)) is not None and got[0] == pause)
    return ControlState(pause, resume, acks)
