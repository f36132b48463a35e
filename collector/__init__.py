"""The global batch collector, the trainer-side library and the trainer integrations.

Three sub-parts (see ``docs/collector.md``, ``docs/architecture.md``):

* the collector process (no torch), the modules directly in this package: ``Collector``
  (``core``), ``CollectorConfig`` (``config``), ``EpochFence`` (``fencing``),
  ``admission``, ``ordering``, ``mixing``, ``resume``, ``cli``, ``errors``;
* ``strawq.collector.trainer`` — the trainer-side library (torch):
  ``strawq.collector.trainer.reader.BatchReader``,
  ``strawq.collector.trainer.bracket.WeightUpdateBracket``,
  ``strawq.collector.trainer.importance``; it never imports the collector process;
* ``strawq.collector.integrations`` — adapters for other trainers (``slime``, ``verl``,
  ``megatron``), over the trainer library.

The trainer-side modules are not imported here, so the collector process never imports
torch. The trainer's errors (``BatchTimeout``, ``BracketTimeout``, ``BracketError``) are
``strawq.errors``'s, re-exported here.
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
