"""A Producer built from injected parts: the in-memory queue and a caller-owned client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    SamplerParams,
    TimingConfig,
)
from strawq.producers.sglang_client import SGLangClient
from strawq.storage.memory import MemoryStorage
from strawq.tasks.queue import RunQueue
from tests.producers.helpers import ids, make_run, ready_groups, run_producers, wait_for

pytestmark = pytest.mark.timeout(90)

PLUGINS = "tests.producers.plugins_for_tests"


def test_memory_queue_groups_become_ready_exactly_once(tmp_path: Path,
                                                      sim_engine: Any) -> None:
    n = 16
    q = make_run(str(tmp_path), n, storage=MemoryStorage(writer_id="p-mem"))
    cfg = ProducerConfig(
        run_dir="unused-with-an-injected-queue",
        engine=EngineConfig(workers=(sim_engine.url,)),
        plugins=PluginsConfig(reward=f"{PLUGINS}.length_reward"),
        sampling=SamplerParams(max_new_tokens=64, seed=3),
        budget=BudgetConfig(slots=2),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02),
        producer_id="p-mem")
    seen_rids: set[str] = set()

    async def main() -> None:
        async with SGLangClient([sim_engine.url]) as client:
            p = Producer(cfg, queue=q, client=client)

            async def body() -> None:
                async def watch() -> None:
                    while True:
                        seen_rids.update(p.live_rids())
                        await asyncio.sleep(0.002)
                w = asyncio.create_task(watch())
                await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all groups ready")
                w.cancel()

            await run_producers([p], body)
            assert p.live_rids() == set()
            st = p.stats()
            assert st.groups_completed == n and st.groups_claimed == n
            assert st.busy_trajectories == 0
            # the client is the caller's: still open after the producer stopped
            assert client.worker_urls == [sim_engine.url]
            await client.start()

    asyncio.run(main())
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    for state in ("pending", "leased", "partial", "dropped", "failed"):
        assert ids(q, state) == [], state
    assert all(g.num_samples == 4 for g in ready_groups(q).values())
    assert seen_rids and all(r.startswith("p-mem/") for r in seen_rids)


def test_producer_config_alone_builds_queue_and_client(tmp_path: Path) -> None:
    make_run(str(tmp_path / "run"), 0)
    cfg = ProducerConfig(
        run_dir=str(tmp_path / "run"),
        engine=EngineConfig(workers=("http://127.0.0.1:9",)),
        plugins=PluginsConfig(reward=f"{PLUGINS}.length_reward"))
    p = Producer.from_config(cfg, node_id="n1")
    assert isinstance(p.queue, RunQueue) and p.queue.storage.writer_id == p.producer_id
    with pytest.raises(RuntimeError, match="starts in run"):
        _ = p.client  # built from the config when run() starts, closed when it returns
