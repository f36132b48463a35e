"""Admission applied: the feeder releases as many new prompt groups as admission allows.

``admit(rep, ...)`` judges the pass's depths (``strawq.collector.admission.admission``),
then, fenced, releases up to its capacity in ``release_batch`` steps through the
``Feeder`` and counts what it released into the pass's report (``pending`` included).
"""

from __future__ import annotations

from strawq.collector.admission import Depths, admission
from strawq.collector.config import CollectorConfig
from strawq.collector.fencing import EpochFence
from strawq.collector.report import StepReport
from strawq.data.feeder import Feeder


def admit(rep: StepReport, feeder: Feeder, fence: EpochFence, config: CollectorConfig, *,
          release_batch: int) -> None:
    """Decide this pass's admission (``rep.admission``) and release what it allows."""
    cfg = config
    rep.admission = admission(rep.depths, batch_groups=cfg.batch_groups,
                              max_staleness=cfg.max_staleness,
                              batches_per_version=cfg.batches_per_version,
                              max_running=cfg.max_running, max_ready=cfg.max_ready,
                              window=cfg.admission_batches,
                              in_training=rep.progress.in_training)
    want = rep.admission.capacity
    if want <= 0 or feeder.exhausted:
        return
    fence.check()
    while want > 0 and not feeder.exhausted:
        n = feeder.release(min(want, release_batch))
        if n == 0:
            break
        rep.released += n
        want -= n
    rep.exhausted = feeder.exhausted
    rep.depths = Depths(pending=rep.depths.pending + rep.released,
                        partial=rep.depths.partial, leased=rep.depths.leased,
                        ready=rep.depths.ready, batched=rep.depths.batched)
