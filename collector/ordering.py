"""Staleness-first order of ready groups (docs/design.md, invariant 5) and GRPO advantages.

``BatchStore.scan_ready()`` lists ready groups by (minimum token version, dataset index),
because that is how their names sort. The trainer must get them oldest version first and
FIFO on ties, where FIFO means *the order the collector first saw them ready* — not dataset
order, which would let an early-indexed late finisher overtake groups that waited longer.
``StalenessOrder`` assigns each ready group a first-observation number the first time a
scan shows it and sorts by (min version, that number). After a collector restart, the
groups already ready are numbered in scan order (dataset order within a version): the
finish order of work done before the crash is not recorded on disk.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from strawq.ondisk.names import TaskName


class StalenessOrder:
    """First-observation FIFO within a min version. Memory: one int per ready group."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._next = itertools.count()
        #: groups observed ready so far (each counted once): feeds ``collector/groups_per_s``
        self.observed_total = 0

    def order(self, ready: Sequence[TaskName]) -> list[TaskName]:
        """``ready`` (a full scan) sorted staleness-first; forgets groups no longer ready."""
        live = {n.id for n in ready}
        for gone in [k for k in self._seen if k not in live]:
            del self._seen[gone]
        for n in ready:  # scan order: dataset order within a version, for first sightings
            if n.id not in self._seen:
                self._seen[n.id] = next(self._next)
                self.observed_total += 1
        return sorted(ready, key=lambda n: (n.version, self._seen[n.id]))

    def __len__(self) -> int:
        return len(self._seen)

    def forget(self, task_ids: Sequence[str]) -> None:
        for t in task_ids:
            self._seen.pop(t, None)


def group_advantages(rewards: Sequence[float | None], mode: str = "grpo",
                     eps: float = 1e-6) -> list[float]:
    """Per-sample advantages of one group from its rewards.

    ``grpo``: (r − mean) / (std + eps) with the unbiased std (verl's GRPO); ``grpo_mean_only``:
    r − mean (Dr. GRPO); ``none``: the raw reward. A sample without a reward (``None``, e.g. a
    failed one) is left out of the statistics and gets advantage 0.
    """
    if mode == "none":
        return [0.0 if r is None else float(r) for r in rewards]
    have = np.array([r for r in rewards if r is not None], dtype=np.float64)
    if have.size == 0:
        return [0.0] * len(rewards)
    mean = float(have.mean())
    std = float(have.std(ddof=1)) if have.size > 1 else 0.0
    out = []
    for r in rewards:
        if r is None:
            out.append(0.0)
        elif mode == "grpo":
            out.append((float(r) - mean) / (std + eps))
        else:
            out.append(float(r) - mean)
    return out
