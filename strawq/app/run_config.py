"""The root configuration of one run: every section nested under one object, each value once.

torchtitan's job config is the model: one frozen tree whose sections are the components'
own config classes, loaded from one file (``run.json``) plus ``--set section.key=value``
overrides (``strawq.config.load_config``), validated in one pass. A misspelt key or a value
of the wrong type is one line naming its place (``run config.producer.engine.client: unknown
key(s) ['max_retry']; known keys are [...]``).

Sections:

    queue      strawq.config.QueueConfig                      strawq init, the run's meta
    collector  strawq.collector.config.CollectorConfig        strawq collector
    producer   strawq.producers.producer_config.ProducerConfig   (in sections; the engine
               client is ``producer.engine.client``, a ClientConfig)
    placement  strawq.producers.placement_config.PlacementConfig   the driver's placement

**Each value is held once.** G, the samples per prompt group, lives in ``queue.group_size``
and nowhere else: ``ProducerConfig`` and ``PlacementConfig`` have no such field (a producer
reads G from the run it joins, ``ProducerPlacement`` from the run or from
``RunConfig.group_size``). A file that writes ``group_size`` in the producer or placement
section is refused with both places named.

This module imports no Ray, torch or HTTP client: ``PlacementConfig`` lives in a Ray-free
module (a run config with placement loads where Ray is not installed), and ``producer``
lives in a module that imports the HTTP client, so its class is imported only when a run
config has that section.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from strawq.collector.config import CollectorConfig
from strawq.config import Config, QueueConfig
from strawq.errors import ConfigError

from strawq.producers.placement_config import PlacementConfig

if TYPE_CHECKING:
    from strawq.producers.producer_config import ProducerConfig

#: Sections that may not restate a value held elsewhere: section -> (key, where it lives).
_HELD_ELSEWHERE = {"producer": ("group_size", "queue.group_size"),
                   "placement": ("group_size", "queue.group_size")}


@dataclass(frozen=True, kw_only=True)
class RunConfig(Config):
    """One run: the queue, the collector, the producers and their placement."""

    _lazy_types: ClassVar[Mapping[str, str]] = {
        "ProducerConfig": "strawq.producers.producer_config:ProducerConfig",
    }

    #: The queue, recorded in ``run.meta`` at ``strawq init``; holds G (``group_size``).
    queue: QueueConfig = field(default_factory=QueueConfig)
    #: The global batch collector (admission, staleness bound, batches).
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    #: The producers (one per node), with their engine client in ``producer.engine.client``;
    #: None on hosts that run no producer.
    producer: ProducerConfig | None = None
    #: Placement of the producer actors and the slot budget K = floor(C*E/G); None when
    #: producers are started by hand.
    placement: PlacementConfig | None = None

    @property
    def group_size(self) -> int:
        """G, samples per prompt group (held in ``queue.group_size``)."""
        return self.queue.group_size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> RunConfig:
        """Build the run config; G written in a section besides ``queue`` is refused."""
        where = where or "run config"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping, found {type(data).__name__}")
        queue = data.get("queue", {})
        g = queue.get("group_size", QueueConfig.group_size) if isinstance(queue, Mapping) \
            else None
        for section, (key, home) in _HELD_ELSEWHERE.items():
            part = data.get(section)
            if isinstance(part, Mapping) and key in part:
                raise ConfigError(
                    f"{where}: {section}.{key} = {part[key]!r} restates {home} = {g!r}; G is "
                    f"held once, in {home}: remove {key} from the {section} section")
        return super().from_dict(data, where=where)

    def validate(self) -> None:
        g = self.queue.group_size
        p = self.placement
        if p is not None and p.concurrency * p.engines < g:
            raise ConfigError(f"placement: C*E = {p.concurrency}*{p.engines} = "
                              f"{p.concurrency * p.engines} < G = {g} (queue.group_size): not "
                              f"one group fits the engines; raise the concurrency or add engines")
        margin = None if self.producer is None else self.producer.timing.lease_margin_s
        if margin is not None and margin >= self.queue.lease_timeout_s:
            raise ConfigError(f"producer.timing.lease_margin_s ({margin}) must be below "
                              f"queue.lease_timeout_s ({self.queue.lease_timeout_s})")


def slots_explicit(config_path: str, overrides: Sequence[str]) -> bool:
    """Whether the run config file or an override sets ``producer.budget.slots``. A producer
    section written for ``strawq producer --config`` leaves the key out when not: the
    producer then derives its slots (``--concurrency``) or asks for them (``--slots``)
    instead of taking the class default of one slot in silence."""
    if any(o.split("=", 1)[0].strip() == "producer.budget.slots" for o in overrides):
        return True
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    budget = (raw.get("producer") or {}).get("budget") if isinstance(raw, dict) else None
    return isinstance(budget, dict) and "slots" in budget
