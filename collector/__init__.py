"""The global batch collector and the trainer-side reader (see ``docs/collector.md``).

Collector side (no torch): ``Collector``, ``CollectorConfig``, ``EpochFence``,
``admission``. Trainer side (torch): ``collector.reader.BatchReader``,
``collector.bracket.WeightUpdateBracket``, ``collector.importance``. The trainer-side
modules are not imported here, so the collector process never imports torch.
"""

from __future__ import annotations

from collector.admission import Admission, Depths, admission
from collector.config import CollectorConfig
from collector.core import Collector, StepReport
from collector.errors import (
                              BatchTimeout,
                              BracketError,
                              BracketTimeout,
                              CollectorBusy,
                              CollectorError,
)
from collector.fencing import EpochFence

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
