"""The collector's hooks: optional behaviours plugged in at the points where the collector
decides about groups, instead of branches inside ``Collector``.

A hook sees:

* ``eta_of(task_id, default)``: the η a task's group is judged by (``default``: the run's);
  ``tightens_eta`` says whether it may differ from the run's for some group;
* ``drop_verdict(name, summary)``: as a ready group is taken into a batch, a reason (and a
  message) to drop it instead, or None;
* ``on_stale``, ``on_skipped``, ``on_trained``: the groups η dropped or regenerated, the
  rows a release skipped (the history's rule), the groups of a published batch;
* ``metrics()``: values for the collector's metrics line.

``CollectorHooks`` is the no-op base; ``HookChain`` composes several in order (the first
verdict drops, the tightest η wins). A dataset mixture's book
(``strawq.collector.mixing.MixtureBook``) is one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from strawq.ondisk.names import TaskName


class CollectorHooks:
    """A hook that does nothing: subclasses override what they take part in."""

    @property
    def tightens_eta(self) -> bool:
        """``eta_of`` may give some group a bound other than the run's."""
        return False

    def eta_of(self, task_id: str, default: int | None) -> int | None:
        return default

    def drop_verdict(self, name: TaskName, summary: Mapping[str, Any]
                     ) -> tuple[str, str] | None:
        return None

    def on_stale(self, task_ids: Iterable[str]) -> None:
        return None

    def on_skipped(self, task_ids: Iterable[str]) -> None:
        return None

    def on_trained(self, names: Sequence[TaskName], summaries: Sequence[Mapping[str, Any]]
                   ) -> None:
        return None

    def metrics(self) -> dict[str, Any]:
        return {}


class HookChain(CollectorHooks):
    """Several hooks as one, called in order."""

    def __init__(self, hooks: Iterable[CollectorHooks] = ()) -> None:
        self.hooks = list(hooks)

    @property
    def tightens_eta(self) -> bool:
        return any(h.tightens_eta for h in self.hooks)

    def eta_of(self, task_id: str, default: int | None) -> int | None:
        bounds = [h.eta_of(task_id, default) for h in self.hooks if h.tightens_eta]
        known = [b for b in bounds if b is not None]
        return min(known) if known else default

    def drop_verdict(self, name: TaskName, summary: Mapping[str, Any]
                     ) -> tuple[str, str] | None:
        for h in self.hooks:
            verdict = h.drop_verdict(name, summary)
            if verdict is not None:
                return verdict
        return None

    def on_stale(self, task_ids: Iterable[str]) -> None:
        ids = list(task_ids)
        for h in self.hooks:
            h.on_stale(ids)

    def on_skipped(self, task_ids: Iterable[str]) -> None:
        ids = list(task_ids)
        for h in self.hooks:
            h.on_skipped(ids)

    def on_trained(self, names: Sequence[TaskName], summaries: Sequence[Mapping[str, Any]]
                   ) -> None:
        for h in self.hooks:
            h.on_trained(names, summaries)

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for h in self.hooks:
            out.update(h.metrics())
        return out
