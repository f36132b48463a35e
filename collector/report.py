"""What one pass of the collector did (``Collector.step`` returns it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from strawq.collector.admission import Admission, Depths, Progress
from strawq.collector.trainer.packing import PackReport
from strawq.delivery.batches import GcReport
from strawq.tasks.grantor import ScanResult


@dataclass
class StepReport:
    version: int = 0
    depths: Depths = field(default_factory=Depths)
    admission: Admission | None = None
    released: int = 0
    published: list[int] = field(default_factory=list)
    dropped_stale: list[str] = field(default_factory=list)
    requeued_stale: list[str] = field(default_factory=list)
    #: groups published although over η (``eta_mode="train"``): kept, trained, counted
    stale_trained: list[str] = field(default_factory=list)
    #: groups a mixture source's filter dropped as their batch formed (``collector.mixing``)
    filtered: list[str] = field(default_factory=list)
    scan: ScanResult | None = None
    gc: GcReport | None = None
    #: unacked batches (not refused): bounded by ``max_prefetch_batches``
    prefetched: int = 0
    #: the trainer's position against the current version (``admission.Progress``)
    progress: Progress = field(default_factory=Progress)
    #: what packing the published batches' rank shards cost (``pack_ranks``), one per shard set
    packed: list[PackReport] = field(default_factory=list)
    #: batches trained before the next one formed: ``progress.ahead`` + formed this pass
    ahead: int = 0
    exhausted: bool = False

    @property
    def drained(self) -> bool:
        """Nothing left to do: dataset exhausted, nothing running, ready or unacked."""
        d = self.depths
        return self.exhausted and d.running == 0 and d.ready == 0 and self.prefetched == 0
