"""The release model (``strawq.testing.release_model``) against examples worked by hand:
it is the oracle of tests/collector/test_release_combinations.py, so it is checked alone
here first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from strawq.testing.release_model import (TRAINED, ZERO_VARIANCE, Behaviour, ModelRow,
                                          Observed, ReleaseModel, Resume, Seen, Source,
                                          agreeing, check_cursor, check_outcomes,
                                          check_passes, check_resume, check_rows,
                                          check_run, check_shares, check_skips,
                                          check_unread, ideal_run, outcome)


def _rows(model: ReleaseModel) -> list[list[str]]:
    """Each pass as ``<source initial><source row>`` strings."""
    return [[f"{r.name[0]}{r.source_row}" for r in p.rows] for p in model.passes]


def _solved(row: ModelRow) -> list[float | None]:
    return [1.0, 1.0]


def _mixed(row: ModelRow) -> list[float | None]:
    return [0.0, 1.0]


BIG_SMALL = [Source("big", 12), Source("small", 3)]


def test_first_exhausted_carries_each_sources_offset_into_the_next_pass() -> None:
    """big 12 rows, small 3, weights 1:1, four passes: each pass ends when small runs out;
    big's rows not reached come first in the next pass, so every big row is read."""
    m = ReleaseModel(BIG_SMALL, passes=4)
    assert _rows(m) == [["b0", "s0", "b1", "s1", "b2", "s2", "b3"],
                        ["b4", "s0", "b5", "s1", "b6", "s2", "b7"],
                        ["b8", "s0", "b9", "s1", "b10", "s2", "b11"],
                        ["b0", "s0", "b1", "s1", "b2", "s2", "b3"]]
    assert m.epoch_bases == [0, 7, 14, 21] and m.end == 28
    assert m.epoch_offsets == [[0, 0], [4, 0], [8, 0], [0, 0]]
    assert m.consumed() == [16, 12] and m.unread() == {}
    assert m.row_at(8) == ModelRow(index=8, pass_no=1, position=1, source=1, name="small",
                                   source_row=0, bad=False)
    # two passes stop before big's rows 8..11: the final cursor names them
    assert ReleaseModel(BIG_SMALL, passes=2).unread() == {"big": [8, 12]}
    assert ReleaseModel(BIG_SMALL, passes=1).unread() == {"big": [4, 12]}


def test_a_small_weight_sources_offset_moves_too() -> None:
    """a 6 rows at weight 3, b 4 rows at weight 1: the pattern is a a b a; pass 0 ends when
    a runs out (after 2 of b's rows), so pass 1 gives b's rows 2 and 3."""
    m = ReleaseModel([Source("a", 6, 3.0), Source("b", 4, 1.0)], passes=2)
    assert _rows(m) == [["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a5"],
                        ["a0", "a1", "b2", "a2", "a3", "a4", "b3", "a5"]]
    assert m.epoch_offsets == [[0, 0], [0, 2]] and m.unread() == {}


def test_all_exhausted_wraps_the_short_source_and_carries_its_offset() -> None:
    """big 5, small 3, 1:1: a pass gives every big row; small runs out after 3 and starts
    again (s0 twice in pass 0), and pass 1 starts small where pass 0 left it (row 1)."""
    m = ReleaseModel([Source("big", 5), Source("small", 3)], passes=2,
                     stopping_strategy="all_exhausted")
    assert _rows(m) == [["b0", "s0", "b1", "s1", "b2", "s2", "b3", "s0", "b4"],
                        ["b0", "s1", "b1", "s2", "b2", "s0", "b3", "s1", "b4"]]
    assert m.epoch_bases == [0, 9] and m.epoch_offsets == [[0, 0], [0, 1]]
    assert m.unread() == {}


@pytest.mark.parametrize("strategy", ["first_exhausted", "all_exhausted"])
def test_a_plain_dataset_gives_every_row_each_pass(strategy: str) -> None:
    m = ReleaseModel([Source("data", 4, bad=frozenset({2}))], passes=3,
                     stopping_strategy=strategy, plain=True)
    assert _rows(m) == [["d0", "d1", "d2", "d3"]] * 3
    assert m.epoch_bases == [0, 4, 8] and m.epoch_offsets == [[0]] * 3 and m.unread() == {}
    assert [r.index for r in m.passes[2].rows if r.bad] == [10]
    obs = ideal_run(m, Behaviour(_mixed))
    assert obs.bad_dropped == 3 and sorted(obs.released) == [0, 1, 3, 4, 5, 7, 8, 9, 11]
    assert all(s.source is None for s in obs.released.values())  # no source in the body
    assert check_run(m, Behaviour(_mixed), obs, exact_skips=True) == []


def test_agreeing_needs_two_valid_equal_rewards() -> None:
    assert agreeing([1.0, 1.0]) and agreeing([0.0, 0.0, 0.0])
    assert not agreeing([1.0]) and not agreeing([0.0, 1.0])
    assert not agreeing([1.0, None]) and not agreeing([float("nan"), float("nan")])


def test_outcome_the_producers_drop_comes_before_the_filter() -> None:
    def drop_solved(task: dict[str, Any], rewards: list[float]) -> str | None:
        assert task["source"] == "b" and task["id"] == f"i{task['index']}"
        return "too_easy" if rewards and all(r == 1.0 for r in rewards) else None

    m = ReleaseModel([Source("a", 2), Source("b", 2, filter=drop_solved)])
    a0, b0 = m.rows[0], m.rows[1]
    assert outcome(m, Behaviour(_solved), a0) == TRAINED
    assert outcome(m, Behaviour(_solved), b0) == "too_easy"
    assert outcome(m, Behaviour(_mixed), b0) == TRAINED
    assert outcome(m, Behaviour(_solved, zero_variance_drop=True), b0) == ZERO_VARIANCE
    # the filter sees the valid rewards only
    assert outcome(m, Behaviour(lambda r: [1.0, None]), b0) == "too_easy"


def test_the_skip_counts_appearances_not_passes() -> None:
    """big row 0 comes up in passes 0 and 3 only (12/3, 1:1): with revisit 2 its agreeing
    attempt of pass 0 is one appearance ago in pass 3, so it is skipped there; small row 0
    (every pass) is skipped in pass 1 and released in pass 2, two appearances after."""
    m = ReleaseModel(BIG_SMALL, passes=4)
    b = Behaviour(_solved, skip_zero_variance=True, revisit=2)
    obs = ideal_run(m, b)
    skipped = {(m.rows[i].pass_no, m.rows[i].name, m.rows[i].source_row) for i in obs.skipped}
    assert skipped == {(1, "small", 0), (1, "small", 1), (1, "small", 2),
                       (3, "small", 0), (3, "small", 1), (3, "small", 2),
                       (3, "big", 0), (3, "big", 1), (3, "big", 2), (3, "big", 3)}
    assert check_run(m, b, obs, exact_skips=True) == []
    # revisit 3: small is released again only in pass 3 (three appearances after pass 0)
    obs3 = ideal_run(m, replace(b, revisit=3))
    assert sorted((m.rows[i].pass_no, m.rows[i].source_row) for i in obs3.skipped
                  if m.rows[i].name == "small") == [(p, j) for p in (1, 2) for j in range(3)]


def test_a_dropped_attempt_counts_for_the_skip() -> None:
    """An attempt dropped by the producer's zero-variance drop has rewards: it skips."""
    m = ReleaseModel([Source("data", 2)], passes=2, plain=True)
    b = Behaviour(_solved, zero_variance_drop=True, skip_zero_variance=True)
    obs = ideal_run(m, b)
    assert obs.dropped == {0: [ZERO_VARIANCE], 1: [ZERO_VARIANCE]} and obs.skipped == {2, 3}
    assert check_run(m, b, obs, exact_skips=True) == []


def test_todays_restart_of_every_pass_at_row_0_is_a_mismatch() -> None:
    """A mixture that starts every pass at each source's row 0 (no offsets) releases big
    rows 0..3 in pass 1: the model says 4..7, and rows 4..11 are never read."""
    m = ReleaseModel(BIG_SMALL, passes=2)
    b = Behaviour(_mixed)
    obs = ideal_run(m, b)
    for i in range(7, 14):
        r = m.rows[i - 7]
        obs.released[i] = replace(obs.released[i], content=(r.name, r.source_row))
    obs.cursor = {"next_index": 14, "exhausted": True, "epoch_bases": [0, 7]}
    got = check_run(m, b, obs)
    assert "[row] pass 1 row 0 (task index 7, big row 4): released big row 0, the model " \
           "releases big row 4" in got
    assert "[cursor] epoch_offsets is None, the model says [[0, 0], [4, 0]]" in got
    assert ("[unread] the final cursor's unread is {}, the model says {'big': [8, 12]}"
            in got)
    assert "[unread] big row 11 was never released and has no recorded reason (not bad, " \
           "not in the cursor's unread)" in got


def test_checks_name_each_kind_of_mismatch() -> None:
    m = ReleaseModel(BIG_SMALL, passes=2)
    b = Behaviour(_solved, skip_zero_variance=True, revisit=2)
    good = ideal_run(m, b)
    assert check_run(m, b, good, exact_skips=True) == []

    def obs(**kw: Any) -> Observed:
        return replace(good, **kw)

    # a field the body gets wrong; a body without the new fields is accepted on request
    released = dict(good.released)
    released[0] = replace(released[0], source_row=None, pass_no=None)
    released[1] = replace(released[1], source_row=5, pass_no=None)
    assert check_rows(m, obs(released=released)) == [
        "[field] pass 0 row 1 (task index 1, small row 0): task['source_row'] is 5, the "
        "model says 0",
        "[field] 1 released task(s) carry no task['source_row'] (the first: pass 0 row 0 "
        "(task index 0, big row 0))",
        "[field] 2 released task(s) carry no task['pass'] (the first: pass 0 row 0 (task "
        "index 0, big row 0))"]
    assert check_rows(m, obs(released=released), require_fields=False) == [
        "[field] pass 0 row 1 (task index 1, small row 0): task['source_row'] is 5, the "
        "model says 0"]
    # a row neither released nor skipped
    released = {i: s for i, s in good.released.items() if i != 2}
    assert check_passes(m, obs(released=released)) == [
        "[pass] pass 0 row 2 (task index 2, big row 1): neither released nor skipped"]
    # trained twice; released and never trained
    assert check_outcomes(m, b, obs(trained=[*good.trained, 0])) == [
        "[trained] pass 0 row 0 (task index 0, big row 0): trained 2 time(s); the model "
        "trains it once"]
    assert check_shares(m, b, obs(trained=good.trained[1:])) == [
        "[share] big: 7 groups trained, the model 8 (8 rows over the passes, 0 bad, "
        "0 skipped, 0 dropped)"]
    # a skip without reason (pass 0), and, exactly, a release the rule skips
    assert check_skips(m, b, obs(skipped={*good.skipped, 0}, released=released)) == [
        "[skip] pass 0 row 0 (task index 0, big row 0): skipped in the first pass"]
    small = next(i for i in good.skipped if m.rows[i].name == "small")
    seen = Seen(small, ("small", m.rows[small].source_row), "small",
                m.rows[small].source_row, 1)
    late = obs(skipped=good.skipped - {small}, released={**good.released, small: seen},
               trained=[*good.trained, small])
    assert check_skips(m, b, late) == []  # timing: not skipping is allowed
    assert [x[:60] for x in check_skips(m, b, late, exact=True)] == [
        f"[skip] {m.rows[small]}: released, but the rule skips it"[:60]]
    # the cursor
    assert check_cursor(m, {**(good.cursor or {}), "exhausted": False}) == [
        "[cursor] the final cursor is not exhausted (next index 14)"]
    assert check_unread(m, obs(cursor={"exhausted": True})) != []


def test_a_resume_re_releases_what_was_in_flight() -> None:
    """A checkpoint at task index 9 that trained 0..5: rows 6..8 were in flight and must be
    released again; row 0 must not be."""
    m = ReleaseModel(BIG_SMALL, passes=2)
    b = Behaviour(_mixed)
    good = ideal_run(m, b)
    res = Resume(at=9, trained=frozenset(range(6)), released_after=frozenset(range(6, 14)))
    assert check_resume(m, replace(good, resume=res)) == []
    res_bad = replace(res, released_after=frozenset({0, *range(7, 14)}))
    assert check_resume(m, replace(good, resume=res_bad)) == [
        "[resume] pass 0 row 0 (task index 0, big row 0): trained by the checkpoint and "
        "released again after the resume",
        "[resume] pass 0 row 6 (task index 6, big row 3): in flight at the checkpoint "
        "(cursor at task index 9) and not released again after the resume"]


def test_after_a_resume_skips_need_attempts_made_after_it() -> None:
    m = ReleaseModel([Source("data", 2)], passes=3, plain=True)
    b = Behaviour(_solved, skip_zero_variance=True, revisit=3)
    good = ideal_run(m, b)
    assert good.skipped == {2, 3, 4, 5}
    # resumed at index 2, the history is gone: pass 1 is released again, then pass 2 skipped
    res = Resume(at=2, trained=frozenset({0, 1}), released_after=frozenset({2, 3}))
    resumed = replace(good, resume=res, skipped={4, 5},
                      released={**good.released,
                                **{i: Seen(i, ("data", i - 2), None, i - 2, 1) for i in (2, 3)}},
                      trained=[0, 1, 2, 3])
    assert check_run(m, b, resumed, exact_skips=True) == []
    # skipping pass 1 after the resume has no attempt to stand on
    wrong = replace(resumed, skipped={2, 3, 4, 5},
                    released={i: s for i, s in resumed.released.items() if i < 2},
                    trained=[0, 1], resume=replace(res, released_after=frozenset()))
    assert [x for x in check_skips(m, b, wrong) if "task index 2" in x] == [
        "[skip] pass 1 row 0 (task index 2, data row 0): skipped without an agreeing "
        "attempt within 3 appearance(s)"]
