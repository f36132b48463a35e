"""A producer restarted under the id it had (``--producer-id``): a new incarnation. Its
predecessor's leases go back to the queue at its start (nothing waits on a lease the new
process's heartbeat keeps alive), and a predecessor still running is fenced: it stops, and
nothing is lost or made twice (``strawq.producers.incarnation``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.tasks.grantor import LeaseMonitor
from tests.producers.helpers import config_with, ids, make_run, ready_groups, wait_for

pytestmark = [pytest.mark.timeout(120)]


def cfg(run: Path, url: str, **sections: Any) -> ProducerConfig:
    base: dict[str, Any] = {
        "run_dir": str(run), "producer_id": "p-local-0",
        "engine": {"workers": (url,), "backoff_s": 0.05},
        "plugins": {"reward": "strawq.producers.rewards.count_task"},
        "budget": {"slots": 2}, "sampling": {"max_new_tokens": 40, "seed": 3},
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}}
    return config_with(base, sections)


def exactly_once(q: Any, n: int) -> None:
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    assert not ids(q, "pending") and not ids(q, "leased") and not ids(q, "dropped")
    assert all(g.num_samples == 4 for g in ready_groups(q).values())


async def _grantor_until(q: Any, n: int, timeout: float) -> None:
    """The collector's grantor scans while producers work, until every group is ready."""
    monitor = LeaseMonitor(q)
    deadline = asyncio.get_running_loop().time() + timeout
    while len(ids(q, "ready")) < n:
        assert asyncio.get_running_loop().time() < deadline, (
            f"stalled: leased {ids(q, 'leased')}, ready {len(ids(q, 'ready'))}/{n}")
        monitor.scan()
        await asyncio.sleep(0.05)


def test_a_restart_under_the_same_id_takes_the_killed_ones_leases_back(
        tmp_path: Path, sim_engine: Any) -> None:
    n = 6
    q = make_run(str(tmp_path / "run"), n, lease_timeout_s=1.0, heartbeat_interval_s=0.1)
    # the killed process: it held two leases and beat, then died (no handback)
    held = q.claim("p-local-0", 2)
    q.heartbeat("p-local-0")
    assert len(held) == 2
    p = Producer(cfg(tmp_path / "run", sim_engine.url))

    async def main() -> None:
        task = asyncio.create_task(p.run())
        try:
            await _grantor_until(q, n, 20)
        finally:
            p.request_stop()
            await task

    asyncio.run(main())
    exactly_once(q, n)
    assert p.incarnation.number == 1
    for lease in held:  # the dead process's results would be refused
        assert not q.still_held(lease)


def test_a_live_predecessor_is_fenced_and_stops(tmp_path: Path, sim_engine: Any) -> None:
    from strawq.producers.incarnation import ProducerSuperseded

    n = 8
    q = make_run(str(tmp_path / "run"), n, lease_timeout_s=1.0, heartbeat_interval_s=0.1)
    kw: dict[str, Any] = {"sampling": {"max_new_tokens": 400, "ignore_eos": True}}
    old = Producer(cfg(tmp_path / "run", sim_engine.url, **kw))
    new = Producer(cfg(tmp_path / "run", sim_engine.url, **kw))

    async def main() -> None:
        first = asyncio.create_task(old.run())
        await wait_for(lambda: old.stats().busy_trajectories > 0, 30, "the old one generating")
        second = asyncio.create_task(new.run())
        try:
            with pytest.raises(ProducerSuperseded) as err:
                await asyncio.wait_for(first, 30)
            assert "incarnation 2" in str(err.value) and "pid" in str(err.value)
            await _grantor_until(q, n, 60)
        finally:
            old.request_stop()
            new.request_stop()
            await asyncio.gather(first, second, return_exceptions=True)

    asyncio.run(main())
    exactly_once(q, n)
    assert (old.incarnation.number, new.incarnation.number) == (1, 2)
