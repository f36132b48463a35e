"""Sharding a manifest over data-parallel ranks, and packing group records into flat arrays.

Packed layout (Megatron's packed sequences, ``THD``): every sample is prompt + response,
samples are concatenated, ``cu_seqlens[i]:cu_seqlens[i+1]`` is sample i. Per-token columns
over the prompt part: ``loss_mask`` 0, ``rollout_logprobs`` 0, ``versions`` −1 (not
generated); over the response part: the recorded values.

Group records are memory-mapped and decoded in place (``strawq.records.decode`` over the
mmap, xxh3 verified over the mapped bytes); Arrow hands out zero-copy numpy views of the
columns, and each value is copied exactly once, into the packed output.
"""

from __future__ import annotations

import heapq
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from strawq import records
from strawq.errors import CorruptRecord
from strawq.groups import TOKEN_COLUMNS
from strawq.records import Kind
from strawq.storage import Storage

_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_MAX_G = 64
_PATTERN = np.tile(np.array([False, True]), _MAX_G)


def group_tokens(summary: dict[str, Any]) -> int:
    """Packed tokens of one group: G prompts plus every response."""
    lens = summary["sample_lens"]
    return int(summary["prompt_len"]) * len(lens) + int(sum(lens))


def shard_groups(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Deterministic, token-balanced split of group positions over ranks.

    Longest-processing-time greedy: groups by descending tokens (position breaks ties) go to
    the rank with the fewest tokens so far (lowest rank breaks ties). Each rank's positions
    are returned in manifest (staleness-first) order. The heaviest rank carries at most
    4/3 of the optimum.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    heap = [(0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for pos in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(pos)
        heapq.heappush(heap, (load + int(token_counts[pos]), r))
    return [sorted(x) for x in out]


def map_record(storage: Storage, key: str) -> memoryview | bytes:
    """The record's bytes: a read-only memory map where the backend has paths."""
    path = storage.local_path(key)
    if path is None:
        return storage.read(key)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        from strawq.errors import NotFound

        raise NotFound(2, f"{key}: group payload is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise CorruptRecord(f"{key}: empty file (torn write?)")
        mm = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return memoryview(mm)


def decode_columns(data: memoryview | bytes, *, key: str,
                   verify: bool) -> tuple[dict[str, Any], np.ndarray, dict[str, np.ndarray]]:
    """(summary, prompt ids, token columns) of a GROUP record: zero-copy views over ``data``.

    The lean path of ``GroupData.from_record`` with the same checks that matter here: the
    four token columns have one length, and it is the sum of ``sample_lens`` (invariant 4).
    """
    rec = records.decode(data, expect=Kind.GROUP, name=key, verify=verify)
    try:
        summary = rec.meta["group"]
        tables = records.decode_tables(rec.meta["tables"], rec.payload)
        tok = tables["tokens"]
        cols = {name: tok.column(name).to_numpy(zero_copy_only=True)
                for name in TOKEN_COLUMNS}
        prompt = tables["prompt"].column("ids").to_numpy(zero_copy_only=True)
        lens = summary["sample_lens"]
    except (KeyError, TypeError) as exc:
        raise CorruptRecord(f"{key}: group record is missing field {exc}") from exc
    n = sum(lens)
    for name, dtype in TOKEN_COLUMNS.items():
        col = cols[name]
        if col.shape != (n,) or col.dtype != dtype:
            raise CorruptRecord(f"{key}: column {name!r} is {col.dtype}{list(col.shape)}, "
                                f"expected {np.dtype(dtype)}[{n}] (the sum of sample_lens)")
    if prompt.dtype != np.int32:
        raise CorruptRecord(f"{key}: prompt ids are {prompt.dtype}, expected int32")
    return summary, prompt, cols


class Packer:
    """Preallocated packed columns for ``total_tokens`` tokens of ``num_samples`` samples."""

    def __init__(self, total_tokens: int, num_samples: int) -> None:
        self.tokens = np.empty(total_tokens, dtype=np.int32)
        # prompt positions keep these fills: logprob 0, mask 0, version -1
        self.logprobs = np.zeros(total_tokens, dtype=np.float32)
        self.versions = np.full(total_tokens, -1, dtype=np.int64)
        self.loss_mask = np.zeros(total_tokens, dtype=np.uint8)
        self.seqlens = np.empty(num_samples, dtype=np.int64)
        self.prompt_lens = np.empty(num_samples, dtype=np.int32)
        self.version_hint = np.empty(num_samples, dtype=np.int64)
        self.min_version = np.empty(num_samples, dtype=np.int64)
        self.multi_version = np.empty(num_samples, dtype=bool)
        self.pos = 0
        self.sample = 0

    def add(self, prompt: np.ndarray, sample_lens: list[int], cols: dict[str, np.ndarray],
            version_hint: int) -> None:
        """Append one group: G × (prompt, response_i), one vectorised write per column."""
        p = int(prompt.shape[0])
        g = len(sample_lens)
        runs = np.empty(2 * g, dtype=np.int64)
        runs[0::2] = p
        runs[1::2] = sample_lens
        total = int(runs.sum())
        a = self.pos
        resp = np.repeat(_PATTERN[:2 * g] if g <= _MAX_G else np.tile([False, True], g),
                         runs)
        self.tokens[a:a + total][resp] = cols["tokens"]
        self.tokens[a:a + total][~resp] = np.tile(prompt, g)
        self.logprobs[a:a + total][resp] = cols["logprobs"]
        self.versions[a:a + total][resp] = cols["versions"]
        self.loss_mask[a:a + total][resp] = cols["loss_mask"]
        s = self.sample
        self.seqlens[s:s + g] = runs[1::2]
        self.seqlens[s:s + g] += p
        self.prompt_lens[s:s + g] = p
        self.version_hint[s:s + g] = version_hint
        self._versions_of(cols["versions"], runs[1::2], s, version_hint)
        self.pos, self.sample = a + total, s + g

    def _versions_of(self, vers: np.ndarray, lens: np.ndarray, s: int, hint: int) -> None:
        """Per-sample min version and multi-version flag from the record's own column."""
        g = lens.shape[0]
        if vers.size == 0:
            self.min_version[s:s + g] = hint
            self.multi_version[s:s + g] = False
            return
        starts = np.zeros(g, dtype=np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        idx = np.minimum(starts, vers.size - 1)
        lo = np.minimum.reduceat(vers, idx)
        hi = np.maximum.reduceat(vers, idx)
        empty = lens == 0
        self.min_version[s:s + g] = np.where(empty, hint, lo)
        self.multi_version[s:s + g] = ~empty & (hi != lo)

    def finish(self) -> None:
        """Trim to what was added (groups skipped as corrupt leave a shorter batch)."""
        for name in ("tokens", "logprobs", "versions", "loss_mask"):
            setattr(self, name, getattr(self, name)[:self.pos])
        for name in ("seqlens", "prompt_lens", "version_hint", "min_version",
                     "multi_version"):
            setattr(self, name, getattr(self, name)[:self.sample])
