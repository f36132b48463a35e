"""The release planner (``strawq.data.planner``): each mixture source carries its own offset
across passes, a cursor resume releases again what was in flight in any pass, the rows no
pass reached are named, and every task says where it comes from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from strawq.data.cursor import read_cursor_state
from strawq.data.feeder import Feeder, preview_release
from strawq.data.history import load_history, record_attempts
from strawq.data.mixture import Mixture, open_dataset
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.views.status import run_status
from tests.collector.helpers import make_run


def _mix(tmp: Path, sizes: dict[str, int], weights: dict[str, float], **kw: Any) -> Mixture:
    for name, n in sizes.items():
        with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": f"{name}{i}"}) + "\n" for i in range(n))
    spec = tmp / "m.mixture.json"
    spec.write_text(json.dumps({"sources": [{"name": k, "path": f"{k}.jsonl",
                                             "weight": weights[k]} for k in sizes], **kw}))
    m = open_dataset(str(spec))
    assert isinstance(m, Mixture)
    return m


def _released(q: RunQueue) -> list[dict[str, Any]]:
    """Every released task's body, in task-index order (claimed and finished at once)."""
    out = []
    while True:
        leases = q.claim("p", 64)
        if not leases:
            return sorted(out, key=lambda t: t["index"])
        for lease in leases:
            out.append(dict(lease.task))
            q.drop(lease, "test", "consumed")


def _run_all(tmp: Path, m: Mixture, passes: int) -> tuple[RunQueue, list[dict[str, Any]]]:
    q = make_run(str(tmp / "run"), release_batch=5, num_epochs=passes)
    f = Feeder(q, m)
    while not f.exhausted:
        f.release()
    return q, _released(q)


def test_first_exhausted_passes_read_every_row_of_the_big_source(tmp_path: Path) -> None:
    # The case: big 12 rows, small 3, weights 1:1, 4 passes. Every pass used to
    # start both sources at row 0, so big4..big11 were never released in any pass.
    m = _mix(tmp_path, {"big": 12, "small": 3}, {"big": 1, "small": 1})
    q, tasks = _run_all(tmp_path, m, passes=4)
    by_pass: dict[int, list[str]] = {}
    for t in tasks:
        by_pass.setdefault(t["pass"], []).append(t["row"]["prompt"])
    assert by_pass == {
        0: ["big0", "small0", "big1", "small1", "big2", "small2", "big3"],
        1: ["big4", "small0", "big5", "small1", "big6", "small2", "big7"],
        2: ["big8", "small0", "big9", "small1", "big10", "small2", "big11"],
        3: ["big0", "small0", "big1", "small1", "big2", "small2", "big3"]}
    # each task names its source and its row there
    assert all(t["row"]["prompt"] == f"{t['source']}{t['source_row']}" for t in tasks)
    state = read_cursor_state(q.storage)
    assert state is not None and state["epoch_offsets"] == [[0, 0], [4, 0], [8, 0], [0, 0]]
    assert "unread" not in state  # every row was read


def test_rows_no_pass_reached_are_named_in_the_last_cursor(tmp_path: Path) -> None:
    m = _mix(tmp_path, {"big": 12, "small": 3}, {"big": 1, "small": 1})
    q, tasks = _run_all(tmp_path, m, passes=2)
    assert max(t["source_row"] for t in tasks if t["source"] == "big") == 7
    state = read_cursor_state(q.storage)
    assert state is not None and state["unread"] == {"big": [8, 12]}
    assert run_status(q).cursor["unread"] == {"big": [8, 12]}  # strawq status shows it


def test_all_exhausted_rotates_the_rows_a_small_source_repeats(tmp_path: Path) -> None:
    m = _mix(tmp_path, {"big": 6, "small": 3}, {"big": 1, "small": 1},
             stopping_strategy="all_exhausted")
    _q, tasks = _run_all(tmp_path, m, passes=2)
    small = {p: [t["source_row"] for t in tasks if t["source"] == "small" and t["pass"] == p]
             for p in (0, 1)}
    # 11 rows a pass: the small source gives 5, repeating two rows, other ones next pass
    assert small == {0: [0, 1, 2, 0, 1], 1: [2, 0, 1, 2, 0]}
    big = [t["source_row"] for t in tasks if t["source"] == "big"]
    assert big == [0, 1, 2, 3, 4, 5] * 2


def test_a_cursor_resume_after_a_pass_boundary_releases_the_last_pass_in_flight(
        tmp_path: Path) -> None:
    # A plain dataset of 10 rows, 2 passes: the checkpoint is taken just after pass 2
    # began, with rows 8 and 9 of pass 1 still generating. They used to be taken for the
    # "dataset before the switch" and never released again.
    ds_path = tmp_path / "ds.jsonl"
    ds_path.write_text("".join(json.dumps({"prompt": f"r{i}"}) + "\n" for i in range(10)))
    from strawq.data.dataset import Dataset

    ds = Dataset(str(ds_path))
    q = make_run(str(tmp_path / "run"), release_batch=4, num_epochs=2)
    f = Feeder(q, ds)
    # rows 0..3, 4..7, 8 and 9 (the pass ends), then pass 2's first two
    assert [f.release(n) for n in (4, 4, 4, 2)] == [4, 4, 2, 2]
    state = f.state_dict()
    assert state["epoch_bases"] == [0, 10]
    state["in_flight"] = [8, 9, 10, 11]
    q2 = make_run(str(tmp_path / "run2"), release_batch=4, num_epochs=2)
    f2 = Feeder(q2, ds)
    assert f2.load_state_dict(state) == 4
    again = _released(q2)
    assert [(t["index"], t["pass"], t["row"]["prompt"]) for t in again] == [
        (8, 0, "r8"), (9, 0, "r9"), (10, 1, "r0"), (11, 1, "r1")]
    while not f2.exhausted:
        f2.release()
    rest = _released(q2)
    assert [t["row"]["prompt"] for t in rest] == [f"r{i}" for i in range(2, 10)]
    assert names_in(q2.storage, TaskState.PENDING) == []


def test_a_cursor_resume_in_a_later_mixture_pass_reads_each_row_in_its_own_pass(
        tmp_path: Path) -> None:
    m = _mix(tmp_path, {"big": 12, "small": 3}, {"big": 1, "small": 1})
    q = make_run(str(tmp_path / "run"), release_batch=5, num_epochs=3)
    f = Feeder(q, m)
    # rows 0..4, then 5 and 6 (pass 0 ends), then pass 1's 7 and 8
    assert [f.release(n) for n in (5, 4, 2)] == [5, 2, 2]
    state = f.state_dict()
    assert state["next_index"] == 9 and state["epoch_offsets"] == [[0, 0], [4, 0]]
    state["in_flight"] = [6, 7, 8]  # big3 of pass 0; big4 and small0 of pass 1
    q2 = make_run(str(tmp_path / "run2"), release_batch=5, num_epochs=3)
    f2 = Feeder(q2, m)
    assert f2.load_state_dict(state) == 3
    assert [t["row"]["prompt"] for t in _released(q2)] == ["big3", "big4", "small0"]
    f2.release(2)
    assert [t["row"]["prompt"] for t in _released(q2)] == ["big5", "small1"]


def _agreed(task_id: str, index: int) -> dict[str, Any]:
    """A trained attempt whose four rewards all agree (nothing to learn)."""
    return {"id": task_id, "gen": 0, "status": "trained", "samples": 4, "tokens": 8,
            "len_mean": 2.0, "reward_mean": 1.0, "reward_var": 0.0, "index": index,
            "at": 1.0}


def test_a_dry_run_shows_per_source_what_the_release_would_take_and_skip(
        tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr("strawq.data.planner.HISTORY_REFRESH_S", 0.0)
    m = _mix(tmp_path, {"big": 12, "small": 3}, {"big": 1, "small": 1})
    q = make_run(str(tmp_path / "run"), release_batch=7, num_epochs=2,
                 skip_zero_variance=True)
    f = Feeder(q, m)
    first = preview_release(q, m, 7)
    assert first.sources == {"big": {"release": 4, "skip": 0, "bad": 0},
                             "small": {"release": 3, "skip": 0, "bad": 0}}
    f.release(7)
    # every small row of pass 0 agreed: pass 1 skips them (they sit at other task ids)
    tasks = _released(q)
    record_attempts(q.storage, [_agreed(t["id"], t["index"]) for t in tasks
                                if t["source"] == "small"])
    p = preview_release(q, m, 7)
    assert p.sources == {"big": {"release": 4, "skip": 0, "bad": 0},
                         "small": {"release": 0, "skip": 3, "bad": 0}}
    assert "small: release 0, skip 3 (history)" in p.describe()
    f.release(7)
    assert [t["row"]["prompt"] for t in _released(q)] == ["big4", "big5", "big6", "big7"]


def test_the_skip_window_counts_passes_not_the_times_a_wrapping_source_repeats_a_row(
        tmp_path: Path, monkeypatch: Any) -> None:
    # all_exhausted: the 2-row source gives each of its rows 3 times a pass. Its rows agreed
    # in pass 0, were skipped in pass 1 (one pass ago), and are still in the window of 3
    # passes in pass 2 (two passes ago) — counted by repeats, pass 1 alone was 3 "ago".
    monkeypatch.setattr("strawq.data.planner.HISTORY_REFRESH_S", -1.0)
    m = _mix(tmp_path, {"big": 6, "small": 2}, {"big": 1, "small": 1},
             stopping_strategy="all_exhausted")
    q = make_run(str(tmp_path / "run"), release_batch=20, num_epochs=3,
                 skip_zero_variance=True, zero_variance_revisit_epochs=3)
    f = Feeder(q, m)
    f.release(20)
    first = _released(q)
    assert [t["source_row"] for t in first if t["source"] == "small"] == [0, 1, 0, 1, 0]
    record_attempts(q.storage, [_agreed(t["id"], t["index"]) for t in first
                                if t["source"] == "small"])
    while not f.exhausted:  # passes 1 and 2
        f.release(20)
    later = _released(q)
    assert [(t["pass"], t["source"]) for t in later] == [(1, "big")] * 6 + [(2, "big")] * 6
    skips = [s for s in load_history(q.storage).prompts.values() if s.skipped]
    assert len(skips) == 2 * 5
