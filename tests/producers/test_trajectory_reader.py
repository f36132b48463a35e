"""Multi-turn samples through the collector and the trainer's reader: the importance-
sampling helpers work unchanged, and the loss mask keeps tool tokens out of the loss."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from strawq.collector.trainer.importance import (
    aggregate_loss,
    masked_tis_weights,
    offpolicy_prefix_mask,
)
from strawq.producers.producer import Producer
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.trajectory import Trajectory
from strawq.weights.control import Control
from tests.producers.helpers import (
    batch_all_ready,
    ids,
    make_run,
    ready_groups,
    run_producers,
    wait_for,
)
from tests.producers.test_trajectory import agent_config
from tests.producers.trajectory_plugins import ledger_counts

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_reader_and_importance_sampling_on_multi_turn_samples(tmp_path: Path,
                                                               sim_engine: Any) -> None:
    n, g = 4, 2
    run = tmp_path / "run"
    q = make_run(str(run), n, group_size=g)
    control = Control(q.storage)
    ledger = tmp_path / "ledger"
    p = Producer(agent_config(run, sim_engine.url, ledger,
                              plugins={"generate_args": {"ledger": str(ledger), "turns": 3,
                                             "slow_s": 0.05}}))

    async def body() -> None:
        await wait_for(lambda: sum(ledger_counts(str(ledger)).values()) >= 2 or
                       len(ids(q, "ready")) == n, 60, "tool calls")
        control.pause(1)
        await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
        async with SGLangClient([sim_engine.url]) as client:
            await client.update_weight_version(1)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) == n, 120, "all ready")

    asyncio.run(run_producers([p], body))
    groups = {grp.task_id: grp for grp in ready_groups(q).values()}
    batch = batch_all_ready(q, os.path.join(run, "dataset.jsonl"), n)
    assert batch.num_samples == n * g
    cu = batch.cu_seqlens.tolist()
    tool_pos: list[int] = []
    gen_pos: list[int] = []
    per_group_seen: dict[str, int] = {}
    for s in range(batch.num_samples):
        name = batch.groups[int(batch.sample_group[s])]
        grp = groups[name.id]
        i = per_group_seen.get(name.id, 0)
        per_group_seen[name.id] = i + 1
        c = grp.sample(i)
        start = cu[s] + int(batch.prompt_lens[s])
        end = cu[s + 1]
        assert end - start == len(c["tokens"])
        np.testing.assert_array_equal(batch.tokens[start:end].numpy(), c["tokens"])
        np.testing.assert_array_equal(batch.loss_mask[start:end].numpy(), c["loss_mask"])
        np.testing.assert_array_equal(batch.versions[start:end].numpy(), c["versions"])
        np.testing.assert_array_equal(batch.rollout_logprobs[start:end].numpy(), c["logprobs"])
        trajs = grp.meta.get("trajectories")
        t = Trajectory.from_dict(trajs[i] if trajs else None, len(c["tokens"]))
        for e in t.events:
            if e["op"] == "append":
                tool_pos += range(start + e["start"], start + e["end"])
            elif e["op"] == "gen":
                gen_pos += range(start + e["start"], start + e["end"])
        gen_versions = [int(v) for e in t.events if e["op"] == "gen"
                        for v in c["versions"][e["start"]:e["end"]]]
        if gen_versions:  # tool tokens never make a sample look staler than its turns
            assert int(batch.sample_min_version[s]) == min(gen_versions)
    assert tool_pos, "no tool tokens reached the batch"
    tools = torch.tensor(tool_pos)
    assert not batch.loss_mask[tools].any()
    # importance weights: finite everywhere, zero on tool tokens, unchanged on generated ones
    gen = torch.Generator().manual_seed(0)
    logp_new = batch.rollout_logprobs + 0.1 * torch.randn(batch.num_tokens, generator=gen)
    w = masked_tis_weights(logp_new, batch.rollout_logprobs, batch.loss_mask)
    assert torch.isfinite(w).all() and not w[tools].any()
    assert (w[torch.tensor(gen_pos)] > 0).all()
    # the loss does not see tool tokens, whatever the per-token loss there is
    per_token = torch.rand(batch.num_tokens, generator=gen)
    base = aggregate_loss(per_token, batch.loss_mask.float(), cu_seqlens=batch.cu_seqlens)
    per_token[tools] += 1000.0
    again = aggregate_loss(per_token, batch.loss_mask.float(), cu_seqlens=batch.cu_seqlens)
    assert torch.equal(base, again)
    # the off-policy prefix mask is per sample's newest version; tool tokens stay masked
    keep = offpolicy_prefix_mask(batch.versions, batch.cu_seqlens) * batch.loss_mask
    assert not keep[tools].any()
    assert keep.sum() > 0
