"""The data-side features together, through the real collector, reader and queue, checked
row by row against the release model (``strawq.testing.release_model``).

Passes (``num_epochs``), mixtures (weights, ``stopping_strategy``, per-source filters), bad
rows, the zero-variance skip (its revisit window, the producers' zero-variance drop),
longest-first and a crash with its resume (queue path or cursor path) each work alone; this
checks them in combination. Hypothesis draws the combination (``@given`` with
``st.data()``: a scenario is drawn up front, then run by one driver,
``tests/collector/release_driver.py``, which ``bench/planner.py`` runs longer): a stateful
machine would draw the steps too, but what is checked here is the whole run against a model
of whole passes, and the steps that matter (the crash point, the collector's sizing) are
part of the scenario. Every released row is checked for its source, source row and pass,
every pass for completeness, every skip for its reason (exactly, in lockstep scenarios, see
the driver), the final cursor for its bases, offsets and unread rows, and each source's
trained groups for the model's exact count.

A fixed number of examples, derandomized, no shrinking (a failure prints its scenario and
its mismatches by kind; ``bench/planner.py`` counts them all), sized to run in well under a
minute on one core.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.collector.release_driver import (Crash, Scenario, SourcePlan, draw_scenario,
                                            report, run_scenario)

T = TypeVar("T")

pytestmark = pytest.mark.slow

#: examples of the combination test (about 0.3 s each here: about 30 s in all)
EXAMPLES = 100


class HypothesisDraw:
    """The driver's ``Draw`` from Hypothesis's interactive data."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integers(self, lo: int, hi: int) -> int:
        return int(self.data.draw(st.integers(lo, hi)))

    def boolean(self) -> bool:
        return bool(self.data.draw(st.booleans()))

    def choice(self, options: Sequence[T]) -> T:
        return self.data.draw(st.sampled_from(list(options)))


def _check(scn: Scenario) -> None:
    with tempfile.TemporaryDirectory(prefix="strawq-release-") as root:
        result = run_scenario(scn, Path(root))
    if result.mismatches:
        pytest.fail("the run disagrees with the release model:\n" + report(result),
                    pytrace=False)


@pytest.mark.timeout(240)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_combinations_release_what_the_model_says(data: st.DataObject) -> None:
    _check(draw_scenario(HypothesisDraw(data)))


def _mixed(rows: int) -> tuple[tuple[str, ...], ...]:
    return (("mixed",),) * rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash", [None, Crash("queue", 5, close=False, restart_producer=True),
                                   Crash("cursor", 6, after=2)])
def test_one_dataset_read_once(crash: Crash | None) -> None:
    """The plain case, with each crash path: every row released, trained once."""
    _check(Scenario((SourcePlan("a", 12, 1, bad=(4,), kinds=_mixed(12)),), plain=True,
                    max_staleness=None, crash=crash))


@pytest.mark.timeout(60)
def test_a_first_exhausted_mixture_reads_the_big_source_on_over_passes() -> None:
    """big 12 rows, small 3, 1:1, four passes: pass 1 reads big rows 4..7, pass 2 8..11,
    pass 3 0..3 again; every big row is read."""
    _check(Scenario((SourcePlan("a", 12, 1, kinds=_mixed(12)),
                     SourcePlan("b", 3, 1, kinds=_mixed(3))), passes=4))


@pytest.mark.timeout(60)
def test_an_all_exhausted_mixture_carries_the_short_sources_offset() -> None:
    _check(Scenario((SourcePlan("a", 5, 1, kinds=_mixed(5)),
                     SourcePlan("b", 3, 1, kinds=_mixed(3))),
                    stopping="all_exhausted", passes=3))


@pytest.mark.timeout(60)
def test_a_cursor_resume_just_after_a_pass_boundary() -> None:
    """The checkpoint is taken with rows of the first pass still in flight: they are
    released again, and passes keep counting."""
    _check(Scenario((SourcePlan("a", 8, 1, kinds=_mixed(8)),), plain=True, passes=2,
                    batch_groups=2, max_running=6, max_ready=6, release_batch=4,
                    crash=Crash("cursor", 8, after=1)))


@pytest.mark.timeout(60)
def test_the_skip_exactly_in_lockstep() -> None:
    """Each row trained before the next is released: the skip set is the rule's exactly.
    Rows 0-1 solve every time, row 2 fails a reward, row 3 varies."""
    kinds = (("solved",), ("solved",), ("invalid",), ("mixed",))
    _check(Scenario((SourcePlan("a", 4, 1, kinds=kinds),), plain=True, passes=4, skip=True,
                    revisit=2, lockstep=True, batch_groups=1, max_running=1, max_ready=1,
                    prefetch=1, max_staleness=0, release_batch=1))


@pytest.mark.timeout(60)
def test_a_cursor_resume_after_a_longest_first_release() -> None:
    """Longest-first stages a release's rows under permuted order numbers; the checkpoint's
    rows in flight are task indexes all the same: the trained ones are not released again,
    the untrained ones are."""
    _check(Scenario((SourcePlan("a", 20, 1, kinds=_mixed(20)),), plain=True, passes=2,
                    longest_first=True, batch_groups=3, max_running=6, max_ready=6,
                    prefetch=1, release_batch=6, crash=Crash("cursor", 31, after=0)))
