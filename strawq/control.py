"""The weight-update bracket's control channel, on the queue's own filesystem.

The trainer (rank 0, through ``strawq.collector.trainer.bracket.WeightUpdateBracket``) announces;
producers acknowledge; nothing needs a live connection between them, and a restarted party
reads where the bracket stands::

    control/pause-<v>              trainer: stop claiming, abort, persist partials, ack
    control/ack-<v>~<producer>     producer: paused; holds no leases; partials persisted
    control/resume-<v>             trainer: weights of version v are live; carry on

The bracket for version ``v`` is open while ``pause-<v>`` exists without ``resume-<v>``.
Producers poll ``list("control")`` (one cheap listing) on their loop cadence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from strawq import records
from strawq.errors import AlreadyExists
from strawq.names import validate_id
from strawq.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)

KEEP = 4


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
        self._put(f"pause-{version:012d}", {"version": version, "reason": reason})

    def ack(self, version: int, producer: str, *, partials: int = 0) -> None:
        validate_id(producer, "producer id")
        self._put(f"ack-{version:012d}~{producer}", {"version": version, "partials": partials})

    def resume(self, version: int) -> None:
        self._put(f"resume-{version:012d}", {"version": version})
        self._gc(version)

    def _gc(self, version: int) -> None:
        for n in self.storage.list("control"):
            kind, _, rest = n.partition("-")
            v = rest.partition("~")[0]
            if v.isascii() and v.isdigit() and int(v) <= version - KEEP:
                self.storage.delete(f"control/{n}")


def read_state(storage: Storage) -> ControlState:
    """The bracket's state from the names in ``control/`` (reads only; ``Control()`` would
    create the directory)."""
    pause = resume = 0
    acks: dict[int, set[str]] = {}
    for n in storage.list("control"):
        kind, _, rest = n.partition("-")
        if kind == "pause" and rest.isascii() and rest.isdigit():
            pause = max(pause, int(rest))
        elif kind == "resume" and rest.isascii() and rest.isdigit():
            resume = max(resume, int(rest))
        elif kind == "ack":
            v, _, producer = rest.partition("~")
            if v.isascii() and v.isdigit():
                acks.setdefault(int(v), set()).add(producer)
    return ControlState(pause, resume, frozenset(acks.get(pause, set())))
