"""The weight-update bracket with producers that are slow, dead, deaf or mid-write.

Deterministic and single-threaded: the bracket's injected ``sleep`` advances a fake clock
and runs one pass of each producer that is still "alive" (so nothing here is timed).
"""

from __future__ import annotations

import numpy as np
import pytest

from strawq.collector.bracket import WeightUpdateBracket
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BracketError, BracketTimeout
from strawq.collector.reader import BatchReader
from strawq.dataset import Dataset
from strawq.names import TaskName, data_key
from tests.collector.helpers import FakeClock, SimProducer, make_run, write_dataset

LEASE = 2.0


@pytest.fixture
def world(tmp_path):
    q = make_run(str(tmp_path / "run"), lease_timeout_s=LEASE, heartbeat_interval_s=0.5)
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 40))
    clock = FakeClock()
    col = Collector(q, ds, CollectorConfig(batch_groups=4, max_running=12, max_ready=12,
                                           max_prefetch_batches=10, poll_interval_s=0),
                    clock=clock, sleep=clock.sleep)
    col.start(wait=False)
    return q, col, clock


def _run(col, clock, prods, steps):
    for _ in range(steps):
        col.step()
        for p in prods:
            p.step()
        clock.t += 0.1


def _leases_of(q, producer):
    return [n for n in q.storage.list("leased") if TaskName.parse(n).producer == producer]


@pytest.mark.timeout(60)
def test_slow_producers_pause_persist_partials_and_resume_on_new_version(world):
    q, col, clock = world
    fast = SimProducer(q, "fast", seed=1, chunk=2, max_new=(6, 12))
    slow = SimProducer(q, "slow", seed=2, chunk=2, max_new=(6, 12))
    _run(col, clock, [fast, slow], 3)
    assert _leases_of(q, "fast") and _leases_of(q, "slow")
    calls = {"n": 0}

    def hook():
        calls["n"] += 1
        fast.step()
        if calls["n"] >= 5:  # the slow one notices the pause only after 5 polls
            slow.step()
    clock.hook = hook
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    rep = bracket.weight_update(lambda v: None, timeout=60)
    clock.hook = None
    assert rep.version == 1 and rep.acked == {"fast", "slow"} and not rep.dead
    assert not rep.stray_leases
    assert fast.partials + slow.partials > 0
    assert q.current_version() == 1 and not bracket.is_open
    partial = [n for n in q.storage.list("pending") if n.startswith("a")]
    assert partial
    # resume: the partials finish on version 1, their tokens span versions 0 and 1
    _run(col, clock, [fast, slow], 40)
    reader = BatchReader(q)
    multi = 0
    for _ in range(len(col.batches.batch_seqs()[0])):
        b = reader.next_batch(timeout=1)
        multi += int(b.stats["staleness/multi_version_frac"] > 0)
        assert set(np.unique(b.versions.numpy())) <= {-1, 0, 1}
    assert multi > 0


@pytest.mark.timeout(60)
def test_dead_producer_is_not_waited_for_and_its_leases_expire(world):
    q, col, clock = world
    live = SimProducer(q, "live", seed=1, chunk=1, max_new=(8, 12))
    dead = SimProducer(q, "dead", seed=2, chunk=1, max_new=(8, 12))
    _run(col, clock, [live, dead], 3)
    held = {TaskName.parse(n).id for n in _leases_of(q, "dead")}
    assert held
    clock.hook = live.step  # "dead" never runs again
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    rep = bracket.begin_weight_update(timeout=60)
    assert rep.acked == {"live"} and set(rep.dead) == {"dead"}
    # not waited for after the liveness timeout, well before its leases expire
    assert bracket.liveness_s <= rep.dead["dead"] < LEASE
    bracket.end_weight_update()
    clock.hook = None
    col.step()
    assert {TaskName.parse(n).id for n in _leases_of(q, "dead")} == held  # still its own
    clock.t += LEASE
    col.step()  # after the lease timeout the grantor expires the dead producer's leases
    for tid in held:
        state, name = q.find(tid)
        assert state in ("pending", "leased")
        assert name.producer != "dead"


@pytest.mark.timeout(60)
def test_deaf_producer_fails_the_bracket_by_name_then_abort(world):
    q, col, clock = world
    ok = SimProducer(q, "ok", seed=1)
    deaf = SimProducer(q, "deaf", seed=2)
    _run(col, clock, [ok, deaf], 2)

    def hook():
        ok.step()
        q.heartbeat("deaf")  # alive, but never looks at the control channel
    clock.hook = hook
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    with pytest.raises(BracketTimeout, match=r"\['deaf'\]") as err:
        bracket.begin_weight_update(timeout=5)
    assert set(err.value.missing) == {"deaf"}
    assert bracket.is_open
    bracket.abort_weight_update()
    assert not bracket.is_open and q.current_version() == 0
    # the next bracket takes a fresh version number (acks of the aborted one do not count)
    clock.hook = lambda: (ok.step(), deaf.step())
    rep = bracket.begin_weight_update(timeout=30)
    assert rep.version == 2 and rep.acked == {"ok", "deaf"}
    assert bracket.end_weight_update() == 2 and q.current_version() == 2


@pytest.mark.timeout(60)
def test_producer_dead_mid_write_of_a_partial(world):
    q, col, clock = world
    live = SimProducer(q, "live", seed=1, chunk=1, max_new=(6, 9))
    victim = SimProducer(q, "victim", seed=2, chunk=1, max_new=(6, 9))
    _run(col, clock, [live, victim], 3)
    w = victim.work[0]
    # the victim published its partial payload and died before the rename (mid-write)
    q.storage.publish(data_key(w.lease.task_id, w.lease.gen, "partial"),
                      victim._group(w, final=False).encode())
    clock.hook = live.step
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    rep = bracket.weight_update(lambda v: None, timeout=60)
    clock.hook = None
    assert "victim" in rep.dead
    clock.t += LEASE  # its leases expire after the lease timeout, as ever
    col.step()
    state, name = q.find(w.lease.task_id)
    assert state == "pending" and name.gen == w.lease.gen + 1
    assert name.resume == w.lease.name.resume  # the orphan payload is never resumed from
    _run(col, clock, [live], 60)
    state, _ = q.find(w.lease.task_id)
    assert state in ("ready", "batched")
    assert live.completed.count(w.lease.task_id) == 1


@pytest.mark.timeout(60)
def test_open_bracket_is_continued_after_a_trainer_crash(world):
    q, col, clock = world
    p = SimProducer(q, "p", seed=1)
    _run(col, clock, [p], 2)
    clock.hook = p.step
    first = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    assert first.begin_weight_update(timeout=30).version == 1
    # trainer dies here; a new one starts, sees the open pause and finishes it
    second = WeightUpdateBracket(q, clock=clock, sleep=clock.sleep)
    assert second.is_open
    rep = second.begin_weight_update(timeout=30)
    assert rep.continued and rep.version == 1
    assert second.end_weight_update() == 1
    with pytest.raises(BracketError, match="no weight-update bracket is open"):
        second.end_weight_update()
    with pytest.raises(BracketError, match="expected a version >= 2"):
        second.begin_weight_update(timeout=30)
        second.end_weight_update(1)


def test_repair_pushes_the_run_version_to_noted_engines_only_outside_a_bracket(world):
    q, _col, clock = world
    q.set_version(3)
    pushed: list[tuple[list[str], int]] = []

    def push_to(urls, version):
        pushed.append((list(urls), version))
        return ["http://b"]  # b refused again: its note stays

    bracket = WeightUpdateBracket(q, clock=clock, sleep=clock.sleep, repair=push_to,
                                  repair_interval_s=None)
    assert bracket.repair_engines() == [] and pushed == []  # nothing noted: no push
    bracket.engines.mark("http://a", writer="p1", engine_version=1, run_version=3, reason="r")
    bracket.mark_needing_weights(["http://b"], reason="push failed")
    assert set(bracket.engines_needing_weights()) == {"http://a", "http://b"}
    assert bracket.repair_engines() == ["http://a"]
    assert pushed == [(["http://a", "http://b"], 3)]
    assert set(bracket.engines_needing_weights()) == {"http://b"}
    bracket.control.pause(4)  # a bracket: its own push reaches every engine
    with pytest.raises(BracketError, match="bracket is open"):
        bracket.repair_engines()
    bracket.end_weight_update(4)  # resumes, then repairs what is noted
    assert pushed[-1] == (["http://b"], 4)
    bracket.close()
