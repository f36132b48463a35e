"""Sharding a manifest over data-parallel ranks, and packing group records into flat arrays.

Packed layout (Megatron's packed sequences, ``THD``): every sample is prompt + response,
samples are concatenated, ``cu_seqlens[i]:cu_seqlens[i+1]`` is sample i. Per-token columns
over the prompt part: ``loss_mask`` 0, ``rollout_logprobs`` 0, ``versions`` −1 (not
generated); over the response part: the recorded values.

The hot path, per group record: one ``preadv`` of the whole file into a reused, 64-byte
aligned buffer (``RecordFile``), xxh3 over it, the Arrow IPC streams read as numpy views
(``strawq.groups.decode_group_columns``: cached schemas, no pyarrow objects), and one
masked copy per column into the packed output (``ShardPacker.add``). Everything that does
not depend on the payload — the layout of the output, the prompt/response masks, the
per-sample arrays — is computed once per shard from the manifest summaries, vectorised.
Each payload byte is copied twice (file → buffer, buffer → packed column); the buffer stays
in cache between the two.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from strawq.errors import CorruptRecord, NotFound
from strawq.storage import Storage

_ALIGN = 64
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


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
        raw = np.empty(size + _ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % _ALIGN
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


class ShardPacker:
    """Packed columns of a rank's groups, laid out from their manifest summaries.

    ``add(k, ...)`` copies group ``k``'s record columns into its slot (any order; each group
    at most once); ``finish(ok)`` fills the prompts, drops the slots of groups that were not
    added (corrupt or missing records) and computes the per-sample version statistics.
    """

    def __init__(self, summaries: Sequence[dict[str, Any]]) -> None:
        self.num_groups = len(summaries)
        self.group_samples = np.array([len(s["sample_lens"]) for s in summaries],
                                      dtype=np.int64)
        self.group_prompt = np.array([int(s["prompt_len"]) for s in summaries], dtype=np.int64)
        self.hints = np.array([int(s.get("min_version", 0)) for s in summaries],
                              dtype=np.int64)
        self.sample_lens = [list(s["sample_lens"]) for s in summaries]
        resp = np.array([n for lens in self.sample_lens for n in lens], dtype=np.int64)
        nsamples = resp.shape[0]
        self.prompt_lens = np.repeat(self.group_prompt, self.group_samples)
        self.seqlens = self.prompt_lens + resp
        runs = np.empty(2 * nsamples, dtype=np.int64)
        runs[0::2] = self.prompt_lens
        runs[1::2] = resp
        #: True over response tokens, False over prompts, for the whole shard
        self.resp_mask = np.repeat(np.tile(np.array([False, True]), nsamples), runs)
        self.bounds = np.zeros(self.num_groups + 1, dtype=np.int64)
        np.cumsum(np.array([group_tokens(s) for s in summaries], dtype=np.int64),
                  out=self.bounds[1:])
        self._bounds = self.bounds.tolist()
        total = int(self.bounds[-1])
        self.tokens = np.empty(total, dtype=np.int32)
        self.logprobs = np.empty(total, dtype=np.float32)
        self.versions = np.empty(total, dtype=np.int64)
        self.loss_mask = np.empty(total, dtype=np.uint8)
        self._prompts: list[np.ndarray | None] = [None] * self.num_groups

    def check(self, k: int, prompt: np.ndarray, sample_lens: Sequence[int], key: str) -> None:
        """The record agrees with its manifest summary (else ``CorruptRecord``)."""
        if list(sample_lens) != self.sample_lens[k]:
            raise CorruptRecord(f"{key}: sample_lens {list(sample_lens)} differ from the "
                                f"manifest's {self.sample_lens[k]}")
        if prompt.shape[0] != self.group_prompt[k]:
            raise CorruptRecord(f"{key}: prompt has {prompt.shape[0]} tokens, the manifest "
                                f"says {int(self.group_prompt[k])}")

    def add(self, k: int, prompt: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        """Copy group ``k``'s response columns into place (after ``check``)."""
        a, b = self._bounds[k], self._bounds[k + 1]
        m = self.resp_mask[a:b]
        self.tokens[a:b][m] = cols["tokens"]
        self.logprobs[a:b][m] = cols["logprobs"]
        self.versions[a:b][m] = cols["versions"]
        self.loss_mask[a:b][m] = cols["loss_mask"]
        self._prompts[k] = np.array(prompt)  # a copy: the record's buffer is reused

    def finish(self) -> np.ndarray:
        """Prompt fills, then compaction over the groups not added; returns their mask."""
        ok = np.array([p is not None for p in self._prompts], dtype=bool)
        prompts = [p if p is not None else np.zeros(n, dtype=np.int32)
                   for p, n in zip(self._prompts, self.group_prompt.tolist(), strict=True)]
        pm = ~self.resp_mask
        self.logprobs[pm] = 0
        self.versions[pm] = -1
        self.loss_mask[pm] = 0
        if prompts:
            # prompt token j of sample s comes from its group's prompt: source index =
            # (group's offset in the concatenated prompts) + (position within the prompt)
            flat = np.concatenate(prompts)
            poff = np.zeros(self.num_groups, dtype=np.int64)
            np.cumsum(self.group_prompt[:-1], out=poff[1:])
            pstart = np.zeros(self.prompt_lens.shape[0], dtype=np.int64)
            np.cumsum(self.prompt_lens[:-1], out=pstart[1:])
            shift = np.repeat(np.repeat(poff, self.group_samples) - pstart, self.prompt_lens)
            self.tokens[pm] = flat[np.arange(shift.shape[0], dtype=np.int64) + shift]
        if not ok.all():
            keep_tok = np.repeat(ok, np.diff(self.bounds))
            keep_sample = np.repeat(ok, self.group_samples)
            for name in ("tokens", "logprobs", "versions", "loss_mask", "resp_mask"):
                setattr(self, name, getattr(self, name)[keep_tok])
            for name in ("seqlens", "prompt_lens"):
                setattr(self, name, getattr(self, name)[keep_sample])
            self.group_samples = self.group_samples[ok]
            self.hints = self.hints[ok]
        self.min_version, self.multi_version = self._sample_versions()
        return ok

    def _sample_versions(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample min version over its response (the group's hint when empty) and
        whether the response spans more than one version."""
        hint = np.repeat(self.hints, self.group_samples)
        n = self.seqlens.shape[0]
        total = self.versions.shape[0]
        if n == 0 or total == 0:
            return hint, np.zeros(n, dtype=bool)
        ends = np.cumsum(self.seqlens)
        starts = ends - (self.seqlens - self.prompt_lens)  # response starts
        # reduceat over [start_0, end_0, start_1, end_1, ...): the even results are the
        # responses, the odd ones (the next prompt) are discarded. Indices equal to ``total``
        # (a suffix: they are non-decreasing) are cut; the last index kept reduces to the end.
        idx = np.empty(2 * n, dtype=np.int64)
        idx[0::2] = starts
        idx[1::2] = ends
        idx = idx[:int(np.searchsorted(idx, total))]
        lo, hi = hint.copy(), hint.copy()
        if idx.shape[0]:
            r_lo = np.minimum.reduceat(self.versions, idx)[0::2]
            r_hi = np.maximum.reduceat(self.versions, idx)[0::2]
            lo[:r_lo.shape[0]] = r_lo
            hi[:r_hi.shape[0]] = r_hi
        empty = self.seqlens == self.prompt_lens
        return np.where(empty, hint, lo), ~empty & (hi != lo)
