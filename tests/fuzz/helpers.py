"""What every decoder fuzz test asserts: success, or a project error saying why."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import xxhash

from strawq.errors import StrawqError
from strawq.ondisk import records

T = TypeVar("T")


def clean(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | StrawqError:
    """``fn(*args)``'s result, or the ``StrawqError`` it raised; any other exception fails."""
    try:
        return fn(*args, **kwargs)
    except StrawqError as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return exc


def frame(kind: int, meta: bytes, payload: bytes = b"", *, fmt: int = records.FORMAT_VERSION
          ) -> bytes:
    """A record with a *valid* header and checksum around arbitrary metadata bytes and
    payload: what a writer with access to the run directory can publish."""
    h = xxhash.xxh3_64()
    h.update(meta)
    h.update(payload)
    head = records.HEADER.pack(records.MAGIC, fmt, kind, 0, len(meta), 0, len(payload),
                               h.intdigest()) + meta
    if payload:
        head += b"\0" * records._pad(len(head))
    return head + payload


def frame_meta(kind: int, meta: Any, payload: bytes = b"") -> bytes:
    return frame(kind, msgpack.packb(meta, use_bin_type=True), payload)


def header_with(data: bytes, **fields: int) -> bytes:
    """``data`` with header fields replaced (the checksum left as it was)."""
    names = ("magic", "fmt", "kind", "r", "meta_len", "r2", "payload_len", "digest")
    values = dict(zip(names, records.HEADER.unpack_from(data), strict=True))
    values.update(fields)
    return records.HEADER.pack(*values.values()) + data[records.HEADER.size:]


_ = struct
