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

Waiting: each rank watches ``batches/`` itself, unless the trainer passes its process group
(``process_group=``, on by default then; ``one_rank_watches=False`` turns it off): the
group's rank 0 then watches and the others hear the next batch, the run's end or the
watcher's error from it over that group (``strawq.collector.trainer.rank_watch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from strawq.collector.trainer.bracket import BracketReport, WeightUpdateBracket
from strawq.collector.trainer.engine_repair import PushTo
from strawq.collector.trainer.fence import FenceUse, TrainerFence
from strawq.collector.trainer.loading import Batch as Batch
from strawq.collector.trainer.loading import ShardLoader
from strawq.collector.trainer.metrics import MetricsSink
from strawq.collector.trainer.positions import ReaderPositions
from strawq.collector.trainer.rank_watch import RankWatch
from strawq.collector.trainer.reader_metrics import ReaderMetrics
from strawq.collector.trainer.waiting import LIST_EVERY_S as LIST_EVERY_S
from strawq.collector.trainer.waiting import ManifestWait
from strawq.delivery.batches import BatchStore, Manifest, mark_delivered
from strawq.storage import open_storage
from strawq.storage.watch import DirWatch
from strawq.tasks.queue import RunQueue
from strawq.views.status import run_label
from strawq.weights.fingerprint import Fingerprint


class BatchReader:
    """Reads batches for one data-parallel rank. Clock and sleep are injected for tests."""

    def __init__(self, queue: RunQueue, *, rank: int = 0, world_size: int = 1,
                 verify: bool = True, metrics: MetricsSink | None = None,
                 poll_interval_s: float = 0.02, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, read_threads: int = 1,
                 watch: DirWatch | None = None, checkpointed: bool = True,
                 fence: TrainerFence | None = None, process_group: Any = None,
                 one_rank_watches: bool | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if one_rank_watches and process_group is None:
            raise ValueError("one_rank_watches=True needs the trainer's process group "
                             "(process_group=..., torch.distributed.group.WORLD for the "
                             "default one): the other ranks hear the next batch over it")
        self.queue = queue
        self.storage = queue.storage
        self.batches = BatchStore(queue)
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        self.metrics = metrics
        self.clock = clock
        self.sleep = sleep
        self._bracket: WeightUpdateBracket | None = None
        #: rank 0's trainer fence (``strawq.collector.trainer.fence``): taken at the first
        #: write, checked before every write. By default this process's shared one; an
        #: injected one is the caller's to release
        self.fence_use = FenceUse(self.storage, fence)
        #: delivered, acked, replayed and checkpointed positions (``positions``)
        self.positions = ReaderPositions(queue, self.batches, rank=rank,
                                         checkpointed=checkpointed, writer=self._writer)
        #: reads this rank's shard of a manifest (the collector's, or packed from records)
        self.loader = ShardLoader(queue, self.batches, rank=rank, world_size=world_size,
                                  verify=verify, read_threads=read_threads)
        #: waits for the next manifest: change events or a probe, the run's end, a timeout
        self.waiter = ManifestWait(queue, self.batches, next_seq=self.positions.next_seq,
                                   refused=self.positions.refused,
                                   delivered=lambda: self.positions.delivered,
                                   poll_interval_s=poll_interval_s, clock=clock, sleep=sleep,
                                   watch=watch)
        self.step_metrics = ReaderMetrics(self.storage, clock)
        #: with a process group (on unless ``one_rank_watches=False``): its rank 0 watches
        #: ``batches/`` and the others hear the next batch from it (``rank_watch``); None:
        #: this rank watches for itself (one rank, or no group given)
        self.rank_watch: RankWatch | None = None
        if process_group is not None and one_rank_watches is not False:
            rw = RankWatch(process_group)
            if rw.watcher != (rank == 0):
                raise ValueError(
                    f"BatchReader(rank={rank}, process_group=...): this process is rank "
                    f"{rw.group_rank} of that group; the reader's rank 0 (the one that writes) "
                    "must be the group's rank 0, which watches batches/: pass the "
                    "data-parallel group whose ranks are the readers' ranks")
            self.rank_watch = rw if rw.size > 1 else None

    @classmethod
    def open(cls, path: str, *, rank: int = 0, world_size: int = 1,
             metrics_jsonl: str | None = None, prometheus_port: int | None = None,
             **kwargs: Any) -> BatchReader:
        """Open the run at ``path``; metrics only on rank 0."""
        queue = RunQueue.open(open_storage(path, writer_id=f"reader{rank}"))
        metrics = MetricsSink(metrics_jsonl, prometheus_port,
                              labels={"run": run_label(queue.storage)}) if rank == 0 and (
            metrics_jsonl or prometheus_port is not None) else None
        return cls(queue, rank=rank, world_size=world_size, metrics=metrics, **kwargs)

    # -- fencing (rank 0) ----------------------------------------------------------------------
    @property
    def fence(self) -> TrainerFence:
        """Rank 0's trainer fence (this process's shared one unless one was injected)."""
        return self.fence_use.fence

    def _writer(self) -> None:
        """Before a rank-0 write: hold the run's trainer epoch (taking it at the first write:
        ``TrainerBusy`` while another trainer lives), or ``FencedOut`` if taken over."""
        self.fence_use.acquire()

    @property
    def checkpointed(self) -> bool:
        """The trainer restores from checkpoints: acked batches stay until ``commit``."""
        return self.positions.checkpointed

    @checkpointed.setter
    def checkpointed(self, value: bool) -> None:
        self.positions.checkpointed = value

    @property
    def poll_interval_s(self) -> float:
        """Seconds between listings while a rank waits (``ManifestWait``)."""
        return self.waiter.poll_interval_s

    @poll_interval_s.setter
    def poll_interval_s(self, value: float) -> None:
        self.waiter.poll_interval_s = value

    # -- delivery -----------------------------------------------------------------------------
    def next_batch(self, timeout: float = 600.0) -> Batch:
        """The next batch's shard for this rank; ``BatchTimeout`` after ``timeout`` seconds.

        ``RunFinished`` once the run has ended (the collector's ``finished`` record) and no
        batch is left for this reader: every batch of the run is delivered. The trainer
        loop stops there (save and commit the last checkpoint)."""
        rw = self.rank_watch
        if rw is None:
            self._before_wait()
        start = self.clock()
        if rw is None:
            seq, man = self.waiter.next_manifest(timeout)
        elif rw.watcher:
            seq, man = rw.watch(self._before_wait, self.waiter.next_manifest,
                                self.waiter.timeout_message, timeout, self.clock)
        else:
            seq, man = rw.hear()
        wait_s = self.clock() - start
        batch = self.load(man)
        if self.rank == 0:  # from now on it is being trained (strawq.collector.admission)
            mark_delivered(self.storage, seq, batch.version)
        self.positions.delivered = seq
        self.step_metrics.delivered(batch, wait_s, self.metrics)
        return batch

    def _before_wait(self) -> None:
        if self.rank == 0:
            self._writer()
            self.bracket.observe()  # producers' liveness history for the next bracket

    def load(self, man: Manifest) -> Batch:
        """This rank's shard of a manifest (no waiting, no bookkeeping): the collector's
        packed shard when it wrote one for this world size (``CollectorConfig.pack_ranks``),
        else packed here from the group records (``ShardLoader``)."""
        return self.loader.load(man)

    # -- acks ---------------------------------------------------------------------------------
    def ack(self, batch: Batch | int) -> None:
        """Consumption is durable (rank 0 publishes ``acked/<seq>``; other ranks no-op)."""
        self.positions.ack(batch if isinstance(batch, int) else batch.seq)

    # -- weight updates (rank 0) --------------------------------------------------------------
    #: the options ``configure_bracket`` built the bracket with (None: not built yet)
    _bracket_options: dict[str, Any] | None = None

    @property
    def bracket(self) -> WeightUpdateBracket:
        """This reader's weight-update bracket, the trainer side's one (built at first use:
        ``configure_bracket`` first to build it with other options)."""
        return self._bracket if self._bracket is not None else self.configure_bracket()

    def configure_bracket(self, *, lease_timeout_s: float | None = None,
                          poll_interval_s: float | None = None,
                          sleep: Callable[[float], None] | None = None,
                          repair: PushTo | None = None, weight_update: str | None = None,
                          wave: float | None = None, max_lag: int | None = None,
                          publish_dir: str | None = None, max_delta_chain: int | None = None,
                          engine_urls: Sequence[str] | None = None
                          ) -> WeightUpdateBracket:
        """Build this reader's bracket with these options (None: the bracket's default, the
        reader's ``sleep``) and return it; a later call with the same options returns it,
        one with other options is refused (``ValueError``): one bracket per trainer, so
        configure it before the first ``next_batch`` or ``bracket`` use.

        ``weight_update`` (``"bracket"`` or ``"rolling"``), ``wave``, ``max_lag``: the
        update's mode and the rolling mode's settings; ``publish_dir``, ``max_delta_chain``:
        where the rolling mode copies each version, whole or as a delta, and how many deltas
        in a row; ``engine_urls``: engines besides those producers registered (probed, and
        counted in the rolling wave's share). As ``WeightUpdateBracket``'s."""
        options: dict[str, Any] = {"lease_timeout_s": lease_timeout_s,
                                   "poll_interval_s": poll_interval_s, "sleep": sleep,
                                   "repair": repair, "weight_update": weight_update,
                                   "wave": wave, "max_lag": max_lag,
                                   "publish_dir": publish_dir,
                                   "max_delta_chain": max_delta_chain,
                                   "engine_urls": None if engine_urls is None
                                   else tuple(engine_urls)}
        if self._bracket is not None:
            if options != self._bracket_options:
                given = {k: v for k, v in options.items() if v is not None}
                built = {k: v for k, v in (self._bracket_options or {}).items()
                         if v is not None}
                raise ValueError(
                    f"this reader's weight-update bracket is already built with "
                    f"{built or 'the defaults'}, not {given or 'the defaults'}: a trainer has "
                    "one bracket; configure it once, before the first next_batch or use of "
                    "reader.bracket")
            return self._bracket
        kwargs: dict[str, Any] = {k: v for k, v in options.items()
                                  if v is not None and k != "sleep"}
        self._bracket = WeightUpdateBracket(self.queue, clock=self.clock,
                                            sleep=sleep or self.sleep, rank=self.rank,
                                            fence=self._writer, **kwargs)
        self._bracket_options = options
        return self._bracket

    def weight_update(self, push: Callable[[int], Any], *, timeout: float = 300.0,
                      fingerprint: Fingerprint | None = None) -> BracketReport | None:
        """The rank-aware update: on rank 0 ``bracket.weight_update(push, fingerprint=...)``
        (pause, push, resume; with ``fingerprint``, of the pushed weights, every engine is
        checked against it before producers resume), on every other rank nothing (None), as
        ``ack`` does. Call it on every rank (the fingerprint matters on rank 0 only)."""
        if self.rank != 0:
            return None
        return self.bracket.weight_update(push, timeout=timeout, fingerprint=fingerprint)

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
        return self.positions.state_dict(_seq(consumed))

    def checkpoint_state(self, consumed: Batch | int | None = None) -> dict[str, Any]:
        """What ``state_dict(consumed)`` returns, with no side effect (it commits nothing and
        starts no checkpoint): for a trainer that records the state of a checkpoint ahead of
        saving it (slime's data source writes it when the batch is delivered, since slime
        saves the model before it calls the data source's ``save``)."""
        return self.positions.checkpoint_state(_seq(consumed))

    def commit(self, state: Mapping[str, Any] | int | None = None) -> int:
        """The checkpoint holding ``state`` (default: the last ``state_dict``) is durable:
        batches up to its position are trained and may be garbage-collected. Rank 0 writes;
        returns the committed position."""
        return self.positions.commit(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after the checkpoint: every batch after its position is delivered (again,
        if it was acked after the checkpoint was saved), none at or below it."""
        self.positions.load_state_dict(state)

    def close(self) -> None:
        self.fence_use.close()  # the last reader of this process releases the run
        self.waiter.close()
        self.loader.close()
        if self.metrics is not None:
            self.metrics.close()


def _seq(consumed: Batch | int | None) -> int | None:
    return consumed if consumed is None or isinstance(consumed, int) else consumed.seq
