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
from collections.abc import Callable, Mapping
from typing import Any


from strawq.collector.trainer.bracket import BracketReport, WeightUpdateBracket
from strawq.collector.trainer.engine_repair import PushTo
from strawq.collector.trainer.fence import TrainerFence, shared_fence, unshare_fence
from strawq.collector.trainer.loading import Batch as Batch
from strawq.collector.trainer.loading import ShardLoader
from strawq.collector.trainer.metrics import MetricsSink
from strawq.status import run_label
from strawq.batches import (BatchStore, Manifest, forget_delivered_after, high_water,
                            mark_delivered)
from strawq.checkpoint import CHECKPOINT_FORMAT, read_cursor_state
from strawq.commits import commit as commit_position
from strawq.cursor import read_cursor_state as cursor_state
from strawq.commits import committed_seq, hold
from strawq.epochs import epoch_starts, superseded
from strawq.epochs import epochs as known_epochs
from strawq.epochs import list_names as list_epoch_names
from strawq.errors import BatchTimeout, NotFound, RunFinished
from strawq.finished import finished
from strawq.queue import RunQueue
from strawq.states import depths
from strawq.storage import open_storage
from strawq.storage.watch import DirProbe, DirWatch

log = logging.getLogger(__name__)

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
                 watch: DirWatch | None = None, checkpointed: bool = True,
                 fence: TrainerFence | None = None) -> None:
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
        #: rank 0's trainer fence (``strawq.collector.trainer.fence``): taken at the first
        #: write, checked before every write. By default this process's shared one; an
        #: injected one is the caller's to release
        self._fence = fence
        self._shares_fence = fence is None
        self._fence_users = 0
        #: reads this rank's shard of a manifest (the collector's, or packed from records)
        self.loader = ShardLoader(queue, self.batches, rank=rank, world_size=world_size,
                                  verify=verify, read_threads=read_threads)
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
        metrics = MetricsSink(metrics_jsonl, prometheus_port,
                              labels={"run": run_label(queue.storage)}) if rank == 0 and (
            metrics_jsonl or prometheus_port is not None) else None
        return cls(queue, rank=rank, world_size=world_size, metrics=metrics, **kwargs)

    # -- fencing (rank 0) ----------------------------------------------------------------------
    @property
    def fence(self) -> TrainerFence:
        """Rank 0's trainer fence (this process's shared one unless one was injected)."""
        if self._fence is None:
            self._fence = shared_fence(self.storage)
            self._fence_users = 1
        return self._fence

    def _writer(self) -> None:
        """Before a rank-0 write: hold the run's trainer epoch (taking it at the first write:
        ``TrainerBusy`` while another trainer lives), or ``FencedOut`` if taken over."""
        self.fence.acquire()

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
        """The next batch's shard for this rank; ``BatchTimeout`` after ``timeout`` seconds.

        ``RunFinished`` once the run has ended (the collector's ``finished`` record) and no
        batch is left for this reader: every batch of the run is delivered. The trainer
        loop stops there (save and commit the last checkpoint)."""
        if self.rank == 0:
            self._writer()
            self.bracket.observe()  # producers' liveness history for the next bracket
        start = self.clock()
        look = True  # list now; later, when the probe says batches/ changed
        end_checked = float("-inf")
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
            now = self.clock()
            if now - end_checked >= LIST_EVERY_S:  # one stat, at most once a second
                end_checked = now
                self._check_finished()
            waited = now - start
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

    def _check_finished(self) -> None:
        """``RunFinished`` when the run's ``finished`` record is there and, listed after it,
        no batch is left for this reader (the record is published after the last ack)."""
        end = finished(self.storage)
        if end is None or self._next_seq() is not None:
            return
        raise RunFinished(
            f"the run has finished: the dataset's last pass is trained (last batch "
            f"{end.get('last_seq')}, this reader's last {self._delivered}); no batch is "
            "coming. Save and commit the last checkpoint and stop the trainer.")

    def _timeout_message(self, timeout: float) -> str:
        d = depths(self.storage)
        head = (f"no batch after {timeout:.1f}s (expected batch > {self._delivered}); queue: "
                f"pending={d.pending + d.partial} leased={d.leased} ready={d.ready}")
        cursor = cursor_state(self.storage)
        last_pass = cursor is not None and max(len(cursor.get("epoch_bases") or ()), 1) \
            >= self.queue.config.num_epochs
        if cursor is not None and cursor.get("exhausted") and last_pass and not (
                d.pending or d.partial or d.leased or d.ready):
            # the last pass is released and nothing is left to generate or batch
            return (f"{head}. The run has drained: the dataset's last pass is released (cursor "
                    f"at index {cursor.get('next_index')}) and every group is trained or "
                    "dropped ('strawq inspect RUN dropped' lists why); no batch is coming. "
                    "Train fewer steps, or release more (queue.num_epochs, a larger dataset).")
        epochs = known_epochs(list_epoch_names(self.storage))
        return (f"{head}; collector epochs {epochs or 'none'}. Is the collector running "
                "('strawq collector') and are producers claiming work?")

    def load(self, man: Manifest) -> Batch:
        """This rank's shard of a manifest (no waiting, no bookkeeping): the collector's
        packed shard when it wrote one for this world size (``CollectorConfig.pack_ranks``),
        else packed here from the group records (``ShardLoader``)."""
        return self.loader.load(man)

    # -- acks ---------------------------------------------------------------------------------
    def ack(self, batch: Batch | int) -> None:
        """Consumption is durable (rank 0 publishes ``acked/<seq>``; other ranks no-op)."""
        seq = batch if isinstance(batch, int) else batch.seq
        if self.rank == 0:
            self._writer()
            self.batches.ack(seq)
        self._acked = max(self._acked, seq)

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
                          repair: PushTo | None = None
                          ) -> WeightUpdateBracket:
        """Build this reader's bracket with these options (None: the bracket's default, the
        reader's ``sleep``) and return it; a later call with the same options returns it,
        one with other options is refused (``ValueError``): one bracket per trainer, so
        configure it before the first ``next_batch`` or ``bracket`` use."""
        options: dict[str, Any] = {"lease_timeout_s": lease_timeout_s,
                                   "poll_interval_s": poll_interval_s, "sleep": sleep,
                                   "repair": repair}
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
            self._writer()
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
        if self.rank == 0:
            self._writer()  # refused: the checkpoint being saved stays pending
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
        if self.rank == 0:
            self._writer()  # refused: nothing of the reader's state moved
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
        if self._fence is not None and self._shares_fence and self._fence_users:
            self._fence_users = 0
            unshare_fence(self._fence)  # the last reader of this process releases the run
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self.loader.close()
        if self.metrics is not None:
            self.metrics.close()
