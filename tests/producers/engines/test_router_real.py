"""The real sglang-router 0.3.2 (PyPI ``sglang-router``) in front of local engines and of
the real SGLang server: worker discovery, generate through the router, control calls sent
to every worker, workers added and removed while requests run.

Skipped with the reason when the package is missing (``pip install -e '.[sglang-test]'``);
required in CI (``STRAWQ_REQUIRE_SGLANG=1``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from tests.producers.engine_helpers import orphan_through_router, run

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from tests.sglang_fixtures import RealServer, RouterProcess, start_router

pytestmark = [pytest.mark.sglang_real, pytest.mark.timeout(240)]

PROMPT = [11, 22, 33, 44, 55]
SIM = SimConfig(step_base_ms=5.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)


@pytest.fixture
def sims() -> Iterator[list[EngineThread]]:
    engines = [
        EngineThread(EngineOptions(kind="sim", max_running=8, sim=SIM, weight_version=v,
                                   disconnect_poll_s=0.5))
        for v in ("0", "5", "9")
    ]
    yield engines
    for e in engines:
        e.stop()


@pytest.fixture
def router_on_sims(
    sglang_router_cmd: list[str], sims: list[EngineThread], tmp_path: Path
) -> Iterator[RouterProcess]:
    router = start_router(sglang_router_cmd, [sims[0].url, sims[1].url], log=tmp_path / "r.log")
    yield router
    router.stop()


def _client(router: RouterProcess, **cfg: object) -> SGLangClient:
    return SGLangClient(router_url=router.url, config=ClientConfig(max_retries=0, **cfg))  # type: ignore[arg-type]


def test_router_discovers_workers_and_routes_generate(
    router_on_sims: RouterProcess, sims: list[EngineThread]
) -> None:
    async def go() -> None:
        async with _client(router_on_sims) as c:
            assert sorted(c.worker_urls) == sorted([sims[0].url, sims[1].url])
            results = await asyncio.gather(
                *(c.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}) for _ in range(8))
            )
            # both workers served (their versions differ), every reply is whole
            assert {r.weight_version for r in results} == {0, 5}
            assert all(len(r.output_ids) == 3 for r in results)

    run(go(), 120)


def test_control_calls_reach_every_worker_not_the_router(
    router_on_sims: RouterProcess, sims: list[EngineThread]
) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            for path in ("/abort_request", "/pause_generation", "/update_weights_from_disk"):
                async with http.post(router_on_sims.url + path, json={}) as resp:
                    assert resp.status == 404, path  # the router does not route control calls
        async with _client(router_on_sims) as c:
            long = asyncio.create_task(
                c.generate(PROMPT, {"max_new_tokens": 5000, "ignore_eos": True}, rid="via-router")
            )
            await asyncio.sleep(0.3)
            assert c.inflight_rids() == ["via-router"]
            # a worker-side exact abort ends a request that came through the router
            assert await c.abort_matching("via-") == ["via-router"]
            r = await long
            assert r.is_abort and len(r.output_ids) > 0
            await c.pause_generation("abort")
            async with aiohttp.ClientSession() as http:
                for e in sims[:2]:
                    async with http.get(e.url + "/ready") as resp:
                        assert resp.status == 503  # paused, each one
            await c.push_weights("/sim/new", weight_version=7, url=None)
            await c.continue_generation()
            for e in sims[:2]:
                assert await c.weight_version(e.url) == 7

    run(go(), 120)


def test_a_killed_clients_request_is_aborted_through_the_router(
    router_on_sims: RouterProcess, sims: list[EngineThread]
) -> None:
    run(orphan_through_router(router_on_sims.url, [e.url for e in sims[:2]]), 120)


def test_worker_added_and_removed_while_requests_run(
    router_on_sims: RouterProcess, sims: list[EngineThread]
) -> None:
    async def go() -> None:
        async with _client(router_on_sims) as c:
            stop = asyncio.Event()
            versions: list[int] = []

            async def producer() -> None:
                while not stop.is_set():
                    r = await c.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
                    assert len(r.output_ids) == 4
                    versions.append(r.weight_version)

            runners = [asyncio.create_task(producer()) for _ in range(3)]
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    router_on_sims.url + "/workers", json={"url": sims[2].url}
                ) as resp:
                    assert resp.status == 202
                for _ in range(100):
                    if len(await c.refresh_workers()) == 3:
                        break
                    await asyncio.sleep(0.1)
                assert sims[2].url in c.worker_urls
                for _ in range(100):
                    if 9 in versions:
                        break
                    await asyncio.sleep(0.05)
                assert 9 in versions  # the new worker serves
                gone = next(w for w in await c.refresh_workers() if w.url == sims[0].url)
                async with http.delete(f"{router_on_sims.url}/workers/{gone.id}") as resp:
                    assert resp.status == 202
                for _ in range(100):
                    if sims[0].url not in [w.url for w in await c.refresh_workers()]:
                        break
                    await asyncio.sleep(0.1)
                assert sims[0].url not in c.worker_urls
                mark = len(versions)
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*runners)  # no request failed
            assert len(versions) > mark and 0 not in versions[mark + 3 :]

    run(go(), 120)


def test_router_in_front_of_the_real_server(
    sglang_router_cmd: list[str], sglang_real: RealServer, tmp_path: Path
) -> None:
    router = start_router(
        sglang_router_cmd, [sglang_real.url], log=tmp_path / "r.log", api_key=sglang_real.api_key
    )
    try:
        cfg = ClientConfig(
            max_retries=0, api_key=sglang_real.api_key, admin_api_key=sglang_real.admin_api_key
        )

        async def go() -> None:
            async with SGLangClient(router_url=router.url, config=cfg) as c:
                assert c.worker_urls == [sglang_real.url]
                prompt = [504, 3575, 282, 4649, 314]
                r = await c.generate(prompt, {"max_new_tokens": 3, "ignore_eos": True})
                assert len(r.output_ids) == 3
                long = asyncio.create_task(
                    c.generate(prompt, {"max_new_tokens": 400, "ignore_eos": True}, rid="rr-1")
                )
                await asyncio.sleep(1.0)
                assert await c.abort_matching("rr-") == ["rr-1"]
                aborted = await long
                assert aborted.is_abort and 0 < len(aborted.output_ids) < 400

        run(go(), 180)
    finally:
        router.stop()
