"""The global batch collector: grantor, feeder, admission, staleness-first batches, GC.

Exactly one per run (``strawq.collector.fencing``). One pass of ``Collector.step()``:

1. ``beat``: check the epoch fence (``FencedOut`` if taken over), advance the heartbeat;
2. ``LeaseMonitor.scan()``: expire the leases of producers whose counters stopped moving;
3. GC of acked batches (every ``gc_interval_s``) and sweeps (``strawq.collector.upkeep``);
4. scan ``ready/``, order it staleness-first, judge each group against η at the version it
   will be trained at (``trained_at``: the batches ahead of it that the weights do not hold
   yet, ``strawq.collector.admission.Progress``) and apply ``eta_mode``: ``train``
   (default: keep, count and warn), ``regenerate`` or ``drop`` (only when configured);
5. publish batches of B groups while fewer than ``max_prefetch_batches`` are unacked (a
   short last batch once the dataset is exhausted and nothing runs);
6. admission: release new prompt groups through the ``Feeder`` (``strawq.collector.admission``,
   applied by ``strawq.collector.releasing``);
7. metrics (after the state is persisted: ``strawq.collector.pass_metrics``).

A drained run ends in ``strawq.collector.run_end``; passes that fail on a full disk are
retried (``strawq.collector.upkeep.FullDisk``).

Everything runs in the caller's thread on an injected clock: tests drive ``step()`` directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from strawq.collector.admission import ConsumedGroups, Depths, progress
from strawq.collector.batching import BatchFormer
from strawq.collector.config import CollectorConfig
from strawq.collector.eta_judge import EtaJudge
from strawq.collector.fencing import EpochFence, SupersededSweep, mark_epoch_start
from strawq.collector.hooks import HookChain
from strawq.collector.mixing import MixtureBook, mixture_book
from strawq.collector.ops_metrics import OpsMetrics
from strawq.collector.ordering import StalenessOrder
from strawq.collector.pass_metrics import PassMetrics
from strawq.collector.releasing import admit
from strawq.collector.report import StepReport
from strawq.collector.resume import ResumeInfo, apply_checkpoint, open_queue, run_cursor
from strawq.collector.run_end import finish_run
from strawq.collector.trainer.metrics import MetricsSink
from strawq.collector.upkeep import (
    COMPACT_DROPS_AT,
    FULL_REMIND_S,
    FULL_RETRY_MAX_S,
    SWEEP_INTERVAL_S,
    FullDisk,
    GcSchedule,
)
from strawq.config import QueueConfig
from strawq.data.binding import check_binding
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.data.planner import Origin
from strawq.delivery.batches import BatchStore, delivered, queue_depths
from strawq.errors import StorageFull
from strawq.tasks.eta import EtaPolicy, publish_policy
from strawq.tasks.finished import clear as clear_finished
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import depths, upstream_depths
from strawq.views.status import run_label

#: the upkeep's constants, where they were first defined (``strawq.collector.upkeep``)
__all__ = ["Collector", "COMPACT_DROPS_AT", "FULL_REMIND_S", "FULL_RETRY_MAX_S",
           "SWEEP_INTERVAL_S"]


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
        #: the parts a pass composes: GC and sweeps on a schedule, a full disk's retries,
        #: the counters and the metrics line (``upkeep``, ``pass_metrics``)
        self.gc = GcSchedule(self.config, self.batches)
        self.full_disk = FullDisk(self.storage, clock)
        self.pass_metrics = PassMetrics(self.config, self.storage, self.metrics, self.order,
                                        self.hooks, lambda: self.fence.epoch,
                                        lambda: self.feeder)

    @property
    def stale_totals(self) -> dict[str, int]:
        """Groups over η this incarnation, per policy action (``eta_mode``)."""
        return self.pass_metrics.stale_totals

    @property
    def storage_full(self) -> str | None:
        """While passes fail on a full disk (ENOSPC, EDQUOT): the one-line message that says
        so (``run`` retries); None otherwise."""
        return self.full_disk.message

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
        appended: then the cursor continues over it (``strawq.data.binding.check_binding``)."""
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
        # producers apply it to partial tasks at claim (strawq.tasks.eta)
        publish_policy(self.storage, self.policy)
        clear_finished(self.storage)  # a run continued with more data goes on (re-marked)
        self.feeder = Feeder(self.queue, self.dataset, check_dataset=not dataset_grew)
        if dataset_grew:
            self.feeder.continue_grown()
        if self.mixing is not None:
            self.mixing.origin = self._origin
        self.batches.recover()
        self.resume_info = resume
        if resume is not None:
            apply_checkpoint(self.queue, self.feeder, resume)
        return epoch

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

    # -- one pass -----------------------------------------------------------------------------
    def step(self) -> StepReport:
        if self.feeder is None:
            raise RuntimeError("Collector.step() before start(): take the fence first")
        now = self.clock()
        self.fence.beat()
        rep = StepReport(scan=self.monitor.scan())
        rep.gc = self.gc.due(now)  # acked batches collected, the run swept, when due
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
                            ready=len(ready) + len(rep.requeued_stale),
                            batched=self.batches.batched_in_ready)
        rep.depths = self.consumed.untrained(rep.depths, seqs, rep.progress)
        if rep.gc is not None:
            self.batches.prune_delivered(rep.version, seqs, acked)
        rep.exhausted = self.feeder.exhausted
        self.former.form(ready, rep)
        admit(rep, self.feeder, self.fence, self.config,
              release_batch=self.queue.config.release_batch)
        self._note_skips()
        self.pass_metrics.count(rep)
        self.pass_metrics.emit(rep, now)  # after the state is persisted
        return rep

    def depths(self) -> Depths:
        """Queue depths now (``strawq.delivery.batches.queue_depths``: listed in the direction
        work flows)."""
        return queue_depths(self.storage)

    def dropped_by_reason(self) -> dict[str, int]:
        """Per reason over the whole run: the drop audit's counts plus ``dropped/``."""
        return self.pass_metrics.dropped_by_reason()

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
                self.full_disk.note(exc)
                if (max_steps is not None and steps >= max_steps) or (
                        should_stop is not None and should_stop()) or (
                        deadline_s is not None and self.clock() - start >= deadline_s):
                    raise
                wait = min(max(2 * wait, 0.05), FULL_RETRY_MAX_S)
                self.sleep(wait)
                continue
            wait = self.config.poll_interval_s
            self.full_disk.passed()
            steps += 1
            published += len(rep.published)
            if until_drained and rep.drained:
                return finish_run(rep, batches=self.batches, gc=self.gc, fence=self.fence,
                                  config=self.config, clock=self.clock, sleep=self.sleep)
            if max_steps is not None and steps >= max_steps:
                return rep
            if max_batches is not None and published >= max_batches:
                return rep
            if deadline_s is not None and self.clock() - start >= deadline_s:
                return rep
            if should_stop is not None and should_stop():
                return rep
            self.sleep(self.config.poll_interval_s)
