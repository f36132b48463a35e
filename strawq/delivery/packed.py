"""Packed rank shards: a batch's data-parallel shards, packed once by the collector.

With ``CollectorConfig.pack_ranks = W`` the collector writes, for each batch it publishes
and before its manifest, one PACKED record per rank of a W-rank trainer holding exactly the
arrays ``BatchReader.load`` packs from the group records for that rank (the flat token
columns, the per-sample columns, the extras), and names them in the manifest's
``meta["packed"]`` (``{"world_size": W, "tag": T, "ranks": [...]}``). A rank of a W-rank
trainer then loads its shard with one read into a reused buffer and views the arrays in
place; anything that does not match (another world size, a missing, corrupt or torn shard)
falls back to the records. The shards are derived data: nothing is lost without them.

This module owns the key family; nothing else spells it::

    packed/<seq>~<tag>~w<W>~r<rank>   PACKED record of rank ``rank`` of ``W`` for batch
                                      ``seq`` (``shard_key``); ``tag`` is new for every
                                      publish attempt, so a name is never reused

A PACKED record is a record (``strawq.ondisk.records``: magic, kind, xxh3 over everything) whose
metadata says what it was packed from (``info``: seq, tag, world size, rank, the sharding
rule's version, the manifest positions and ``id~g<gen>`` of its groups) and where each array
lies (``arrays``: ``[name, dtype, shape, offset, nbytes]``, offsets into the payload,
64-byte aligned); the payload is the arrays' raw little-endian bytes. Dtypes are a fixed
set; nothing is unpickled (docs/design.md, invariant 7).

Shards leave with their batch: GC deletes the ones its manifest names (``delete_named``),
and the sweep deletes every shard whose batch has no manifest (a collector that crashed
between its shards and its manifest, a lost publish race: ``sweep_orphans``).
"""

from __future__ import annotations

import math
import sys
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from strawq.errors import CorruptRecord
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage

PACKED_DIR = "packed"
#: ``packed/<seq>~<tag>~w<W>~r<rank>``
SHARDS = Numbered(sep="~")
#: the version of the rank-sharding rule (``strawq.collector.trainer.packing.shard_groups``) a
#: shard was packed with; a reader with another rule reads the records
SHARDING = 1
ALIGN = records.ALIGN

#: the dtypes a shard may hold (numpy's ``dtype.str``, little endian)
DTYPES = {np.dtype(t).newbyteorder("<").str: np.dtype(t).newbyteorder("<")
          for t in (np.uint8, np.bool_, np.int32, np.int64, np.float32, np.float64)}


def new_tag() -> str:
    """A fresh tag for one publish attempt's shards (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def shard_key(seq: int, tag: str, world_size: int, rank: int) -> str:
    """``packed/<seq>~<tag>~w<W>~r<rank>``: rank ``rank`` of ``world_size`` of batch ``seq``."""
    return f"{PACKED_DIR}/{SHARDS.name(seq, f'{tag}~w{world_size}~r{rank}')}"


def parse_shard_name(name: str) -> tuple[int, str, int, int] | None:
    """(seq, tag, world size, rank) of a name in ``packed/``, None for anything else."""
    got = SHARDS.split(name)
    if got is None:
        return None
    seq, rest = got
    parts = rest.split("~")
    if len(parts) != 3 or not parts[1].startswith("w") or not parts[2].startswith("r"):
        return None
    tag, w, r = parts[0], parts[1][1:], parts[2][1:]
    if not (w + r).isascii() or not (w.isdigit() and r.isdigit()):
        return None
    if not tag.isascii() or not tag.isalnum():
        return None
    return seq, tag, int(w), int(r)


def encode_shard(info: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> list[bytes | memoryview]:
    """A PACKED record of ``arrays`` (each written as it is: no copy of contiguous arrays)."""
    index: list[list[Any]] = []
    blobs: list[bytes | memoryview] = []
    off = 0
    for name, arr in arrays.items():
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        key = dt.newbyteorder("<").str
        if key not in DTYPES:
            raise ValueError(f"packed array {name!r}: dtype {arr.dtype} is not one of "
                             f"{sorted(DTYPES)}")
        a = np.ascontiguousarray(arr, dtype=DTYPES[key])
        nbytes = a.nbytes
        index.append([name, key, list(a.shape), off if nbytes else 0, nbytes])
        if nbytes:
            blobs.append(a.reshape(-1).view(np.uint8).data)
            pad = -nbytes % ALIGN
            if pad:
                blobs.append(b"\0" * pad)
            off += nbytes + pad
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little endian
        raise RuntimeError("packed shards are written on little-endian hosts only")
    return records.encode_blobs(Kind.PACKED, {"info": dict(info), "arrays": index}, blobs)


def decode_shard(buf: np.ndarray, *, name: str = "shard", verify: bool = True,
                 digest: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(info, arrays) of a PACKED record held in the uint8 array ``buf`` (exactly the file).

    ``digest``: the xxh3-64 of the record's checksummed ranges (``records.checksummed``),
    already computed as it was read (checked against the header's instead of hashing
    again). The arrays are views of
    ``buf`` (they keep it alive); ``CorruptRecord`` says what does not hold.
    """
    if verify and digest is not None and buf.shape[0] >= records.HEADER.size:
        stored = records.HEADER.unpack_from(buf.data)[7]
        if stored != digest:
            raise CorruptRecord(f"{name}: checksum mismatch (stored {stored:#018x}, computed "
                                f"{digest:#018x}); the shard is corrupt")
        verify = False  # checked: the rest of the framing still is
    rec = records.decode(buf.data, expect=Kind.PACKED, name=name, verify=verify)
    info, index = rec.meta.get("info"), rec.meta.get("arrays")
    if not isinstance(info, dict) or not isinstance(index, list):
        raise CorruptRecord(f"{name}: a PACKED record needs 'info' and 'arrays' in its "
                            "metadata")
    start = buf.shape[0] - len(rec.payload)
    out: dict[str, np.ndarray] = {}
    for entry in index:
        try:
            aname, key, shape, off, nbytes = entry
            dt = DTYPES[key]
            shape = tuple(int(d) for d in shape)
            if type(off) is not int or type(nbytes) is not int:
                raise TypeError("offset and size must be integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"{name}: bad array entry {entry!r} ({exc})") from None
        if any(d < 0 for d in shape) or math.prod(shape) * dt.itemsize != nbytes or off < 0 \
                or off + nbytes > len(rec.payload):
            raise CorruptRecord(f"{name}: array {aname!r} ({key} {list(shape)}, {nbytes} "
                                f"bytes at {off}) does not fit the {len(rec.payload)}-byte "
                                "payload")
        out[str(aname)] = buf[start + off:start + off + nbytes].view(dt).reshape(shape)
    return info, out


def delete_named(storage: Storage, seq: int, meta: Mapping[str, Any]) -> int:
    """Delete the shards a manifest's ``meta["packed"]`` names; returns how many it named."""
    packed = meta.get("packed")
    if not isinstance(packed, Mapping):
        return 0
    try:
        tag, w = str(packed["tag"]), int(packed["world_size"])
        ranks = [int(r) for r in packed.get("ranks", range(w))]
    except (KeyError, TypeError, ValueError):
        return 0
    if parse_shard_name(shard_key(seq, tag, w, 0).rpartition("/")[2]) is None:
        return 0  # not a name this module writes: nothing to delete
    for r in ranks:
        storage.delete(shard_key(seq, tag, w, r))
    return len(ranks)


def sweep_orphans(storage: Storage, live: Iterable[int]) -> int:
    """Delete every shard whose batch number is not in ``live`` (the manifests present):
    shards of a publish that never happened, or of a batch already retired. Run it only
    where no shard is being written for a manifest not yet published (the collector's own
    GC pass)."""
    keep = set(live)
    n = 0
    for name in storage.list(PACKED_DIR):
        parsed = parse_shard_name(name)
        if parsed is not None and parsed[0] not in keep:
            storage.delete(f"{PACKED_DIR}/{name}")
            n += 1
    return n
