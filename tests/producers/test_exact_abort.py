"""The producer aborts its requests by exact rid (SGLang 0.5.23 drops a rid prefix), so a
bracket gets every request back with its tokens, long before the abort deadline."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
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
from strawq.weights.control import Control
from tests.producers.helpers import ids, make_run, names, ready_groups, run_producers, wait_for

pytestmark = pytest.mark.timeout(120)

SIM = SimConfig(step_base_ms=10.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)


@pytest.mark.slow
def test_bracket_aborts_by_exact_rid_and_keeps_every_token(tmp_path: Path) -> None:
    n, g, max_new = 4, 2, 400  # 4 s of decoding: a missed abort shows
    rows = [{"prompt": [5 + i, 9, 11 + i], "target": 7, "count": 3} for i in range(n)]
    q = make_run(str(tmp_path / "run"), 0, rows=rows, group_size=g)
    control = Control(q.storage)
    with EngineThread(EngineOptions(kind="sim", max_running=16, sim=SIM)) as eng:
        p = Producer(ProducerConfig(
            run_dir=str(tmp_path / "run"),
            engine=EngineConfig(workers=(eng.url,)),
            plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
            sampling=SamplerParams(max_new_tokens=max_new, ignore_eos=True, seed=1),
            budget=BudgetConfig(slots=n),
            timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02, abort_poll_s=0.1,
                                abort_deadline_s=30.0)))
        took: list[float] = []

        async def body() -> None:
            async with SGLangClient([eng.url]) as client:
                for v in (1, 2):
                    await wait_for(lambda: p.stats().busy_trajectories > 0, 60, "generating")
                    await asyncio.sleep(0.2)
                    t0 = time.monotonic()
                    control.pause(v)
                    await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
                    took.append(time.monotonic() - t0)
                    # every lease handed back, or held through the pause (the default)
                    assert len(names(q, "leased")) == control.held(v, p.producer_id)
                    await client.push_weights("/sim/w", weight_version=v)
                    q.set_version(v)
                    control.resume(v)
            await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all ready")

        asyncio.run(run_producers([p], body))
    assert p._aborter.lost_requests == 0
    assert max(took) < 2.0, took  # a prefix abort would leave them running to their end
    groups = ready_groups(q)
    kept = sum(int(sum(grp.sample_lens)) for grp in groups.values())
    assert kept == p.stats().tokens_generated == n * g * max_new
    assert any(len(set(grp.sample(i)["versions"].tolist())) > 1
               for grp in groups.values() for i in range(g))


def test_aborter_sends_exact_rids_chosen_when_called() -> None:
    """stop / heartbeat give-up / a sample fault cancel their tasks and then abort: the rids
    are chosen at the call, before the cancelled tasks forget them, and sent one by one."""
    from strawq.producers.bracket import EngineAborter

    sent: list[tuple[str | None, str | None]] = []

    class FakeClient:
        worker_urls = ["http://w1", "http://w2"]

        async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
            sent.append((rid, url))

    live = {"p/t1.g1/0.1", "p/t1.g1/1.3", "p/t2.g1/0.1"}

    async def go() -> None:
        aborter = EngineAborter(lambda: FakeClient(), "p", poll_s=0.1, deadline_s=1.0,  # type: ignore[arg-type, return-value]
                                clock=time.monotonic, live_rids=lambda: set(live))
        aborter.abort_soon("p/t1.g1/")
        live.clear()  # the cancelled sample tasks drop their rids
        aborter.abort_soon("p/t2.g1/0.1")  # one rid whose call failed: sent as it is
        await asyncio.sleep(0.1)

    asyncio.run(go())
    assert sorted(sent) == sorted(
        (r, u) for r in ("p/t1.g1/0.1", "p/t1.g1/1.3", "p/t2.g1/0.1")
        for u in ("http://w1", "http://w2"))
