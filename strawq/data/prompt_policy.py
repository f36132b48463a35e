"""Which prompts a release takes, and in what order, from the per-prompt history.

Two admission rules, each off by default (``QueueConfig.skip_zero_variance``,
``QueueConfig.longest_first``), for runs of several passes over the dataset
(``QueueConfig.num_epochs``). A row is a new task id each pass; the history of the same
row — the same source and row in it — in earlier passes is found under the ids the release
planner gives (``strawq.data.planner.ReleasePlanner.earlier_ids``), newest first. Each earlier
appearance of the row counts as one pass ago.

* **Zero-variance skip.** A row whose newest attempt with rewards (a trained group, or one
  a filter dropped) had two or more samples, every reward valid and all equal (all solved
  or all failed: no advantage, nothing to learn), is skipped by the next
  ``zero_variance_revisit_epochs - 1`` passes and released again after that: a policy that
  has moved may no longer solve (or fail) it every time. A skip is recorded in the history
  (status ``skipped``, with the reward the group agreed on) before the release commits, so
  ``strawq inspect RUN history`` counts what was left out and by which reward: the bias the
  rule introduces (the trained mix drifts away from the dataset's hard and easy ends) is
  visible, not silent. A row with no attempt with rewards in the history (not yet
  recorded, or dropped before its rewards, e.g. for η) is released. A skipped row is not
  replaced by another: the skip overrides a mixture's weights.
* **Longest-predicted-first.** Within a release the rows are staged in the order of their
  predicted response length, longest first (the mean length of their newest recorded
  attempt; a row with none gets the run's median, over every prompt in the history), so the
  tail starts early.
  The rows keep their task ids and take the release's order numbers in that order, and each
  task's key carries its release's weight version and the length it was ranked by (its
  claim rank, ``strawq.ondisk.names.fresh_key``): producers claim the fresh tasks they see
  by release version, then longest predicted first across releases, not only within one
  (``strawq.tasks.claims``). The version comes first because the collector bounds a fresh
  task's oldest token by the version it was released at (``strawq.collector.deadlines``):
  a task left from an earlier version is due earlier, whatever its length.

Both read a history snapshot the feeder refreshes at most every ``HISTORY_REFRESH_S``: a
release is judged on what gc had recorded by then (a few seconds behind at most).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from strawq.data.history import PromptHistory, PromptStats, rewards_agreed
from strawq.ondisk.names import dataset_task_id

#: seconds between re-reads of the history by one feeder
HISTORY_REFRESH_S = 30.0


@dataclass(frozen=True)
class Skip:
    index: int
    #: the reward every sample of the newest attempt with rewards agreed on
    reward: float | None
    #: passes since that group's pass
    epochs_ago: int


@dataclass
class Plan:
    """A release's rows in staging order, and the rows it skips."""

    order: list[int] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    #: predicted length per ordered index (None: no history, the median was used)
    predicted: dict[int, float | None] = field(default_factory=dict)
    #: the length each ordered index was ranked by (its prediction, or the median): its
    #: task's claim rank (``strawq.ondisk.names.fresh_key``); empty: dataset order
    ranked: dict[int, float] = field(default_factory=dict)
    #: the weight version the release is made at (its claim ranks' first part; the feeder
    #: reads it for a ranked release)
    version: int = 0


def _newest_rewarded(stats: PromptStats) -> dict[str, Any] | None:
    """The newest attempt whose group of two or more samples got rewards (one valid reward
    or more), trained or dropped: a group a filter dropped (the ``zero_variance`` filter,
    a mixture source's) was scored all the same, and its rewards say as much about the row
    as a trained group's. An attempt without rewards (dropped for η, expired, all its
    rewards failed) says nothing about them."""
    rows = [r for r in stats.last if r.get("status") in ("trained", "dropped")
            and int(r.get("samples") or 0) >= 2
            and isinstance(r.get("reward_mean"), (int, float))]
    return rows[-1] if rows else None


def zero_variance_skip(index: int, earlier: Sequence[Sequence[str]], history: PromptHistory,
                       revisit_epochs: int) -> Skip | None:
    """The skip of ``index`` by the zero-variance rule, or None to release it. ``earlier``:
    per earlier pass the row came up in, newest first, the task ids it had there (newest
    first: a source that wraps under ``all_exhausted`` gives a row twice in one pass); the
    pass before is one appearance ago."""
    for ago, tids in enumerate(earlier, start=1):
        for tid in tids:
            stats = history.get(tid)
            row = _newest_rewarded(stats) if stats is not None else None
            if row is None:
                continue  # skipped, no rewards or not recorded: look further back
            if rewards_agreed(row) and ago < revisit_epochs:
                mean = row.get("reward_mean")
                return Skip(index, float(mean) if isinstance(mean, (int, float)) else None,
                            ago)
            return None
    return None


def predicted_length(earlier: Sequence[Sequence[str]], history: PromptHistory
                     ) -> float | None:
    """The mean response length of the row's newest recorded attempt, or None."""
    for tids in earlier:
        for tid in tids:
            stats = history.get(tid)
            if stats is not None and stats.mean_length is not None:
                return stats.mean_length
    return None


def plan_release(indexes: Sequence[int], earlier: Callable[[int], Sequence[Sequence[str]]],
                 history: PromptHistory | None, *, skip_zero_variance: bool,
                 revisit_epochs: int, longest_first: bool) -> Plan:
    """The plan for a release of the good rows ``indexes`` (ascending) of the current pass;
    ``earlier(index)``: the task ids of the row in each earlier pass it came up in, newest
    first (``zero_variance_skip``; None history: the first pass, nothing to look up)."""
    plan = Plan()
    if history is None:
        plan.order = list(indexes)
        return plan
    ids = {i: earlier(i) for i in indexes}
    keep = []
    for i in indexes:
        skip = zero_variance_skip(i, ids[i], history, revisit_epochs) \
            if skip_zero_variance else None
        if skip is None:
            keep.append(i)
        else:
            plan.skips.append(skip)
    if not longest_first:
        plan.order = keep
        return plan
    pred = {i: predicted_length(ids[i], history) for i in keep}
    fill = history.median_length() or 0.0
    guess = {i: fill if v is None else v for i, v in pred.items()}
    plan.order = sorted(keep, key=lambda i: (-guess[i], i))
    plan.predicted = pred
    plan.ranked = guess
    return plan


def skip_rows(skips: Sequence[Skip]) -> list[dict[str, Any]]:
    """History rows recording ``skips`` (generation -1: never a real attempt's)."""
    now = time.time()
    return [{"id": dataset_task_id(s.index), "gen": -1, "status": "skipped",
             "reason": "zero_variance", "index": s.index, "reward_mean": s.reward,
             "epochs_ago": s.epochs_ago, "samples": 0, "tokens": 0, "at": now}
            for s in skips]
