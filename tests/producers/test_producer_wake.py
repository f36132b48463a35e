"""The producer wakes on new work and on the bracket (inotify), not on its idle polls; it
records its hand-off latencies. Behaviour only: the polls here are an hour long, so only
the wake-up can make the test finish within its own deadline."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from strawq.control import Control
from strawq.dataset import Dataset
from strawq.feeder import Feeder
from strawq.storage.watch import inotify_available

from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from tests.producers.helpers import ids, make_run, run_producers, wait_for

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not inotify_available(), reason="no inotify on this OS")]

HOUR = 3600.0


def test_new_work_and_a_pause_wake_an_idle_producer(tmp_path: Path, sim_engine: Any) -> None:
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=[])
    cfg = ProducerConfig(run_dir=str(run), reward="tests.producers.plugins_for_tests."
                         "length_reward", workers=(sim_engine.url,), slots=2,
                         max_new_tokens=32, seed=3, control_poll_s=HOUR, idle_poll_s=HOUR)
    p = Producer(cfg)
    data = tmp_path / "later.jsonl"
    data.write_text("".join(json.dumps({"prompt": [5, 6, 7]}) + "\n" for _ in range(4)))

    async def body() -> None:
        # idle: it has looked once, found nothing, and would not look again for an hour
        await wait_for(lambda: p._last_empty_claim > -math.inf, 30, "the first empty claim")
        Feeder(q, Dataset(str(data))).release(4)
        await wait_for(lambda: len(ids(q, "ready")) == 4, 60, "released work to be done")
        Control(q.storage).pause(1)
        await wait_for(lambda: p.producer_id in Control(q.storage).state().acks, 60,
                       "the pause to be acknowledged")

    asyncio.run(run_producers([p], body))
    hops = p.stats().hops
    assert len(hops["claim_to_generate"]) == 4 and len(hops["final_to_ready"]) == 4
    assert all(x >= 0 for xs in hops.values() for x in xs)
