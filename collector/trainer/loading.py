"""Loading a rank's shard of a batch: the ``Batch`` a trainer gets, read from the shard the
collector packed for this rank (``CollectorConfig.pack_ranks``) or packed here from the
group records (read, verify, decode, copy; ``strawq.collector.trainer.packing``). A packed
shard that does not check out against its manifest is not used: the records are read
instead (logged). A group whose record fails its checks is quarantined and dropped, and
the batch goes on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strawq.collector.trainer.behaviour import read_time_staleness
from strawq.collector.trainer.importance import LossTotals
from strawq.collector.trainer.packing import (
    EXTRA_PREFIX,
    SHARD_ARRAYS,
    ShardPacker,
    group_tokens,
    manifest_totals,
    read_groups,
    shard_arrays,
    shard_groups,
)
from strawq.collector.trainer.record_io import BufferPool, RecordFile, read_file
from strawq.delivery import packed
from strawq.delivery.batches import BatchStore, Manifest
from strawq.errors import ConfigError, CorruptRecord, NotFound
from strawq.ondisk.groups import staleness
from strawq.ondisk.names import TaskName, data_key
from strawq.tasks.queue import RunQueue

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One rank's shard of one batch. Token tensors are flat over ``cu_seqlens``."""

    seq: int
    rank: int
    world_size: int
    #: weight version current when the batch was read (staleness is measured against it)
    version: int
    #: int32 [T]: prompt + response ids of every sample, concatenated
    tokens: torch.Tensor
    #: int32 [S + 1]: sample i is ``[cu_seqlens[i], cu_seqlens[i+1])``
    cu_seqlens: torch.Tensor
    #: uint8 [T]: 0 over prompts, the recorded mask over responses
    loss_mask: torch.Tensor
    #: float32 [T]: the engine's log-probs (0 over prompts)
    rollout_logprobs: torch.Tensor
    #: int64 [T]: weight version that produced each token (−1 over prompts)
    versions: torch.Tensor
    #: float32 [T]: each sample's advantage on every one of its tokens
    advantages: torch.Tensor
    #: float32 [S]
    rewards: torch.Tensor
    #: float32 [S]
    sample_advantages: torch.Tensor
    #: int32 [S]
    prompt_lens: torch.Tensor
    #: int32 [S]
    response_lens: torch.Tensor
    #: int64 [S]: position of the sample's group in ``groups``
    sample_group: torch.Tensor
    #: int64 [S]: dataset index of the sample's prompt
    sample_index: torch.Tensor
    #: int64 [S]: minimum token version of each sample (its group's for empty responses)
    sample_min_version: torch.Tensor
    #: this rank's groups (manifest names), staleness-first
    groups: list[TaskName]
    #: their manifest summaries (task_id, index, sample_lens, rewards, status, advantages, ...)
    summaries: list[dict[str, Any]]
    #: groups in the whole batch (all ranks)
    total_groups: int
    #: groups of this shard that failed their checks (dropped with a record, not trained)
    skipped: list[str] = field(default_factory=list)
    #: staleness/* metrics of this shard
    stats: dict[str, float] = field(default_factory=dict)
    #: bytes of group records read for this shard
    bytes_read: int = 0
    #: per sample, the behaviour policy's sampling parameters
    #: (``strawq.collector.trainer.behaviour``): float32 [S] temperature, float32 [S] top-p,
    #: int32 [S] top-k (−1: all)
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    #: bool [S]: staler than the run's η at the version this batch was read at (the
    #: read-time re-check; kept and trained under ``eta_mode="train"``)
    over_eta: torch.Tensor | None = None
    #: per-token extras (``strawq.ondisk.extras``, ``collector.trainer.packing``):
    #: ``routed_experts`` int32 [T, layers, top_k] (−1: not computed, e.g. each sample's
    #: last position), ``teacher_logprobs`` float32 [T], ``top_p_token_ids`` int32 flat with
    #: ``top_p_token_offsets`` int64 [T + 1]; empty when the groups recorded none
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    #: samples in the whole batch (every rank's shard; from the manifest)
    total_samples: int | None = None
    #: trained tokens (loss_mask = 1) in the whole batch, from the manifest's per-sample
    #: ``loss_tokens``; None when a group was recorded without them
    total_loss_tokens: int | None = None
    #: read from the collector's packed shard (``CollectorConfig.pack_ranks``; the same
    #: tensors as from the records, ``bytes_read`` is then the shard's size)
    packed: bool = False

    @property
    def num_samples(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def totals(self) -> LossTotals:
        """The whole batch's loss denominators, gradients averaged over ``world_size``
        ranks (``strawq.collector.trainer.importance.batch_loss``). On one rank a Batch built
        without totals counts its own."""
        samples, tokens = self.total_samples, self.total_loss_tokens
        if self.world_size == 1:
            samples = self.num_samples if samples is None else samples
            if tokens is None:  # count_nonzero: a uint8 sum() promotes, ~20x slower
                tokens = int(np.count_nonzero(self.loss_mask.numpy())) \
                    if self.loss_mask.device.type == "cpu" else int(self.loss_mask.sum())
        elif samples is None:
            raise ValueError(f"batch {self.seq} (rank {self.rank} of {self.world_size}) has no "
                             "total_samples: a shard's loss needs the whole batch's "
                             "denominators; read it with BatchReader")
        return LossTotals(total_samples=samples, total_loss_tokens=tokens,
                          grad_ranks=self.world_size)

    def sample_of_token(self) -> torch.Tensor:
        """int64 [T]: the sample each token belongs to."""
        cu = self.cu_seqlens.to(torch.int64)
        return torch.repeat_interleave(torch.arange(self.num_samples), cu[1:] - cu[:-1])

    def token_column(self, per_sample: torch.Tensor) -> torch.Tensor:
        """A per-sample column [S] (``temperature``, ``top_p``, ``top_k``) on every token [T]."""
        cu = self.cu_seqlens.to(torch.int64)
        return torch.repeat_interleave(per_sample, cu[1:] - cu[:-1])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])




class ShardLoader:
    """Loads one rank's shards (see the module's docstring)."""

    def __init__(self, queue: RunQueue, batches: BatchStore, *, rank: int, world_size: int,
                 verify: bool = True, read_threads: int = 1) -> None:
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        self.queue = queue
        self.storage = queue.storage
        self.batches = batches
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        #: one record buffer per reading thread; threads beyond the caller's from ``_pool``
        self._files = [RecordFile() for _ in range(read_threads)]
        #: reused memory for the packed shards (first-touch page faults cost as much as
        #: the copies); a buffer is reused only once no batch references it
        self._buffers = BufferPool()
        self._pool: ThreadPoolExecutor | None = None
        #: a packed shard was not used once already (``_fallback`` logs the first loudly)
        self._fell_back = False

    def load(self, man: Manifest) -> Batch:
        """This rank's shard of a manifest: the collector's packed shard when it wrote one
        for this world size (``CollectorConfig.pack_ranks``), else packed here from the
        group records."""
        info = man.meta.get("packed")
        if isinstance(info, Mapping):
            batch = self._load_packed(man, info)
            if batch is not None:
                return batch
        return self._load_records(man)

    def _fallback(self, man: Manifest, why: str) -> None:
        """Log why a packed shard is not used: a warning the first time, then at debug."""
        level = logging.DEBUG if self._fell_back else logging.WARNING
        self._fell_back = True
        log.log(level, "batch %d, rank %d of %d: %s; reading the group records instead "
                "(further fallbacks are logged at debug level)", man.seq, self.rank,
                self.world_size, why)

    def _load_packed(self, man: Manifest, info: Mapping[str, Any]) -> Batch | None:
        """The shard the collector packed for this rank, or None (logged) when there is none
        for this world size or it does not check out: the records are read instead."""
        try:
            tag, ws = str(info["tag"]), int(info["world_size"])
            ranks = info.get("ranks", ())
        except (KeyError, TypeError, ValueError):
            self._fallback(man, f"the manifest's packed entry {dict(info)!r} is not readable")
            return None
        if ws != self.world_size:
            self._fallback(man, f"the collector packed shards for {ws} ranks "
                           f"(pack_ranks), this trainer runs {self.world_size}")
            return None
        if self.rank not in ranks:
            self._fallback(man, "the collector wrote no shard for this rank (a group of it "
                           "did not read cleanly)")
            return None
        key = packed.shard_key(man.seq, tag, ws, self.rank)
        try:
            buf, digest = read_file(self.storage, key, self._buffers, checksum=self.verify)
            meta, arrays = packed.decode_shard(buf, name=key, verify=self.verify,
                                               digest=digest)
            positions = self._check_shard(man, meta, arrays, tag, key)
        except (CorruptRecord, NotFound, ConfigError) as exc:
            self._fallback(man, f"its packed shard is unusable: {exc}")
            return None
        return self._assemble(man, positions, arrays, version=self.queue.current_version(),
                              totals=(meta["total_samples"], meta["total_loss_tokens"]),
                              nbytes=int(buf.shape[0]), skipped=[], from_shard=True)

    def _check_shard(self, man: Manifest, meta: Mapping[str, Any],
                     arrays: Mapping[str, np.ndarray], tag: str, key: str) -> list[int]:
        """The shard was packed from this manifest for this rank (else ``CorruptRecord``);
        returns its manifest positions."""
        want = {"seq": man.seq, "tag": tag, "world_size": self.world_size, "rank": self.rank,
                "sharding": packed.SHARDING}
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise CorruptRecord(f"{key}: packed for {got}, this read needs {want}")
        positions = meta.get("positions")
        names = meta.get("groups")
        if not isinstance(positions, list) or not isinstance(names, list) or \
                len(positions) != len(names) or \
                not all(type(i) is int and 0 <= i < len(man.groups) for i in positions):
            raise CorruptRecord(f"{key}: its group positions do not fit the manifest's "
                                f"{len(man.groups)} groups")
        for i, name in zip(positions, names, strict=True):
            g = man.groups[i]
            if name != f"{g.id}~g{g.gen}":
                raise CorruptRecord(f"{key}: holds group {name!r} at position {i}, the "
                                    f"manifest names {g.id}~g{g.gen}")
        missing = [k for k in SHARD_ARRAYS if k not in arrays]
        if missing:
            raise CorruptRecord(f"{key}: lacks the arrays {missing}")
        total = arrays["cu_seqlens"]
        if total.ndim != 1 or total.shape[0] < 1 or \
                int(total[-1]) != arrays["tokens"].shape[0]:
            raise CorruptRecord(f"{key}: cu_seqlens does not end at the {arrays['tokens'].shape[0]}"
                                " packed tokens")
        if "total_samples" not in meta or "total_loss_tokens" not in meta:
            raise CorruptRecord(f"{key}: lacks the batch totals")
        return positions

    def _load_records(self, man: Manifest) -> Batch:
        """Pack this rank's shard from the group records (read, verify, decode, copy)."""
        counts = [group_tokens(s) for s in man.summaries]
        mine = shard_groups(counts, self.world_size)[self.rank]
        version = self.queue.current_version()
        pk = ShardPacker([man.summaries[i] for i in mine], self._buffers)
        keys = [data_key(man.groups[i].id, man.groups[i].gen, "group") for i in mine]
        nthreads = min(len(self._files), max(len(keys), 1))
        if nthreads > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(len(self._files) - 1,
                                            thread_name_prefix="strawq-reader")
        parts = [range(t, len(keys), nthreads) for t in range(nthreads)]
        futures = [self._pool.submit(read_groups, self.storage, pk, keys, part,
                                     self._files[t], verify=self.verify)
                   for t, part in enumerate(parts[1:], 1)] if self._pool else []
        results = [read_groups(self.storage, pk, keys, parts[0], self._files[0],
                               verify=self.verify)]
        results += [f.result() for f in futures]
        nbytes = sum(n for n, _ in results)
        failed = sorted((k, exc) for _, errs in results for k, exc in errs)
        skipped: list[str] = []
        for k, exc in failed:
            name = man.groups[mine[k]]
            self._drop_bad(name, keys[k], exc)
            skipped.append(name.id)
        ok = pk.finish().tolist()
        positions = [i for k, i in enumerate(mine) if ok[k]]
        arrays = shard_arrays(pk, [man.summaries[i] for i in positions])
        return self._assemble(man, positions, arrays, version=version,
                              totals=manifest_totals(man.summaries), nbytes=nbytes,
                              skipped=skipped)

    def _assemble(self, man: Manifest, positions: list[int], arrays: Mapping[str, np.ndarray],
                  *, version: int, totals: tuple[int, int | None], nbytes: int,
                  skipped: list[str], from_shard: bool = False) -> Batch:
        """The ``Batch`` over a rank's arrays (``packing.shard_arrays``; views, no copy),
        with what depends on the version it is read at: staleness figures, the η re-check."""
        t = {k: torch.from_numpy(arrays[k]) for k in SHARD_ARRAYS if k != "multi_version"}
        min_version = arrays["sample_min_version"]
        stal = staleness(version, min_version)  # per sample: each one's minimum version
        stats = {"staleness/mean": float(stal.mean()) if stal.size else 0.0,
                 "staleness/max": float(stal.max()) if stal.size else 0.0,
                 "staleness/multi_version_frac":
                     float(arrays["multi_version"].mean()) if stal.size else 0.0}
        over, recheck = read_time_staleness(version, stal, man.meta)
        stats.update(recheck)
        n = len(EXTRA_PREFIX)
        return Batch(
            seq=man.seq, rank=self.rank, world_size=self.world_size, version=version,
            groups=[man.groups[i] for i in positions],
            summaries=[man.summaries[i] for i in positions], total_groups=len(man.groups),
            skipped=skipped, stats=stats, bytes_read=nbytes, over_eta=torch.from_numpy(over),
            extras={k[n:]: torch.from_numpy(v) for k, v in arrays.items()
                    if k.startswith(EXTRA_PREFIX)},
            total_samples=totals[0], total_loss_tokens=totals[1], packed=from_shard, **t)

    def _drop_bad(self, name: TaskName, key: str, exc: Exception) -> None:
        """A batched group whose payload fails its checks: quarantine it, drop with a record."""
        reason = "corrupt_group" if not isinstance(exc, NotFound) else "missing_payload"
        log.error("batch group %s (%s) is unusable: %s; quarantined and dropped with reason "
                  "%s, the batch goes on without it", name.id, key, exc, reason)
        self.queue.quarantine(key)
        self.batches.drop_from("batched", name, reason, str(exc))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
