"""The per-prompt history (``strawq.data.history``): every trained or dropped attempt recorded
once, from what gc retires, bounded by merges, and readable with ``strawq inspect``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig
from strawq.data import history
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery.batches import BatchStore
from strawq.delivery.retention import compact_drops
from strawq.ondisk.names import dataset_task_id
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing import make_group, write_jsonl
from strawq.testing.factories import prompts


def _run(tmp_path: Path, n: int) -> tuple[RunQueue, Feeder]:
    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    q = RunQueue.create(storage, QueueConfig(fsync=False, lease_timeout_s=10.0,  # type: ignore
                                             heartbeat_interval_s=1.0, max_attempts=3))
    return q, Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", prompts(n))))


def _complete(q: RunQueue, rewards: dict[str, list[float]], lens: tuple[int, ...] = (3, 5)
              ) -> None:
    for lease in q.claim("p", len(rewards)):
        g = make_group(lease.task_id, lens=lens, version=q.current_version())
        g.rewards = list(rewards[lease.task_id])
        q.complete(lease, g)


def _train(q: RunQueue, trained_at: int = 0) -> list[history.PromptStats]:
    """As the collector does: one batch with the groups' summaries, acked, then gc."""
    bs = BatchStore(q)
    names = bs.scan_ready()
    seq = bs.next_seq()
    bs.publish_batch(seq, names, [bs.read_summary(n) for n in names],
                     {"trained_at": trained_at})
    bs.ack(seq)
    bs.gc()
    return list(history.load_history(q.storage).prompts.values())


def test_gc_records_each_trained_attempt_with_its_lengths_and_reward_spread(
        tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, 3)
    feeder.release(3)
    t = [dataset_task_id(i) for i in range(3)]
    _complete(q, {t[0]: [1.0, 0.0], t[1]: [1.0, 1.0], t[2]: [0.0, 0.0]})
    _train(q, trained_at=0)
    h = history.load_history(q.storage)
    assert len(h) == 3
    s0, s1 = h.get(t[0]), h.get(t[1])
    assert s0 is not None and s1 is not None
    assert (s0.attempts, s0.trained, s0.dropped, s0.tokens) == (1, 1, 0, 8)
    assert s0.index == 0 and s0.mean_length == 4.0
    (row,) = s0.last
    assert (row["len_min"], row["len_max"], row["reward_mean"], row["reward_var"]) == \
        (3, 5, 0.5, 0.25)
    assert row["trained_at"] == 0 and row["status"] == "trained"
    assert not s0.last_zero_variance and s0.zero_variance == 0
    assert s1.last_zero_variance and s1.zero_variance == 1
    assert h.totals()["zero_variance_attempts"] == 2
    assert h.totals()["attempts"] == 3 and h.totals()["tokens"] == 24
    assert history.PromptHistory.open(str(tmp_path / "run")).totals() == h.totals()


def test_an_attempt_recorded_twice_by_a_crash_is_counted_once(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, 2)
    feeder.release(2)
    t = [dataset_task_id(i) for i in range(2)]
    _complete(q, {t[0]: [1.0, 0.0], t[1]: [0.0, 1.0]})
    bs = BatchStore(q)
    names = bs.scan_ready()
    bs.publish_batch(1, names, [bs.read_summary(n) for n in names], {"trained_at": 0})
    bs.ack(1)
    # a gc killed after it recorded the history, before it deleted the batch
    history.record_attempts(q.storage, history.trained_rows([bs.read_manifest(1)]))
    bs.gc()  # the next gc records the same batch again, then retires it
    h = history.load_history(q.storage)
    assert h.segments == 2
    assert [(s.id, s.attempts, s.trained) for s in sorted(h.prompts.values(),
                                                          key=lambda s: s.id)] == \
        [(t[0], 1, 1), (t[1], 1, 1)]


def test_drops_are_recorded_with_their_reason(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, 2)
    feeder.release(2)
    t = [dataset_task_id(i) for i in range(2)]
    leases = {lease.task_id: lease for lease in q.claim("p", 2)}
    g = make_group(t[0], lens=(4, 4, 4))
    g.rewards = [1.0, 1.0, 1.0]
    q.drop(leases[t[0]], "zero_variance", "all rewards equal", summary=g.summary())
    q.drop(leases[t[1]], "too_long", "over the cap")  # no group summary
    assert compact_drops(q.storage) == 2
    h = history.load_history(q.storage)
    s0, s1 = h.get(t[0]), h.get(t[1])
    assert s0 is not None and s1 is not None
    assert (s0.attempts, s0.dropped, s0.tokens, s0.zero_variance) == (1, 1, 12, 1)
    assert s0.last[0]["reason"] == "zero_variance"
    assert (s1.dropped, s1.tokens, s1.last[0]["reason"]) == (1, 0, "too_long")


def test_merges_bound_the_history_and_a_crash_inside_one_counts_nothing_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q, feeder = _run(tmp_path, 1)
    tid = dataset_task_id(0)
    rows = [history.attempt_row({"task_id": tid, "index": 0, "sample_lens": [2, 2],
                                 "rewards": [float(g % 2), 1.0]}, gen=g, status="trained")
            for g in range(40)]
    for row in rows:  # one segment per gc pass
        assert history.record_attempts(q.storage, [row])
    segs = history._segments(q.storage)
    assert len(segs) <= history.MAX_SEGMENTS
    h = history.load_history(q.storage)
    s = h.get(tid)
    assert s is not None
    assert (s.attempts, s.trained, s.tokens) == (40, 40, 160)
    assert s.zero_variance == 20  # the odd generations: rewards [1, 1]
    assert [r["gen"] for r in s.last] == [36, 37, 38, 39]  # KEEP_ATTEMPTS in detail
    # a merge that dies after publishing, before deleting what it covers
    monkeypatch.setattr(q.storage, "delete", lambda key: None)
    assert history.compact_history(q.storage) > 0
    monkeypatch.undo()
    assert len(history._segments(q.storage)) > 1  # the covered segments are still there
    again = history.load_history(q.storage).get(tid)
    assert again is not None and (again.attempts, again.tokens) == (40, 160)
    # and the same rows recorded again after the merge are still counted once
    history.record_attempts(q.storage, rows[-3:])
    again = history.load_history(q.storage).get(tid)
    assert again is not None and again.attempts == 40


def test_inspect_shows_the_history_and_refuses_an_unknown_prompt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q, feeder = _run(tmp_path, 2)
    feeder.release(2)
    t = [dataset_task_id(i) for i in range(2)]
    _complete(q, {t[0]: [1.0, 0.0], t[1]: [1.0, 1.0]})
    _train(q)
    run = str(tmp_path / "run")
    assert cli_main(["inspect", run, "history"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["totals"]["prompts"] == 2 and out["totals"]["zero_variance_attempts"] == 1
    assert cli_main(["inspect", run, f"history/{t[1]}"]) == 0
    one = json.loads(capsys.readouterr().out)["prompt"]
    assert one["id"] == t[1] and one["trained"] == 1 and one["zero_variance"] == 1
    assert cli_main(["inspect", run, "history/i999999999999"]) == 1
    err = capsys.readouterr().err
    assert "no attempt at 'i999999999999' is recorded" in err and "Traceback" not in err


def test_a_corrupt_segment_is_skipped_with_an_error(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    q, feeder = _run(tmp_path, 1)
    feeder.release(1)
    tid = dataset_task_id(0)
    _complete(q, {tid: [1.0, 0.0]})
    _train(q)
    q.storage.publish("history/seg-000000000099", b"not a record")
    h = history.load_history(q.storage)
    s = h.get(tid)
    assert s is not None and s.attempts == 1
    assert "seg-000000000099 is unreadable" in caplog.text


def test_failed_rewards_are_not_agreement(tmp_path: Path) -> None:
    """A reward that failed (None: a reward error or a failed sample; not a finite number)
    is not agreement: a group of 4 whose one valid reward stands alone, or whose valid
    rewards are equal beside a failed one, did not agree, trained or dropped. The row says
    how many rewards were valid."""
    q, feeder = _run(tmp_path, 3)
    feeder.release(3)
    t = [dataset_task_id(i) for i in range(3)]
    leases = {lease.task_id: lease for lease in q.claim("p", 3)}
    groups = {tid: make_group(tid, lens=(3, 3, 3, 3)) for tid in t}
    groups[t[0]].rewards = [1.0, None, None, None]
    groups[t[1]].rewards = [0.0, 0.0, float("nan"), None]
    groups[t[2]].rewards = [1.0, 1.0, 1.0, 1.0]
    q.complete(leases[t[0]], groups[t[0]])
    q.drop(leases[t[1]], "reward_error", "2 of 4 rewards failed",
           summary=groups[t[1]].summary())
    q.complete(leases[t[2]], groups[t[2]])
    _train(q)
    assert compact_drops(q.storage) == 1
    h = history.load_history(q.storage)
    rows = {tid: s.last[-1] for tid in t if (s := h.get(tid)) is not None}
    assert [(rows[tid]["samples"], rows[tid]["rewards_valid"], rows[tid]["reward_var"])
            for tid in t] == [(4, 1, 0.0), (4, 2, 0.0), (4, 4, 0.0)]
    assert [history.rewards_agreed(rows[tid]) for tid in t] == [False, False, True]
    assert h.totals()["zero_variance_attempts"] == 1


def test_a_row_without_rewards_valid_is_judged_on_its_variance() -> None:
    """Rows recorded before ``rewards_valid`` cannot say whether a reward failed: they are
    judged as they were (two or more samples, variance 0). A summary with fewer rewards
    than samples records the rewards it has."""
    old = {"samples": 4, "reward_mean": 1.0, "reward_var": 0.0}
    assert history.rewards_agreed(old)
    assert history.rewards_agreed({**old, "rewards_valid": 4})
    assert not history.rewards_agreed({**old, "rewards_valid": 3})
    assert not history.rewards_agreed({**old, "samples": 1, "rewards_valid": 1})
    short = history.attempt_row({"task_id": "i0", "sample_lens": [2, 2, 2, 2],
                                 "rewards": [1.0, 1.0]}, gen=0, status="trained")
    assert (short["samples"], short["rewards_valid"]) == (4, 2)
    assert not history.rewards_agreed(short)
    none = history.attempt_row({"task_id": "i0", "sample_lens": [2, 2], "rewards": None},
                               gen=0, status="dropped")
    assert none["rewards_valid"] == 0 and none["reward_mean"] is None
