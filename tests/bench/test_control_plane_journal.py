"""The in-flight journal's term in ``bench/scale.py --control-plane``
(``bench/control_plane.py``), counted without a server: costs times rates."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


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
        [*cp.steady_rates(run), *cp.burst_counts(run), *cp.burst_counts(off)])}
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
