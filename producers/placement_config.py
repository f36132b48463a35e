"""Configuration of the producer placement: the sizing and deadlines of the producer fleet.

Ray-free on purpose: a run config with a ``placement`` section loads (and is checked) on
any host, Ray installed or not; only ``strawq.producers.placement`` imports Ray. The fleet
(``strawq.producers.placement_plan.ProducerFleet``) reads these values from here and G from
the run's ``queue.group_size``: each is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass

from strawq.config import Config
from strawq.errors import ConfigError
from strawq.ondisk.names import validate_id


@dataclass(frozen=True, kw_only=True)
class PlacementConfig(Config):
    """One pinned, named producer actor per eligible Ray node, and the slot budget
    K = floor(C*E/G) split over them (``strawq.producers.budget``)."""

    #: Run id used in actor names (``[A-Za-z0-9_.-]``).
    run_id: str
    #: C: concurrent requests per engine (the engines' ``--max-running-requests``).
    concurrency: int
    #: E: number of engines.
    engines: int
    #: Ray namespace of the named actors (None: the driver's).
    namespace: str | None = None
    #: CPUs each producer actor reserves (slime: 1); a node needs at least this many.
    num_cpus: float = 1.0
    #: Seconds between reconcile passes of ``start_background``.
    reconcile_interval_s: float = 5.0
    #: Deadline of each actor call (start, set_slots, stats).
    call_timeout_s: float = 60.0
    #: Deadline of a producer's stop (it parks its groups first).
    stop_timeout_s: float = 120.0

    def validate(self) -> None:
        validate_id(self.run_id, "run id")
        for name in ("concurrency", "engines"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PlacementConfig.{name} must be >= 1, got "
                                  f"{getattr(self, name)}")
        if self.num_cpus < 0:
            raise ConfigError(f"PlacementConfig.num_cpus must be >= 0, got {self.num_cpus}")
        for name in ("reconcile_interval_s", "call_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"PlacementConfig.{name} must be > 0, got "
                                  f"{getattr(self, name)}")
