"""Engine faults slow work down but lose none: a killed engine, 500s, a hung engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.engines.testing import start_engine_subprocess
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sglang_client import ClientConfig
from tests.producers.faulty_proxy import FaultyProxy
from tests.producers.helpers import (
    config_with,
    ids,
    make_run,
    ready_groups,
    run_producers,
    wait_for,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

FAST_CLIENT = ClientConfig(generate_timeout_s=1.5, control_timeout_s=1.0, connect_timeout_s=1.0,
                           max_retries=2, backoff_base_s=0.02, backoff_max_s=0.1)


def cfg(run: Path, workers: list[str], **sections: Any) -> ProducerConfig:
    base: dict[str, Any] = {
        "run_dir": str(run), "engine": {"workers": tuple(workers), "client": FAST_CLIENT,
                                        "backoff_s": 0.05},
        "plugins": {"reward": "strawq.producers.rewards.count_task"},
        "budget": {"slots": 3}, "sampling": {"max_new_tokens": 60, "seed": 3},
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02, "abort_deadline_s": 2.0}}
    return config_with(base, sections)


def check_exactly_once(q: Any, n: int) -> None:
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    assert not ids(q, "pending") and not ids(q, "leased") and not ids(q, "dropped")
    for g in ready_groups(q).values():
        assert g.num_samples == 4 and max(g.sample_lens) <= 3000


def test_killed_500_and_hung_engines_lose_nothing(tmp_path: Path, sim_engine: Any) -> None:
    n = 30
    q = make_run(str(tmp_path / "run"), n)
    victim = start_engine_subprocess("sim", time_scale=0.02, len_median=20, len_cap=60)
    with FaultyProxy(sim_engine.url, "flaky") as flaky, \
            FaultyProxy(sim_engine.url, "hang") as hung:
        p = Producer(cfg(tmp_path / "run", [sim_engine.url, victim.url, flaky.url, hung.url]))

        async def body() -> None:
            await wait_for(lambda: len(ids(q, "ready")) >= 3, 60, "first groups")
            victim.kill()  # kill -9 mid-generation
            await wait_for(lambda: len(ids(q, "ready")) == n, 90, "all groups ready")

        try:
            asyncio.run(run_producers([p], body))
        finally:
            victim.stop()
        assert flaky.calls["500"] > 0 and hung.calls["hang"] > 0
    check_exactly_once(q, n)
    assert p.stats().engine_faults > 0


def test_engine_outage_yields_partials_then_finishes(tmp_path: Path, sim_engine: Any) -> None:
    """The only engine answers 500 for a while: groups go back as partials (no attempt
    spent, prefixes kept), the producer backs off, and finishes once the engine recovers."""
    n = 6
    q = make_run(str(tmp_path / "run"), n)
    with FaultyProxy(sim_engine.url, "ok") as proxy:
        p = Producer(cfg(tmp_path / "run", [proxy.url], engine={"sample_retries": 1},
                         sampling={"max_new_tokens": 300, "ignore_eos": True}))

        async def body() -> None:
            await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
            proxy.mode = "500"
            await wait_for(lambda: p.stats().groups_yielded >= 1, 30, "a partial yield")
            await asyncio.sleep(0.3)
            proxy.mode = "ok"
            await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all ready")

        asyncio.run(run_producers([p], body))
    assert not ids(q, "dropped")
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    for g in ready_groups(q).values():
        assert g.sample_lens == [300] * 4


def test_a_producer_whose_heartbeats_come_back_hands_its_abandoned_leases_back(
        tmp_path: Path, sim_engine: Any) -> None:
    """Heartbeats fail just long enough for the producer to give its leases up (a stalled
    event loop does the same), then succeed again: its moving counter keeps those leases
    alive on the grantor's clock, so unless the producer hands them back, the tasks wait
    forever. Handed back, the same producer claims and finishes them."""
    from strawq.tasks.grantor import LeaseMonitor

    n = 2
    q = make_run(str(tmp_path / "run"), n, lease_timeout_s=1.0, heartbeat_interval_s=0.1)
    p = Producer(cfg(tmp_path / "run", [sim_engine.url],
                     sampling={"max_new_tokens": 3000, "ignore_eos": True},
                     budget={"slots": 2},
                     engine={"client": ClientConfig(generate_timeout_s=60.0)}))
    beat = p.queue.heartbeat

    def broken(producer: str, **kw: Any) -> int:
        raise StorageError(5, "injected: heartbeat write failed")

    async def body() -> None:
        await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
        p.queue.heartbeat = broken  # type: ignore[method-assign]
        await wait_for(lambda: p.stats().leases_lost >= 1, 30, "the leases given up")
        p.queue.heartbeat = beat  # type: ignore[method-assign]
        monitor = LeaseMonitor(q)
        deadline = asyncio.get_running_loop().time() + 90
        while len(ids(q, "ready")) < n:
            assert asyncio.get_running_loop().time() < deadline, (
                f"the abandoned tasks never came back: leased {ids(q, 'leased')}")
            monitor.scan()
            await asyncio.sleep(0.05)

    from strawq.errors import StorageError

    asyncio.run(run_producers([p], body))
    check_exactly_once(q, n)


def test_failing_heartbeats_stop_work_and_the_grantor_requeues(tmp_path: Path,
                                                              sim_engine: Any) -> None:
    """Heartbeats start failing: the producer gives its leases up at lease_timeout - margin
    and claims nothing; the grantor expires them; a healthy producer finishes the work."""
    from strawq.errors import StorageError
    from strawq.tasks.grantor import LeaseMonitor

    n = 4
    q = make_run(str(tmp_path / "run"), n, lease_timeout_s=1.0, heartbeat_interval_s=0.1)
    kw: dict[str, Any] = {"sampling": {"max_new_tokens": 3000, "ignore_eos": True},
                          "budget": {"slots": 4},
                          "engine": {"client": ClientConfig(generate_timeout_s=60.0)}}
    sick = Producer(cfg(tmp_path / "run", [sim_engine.url], **kw))
    healthy = Producer(cfg(tmp_path / "run", [sim_engine.url], **kw))

    def broken(producer: str) -> int:
        raise StorageError(5, "injected: heartbeat write failed")

    async def body() -> None:
        await wait_for(lambda: sick.stats().busy_trajectories > 0, 30, "sick generating")
        sick.queue.heartbeat = broken  # type: ignore[method-assign]
        await wait_for(lambda: sick.stats().leases_lost >= 1, 30, "sick gives up")
        assert sick.stats().busy_trajectories == 0
        monitor = LeaseMonitor(q)
        task = asyncio.create_task(healthy.run())
        deadline = asyncio.get_running_loop().time() + 60
        try:
            while len(ids(q, "ready")) < n:
                assert asyncio.get_running_loop().time() < deadline, "work not finished"
                monitor.scan()
                await asyncio.sleep(0.05)
        finally:
            healthy.request_stop()
            await task
        assert sick.stats().groups_completed == 0

    asyncio.run(run_producers([sick], body))
    check_exactly_once(q, n)
