"""Passes over the dataset and history-driven admission (``strawq.data.prompt_policy``).

A run of ``num_epochs`` passes releases every row once per pass under new task ids; from
the second pass on, a row whose newest trained group's rewards all agreed can be skipped
(recorded in the history) and a release can be staged longest-predicted-first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strawq.config import QueueConfig
from strawq.data import history
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.data.prompt_policy import Skip, plan_release, zero_variance_skip
from strawq.delivery.batches import BatchStore
from strawq.errors import ConfigError
from strawq.ondisk.names import dataset_task_id
from strawq.storage import MemoryStorage, PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.testing import audit_run, make_group, write_jsonl
from strawq.testing.factories import prompts
from strawq.testing.faults import CrashPoint, FaultyStorage
from strawq.views.status import run_status

ROWS = 4


def _run(tmp_path: Path, **cfg: Any) -> tuple[RunQueue, Feeder]:
    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    q = RunQueue.create(storage, QueueConfig(fsync=False, lease_timeout_s=10.0,  # type: ignore
                                             heartbeat_interval_s=1.0, **cfg))
    return q, Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", prompts(ROWS))))


def _rows(q: RunQueue, n: int) -> list[tuple[str, int]]:
    """Claim ``n`` tasks in claim order: (task id, dataset row index of its body)."""
    return [(lease.task_id, int(lease.task["row"]["answer"])) for lease in q.claim("p", n)]


def _finish(q: RunQueue, rewards: dict[int, list[float]], lens: dict[int, tuple[int, ...]]
            | None = None) -> None:
    """Complete every pending task (keyed by dataset row), train it in one batch, gc."""
    for lease in q.claim("p", 100):
        r = int(lease.task["row"]["answer"])
        g = make_group(lease.task_id, lens=(lens or {}).get(r, (3, 5)),
                       version=q.current_version())
        g.rewards = list(rewards[r])
        q.complete(lease, g)
    bs = BatchStore(q)
    names = bs.scan_ready()
    seq = bs.next_seq()
    bs.publish_batch(seq, names, [bs.read_summary(n) for n in names], {"trained_at": 0})
    bs.ack(seq)
    bs.gc()


def test_each_pass_releases_every_row_again_under_new_task_ids(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, num_epochs=3)
    got = []
    while not feeder.exhausted:
        assert feeder.release(3) > 0
        got += _rows(q, 10)
    assert [row for _, row in got] == [0, 1, 2, 3] * 3
    assert [tid for tid, _ in got] == [dataset_task_id(i) for i in range(3 * ROWS)]
    assert feeder.release(3) == 0 and feeder.cursor.epoch == 2
    st = run_status(q)
    assert st.cursor["pass"] == "3/3" and st.cursor["exhausted"] is True
    # a second feeder (the operator's `strawq release`) agrees where the run stands
    again = Feeder(q, Dataset(str(tmp_path / "d.jsonl")))
    assert again.exhausted and again.cursor.epoch_bases == (0, ROWS, 2 * ROWS)


def test_status_says_which_pass_and_is_not_exhausted_between_passes(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, num_epochs=2)
    feeder.release(ROWS + 1)  # the whole first pass: its cursor is at the dataset's end
    assert feeder.cursor.exhausted and not feeder.exhausted
    st = run_status(q)
    assert st.cursor["pass"] == "1/2" and st.cursor["exhausted"] is False


def test_one_pass_by_default(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path)
    assert feeder.release(10) == ROWS
    assert feeder.exhausted and feeder.release(10) == 0


def test_zero_variance_rows_skip_one_pass_recorded_by_reward_then_return(
        tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, num_epochs=3, skip_zero_variance=True)
    assert feeder.release(ROWS) == ROWS
    # row 0 all solved, row 2 all failed: nothing to learn from either
    _finish(q, {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [1.0, 0.0]})
    # pass 2 skips rows 0 and 2 and releases 1 and 3; the two more asked for come from
    # pass 3, two passes after the zero-variance groups: row 0 is back
    assert feeder.release(ROWS) == ROWS
    ids = [dataset_task_id(i) for i in range(3 * ROWS)]
    assert _rows(q, 10) == [(ids[5], 1), (ids[7], 3), (ids[8], 0), (ids[9], 1)]
    h = history.load_history(q.storage)
    assert h.totals()["skipped"] == 2
    assert h.totals()["skipped_by_reward"] == {"0": 1, "1": 1}
    skipped = h.get(ids[ROWS + 0])
    assert skipped is not None and skipped.skipped == 1 and skipped.attempts == 0
    assert feeder.release(ROWS) == 2 and feeder.exhausted  # row 2 is back too
    assert _rows(q, 10) == [(ids[10], 2), (ids[11], 3)]


def _settle(q: RunQueue, outcomes: dict[int, tuple[str, list[float | None]]]) -> None:
    """Every pending task (keyed by dataset row), with 4 samples: ``("trained", rewards)``
    completes it; ``(reason, rewards)`` drops it with that reason and the group's summary,
    as a producer's filter does. Then one batch of the completed, and gc (drops compacted:
    their rows reach the history)."""
    for lease in q.claim("p", 100):
        r = int(lease.task["row"]["answer"])
        how, rewards = outcomes[r]
        g = make_group(lease.task_id, lens=(3, 3, 3, 3), version=q.current_version())
        g.rewards = list(rewards)
        if how == "trained":
            q.complete(lease, g)
        else:
            q.drop(lease, how, f"filter: {how}", summary=g.summary())
    bs = BatchStore(q)
    names = bs.scan_ready()
    seq = bs.next_seq()
    bs.publish_batch(seq, names, [bs.read_summary(n) for n in names], {"trained_at": 0})
    bs.ack(seq)
    bs.gc(compact_drops_at=0)


def test_a_dropped_group_whose_rewards_agreed_is_skipped_by_the_next_pass(
        tmp_path: Path) -> None:
    """The DAPO filter drops a group whose rewards all agree (``zero_variance``): that
    attempt counts like a trained one, or the row is generated and dropped again every
    pass. A drop without rewards (here ``too_long``, no summary) says nothing about them."""
    q, feeder = _run(tmp_path, num_epochs=2, skip_zero_variance=True)
    assert feeder.release(ROWS) == ROWS
    leases = q.claim("p", 1)  # row 0: dropped without a group summary
    q.drop(leases[0], "too_long", "over the cap")
    _settle(q, {1: ("zero_variance", [1.0] * 4), 2: ("trained", [0.0, 1.0, 1.0, 0.0]),
                3: ("zero_variance", [0.0] * 4)})
    h = history.load_history(q.storage)
    ids = [dataset_task_id(i) for i in range(2 * ROWS)]
    def earlier(i: int) -> list[list[str]]:  # a plain dataset: the same row one pass before
        return [[ids[i - ROWS]]]

    assert zero_variance_skip(ROWS + 1, earlier(ROWS + 1), h, 2) == Skip(ROWS + 1, 1.0, 1)
    assert zero_variance_skip(ROWS + 0, earlier(ROWS), h, 2) is None
    plan = plan_release(range(ROWS, 2 * ROWS), earlier, h, skip_zero_variance=True,
                        revisit_epochs=2, longest_first=False)
    assert plan.order == [ROWS + 0, ROWS + 2]
    # and the feeder, which plans the same from the same history
    assert feeder.release(ROWS) == 2 and feeder.exhausted
    assert _rows(q, 10) == [(ids[4], 0), (ids[6], 2)]
    assert history.load_history(q.storage).totals()["skipped_by_reward"] == {"0": 1, "1": 1}


def test_a_group_whose_rewards_failed_is_released_by_the_next_pass(tmp_path: Path) -> None:
    """Three of four rewards failed (None): the one left agrees with nothing. The group is
    not a zero-variance group, trained (row 0) or dropped (row 1), and the row comes back."""
    q, feeder = _run(tmp_path, num_epochs=2, skip_zero_variance=True)
    assert feeder.release(ROWS) == ROWS
    _settle(q, {0: ("trained", [1.0, None, None, None]),
                1: ("reward_error", [0.0, None, 0.0, None]),
                2: ("trained", [0.0, 0.0, 0.0, 0.0]), 3: ("trained", [1.0, 0.0, 1.0, 0.0])})
    assert feeder.release(ROWS) == 3 and feeder.exhausted
    assert [row for _, row in _rows(q, 10)] == [0, 1, 3]


def test_without_the_rule_zero_variance_rows_are_released(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, num_epochs=2)
    feeder.release(ROWS)
    _finish(q, {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [1.0, 0.0]})
    assert feeder.release(ROWS) == ROWS
    assert [row for _, row in _rows(q, 10)] == [0, 1, 2, 3]  # and in dataset order


def test_a_pass_whose_rows_all_agreed_still_releases_what_was_asked(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, num_epochs=3, skip_zero_variance=True)
    feeder.release(ROWS)
    _finish(q, dict.fromkeys(range(ROWS), [1.0, 1.0]))
    # pass 2 skips every row; the release goes on into pass 3 (revisit: all back)
    assert feeder.release(2) == 2
    assert [row for _, row in _rows(q, 10)] == [0, 1]
    assert history.load_history(q.storage).totals()["skipped"] == ROWS


def test_longest_predicted_first_within_a_release(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, num_epochs=2, longest_first=True)
    feeder.release(3)  # rows 0..2 this pass; row 3 later, with no history by then
    rewards = {r: [0.0, 1.0] for r in range(ROWS)}
    _finish(q, rewards, lens={0: (4, 6), 1: (90, 110), 2: (20, 40)})
    feeder.release(10)  # row 3
    _rows(q, 10)
    feeder.release(ROWS)
    # predicted 100, 30, 5; row 3 has none: the run's median (30) ties row 2, index breaks it
    assert [row for _, row in _rows(q, 10)] == [1, 2, 3, 0]
    assert history.load_history(q.storage).median_length() == 30


def test_the_longest_predicted_prompt_of_a_later_release_is_claimed_first(
        tmp_path: Path) -> None:
    """Claim order by predicted length across releases: the second pass releases the short
    rows first and the long one in a release of its own after them; a producer claiming
    them one at a time starts the long one first (in release order it would start last)."""
    q, feeder = _run(tmp_path, num_epochs=2, longest_first=True)
    feeder.release(ROWS)
    _finish(q, {r: [0.0, 1.0] for r in range(ROWS)},
            lens={0: (4, 6), 1: (9, 11), 2: (20, 40), 3: (300, 340)})
    assert feeder.release(3) == 3 and feeder.release(1) == 1  # rows 0..2, then row 3
    got = [row for _ in range(ROWS) for _, row in _rows(q, 1)]
    assert got == [3, 2, 1, 0]


def test_a_release_of_an_earlier_version_is_claimed_before_a_longer_later_one(
        tmp_path: Path) -> None:
    """The claim rank starts with the release's weight version: a fresh task is bounded by
    the version it was released at, so what is left of an earlier version's release is due
    earlier and goes first, however long a later release's prediction."""
    q, feeder = _run(tmp_path, num_epochs=2, longest_first=True)
    feeder.release(ROWS)
    _finish(q, {r: [0.0, 1.0] for r in range(ROWS)},
            lens={0: (4, 6), 1: (9, 11), 2: (20, 40), 3: (300, 340)})
    feeder.release(3)  # rows 0..2 at version v
    q.set_version(q.current_version() + 1)
    feeder.release(1)  # row 3, the longest predicted, at v + 1
    got = [row for _ in range(ROWS) for _, row in _rows(q, 1)]
    assert got == [2, 1, 0, 3]


def test_partial_and_returned_tasks_keep_their_priority_over_ranked_fresh_ones(
        tmp_path: Path) -> None:
    """A task handed back (and a partial) is older work: it is claimed before the fresh
    tasks of a ranked release, however long their prediction."""
    q, feeder = _run(tmp_path, num_epochs=2, longest_first=True)
    feeder.release(ROWS)
    _finish(q, {r: [0.0, 1.0] for r in range(ROWS)}, lens={3: (300, 340)})
    feeder.release(2)  # rows 0, 1
    (first,) = q.claim("p", 1)
    q.release(first)  # back to the top of pending/ (stage b)
    feeder.release(2)  # rows 2, 3: row 3 the longest predicted
    got = [row for _ in range(ROWS) for _, row in _rows(q, 1)]
    assert got[0] == int(first.task["row"]["answer"]) and got[1] == 3


@pytest.mark.parametrize("bad", [{"num_epochs": 0}, {"zero_variance_revisit_epochs": 1}])
def test_bad_pass_settings_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        QueueConfig(**bad)  # type: ignore[arg-type]


def test_a_crash_at_any_step_of_a_skipping_release_loses_and_repeats_nothing(
        tmp_path: Path) -> None:
    """Crash enumeration (``FaultyStorage(crash_after=N)``) over a release that starts the
    second pass and skips: after recovery every row of the pass is released or recorded as
    skipped, exactly once, and a redo of the release makes the same decision."""
    path = write_jsonl(tmp_path / "d.jsonl", prompts(ROWS))
    ids = [dataset_task_id(i) for i in range(2 * ROWS)]
    crashes = 0
    for n in range(1, 200):
        storage = MemoryStorage()
        q = RunQueue.create(storage, QueueConfig(fsync=False, num_epochs=2,  # type: ignore
                                                 skip_zero_variance=True, release_batch=ROWS))
        Feeder(q, Dataset(path)).release(ROWS)
        _finish(q, {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [1.0, 0.0]})
        finished = False
        try:
            Feeder(RunQueue(FaultyStorage(storage, crash_after=n), q.config),
                   Dataset(path)).release(ROWS)
            finished = True
        except CrashPoint:
            crashes += 1
        again = Feeder(RunQueue.open(storage), Dataset(path))  # recovery, then the rest
        while not again.exhausted:
            again.release(ROWS)
        audit = audit_run(storage)
        assert audit.check(ids, trained=set(ids[:ROWS])) == [], n
        assert audit.skipped == {ids[4], ids[6]}, n
        assert audit.ids("pending") == {ids[5], ids[7]}, n
        assert history.load_history(storage).totals()["skipped"] == 2, n
        if finished:
            break
    assert crashes >= 5, "the enumeration crashed nowhere"


def test_a_drop_reaches_the_history_at_the_next_gc_and_stays_requeueable(
        tmp_path: Path) -> None:
    """A run that drops fewer groups than the compaction threshold: the collector's gc
    records each new drop in the history at once (the next pass skips its row), while the
    drop stays in ``dropped/``; compacting it later counts it once."""
    q, feeder = _run(tmp_path, num_epochs=2, skip_zero_variance=True)
    assert feeder.release(ROWS) == ROWS
    for lease in q.claim("p", 100):
        g = make_group(lease.task_id, lens=(3, 3, 3, 3), version=q.current_version())
        g.rewards = [1.0] * 4
        q.drop(lease, "zero_variance", "filter: zero_variance", summary=g.summary())
    bs = BatchStore(q)
    bs.gc(compact_drops_at=1000)  # the collector's threshold: nothing is compacted
    assert len(names_in(q.storage, TaskState.DROPPED)) == ROWS  # still requeueable
    h = history.load_history(q.storage)
    assert h.totals()["dropped"] == ROWS and h.totals()["zero_variance_attempts"] == ROWS
    bs.gc(compact_drops_at=1000)  # seen: not recorded twice
    bs.gc(compact_drops_at=0)  # compacted now: recorded again, counted once
    assert history.load_history(q.storage).totals()["dropped"] == ROWS
    # every row agreed: the next pass skips them all
    assert feeder.release(ROWS) == 0 and feeder.exhausted
    assert history.load_history(q.storage).totals()["skipped"] == ROWS
