"""The weight-update bracket against the tiny torch engine: groups span versions, and every
rollout log-prob matches a teacher-forced recomputation under its token's weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.tiny_config import TinyConfig
from strawq.producers.engines.tiny_model import (
    init_model,
    load_weights,
    recompute_logprobs,
    save_weights,
)
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
from strawq.tasks.queue import RunQueue
from strawq.testing.waiting import async_wait_until
from strawq.weights.control import Control
from tests.producers.helpers import ids, make_run, names, ready_groups, run_producers, wait_for
from tests.producers.journal_helpers import saved_prefix

pytestmark = pytest.mark.timeout(180)

SMALL = TinyConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2,
                   intermediate_size=128, context_length=256, seed=3)


def perturbed(src: Path, dst: Path, seed: int) -> Path:
    model = load_weights(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return save_weights(model, dst)


async def mid_flight(http: aiohttp.ClientSession, url: str, lo: int, hi: int) -> bool:
    """Whether a request in the engine has generated between ``lo`` and ``hi`` tokens: a pause
    now lands mid-sample, however slow the machine (a fixed sleep can land before the first
    token on a loaded one, and the resumed sample then holds one version)."""
    async with http.get(url + "/strawq/live_requests") as resp:
        body = await resp.json()
    return any(lo <= r["output_tokens"] <= hi for r in body["requests"])


def mid_sample(q: RunQueue, max_new: int) -> bool:
    """Whether a parked partial holds a sample begun but unfinished: on resume under the new
    weights it must span two versions."""
    for t in names(q, "pending"):
        if t.resume >= 0:
            group = saved_prefix(q, t)  # its .partial, or the journal it was parked into
            assert group is not None, f"task {t} has no saved prefix"
            if any(0 < n < max_new for n in group.sample_lens):
                return True
    return False


def held_mid_sample(p: Producer, max_new: int) -> bool:
    """Whether a group the producer holds through the pause has a sample begun but
    unfinished (``timing.hold_through_pause``): it goes on under the new weights."""
    return any(0 < len(s.response_ids) < max_new for a in p.runner.groups.values()
               if a.run is not None for s in a.run.samples)


#: brackets run: at least two, and more (each on new weights) until one has parked a sample
#: mid-flight; the producer's reaction to a pause is not bounded in time on a loaded machine
MIN_BRACKETS, MAX_BRACKETS = 2, 6


@pytest.mark.slow
@pytest.mark.parametrize("hold", [False, None], ids=["park", "hold-default"])
def test_bracket_with_tiny_engine(tmp_path: Path, hold: bool | None) -> None:
    """Parked (``timing.hold_through_pause=false``) and held, the default with the journal:
    either way every token's log-prob is its own weights'."""
    weights = {0: save_weights(init_model(SMALL), tmp_path / "w0")}
    for v in range(1, MAX_BRACKETS + 1):
        weights[v] = perturbed(weights[v - 1], tmp_path / f"w{v}", seed=v)
    n, g, max_new = 8, 2, 96
    rows = [{"prompt": [5 + i, 9, 11 + i], "target": 7, "count": 3} for i in range(n)]
    q = make_run(str(tmp_path / "run"), 0, rows=rows, group_size=g)
    control = Control(q.storage)
    with EngineThread(EngineOptions(kind="tiny", model_path=str(weights[0]), max_running=16,
                                    tiny=SMALL)) as eng:
        p = Producer(ProducerConfig(
            run_dir=str(tmp_path / "run"),
            engine=EngineConfig(workers=(eng.url,)),
            plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
            sampling=SamplerParams(max_new_tokens=max_new, ignore_eos=True, seed=1),
            budget=BudgetConfig(slots=2),
            timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02,
                                hold_through_pause=hold)))
        acks: list[int] = []
        spanning = False

        async def body() -> None:
            async with SGLangClient([eng.url]) as client, aiohttp.ClientSession() as http:
                nonlocal spanning
                for v in range(1, MAX_BRACKETS + 1):
                    if v > MIN_BRACKETS and spanning:
                        break
                    async def pausable() -> bool:
                        return (len(ids(q, "ready")) == n
                                or await mid_flight(http, eng.url, 2, max_new // 4))

                    await async_wait_until(pausable, 60, what="a request mid-flight",
                                           poll_s=0.002)
                    control.pause(v)
                    await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
                    if hold is False:
                        assert not names(q, "leased")
                        spanning = spanning or mid_sample(q, max_new)
                    else:  # held: every lease kept, the groups in memory, nothing yielded
                        assert not [t for t in names(q, "pending") if t.resume >= 0]
                        assert sorted(t.id for t in names(q, "leased")) == sorted(
                            a.lease.task_id for a in p.runner.groups.values())
                        assert control.held(v, p.producer_id) == len(p.runner.groups)
                        spanning = spanning or held_mid_sample(p, max_new)
                    acks.append(v)
                    await client.update_weights_from_disk(str(weights[v]), weight_version=v)
                    q.set_version(v)
                    control.resume(v)
            await wait_for(lambda: len(ids(q, "ready")) == n, 120, "all ready")

        asyncio.run(run_producers([p], body))
    assert acks == list(range(1, len(acks) + 1)) and len(acks) >= MIN_BRACKETS
    assert spanning, f"none of {len(acks)} pauses parked a sample mid-flight"
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    models = {v: load_weights(w) for v, w in weights.items()}
    multi = 0
    for grp in ready_groups(q).values():
        assert grp.sample_lens == [max_new] * g
        for i in range(g):
            c = grp.sample(i)
            vers = c["versions"]
            assert len(c["tokens"]) == len(c["logprobs"]) == len(vers) == len(c["loss_mask"])
            assert np.all(np.diff(vers) >= 0)
            multi += int(vers.min() != vers.max())
            for v in np.unique(vers):
                ref = recompute_logprobs(models[int(v)], grp.prompt_ids, c["tokens"])
                sel = vers == v
                np.testing.assert_allclose(c["logprobs"][sel], ref[sel], atol=1e-3)
    assert multi > 0, "no sample spanned a weight update"
