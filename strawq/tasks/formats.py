"""On-disk format versions: what a run's writers write and what this strawq can read.

Every record carries two versions (``strawq.ondisk.records``): the framing's (the header byte,
``records.FORMAT_VERSION``) and its kind's schema version (``meta["v"]``). A *run format*
is one number that fixes the schema version of every record kind (``records.schema_of``).

* A reader reads every schema version up to its newest run format's (older ones too). A
  record newer than that is not corrupt: ``records.decode`` raises ``NewerFormat`` (never
  ``CorruptRecord``), so nothing quarantines or drops it; the part stops and says which
  part to upgrade.
* A writer writes the *run's* format, not its newest: the run's format is ``BASE`` until
  ``strawq upgrade RUN`` publishes ``format/<n>`` (exclusive create, a name never reused;
  the newest one wins). ``upgrade`` refuses while a live part reads only older formats:
  every part says what it reads in the identity its heartbeat or epoch record carries
  (``strawq.liveness.identity``, ``"reads"``). A part whose newest format is older than the
  run's refuses to start (``check_readable``).

The policy (which versions can share a live run) is in docs/operations.md, "Upgrading a
live run". ``strawq.testing.formats`` simulates a newer format (a group record schema 2)
to test a rolling upgrade across a format change.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from strawq.errors import AlreadyExists, CorruptRecord, NewerFormat, NotFound, StrawqError
from strawq.liveness import parse_identity
from strawq.ondisk import records
from strawq.ondisk.names import parse_heartbeat_state
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.epochs import CLOSED, EPOCHS, epoch_key, list_names

log = logging.getLogger(__name__)

#: The run format of a run that never ran ``strawq upgrade`` (and of every run made before
#: run formats were recorded).
BASE = 1
#: ``format/<n>``: the run's format, raised by ``strawq upgrade`` (the newest one wins)
FORMAT_DIR = "format"
FORMATS = Numbered()
#: How long a writer trusts the run format it read (its own monotonic clock). A writer that
#: writes an older format than the run's for a while is harmless: every reader reads it.
REFRESH_S = 30.0


def newest() -> int:
    """The newest run format this strawq reads and can write."""
    return records.newest_format()


def schema(run_format: int, kind: Kind) -> int:
    """The schema version of ``kind`` in run format ``run_format``."""
    return records.schema_of(run_format, kind)


def key(n: int) -> str:
    return f"{FORMAT_DIR}/{FORMATS.name(n)}"


def run_format(storage: Storage) -> int:
    """The run's format: the newest ``format/<n>``, or ``BASE``."""
    known = FORMATS.numbers(storage.list(FORMAT_DIR))
    return max(known, default=BASE)


def check_readable(storage: Storage, *, part: str = "this part") -> int:
    """The run's format; ``NewerFormat`` when this strawq cannot read it (start-up check)."""
    fmt = run_format(storage)
    if fmt > newest():
        raise NewerFormat(f"{storage.describe()}: the run is at format {fmt}, {part} reads "
                          f"formats up to {newest()}: upgrade this part (strawq) before "
                          "starting it on this run (docs/operations.md, Upgrading a live run)")
    return fmt


class FormatCache:
    """A writer's view of the run format, read again after ``REFRESH_S``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._fmt = BASE
        self._at = float("-inf")

    def get(self) -> int:
        now = time.monotonic()
        if now - self._at >= REFRESH_S:
            self.refresh()
        return self._fmt

    def refresh(self) -> int:
        """Read the run format now; a format newer than this strawq's is written as the
        newest this strawq knows (``check_readable`` refuses such a part at start)."""
        self._fmt = min(run_format(self.storage), newest())
        self._at = time.monotonic()
        return self._fmt


def part_formats(identities: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The newest format each part reads, from the identities its records carry (a part
    that does not say reads ``BASE``: it predates run formats)."""
    out: dict[str, int] = {}
    for part, who in identities.items():
        reads = who.get("reads", BASE) if isinstance(who, dict) else BASE
        out[part] = reads if type(reads) is int else BASE
    return out


def live_parts(storage: Storage) -> dict[str, int]:
    """The newest format each part that may be live reads: every producer with a heartbeat
    in ``hb/`` (the collector removes a departed producer's) and the newest collector epoch
    if it did not close. A part whose record cannot be read counts as reading ``BASE``."""
    idents: dict[str, dict[str, Any]] = {}
    newest_hb: dict[str, tuple[int, str]] = {}
    for n in storage.list("hb"):
        hb = parse_heartbeat_state(n)
        if hb is not None and hb[1] >= newest_hb.get(hb[0], (-1, ""))[0]:
            newest_hb[hb[0]] = (hb[1], n)
    for producer, (_c, n) in newest_hb.items():
        try:
            idents[f"producer {producer}"] = parse_identity(storage.read(f"hb/{n}")) or {}
        except NotFound:
            continue  # gone meanwhile
    names = list_names(storage)
    epochs = EPOCHS.numbers(names)
    if epochs and epochs[-1] not in CLOSED.numbers(names):
        e = epochs[-1]
        try:
            rec = records.decode(storage.read(epoch_key(e)), expect=Kind.EPOCH)
            idents[f"collector (epoch {e})"] = dict(rec.meta)
        except (CorruptRecord, NotFound, NewerFormat):
            idents[f"collector (epoch {e})"] = {}
    return part_formats(idents)


class UpgradeRefused(StrawqError):
    """``strawq upgrade`` would raise the run's format past what a live part reads."""


def upgrade(storage: Storage, target: int, live: dict[str, int]) -> int:
    """Raise the run's format to ``target``; returns the format it had.

    ``live``: the newest format each live part reads (``part_formats``). ``UpgradeRefused``
    (nothing written) when one of them reads less than ``target``, naming them, or when
    ``target`` is past this strawq's newest format."""
    if target > newest():
        raise UpgradeRefused(f"format {target} is newer than this strawq knows (up to "
                             f"{newest()}): run the upgrade with the new strawq")
    old = run_format(storage)
    if target <= old:
        log.info("the run is at format %d already (asked for %d): nothing to do", old, target)
        return old
    behind = {p: f for p, f in sorted(live.items()) if f < target}
    if behind:
        names = ", ".join(f"{p} (reads up to {f})" for p, f in behind.items())
        raise UpgradeRefused(f"cannot raise the run to format {target}: live parts read only "
                             f"older formats: {names}. Upgrade and restart them first "
                             "(docs/operations.md, Upgrading a live run); nothing was changed")
    storage.makedirs(FORMAT_DIR)
    body = {"format": target, "from": old, "at": time.time()}
    try:
        storage.publish(key(target), records.encode(Kind.STATE, body))
    except AlreadyExists:
        pass  # another upgrade to the same format first: the run is at it
    return old
