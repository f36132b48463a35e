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

Nothing is imported here until a name is used: the collector process never imports torch
(the trainer-side modules are not imported here), and the trainer side never loads the
collector process through this package. The trainer's errors (``BatchTimeout``,
``BracketTimeout``, ``BracketError``) are ``strawq.errors``'s, re-exported here.
"""

from __future__ import annotations

if __name__ != "strawq.collector":  # one identity per module: see docs/architecture.md
    raise ImportError(
        f"the folder collector/ is the package strawq.collector; import it by that name, not as "
        f"{__name__!r} (that would load a second, distinct copy of every module in it)"
    )


from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strawq.collector.admission import Admission, Depths
    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.collector.report import StepReport
    from strawq.collector.errors import (BatchTimeout, BracketError, BracketTimeout,
                                         CollectorBusy, CollectorError, RunFinished)
    from strawq.collector.fencing import EpochFence

#: name -> the module that defines it. Loaded on first use (PEP 562), so importing the
#: trainer library (``strawq.collector.trainer``) or an integration, which runs this
#: package's ``__init__`` first, does not load the collector process.
_EXPORTS = {
    "Admission": "admission", "Depths": "admission",
    "CollectorConfig": "config", "Collector": "core", "StepReport": "report",
    "BatchTimeout": "errors", "BracketError": "errors", "BracketTimeout": "errors",
    "CollectorBusy": "errors", "CollectorError": "errors", "RunFinished": "errors",
    "EpochFence": "fencing",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'strawq.collector' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"strawq.collector.{module}"), name)


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
    "RunFinished",
    "StepReport",
]
