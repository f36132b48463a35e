"""Rolling weight updates: version v published once, engines pull it in waves.

The simple mode of a weight update is the global bracket (``strawq.weights.control``): every
producer paused, every engine pushed at once. In the rolling mode the trainer writes the
weights of version v once to a directory every engine can read, publishes a manifest for it
here and returns; nothing is paused for it. Producers load it into their engines themselves,
a few at a time, and route by the version each engine holds
(``strawq.producers.rolling``)::

    weights/manifest-<v>            trainer: version v's weights are at <path>; checksum over
                                    its files; how many engines may load at once (``wave``),
                                    how many versions an engine may lag (``max_lag``)
    weights/wave-<v>~<k>            a producer: slot k of version v's wave is mine, loading
                                    <url> (exclusive create; deleted after the load)

A manifest is written once under its version (an exclusive create: a second trainer
publishing the same version with other weights loses, ``WeightsConflict``), through the
record framing (schema version and checksum, invariant 2), after the weights themselves are
complete on disk: a manifest names weights that are there, and its checksum (sha256 over
the directory's file names and bytes) lets a loader refuse a copy that changed since. The
trainer announces version v (``versions/``) only after the manifest is in place.

A manifest also lists each file's sha256 and size. With a publish directory the version
may be a delta against the version before it (``strawq.weights.delta``): its directory
holds only the files that changed, and the manifest names the base, the base manifest's
checksum and the delta's own; ``checksum`` stays the whole version's. A producer builds it
on its local disk (``WeightStore.materialize``); collection keeps every base a kept delta
needs.

A wave slot is claimed by creating ``wave-<v>~<k>`` for some ``k < wave``; at most ``wave``
engines of the fleet load version v at once, whoever drives them, with no coordinator. A
producer that dies holding a slot leaves it until it restarts under the same id (it deletes
its own slots at start) or until the slots of v are collected (``KEEP`` versions later):
version v's wave is one slot narrower meanwhile, and every newer version has slots of its
own.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import zlib
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import validate_id
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.weights.delta import (
    BaseInfo,
    BaseUnavailable,
    DeltaRefused,
    Staged,
    build,
    delta_checksum_of,
    scan,
)

log = logging.getLogger(__name__)

WEIGHTS_DIR = "weights"
#: ``weights/manifest-<v>``, ``weights/wave-<v>~<k>``
MANIFESTS = Numbered("manifest-")
WAVES = Numbered("wave-", sep="~", tail_width=4)
#: manifests (and their wave slots) kept below the newest
KEEP = 4
#: the two modes of a weight update (``WeightUpdateBracket(weight_update=...)``)
MODES = ("bracket", "rolling")


class WeightsConflict(DeltaRefused):
    """A version published twice with different weights, or weights that changed on disk
    since their manifest was written."""


@dataclass(frozen=True)
class Manifest:
    """Version ``version``'s weights, as the trainer published them."""

    version: int
    #: the directory engines load (``update_weights_from_disk``'s ``model_path``)
    path: str
    #: sha256 over the directory's relative file names and bytes (``checksum_dir``)
    checksum: str
    files: int
    bytes: int
    #: engines of the fleet that may load this version at once
    wave: int
    #: versions an engine may lag this one and still serve (0: none)
    max_lag: int
    #: the trainer's seconds to write the weights (``publish_version``: ``write(v)``, with a
    #: publish directory the copy into it; not the manifest's own write, nor the announce)
    write_s: float
    at: float
    #: each file of the version: sha256 and bytes (empty in a manifest written before
    #: deltas existed: no delta is computed against it)
    listing: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    #: a delta (``strawq.weights.delta``): ``path`` holds only the files that differ from
    #: version ``base``'s, whose manifest's checksum is ``base_checksum``; ``delta_checksum``
    #: is ``path``'s own; ``chain`` counts deltas since the last full version (0: full)
    base: int | None = None
    base_checksum: str | None = None
    delta_checksum: str | None = None
    chain: int = 0
    #: bytes the trainer wrote to ``path`` for this version (a delta: its files only)
    written: int = 0

    @property
    def is_delta(self) -> bool:
        return self.base is not None

    def to_meta(self) -> dict[str, object]:
        meta: dict[str, object] = {
            "version": self.version, "path": self.path, "checksum": self.checksum,
            "files": self.files, "bytes": self.bytes, "wave": self.wave,
            "max_lag": self.max_lag, "write_s": self.write_s, "at": self.at,
            "listing": {k: list(v) for k, v in self.listing.items()},
            "written": self.written}
        if self.base is not None:
            meta.update(base=self.base, base_checksum=self.base_checksum,
                        delta_checksum=self.delta_checksum, chain=self.chain)
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Manifest:
        base = meta.get("base")
        listing = meta.get("listing") or {}
        return cls(int(meta["version"]), str(meta["path"]), str(meta["checksum"]),
                   int(meta["files"]), int(meta["bytes"]), int(meta["wave"]),
                   int(meta["max_lag"]), float(meta.get("write_s", 0.0)), float(meta["at"]),
                   {str(k): (str(v[0]), int(v[1])) for k, v in listing.items()},
                   None if base is None else int(base),
                   None if base is None else str(meta["base_checksum"]),
                   None if base is None else str(meta["delta_checksum"]),
                   int(meta.get("chain", 0)), int(meta.get("written", meta["bytes"])))

    def as_base(self) -> BaseInfo:
        return BaseInfo(self.version, self.checksum, self.listing, self.chain)


def checksum_dir(path: str | Path) -> tuple[str, int, int]:
    """(sha256 hex, files, bytes) over every regular file under ``path``, by sorted relative
    name; a single file is checksummed by itself."""
    root = Path(path)
    if not root.exists():
        raise WeightsConflict(f"weights {root} do not exist")
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    total = 0
    for p in files:
        rel = p.relative_to(root).as_posix() if root.is_dir() else p.name
        h.update(rel.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                total += len(chunk)
        h.update(b"\0")
    return h.hexdigest(), len(files), total


def wave_width(wave: float, fleet: int) -> int:
    """Engines that may load at once: ``wave`` >= 1 is a count, below 1 a share of ``fleet``
    (at least one engine)."""
    if not wave > 0:
        raise ValueError(f"wave must be > 0 (a count, or a share of the fleet), got {wave}")
    if wave >= 1:
        return int(wave)
    return max(1, math.floor(wave * max(fleet, 1)))


def check_mode(weight_update: str, wave: float, max_lag: int) -> None:
    """Refuse (``ValueError``) a weight-update mode, wave or lag that cannot work."""
    if weight_update not in MODES:
        raise ValueError(f"weight_update must be one of {MODES}, got {weight_update!r}")
    wave_width(wave, 1)  # refuses a wave <= 0
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")


class WeightStore:
    """The manifests and wave slots under ``weights/`` on the run's storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # -- manifests (the trainer writes, everyone reads) ----------------------------------------
    def publish(self, version: int, path: str | Path, *, wave: int, max_lag: int,
                write_s: float = 0.0, staged: Staged | None = None) -> Manifest:
        """Write version ``version``'s manifest for the weights at ``path`` (complete on
        disk; ``staged``: copied into a publish directory, whole or as a delta,
        ``strawq.weights.delta.stage``). Publishing the same weights again is a no-op;
        other weights under a version already published raise ``WeightsConflict``."""
        if version < 1:
            raise ValueError(f"a published version is >= 1, got {version}")
        if wave < 1 or max_lag < 0:
            raise ValueError(f"wave >= 1 and max_lag >= 0, got {wave} and {max_lag}")
        if staged is None:
            if not Path(path).exists():
                raise WeightsConflict(f"weights {path} do not exist")
            checksum, listing = scan(path)
            staged = Staged(int(version), os.fspath(Path(path).resolve()), checksum, listing,
                            written=sum(n for _, n in listing.values()))
        checksum, listing = staged.checksum, staged.listing
        m = Manifest(int(version), staged.path, checksum, len(listing),
                     sum(n for _, n in listing.values()), int(wave), int(max_lag),
                     float(write_s), time.time(), listing, staged.base, staged.base_checksum,
                     staged.delta_checksum, staged.chain, staged.written)
        self.storage.makedirs(WEIGHTS_DIR)
        try:
            self.storage.publish(f"{WEIGHTS_DIR}/{MANIFESTS.name(version)}",
                                 records.encode(Kind.STATE, m.to_meta()))
        except AlreadyExists:
            there = self.manifest(version)
            if there is None or there.checksum != checksum:
                raise WeightsConflict(
                    f"weight version {version} is already published "
                    f"({there.path if there else 'unreadable'}, checksum "
                    f"{there.checksum[:12] if there else '?'}); these weights ({path}, "
                    f"checksum {checksum[:12]}) differ: publish them as a new version"
                ) from None
            return there
        self._gc(version)
        return m

    def publish_version(self, version: int, write: Callable[[int], Any], *,
                        announce: Callable[[int], None], wave: int, max_lag: int,
                        clock: Callable[[], float]) -> tuple[Manifest, float]:
        """``write(version)`` (returns the weights' directory, complete), the manifest,
        then ``announce(version)``; returns the manifest and the seconds it all took."""
        t0 = clock()
        path = write(version)
        if path is None:
            raise WeightsConflict("write(version) must return the directory it wrote the "
                                  "weights to (the rolling mode loads them from there)")
        staged = path if isinstance(path, Staged) else None
        m = self.publish(version, staged.path if staged else path, wave=wave,
                         max_lag=max_lag, write_s=clock() - t0, staged=staged)
        announce(version)
        waited = clock() - t0
        log.info("weight version %d published (%s, %d files, %.1f MB%s) in %.2fs; engines "
                 "load it %d at a time", version, m.path, m.files, m.bytes / 1e6,
                 f", a delta against version {m.base}: {m.written / 1e6:.1f} MB written"
                 if m.is_delta else "", waited, m.wave)
        return m, waited

    def manifest(self, version: int) -> Manifest | None:
        key = f"{WEIGHTS_DIR}/{MANIFESTS.name(version)}"
        try:
            meta = records.decode(self.storage.read(key), expect=Kind.STATE, name=key).meta
            return Manifest.from_meta(meta)
        except NotFound:
            return None
        except (CorruptRecord, KeyError, TypeError, ValueError, IndexError) as exc:
            log.warning("%s is unreadable (%s); skipping it", key, exc)
            return None

    def newest(self) -> Manifest | None:
        """The newest readable manifest (None: nothing published, the bracket mode)."""
        for v in reversed(MANIFESTS.numbers(self.storage.list(WEIGHTS_DIR))):
            m = self.manifest(v)
            if m is not None:
                return m
        return None

    @staticmethod
    def verify(m: Manifest) -> None:
        """Raise ``WeightsConflict`` unless the weights at ``m.path`` still match ``m`` (a
        delta: its own files, ``m.delta_checksum``)."""
        want = m.delta_checksum if m.delta_checksum is not None else m.checksum
        checksum = delta_checksum_of(m.path) if m.delta_checksum is not None else \
            checksum_dir(m.path)[0]
        if checksum != want:
            raise WeightsConflict(f"the weights of version {m.version} at {m.path} changed "
                                  f"since they were published (checksum {checksum[:12]}, "
                                  f"manifest {want[:12]}); not loading them")

    def materialize(self, m: Manifest, cache: str | Path, *, check: bool = True) -> str:
        """The directory an engine loads version ``m`` from: a full version's published
        directory; a delta's base plus its files, built and verified in ``cache`` (this
        node's local disk; ``strawq.weights.delta.build``). Raises ``BaseUnavailable`` when
        the base's manifest is gone or names other weights than the delta was computed
        against, ``DeltaRefused`` when the build does not match ``m``: nothing is loaded.
        A full version is not read here (``verify`` checks it); ``check=False`` (for a
        base) takes a build already in ``cache`` unread."""
        if m.base is None:
            return m.path
        base = self.manifest(m.base)
        if base is None:
            raise BaseUnavailable(f"version {m.version} is a delta against version {m.base}, "
                                  "whose manifest is gone (collected or unreadable)")
        if base.checksum != m.base_checksum:
            raise BaseUnavailable(
                f"version {m.version} is a delta against version {m.base} with checksum "
                f"{str(m.base_checksum)[:12]}, but version {m.base}'s manifest has "
                f"{base.checksum[:12]}")
        base_dir = self.materialize(base, cache, check=False)
        return build(m.version, listing=m.listing, checksum=m.checksum, delta_dir=m.path,
                     delta_checksum=m.delta_checksum, base_dir=base_dir, cache=cache,
                     check=check)

    # -- wave slots (producers) ----------------------------------------------------------------
    def claim_slot(self, m: Manifest, holder: str, url: str, *,
                   check_url: bool = True) -> int | None:
        """Claim a free slot of version ``m.version``'s wave for loading ``url``; the slot
        number, or None when all ``m.wave`` are held (or ``url`` is being loaded already).

        One listing of ``weights/``; a full wave is known from its names alone. With a
        slot free, ``check_url`` reads the held slots' records to refuse an engine being
        loaded already; ``check_url=False`` reads none (a caller that knows its own loads:
        ``RollingPull``). The free slots are tried from an offset of the holder's own, so
        producers that saw the same free slots do not all race for the first."""
        validate_id(holder, "producer id")
        self.storage.makedirs(WEIGHTS_DIR)
        taken = {k for v, k in self._slot_names(self.storage.list(WEIGHTS_DIR))
                 if v == m.version}
        free = [k for k in range(m.wave) if k not in taken]
        if not free:
            return None
        if check_url and url.rstrip("/") in {u for _, _, u in self.slots(m.version)}:
            return None
        off = zlib.crc32(f"{holder} {url}".encode()) % len(free)
        for k in free[off:] + free[:off]:
            try:
                self.storage.publish(
                    f"{WEIGHTS_DIR}/{WAVES.name(m.version, k)}",
                    records.encode(Kind.STATE, {"holder": holder, "url": url.rstrip("/"),
                                                "at": time.time()}))
                return k
            except AlreadyExists:
                continue  # another producer took it meanwhile: try the next
        return None

    @staticmethod
    def _slot_names(listing: list[str]) -> list[tuple[int, int]]:
        """(version, slot) of each wave slot's name in a listing of ``weights/``."""
        return [got for got in map(WAVES.pair, listing) if got is not None]

    def slots(self, version: int) -> list[tuple[int, str, str]]:
        """(slot, holder, url) of the wave slots held for ``version``."""
        out = []
        for name in self.storage.list(WEIGHTS_DIR):
            got = WAVES.pair(name)
            if got is None or got[0] != version:
                continue
            key = f"{WEIGHTS_DIR}/{name}"
            try:
                meta = records.decode(self.storage.read(key), expect=Kind.STATE, name=key).meta
                out.append((got[1], str(meta["holder"]), str(meta["url"])))
            except NotFound:
                continue
            except (CorruptRecord, KeyError, TypeError, ValueError) as exc:
                log.warning("%s is unreadable (%s): its slot stays taken", key, exc)
                out.append((got[1], "?", "?"))
        return sorted(out)

    def release_slot(self, version: int, slot: int) -> None:
        self.storage.delete(f"{WEIGHTS_DIR}/{WAVES.name(version, slot)}")

    def release_mine(self, holder: str) -> int:
        """Delete every slot ``holder`` holds (a producer restarted under its id holds none
        of its predecessor's); returns how many."""
        gone = 0
        for name in self.storage.list(WEIGHTS_DIR):
            got = WAVES.pair(name)
            if got is None:
                continue
            if any(h == holder for k, h, _ in self.slots(got[0]) if k == got[1]):
                self.release_slot(*got)
                gone += 1
        return gone

    def kept(self) -> list[Manifest]:
        """The readable manifests (after a publish's collection: the newest ``KEEP`` and
        the bases their deltas need)."""
        out = []
        for v in MANIFESTS.numbers(self.storage.list(WEIGHTS_DIR)):
            m = self.manifest(v)
            if m is not None:
                out.append(m)
        return out

    def _gc(self, version: int) -> None:
        """Collect manifests (and their wave slots) below the newest ``KEEP``, except the
        bases a kept delta needs, down its chain to its full version."""
        names = self.storage.list(WEIGHTS_DIR)
        cut = version - KEEP + 1
        needed: set[int] = set()
        for v in MANIFESTS.numbers(names):
            if v < cut:
                continue
            m = self.manifest(v)
            while m is not None and m.base is not None and m.base not in needed:
                needed.add(m.base)
                m = self.manifest(m.base)
        for n in MANIFESTS.below(names, cut):
            if MANIFESTS.parse(n) not in needed:
                self.storage.delete(f"{WEIGHTS_DIR}/{n}")
        for n in WAVES.below(names, cut):
            self.storage.delete(f"{WEIGHTS_DIR}/{n}")
