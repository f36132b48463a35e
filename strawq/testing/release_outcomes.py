"""The release model, what happens to a released row: its group's rewards, the producers'
zero-variance drop, a source's filter, and the zero-variance skip rule (``Behaviour``,
``outcome``, ``skip_reason``).

Part of ``strawq.testing.release_model`` (the statement, and every public name).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from strawq.testing.release_passes import ModelRow, ReleaseModel

#: the outcome of a released row whose group was trained
TRAINED = "trained"
#: the reason of a producer's drop of a group whose rewards all agreed
ZERO_VARIANCE = "zero_variance"


@dataclass(frozen=True)
class Behaviour:
    """What the run does with released rows: the rewards of each row's group (the test's
    choice), the producers' zero-variance drop, the skip rule."""

    #: the group's rewards (one per sample; None: a reward that failed)
    rewards: Callable[[ModelRow], Sequence[float | None]]
    #: producers drop a group whose rewards all agree (reason ``zero_variance``)
    zero_variance_drop: bool = False
    skip_zero_variance: bool = False
    #: ``QueueConfig.zero_variance_revisit_epochs``
    revisit: int = 2


def valid(reward: float | None) -> bool:
    return isinstance(reward, (int, float)) and not isinstance(reward, bool) \
        and math.isfinite(reward)


def agreeing(rewards: Sequence[float | None]) -> bool:
    """Two or more rewards, every one valid, all equal: no advantage to train on."""
    return len(rewards) >= 2 and all(valid(r) for r in rewards) and len(set(rewards)) == 1


def outcome(model: ReleaseModel, behaviour: Behaviour, row: ModelRow) -> str:
    """``TRAINED``, or the reason the released row's group is dropped."""
    rewards = list(behaviour.rewards(row))
    if behaviour.zero_variance_drop and agreeing(rewards):
        return ZERO_VARIANCE
    fn = model.sources[row.source].filter
    if fn is not None and not model.plain:
        task: dict[str, Any] = {"id": f"i{row.index}", "index": row.index, "source": row.name}
        reason = fn(task, [float(r) for r in rewards if r is not None and valid(r)])
        if reason is not None:
            return reason
    return TRAINED


def skip_reason(model: ReleaseModel, behaviour: Behaviour, row: ModelRow,
                attempts: Iterable[ModelRow], *, newest_only: bool = True) -> str | None:
    """Why the rule skips ``row`` given earlier ``attempts`` (released rows whose groups
    have rewards), or None when it releases it. ``newest_only=False``: any agreeing attempt
    in the window justifies a skip (the history may not hold the newest yet)."""
    if not behaviour.skip_zero_variance or row.pass_no < 1:
        return None
    earlier = sorted((a for a in attempts if a.key == row.key and a.pass_no < row.pass_no),
                     key=lambda a: a.index, reverse=True)
    for a in earlier:
        ago = model.ago(row.key, a.pass_no, row.pass_no)
        if agreeing(behaviour.rewards(a)) and ago < behaviour.revisit:
            return (f"its attempt in pass {a.pass_no} (task index {a.index}, {ago} "
                    f"appearance(s) ago) had rewards {list(behaviour.rewards(a))}")
        if newest_only:
            return None
    return None
