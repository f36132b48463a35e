"""Forming and publishing batches: B ready groups in staleness-first order (under a hard
η, due groups first, or the batch held back until they are ready:
``strawq.collector.deadlines``), their summaries (an unreadable group dropped, a hook's
verdict applied: a mixture source's filter), the advantages, the η verdicts of the
manifest, the rank shards (``pack_ranks``) and the manifest, fenced by the collector's epoch.
"""

from __future__ import annotations

import logging
from typing import Any

from strawq.collector.admission import Depths
from strawq.collector.config import CollectorConfig
from strawq.collector.eta_judge import EtaJudge
from strawq.collector.fencing import EpochFence
from strawq.collector.hooks import CollectorHooks
from strawq.collector.ordering import StalenessOrder, group_advantages
from strawq.collector.report import StepReport
from strawq.collector.trainer.packing import pack_batch
from strawq.collector.trainer.record_io import BufferPool, RecordFile
from strawq.data.history import attempt_summary
from strawq.delivery.batches import BatchStore
from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk.names import TaskName, data_key
from strawq.tasks.queue import RunQueue

log = logging.getLogger(__name__)

CORRUPT_REASON = "corrupt_group"


class BatchFormer:
    """Forms and publishes a collector's batches (see the module's docstring)."""

    def __init__(self, config: CollectorConfig, queue: RunQueue, batches: BatchStore,
                 fence: EpochFence, order: StalenessOrder, judge: EtaJudge,
                 hooks: CollectorHooks) -> None:
        self.config = config
        self.queue = queue
        self.storage = queue.storage
        self.batches = batches
        self.fence = fence
        self.order = order
        self.judge = judge
        self.hooks = hooks
        #: batches this collector may still publish (None: no limit; ``run(max_batches=)``)
        self.budget: int | None = None
        #: record buffer and shard memory for packing rank shards (``pack_ranks``)
        self._record_file = RecordFile() if config.pack_ranks is not None else None
        self._pack_buffers = BufferPool(keep=1)

    def form(self, ready: list[TaskName], rep: StepReport) -> None:
        """Publish batches of ``batch_groups`` from ``ready`` while fewer than
        ``max_prefetch_batches`` are unacked (a short last one once the dataset is exhausted
        and nothing runs)."""
        cfg = self.config
        B = cfg.batch_groups
        while rep.prefetched < cfg.max_prefetch_batches and ready and self.budget != 0:
            flush = rep.exhausted and cfg.flush_at_end and rep.depths.running == 0
            if len(ready) < B and not flush:
                return
            if self.judge.hard:  # η is a hard bound: due groups first, or wait for them
                plan = self.judge.deadlines.plan(ready, version=rep.version, ahead=rep.ahead,
                                                 running=self.judge.running)
                if plan.hold:
                    log.debug("batch held back: %d groups due by version %d are still "
                              "running (%d due are ready)", plan.due_running,
                              plan.trained_at, plan.due_ready)
                    return
                ready = plan.ready
            names: list[TaskName] = []
            summaries: list[dict[str, Any]] = []
            topped_up = False
            while len(names) < B and ready:  # a dropped group's place goes to the next one
                take, ready = ready[:B - len(names)], ready[B - len(names):]
                judging = self.judge.judges and self.judge.policy.mode in ("drop", "regenerate")
                if topped_up and judging:
                    # a group taken in a dropped one's place may lie past the groups that
                    # ``ordered_ready`` judged: one over η waits for its verdict next pass
                    at = self.judge.trained_at(rep, 0)
                    take = [n for n in take if not self.judge.policy_of(n.id).over(at, n.version)]
                got, sums = self.summaries(take, rep)
                topped_up = True
                names += got
                summaries += sums
            if not names or (len(names) < B and not flush):
                return  # too few left once the unreadable and filtered went: they wait
            at = self.judge.trained_at(rep, 0)
            policy = self.judge.policy
            meta: dict[str, Any] = {"epoch": self.fence.epoch, "version": rep.version,
                                    "advantages": cfg.advantages, "owner": self.fence.owner,
                                    **policy.to_meta(), "trained_at": at}
            over: list[str] = []
            if self.judge.judges:
                over = [n.id for n in names if self.judge.policy_of(n.id).over(at, n.version)]
                meta["over_eta"] = over
                rep.stale_trained += over
            seq = self.publish(names, summaries, meta, rep)
            self.hooks.on_trained(names, summaries)
            if over:
                log.warning("batch %d holds %d groups over eta %s (trained at version %d, "
                            "eta_mode=%s%s): they are trained with their importance "
                            "correction and named in the manifest's over_eta", seq, len(over),
                            policy.max_staleness, at, policy.eta_mode,
                            "" if policy.mode in ("train", "hard") else ", attempts used up")
            self.order.forget([n.id for n in names])
            rep.published.append(seq)
            if self.budget is not None:
                self.budget -= 1
            rep.prefetched += 1
            rep.ahead += 1
            rep.depths = Depths(pending=rep.depths.pending, partial=rep.depths.partial,
                                leased=rep.depths.leased, ready=rep.depths.ready - len(names),
                                batched=rep.depths.batched + len(names))

    def summaries(self, take: list[TaskName], rep: StepReport | None = None
                   ) -> tuple[list[TaskName], list[dict[str, Any]]]:
        """The summaries of ``take``; an unreadable group is dropped (``corrupt_group``), and
        so is one a hook drops (a mixture source's filter, ``strawq.collector.mixing``)."""
        names: list[TaskName] = []
        summaries: list[dict[str, Any]] = []
        for n in take:
            try:
                s = self.batches.read_summary(n)
            except (CorruptRecord, NotFound) as exc:
                log.error("ready group %s has an unreadable payload (%s); dropping it with "
                          "reason %s", n.id, exc, CORRUPT_REASON)
                self.queue.quarantine(data_key(n.id, n.gen, "group"))
                self.batches.drop_ready(n, CORRUPT_REASON, str(exc))
                continue
            s = dict(s)
            verdict = self.hooks.drop_verdict(n, s)
            if verdict is not None:
                # with its rewards: the history's zero-variance rule counts the drop
                if self.batches.drop_ready(n, *verdict, attempt_summary(s)) and rep is not None:
                    rep.filtered.append(n.id)
                self.order.forget([n.id])
                continue
            s["advantages"] = group_advantages(s.get("rewards", []), self.config.advantages,
                                               self.config.advantage_eps)
            names.append(n)
            summaries.append(s)
        return names, summaries

    def publish(self, names: list[TaskName], summaries: list[dict[str, Any]],
                 meta: dict[str, Any], rep: StepReport | None = None) -> int:
        for _attempt in range(3):
            self.fence.check()
            seq = self.batches.next_seq()
            if self.config.pack_ranks is not None:  # the ranks' shards, before the manifest
                packing = pack_batch(self.storage, seq, names, summaries,
                                     self.config.pack_ranks, file=self._record_file,
                                     pool=self._pack_buffers)
                meta = {**meta, "packed": packing.meta}
                if rep is not None:
                    rep.packed.append(packing)
                self.fence.check()
            try:
                self.batches.publish_batch(seq, names, summaries, meta)
            except AlreadyExists:
                log.warning("batch %d already exists (a concurrent collector?); rechecking the "
                            "fence", seq)
                continue
            log.info("published batch %d: %d groups, versions %d..%d", seq, len(names),
                     names[0].version, names[-1].version)
            return seq
        self.fence.check()
        raise AlreadyExists(17, "could not publish a batch after 3 tries: batches/ keeps "
                                "changing under this collector; is a second one running?")
