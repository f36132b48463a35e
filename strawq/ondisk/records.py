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
    32  meta       msgpack map (schema version under "v": ``schema_of``)
    ..  padding    zeros up to a 64-byte boundary
    P   payload    Arrow IPC streams, one per table, each starting 64-byte aligned

The payload offset is aligned so that a memory-mapped record hands Arrow (and then torch)
aligned buffers with no copy. Payloads are data, never code: no pickle (docs/design.md, invariant
7).

A record newer than this strawq reads (a framing version past ``FORMAT_VERSION``, a schema
version past its kind's in ``newest_format()``) raises ``NewerFormat``, not ``CorruptRecord``:
it is not quarantined, and the part that met it stops (``strawq.tasks.formats``).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from strawq.errors import CorruptRecord, NewerFormat

if TYPE_CHECKING:  # numpy and pyarrow load on first use: reading metadata needs neither
    import numpy as np
    import pyarrow as pa

    _Fields = tuple[tuple[str, np.dtype[Any]], ...]

MAGIC = b"SQRC"
FORMAT_VERSION = 1
#: A framing version up to this far past ``FORMAT_VERSION`` is a newer strawq's; further is
#: a damaged header (the header is not under the checksum).
NEWER_FRAMING_SPAN = 16
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
    #: a rank's packed shard of a batch (``strawq.delivery.packed``): raw aligned arrays
    PACKED = 12
    #: one window of a producer's in-flight journal (``strawq.tasks.journal``)
    JOURNAL = 13


#: Run format -> schema version per record kind (a kind not named has schema 1). A run
#: format's schemas are never below the previous format's. ``strawq.testing.formats``
#: adds a simulated newer format to test upgrades.
_RUN_FORMATS: dict[int, dict[Kind, int]] = {1: {}}


def newest_format() -> int:
    """The newest run format this strawq reads and can write (``strawq.tasks.formats``)."""
    return max(_RUN_FORMATS)


def schema_of(run_format: int, kind: Kind) -> int:
    """The schema version records of ``kind`` have in run format ``run_format``."""
    try:
        return _RUN_FORMATS[run_format].get(kind, SCHEMA_VERSION)
    except KeyError:
        raise NewerFormat(f"run format {run_format} is not one this strawq knows (it knows "
                          f"{sorted(_RUN_FORMATS)}): upgrade this part") from None


def reads(kind: Kind) -> int:
    """The newest schema version of ``kind`` this strawq reads."""
    return schema_of(newest_format(), kind)


def _newer(name: str, kind: Kind, version: int) -> NewerFormat:
    return NewerFormat(f"{name}: a {kind.name} record of schema version {version}; this strawq "
                       f"reads {kind.name} records up to version {reads(kind)} (run format "
                       f"{newest_format()}). It is a newer strawq's record, not a corrupt one: "
                       "nothing was dropped or moved. Upgrade this part (docs/operations.md, "
                       "Upgrading a live run)")


def _check_schema(name: str, kind: Kind, meta: dict[str, Any]) -> None:
    v = meta.get("v")
    if type(v) is not int or v < 1:
        raise CorruptRecord(f"{name}: schema version {v!r}, expected a positive integer")
    if v > reads(kind):
        raise _newer(name, kind, v)


def _is_current_but_for_version(view: memoryview) -> bool:
    """Whether a whole record whose framing version reads newer has this framing's layout
    and checksum all the same: then only its (unchecksummed) version byte differs, which is
    damage, not a newer strawq (a newer framing changes the layout or the checksum)."""
    _m, _f, _k, _r, meta_len, _r2, payload_len, digest = HEADER.unpack_from(view)
    meta_end = HEADER.size + meta_len
    payload_start = meta_end + (_pad(meta_end) if payload_len else 0)
    if payload_start + payload_len != len(view):
        return False
    h = xxhash.xxh3_64()
    h.update(view[HEADER.size:meta_end])
    h.update(view[payload_start:])
    return bool(h.intdigest() == digest)


def _check_framing(name: str, fmt: int, whole: memoryview | None = None) -> None:
    """``NewerFormat`` for a framing version a newer strawq may write, ``CorruptRecord`` for
    any other unknown one. ``whole``: the whole record, when the caller has it, to tell a
    damaged version byte (the rest verifies as this framing) from a newer framing."""
    if FORMAT_VERSION < fmt <= FORMAT_VERSION + NEWER_FRAMING_SPAN:
        if whole is not None and _is_current_but_for_version(whole):
            raise CorruptRecord(f"{name}: framing version {fmt} on a record whose layout and "
                                f"checksum are version {FORMAT_VERSION}'s: a damaged header")
        raise NewerFormat(f"{name}: record framing version {fmt}, this strawq reads "
                          f"{FORMAT_VERSION}. It is a newer strawq's record, not a corrupt "
                          "one: nothing was dropped or moved. Upgrade this part "
                          "(docs/operations.md, Upgrading a live run)")
    if fmt != FORMAT_VERSION:
        raise CorruptRecord(f"{name}: format version {fmt}, this strawq reads {FORMAT_VERSION}")


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
    import numpy as np
    import pyarrow as pa

    index: dict[str, list[int]] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, columns in tables.items():
        batch = pa.RecordBatch.from_pydict({k: _column(np.ascontiguousarray(v))
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


def _column(v: np.ndarray) -> pa.Array:
    """A numpy column as an Arrow array. A flat integer or float column (the bytes of a
    verl sample, token ids) is wrapped without a copy and without ``pa.array``, whose
    first call in a process imports pandas (~0.3-0.8 s, issue 40); the array, and the IPC
    bytes written from it, are the ones ``pa.array`` makes. Any other column goes through
    ``pa.array``."""
    import pyarrow as pa

    if v.ndim == 1 and v.dtype.kind in "iuf" and v.dtype.isnative:
        return pa.Array.from_buffers(pa.from_numpy_dtype(v.dtype), len(v),
                                     [None, pa.py_buffer(v)])
    return pa.array(v)


def decode_tables(index: Mapping[str, Any], payload: memoryview) -> dict[str, pa.RecordBatch]:
    import pyarrow as pa

    out: dict[str, pa.RecordBatch] = {}
    if not isinstance(index, Mapping):
        raise CorruptRecord(f"the table index must be a map, found {type(index).__name__}")
    for name, where in index.items():
        if not (isinstance(where, (list, tuple)) and len(where) == 2
                and all(type(x) is int for x in where)):
            raise CorruptRecord(f"table {name!r}: expected [offset, length], found {where!r}")
        off, length = where
        if off < 0 or length < 0 or off + length > len(payload):
            raise CorruptRecord(f"table {name!r} at [{off}, {off + length}) lies outside the "
                                f"{len(payload)}-byte payload")
        try:
            reader = pa.ipc.open_stream(pa.py_buffer(payload[off:off + length]))
            batches = list(reader)
        except (pa.ArrowException, OSError) as exc:  # pyarrow raises OSError for bad flatbuffers
            raise CorruptRecord(f"table {name!r} is not a valid Arrow IPC stream: {exc}") from exc
        if len(batches) != 1:
            raise CorruptRecord(f"table {name!r}: expected 1 record batch, found {len(batches)}")
        out[name] = batches[0]
    return out


def encode(kind: Kind, meta: Mapping[str, Any],
           tables: Mapping[str, Mapping[str, np.ndarray]] | None = None, *,
           run_format: int = 1) -> list[bytes]:
    """Frame a record; returns buffers to write back to back (see ``Storage.publish``).
    Its schema version is ``kind``'s in ``run_format`` (the run's, never this strawq's
    newest: ``strawq.tasks.formats``)."""
    meta = dict(meta)
    meta.setdefault("v", schema_of(run_format, kind))
    chunks: list[bytes] = []
    if tables:
        index, chunks = encode_tables(tables)
        meta["tables"] = index
    return _frame(kind, meta, chunks)


def encode_blobs(kind: Kind, meta: Mapping[str, Any],
                 blobs: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Frame a record whose payload is raw buffers the caller laid out (64-byte aligned)
    and described in ``meta`` (``strawq.delivery.packed``), written as they are, no copy. Each
    buffer must be a byte view (``len`` is its size in bytes)."""
    framed = dict(meta)
    framed.setdefault("v", SCHEMA_VERSION)
    return _frame(kind, framed, [c for c in blobs if len(c)])


def _frame(kind: Kind, meta: dict[str, Any], chunks: list[Any]) -> list[Any]:
    """Header + metadata (padded to the payload's alignment) followed by ``chunks``."""
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


def checksummed(head: bytes | memoryview, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two byte ranges of a ``size``-byte record the header's xxh3 covers (its metadata,
    then its payload; the padding between them is not covered), from its first 32 bytes:
    for a reader that checksums as it reads. A damaged header gives ranges whose checksum
    will not match, or that ``decode`` refuses."""
    _m, _f, _k, _r, meta_len, _r2, payload_len, _d = HEADER.unpack_from(head)
    meta_end = min(HEADER.size + meta_len, size)
    start = meta_end + (_pad(meta_end) if payload_len else 0)
    return (HEADER.size, meta_end), (min(start, size), size)


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
    _check_framing(name, fmt, view)
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
    _check_schema(name, kind_e, meta)
    return Record(kind_e, meta, payload)


def decode_meta_only(prefix: bytes, *, name: str = "record") -> tuple[Kind, dict[str, Any], int]:
    """Parse header + metadata from a prefix of a record (no payload checksum).

    Returns (kind, meta, bytes_needed). When the prefix is too short, meta is {} and
    bytes_needed says how much to read.
    """
    view = memoryview(prefix)
    if len(view) < HEADER.size:
        raise CorruptRecord(f"{name}: truncated header ({len(view)} bytes)")
    magic, fmt, kind, _r, meta_len, _r2, _pl, _d = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord(f"{name}: bad magic or format version")
    _check_framing(name, fmt)
    try:
        kind_e = Kind(kind)
    except ValueError:
        raise CorruptRecord(f"{name}: unknown record kind {kind}") from None
    need = HEADER.size + meta_len
    if len(view) < need:
        return kind_e, {}, need
    try:
        meta = msgpack.unpackb(view[HEADER.size:need], raw=False, strict_map_key=False)
    except Exception as exc:
        raise CorruptRecord(f"{name}: metadata is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict) or not meta:
        raise CorruptRecord(f"{name}: metadata must be a non-empty map, found {meta!r:.40}")
    if type(meta.get("v")) is int and meta["v"] > reads(kind_e):
        raise _newer(name, kind_e, meta["v"])
    return kind_e, meta, need


# -- fast path: one-batch Arrow IPC streams of fixed-width, null-free columns -----------------
#
# A group record's tables are Arrow IPC streams written by ``encode_tables``: a schema message,
# one record-batch message, the end-of-stream marker. Records of one run share their schemas,
# so the schema message is recognised by its bytes (parsed once by pyarrow, then cached) and
# the record-batch message's flatbuffer is read directly for the body buffer offsets; the
# columns are ``np.frombuffer`` views of the body. Anything unexpected (nulls, compression,
# another layout or type) returns None and the caller takes the general ``decode_tables``
# path, which decodes any valid stream and explains what is wrong with an invalid one.

_IPC_PREFIX = struct.Struct("<Ii")
_IPC_CONTINUATION = 0xFFFFFFFF
_IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_IPC_METADATA_V5 = 4
_IPC_RECORD_BATCH = 3
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_I16 = struct.Struct("<h")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_FB_SLOTS = [struct.Struct(f"<{n}H") for n in range(17)]
#: schema message bytes -> (name, dtype) per field, or None for a schema the fast path skips
_SCHEMAS: dict[bytes, _Fields | None] = {}
_SCHEMAS_MAX = 256


def _schema_fields(message: bytes) -> _Fields | None:
    """Fields of a schema message when every one is a fixed-width number (cached by bytes)."""
    import numpy as np
    import pyarrow as pa

    try:
        return _SCHEMAS[message]
    except KeyError:
        pass
    fields: _Fields | None
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(message))
        out = []
        for f in schema:
            t = f.type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                raise TypeError(f"{t} is not a fixed-width number")
            out.append((f.name, np.dtype(t.to_pandas_dtype())))
        fields = tuple(out)
        if len({name for name, _ in fields}) != len(fields):
            fields = None
    except (pa.ArrowException, OSError, TypeError, ValueError):
        fields = None
    if len(_SCHEMAS) < _SCHEMAS_MAX:
        _SCHEMAS[message] = fields
    return fields


def _fb_slots(buf: memoryview, table: int) -> tuple[int, ...]:
    """Field offsets (0 = absent) of the flatbuffer table at ``table``."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    n = (_U16.unpack_from(buf, vtable)[0] - 4) // 2
    slots: tuple[int, ...] = _FB_SLOTS[n].unpack_from(buf, vtable + 4)  # IndexError: > 16
    return slots


def _fb_vector(buf: memoryview, at: int, fmt: str) -> tuple[int, ...]:
    """A vector of 16-byte structs (two int64 each) referenced from offset field ``at``."""
    at += _U32.unpack_from(buf, at)[0]
    n = _U32.unpack_from(buf, at)[0]
    return struct.unpack_from(f"<{2 * n}{fmt}", buf, at + 4)


def _record_batch_layout(meta: memoryview) -> tuple[int, tuple[int, ...], tuple[int, ...],
                                                     int] | None:
    """(rows, nodes, buffers, body length) of an uncompressed record-batch message."""
    root = _U32.unpack_from(meta, 0)[0]
    m = _fb_slots(meta, root) + (0,) * 5
    # Message: 0 version, 1 header_type, 2 header, 3 bodyLength, 4 custom_metadata
    if not (m[0] and _I16.unpack_from(meta, root + m[0])[0] == _IPC_METADATA_V5
            and m[1] and _U8.unpack_from(meta, root + m[1])[0] == _IPC_RECORD_BATCH and m[2]):
        return None
    body_len = _I64.unpack_from(meta, root + m[3])[0] if m[3] else 0
    rb = root + m[2] + _U32.unpack_from(meta, root + m[2])[0]
    r = _fb_slots(meta, rb) + (0,) * 5
    # RecordBatch: 0 length, 1 nodes, 2 buffers, 3 compression, 4 variadicBufferCounts
    if r[3] or r[4] or not (r[1] and r[2]):
        return None
    rows = _I64.unpack_from(meta, rb + r[0])[0] if r[0] else 0
    return rows, _fb_vector(meta, rb + r[1], "q"), _fb_vector(meta, rb + r[2], "q"), body_len


def decode_ipc_columns(stream: memoryview) -> dict[str, np.ndarray] | None:
    """Zero-copy numpy views of the columns of a one-batch Arrow IPC stream.

    For streams of null-free fixed-width numeric columns (what ``encode_tables`` writes for
    numpy arrays); None for anything else — then use ``decode_tables``, which decodes every
    valid stream and says what is wrong with an invalid one. Never raises on bad bytes.
    """
    import numpy as np

    try:
        cont, size = _IPC_PREFIX.unpack_from(stream, 0)
        if cont != _IPC_CONTINUATION or size <= 0:
            return None
        schema_end = 8 + size
        fields = _schema_fields(bytes(stream[:schema_end]))
        if fields is None:
            return None
        cont, size = _IPC_PREFIX.unpack_from(stream, schema_end)
        body = schema_end + 8 + size
        if cont != _IPC_CONTINUATION or size <= 0 or body % 8:
            return None
        layout = _record_batch_layout(stream[schema_end + 8:body])
        if layout is None:
            return None
        rows, nodes, buffers, body_len = layout
        end = body + body_len
        k = len(fields)
        if (rows < 0 or body_len < 0 or end + 8 != len(stream) or len(nodes) != 2 * k
                or len(buffers) != 4 * k or stream[end:] != _IPC_EOS):
            return None
        out: dict[str, np.ndarray] = {}
        for i, (name, dtype) in enumerate(fields):
            off, length = buffers[4 * i + 2], buffers[4 * i + 3]
            if (nodes[2 * i] != rows or nodes[2 * i + 1] != 0 or off < 0
                    or length < rows * dtype.itemsize or off + length > body_len):
                return None
            out[name] = np.frombuffer(stream, dtype, count=rows, offset=body + off)
        return out
    except (struct.error, IndexError, ValueError, TypeError, OverflowError):
        return None


def decode_tables_fast(index: Mapping[str, Any],
                       payload: memoryview) -> dict[str, dict[str, np.ndarray]] | None:
    """``decode_tables`` as numpy column views, or None where ``decode_ipc_columns`` is."""
    out: dict[str, dict[str, np.ndarray]] = {}
    if not isinstance(index, Mapping):
        return None  # decode_tables says why
    try:
        for name, (off, length) in index.items():
            if off < 0 or length < 0 or off + length > len(payload):
                return None
            cols = decode_ipc_columns(payload[off:off + length])
            if cols is None:
                return None
            out[name] = cols
    except (TypeError, ValueError):
        return None
    return out
