"""The trainer-side reader: ``next_batch`` → packed torch tensors of this rank's shard; ``ack``.

Delivery is at-least-once and training exactly-once when the trainer acks after its step:
an unacked batch is delivered again after a trainer restart; a batch at or below the
checkpoint's ``batch_seq`` is never delivered again (it is acked on the spot if it was not).

Only rank 0 writes (acks); every rank reads the same manifest and packs only its shard (see
``strawq.collector.trainer.packing.shard_groups``). Call ``ack`` after the optimizer step —
every rank has loaded its shard by then, so the collector's GC cannot pull payloads from
under a reader.

A shard's loss is its share of the *whole batch's*: ``Batch.totals`` carries the batch's
sample and trained-token counts (from the manifest, the same on every rank), and
``strawq.collector.trainer.importance.batch_loss`` divides by them, so the DDP mean of the ranks'
gradients is the single-process gradient of the whole batch (docs/design.md, invariant 11;
checked against ``strawq.testing.reference``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strawq.collector.trainer.behaviour import read_time_staleness
from strawq.collector.trainer.bracket import BracketReport, WeightUpdateBracket
from strawq.collector.trainer.importance import LossTotals
from strawq.collector.trainer.metrics import MetricsSink
from strawq.collector.trainer.packing import (EXTRA_PREFIX, SHARD_ARRAYS, BufferPool, RecordFile,
                                              ShardPacker, group_tokens, manifest_totals, read_file,
                                              read_groups, shard_arrays, shard_groups)
from strawq.batches import (BatchStore, Manifest, forget_delivered_after, high_water,
                            mark_delivered)
from strawq.checkpoint import CHECKPOINT_FORMAT, read_cursor_state
from strawq.commits import commit as commit_position
from strawq.commits import committed_seq, hold
from strawq.epochs import epoch_starts, superseded
from strawq.epochs import epochs as known_epochs
from strawq.epochs import list_names as list_epoch_names
from strawq import packed
from strawq.errors import BatchTimeout, ConfigError, CorruptRecord, NotFound
from strawq.groups import staleness
from strawq.names import TaskName, data_key
from strawq.queue import RunQueue
from strawq.states import depths
from strawq.storage import open_storage
from strawq.storage.watch import DirProbe, DirWatch

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
    #: per-token extras (``strawq.extras``, ``collector.trainer.packing``): ``routed_experts`` int32
    #: [T, layers, top_k] (−1: not computed, e.g. each sample's last position),
    #: ``teacher_logprobs`` float32 [T], ``top_p_token_ids`` int32 flat with
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


#: A waiting rank on a mount without change events lists ``batches/`` at least this often
#: (it stats it at every poll and lists at once when it changed; on a FUSE mount the stat
#: is answered from the attribute cache, so a new manifest is seen within that TTL).
LIST_EVERY_S = 1.0


class BatchReader:
    """Reads batches for one data-parallel rank. Clock and sleep are injected for tests."""

    def __init__(self, queue: RunQueue, *, rank: int = 0, world_size: int = 1,
                 verify: bool = True, metrics: MetricsSink | None = None,
                 poll_interval_s: float = 0.02, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, read_threads: int = 1,
                 watch: DirWatch | None = None, checkpointed: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.queue = queue
        self.storage = queue.storage
        self.batches = BatchStore(queue)
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.sleep = sleep
        self._delivered = 0
        self._acked = 0
        self._skip_upto = 0
        #: the trainer restores from checkpoints: acked batches stay until ``commit``
        self.checkpointed = checkpointed
        #: batches after this number are delivered (again) whether acked or not: the
        #: committed position when this reader started, or the restored checkpoint's
        self._replay_after: int | None = None
        #: the position of the checkpoint being saved (committed by ``commit``, or by the
        #: next ``state_dict``: a trainer saves one checkpoint at a time)
        self._saving: int | None = None
        #: manifests from a superseded collector epoch (never delivered)
        self._refused: set[int] = set()
        self._last_return: float | None = None
        self._steps = 0
        self._bracket: WeightUpdateBracket | None = None
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        #: one record buffer per reading thread; threads beyond the caller's from ``_pool``
        self._files = [RecordFile() for _ in range(read_threads)]
        #: reused memory for the packed shards (first-touch page faults cost as much as
        #: the copies); a buffer is reused only once no batch references it
        self._buffers = BufferPool()
        self._pool: ThreadPoolExecutor | None = None
        #: a packed shard was not used once already (``_fallback`` logs the first loudly)
        self._fell_back = False
        # Wait for a new manifest on inotify where this host sees it (the default sleep
        # only: an injected sleep means an injected clock), else a fixed poll (no back-off).
        if watch is None and sleep is time.sleep:
            watch = DirWatch(self.storage, ("batches",))
        self._watch = watch if watch is not None and watch.event_driven else None
        # A waiting rank stats batches/ at each poll and lists it only when it changed, or
        # once a LIST_EVERY_S: no event comes for another host's manifest on a shared mount
        # (inotify on a FUSE mount sees this client's changes only), and a listing of
        # batches/ and acked/ every 20 ms was ~320 metadata operations a second per rank on
        # JuiceFS (bench/scale.py, "a waiting trainer rank").
        self._probe: DirProbe | None = DirProbe(self.storage, ("batches",),
                                                full_every_s=LIST_EVERY_S, clock=clock)

    @classmethod
    def open(cls, path: str, *, rank: int = 0, world_size: int = 1,
             metrics_jsonl: str | None = None, prometheus_port: int | None = None,
             **kwargs: Any) -> BatchReader:
        """Open the run at ``path``; metrics only on rank 0."""
        queue = RunQueue.open(open_storage(path, writer_id=f"reader{rank}"))
        metrics = MetricsSink(metrics_jsonl, prometheus_port) if rank == 0 and (
            metrics_jsonl or prometheus_port is not None) else None
        return cls(queue, rank=rank, world_size=world_size, metrics=metrics, **kwargs)

    # -- delivery -----------------------------------------------------------------------------
    def _start_replay(self) -> None:
        """First delivery: a checkpointing trainer re-reads every batch after the committed
        position (its model has none of them, whatever it acked before a crash)."""
        if not self.checkpointed or self._replay_after is not None:
            return
        if self.rank == 0:
            hold(self.storage, high_water(self.storage))
        pos = committed_seq(self.storage)
        if pos is not None:
            self._replay_after = max(pos, self._skip_upto)

    def _next_seq(self) -> int | None:
        self._start_replay()
        seqs, acked = self.batches.batch_seqs()
        replay = self._replay_after
        for s in sorted(seqs):
            if s in acked and (replay is None or s <= replay):
                continue
            if s <= self._skip_upto:
                log.warning("batch %d is at or below the checkpoint's batch %d but was not "
                            "acked (the trainer stopped between its checkpoint and the ack); "
                            "acking it now, it is not trained again", s, self._skip_upto)
                if self.rank == 0:
                    self.batches.ack(s)
                continue
            if s <= self._delivered or s in self._refused:
                continue
            return s
        return None

    def next_batch(self, timeout: float = 600.0) -> Batch:
        """The next batch's shard for this rank; ``BatchTimeout`` after ``timeout`` seconds."""
        if self.rank == 0:
            self.bracket.observe()  # producers' liveness history for the next bracket
        start = self.clock()
        look = True  # list now; later, when the probe says batches/ changed
        while True:
            seq = self._next_seq() if look or self._probe is None or self._probe.changed() \
                else None
            look = False
            if seq is not None:
                look = True  # whatever happens to this one, list again at once
                try:
                    man = self.batches.read_manifest(seq)
                except NotFound:
                    continue  # acked and collected in between (another reader process)
                by = superseded(seq, man.meta, epoch_starts(self.storage))
                if by is None:
                    break
                log.error("batch %d comes from collector epoch %s, published after epoch %d "
                          "took over: refused (its groups are batched again by the live "
                          "collector)", seq, man.meta.get("epoch"), by)
                self._refused.add(seq)
                continue
            waited = self.clock() - start
            if waited >= timeout:
                raise BatchTimeout(self._timeout_message(timeout))
            # A fixed interval: a doubling one (it reached 0.5 s) left a manifest published
            # just after a listing unseen for up to that long while the trainer idled.
            pause = min(self.poll_interval_s, max(timeout - waited, 0.0))
            if self._watch is not None:
                look = self._watch.wait(pause)  # an event: list, whatever the mtime says
            else:
                self.sleep(pause)
        wait_s = self.clock() - start
        batch = self.load(man)
        if self.rank == 0:  # from now on it is being trained (strawq.collector.admission)
            mark_delivered(self.storage, seq, batch.version)
        self._delivered = seq
        now = self.clock()
        step_s = now - self._last_return if self._last_return is not None else None
        self._last_return = now
        self._steps += 1
        self._emit(batch, wait_s, step_s)
        return batch

    def _timeout_message(self, timeout: float) -> str:
        d = depths(self.storage)
        epochs = known_epochs(list_epoch_names(self.storage))
        return (f"no batch after {timeout:.1f}s (expected batch > {self._delivered}); queue: "
                f"pending={d.pending + d.partial} leased={d.leased} ready={d.ready}; "
                "collector epochs "
                f"{epochs or 'none'}. Is the collector running ('strawq collector') and are "
                "producers claiming work?")

    def load(self, man: Manifest) -> Batch:
        """This rank's shard of a manifest (no waiting, no bookkeeping): the collector's
        packed shard when it wrote one for this world size (``CollectorConfig.pack_ranks``),
        else packed here from the group records."""
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

    # -- acks ---------------------------------------------------------------------------------
    def ack(self, batch: Batch | int) -> None:
        """Consumption is durable (rank 0 publishes ``acked/<seq>``; other ranks no-op)."""
        seq = batch if isinstance(batch, int) else batch.seq
        if self.rank == 0:
            self.batches.ack(seq)
        self._acked = max(self._acked, seq)

    # -- weight updates (rank 0) --------------------------------------------------------------
    @property
    def bracket(self) -> WeightUpdateBracket:
        if self._bracket is None:
            self._bracket = WeightUpdateBracket(self.queue, clock=self.clock, sleep=self.sleep,
                                                rank=self.rank)
        return self._bracket

    def weight_update(self, push: Callable[[int], None], *, timeout: float = 300.0
                      ) -> BracketReport | None:
        """The rank-aware update: on rank 0 ``bracket.weight_update(push)`` (pause, push,
        resume), on every other rank nothing (None), as ``ack`` does. Call it on every rank."""
        if self.rank != 0:
            return None
        return self.bracket.weight_update(push, timeout=timeout)

    def begin_weight_update(self, timeout: float = 300.0) -> BracketReport:
        """Pause producers (see ``strawq.collector.trainer.bracket``); rank 0 only."""
        return self.bracket.begin_weight_update(timeout)

    def end_weight_update(self, version: int | None = None) -> int:
        """Announce the new version and resume producers; rank 0 only."""
        return self.bracket.end_weight_update(version)

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self, consumed: Batch | int | None = None) -> dict[str, Any]:
        """For the trainer's checkpoint: last trained batch, weight version, dataset cursor.

        The one order: train on the batch, ``ack(batch)``, and every N steps
        ``state = reader.state_dict()``, save the checkpoint with it, ``reader.commit(state)``.
        Batches after the committed position are kept and delivered again to a trainer
        restored from that checkpoint. (Calling ``state_dict`` again also commits the
        previous one: a trainer saves one checkpoint at a time.) ``consumed`` counts a batch
        trained but not yet acked.
        """
        state = self.checkpoint_state(consumed)
        if self._saving is not None and self.rank == 0 and self.checkpointed:
            commit_position(self.storage, self._saving)
        self._saving = int(state["batch_seq"])
        return state

    def checkpoint_state(self, consumed: Batch | int | None = None) -> dict[str, Any]:
        """What ``state_dict(consumed)`` returns, with no side effect (it commits nothing and
        starts no checkpoint): for a trainer that records the state of a checkpoint ahead of
        saving it (slime's data source writes it when the batch is delivered, since slime
        saves the model before it calls the data source's ``save``)."""
        seq = self._acked
        if consumed is not None:
            seq = max(seq, consumed if isinstance(consumed, int) else consumed.seq)
        return {"format": CHECKPOINT_FORMAT, "batch_seq": seq,
                "version": self.queue.current_version(),
                "feeder": read_cursor_state(self.storage, trained_through=seq)}

    def commit(self, state: Mapping[str, Any] | int | None = None) -> int:
        """The checkpoint holding ``state`` (default: the last ``state_dict``) is durable:
        batches up to its position are trained and may be garbage-collected. Rank 0 writes;
        returns the committed position."""
        if isinstance(state, Mapping):
            seq = int(state.get("batch_seq") or 0)
        elif state is not None:
            seq = int(state)
        elif self._saving is not None:
            seq = self._saving
        else:
            raise ValueError("commit() before state_dict(): nothing to commit")
        if self._saving is not None and seq >= self._saving:
            self._saving = None
        if self.rank != 0:
            return seq
        return commit_position(self.storage, seq)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after the checkpoint: every batch after its position is delivered (again,
        if it was acked after the checkpoint was saved), none at or below it."""
        if state.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format {state.get('format')!r}, this reader reads "
                             f"{CHECKPOINT_FORMAT}")
        seq = int(state.get("batch_seq") or 0)
        self._acked = max(self._acked, seq)
        self._skip_upto = max(self._skip_upto, seq)
        self._delivered = max(self._delivered, seq)
        if self.rank == 0:  # batches after it are trained again: not in the weights
            forget_delivered_after(self.storage, seq, acks=self.checkpointed)
        if self.checkpointed:
            if self.rank == 0:
                commit_position(self.storage, seq)  # a checkpoint being restored is durable
            retired = high_water(self.storage)
            if retired > seq:
                log.error("batches %d..%d after this checkpoint were garbage-collected before "
                          "a checkpoint covering them was committed; they cannot be trained "
                          "again. Restore the newest checkpoint, and call reader.commit() "
                          "after each save", seq + 1, retired)
            self._replay_after = seq
        v = int(state.get("version") or 0)
        if v != self.queue.current_version():
            log.info("checkpoint was at weight version %d, the queue announces %d", v,
                     self.queue.current_version())

    # -- metrics ------------------------------------------------------------------------------
    def _emit(self, batch: Batch, wait_s: float, step_s: float | None) -> None:
        if self.metrics is None:
            return
        values: dict[str, Any] = {"trainer/step": self._steps, "batch/seq": batch.seq,
                                  "batch/groups": len(batch.groups),
                                  "batch/samples": batch.num_samples,
                                  "batch/tokens": batch.num_tokens,
                                  "trainer/wait_s": wait_s, "queue/version": batch.version,
                                  **batch.stats}
        if step_s is not None and step_s > 0:
            values["trainer/wait_ratio"] = min(wait_s / step_s, 1.0)
        d = depths(self.storage)
        for state in ("pending", "partial", "leased", "ready", "batched"):
            values[f"queue/{state}"] = getattr(d, state)
        self.metrics.emit(values)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.metrics is not None:
            self.metrics.close()
