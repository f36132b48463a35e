"""Engines that need weights: durable notes from producers to the trainer, under ``engines/``.

A producer that finds an engine on weights other than the run's version (a restart on an
old checkpoint, a push that failed, a new worker behind a router) takes it out of its
rotation and writes one note here; the trainer's side (``WeightUpdateBracket``) lists the
notes and pushes the run's weights to those engines through its ordinary push path::

    engines/<url key>~<writer>~<nonce>     one note: url, the version the engine reported,
                                           the run's version then, why, when

``<url key>`` is a hash of the engine's base URL (URLs are not valid file names). Notes are
written once under a fresh name and deleted, never rewritten: the trainer deletes an
engine's notes after a push to it succeeded; a producer deletes its own once the engine
reports the run's version again. A note whose engine is already repaired only costs one
more (idempotent) push.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass

from strawq import records
from strawq.errors import CorruptRecord, NotFound, StrawqError
from strawq.names import validate_id
from strawq.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"


def url_key(url: str) -> str:
    """A file-name-safe key for an engine's base URL."""
    return hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StaleNote:
    """One producer's (or trainer's) note that an engine needs the run's weights."""

    name: str
    url: str
    #: the version the engine reported (None: it could not be read)
    engine_version: int | None
    #: the run's version when the note was written
    run_version: int
    writer: str
    reason: str
    at: float


class EngineWeights:
    """Read and write the notes of ``engines/`` on the run's storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def mark(self, url: str, *, writer: str, engine_version: int | None, run_version: int,
             reason: str) -> str:
        """Write a note that ``url`` needs the weights of ``run_version``; returns its name."""
        validate_id(writer, "writer id")
        name = f"{url_key(url)}~{writer}~{uuid.uuid4().hex[:12]}"
        self.storage.makedirs(ENGINES_DIR)
        self.storage.publish(f"{ENGINES_DIR}/{name}", records.encode(Kind.STATE, {
            "url": url.rstrip("/"), "engine_version": engine_version,
            "run_version": int(run_version), "writer": writer, "reason": reason[:500],
            "at": time.time()}))
        return name

    def notes(self) -> list[StaleNote]:
        """Every readable note; an unreadable one is logged and skipped (and left for an
        operator: it names no engine this code could trust)."""
        out = []
        for name in self.storage.list(ENGINES_DIR):
            key = f"{ENGINES_DIR}/{name}"
            try:
                meta = records.decode(self.storage.read(key), expect=Kind.STATE,
                                      name=key).meta
                ev = meta.get("engine_version")
                out.append(StaleNote(name, str(meta["url"]),
                                     None if ev is None else int(ev), int(meta["run_version"]),
                                     str(meta["writer"]), str(meta.get("reason", "")),
                                     float(meta.get("at", 0.0))))
            except NotFound:
                continue  # deleted meanwhile (repaired)
            except (CorruptRecord, KeyError, TypeError, ValueError) as exc:
                log.warning("engines/%s is unreadable (%s); skipping it", name, exc)
        return out

    def needing(self) -> dict[str, StaleNote]:
        """Engine URL -> its newest note: the engines that need the run's weights."""
        out: dict[str, StaleNote] = {}
        for n in self.notes():
            if n.url not in out or n.at > out[n.url].at:
                out[n.url] = n
        return out

    def clear(self, url: str, *, writer: str | None = None,
              up_to_version: int | None = None) -> int:
        """Delete the notes on ``url`` (only ``writer``'s, only those written at a run
        version <= ``up_to_version``, when given); returns how many were deleted."""
        prefix = f"{url_key(url)}~"
        gone = 0
        for n in self.notes():
            if not n.name.startswith(prefix) or (writer is not None and n.writer != writer):
                continue
            if up_to_version is not None and n.run_version > up_to_version:
                continue
            try:
                self.storage.delete(f"{ENGINES_DIR}/{n.name}")
                gone += 1
            except StrawqError as exc:
                log.warning("cannot delete engines/%s: %s", n.name, exc)
        return gone
