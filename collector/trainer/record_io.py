"""Reading group records and packed shards into aligned, reused memory.

Two readers of whole files, each one ``preadv`` into 64-byte aligned memory: ``RecordFile``
(a group record, into one reused buffer: the packing hot path,
``strawq.collector.trainer.packing``) and ``read_file`` (a packed shard or a record, into a
``BufferPool`` buffer the batch's tensors are then views of, its xxh3 streamed over
``READ_CHUNK`` pieces while they are in cache). ``allocate_buffer`` maps large buffers on
transparent huge pages; ``BufferPool`` reuses a shard's memory once no batch references it.
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import Any

import numpy as np
import xxhash

from strawq.errors import CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.storage import Storage

#: the alignment of every buffer and packed column (a cache line)
ALIGN = 64
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class RecordFile:
    """Reads whole records into one reused, 64-byte aligned buffer (not thread-safe).

    The returned view is valid until the next ``read``. Backends without local paths fall
    back to ``Storage.read`` (a fresh ``bytes``).
    """

    def __init__(self, capacity: int = 1 << 20) -> None:
        self._raw = np.empty(0, dtype=np.uint8)
        self._buf = self._raw.data
        self._grow(capacity)

    def _grow(self, size: int) -> None:
        raw = np.empty(size + ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % ALIGN
        self._raw = raw
        self._buf = raw[skip:skip + size].data

    def read(self, storage: Storage, key: str) -> memoryview | bytes:
        path = storage.local_path(key)
        if path is None:
            return storage.read(key)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise NotFound(2, f"{key}: group payload is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise CorruptRecord(f"{key}: empty file (torn write?)")
            if size > len(self._buf):
                self._grow(max(size, 2 * len(self._buf)))
            got = 0
            while got < size:  # one call for a regular file; loop for the odd short read
                n = os.preadv(fd, [self._buf[got:size]], got)
                if n == 0:
                    raise CorruptRecord(f"{key}: file shrank to {got} of {size} bytes "
                                        "while read")
                got += n
        finally:
            os.close(fd)
        return self._buf[:size]


#: buffers from this size on are mapped on their own, on transparent huge pages
_HUGE = 2 << 20


def allocate_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes``; from 2 MiB on an anonymous mapping, 2 MiB aligned and
    advised onto transparent huge pages where the kernel has them (``madvise`` mode).

    Filling a reused 12 MB buffer with 4 KiB pages read at a third of the speed of
    ``numpy.fromfile`` into fresh memory here (a TLB miss every 4 KiB on a shared host);
    on huge pages it reads as fast or faster (bench/collector.py).
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE or advice is None:
        return np.empty(nbytes, dtype=np.uint8)
    mm = mmap.mmap(-1, nbytes + _HUGE)
    try:
        mm.madvise(advice)
    except OSError:  # no THP on this kernel: ordinary pages
        pass
    whole = np.frombuffer(mm, dtype=np.uint8)
    skip = -whole.ctypes.data % _HUGE
    return whole[skip:skip + nbytes]


class BufferPool:
    """Reuses the memory of packed shards once nothing references the batch built on it.

    A fresh shard's outputs (~21 bytes per token) are new pages: first-touch page faults
    cost as much as the copies that fill them (~1.3 ms per 4.7 MB here). A batch's tensors
    are views of one pool buffer (``torch.from_numpy`` keeps the numpy view, the view keeps
    the buffer); a buffer whose only references are the pool's is free again. ``keep``
    buffers at most are kept (a trainer holds one batch while the next is read: 2).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._bufs: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` that nothing else references."""
        for i in range(len(self._bufs)):
            # the list's reference and getrefcount's argument: nothing else holds it
            if self._bufs[i].nbytes >= nbytes and sys.getrefcount(self._bufs[i]) <= 2:
                return self._bufs[i]
        buf = allocate_buffer(nbytes + nbytes // 8)  # room to grow a little
        free = [i for i in range(len(self._bufs)) if sys.getrefcount(self._bufs[i]) <= 2]
        if len(self._bufs) >= self.keep and free:
            del self._bufs[free[0]]
        if len(self._bufs) < self.keep:
            self._bufs.append(buf)
        return buf


#: bytes read per ``preadv`` by ``read_file`` when it checksums as it reads: the xxh3 of
#: each piece runs while the piece is still in cache
READ_CHUNK = 1 << 20


def read_file(storage: Storage, key: str, pool: BufferPool, *,
              checksum: bool = False) -> tuple[np.ndarray, int | None]:
    """The whole of record ``key`` in a pool buffer, 64-byte aligned, and with ``checksum``
    the xxh3-64 of the ranges its header's checksum covers (``records.checksummed``),
    streamed over ``READ_CHUNK`` pieces as they are read so the hash reads from cache. The
    array is exactly the file. Backends without local paths copy ``Storage.read`` into it."""
    path = storage.local_path(key)
    if path is None:
        data = storage.read(key)
        buf = pool.take(len(data) + ALIGN)
        skip = -buf.ctypes.data % ALIGN
        out = buf[skip:skip + len(data)]
        out[:] = np.frombuffer(data, dtype=np.uint8)
        return out, _digest(out, 0, out.shape[0], None) if checksum else None
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise NotFound(2, f"{key}: missing") from None
    h = xxhash.xxh3_64() if checksum else None
    ranges = None
    try:
        size = os.fstat(fd).st_size
        buf = pool.take(size + ALIGN)
        skip = -buf.ctypes.data % ALIGN
        out = buf[skip:skip + size]
        got = 0
        step = READ_CHUNK if h is not None else max(size, 1)
        while got < size:
            n = os.preadv(fd, [out[got:min(got + step, size)].data], got)
            if n == 0:
                raise CorruptRecord(f"{key}: file shrank to {got} of {size} bytes while read")
            if h is not None and (ranges is not None or got + n >= records.HEADER.size):
                ranges = ranges or records.checksummed(out[:records.HEADER.size].data, size)
                _digest(out, got, got + n, h, ranges)
            got += n
    finally:
        os.close(fd)
    return out, (h.intdigest() if h is not None else None)


def _digest(out: np.ndarray, lo: int, hi: int, h: Any,
            ranges: tuple[tuple[int, int], ...] | None = None) -> int:
    """Feed the part of ``out[lo:hi]`` inside the checksummed ``ranges`` to ``h`` (a fresh
    hash over the whole record's ranges when ``h`` is None); returns the digest so far."""
    if h is None:
        h = xxhash.xxh3_64()
        if out.shape[0] < records.HEADER.size:
            return int(h.intdigest())
        ranges = records.checksummed(out[:records.HEADER.size].data, out.shape[0])
    assert ranges is not None
    for a, b in ranges:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            h.update(out[a:b].data)
    return int(h.intdigest())
