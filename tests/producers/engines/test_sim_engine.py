"""The client against the sim (timing-model) engine, and the mini router."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.producers.engine_helpers import (load_counts, orphan_through_router, run,
                                                    wait_until)

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig, target_length
from strawq.producers.engines.testing import running_engine
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sample_step import step_sample

pytestmark = pytest.mark.timeout(90)

PROMPT = [101, 102, 103, 104]


def sim(max_running: int = 64, **cfg: Any) -> EngineOptions:
    base: dict[str, Any] = {
        "step_base_ms": 2.0,
        "step_per_req_ms": 0.0,
        "len_median": 40,
        "len_sigma": 0.8,
        "len_cap": 200,
        "cap_prob": 0.1,
    }
    base.update(cfg)
    return EngineOptions(kind="sim", max_running=max_running, sim=SimConfig(**base))


def client(*urls: str, **kw: Any) -> SGLangClient:
    return SGLangClient(list(urls), config=ClientConfig(max_retries=1, backoff_base_s=0.05), **kw)


def test_deterministic_lengths_stop_and_length() -> None:
    cfg = SimConfig(len_median=40, len_sigma=0.8, len_cap=200, cap_prob=0.1)

    async def go() -> None:
        async with running_engine(sim(step_base_ms=0.0)) as url, client(url) as c:
            seed = next(s for s in range(100) if 5 < target_length(s, cfg) < 150)
            n = target_length(seed, cfg)
            r = await c.generate(PROMPT, {"max_new_tokens": 500, "sampling_seed": seed})
            assert r.finish_reason == {"type": "stop", "matched": 2} and len(r.output_ids) == n
            r2 = await c.generate(PROMPT, {"max_new_tokens": 500, "sampling_seed": seed})
            assert (
                r2.output_ids.tolist() == r.output_ids.tolist()
                and r2.logprobs.tolist() == r.logprobs.tolist()
            )
            short = await c.generate(PROMPT, {"max_new_tokens": n - 1, "sampling_seed": seed})
            assert short.finish_reason == {"type": "length", "length": n - 1}
            assert short.output_ids.tolist() == r.output_ids.tolist()[: n - 1]

    run(go())


@pytest.mark.slow
def test_abort_and_resume_equals_uninterrupted_across_versions() -> None:
    async def go() -> None:
        async with (
            running_engine(
                sim(step_base_ms=5.0, len_median=10**4, len_cap=400, cap_prob=1.0)
            ) as url,
            client(url) as c,
        ):
            params = SamplerParams(max_new_tokens=120, seed=99)
            ref = Sample.new("ref", PROMPT, params)
            await step_sample(c, ref)
            assert ref.status is SampleStatus.TRUNCATED and ref.response_length == 120
            s = Sample.new("s", PROMPT, params)
            t = asyncio.create_task(step_sample(c, s))
            await wait_until(lambda: _running(c, url))
            await asyncio.sleep(0.05)
            await c.pause_generation("abort")
            await t
            assert s.status is SampleStatus.ABORTED and 0 < s.response_length < 120
            k = s.response_length
            await c.update_weights_from_disk("/any/path", weight_version=4)
            await c.continue_generation()
            await step_sample(c, s)
            assert s.response_ids.tolist() == ref.response_ids.tolist()
            assert s.logprobs.tolist() == ref.logprobs.tolist()
            assert s.versions.tolist() == [0] * k + [4] * (120 - k)
            assert s.status is SampleStatus.TRUNCATED

    run(go())


async def _running(c: SGLangClient, url: str) -> bool:
    return (await load_counts(c, url))[0] > 0


@pytest.mark.slow
def test_thousand_concurrent_requests_respect_slot_limit() -> None:
    async def go() -> None:
        async with (
            running_engine(
                sim(max_running=128, step_base_ms=1.0, len_median=20, len_cap=60)
            ) as url,
            client(url) as c,
        ):
            peak = 0
            stop = asyncio.Event()

            async def watch() -> None:
                nonlocal peak
                while not stop.is_set():
                    running, _ = await load_counts(c, url)
                    peak = max(peak, running)
                    await asyncio.sleep(0.01)

            w = asyncio.create_task(watch())
            results = await asyncio.gather(
                *(
                    c.generate(PROMPT + [i % 500], {"max_new_tokens": 50, "sampling_seed": i})
                    for i in range(1000)
                )
            )
            stop.set()
            await w
            kinds = {r.finish_type for r in results}
            assert kinds <= {"stop", "length"} and "stop" in kinds
            assert all(
                len(r.output_ids) == len(r.logprobs) == len(r.versions) <= 50 for r in results
            )
            assert 0 < peak <= 128

    run(go(), 120)


def test_waiting_abort_shape_and_retract_spans() -> None:
    async def go() -> None:
        async with (
            running_engine(
                sim(max_running=1, step_base_ms=3.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)
            ) as url,
            client(url) as c,
        ):
            a = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 5000}, rid="a"))
            b = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 5000}, rid="b"))
            await wait_until(lambda: _counts(c, url, (1, 1)))
            await c.abort("b")
            rb = await b
            assert rb.is_waiting_abort and rb.prompt_tokens is None
            await c.pause_generation("retract")
            await c.update_weight_version(7, abort_all_requests=False)
            await c.continue_generation()
            await wait_until(lambda: _counts(c, url, (1, 0)))
            await asyncio.sleep(0.03)
            await c.abort_until_idle(deadline_s=10)
            ra = await a
            assert ra.is_abort and ra.num_retractions == 1
            assert set(ra.versions.tolist()) == {0, 7} and ra.versions[-1] == 7

    run(go())


async def _counts(c: SGLangClient, url: str, expected: tuple[int, int]) -> bool:
    return await load_counts(c, url) == expected


@pytest.mark.process
def test_router_drops_the_request_of_a_killed_client() -> None:
    """As the real sglang-router does (``test_router_real``): the worker sees its client
    gone and aborts the request."""
    sim = SimConfig(step_base_ms=5.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)

    async def go() -> None:
        async with (
            running_engine(EngineOptions(kind="sim", sim=sim, disconnect_poll_s=0.5)) as w1,
            running_engine(EngineOptions(kind="router", worker_urls=(w1,))) as router,
        ):
            await orphan_through_router(router, [w1])

    run(go())


def test_router_discovery_generate_and_per_worker_control() -> None:
    async def go() -> None:
        async with (
            running_engine(
                EngineOptions(kind="sim", weight_version="1", sim=SimConfig(step_base_ms=0.0))
            ) as w1,
            running_engine(
                EngineOptions(kind="sim", weight_version="2", sim=SimConfig(step_base_ms=0.0))
            ) as w2,
            running_engine(EngineOptions(kind="router", worker_urls=(w1, w2))) as router,
        ):
            async with SGLangClient(router_url=router, config=ClientConfig(max_retries=0)) as c:
                assert sorted(c.worker_urls) == sorted([w1, w2])
                versions = {
                    (await c.generate(PROMPT, {"max_new_tokens": 3})).weight_version
                    for _ in range(4)
                }
                assert versions == {1, 2}  # round-robin reached both workers
                paused = await c.pause_generation("abort")
                assert set(paused) == {w1, w2}
                await c.update_weight_version(9)
                await c.continue_generation()
                assert [await c.weight_version(u) for u in (w1, w2)] == [9, 9]
                r = await c.generate(PROMPT, {"max_new_tokens": 3})
                assert r.weight_version == 9
        # plain list of workers, no router: round-robin too
        async with (
            running_engine(
                EngineOptions(kind="sim", weight_version="3", sim=SimConfig(step_base_ms=0.0))
            ) as u1,
            running_engine(
                EngineOptions(kind="sim", weight_version="4", sim=SimConfig(step_base_ms=0.0))
            ) as u2,client(u1, u2) as c
        ):
            got = {
                (await c.generate(PROMPT, {"max_new_tokens": 2})).weight_version
                for _ in range(2)
            }
            assert got == {3, 4}

    run(go())
