"""The weight-update bracket with producers that are slow, dead, deaf or mid-write.

Deterministic and single-threaded: the bracket's injected ``sleep`` advances a fake clock
and runs one pass of each producer that is still "alive" (so nothing here is timed).
"""

from __future__ import annotations

import functools
import json
import urllib.request

import numpy as np
import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BracketError, BracketTimeout
from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.errors import StrawqError
from strawq.ondisk.names import TaskName, data_key
from strawq.weights.control import Control
from strawq.weights.engine_weights import EngineWeights
from tests.collector.helpers import FakeClock, SimProducer, make_run, write_dataset
from tests.producers.test_engine_versions import sim

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
    a, b = sim("1"), sim("1")  # engines that answer, on another version
    silent = "http://127.0.0.1:9"  # nothing listens: noted, never pushed to

    def push_to(urls, version):
        pushed.append((list(urls), version))
        return [b.url]  # b refused again: its note stays

    bracket = WeightUpdateBracket(q, clock=clock, sleep=clock.sleep, repair=push_to,
                                  repair_interval_s=None, probe_timeout_s=2.0)
    try:
        assert bracket.repair_engines() == [] and pushed == []  # nothing noted: no push
        bracket.engines.mark(a.url, writer="p1", engine_version=1, run_version=3, reason="r")
        bracket.mark_needing_weights([b.url, silent], reason="push failed")
        assert set(bracket.engines_needing_weights()) == {a.url, b.url, silent}
        assert bracket.repair_engines() == [a.url]
        assert pushed == [(sorted([a.url, b.url]), 3)]
        assert set(bracket.engines_needing_weights()) == {b.url, silent}
        bracket.control.pause(4)  # a bracket: its own push reaches every engine
        with pytest.raises(BracketError, match="bracket is open"):
            bracket.repair_engines()
        bracket.end_weight_update(4)  # resumes, then repairs what is noted
        assert pushed[-1] == ([b.url], 4)
    finally:
        bracket.close()
        a.stop()
        b.stop()


def test_without_a_repair_an_update_warns_about_engines_still_on_other_weights(world, caplog):
    """No repair configured: at the end of an update the engines noted on other weights are
    probed; one that does not answer keeps its note and is named in a warning."""
    q, _col, clock = world
    url = "http://127.0.0.1:9"  # nothing listens: the probe is refused at once
    bracket = WeightUpdateBracket(q, clock=clock, sleep=clock.sleep, probe_timeout_s=1.0)
    bracket.engines.mark(url, writer="p1", engine_version=0, run_version=0, reason="r")
    bracket.begin_weight_update(timeout=5)
    with caplog.at_level("WARNING"):
        assert bracket.end_weight_update() == 1
    warned = [r.getMessage() for r in caplog.records if "no repair is configured" in
              r.getMessage()]
    assert len(warned) == 1 and url in warned[0]
    assert set(bracket.engines_needing_weights()) == {url}


# -- rank 0 only ---------------------------------------------------------------------------------
def test_the_bracket_refuses_to_run_on_a_rank_other_than_0(tmp_path, monkeypatch):
    """Run on every rank, the bracket would announce a version per rank and step (ack is a
    no-op there, the bracket was not): it refuses, and reader.weight_update is the call
    that is safe on every rank."""
    q = make_run(str(tmp_path / "run"), lease_timeout_s=LEASE)
    pushed: list[int] = []
    monkeypatch.setenv("RANK", "2")  # torchrun's rank, for a bracket built without one
    with pytest.raises(BracketError, match="rank 2"):
        WeightUpdateBracket(q).weight_update(pushed.append)
    monkeypatch.delenv("RANK")
    for rank in (1, 3):
        bracket = WeightUpdateBracket(q, rank=rank)
        for call in (bracket.begin_weight_update, bracket.end_weight_update,
                     bracket.abort_weight_update, bracket.finish_weight_update,
                     functools.partial(bracket.weight_update, pushed.append)):
            with pytest.raises(StrawqError, match=f"rank {rank}: the weight-update bracket "
                               "runs on rank 0 only.*reader.weight_update"):
                call()
    assert pushed == [] and q.current_version() == 0 and not Control(q.storage).state().paused
    # the same loop on every rank of a world of 4: one version per step, pushed once
    readers = [BatchReader(q, rank=r, world_size=4) for r in range(4)]
    for _step in range(2):
        reports = [r.weight_update(pushed.append, timeout=5) for r in readers]
        assert [rep is None for rep in reports] == [False, True, True, True]
    assert pushed == [1, 2] and q.current_version() == 2
    monkeypatch.setenv("RANK", "0")
    assert WeightUpdateBracket(q).weight_update(pushed.append).version == 3


# -- settled by what the engines hold ------------------------------------------------------------
@pytest.fixture
def sims():
    from strawq.producers.engines.launch import EngineOptions
    from strawq.producers.engines.testing import EngineThread

    engines = [EngineThread(EngineOptions(kind="sim", weight_version="3")) for _ in range(2)]
    yield engines
    for e in engines:
        e.stop()


def _hold(engine, version: int) -> None:
    """The engine loads version ``version`` (SGLang's ``/update_weight_version``)."""
    req = urllib.request.Request(f"{engine.url}/update_weight_version", method="POST",
                                 data=json.dumps({"new_version": str(version)}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["success"]


def test_a_restarted_trainer_finishes_or_undoes_by_what_the_engines_hold(tmp_path, sims):
    q = make_run(str(tmp_path / "run"), lease_timeout_s=LEASE)
    q.set_version(3)
    a, b = sims
    for e in sims:
        EngineWeights(q.storage).register(e.url)  # as the producers do
    WeightUpdateBracket(q).begin_weight_update(timeout=5)  # version 4; the trainer dies
    for e in sims:
        _hold(e, 4)  # ... after its push reached every engine
    restarted = WeightUpdateBracket(q)
    assert restarted.is_open
    assert {u: p.version for u, p in restarted.engine_versions().items()} == {
        a.url: 4, b.url: 4}
    with pytest.raises(BracketError, match="weights reached the engines.*finish_weight_update"):
        restarted.abort_weight_update()
    done = restarted.finish_weight_update()
    assert (done.action, done.version) == ("finish", 4)
    assert q.current_version() == 4 and not restarted.is_open
    # the next trainer dies before its push: finishing undoes it
    WeightUpdateBracket(q).begin_weight_update(timeout=5)
    undone = WeightUpdateBracket(q).finish_weight_update()
    assert (undone.action, undone.version, undone.bracket) == ("undo", 4, 5)
    assert q.current_version() == 4 and not Control(q.storage).state().paused
    # a push that reached one engine of two: neither finished nor undone nor aborted
    WeightUpdateBracket(q).begin_weight_update(timeout=5)
    _hold(a, 6)
    third = WeightUpdateBracket(q)
    with pytest.raises(BracketError, match=f"version 4: {b.url}; version 6: {a.url}"):
        third.finish_weight_update()
    with pytest.raises(BracketError, match=f"{a.url} holds version 6"):
        third.abort_weight_update()
    assert third.is_open and q.current_version() == 4
    _hold(b, 6)  # the retried push reached the other one too
    assert third.finish_weight_update().version == 6 and q.current_version() == 6


def test_finish_without_an_engine_that_answers(tmp_path):
    q = make_run(str(tmp_path / "run"), lease_timeout_s=LEASE)
    bracket = WeightUpdateBracket(q, engine_urls=["http://127.0.0.1:9"],
                                  probe_timeout_s=0.5)
    bracket.begin_weight_update(timeout=5)
    with pytest.raises(BracketError, match="no engine answered.*127.0.0.1:9 unreachable"):
        bracket.finish_weight_update()
    assert bracket.is_open
    bracket.abort_weight_update()  # nothing says the new version reached an engine
    assert not bracket.is_open and q.current_version() == 0
    bracket.begin_weight_update(timeout=5)
    assert bracket.finish_weight_update(if_unknown="end").version == 2  # slime's close


def test_repair_clears_the_notes_of_engines_already_on_the_run_version(tmp_path, sims):
    """A note whose engine holds the run's version (fixed by hand, its writer gone) is
    deleted by the trainer's repair without a push; a note on an engine behind is pushed."""
    q = make_run(str(tmp_path / "run"), lease_timeout_s=LEASE)
    q.set_version(3)
    fine, behind = sims
    _hold(behind, 2)
    notes = EngineWeights(q.storage)
    for e in sims:
        notes.mark(e.url, writer="p-gone", engine_version=2, run_version=3, reason="r")
    pushed: list[tuple[list[str], int]] = []
    bracket = WeightUpdateBracket(q, repair_interval_s=None)
    assert bracket.repair_engines(lambda urls, v: pushed.append((urls, v))) == [behind.url]
    assert pushed == [([behind.url], 3)] and not notes.needing()
    # without a repair, the end of an update still deletes the notes of engines on it
    for e in sims:
        notes.mark(e.url, writer="p-gone", engine_version=3, run_version=3, reason="r")
    bracket.begin_weight_update(timeout=5)
    for e in sims:
        _hold(e, 4)
    _hold(behind, 3)  # this one missed the push
    bracket.end_weight_update(4)
    assert set(notes.needing()) == {behind.url}


def test_settle_decides_by_what_the_engines_hold():
    from strawq.collector.trainer.bracket import settle
    from strawq.weights.control import ControlState
    from strawq.weights.engine_weights import EngineProbe

    def on(**versions):
        return {u: EngineProbe(u, v, None if v is not None else "cannot reach it")
                for u, v in versions.items()}

    open_4 = ControlState(4, 3, frozenset({"p1"}))  # the run at 3, the bracket for 4 open
    aborted_4 = ControlState(4, 4, frozenset())
    closed = ControlState(3, 3, frozenset())
    cases = [
        (open_4, on(a=4, b=4), "finish", 4),
        (open_4, on(a=4, b=None), "finish", 4),  # the unreachable one is named, not waited
        (open_4, on(a=5, b=5), "finish", 5),  # a push under a later version (version=)
        (open_4, on(a=3, b=3), "undo", 3),
        (open_4, on(a=3, b=4), "refuse", 3),
        (open_4, on(a=None), "refuse", 3),
        (open_4, {}, "refuse", 3),
        (open_4, on(a=2, b=2), "refuse", 3),
        (aborted_4, on(a=4, b=4), "finish", 4),
        (aborted_4, on(a=3), "none", 3),
        (closed, on(a=3), "none", 3),
        (closed, {}, "none", 3),
        (closed, on(a=2, b=3), "refuse", 3),
    ]
    for state, engines, action, version in cases:
        got = settle(state, 3, engines)
        assert (got.action, got.version) == (action, version), (state, engines, got.message)
    msg = settle(open_4, 3, on(a=3, b=4, c=None)).message
    assert "version 3: a; version 4: b" in msg and "not heard from: c" in msg
    assert "none known" in settle(open_4, 3, {}).message


@pytest.mark.timeout(60)
def test_a_producer_that_acks_while_holding_leases_is_reported(world, caplog):
    """An ack means "holds no lease": a producer that acks and keeps its leases (a bug) is
    not waited for again, and its leases are named in the report and the log."""
    q, col, clock = world
    buggy = SimProducer(q, "buggy", seed=3, chunk=2, max_new=(6, 12))
    _run(col, clock, [buggy], 3)
    held = sorted(_leases_of(q, "buggy"))
    assert held

    def hook():  # acks the pause without parking anything
        state = Control(q.storage).state()
        if state.paused and "buggy" not in state.acks:
            Control(q.storage).ack(state.pause_version, "buggy")
    clock.hook = hook
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    with caplog.at_level("ERROR"):
        rep = bracket.begin_weight_update(timeout=60)
    clock.hook = None
    assert rep.acked == {"buggy"}
    assert sorted(rep.stray_leases) == held
    assert any("still hold leases" in r.getMessage() for r in caplog.records)
    bracket.end_weight_update()


@pytest.mark.timeout(60)
def test_a_producer_whose_ack_counts_its_held_leases_is_not_reported(world, caplog):
    """A producer holding its groups through the pause (``timing.hold_through_pause``) acks
    with ``held``: its leases are not stray; more leases than its ack counts are."""
    q, col, clock = world
    holder = SimProducer(q, "holder", seed=3, chunk=2, max_new=(6, 12))
    _run(col, clock, [holder], 3)
    held = sorted(_leases_of(q, "holder"))
    assert held
    count = {"n": len(held)}

    def hook():  # acks the pause, counting the leases it keeps
        state = Control(q.storage).state()
        if state.paused and "holder" not in state.acks:
            Control(q.storage).ack(state.pause_version, "holder", held=count["n"])
    clock.hook = hook
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    with caplog.at_level("ERROR"):
        rep = bracket.begin_weight_update(timeout=60)
    assert rep.acked == {"holder"} and rep.stray_leases == []
    assert not any("still hold leases" in r.getMessage() for r in caplog.records)
    bracket.end_weight_update()

    count["n"] = len(held) - 1  # an ack that counts fewer than it holds: reported
    bracket = WeightUpdateBracket(q, monitor=col.monitor, clock=clock, sleep=clock.sleep)
    rep = bracket.begin_weight_update(timeout=60)
    clock.hook = None
    assert rep.stray_leases and set(rep.stray_leases) <= set(_leases_of(q, "holder"))
    bracket.end_weight_update()
