"""The global batch collector and the trainer-side reader (see ``docs/collector.md``).

Collector side (no torch): ``Collector``, ``CollectorConfig``, ``EpochFence``,
``admission``. Trainer side (torch): ``strawq.collector.reader.BatchReader``,
``strawq.collector.bracket.WeightUpdateBracket``, ``strawq.collector.importance``. The trainer-side
modules are not imported here, so the collector process never imports torch.
"""

from __future__ import annotations

if __name__ != "strawq.collector":  # one identity per module: see docs/architecture.md
    raise ImportError(
        f"the folder collector/ is the package strawq.collector; import it by that name, not as "
        f"{__name__!r} (that would load a second, distinct copy of every module in it)"
    )


from strawq.collector.admission import Admission, Depths, admission
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector, StepReport
from strawq.collector.errors import (
                              BatchTimeout,
                              BracketError,
                              BracketTimeout,
                              CollectorBusy,
                              CollectorError,
)
from strawq.collector.fencing import EpochFence

__all__ = [
    "Admission",
    "BatchTimeout",
    "BracketError",
    "BracketTimeout",
    "Collector",
    "CollectorBusy",
    "CollectorConfig",
    "CollectorError",
    "Depths",
    "EpochFence",
    "StepReport",
    "admission",
]
