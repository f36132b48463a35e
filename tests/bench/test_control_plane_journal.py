"""The in-flight journal's term in ``bench/scale.py --control-plane``
(``bench/control_plane.py``), counted without a server: costs times rates."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def rolling_names(cp: Any, run: Any) -> list[str]:
    """The rolling update's operations (``bench/control_plane_rolling.py``): every demand
    prices them too."""
    return [*cp.rolling_counts(run), *cp.rolling_counts(run, before=True)]


def _control_plane() -> object:
    sys.path.insert(0, str(REPO / "bench"))
    import control_plane

    return control_plane


@pytest.mark.parametrize("fmt", ["records", "segments"])
def test_the_journal_is_a_steady_producer_term_and_the_park_replaces_the_partials(
        fmt: str) -> None:
    """Counted without a server: each journal operation's cost times its rate is added to
    the producers' steady term, and at the update the park into the journal replaces the
    ``.partial`` saves and loads."""
    cp: Any = _control_plane()
    from strawq.tasks.journal import FULL_EVERY

    run = cp.Run(gpus=10_000, journal_every_s=2.0, journal_format=fmt)
    off = cp.Run(gpus=10_000)
    costs = {name: 10.0 + i for i, name in enumerate(
        [*cp.steady_rates(run), *cp.burst_counts(run), *cp.burst_counts(off),
         *cp.burst_counts(run, refill=False), *cp.burst_counts(off, refill=False),
         cp.fill_op(run), *rolling_names(cp, run)])}
    counter = cp.Counter.__new__(cp.Counter)
    counter.ops = [cp.Op("x", name, 1, c) for name, c in costs.items()]
    rates = cp.steady_rates(run)
    windows = run.producers / 2.0
    journal = {k: r for k, r in rates.items() if k.startswith("journal:")}
    if fmt == "records":
        assert journal == {"journal: window record": windows,
                           "journal: delete superseded": windows}
    else:
        assert journal == pytest.approx({
            "journal: window record": windows * (1 - 2 / FULL_EVERY),
            "journal: first append (opens)": windows / FULL_EVERY,
            "journal: new segment": windows / FULL_EVERY,
            "journal: delete superseded": windows / FULL_EVERY})
    assert not [k for k in cp.steady_rates(off) if k.startswith("journal:")]
    with_j, without = cp.demand(counter, run), cp.demand(counter, off)
    added = sum(r * costs[k] for k, r in journal.items())
    assert with_j["steady_producer"] == pytest.approx(without["steady_producer"] + added)
    assert with_j["steady_rank"] == without["steady_rank"]
    burst = cp.burst_counts(run)
    assert "save partial" not in burst and "resume: load partial" not in burst
    assert burst["park: journal record (per producer)"] == run.producers
    assert burst["park: yield into the journal"] == run.in_flight * (1 - run.handback_share)


def test_the_update_burst_counts_one_refill_claim_per_producer() -> None:
    """Counted without a server: at an update each producer takes its slots back in one
    claim of its slot budget (issue 40), which replaces the claims of one task each in the
    burst; those are kept beside (``burst_single``), and every producer's first fill is
    counted apart (``start``)."""
    cp: Any = _control_plane()
    run = cp.Run(gpus=10_000)
    single = cp.burst_counts(run, refill=False)
    costs = {name: 10.0 + i for i, name in enumerate(
        [*cp.steady_rates(run), *single, cp.refill_op(run), cp.fill_op(run),
         *rolling_names(cp, run)])}
    counter = cp.Counter.__new__(cp.Counter)
    counter.ops = [cp.Op("x", name, 1, c) for name, c in costs.items()]
    burst = cp.burst_counts(run)
    assert "resume: claim" not in burst and "hand back: claim again" not in burst
    assert burst[cp.refill_op(run)] == run.producers == 1_250
    assert cp.refill_op(run) == "refill: claim 24 tasks at once"
    saved, handed = run.in_flight * 0.75, run.in_flight * 0.25
    assert single["resume: claim"] == saved and single["hand back: claim again"] == handed
    d = cp.demand(counter, run)
    claims_of_one = saved * costs["resume: claim"] + handed * costs["hand back: claim again"]
    assert d["burst_single"] - d["burst"] == pytest.approx(
        claims_of_one - run.producers * costs[cp.refill_op(run)])
    assert d["start"] == pytest.approx(run.producers * costs[cp.fill_op(run)])


def test_a_pause_that_holds_the_groups_is_one_record_per_producer() -> None:
    """Counted without a server: with ``hold`` (``timing.hold_through_pause``) the update
    burst is one window record per producer; no yield, hand-back, claim or load."""
    cp: Any = _control_plane()
    run = cp.Run(gpus=10_000, journal_every_s=4.0, hold=True)
    assert cp.burst_counts(run) == {"journal: window record": 1_250}
    assert cp.burst_counts(run, refill=False) == {"journal: window record": 1_250}
    parked = cp.burst_counts(cp.Run(gpus=10_000, journal_every_s=4.0))
    assert parked["park: yield into the journal"] == 22_500
    costs = {name: 10.0 + i for i, name in enumerate(
        [*cp.steady_rates(run), *parked, *cp.burst_counts(run), cp.fill_op(run),
         *rolling_names(cp, run)])}
    counter = cp.Counter.__new__(cp.Counter)
    counter.ops = [cp.Op("x", name, 1, c) for name, c in costs.items()]
    d = cp.demand(counter, run)
    assert d["burst"] == pytest.approx(1_250 * costs["journal: window record"])
    # without the journal there is nothing to hold the groups in: the park as before
    assert "save partial" in cp.burst_counts(cp.Run(gpus=10_000, hold=True))
