"""The group-slot budget: K = floor(C*E/G) slots split over W producers by divmod.

C = concurrent requests per engine, E = engines, G = samples per prompt group,
W = eligible producer nodes. Slots are *groups*; producers count them in trajectories
(``trajectory_slots``) so that one long-tail sample never blocks a new claim once a
group's worth of trajectories is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from strawq.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    concurrency: int
    engines: int
    group_size: int
    producers: int
    #: group slots of each producer, in producer order
    slots: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.slots)

    def trajectory_slots(self, i: int) -> int:
        return self.slots[i] * self.group_size


def split_budget(concurrency: int, engines: int, group_size: int, producers: int) -> Budget:
    """K = floor(C*E/G) split by divmod(K, W); the first ``remainder`` producers get +1."""
    for name, v in (("concurrency per engine (C)", concurrency), ("engines (E)", engines),
                    ("group size (G)", group_size), ("producers (W)", producers)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if concurrency * engines < producers * group_size:
        raise ConfigError(
            f"not enough engine concurrency for one group per producer: C*E = {concurrency}*"
            f"{engines} = {concurrency * engines} < W*G = {producers}*{group_size} = "
            f"{producers * group_size}; raise the engines' concurrency, add engines, or run "
            "fewer producer nodes")
    k = concurrency * engines // group_size
    base, extra = divmod(k, producers)
    return Budget(concurrency, engines, group_size, producers,
                  tuple(base + (1 if i < extra else 0) for i in range(producers)))
