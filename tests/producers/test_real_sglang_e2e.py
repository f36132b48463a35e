"""End to end on the real SGLang 0.5.23 server: a producer (G = 2) across two weight
updates to a different weight directory (the model with one tensor perturbed) keeps every
generated token, stamps each token with the version that produced it, and the trainer's
reader delivers them; directly and through the real sglang-router.

Real tier (marker ``sglang_real``): skipped with the reason without the CPU fixture,
required in CI.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.reader import BatchReader
from strawq.control import Control
from strawq.dataset import Dataset
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from tests.producers.helpers import ids, make_run, names, ready_groups, run_producers, wait_for
from tests.sglang_fixtures import RealServer, start_router

pytestmark = [pytest.mark.sglang_real, pytest.mark.timeout(420)]

N_GROUPS, G, MAX_NEW = 2, 2, 48


def _rows() -> list[dict[str, Any]]:
    # SmolLM2 ids: "The capital of France is", "Once upon a time"
    prompts = [[504, 3575, 282, 4649, 314], [11443, 2402, 253, 655]]
    return [{"prompt": prompts[i % 2], "target": 7, "count": 3} for i in range(N_GROUPS)]


def run_bracket_scenario(server: RealServer, workdir: Path, *,
                         router_url: str | None = None) -> dict[str, Any]:
    """Producer + two brackets (versions 1: perturbed weights, 2: the original ones)."""
    cfg = ClientConfig(api_key=server.api_key, admin_api_key=server.admin_api_key,
                       max_retries=1)
    q = make_run(str(workdir / "run"), 0, rows=_rows(), group_size=G, lease_timeout_s=30.0)
    control = Control(q.storage)
    p = Producer(ProducerConfig(
        run_dir=str(workdir / "run"), reward="strawq.producers.rewards.count_task",
        workers=() if router_url else (server.url,), router_url=router_url, client=cfg,
        slots=N_GROUPS, max_new_tokens=MAX_NEW, ignore_eos=True, seed=1,
        control_poll_s=0.05, idle_poll_s=0.05))
    brackets: list[float] = []
    weights = {1: server.perturbed_dir, 2: server.model_dir}

    async def body() -> None:
        async with SGLangClient([server.url], config=cfg) as trainer:
            for v in (1, 2):
                await wait_for(lambda: p.stats().busy_trajectories > 0, 120, "generating")
                await asyncio.sleep(0.8)  # let every sample hold some tokens
                t0 = time.monotonic()
                control.pause(v)
                await wait_for(lambda: p.producer_id in control.state().acks, 120, "ack")
                assert not names(q, "leased")
                await trainer.push_weights(weights[v], weight_version=v)
                q.set_version(v)
                control.resume(v)
                brackets.append(time.monotonic() - t0)
        await wait_for(lambda: len(ids(q, "ready")) == N_GROUPS, 300, "all ready")

    async def main() -> None:
        async with SGLangClient([server.url], config=cfg) as c:
            await c.push_weights(server.model_dir, weight_version=0)  # a known start
        await run_producers([p], body)

    asyncio.run(main())
    groups = ready_groups(q)
    kept = sum(int(sum(g.sample_lens)) for g in groups.values())
    return {"queue": q, "groups": groups, "kept": kept, "producer": p,
            "generated": p.stats().tokens_generated, "brackets": brackets,
            "lost": p._aborter.lost_requests}


def _check(result: dict[str, Any], workdir: Path) -> None:
    groups = result["groups"]
    assert len(groups) == N_GROUPS
    assert result["lost"] == 0, "a request did not come back with its tokens"
    assert result["kept"] == result["generated"], (result["kept"], result["generated"])
    spanning = 0
    for grp in groups.values():
        assert grp.sample_lens == [MAX_NEW] * G
        for i in range(G):
            c = grp.sample(i)
            vers = c["versions"]
            assert len(c["tokens"]) == len(c["logprobs"]) == len(vers) == len(c["loss_mask"])
            assert np.all(np.diff(vers) >= 0) and set(vers.tolist()) <= {0, 1, 2}
            spanning += int(vers.min() != vers.max())
    assert spanning > 0, "no sample spanned a weight update"
    # the trainer's reader delivers exactly what was generated
    q = result["queue"]
    col = Collector(q, Dataset(os.path.join(workdir / "run", "dataset.jsonl")),
                    CollectorConfig(batch_groups=N_GROUPS, max_running=N_GROUPS,
                                    max_ready=N_GROUPS, poll_interval_s=0, gc_interval_s=0))
    col.start(wait=False)
    for _ in range(50):
        col.step()
        if col.batches.batch_seqs()[0]:
            break
    batch = BatchReader(q).next_batch(timeout=30)
    assert int(batch.response_lens.sum()) == result["kept"]
    want = sorted(int(g.sample(i)["versions"].min()) for g in groups.values()
                  for i in range(G))
    assert sorted(int(v) for v in batch.sample_min_version.tolist()) == want


def test_producer_across_two_weight_updates_keeps_every_token(
        sglang_real: RealServer, tmp_path: Path) -> None:
    result = run_bracket_scenario(sglang_real, tmp_path)
    _check(result, tmp_path)


def test_producer_through_the_real_router(
        sglang_real: RealServer, sglang_router_cmd: list[str], tmp_path: Path) -> None:
    router = start_router(sglang_router_cmd, [sglang_real.url], log=tmp_path / "router.log",
                          api_key=sglang_real.api_key)
    try:
        result = run_bracket_scenario(sglang_real, tmp_path, router_url=router.url)
    finally:
        router.stop()
    _check(result, tmp_path)
