"""The producer wakes on new work and on the bracket (inotify), not on its idle polls; it
records its hand-off latencies. Behaviour only: the polls here are an hour long, so only
the wake-up can make the test finish within its own deadline."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    SamplerParams,
    TimingConfig,
)
from strawq.storage.watch import inotify_available
from strawq.weights.control import Control
from tests.producers.helpers import ids, make_run, run_producers, wait_for

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not inotify_available(), reason="no inotify on this OS")]

HOUR = 3600.0


def _config(run: Path, url: str, timing: TimingConfig, *, max_new_tokens: int = 32,
            slots: int = 2) -> ProducerConfig:
    """One sim engine, the length reward, seed 3: only the polls and sizes differ."""
    return ProducerConfig(
        run_dir=str(run),
        engine=EngineConfig(workers=(url,)),
        plugins=PluginsConfig(reward="tests.producers.plugins_for_tests.length_reward"),
        sampling=SamplerParams(max_new_tokens=max_new_tokens, seed=3),
        budget=BudgetConfig(slots=slots),
        timing=timing)


def test_new_work_and_a_pause_wake_an_idle_producer(tmp_path: Path, sim_engine: Any) -> None:
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=[])
    p = Producer(_config(run, sim_engine.url, TimingConfig(control_poll_s=HOUR, idle_poll_s=HOUR)))
    data = tmp_path / "later.jsonl"
    data.write_text("".join(json.dumps({"prompt": [5, 6, 7]}) + "\n" for _ in range(4)))

    async def body() -> None:
        # idle: it has looked once, found nothing, and would not look again for an hour
        await wait_for(lambda: p._wakeup.last_empty_claim > -math.inf, 30, "the first empty claim")
        Feeder(q, Dataset(str(data))).release(4)
        await wait_for(lambda: len(ids(q, "ready")) == 4, 60, "released work to be done")
        Control(q.storage).pause(1)
        await wait_for(lambda: p.producer_id in Control(q.storage).state().acks, 60,
                       "the pause to be acknowledged")

    asyncio.run(run_producers([p], body))
    hops = p.stats().hops
    assert len(hops["claim_to_generate"]) == 4 and len(hops["final_to_ready"]) == 4
    assert all(x >= 0 for xs in hops.values() for x in xs)


def test_idle_polls_stat_instead_of_listing(tmp_path: Path, sim_engine: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without events (another host's changes), an idle producer's polls stat pending/
    and control/ and list them only when they changed; new work is still found."""
    import strawq.producers.wake as wake_mod
    from strawq.storage.watch import DirProbe

    monkeypatch.setattr(wake_mod, "DirWatch", _NoEvents)
    probes = {"n": 0}
    real_changed = DirProbe.changed

    def counting(self: DirProbe) -> bool:
        probes["n"] += 1
        return real_changed(self)

    monkeypatch.setattr(DirProbe, "changed", counting)
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=[])
    p = Producer(_config(run, sim_engine.url, TimingConfig(control_poll_s=0.01, idle_poll_s=0.01)))
    listed = {"pending": 0, "control": 0}
    real_list = p.queue.storage.list

    def counting_list(d: str) -> list[str]:
        if d in listed:
            listed[d] += 1
        return real_list(d)

    p.queue.storage.list = counting_list  # type: ignore[method-assign]
    data = tmp_path / "later.jsonl"
    data.write_text("".join(json.dumps({"prompt": [5, 6, 7]}) + "\n" for _ in range(2)))

    async def body() -> None:
        await wait_for(lambda: probes["n"] >= 60, 60, "many idle polls")
        assert listed["pending"] <= 6 and listed["control"] <= 6, listed
        Feeder(q, Dataset(str(data))).release(2)  # seen through pending/'s mtime
        await wait_for(lambda: len(ids(q, "ready")) == 2, 60, "released work to be done")

    asyncio.run(run_producers([p], body))


@pytest.mark.slow
def test_an_idle_producer_marks_its_heartbeat_and_looks_rarely(
        tmp_path: Path, sim_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle (nothing to claim, no lease), a producer marks its heartbeat idle and then,
    over a window of ~20 of its former polls, beats not at all (once per lease timeout),
    stats only pending/ (once per ``idle_probe_s``) and reads nothing else: the
    operations of its polls, counted at the storage and at its probes. Released work (no
    event: another host's change) still reaches it through the probe."""
    import strawq.producers.wake as wake_mod
    from strawq.storage.watch import DirProbe

    monkeypatch.setattr(wake_mod, "DirWatch", _NoEvents)
    looks = {"probe": 0}
    real_changed = DirProbe.changed

    def counting(self: DirProbe) -> bool:
        looks["probe"] += 1
        return real_changed(self)

    monkeypatch.setattr(DirProbe, "changed", counting)
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=[], lease_timeout_s=30.0, heartbeat_interval_s=0.1)
    p = Producer(_config(run, sim_engine.url, TimingConfig(
        control_poll_s=0.05, idle_poll_s=0.05, idle_after_s=0.2, idle_probe_s=0.5)))
    ops: dict[str, int] = {}
    storage = p.queue.storage
    def counted(name: str) -> Callable[..., Any]:
        real = getattr(storage, name)

        def wrap(*a: Any, **kw: Any) -> Any:
            ops[name] = ops.get(name, 0) + 1
            return real(*a, **kw)
        return wrap

    for name in ("list", "rename", "publish", "read", "exists", "delete"):
        setattr(storage, name, counted(name))
    data = tmp_path / "later.jsonl"
    data.write_text("".join(json.dumps({"prompt": [5, 6, 7]}) + "\n" for _ in range(2)))

    async def body() -> None:
        await wait_for(lambda: any(n.endswith(".idle") for n in q.storage.list("hb")), 30,
                       "the producer to mark its heartbeat idle")
        ops.clear()
        looks["probe"] = 0
        await asyncio.sleep(1.0)  # the window: ~20 polls of 0.05 s, 10 beats of 0.1 s
        window = (dict(ops), looks["probe"])
        assert sum(window[0].values()) <= 2 and window[1] <= 4, window
        Feeder(q, Dataset(str(data))).release(2)  # seen through pending/'s mtime
        await wait_for(lambda: len(ids(q, "ready")) == 2, 60, "released work to be done")
        # it left idle with a plain beat, did the work, and went idle again
        await wait_for(lambda: any(n.endswith(".idle") for n in q.storage.list("hb")), 30,
                       "the producer to go idle again")

    asyncio.run(run_producers([p], body))


def test_a_release_claimed_one_group_at_a_time_is_all_claimed(
        tmp_path: Path, sim_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer that found nothing (drained: it stats pending/ instead of listing it)
    gets a release of five with one slot, so it claims one group at a time. Claiming
    empties the release directory without moving pending/'s mtime: the producer must
    list again after every claim that found work, not wait for the probe's full listing
    a minute later (it once stalled there with work pending)."""
    import strawq.producers.wake as wake_mod

    monkeypatch.setattr(wake_mod, "DirWatch", _NoEvents)
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=[])
    p = Producer(_config(run, sim_engine.url, TimingConfig(
        control_poll_s=0.01, idle_poll_s=0.01, idle_after_s=HOUR), max_new_tokens=8, slots=1))
    data = tmp_path / "later.jsonl"
    data.write_text("".join(json.dumps({"prompt": [5, 6, 7]}) + "\n" for _ in range(5)))

    async def body() -> None:
        await wait_for(lambda: p._wakeup.drained, 30, "the producer to find pending/ empty")
        Feeder(q, Dataset(str(data))).release(5)
        await wait_for(lambda: len(ids(q, "ready")) == 5, 30,
                       "all five groups, claimed one at a time")

    asyncio.run(run_producers([p], body))
    assert p.stats().groups_claimed == 5


class _NoEvents:
    """A DirWatch that never hears anything (a change made on another host)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        pass

    def fileno(self) -> None:
        return None

    def close(self) -> None:
        pass
