"""The global batch collector: grantor, feeder, admission, staleness-first batches, GC.

Exactly one per run (``strawq.collector.fencing``). One pass of ``Collector.step()``:

1. ``beat``: check the epoch fence (``FencedOut`` if taken over), advance the heartbeat;
2. ``LeaseMonitor.scan()``: expire the leases of producers whose counters stopped moving;
3. GC of acked batches (every ``gc_interval_s``);
4. scan ``ready/``, order it staleness-first, judge each group against η at the version it
   will be trained at (``trained_at``: the batches ahead of it that the weights do not hold
   yet, ``strawq.collector.admission.Progress``) and apply ``eta_mode``: ``train``
   (default: keep, count and warn), ``regenerate`` or ``drop`` (only when configured);
5. publish batches of B groups while fewer than ``max_prefetch_batches`` are unacked (a
   short last batch once the dataset is exhausted and nothing runs);
6. admission: release new prompt groups through the ``Feeder`` (``strawq.collector.admission``);
7. metrics (after the state is persisted).

Everything runs in the caller's thread on an injected clock: tests drive ``step()`` directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from strawq.collector.admission import (ConsumedGroups, Depths, admission, progress)
from strawq.collector.config import CollectorConfig
from strawq.collector.fencing import EpochFence, SupersededSweep, mark_epoch_start
from strawq.collector.trainer.metrics import MetricsSink, dropped_metric
from strawq.collector.batching import BatchFormer
from strawq.collector.eta_judge import EtaJudge
from strawq.collector.hooks import HookChain
from strawq.collector.mixing import MixtureBook, mixture_book
from strawq.collector.ops_metrics import OpsMetrics
from strawq.collector.report import StepReport
from strawq.collector.ordering import StalenessOrder
from strawq.collector.resume import ResumeInfo, open_queue, run_cursor
from strawq.batches import BatchStore, delivered, mark_high_water
from strawq.config import QueueConfig
from strawq.engine_weights import EngineWeights
from strawq.dataset import Dataset
from strawq.binding import check_binding
from strawq.commits import committed_seq
from strawq.errors import StorageFull
from strawq.finished import clear as clear_finished
from strawq.finished import mark_finished
from strawq.eta import EtaPolicy, publish_policy
from strawq.feeder import Feeder
from strawq.planner import Origin
from strawq.grantor import LeaseMonitor
from strawq.queue import RunQueue
from strawq.retention import drop_totals
from strawq.states import depths, upstream_depths
from strawq.status import disk_space, full_message, low_message, run_label

log = logging.getLogger(__name__)

#: Seconds between sweeps of ``data/`` (``strawq.retention``) on the collector's clock.
SWEEP_INTERVAL_S = 30.0
#: ``dropped/`` entries that trigger a compaction into the drop audit during a run.
COMPACT_DROPS_AT = 1000
#: The longest wait between passes while the disk is full (``Collector.run``).
FULL_RETRY_MAX_S = 2.0
#: Seconds between reminders in the log while the disk stays full.
FULL_REMIND_S = 60.0


class Collector:
    """The run's one collector. Construct with ``Collector.open`` (or ``__init__`` + ``start``)."""

    def __init__(self, queue: RunQueue, dataset: Dataset, config: CollectorConfig | None = None,
                 *, owner: str = "collector", clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 metrics: MetricsSink | None = None) -> None:
        self.queue = queue
        self.storage = queue.storage
        self.dataset = dataset
        self.config = config or CollectorConfig()
        self.clock = clock
        self.sleep = sleep
        self.fence = EpochFence(self.storage, owner=owner,
                                takeover_timeout_s=self.config.takeover_timeout_s,
                                clock=clock, sleep=sleep)
        self.batches = BatchStore(queue)
        self.superseded = SupersededSweep(self.batches)
        self.monitor = LeaseMonitor(queue, clock=clock)
        self.order = StalenessOrder()
        self.consumed = ConsumedGroups(self.batches)
        self.metrics = metrics or MetricsSink(self.config.metrics_jsonl,
                                              self.config.prometheus_port,
                                              addr=self.config.prometheus_host,
                                              labels={"run": run_label(self.storage)})
        self.feeder: Feeder | None = None
        #: a mixture's sources: their η, filters, shares and starvation (None: one dataset)
        self.mixing: MixtureBook | None = mixture_book(
            dataset, run_max_staleness=self.config.max_staleness,
            batch_groups=self.config.batch_groups)
        #: the optional behaviours plugged in (``strawq.collector.hooks``): the mixture's book
        #: and the operator's view (liveness, bracket, disk, quarantine: ``ops_metrics``)
        self.hooks = HookChain([*([self.mixing] if self.mixing is not None else []),
                                OpsMetrics(queue, self.monitor, clock=clock)])
        self.judge = EtaJudge(self.config, queue, self.batches, self.order, self.hooks,
                              lambda: self.policy)
        self.former = BatchFormer(self.config, queue, self.batches, self.fence, self.order,
                                  self.judge, self.hooks)
        self.resume_info: ResumeInfo | None = None
        self._last_gc = float("-inf")
        self._last_sweep = float("-inf")
        self._last_metrics = float("-inf")
        self._ready_seen_at_metrics = 0
        self._steps = 0
        #: counters of this incarnation (the metrics sink continues them across restarts)
        self._totals = {"released": 0, "batches": 0, "expired": 0}
        #: groups over η this incarnation, per policy action (``eta_mode``)
        self.stale_totals = {"trained": 0, "regenerated": 0, "dropped": 0}
        #: while passes fail on a full disk (ENOSPC, EDQUOT): the one-line message that
        #: says so (``run`` retries); None otherwise
        self.storage_full: str | None = None
        self._full_since = 0.0
        self._full_logged = 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, dataset: Dataset, config: CollectorConfig | None = None, *,
             queue_config: QueueConfig | None = None,
             checkpoint: Mapping[str, Any] | None = None, wait: bool = True,
             fsync: bool = True, dataset_grew: bool = False, **kwargs: Any) -> Collector:
        """Open (or create) the run at ``path``, take the fence, recover, apply a resume path.

        First, before anything is written (no run is created): ``EmptyDataset`` for a
        dataset without rows, ``DatasetMismatch`` for one the run's cursor does not count
        over, unless ``dataset_grew`` (``--dataset-grew``) and it is the run's with rows
        appended: then the cursor continues over it (``strawq.binding.check_binding``)."""
        grew = check_binding(dataset, run_cursor(path), grew=dataset_grew)
        queue, info = open_queue(path, queue_config=queue_config, checkpoint=checkpoint,
                                 writer_id=kwargs.get("owner", "collector"), fsync=fsync)
        col = cls(queue, dataset, config, **kwargs)
        col.start(wait=wait, resume=info, dataset_grew=grew)
        return col

    @property
    def batch_budget(self) -> int | None:
        """Batches this collector may still publish (None: no limit; ``run(max_batches=)``)."""
        return self.former.budget

    @batch_budget.setter
    def batch_budget(self, value: int | None) -> None:
        self.former.budget = value

    def trained_at(self, rep: StepReport, position: int) -> int:
        """The version a ready group at ``position`` is trained at (``EtaJudge``)."""
        return self.judge.trained_at(rep, position)

    @property
    def policy(self) -> EtaPolicy:
        """The run's η policy (published for claimers at ``start``)."""
        return EtaPolicy(self.config.max_staleness, self.config.eta_mode, self.fence.epoch)

    def start(self, *, wait: bool = True, resume: ResumeInfo | None = None,
              dataset_grew: bool = False) -> int:
        """Take the epoch fence, then recover releases and batch commits. Returns the epoch.
        ``dataset_grew``: the dataset is the run's with rows appended; the cursor continues
        over it (``Feeder.continue_grown``)."""
        epoch = self.fence.acquire(wait=wait)
        # before recovering: a stalled predecessor's manifest from here on is refused
        mark_epoch_start(self.storage, epoch, self.batches.next_seq())
        # producers apply it to partial tasks at claim (strawq.eta)
        publish_policy(self.storage, self.policy)
        clear_finished(self.storage)  # a run continued with more data goes on (re-marked)
        self.feeder = Feeder(self.queue, self.dataset, check_dataset=not dataset_grew)
        if dataset_grew:
            self.feeder.continue_grown()
        if self.mixing is not None:
            self.mixing.origin = self._origin
        self.batches.recover()
        self.resume_info = resume
        if resume is not None and resume.path in ("cursor", "fresh") and resume.checkpoint:
            self._apply_checkpoint(resume)
        return epoch

    def _apply_checkpoint(self, resume: ResumeInfo) -> None:
        ckpt = resume.checkpoint or {}
        assert self.feeder is not None
        if resume.path == "cursor":
            again = self.feeder.load_state_dict(dict(ckpt["feeder"]))
            if again:
                log.warning("released %d prompts again that were in flight at the checkpoint "
                            "(released, not trained by it)", again)
        version = int(ckpt.get("version") or 0)
        if version > self.queue.current_version():
            self.queue.set_version(version)
        seq = int(ckpt.get("batch_seq") or 0)
        if seq > 0:  # batch numbers continue after the checkpoint's (names are never reused)
            mark_high_water(self.storage, seq)

    def _origin(self, index: int) -> Origin | None:
        """Where task ``index`` comes from, over the feeder's current passes (None for an
        index before the dataset's first pass: a dataset before a switch)."""
        feeder = self.feeder
        if feeder is None:
            return None
        passes = feeder.passes(feeder.cursor)
        return feeder.planner.origin(passes, index) if index >= passes.bases[0] else None

    def _note_skips(self) -> None:
        """Tell the hooks which rows the history's zero-variance rule skipped in this
        collector's releases (a mixture source's starvation reason ``skipped``)."""
        if self.feeder is not None:
            self.hooks.on_skipped(self.feeder.take_skipped())

    def close(self) -> None:
        """Stop cleanly (a successor starts at once) and shut the metrics endpoint."""
        self.fence.close()
        self.metrics.close()

    def state_dict(self) -> dict[str, Any]:
        """Feeder cursor and version, for a trainer that runs the collector in-process."""
        feeder = self.feeder.state_dict() if self.feeder is not None else None
        return {"feeder": feeder, "version": self.queue.current_version()}

    def _warn_low_disk(self) -> None:
        """Warn while the run's disk is low (``disk_warn_share``), before writes fail."""
        share = self.config.disk_warn_share
        disk = disk_space(self.storage, low_share=share) if share > 0 else {}
        if disk.get("low") and not disk.get("full"):
            log.warning("%s", low_message(disk["path"], disk))

    # -- one pass -----------------------------------------------------------------------------
    def step(self) -> StepReport:
        if self.feeder is None:
            raise RuntimeError("Collector.step() before start(): take the fence first")
        now = self.clock()
        self.fence.beat()
        rep = StepReport(scan=self.monitor.scan())
        if now - self._last_gc >= self.config.gc_interval_s:
            sweep = now - self._last_sweep >= max(SWEEP_INTERVAL_S, self.config.gc_interval_s)
            rep.gc = self.batches.gc(sweep=sweep, compact_drops_at=COMPACT_DROPS_AT)
            self._last_gc = now
            if sweep:
                self._last_sweep = now
                rep.gc.tmp += self.storage.clean_dead_tmp()  # writers found dead, unnamed
                self._warn_low_disk()
        rep.version = self.queue.current_version()
        upstream = upstream_depths(self.storage)  # listed before the ready scan: see depths()
        refused = self.superseded.sweep()  # a stalled predecessor's late manifests
        seqs, acked = self.batches.batch_seqs()
        marks = delivered(self.storage)  # listed after the acks: none is missed in between
        rep.prefetched = len([s for s in seqs if s not in acked and s not in refused])
        rep.progress = progress(rep.version, seqs, acked, marks, refused,
                                batches_per_version=self.config.batches_per_version)
        rep.ahead = rep.progress.ahead
        ready = self.judge.ordered_ready(rep)  # after the progress: eta is judged with it
        # re-queued stale groups left ready after the upstream listing: still count them
        rep.depths = depths(self.storage, upstream=upstream,
                            ready=len(ready) + len(rep.requeued_stale))
        rep.depths = self.consumed.untrained(rep.depths, seqs, rep.progress)
        if rep.gc is not None:
            self.batches.prune_delivered(rep.version, seqs, acked)
        rep.exhausted = self.feeder.exhausted
        self.former.form(ready, rep)
        self._admit(rep)
        self._note_skips()
        self._steps += 1
        self.stale_totals["trained"] += len(rep.stale_trained)
        self.stale_totals["regenerated"] += len(rep.requeued_stale)
        self.stale_totals["dropped"] += len(rep.dropped_stale)
        self._totals["released"] += rep.released
        self._totals["batches"] += len(rep.published)
        self._totals["expired"] += len(rep.scan.expired) if rep.scan else 0
        self._emit_metrics(rep, now)
        return rep

    def depths(self) -> Depths:
        """Queue depths now (``strawq.states.depths``: listed in the direction work flows)."""
        return depths(self.storage)

    # -- admission ---------------------------------------------------------------------------
    def _admit(self, rep: StepReport) -> None:
        assert self.feeder is not None
        cfg = self.config
        rep.admission = admission(rep.depths, batch_groups=cfg.batch_groups,
                                  max_staleness=cfg.max_staleness,
                                  batches_per_version=cfg.batches_per_version,
                                  max_running=cfg.max_running, max_ready=cfg.max_ready,
                                  window=cfg.admission_batches,
                                  in_training=rep.progress.in_training)
        want = rep.admission.capacity
        if want <= 0 or self.feeder.exhausted:
            return
        self.fence.check()
        while want > 0 and not self.feeder.exhausted:
            n = self.feeder.release(min(want, self.queue.config.release_batch))
            if n == 0:
                break
            rep.released += n
            want -= n
        rep.exhausted = self.feeder.exhausted
        rep.depths = Depths(pending=rep.depths.pending + rep.released,
                            partial=rep.depths.partial, leased=rep.depths.leased,
                            ready=rep.depths.ready, batched=rep.depths.batched)

    # -- metrics -----------------------------------------------------------------------------
    def dropped_by_reason(self) -> dict[str, int]:
        """Per reason over the whole run: the drop audit's counts plus ``dropped/``."""
        return drop_totals(self.storage)

    def _emit_metrics(self, rep: StepReport, now: float) -> None:
        cfg = self.config
        if now - self._last_metrics < cfg.metrics_interval_s:
            return
        elapsed = now - self._last_metrics if self._last_metrics > float("-inf") else 0.0
        new_ready = self.order.observed_total - self._ready_seen_at_metrics
        self._ready_seen_at_metrics = self.order.observed_total
        self._last_metrics = now
        d = rep.depths
        values: dict[str, Any] = {
            "collector/step": self._steps, "collector/epoch": self.fence.epoch,
            "queue/version": rep.version, "queue/pending": d.pending,
            "queue/partial": d.partial, "queue/leased": d.leased, "queue/ready": d.ready,
            "queue/batched": d.batched, "queue/prefetched_batches": rep.prefetched,
            "collector/released": rep.released,
            "collector/admission_capacity": rep.admission.capacity if rep.admission else 0,
            "collector/groups_per_s": new_ready / elapsed if elapsed > 0 else 0.0,
            "collector/expired_leases": len(rep.scan.expired) if rep.scan else 0,
            "collector/released_total": self._totals["released"],
            "collector/batches_total": self._totals["batches"],
            "collector/expired_leases_total": self._totals["expired"],
            # passes over the dataset (queue.num_epochs) and the rows the history skipped
            "dataset/pass": self.feeder.cursor.epoch if self.feeder else 0,
            "collector/skipped_zero_variance_total":
                self.feeder.skipped_total if self.feeder else 0,
            "collector/stale_trained_total": self.stale_totals["trained"],
            "collector/stale_regenerated_total": self.stale_totals["regenerated"],
            "collector/stale_dropped_total": self.stale_totals["dropped"],
            # engines noted on weights other than the run's (engines/): out of rotation
            "engines/needing_weights": len(EngineWeights(self.storage).needing()),
        }
        for reason, count in self.dropped_by_reason().items():
            values[dropped_metric(reason)] = count
        values.update(self.hooks.metrics())  # a mixture's dataset/<source>/...
        self.metrics.emit(values)

    # -- loop --------------------------------------------------------------------------------
    def run(self, *, max_steps: int | None = None, until_drained: bool = False,
            deadline_s: float | None = None,
            should_stop: Callable[[], bool] | None = None,
            max_batches: int | None = None) -> StepReport:
        """Loop ``step()``; returns the last report. Stops on drain, passes (``max_steps``),
        published batches (``max_batches``), deadline or flag.

        On drain the acked batches are collected before returning (nothing is left as
        "batched" for a later ``strawq gc``).
        """
        start = self.clock()
        steps = 0
        published = 0
        if max_batches is not None:
            self.batch_budget = max_batches
        wait = self.config.poll_interval_s
        while True:
            try:
                rep = self.step()
            except StorageFull as exc:
                steps += 1
                self._note_full(exc)
                if (max_steps is not None and steps >= max_steps) or (
                        should_stop is not None and should_stop()) or (
                        deadline_s is not None and self.clock() - start >= deadline_s):
                    raise
                wait = min(max(2 * wait, 0.05), FULL_RETRY_MAX_S)
                self.sleep(wait)
                continue
            wait = self.config.poll_interval_s
            if self.storage_full is not None:
                log.info("collector: space is back after %.0f s; the run goes on",
                         self.clock() - self._full_since)
                self.storage_full = None
            steps += 1
            published += len(rep.published)
            if until_drained and rep.drained:
                return self._finish(rep)
            if max_steps is not None and steps >= max_steps:
                return rep
            if max_batches is not None and published >= max_batches:
                return rep
            if deadline_s is not None and self.clock() - start >= deadline_s:
                return rep
            if should_stop is not None and should_stop():
                return rep
            self.sleep(self.config.poll_interval_s)

    def _finish(self, rep: StepReport) -> StepReport:
        """The run has drained: publish the ``finished`` record (the trainer's reader raises
        ``RunFinished``, producers exit), wait up to ``finish_wait_s`` for a checkpointing
        trainer's last commit, collect every acked batch, return."""
        seqs, acked = self.batches.batch_seqs()
        committed = committed_seq(self.storage)
        # the trainer commits what it acked (a refused manifest is never acked)
        last = max(acked, default=committed or 0)
        self.fence.check()
        mark_finished(self.storage, max([last, *seqs]), self.fence.epoch)
        if committed is not None and committed < last:
            limit = self.config.finish_wait_s
            log.info("collector: every batch acked; waiting up to %.0f s for the trainer's "
                     "last checkpoint commit (batch %d, committed %d)", limit, last, committed)
            start = self.clock()
            while committed is not None and committed < last:
                if self.clock() - start >= limit:
                    log.warning(
                        "collector: the trainer did not commit batch %d within finish_wait_s "
                        "(%.0f s; committed %d): batches %d-%d stay batched until a commit "
                        "covers them ('strawq gc RUN' collects them then)",
                        last, limit, committed, committed + 1, last)
                    break
                self.fence.beat()
                self.sleep(max(self.config.poll_interval_s, 0.05))
                committed = committed_seq(self.storage)
        rep.gc = self.batches.gc(sweep=True, compact_drops_at=COMPACT_DROPS_AT)
        rep.depths = self.depths()
        log.info("collector: the run has finished (dataset exhausted, every batch acked%s); "
                 "stopping", "" if committed is None else " and committed")
        return rep

    def _note_full(self, exc: StorageFull) -> None:
        """A pass failed on a full disk: say so once, then every ``FULL_REMIND_S``. What the
        pass wrote before the failure is whole (every write is atomic) and the next pass
        picks up from the disk: a half-staged release is discarded by the next commit, a
        manifest that failed was never published."""
        now = self.clock()
        root = getattr(self.storage, "root", self.storage.describe())
        if self.storage_full is None:
            self._full_since = now
            self._full_logged = -FULL_REMIND_S
        self.storage_full = f"collector: {full_message(root)} ({exc.strerror})"
        if now - self._full_logged >= FULL_REMIND_S:
            log.error("%s; retrying every %.0f s at most", self.storage_full, FULL_RETRY_MAX_S)
            self._full_logged = now
