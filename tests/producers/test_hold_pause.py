"""A bracket weight update that keeps the producer's leases (``timing.hold_through_pause``):
no group is yielded, one journal record per producer at the pause, the held groups go on
after the resume from their own tokens; a crash after the ack resumes them from the journal
elsewhere; a held group past η after the update is handled as a claimed partial would be."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.producers.producer import Producer
from strawq.producers.producer_config import TimingConfig
from strawq.producers.sglang_client import SGLangClient
from strawq.tasks.eta import STALE_REASON, EtaPolicy, publish_policy
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.journal import load_chain, writers
from strawq.weights.control import Control
from tests.producers.helpers import ids, make_run, names, ready_groups, run_producers, wait_for
from tests.producers.test_faults import cfg, check_exactly_once

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
#: long groups (the pause lands mid-generation) and no journal window before the pause
HOLD: dict[str, Any] = {
    "budget": {"slots": 3},
    "sampling": {"max_new_tokens": 3000, "ignore_eos": True, "seed": 3},
    "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02, "abort_deadline_s": 2.0,
               "journal_every_tokens": 0, "journal_every_s": 60.0,
               "hold_through_pause": True}}


async def _push_version(url: str, version: int) -> None:
    async with SGLangClient([url]) as client:
        await client.update_weight_version(version, abort_all_requests=False)


def _holding(tmp_path: Path, sim_engine: Any, n: int,
             hold: bool | None = True) -> tuple[Any, Control, Producer]:
    """A run of ``n`` tasks, its ``control/`` and a producer that holds its groups through
    a pause (``HOLD``; ``hold``: its ``timing.hold_through_pause``, None the default) on
    ``sim_engine``."""
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=5.0, heartbeat_interval_s=0.1)
    timing = {k: v for k, v in HOLD["timing"].items() if k != "hold_through_pause"}
    if hold is not None:
        timing["hold_through_pause"] = hold
    return q, Control(q.storage), Producer(cfg(run, [sim_engine.url], **{**HOLD,
                                                                         "timing": timing}))


async def _paused_while_generating(p: Producer, control: Control) -> None:
    """Once ``p`` generates, open a pause and wait for its ack."""
    await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
    control.pause(1)
    await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")


def _held_tokens(p: Producer) -> dict[str, list[np.ndarray]]:
    """Per group the producer holds now, its samples' tokens."""
    return {a.lease.task_id: [s.response_ids.copy() for s in a.run.samples]
            for a in p.runner.groups.values() if a.run is not None}


def test_hold_through_pause_needs_the_journal(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hold_through_pause needs the in-flight journal"):
        TimingConfig(hold_through_pause=True, journal_every_s=0.0, journal_every_tokens=0)
    assert TimingConfig(hold_through_pause=False, journal_every_s=0.0).hold_through_pause is False
    run = tmp_path / "run"
    make_run(str(run), 1)
    url = ["http://127.0.0.1:1"]
    # the default (None) holds whenever the producer keeps the journal, parks otherwise
    assert TimingConfig().hold_through_pause is None
    assert Producer(cfg(run, url))._bracket.holds
    assert not Producer(cfg(run, url, timing={"hold_through_pause": False}))._bracket.holds
    off = {"journal_every_s": 0.0, "journal_every_tokens": 0}
    assert not Producer(cfg(run, url, timing=off))._bracket.holds
    turns = {"plugins": {"reward": "strawq.producers.rewards.count_task",
                         "generate": "tests.producers.trajectory_plugins.tool_agent",
                         "generate_args": {"ledger": str(tmp_path / "ledger")}},
             "tools": {"checkpoint_every_turns": 1}}
    # turn checkpoints keep no journal: refused, not a park in disguise
    with pytest.raises(ConfigError, match="turn checkpoints"):
        Producer(cfg(run, ["http://127.0.0.1:1"], timing={"hold_through_pause": True},
                     **turns))
    plain = Producer(cfg(run, url, **turns))  # the default: parks, as it keeps no journal
    assert plain.journal is None and not plain._bracket.holds


@pytest.mark.slow
@pytest.mark.parametrize("hold", [True, None], ids=["hold", "default"])
def test_a_held_bracket_yields_nothing_and_continues_the_groups(tmp_path: Path, sim_engine: Any,
                                                                hold: bool | None) -> None:
    n = 6
    q, control, p = _holding(tmp_path, sim_engine, n, hold=hold)
    seen: dict[str, Any] = {}

    async def body() -> None:
        await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
        before = p.stats().journal_records
        control.pause(1)
        await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")
        seen["records"] = p.stats().journal_records - before
        seen["yielded"] = [t for t in names(q, "pending") if t.resume >= 0]
        seen["partials"] = [k for k in q.storage.list("data") if k.endswith(".partial")]
        seen["leased"] = sorted(t.id for t in names(q, "leased")
                                if t.producer == p.producer_id)
        seen["held"] = _held_tokens(p)
        seen["ack_held"] = control.held(1, p.producer_id)
        # the held groups keep their slots: what their unfinished samples need is demanded
        seen["demand"] = (p.pool.demand, sum(len(a.run.unfinished())
                                             for a in p.runner.groups.values() if a.run))
        await _push_version(sim_engine.url, 1)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all ready")

    asyncio.run(run_producers([p], body))
    held = seen["held"]
    assert held, "the pause found no group in flight"
    assert seen["yielded"] == [] and seen["partials"] == []  # no yield_journaled, no .partial
    assert seen["records"] == 1  # one journal record for every held group
    assert seen["leased"] == sorted(held)  # the leases kept through the pause
    assert seen["ack_held"] == len(held)
    demand, unfinished = seen["demand"]
    assert unfinished > 0 and demand == unfinished
    st = p.stats()
    assert st.groups_yielded == 0 and st.groups_yielded_journal == 0
    assert st.groups_held == len(held) and st.journal_resumes == 0
    check_exactly_once(q, n)
    ready = ready_groups(q)
    spans = 0
    for tid, toks in held.items():
        g = ready[tid]
        for i, before in enumerate(toks):
            c = g.sample(i)
            np.testing.assert_array_equal(c["tokens"][:len(before)], before)  # kept
            v = c["versions"]
            assert np.all(v[:len(before)] == 0)  # before the pause: the old weights
            assert np.all(v[len(before):] == 1)  # after it: the new ones
            spans += int(len(before) < len(v) and len(before) > 0)
    assert spans > 0


def _producer_process(run: Path, url: str, *sets: str) -> subprocess.Popen[str]:
    """``strawq producer`` on ``run`` in a process of its own (3 slots, long groups on
    ``url``), with ``--set`` for each of ``sets``."""
    code = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"
    flags = [f for kv in ("sampling.max_new_tokens=3000", "sampling.ignore_eos=true",
                          "timing.idle_poll_s=0.02", *sets) for f in ("--set", kv)]
    return subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(run), "--engine", url,
         "--reward", "strawq.producers.rewards.count_task", "--slots", "3", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})


def _journal_tokens(q: Any) -> dict[str, dict[int, np.ndarray]]:
    """Per leased task, its samples' tokens in its holder's journal prefix."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for w in writers(q.storage):
        for x in names(q, "leased"):
            chain = load_chain(q.storage, w, x.id, x.gen)
            if chain is None:
                continue
            toks: dict[int, np.ndarray] = {}
            for e in chain:
                for part in e["samples"]:
                    i = int(part["i"])
                    new = np.frombuffer(part["tokens"], np.int32)
                    toks[i] = new if part["start"] == 0 else np.concatenate([toks[i], new])
            out[x.id] = toks
    return out


@pytest.mark.slow
@pytest.mark.process
def test_a_producer_killed_after_a_held_ack_is_resumed_from_its_journal(
        tmp_path: Path, sim_engine: Any) -> None:
    n = 3
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=1.0, heartbeat_interval_s=0.1)
    control = Control(q.storage)
    proc = _producer_process(run, sim_engine.url, "timing.control_poll_s=0.02",
                             "timing.journal_every_s=60", "timing.hold_through_pause=true")
    try:
        deadline = time.monotonic() + 60
        while len(names(q, "leased")) < n:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the producer never held every task"
            time.sleep(0.05)
        time.sleep(0.3)  # tokens into every group
        control.pause(1)
        while not control.state().acks:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no ack"
            time.sleep(0.02)
        (holder,) = control.state().acks
        assert control.held(1, holder) == n  # nothing finished: every group held
        got = _journal_tokens(q)
    finally:
        proc.kill()  # kill -9 after the ack: no park, no hand-back
        proc.wait()
    assert sorted(got) == ids(q, "leased")
    assert all(len(t) for toks in got.values() for t in toks.values())
    assert not [k for k in q.storage.list("data") if k.endswith(".partial")]
    control.resume(1)

    healthy = Producer(cfg(run, [sim_engine.url], budget={"slots": 3},
                           sampling={"max_new_tokens": 3000, "ignore_eos": True}))
    monitor = LeaseMonitor(q)

    async def body() -> None:
        deadline = asyncio.get_running_loop().time() + 90
        while len(ids(q, "ready")) < n:
            assert asyncio.get_running_loop().time() < deadline, "work not finished"
            monitor.scan()
            await asyncio.sleep(0.05)

    asyncio.run(run_producers([healthy], body))
    check_exactly_once(q, n)
    assert healthy.stats().journal_resumes == n
    for tid, group in ready_groups(q).items():  # what the held ack promised is kept
        for i, toks in got[tid].items():
            np.testing.assert_array_equal(group.sample(i)["tokens"][:len(toks)], toks)


@pytest.mark.slow
def test_a_held_group_past_eta_after_the_update_is_handled_as_a_claimed_partial(
        tmp_path: Path, sim_engine: Any) -> None:
    """η = 0 under ``drop``: each held group with tokens of version 0 is one version behind
    at the resume and is dropped (stale) as a claimed partial of that prefix would be."""
    n = 3
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=5.0, heartbeat_interval_s=0.1)
    publish_policy(q.storage, EtaPolicy(0, "drop", epoch=1))  # before the producer starts
    control = Control(q.storage)
    p = Producer(cfg(run, [sim_engine.url], **HOLD))
    seen: dict[str, Any] = {}

    async def body() -> None:
        await wait_for(lambda: len(p.runner.groups) == n
                       and all(a.run is not None and a.run.oldest_version() is not None
                               for a in p.runner.groups.values()), 30, "tokens in every group")
        control.pause(1)
        await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")
        seen["held"] = _held_tokens(p)
        await _push_version(sim_engine.url, 1)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "dropped")) == n, 60, "all dropped")

    asyncio.run(run_producers([p], body))
    assert len(seen["held"]) == n
    st = p.stats()
    assert st.drop_reasons.get(STALE_REASON) == n
    assert st.groups_yielded == 0 and not ids(q, "ready")


@pytest.mark.slow
def test_a_stop_during_a_held_pause_parks_the_held_groups(tmp_path: Path,
                                                         sim_engine: Any) -> None:
    """A stop keeps today's behaviour: the held groups are parked into the journal (one
    rename each, no ``.partial``) and the producer holds no lease."""
    n = 6
    q, control, p = _holding(tmp_path, sim_engine, n)
    seen: dict[str, Any] = {}

    async def body() -> None:
        await _paused_while_generating(p, control)
        seen["held"] = _held_tokens(p)  # the stop comes before the resume

    asyncio.run(run_producers([p], body))
    held = seen["held"]
    assert held
    assert not names(q, "leased")
    parked = {t.id: t for t in names(q, "pending") if t.resume >= 0}
    assert sorted(parked) == sorted(held)
    assert all(t.producer == p.producer_id for t in parked.values())
    assert not [k for k in q.storage.list("data") if k.endswith(".partial")]
    st = p.stats()
    assert st.groups_held == len(held) and st.groups_yielded_journal == len(held)


@pytest.mark.slow
def test_a_held_pause_whose_record_fails_parks_the_groups_before_it_acks(
        tmp_path: Path, sim_engine: Any) -> None:
    """The ack must not promise state held in memory only: when the journal record fails,
    every group is parked (here into ``.partial`` saves: the journal fails them too) and the
    ack counts no held lease."""
    n = 6
    q, control, p = _holding(tmp_path, sim_engine, n)
    assert p.journal is not None

    async def failing(**_kw: Any) -> bool:
        return False

    p.journal.flush = failing  # type: ignore[method-assign]
    seen: dict[str, Any] = {}

    async def body() -> None:
        await _paused_while_generating(p, control)
        seen["leased"] = [t for t in names(q, "leased") if t.producer == p.producer_id]
        seen["partials"] = [k for k in q.storage.list("data") if k.endswith(".partial")]
        seen["ack_held"] = control.held(1, p.producer_id)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all ready")

    asyncio.run(run_producers([p], body))
    assert seen["leased"] == [] and seen["ack_held"] == 0
    assert seen["partials"] and p.stats().groups_yielded == len(seen["partials"])
    assert p.stats().groups_held == 0
    check_exactly_once(q, n)


@pytest.mark.slow
@pytest.mark.process
def test_a_producer_silent_at_a_held_pause_is_not_waited_for_and_loses_nothing(
        tmp_path: Path, sim_engine: Any) -> None:
    """The crash table's first row for a held pause: a producer (holding by default, the
    journal on) stops before it acks. The trainer judges it dead and resumes without it;
    its leases expire and each group is resumed elsewhere from its journal windows. When it
    wakes after that, nothing it held is completed twice."""
    import signal

    from strawq.collector.trainer.bracket import WeightUpdateBracket

    n = 3
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=2.0, heartbeat_interval_s=0.1)
    # the journal on (streamed, a window every 0.3 s): held by default
    proc = _producer_process(run, sim_engine.url, "timing.control_poll_s=0.5",
                             "timing.journal_every_s=0.3", "engine.client.stream=true")
    bracket = WeightUpdateBracket(q, lease_timeout_s=2.0, poll_interval_s=0.02)
    try:
        deadline = time.monotonic() + 60
        while True:  # every task held, with tokens in its journal windows
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the producer never journaled every task"
            leased = names(q, "leased")
            if len(leased) == n and len(_journal_tokens(q)) == n:
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)  # silent before it could see the pause
        (stopped,) = {t.producer for t in names(q, "leased")}
        got = _journal_tokens(q)  # what its windows made durable before the pause
        assert got and sorted(got) == ids(q, "leased")
        assert any(len(t) for toks in got.values() for t in toks.values())
        report = bracket.begin_weight_update(timeout=30.0)
        assert stopped in report.dead and stopped not in report.acked, report
        assert control_acks(q) == set()
        asyncio.run(_push_version(sim_engine.url, 1))  # the trainer's push
        bracket.end_weight_update(1)
        monitor = bracket.monitor  # it has watched the silent heartbeat since the pause
        while [t for t in names(q, "leased") if t.producer == stopped]:  # the lease timeout
            assert time.monotonic() < deadline + 30, "its leases never expired"
            monitor.scan()
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGCONT)  # it wakes holding leases that are gone

        healthy = Producer(cfg(run, [sim_engine.url], budget={"slots": 3},
                               sampling={"max_new_tokens": 3000, "ignore_eos": True}))

        async def body() -> None:
            loop = asyncio.get_running_loop()
            end = loop.time() + 90
            while len(ids(q, "ready")) < n:
                assert loop.time() < end, "work not finished"
                monitor.scan()
                await asyncio.sleep(0.05)

        asyncio.run(run_producers([healthy], body))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    check_exactly_once(q, n)
    # each group went on from the windows the silent producer wrote before the pause
    for tid, group in ready_groups(q).items():
        for i, toks in got[tid].items():
            np.testing.assert_array_equal(group.sample(i)["tokens"][:len(toks)], toks)


def control_acks(q: Any) -> set[str]:
    return set(Control(q.storage).state().acks)
