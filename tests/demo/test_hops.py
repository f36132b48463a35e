"""The demo's hop tracer and idle-gap finder, on synthetic events and samples."""

from __future__ import annotations

import pytest

from strawq.config import QueueConfig
from strawq.demo.hops import HopTracer, histogram, idle_gaps
from strawq.ondisk import records
from strawq.ondisk.names import queue_key
from strawq.storage import PosixStorage
from strawq.storage.watch import IN_MOVED_TO, Event
from strawq.tasks.queue import RunQueue


def ev(d: str, name: str, t: float) -> Event:
    return Event((d, name, IN_MOVED_TO, t))


def test_histogram_quantiles_in_ms():
    h = histogram([0.001 * i for i in range(1, 101)])
    assert h["count"] == 100 and h["p50_ms"] == 50.0 and h["p99_ms"] == 99.0
    assert h["max_ms"] == 100.0
    assert histogram([]) == {"count": 0}


def test_idle_gaps_need_the_trainer_waiting_and_every_engine_idle():
    engines = {"e0": [(0.0, 1.0), (1.0, 0.0), (1.5, 1.0), (3.0, 0.0), (4.0, 0.0)],
               "e1": [(0.0, 0.0), (1.2, 0.0), (2.0, 0.0), (3.0, 0.0), (4.0, 0.0)]}
    # all idle over [1.0, 1.5) and from 3.0; the trainer waits over [0.9, 1.3] and [2.5, 4]
    gaps = idle_gaps([(0.9, 1.3), (2.5, 4.0)], engines, threshold_s=0.1, work_until=3.5)
    assert gaps.count == 2
    assert gaps.gaps[0] == pytest.approx((1.0, 1.3))
    assert gaps.gaps[1] == pytest.approx((3.0, 3.5)) and gaps.longest_s == pytest.approx(0.5)
    short = idle_gaps([(0.9, 1.05)], engines, threshold_s=0.1)
    assert short.count == 0 and short.longest_s == 0.0


def test_tracer_times_each_hop(tmp_path):
    q = RunQueue.create(PosixStorage(str(tmp_path / "run")), QueueConfig(group_size=2))
    tr = HopTracer(q)
    q.storage.publish("cursor/000000000001/000000000001.000000000010", records.encode(
        records.Kind.CURSOR, {"seq": 1, "next_index": 10}))
    task = f"{queue_key('c', 0, 5)}~i000000000005~g0~a1~r-1~p0"
    ready = "000000000000.000000000005~i000000000005~g0~a1~r-1~p0"
    returned = f"{queue_key('b', 0, 9)}~i000000000009~g1~a2~r-1~p0"
    tr.process([
        ev("cursor", "000000000001", 0.9),
        ev("pending", "r-000000000001", 1.0),
        ev("leased", task, 1.25),
        ev("ready", ready, 2.0),
        ev("acked", "000000000007", 2.1),
        ev("pending", "r-000000000002", 2.3),
        ev("control", "pause-000000000002", 3.0),
        ev("control", "ack-000000000002~p0", 3.4),
        ev("control", "resume-000000000002", 3.5),
        ev("pending", returned.rsplit("~", 1)[0].replace("~a2", "~a1"), 3.2),
        ev("leased", returned, 3.6),
    ])
    s = tr.samples.hops
    assert s["release_to_claim"] == [pytest.approx(0.25), pytest.approx(0.4)]
    assert s["ack_to_release"] == [pytest.approx(0.2)]
    assert s["bracket_pause"] == [pytest.approx(0.4)]
    assert s["bracket_resume"] == [pytest.approx(0.1)]
    tr.add_producer_hops({"final_to_ready": [0.01, 0.02]})
    assert tr.samples.summary()["final_to_ready"]["count"] == 2
    assert tr.samples.marks["claim"] == [1.25, 3.6]
    tr.watch.close()


def test_cursor_bounds_from_any_cursor_layout(tmp_path):
    q = RunQueue.create(PosixStorage(str(tmp_path / "run")), QueueConfig(group_size=2))
    tr = HopTracer(q)
    rec = records.encode(records.Kind.CURSOR, {"seq": 3, "next_index": 40})
    q.storage.publish("cursor/000000000002.000000000030", rec)  # flat <seq>.<next>
    q.storage.publish("cursor/000000000003/000000000003.000000000040", rec)  # per-seq dir
    q.storage.publish("cursor/000000000004", records.encode(
        records.Kind.CURSOR, {"seq": 4, "next_index": 50}))  # only the content says
    assert tr._cursor_bound("000000000002.000000000030") == (30, 2)
    assert tr._cursor_bound("000000000003") == (40, 3)
    assert tr._cursor_bound("000000000004") == (50, 4)
    tr.watch.close()
