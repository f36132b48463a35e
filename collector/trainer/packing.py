"""Sharding a manifest over data-parallel ranks, and packing group records into flat arrays.

Packed layout (Megatron's packed sequences, ``THD``): every sample is prompt + response,
samples are concatenated, ``cu_seqlens[i]:cu_seqlens[i+1]`` is sample i. Per-token columns
over the prompt part: ``loss_mask`` 0, ``rollout_logprobs`` 0, ``versions`` −1 (not
generated); over the response part: the recorded values.

The hot path, per group record: one ``preadv`` of the whole file into a reused, 64-byte
aligned buffer (``RecordFile``, ``strawq.collector.trainer.record_io``), xxh3 over it, the
Arrow IPC streams read as numpy views
(``strawq.ondisk.groups.decode_group_columns``: cached schemas, no pyarrow objects), and one
slice copy per sample and column into the packed output (``ShardPacker.add``), prompts
included. Everything that does not depend on the payload — the layout of the output, the
per-sample arrays — is computed once per shard from the manifest summaries, vectorised.
Each payload byte is copied twice (file → buffer, buffer → packed column); the buffer stays
in cache between the two.

The same packing runs in the collector when it packs rank shards (``pack_batch``,
``CollectorConfig.pack_ranks``): ``read_groups`` and ``shard_arrays`` give the arrays of a
rank's ``Batch`` (numpy only: the collector never imports torch), written as one PACKED
record per rank (``strawq.delivery.packed``) that the reader loads with one read
(``record_io.read_file``).

Per-token extras (``strawq.ondisk.extras``) are packed like ``logprobs``: ``extras[name]`` is
``[T, *row shape]`` over the packed tokens — a prompt extra (routed experts) holds its
record's rows over the prompt too, a response extra the placeholder value (0) there; a
group recorded without an extra another group of the shard has gets placeholder rows (−1
for routed experts). A ragged extra (top-p kept ids) is its flat values plus
``extras[offsets_name(name)]`` int64 [T + 1] (no kept ids over prompts).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strawq.collector.trainer.behaviour import sampling_columns
from strawq.collector.trainer.record_io import ALIGN as _ALIGN

# the record reads' names, where they were first defined
from strawq.collector.trainer.record_io import READ_CHUNK as READ_CHUNK
from strawq.collector.trainer.record_io import BufferPool, RecordFile
from strawq.collector.trainer.record_io import allocate_buffer as allocate_buffer
from strawq.collector.trainer.record_io import read_file as read_file
from strawq.delivery import packed
from strawq.errors import CorruptRecord, NotFound
from strawq.ondisk.extras import Extra, ExtraError, spec_of
from strawq.ondisk.groups import decode_group_columns
from strawq.ondisk.names import TaskName, data_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)


def group_tokens(summary: dict[str, Any]) -> int:
    """Packed tokens of one group: G prompts plus every response."""
    lens = summary["sample_lens"]
    return int(summary["prompt_len"]) * len(lens) + int(sum(lens))


def manifest_totals(summaries: Sequence[dict[str, Any]]) -> tuple[int, int | None]:
    """Samples and trained tokens of a whole manifest (None: a group without ``loss_tokens``).

    Every rank computes the same figures from the manifest alone (no payload read), so the
    loss denominators are the batch's, not the shard's (docs/design.md, invariant 11). A
    group dropped at read time as corrupt stays counted: its share of the loss is missing
    on every path alike, the rest of the gradient is unchanged.
    """
    samples = sum(len(s["sample_lens"]) for s in summaries)
    tokens = 0
    for s in summaries:
        lt = s.get("loss_tokens")
        if lt is None or len(lt) != len(s["sample_lens"]):
            return samples, None
        tokens += int(sum(lt))
    return samples, tokens


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


def _carve(buf: np.ndarray | None, total: int,
           spec: Sequence[tuple[str, np.dtype[Any]]]) -> dict[str, np.ndarray]:
    """Arrays of ``total`` elements of each dtype, 64-byte aligned, inside ``buf`` (or new)."""
    if buf is None:
        return {name: np.empty(total, dtype=dt) for name, dt in spec}
    out: dict[str, np.ndarray] = {}
    off = -buf.ctypes.data % _ALIGN
    for name, dt in spec:
        size = total * dt.itemsize
        out[name] = buf[off:off + size].view(dt)
        off += size + (-size % _ALIGN)
    return out


def packed_nbytes(total: int) -> int:
    """Bytes ``ShardPacker`` carves for ``total`` tokens (with alignment slack)."""
    return sum(total * dt.itemsize + _ALIGN for _, dt in _COLUMNS) + _ALIGN


_COLUMNS: tuple[tuple[str, np.dtype[Any]], ...] = (
    ("versions", np.dtype(np.int64)), ("tokens", np.dtype(np.int32)),
    ("logprobs", np.dtype(np.float32)), ("advantages", np.dtype(np.float32)),
    ("loss_mask", np.dtype(np.uint8)))


def offsets_name(name: str) -> str:
    """The key of a ragged extra's packed offsets: ``top_p_token_ids`` → ``…_offsets``."""
    return f"{name.removesuffix('_ids')}_offsets"


def _extra_layout(summaries: Sequence[dict[str, Any]]) -> dict[str, tuple[tuple[int, ...],
                                                                          bool]]:
    """name -> (row shape, ragged) of every known extra in the summaries (first one wins)."""
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for s in summaries:
        for name, info in (s.get("extras") or {}).items():
            try:
                spec_of(name)
            except ExtraError:
                continue  # a record with it fails its decode: dropped there
            if name not in out or (not out[name][0] and info.get("shape")):
                out[name] = (tuple(int(d) for d in info.get("shape") or ()),
                             bool(info.get("ragged")))
    return out


class ShardPacker:
    """Packed columns of a rank's groups, laid out from their manifest summaries.

    ``add(k, ...)`` copies group ``k``'s record columns into its slot and fills its prompts
    (any order; each group at most once); ``finish()`` drops the slots of groups that were
    not added (corrupt or missing records) and computes the per-sample version statistics.

    The copies are plain slices, one per sample and column: a boolean-mask scatter
    (``out[a:b][mask] = column``) costs ~15 ns per token, more than reading the record, and
    mask passes over the whole shard in ``finish`` as much again.
    """

    def __init__(self, summaries: Sequence[dict[str, Any]],
                 pool: BufferPool | None = None) -> None:
        self.num_groups = len(summaries)
        self.group_samples = np.array([len(s["sample_lens"]) for s in summaries],
                                      dtype=np.int64)
        self._gp = [int(s["prompt_len"]) for s in summaries]
        self.group_prompt = np.array(self._gp, dtype=np.int64)
        self.hints = np.array([int(s.get("min_version", 0)) for s in summaries],
                              dtype=np.int64)
        self.sample_lens = [[int(n) for n in s["sample_lens"]] for s in summaries]
        resp = np.array([n for lens in self.sample_lens for n in lens], dtype=np.int64)
        self.prompt_lens = np.repeat(self.group_prompt, self.group_samples)
        self.seqlens = self.prompt_lens + resp
        sizes = [p * len(lens) + sum(lens) for p, lens in zip(self._gp, self.sample_lens,
                                                             strict=True)]
        self.bounds = np.zeros(self.num_groups + 1, dtype=np.int64)
        np.cumsum(np.array(sizes, dtype=np.int64), out=self.bounds[1:])
        self._bounds = self.bounds.tolist()
        total = int(self.bounds[-1])
        # Every position is written by ``add``: prompt positions get the prompt ids, log-prob
        # 0, version -1 and mask 0; response positions the record's columns. ``advantages``:
        # each sample's advantage on every one of its tokens (from the summaries; zeros for
        # a manifest written without advantages).
        cols = _carve(pool.take(packed_nbytes(total)) if pool is not None else None, total,
                      _COLUMNS)
        self.tokens = cols["tokens"]
        self.logprobs = cols["logprobs"]
        self.versions = cols["versions"]
        self.loss_mask = cols["loss_mask"]
        self.advantages = cols["advantages"]
        self._adv = [[float(a) for a in s.get("advantages", [])] for s in summaries]
        self._adv = [a if len(a) == len(lens) else [0.0] * len(lens)
                     for a, lens in zip(self._adv, self.sample_lens, strict=True)]
        self._added = [False] * self.num_groups
        #: per-token extras over the packed tokens (ragged: counts here, values by group)
        self.extra_layout = _extra_layout(summaries)
        self.extras: dict[str, np.ndarray] = {}
        self._ragged: dict[str, dict[int, np.ndarray]] = {}
        for name, (shape, ragged) in self.extra_layout.items():
            spec = spec_of(name)
            if ragged:
                self.extras[name] = np.zeros(total, dtype=np.int32)  # counts until finish
                self._ragged[name] = {}
            else:
                self.extras[name] = np.empty((total, *shape), dtype=spec.dtype)

    def check(self, k: int, prompt: np.ndarray, sample_lens: Sequence[int], key: str) -> None:
        """The record agrees with its manifest summary (else ``CorruptRecord``)."""
        if list(sample_lens) != self.sample_lens[k]:
            raise CorruptRecord(f"{key}: sample_lens {list(sample_lens)} differ from the "
                                f"manifest's {self.sample_lens[k]}")
        if prompt.shape[0] != self._gp[k]:
            raise CorruptRecord(f"{key}: prompt has {prompt.shape[0]} tokens, the manifest "
                                f"says {self._gp[k]}")

    def check_extras(self, extras: dict[str, Extra], key: str) -> None:
        """The record's extras fit the shard's layout (else ``CorruptRecord``)."""
        for name, x in extras.items():
            if name not in self.extra_layout:
                raise CorruptRecord(f"{key}: extra {name!r} is not in the manifest's summary")
            shape, ragged = self.extra_layout[name]
            if x.ragged != ragged or (not ragged and x.shape != shape):
                raise CorruptRecord(f"{key}: extra {name!r} has rows of {list(x.shape)}"
                                    f"{' (ragged)' if x.ragged else ''}, the shard's other "
                                    f"groups {list(shape)}{' (ragged)' if ragged else ''}")

    def add_extras(self, k: int, extras: dict[str, Extra]) -> None:
        """Copy group ``k``'s extras into place (after ``check_extras``); placeholders for
        the extras it lacks."""
        p = self._gp[k]
        for name, out in self.extras.items():
            spec = spec_of(name)
            x = extras.get(name)
            a, b = self._bounds[k], self._bounds[k + 1]
            if x is None:
                out[a:b] = 0 if name in self._ragged else spec.fill
                continue
            rows = x.values
            if name in self._ragged and x.counts is not None:
                self._ragged[name][k] = np.array(x.values)  # the record buffer is reused
                rows = x.counts
            if spec.prompt:
                out[a:b] = rows
                continue
            o, src = a, 0
            for r in self.sample_lens[k]:
                d = o + p
                out[o:d] = 0 if name in self._ragged else spec.fill
                out[d:d + r] = rows[src:src + r]
                src += r
                o = d + r

    def add(self, k: int, prompt: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        """Copy group ``k``'s prompt and response columns into place (after ``check``)."""
        tok, lp, ver, lm = (cols["tokens"], cols["logprobs"], cols["versions"],
                            cols["loss_mask"])
        out_tok, out_lp, out_ver, out_lm = self.tokens, self.logprobs, self.versions, \
            self.loss_mask
        out_adv = self.advantages
        p = self._gp[k]
        o = self._bounds[k]
        src = 0
        for r, adv in zip(self.sample_lens[k], self._adv[k], strict=True):
            d = o + p
            e = d + r
            out_tok[o:d] = prompt
            out_lp[o:d] = 0
            out_ver[o:d] = -1
            out_lm[o:d] = 0
            out_adv[o:e] = adv
            out_tok[d:e] = tok[src:src + r]
            out_lp[d:e] = lp[src:src + r]
            out_ver[d:e] = ver[src:src + r]
            out_lm[d:e] = lm[src:src + r]
            src += r
            o = e
        self._added[k] = True

    def finish(self) -> np.ndarray:
        """Compaction over the groups not added; returns the mask of those added."""
        ok = np.array(self._added, dtype=bool)
        if not ok.all():
            keep_tok = np.repeat(ok, np.diff(self.bounds))
            keep_sample = np.repeat(ok, self.group_samples)
            for name in ("tokens", "logprobs", "versions", "loss_mask", "advantages"):
                setattr(self, name, getattr(self, name)[keep_tok])
            self.extras = {n: x[keep_tok] for n, x in self.extras.items()}
            for name in ("seqlens", "prompt_lens"):
                setattr(self, name, getattr(self, name)[keep_sample])
            self.group_samples = self.group_samples[ok]
            self.hints = self.hints[ok]
        self.sample_advantages = np.array([x for k, a in enumerate(self._adv) if ok[k]
                                           for x in a], dtype=np.float32)
        self.min_version, self.multi_version = self._sample_versions()
        for name, parts in self._ragged.items():
            counts = self.extras.pop(name)
            values = [parts[k] for k in sorted(parts) if ok[k]]
            self.extras[name] = np.concatenate(values) if values else np.zeros(0, np.int32)
            off = np.zeros(counts.shape[0] + 1, dtype=np.int64)
            np.cumsum(counts, out=off[1:])
            self.extras[offsets_name(name)] = off
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


# -- a rank's shard, from the records ------------------------------------------------------------
def read_groups(storage: Storage, pk: ShardPacker, keys: Sequence[str], part: Sequence[int],
                file: RecordFile, *, verify: bool = True
                ) -> tuple[int, list[tuple[int, Exception]]]:
    """Read, verify, decode and pack groups ``part`` of a shard (one thread's share).

    Returns the bytes read and the groups that failed their checks (the caller drops them,
    or, packing for the trainer in the collector, leaves the shard to the records). Threads
    write disjoint slots of the packed columns; file reads, xxh3 and the numpy copies
    release the GIL.
    """
    nbytes = 0
    failed: list[tuple[int, Exception]] = []
    for k in part:
        try:
            data = file.read(storage, keys[k])
            nbytes += len(data)
            g = decode_group_columns(data, name=keys[k], expect=Kind.GROUP, verify=verify)
            pk.check(k, g.prompt, g.summary["sample_lens"], keys[k])
            if g.extras or pk.extras:
                pk.check_extras(g.extras, keys[k])
            pk.add(k, g.prompt, g.columns)
            if pk.extras:
                pk.add_extras(k, g.extras)
        except (CorruptRecord, NotFound, ValueError) as exc:
            failed.append((k, exc))
    return nbytes, failed


#: ``Batch`` fields of a rank's shard that do not depend on when it is read, in the order a
#: PACKED record holds them (``extras/<name>`` after them); ``multi_version`` (bool [S]:
#: a sample's response spans more than one version) feeds the staleness figures
SHARD_ARRAYS = ("tokens", "cu_seqlens", "loss_mask", "rollout_logprobs", "versions",
                "advantages", "rewards", "sample_advantages", "prompt_lens", "response_lens",
                "sample_group", "sample_index", "sample_min_version", "multi_version",
                "temperature", "top_p", "top_k")
EXTRA_PREFIX = "extras/"


def shard_arrays(pk: ShardPacker, summaries: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Every array of a rank's ``Batch`` that does not depend on the read-time version,
    from a finished ``ShardPacker`` and the summaries of the groups it holds."""
    nsamples = pk.seqlens.shape[0]
    rewards = np.array([0.0 if r is None else r for s in summaries for r in s["rewards"]],
                       dtype=np.float32)
    sgroup = np.repeat(np.arange(len(summaries), dtype=np.int64),
                       [len(s["sample_lens"]) for s in summaries])
    sindex = np.array([s["index"] for s in summaries], dtype=np.int64)[sgroup] \
        if summaries else np.empty(0, dtype=np.int64)
    cu = np.zeros(nsamples + 1, dtype=np.int32)
    np.cumsum(pk.seqlens, out=cu[1:])
    out = {"tokens": pk.tokens, "cu_seqlens": cu, "loss_mask": pk.loss_mask,
           "rollout_logprobs": pk.logprobs, "versions": pk.versions,
           "advantages": pk.advantages, "rewards": rewards,
           "sample_advantages": pk.sample_advantages,  # zeros without manifest advantages
           "prompt_lens": pk.prompt_lens.astype(np.int32),
           "response_lens": (pk.seqlens - pk.prompt_lens).astype(np.int32),
           "sample_group": sgroup, "sample_index": sindex,
           "sample_min_version": pk.min_version, "multi_version": pk.multi_version,
           **sampling_columns(summaries)}
    out.update({EXTRA_PREFIX + k: v for k, v in pk.extras.items()})
    return out


@dataclass
class PackReport:
    """What packing one batch's rank shards cost the collector (``pack_batch``)."""

    #: the manifest's ``meta["packed"]``: world size, tag, the ranks whose shard was written
    meta: dict[str, Any] = field(default_factory=dict)
    #: bytes of shards written, of group records read, and seconds spent (read, pack, write)
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


def pack_batch(storage: Storage, seq: int, names: Sequence[TaskName],
               summaries: Sequence[dict[str, Any]], world_size: int, *,
               file: RecordFile | None = None, pool: BufferPool | None = None) -> PackReport:
    """Write batch ``seq``'s shard for each rank of ``world_size`` (``strawq.delivery.packed``), as
    ``BatchReader.load`` would pack it from these records, before the manifest is published.

    A rank whose groups do not all read cleanly gets no shard: its reader reads the records
    and drops the bad group with its reason, as without packing. The shards' directory is
    fsync'd once, after the last, so a published manifest never names a shard a power cut
    could undo.
    """
    t0 = time.perf_counter()
    file = file if file is not None else RecordFile()
    tag = packed.new_tag()
    positions = shard_groups([group_tokens(s) for s in summaries], world_size)
    total_samples, total_loss_tokens = manifest_totals(summaries)
    rep = PackReport()
    ranks: list[int] = []
    for rank, mine in enumerate(positions):
        mine_summ = [summaries[i] for i in mine]
        pk = ShardPacker(mine_summ, pool)
        keys = [data_key(names[i].id, names[i].gen, "group") for i in mine]
        nbytes, failed = read_groups(storage, pk, keys, range(len(keys)), file)
        rep.bytes_read += nbytes
        if failed:
            log.warning("batch %d: rank %d of %d gets no packed shard: %s (its reader reads "
                        "the records and drops the group)", seq, rank, world_size,
                        "; ".join(str(exc) for _, exc in failed[:3]))
            continue
        pk.finish()
        info = {"seq": seq, "tag": tag, "world_size": world_size, "rank": rank,
                "sharding": packed.SHARDING, "positions": list(mine),
                "groups": [f"{names[i].id}~g{names[i].gen}" for i in mine],
                "total_samples": total_samples, "total_loss_tokens": total_loss_tokens,
                "record_bytes": nbytes}
        chunks = packed.encode_shard(info, shard_arrays(pk, mine_summ))
        storage.publish(packed.shard_key(seq, tag, world_size, rank), chunks, sync_dir=False)
        rep.bytes_written += sum(len(c) for c in chunks)
        ranks.append(rank)
        del pk, chunks  # the pool buffer is free for the next rank
    if ranks:
        storage.sync_dirs([packed.PACKED_DIR])
    rep.meta = {"world_size": world_size, "tag": tag, "ranks": ranks}
    rep.seconds = time.perf_counter() - t0
    return rep
