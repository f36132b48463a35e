"""The collector's side of a dataset mixture (``strawq.data.mixture``): each source's staleness
bound and filter, its share of what is trained, and the starvation signal.

* **Staleness.** A group of source ``s`` is judged against ``s``'s ``max_staleness`` (the
  run's η when it has none) wherever the collector judges η: ``eta_mode`` acts on it, and
  a batch's ``over_eta`` names it. A source's bound may not exceed the run's: admission is
  sized by the run's η, and the producers apply the run's η to partial tasks at claim.
* **Filter.** A source's ``filter(task, rewards) -> reason | None`` (the contract of the
  producers' ``plugins.filter``) is applied when a ready group is taken into a batch (its
  summary is read then anyway); a reason drops the group with that reason, recorded like
  every drop (``dropped/``, ``collector/dropped/<reason>``), and the batch takes the next
  ready group in its place. A filter that raises keeps the group, logged.
* **Shares.** Every trained group counts for its source: groups and trained tokens (loss
  tokens), in total and over the last ``STARVATION_WINDOW_BATCHES`` batches.
* **Starvation.** Over the window, a source is *starved* when its share of the trained
  groups falls below its weight by more than three standard deviations of a binomial draw
  of that many groups (so a short window or a small weight is not called starved by
  chance), once the window holds ``STARVATION_MIN_BATCHES`` batches. The reason is what
  the source lost in the same window: ``filtered`` (its filter's drops make up at least half
  the shortfall), else ``stale`` (its η drops and regenerations do), else ``skipped`` (rows
  the history's zero-variance rule left out of the releases do: ``queue.skip_zero_variance``,
  ``strawq.data.prompt_policy``), else ``slow`` (its groups are still generating: longer
  responses, or a slower engine). The signal does not change what is released: the
  mixture's rows are released in its weights whatever happens to them, less the rows the
  history's rule skips, which are not replaced by other rows of their source
  (``docs/datasets.md``, "Mixtures").
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from strawq.collector.hooks import CollectorHooks
from strawq.data.dataset import Dataset
from strawq.data.mixture import Mixture
from strawq.data.planner import Origin
from strawq.dotted import resolve
from strawq.errors import ConfigError
from strawq.ondisk.names import TASK_IDS, TaskName, validate_id

log = logging.getLogger(__name__)

#: batches of trained groups the shares and the starvation signal look back over
STARVATION_WINDOW_BATCHES = 8
#: batches the window must hold before a source can be called starved
STARVATION_MIN_BATCHES = 2
#: standard deviations below its expected count at which a source is starved
STARVATION_SIGMAS = 3.0

FilterFn = Callable[[dict[str, Any], list[float]], "str | None"]


def task_index(task_id: str) -> int | None:
    """The dataset index of a dataset task's id (``i<index>``), None for other ids."""
    return TASK_IDS.parse(task_id)


class MixtureBook(CollectorHooks):
    """One collector's accounting of a mixture's sources: a collector hook
    (``strawq.collector.hooks``) for their η, filters, shares and starvation."""

    def __init__(self, mixture: Mixture, *, run_max_staleness: int | None,
                 batch_groups: int) -> None:
        self.mixture = mixture
        self.names = [s.name for s in mixture.sources]
        self.weights = dict(mixture.weights)
        for s in mixture.sources:
            if (s.max_staleness is not None and run_max_staleness is not None
                    and s.max_staleness > run_max_staleness):
                raise ConfigError(
                    f"mixture source {s.name!r}: max_staleness {s.max_staleness} is over the "
                    f"run's collector.max_staleness {run_max_staleness}; a source's bound may "
                    f"only be tighter (admission and the producers use the run's): lower it, "
                    f"or raise the run's")
        self.eta = {s.name: s.max_staleness for s in mixture.sources
                    if s.max_staleness is not None}
        self.filters: dict[str, FilterFn] = {
            s.name: resolve(s.filter, what=f"mixture source {s.name!r} filter", arity=2)
            for s in mixture.sources if s.filter is not None}
        self.window_groups = STARVATION_WINDOW_BATCHES * batch_groups
        self.min_groups = STARVATION_MIN_BATCHES * batch_groups
        #: (source, kind, loss tokens) of the newest events, kind trained / filtered / stale
        #: / skipped
        self.events: deque[tuple[str, str, int]] = deque()
        self._trained_in_window = 0
        self.trained_groups: Counter[str] = Counter()
        self.trained_tokens: Counter[str] = Counter()
        self.filtered: Counter[str] = Counter()
        self.stale: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        #: the sources starved at the last ``starved()``, with the reason
        self.starving: dict[str, str] = {}
        #: where a task index comes from: the release planner's ``origin`` over the
        #: feeder's passes (``Collector`` sets it once its feeder exists); until then, a
        #: run of one pass from task index 0
        self.origin: Callable[[int], Origin | None] = \
            lambda index: Origin(0, *mixture.locate_row(index))

    def source(self, task_id: str) -> str | None:
        """The source of a dataset task (None: not a dataset task, or not yet known)."""
        index = task_index(task_id)
        origin = self.origin(index) if index is not None else None
        return origin.source if origin is not None else None

    def max_staleness(self, task_id: str, default: int | None) -> int | None:
        """η for this task's group: its source's, else ``default`` (the run's)."""
        src = self.source(task_id)
        return self.eta.get(src, default) if src is not None else default

    # -- filters --------------------------------------------------------------------------
    # -- the collector's hooks ----------------------------------------------------------------
    @property
    def tightens_eta(self) -> bool:
        return bool(self.eta)

    def eta_of(self, task_id: str, default: int | None) -> int | None:
        return self.max_staleness(task_id, default)

    def drop_verdict(self, name: TaskName, summary: Mapping[str, Any]
                     ) -> tuple[str, str] | None:
        reason = self.filter(name, summary)
        if reason is None:
            return None
        return reason, f"mixture source {self.source(name.id)!r} filter: {reason}"

    def filter(self, name: TaskName, summary: Mapping[str, Any]) -> str | None:
        """The drop reason the group's source's filter gives, or None to keep it."""
        src = self.source(name.id)
        fn = self.filters.get(src) if src is not None else None
        if fn is None or src is None:
            return None
        rewards = [float(r) for r in summary.get("rewards") or [] if isinstance(r, (int, float))
                   and not isinstance(r, bool)]
        task = {"id": name.id, "index": summary.get("index"), "source": src}
        try:
            reason = fn(task, rewards)
            if reason is not None:
                validate_id(reason, "filter drop reason")
        except Exception as exc:  # a user's filter: the group is kept, the error logged
            log.warning("mixture source %r: filter failed on %s (%r); keeping the group", src,
                        name.id, exc)
            return None
        if reason is not None:
            self._event(src, "filtered", 0)
            self.filtered[src] += 1
        return reason

    # -- what happened ----------------------------------------------------------------------
    def on_stale(self, task_ids: Iterable[str]) -> None:
        """Groups dropped or sent back to generation for η."""
        for tid in task_ids:
            src = self.source(tid)
            if src is not None:
                self._event(src, "stale", 0)
                self.stale[src] += 1

    def on_skipped(self, task_ids: Iterable[str]) -> None:
        """Rows the history's zero-variance rule left out of a release (not generated)."""
        for tid in task_ids:
            src = self.source(tid)
            if src is not None:
                self._event(src, "skipped", 0)
                self.skipped[src] += 1

    def on_trained(self, names: Iterable[TaskName], summaries: Iterable[Mapping[str, Any]]
                   ) -> None:
        """A published batch's groups."""
        for n, s in zip(names, summaries, strict=True):
            src = self.source(n.id)
            if src is None:
                continue
            tokens = sum(int(t) for t in s.get("loss_tokens") or [])
            self._event(src, "trained", tokens)
            self.trained_groups[src] += 1
            self.trained_tokens[src] += tokens

    def _event(self, source: str, kind: str, tokens: int) -> None:
        self.events.append((source, kind, tokens))
        self._trained_in_window += kind == "trained"
        while self._trained_in_window > self.window_groups and self.events:
            if self.events.popleft()[1] == "trained":
                self._trained_in_window -= 1

    # -- the signal ---------------------------------------------------------------------------
    def window(self) -> dict[str, dict[str, int]]:
        """Per source, over the window: trained groups, trained tokens, filtered, stale,
        skipped."""
        out = {n: {"trained": 0, "tokens": 0, "filtered": 0, "stale": 0, "skipped": 0}
               for n in self.names}
        for src, kind, tokens in self.events:
            row = out[src]
            row[kind] += 1
            if kind == "trained":
                row["tokens"] += tokens
        return out

    def starved(self) -> dict[str, str]:
        """The starved sources and why (``filtered``, ``stale``, ``skipped`` or ``slow``)."""
        win = self.window()
        n = sum(r["trained"] for r in win.values())
        out: dict[str, str] = {}
        if n >= self.min_groups:
            for src, row in win.items():
                w = self.weights[src]
                expected = w * n
                shortfall = expected - row["trained"]
                if shortfall <= STARVATION_SIGMAS * math.sqrt(n * w * (1 - w)):
                    continue
                out[src] = ("filtered" if row["filtered"] >= shortfall / 2 else
                            "stale" if row["stale"] >= shortfall / 2 else
                            "skipped" if row["skipped"] >= shortfall / 2 else "slow")
        for src, why in out.items():
            if self.starving.get(src) != why:
                log.warning("mixture source %r is starved (%s): %d of the last %d trained "
                            "groups against a weight of %.3f", src, why,
                            win[src]["trained"], n, self.weights[src])
        self.starving = out
        return out

    def metrics(self) -> dict[str, Any]:
        """``dataset/<source>/...``: weight, shares (window and run), totals, starvation."""
        starved = self.starved()
        win = self.window()
        n_win = sum(r["trained"] for r in win.values())
        t_win = sum(r["tokens"] for r in win.values())
        n_all = sum(self.trained_groups.values())
        t_all = sum(self.trained_tokens.values())
        out: dict[str, Any] = {}
        for src in self.names:
            p = f"dataset/{src}"
            out[f"{p}/weight"] = round(self.weights[src], 6)
            out[f"{p}/group_share"] = win[src]["trained"] / n_win if n_win else 0.0
            out[f"{p}/token_share"] = win[src]["tokens"] / t_win if t_win else 0.0
            out[f"{p}/group_share_total"] = self.trained_groups[src] / n_all if n_all else 0.0
            out[f"{p}/token_share_total"] = self.trained_tokens[src] / t_all if t_all else 0.0
            out[f"{p}/trained_groups_total"] = self.trained_groups[src]
            out[f"{p}/trained_tokens_total"] = self.trained_tokens[src]
            out[f"{p}/filtered_total"] = self.filtered[src]
            out[f"{p}/stale_total"] = self.stale[src]
            out[f"{p}/skipped_total"] = self.skipped[src]
            out[f"{p}/starved"] = int(src in starved)
            out[f"{p}/starved_reason"] = starved.get(src, "")
        return out


def mixture_book(dataset: Dataset, *, run_max_staleness: int | None,
                 batch_groups: int) -> MixtureBook | None:
    """The book of a mixture dataset (None for one dataset)."""
    if not isinstance(dataset, Mixture):
        return None
    return MixtureBook(dataset, run_max_staleness=run_max_staleness, batch_groups=batch_groups)
