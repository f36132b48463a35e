"""Per-token extras end to end: producers on the sim engine over HTTP, a weight update in the
middle of generation (partials saved, then resumed), a teacher scoring the finished samples,
the collector, the reader, and slime.

The sim engine's routing and kept ids are functions of the position and its token
(``strawq.producers.engines.extras``), so every packed row can be checked against the
final tokens alone: any row lost, duplicated or shifted at the resume shows up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from strawq.collector.trainer.reader import Batch
from strawq.ondisk.extras import ROUTED_EXPERTS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS
from strawq.producers.engines.extras import (
    LAYERS,
    TOP_K,
    kept_ids,
    routed_experts_row,
    teacher_logprob,
)
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sglang_client import SGLangClient
from strawq.weights.control import Control
from tests.producers.helpers import (
    batch_all_ready,
    config_with,
    ids,
    make_run,
    names,
    run_producers,
    wait_for,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

N = 4
TOP_K_SAMPLING = 50
#: 10 ms a decode step: a group's 80 tokens take ~0.8 s, so the pause sent 0.2 s into
#: generation always finds it mid-flight (at 0.5 ms a step they finished before it, once)
SIM = SimConfig(time_scale=1.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)


@pytest.fixture(scope="module")
def sim() -> Iterator[EngineThread]:
    with EngineThread(EngineOptions(kind="sim", max_running=64, sim=SIM)) as eng:
        yield eng


def _config(run: Path, url: str, **sections: Any) -> ProducerConfig:
    base: dict[str, Any] = {
        "run_dir": str(run), "engine": {"workers": (url,)},
        "plugins": {"reward": "tests.producers.plugins_for_tests.length_reward"},
        "budget": {"slots": 2},
        "sampling": {"max_new_tokens": 80, "ignore_eos": True, "seed": 3,
                     "top_k": TOP_K_SAMPLING},
        # parked at the pause: the extras go through a partial's record and its resume
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02, "hold_through_pause": False},
        "record": {"extras": (ROUTED_EXPERTS, TOP_P_TOKEN_IDS, TEACHER_LOGPROBS),
                   "teacher_url": url, "routed_experts_shape": (LAYERS, TOP_K)}}
    return config_with(base, sections)


@pytest.fixture(scope="module")
def batch(sim: EngineThread, tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """Every group generated across one weight update, batched by the collector, read."""
    run = tmp_path_factory.mktemp("extras") / "run"
    rows = [{"prompt": [20 + i, 21, 22 + i]} for i in range(N)]
    q = make_run(str(run), 0, rows=rows)
    control = Control(q.storage)
    p = Producer(_config(run, sim.url))

    async def body() -> None:
        async with SGLangClient([sim.url]) as client:
            await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
            await asyncio.sleep(0.2)
            control.pause(1)
            await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")
            assert not names(q, "leased")  # every group held was saved as a partial
            await client.update_weight_version(1, abort_all_requests=False)
            q.set_version(1)
            control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) == N, 60, "all ready")

    asyncio.run(run_producers([p], body))
    assert p.stats().groups_yielded >= 1
    return batch_all_ready(q, str(run / "dataset.jsonl"), N)


def test_packed_extras_line_up_with_the_tokens_across_the_resume(batch: Batch) -> None:
    cu = batch.cu_seqlens.tolist()
    routed = batch.extras[ROUTED_EXPERTS].numpy()
    kept = batch.extras[TOP_P_TOKEN_IDS].numpy()
    off = batch.extras["top_p_token_offsets"].numpy()
    teacher = batch.extras[TEACHER_LOGPROBS].numpy()
    assert routed.shape == (batch.num_tokens, LAYERS, TOP_K)
    assert off.shape == (batch.num_tokens + 1,) and off[-1] == kept.shape[0]
    tokens = batch.tokens.numpy()
    resumed = 0
    for i in range(batch.num_samples):
        a, b = cu[i], cu[i + 1]
        p = int(batch.prompt_lens[i])
        versions = batch.versions[a + p:b].numpy()
        resumed += int(versions.min() != versions.max())
        for j in range(b - a - 1):  # every position but the last was the model's input once
            assert routed[a + j].tolist() == routed_experts_row(j, int(tokens[a + j])).tolist()
        assert (routed[b - 1] == -1).all()
        assert (np.diff(off[a:a + p + 1]) == 0).all()  # no kept ids over the prompt
        assert (teacher[a:a + p] == 0).all()
        for j in range(p, b - a):
            got = kept[off[a + j]:off[a + j + 1]].tolist()
            assert got == kept_ids(int(tokens[a + j]), j, SIM.vocab_size, TOP_K_SAMPLING)
            assert teacher[a + j] == pytest.approx(teacher_logprob(j, int(tokens[a + j])))
    assert resumed > 0  # some samples span the weight update: their rows were resumed


@pytest.mark.slime
def test_slime_samples_carry_the_extras_and_slime_accepts_them(batch: Batch) -> None:
    types = pytest.importorskip("slime.utils.types",
                                reason="slime not installed (docs/slime.md)")
    from slime.observability.rollout_data_utils import (
        validate_rollout_routed_experts_for_replay,
    )

    from strawq.collector.integrations.slime import batch_to_samples

    groups = batch_to_samples(batch)
    flat = [s for g in groups for s in g]
    assert len(flat) == batch.num_samples
    tokens = batch.tokens.numpy()
    cu = batch.cu_seqlens.tolist()
    for i, s in enumerate(flat):
        assert s.tokens == tokens[cu[i]:cu[i + 1]].tolist()
        assert tuple(s.rollout_routed_experts.shape) == (len(s.tokens) - 1, LAYERS, TOP_K)
        # slime's own reading of SGLang's top-p replay data accepts the pair
        ids, off = types._extract_rollout_top_p_token_data(
            {"top_p_token_ids": s.rollout_top_p_token_ids,
             "top_p_token_offsets": s.rollout_top_p_token_offsets},
            expected_num_tokens=s.response_length)
        assert off.tolist() == s.rollout_top_p_token_offsets.tolist()
        assert len(s.teacher_log_probs) == s.response_length
        s._validate_response_metadata_lengths()
    args = SimpleNamespace(num_layers=LAYERS, moe_router_topk=TOP_K)
    validate_rollout_routed_experts_for_replay([s.rollout_routed_experts for s in flat], args)
