"""A producer's refill after a weight update (issue 40): every free slot claimed at once,
then — once the resumed partials have loaded and said how many samples each still runs —
one claim of what they left free, which with ``queue.release_chunk`` = k takes whole
chunks, not one claim of one group per partial as each loads (each splitting a chunk)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.producer import Producer, open_queue
from strawq.producers.sglang_client import SGLangClient
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing import make_group
from strawq.weights.control import Control
from tests.producers.conftest import FAST_SIM
from tests.producers.helpers import config_with, make_run, run_producers, wait_for

pytestmark = pytest.mark.timeout(120)

K, SLOTS, G = 4, 8, 2


@pytest.fixture
def endless_sim() -> Iterator[EngineThread]:
    """2 ms a decode step: a sample of 20,000 tokens runs past the test, so no trajectory
    frees but by a load (what the test steps)."""
    with EngineThread(EngineOptions(kind="sim", max_running=64,
                                    sim=replace(FAST_SIM, time_scale=0.2))) as eng:
        yield eng


def park_half_done(q: RunQueue, n: int) -> None:
    """``n`` tasks claimed by an earlier holder and parked at an update, each with one of
    its G = 2 samples final and the other aborted mid-flight (as a bracket parks them)."""
    for lease in q.claim("earlier", n):
        q.yield_partial(lease, make_group(lease.task_id, int(lease.task["index"]),
                                          lens=(3, 2), status=["completed", "aborted"]))


def test_the_refill_after_an_update_claims_what_loaded_partials_free_in_whole_chunks(
        tmp_path: Path, endless_sim: EngineThread) -> None:
    run = tmp_path / "run"
    rows = [{"prompt": [20 + i, 21]} for i in range(4 * K)]
    q = make_run(str(run), 0, rows=rows, group_size=G, release_chunk=K, release_batch=4 * K)
    park_half_done(q, SLOTS)  # the top of pending/: 8 partials; then 2 chunks of 4 fresh
    control = Control(q.storage)
    control.pause(1)  # the update: the producer starts inside it, holding nothing
    cfg = config_with({"run_dir": str(run), "producer_id": "p0",
                       "engine": {"workers": (endless_sim.url,)},
                       "plugins": {"reward": "tests.producers.plugins_for_tests.length_reward"},
                       "budget": {"slots": SLOTS},
                       "threads": {"io": 2 * SLOTS},  # the held-up loads leave the claims some
                       "sampling": {"max_new_tokens": 20_000, "ignore_eos": True},
                       "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}}, {})
    pq = open_queue(cfg, "p0")
    claims: list[tuple[int, int, int]] = []  # (wanted, leased, leased inside a whole chunk)
    claim, load_partial = pq.claim, pq.load_partial

    def counted_claim(producer: str, n: int = 1) -> list[Lease]:
        got = claim(producer, n)
        claims.append((n, len(got), sum(lease.name.chunk is not None for lease in got)))
        return got

    loads = threading.Semaphore(0)

    def stepped_load(lease: Lease) -> Any:
        assert loads.acquire(timeout=60), "the test let no load through"
        return load_partial(lease)

    pq.claim, pq.load_partial = counted_claim, stepped_load  # type: ignore[method-assign]
    p = Producer(cfg, queue=pq)
    passes = [0]
    groups = p.gate.groups

    async def counted_groups() -> int:
        passes[0] += 1
        return await groups()

    p.gate.groups = counted_groups  # type: ignore[method-assign]

    async def settled() -> None:
        """Two more passes of the producer's loop: a claim it would make now is made."""
        seen = passes[0]
        await wait_for(lambda: passes[0] >= seen + 2, 30, "two passes of the claim loop")

    async def body() -> None:
        await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")
        async with SGLangClient([endless_sim.url]) as client:
            await client.update_weight_version(1, abort_all_requests=False)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: p.stats().groups_claimed == SLOTS, 30, "the refill claim")
        assert claims == [(SLOTS, SLOTS, 0)]  # the 8 partials (single files), in one claim
        for i in range(SLOTS):  # each partial loads, freeing the trajectory of its final sample
            loads.release()
            await wait_for(lambda i=i: p.pool.demand <= SLOTS * G - (i + 1), 30, f"load {i}")
            await settled()
        await wait_for(lambda: p.stats().groups_claimed == SLOTS + K, 30, "the second claim")
        await settled()

    asyncio.run(run_producers([p], body))
    assert claims == [(SLOTS, SLOTS, 0), (K, K, K)], claims
