"""Rolling weight updates published as a delta against a base, per file.

A version the rolling mode publishes is a directory of files in the engines' loading format
(SGLang's ``update_weights_from_disk`` loads a safetensors checkpoint: its shards, their
index, the config; the local tiny engine ``config.json`` and ``model.pt``). The delta form
works on those files as they are: with a ``publish_dir`` (a directory every engine reads),
the trainer's publisher copies version v there, into ``v<v>-<nonce>/``, either whole (a
full version) or only the files whose bytes differ from its base's (a delta: the base is
the newest version published before it). Every manifest lists each file of its version
with its sha256 and size (``Manifest.listing``), so the next delta is computed from the base
manifest alone, without reading the base's files again; a delta's manifest names its base,
the base manifest's checksum and the delta directory's own checksum (``delta_checksum``,
over its files' names, sha256 and sizes: ``digest_listing``);
its ``checksum`` is the whole version's, as a full publish of the same weights has it.

A chain stays bounded: a version is a delta only while its base is at most
``max_delta_chain - 1`` deltas away from a full version, and only when it writes fewer
bytes than a full one; otherwise it is full. A base is not collected while a kept manifest
needs it (``WeightStore._gc`` keeps every kept manifest's chain).

A producer materializes a delta on its node's local disk (``materialize``): the base
version (its own local copy when it has one, else the full version's published directory,
else the base materialized first, recursively) plus the delta's files, linked or copied
into a new directory, whose checksum must equal the manifest's before the engine loads it.
A base whose manifest is gone or whose checksum is not the one the delta names, a delta
directory that changed, or a built directory that does not match are refused
(``BaseUnavailable``, ``WeightsConflict``): the engine stays on its version.

Crash safety: the published directory is written under a temporary name and renamed, then
the manifest is created (``WeightStore.publish``): a crash before the manifest leaves a
directory no manifest names, which no loader sees and the next publish's sweep deletes
(``sweep``). A producer builds under a temporary name too, and renames only a verified
build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from strawq.errors import StrawqError

log = logging.getLogger(__name__)

#: rel name -> (sha256 hex, bytes): every file of a version
Listing = Mapping[str, tuple[str, int]]
#: deltas in a row (after a full version) before the next publish is full again
MAX_DELTA_CHAIN = 3
#: ``<publish_dir>/v<v>-<nonce>``: one published version's files (whole, or its delta's)
_PUBLISHED = re.compile(r"^v(\d+)-[0-9a-f]{12}$")
#: ``<cache>/v<v>-<checksum[:16]>``: a producer's local build of a delta version
_BUILT = re.compile(r"^v(\d+)-[0-9a-f]{16}$")


class DeltaRefused(StrawqError):
    """A delta version that cannot be built into exactly its manifest's weights."""


class BaseUnavailable(DeltaRefused):
    """A delta's base is gone (its manifest collected or unreadable) or is not the one the
    delta was computed against."""


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]


def scan(path: str | Path) -> tuple[str, dict[str, tuple[str, int]]]:
    """(checksum, listing) of the directory ``path`` in one read of its files: the checksum
    is ``strawq.weights.publish.checksum_dir``'s, the listing each file's sha256 and size."""
    root = Path(path)
    if not root.exists():
        raise DeltaRefused(f"weights {root} do not exist")
    whole = hashlib.sha256()
    listing: dict[str, tuple[str, int]] = {}
    for p in _files(root):
        rel = p.relative_to(root).as_posix() if root.is_dir() else p.name
        one = hashlib.sha256()
        size = 0
        whole.update(rel.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                whole.update(chunk)
                one.update(chunk)
                size += len(chunk)
        whole.update(b"\0")
        listing[rel] = (one.hexdigest(), size)
    return whole.hexdigest(), listing


def digest_listing(listing: Listing) -> str:
    """sha256 over a listing's sorted (name, file sha256, size): a delta directory's
    checksum, computed from the digests ``scan`` already took (no second read)."""
    h = hashlib.sha256()
    for rel in sorted(listing):
        sha, size = listing[rel]
        h.update(f"{rel}\0{sha}\0{int(size)}\n".encode())
    return h.hexdigest()


def delta_checksum_of(path: str | Path) -> str:
    """The checksum of the delta directory at ``path`` (``digest_listing`` of its files)."""
    return digest_listing(scan(path)[1])


@dataclass(frozen=True)
class Staged:
    """Version ``version`` copied into the publish directory, ready for its manifest."""

    version: int
    #: the directory published (a full version: every file; a delta: the changed ones)
    path: str
    #: the whole version's checksum and files
    checksum: str
    listing: dict[str, tuple[str, int]]
    #: the base version (None: full), its checksum, and the delta directory's checksum
    base: int | None = None
    base_checksum: str | None = None
    delta_checksum: str | None = None
    #: deltas since the last full version (0: full)
    chain: int = 0
    #: bytes copied into the publish directory
    written: int = 0


@dataclass(frozen=True)
class BaseInfo:
    """What a delta needs of its base's manifest."""

    version: int
    checksum: str
    listing: Listing
    chain: int


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 22)
        fo.flush()
        os.fsync(fo.fileno())


def stage(version: int, written: str | Path, publish_dir: str | Path, *,
          base: BaseInfo | None, max_delta_chain: int) -> Staged:
    """Copy version ``version``'s weights (complete at ``written``) into ``publish_dir``:
    only the files that differ from ``base``'s while the chain allows and that writes fewer
    bytes, else every file. Written under a temporary name, fsync'd, then renamed."""
    if max_delta_chain < 0:
        raise ValueError(f"max_delta_chain must be >= 0, got {max_delta_chain}")
    src = Path(written)
    if not src.is_dir():
        raise DeltaRefused(f"write({version}) returned {src}, which is not a directory of "
                           "weights files")
    checksum, listing = scan(src)
    total = sum(n for _, n in listing.values())
    use = list(listing)
    delta = base is not None and bool(base.listing) and base.chain < max_delta_chain
    if delta:
        assert base is not None
        changed = [rel for rel, got in listing.items() if tuple(base.listing.get(rel, ())) != got]
        if sum(listing[r][1] for r in changed) < total:
            use = changed
        else:
            delta = False
    out = Path(publish_dir)
    out.mkdir(parents=True, exist_ok=True)
    nonce = uuid.uuid4().hex[:12]
    tmp = out / f".v{version}-{nonce}.tmp"
    final = out / f"v{version}-{nonce}"
    try:
        tmp.mkdir()
        for rel in use:
            _copy(src / rel, tmp / rel)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written_bytes = sum(listing[r][1] for r in use)
    if not delta:
        return Staged(version, os.fspath(final.resolve()), checksum, listing,
                      written=written_bytes)
    assert base is not None
    return Staged(version, os.fspath(final.resolve()), checksum, listing, base.version,
                  base.checksum, digest_listing({r: listing[r] for r in use}),
                  base.chain + 1, written_bytes)


def sweep(publish_dir: str | Path, named: Iterable[str]) -> int:
    """Delete every published directory under ``publish_dir`` no manifest in ``named``
    names (collected versions, and a publish that crashed before its manifest); returns
    how many. Only the publishing process calls it, after its publish."""
    root = Path(publish_dir)
    if not root.is_dir():
        return 0
    keep = {os.path.realpath(p) for p in named}
    gone = 0
    for p in root.iterdir():
        orphan_tmp = p.name.startswith(".v") and p.name.endswith(".tmp")
        if (_PUBLISHED.match(p.name) or orphan_tmp) and os.path.realpath(p) not in keep:
            shutil.rmtree(p, ignore_errors=True)
            gone += 1
    return gone


# -- the producer's side ---------------------------------------------------------------------
def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def build(version: int, *, listing: Listing, checksum: str, delta_dir: str | Path,
          delta_checksum: str | None, base_dir: str | Path, cache: str | Path,
          check: bool = True) -> str:
    """Build version ``version`` in ``cache`` from the base's files at ``base_dir`` and the
    delta's at ``delta_dir``; returns the directory, whose checksum equals ``checksum`` (or
    raises ``DeltaRefused`` and leaves nothing). A new build is always checked; one already
    in ``cache`` only with ``check`` (a base needs none: what a version takes of its base
    is checked with the version's own build)."""
    root = Path(cache)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"v{version}-{checksum[:16]}"
    if target.is_dir():
        if not check:
            return os.fspath(target)
        got, _ = scan(target)
        if got == checksum:
            return os.fspath(target)
        shutil.rmtree(target, ignore_errors=True)  # a build that changed since: again
    delta = Path(delta_dir)
    if not delta.is_dir():
        raise BaseUnavailable(f"the delta of version {version} ({delta}) is gone")
    if check and delta_checksum is not None:
        got_delta = delta_checksum_of(delta)
        if got_delta != delta_checksum:
            raise DeltaRefused(f"the delta of version {version} at {delta} changed since it "
                               f"was published (checksum {got_delta[:12]}, manifest "
                               f"{delta_checksum[:12]})")
    base = Path(base_dir)
    tmp = root / f".v{version}-{uuid.uuid4().hex[:12]}.tmp"
    try:
        tmp.mkdir()
        for rel in listing:
            src = delta / rel if (delta / rel).is_file() else base / rel
            if not src.is_file():
                raise BaseUnavailable(f"file {rel} of version {version} is neither in its "
                                      f"delta ({delta}) nor in its base ({base})")
            _link_or_copy(src, tmp / rel)
        got, _ = scan(tmp)
        if got != checksum:
            raise DeltaRefused(f"version {version} built from its base ({base}) and its "
                               f"delta has checksum {got[:12]}, its manifest {checksum[:12]}: "
                               "the base is not the one the delta was computed against")
        try:
            os.replace(tmp, target)
        except OSError:  # built meanwhile by another pull of this producer
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.fspath(target)


def prune(cache: str | Path, keep_from: int) -> int:
    """Delete the local builds of versions below ``keep_from``, and every unfinished build
    (``cache`` is one producer's, which builds one version at a time: call it between
    builds); returns how many."""
    root = Path(cache)
    if not root.is_dir():
        return 0
    gone = 0
    for p in root.iterdir():
        got = _BUILT.match(p.name)
        unfinished = p.name.startswith(".v") and p.name.endswith(".tmp")
        if unfinished or (got is not None and int(got.group(1)) < keep_from):
            shutil.rmtree(p, ignore_errors=True)
            gone += 1
    return gone
