from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from aiohttp import web
from tests.producers.engine_helpers import AppThread

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread

#: fast sim engine: ~0.1 ms per decode step, responses of ~20 tokens (long tail to 120)
FAST_SIM = SimConfig(time_scale=0.01, len_median=20, len_sigma=0.8, len_cap=120, cap_prob=0.02)


@pytest.fixture(scope="module")
def module_sim_engine() -> Iterator[EngineThread]:
    with EngineThread(EngineOptions(kind="sim", max_running=256, sim=FAST_SIM)) as eng:
        yield eng


@pytest.fixture
def sim_engine(module_sim_engine: EngineThread) -> EngineThread:
    """The module's sim engine, back on weight version 0 (a fresh run's version): a test
    that pushed versions to it must not leave the next test's producer facing an engine on
    other weights (which it would rightly keep out of rotation)."""
    req = urllib.request.Request(
        module_sim_engine.url + "/update_weight_version", method="POST",
        data=json.dumps({"new_version": "0"}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
    return module_sim_engine


@pytest.fixture
def app_server() -> Iterator[Callable[[Callable[[], web.Application]], AppThread]]:
    """Start throwaway aiohttp servers (scripted engines); all stop at the end of the test."""
    servers: list[AppThread] = []

    def start(factory: Callable[[], web.Application]) -> AppThread:
        server = AppThread(factory)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()
