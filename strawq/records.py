"""Record framing: msgpack metadata plus Arrow IPC columns, with a version and a checksum.

Layout of every record (little endian)::

    0   magic      b"SQRC"
    4   u8         format version (FORMAT_VERSION)
    5   u8         kind (Kind)
    6   u16        reserved (0)
    8   u32        meta_len
    12  u32        reserved (0)
    16  u64        payload_len
    24  u64        xxh3_64 of meta bytes + payload bytes
    32  meta       msgpack map (schema version under "v")
    ..  padding    zeros up to a 64-byte boundary
    P   payload    Arrow IPC streams, one per table, each starting 64-byte aligned

The payload offset is aligned so that a memory-mapped record hands Arrow (and then torch)
aligned buffers with no copy. Payloads are data, never code: no pickle (invariant 7).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import xxhash

from strawq.errors import CorruptRecord

MAGIC = b"SQRC"
FORMAT_VERSION = 1
SCHEMA_VERSION = 1
HEADER = struct.Struct("<4sBBHIIQQ")
ALIGN = 64
assert HEADER.size == 32


class Kind(enum.IntEnum):
    TASK = 1
    GROUP = 2
    PARTIAL = 3
    CURSOR = 4
    MANIFEST = 5
    DROP = 6
    RUN = 7
    FAIL = 8
    ACK = 9
    EPOCH = 10
    STATE = 11


def _pad(n: int) -> int:
    return (-n) % ALIGN


@dataclass(frozen=True)
class Record:
    kind: Kind
    meta: dict[str, Any]
    payload: memoryview = field(default_factory=lambda: memoryview(b""))

    def tables(self) -> dict[str, pa.RecordBatch]:
        """Decode the Arrow tables named in ``meta["tables"]`` (zero-copy over payload)."""
        return decode_tables(self.meta.get("tables", {}), self.payload)


def encode_tables(tables: Mapping[str, Mapping[str, np.ndarray]]) -> tuple[dict[str, list[int]],
                                                                             list[bytes]]:
    """Arrow IPC stream per table; returns ``{name: [offset, length]}`` and the chunks."""
    index: dict[str, list[int]] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, columns in tables.items():
        batch = pa.RecordBatch.from_pydict({k: pa.array(np.ascontiguousarray(v))
                                            for k, v in columns.items()})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        buf = sink.getvalue().to_pybytes()
        index[name] = [offset, len(buf)]
        chunks.append(buf)
        pad = _pad(len(buf))
        if pad:
            chunks.append(b"\0" * pad)
        offset += len(buf) + pad
    return index, chunks


def decode_tables(index: Mapping[str, Any], payload: memoryview) -> dict[str, pa.RecordBatch]:
    out: dict[str, pa.RecordBatch] = {}
    for name, (off, length) in index.items():
        if off < 0 or off + length > len(payload):
            raise CorruptRecord(f"table {name!r} at [{off}, {off + length}) lies outside the "
                                f"{len(payload)}-byte payload")
        try:
            reader = pa.ipc.open_stream(pa.py_buffer(payload[off:off + length]))
            batches = list(reader)
        except pa.ArrowInvalid as exc:
            raise CorruptRecord(f"table {name!r} is not a valid Arrow IPC stream: {exc}") from exc
        if len(batches) != 1:
            raise CorruptRecord(f"table {name!r}: expected 1 record batch, found {len(batches)}")
        out[name] = batches[0]
    return out


def encode(kind: Kind, meta: Mapping[str, Any],
           tables: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> list[bytes]:
    """Frame a record; returns buffers to write back to back (see ``Storage.publish``)."""
    meta = dict(meta)
    meta.setdefault("v", SCHEMA_VERSION)
    chunks: list[bytes] = []
    if tables:
        index, chunks = encode_tables(tables)
        meta["tables"] = index
    meta_bytes = msgpack.packb(meta, use_bin_type=True)
    payload_len = sum(len(c) for c in chunks)
    h = xxhash.xxh3_64()
    h.update(meta_bytes)
    for c in chunks:
        h.update(c)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, int(kind), 0, len(meta_bytes), 0, payload_len,
                         h.intdigest())
    head = header + meta_bytes
    if chunks:
        head += b"\0" * _pad(len(head))
    return [head, *chunks]


def encode_bytes(kind: Kind, meta: Mapping[str, Any],
                 tables: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> bytes:
    return b"".join(encode(kind, meta, tables))


def decode(data: bytes | memoryview, *, expect: Kind | None = None, name: str = "record",
           verify: bool = True) -> Record:
    """Parse and verify a record. ``CorruptRecord`` says what was expected and found."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise CorruptRecord(f"{name}: truncated: {len(view)} bytes, a record needs at least "
                            f"{HEADER.size} (empty or torn write)")
    magic, fmt, kind, _r, meta_len, _r2, payload_len, digest = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord(f"{name}: bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if fmt != FORMAT_VERSION:
        raise CorruptRecord(f"{name}: format version {fmt}, this strawq reads {FORMAT_VERSION}; "
                            "upgrade strawq to read it")
    try:
        kind_e = Kind(kind)
    except ValueError:
        raise CorruptRecord(f"{name}: unknown record kind {kind}") from None
    if expect is not None and kind_e != expect:
        raise CorruptRecord(f"{name}: expected a {expect.name} record, found {kind_e.name}")
    meta_end = HEADER.size + meta_len
    payload_start = meta_end + (_pad(meta_end) if payload_len else 0)
    if payload_start + payload_len != len(view):
        raise CorruptRecord(f"{name}: length mismatch: header promises "
                            f"{payload_start + payload_len} bytes, file has {len(view)} (torn?)")
    meta_view = view[HEADER.size:meta_end]
    payload = view[payload_start:payload_start + payload_len]
    if verify:
        h = xxhash.xxh3_64()
        h.update(meta_view)
        h.update(payload)
        if h.intdigest() != digest:
            raise CorruptRecord(f"{name}: checksum mismatch (stored {digest:#018x}, computed "
                                f"{h.intdigest():#018x}); the record is corrupt")
    try:
        meta = msgpack.unpackb(meta_view, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptRecord(f"{name}: metadata is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict):
        raise CorruptRecord(f"{name}: metadata must be a map, found {type(meta).__name__}")
    if meta.get("v") != SCHEMA_VERSION:
        raise CorruptRecord(f"{name}: schema version {meta.get('v')!r}, this strawq reads "
                            f"{SCHEMA_VERSION}")
    return Record(kind_e, meta, payload)


def header_size_hint(meta_bytes: int = 4096) -> int:
    """How many bytes to read to get the header and (typically) all of the metadata."""
    return HEADER.size + meta_bytes


def decode_meta_only(prefix: bytes, *, name: str = "record") -> tuple[Kind, dict[str, Any], int]:
    """Parse header + metadata from a prefix of a record (no payload checksum).

    Returns (kind, meta, bytes_needed). When the prefix is too short, meta is {} and
    bytes_needed says how much to read.
    """
    view = memoryview(prefix)
    if len(view) < HEADER.size:
        raise CorruptRecord(f"{name}: truncated header ({len(view)} bytes)")
    magic, fmt, kind, _r, meta_len, _r2, _pl, _d = HEADER.unpack_from(view)
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise CorruptRecord(f"{name}: bad magic or format version")
    need = HEADER.size + meta_len
    if len(view) < need:
        return Kind(kind), {}, need
    try:
        meta = msgpack.unpackb(view[HEADER.size:need], raw=False, strict_map_key=False)
    except Exception as exc:
        raise CorruptRecord(f"{name}: metadata is not valid msgpack: {exc}") from exc
    return Kind(kind), meta, need
