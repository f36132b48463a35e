"""The end of a run, on the collector's side: the ``finished`` record, the wait for the
trainer's last checkpoint commit, the last collection.

Once the run has drained (dataset exhausted, every batch acked), ``finish_run`` publishes
the ``finished`` record (the trainer's reader raises ``RunFinished``, producers exit),
waits up to ``finish_wait_s`` for a checkpointing trainer to commit the last batch it
acked (beating the epoch fence meanwhile), and collects every acked batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from strawq.collector.config import CollectorConfig
from strawq.collector.fencing import EpochFence
from strawq.collector.report import StepReport
from strawq.collector.upkeep import GcSchedule
from strawq.delivery.batches import BatchStore, queue_depths
from strawq.delivery.commits import committed_seq
from strawq.tasks.finished import mark_finished

log = logging.getLogger(__name__)


def finish_run(rep: StepReport, *, batches: BatchStore, gc: GcSchedule, fence: EpochFence,
               config: CollectorConfig, clock: Callable[[], float],
               sleep: Callable[[float], None]) -> StepReport:
    """Publish ``finished``, wait for the last commit, collect; returns ``rep`` updated."""
    storage = batches.storage
    seqs, acked = batches.batch_seqs()
    committed = committed_seq(storage)
    # the trainer commits what it acked (a refused manifest is never acked)
    last = max(acked, default=committed or 0)
    fence.check()
    mark_finished(storage, max([last, *seqs]), fence.epoch)
    if committed is not None and committed < last:
        limit = config.finish_wait_s
        log.info("collector: every batch acked; waiting up to %.0f s for the trainer's "
                 "last checkpoint commit (batch %d, committed %d)", limit, last, committed)
        start = clock()
        while committed is not None and committed < last:
            if clock() - start >= limit:
                log.warning(
                    "collector: the trainer did not commit batch %d within finish_wait_s "
                    "(%.0f s; committed %d): batches %d-%d stay batched until a commit "
                    "covers them ('strawq gc RUN' collects them then)",
                    last, limit, committed, committed + 1, last)
                break
            fence.beat()
            sleep(max(config.poll_interval_s, 0.05))
            committed = committed_seq(storage)
    rep.gc = gc.final()
    rep.depths = queue_depths(storage)
    log.info("collector: the run has finished (dataset exhausted, every batch acked%s); "
             "stopping", "" if committed is None else " and committed")
    return rep
