"""The sim engine's per-prompt length scale (``SimConfig.prompt_scale_sigma``): pure
functions of the prompt's tokens, off by default, and never fooled by a resumed prefix."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from strawq.producers.engines.core import Req, ReqParams
from strawq.producers.engines.sim_backend import (SimBackend, SimConfig, _normal,
                                                  prompt_scale, sim_token, target_length)

CFG = SimConfig(len_median=40, len_sigma=0.5, len_cap=4096, cap_prob=0.0)


def _prompt(i: int, n: int = 16) -> list[int]:
    return [3 + (i * 7919 + k * 104729) % 31000 for k in range(n)]


def test_off_by_default_and_at_sigma_zero() -> None:
    assert SimConfig().prompt_scale_sigma == 0.0
    assert prompt_scale(_prompt(1), 0.0) == 1.0
    for seed in range(200):  # scale 1: exactly the length the seed always had
        assert target_length(seed, CFG, 1.0) == target_length(seed, CFG)


def test_scale_is_a_skewed_mean_one_function_of_the_prompt() -> None:
    scales = [prompt_scale(_prompt(i), 0.8) for i in range(4000)]
    assert prompt_scale(_prompt(5), 0.8) == scales[5]  # deterministic
    assert prompt_scale(_prompt(5)[:-1], 0.8) != scales[5]  # another prompt, another scale
    assert statistics.fmean(scales) == pytest.approx(1.0, abs=0.05)
    assert statistics.median(scales) == pytest.approx(math.exp(-0.32), rel=0.06)
    logs = [math.log(s) for s in scales]
    assert statistics.pstdev(logs) == pytest.approx(0.8, rel=0.06)
    top = sorted(scales)[-40:]  # the longest 1 %: several times the median
    assert min(top) > 3.5 * statistics.median(scales)


def test_scale_multiplies_the_body_not_the_cap_spike() -> None:
    capped = SimConfig(len_median=40, len_sigma=0.5, len_cap=256, cap_prob=0.5)
    spikes = 0
    for seed in range(300):
        base = target_length(seed, capped)
        body = math.exp(math.log(capped.len_median) + capped.len_sigma * _normal(seed))
        if base == capped.len_cap and body < capped.len_cap:  # the spike: whatever the scale
            spikes += 1
            assert target_length(seed, capped, 0.25) == capped.len_cap
        else:
            assert target_length(seed, capped, 3.0) == min(capped.len_cap, round(body * 3.0))
            assert target_length(seed, capped, 1e-6) == 1
    assert 100 < spikes < 200


def test_a_resumed_request_keeps_its_prompts_scale() -> None:
    """The scale hashes the prompt the backend finds (``prompt_len``), so the same request
    resumed with its earlier output appended targets the same length."""
    cfg = SimConfig(len_median=40, len_sigma=0.5, len_cap=4096, cap_prob=0.0,
                    prompt_scale_sigma=1.0)
    seed, prompt = 12345, _prompt(9)
    out = [sim_token(seed, len(prompt) + k, cfg.vocab_size) for k in range(5)]

    async def targets() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        backend = SimBackend(cfg)
        fresh = Req("a", list(prompt), ReqParams(seed=seed), seed, loop.create_future())
        resumed = Req("b", prompt + out, ReqParams(seed=seed, resumed_tokens=len(out)), seed,
                      loop.create_future())
        await backend.prefill([fresh, resumed])
        assert resumed.backend_state["prompt_len"] == len(prompt)
        return fresh.backend_state["target"], resumed.backend_state["target"]

    a, b = asyncio.run(targets())
    expected = target_length(seed, cfg, prompt_scale(prompt, 1.0))
    assert a == b == expected
    assert expected != target_length(seed, cfg)  # the scale did change it
