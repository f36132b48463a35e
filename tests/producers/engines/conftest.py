"""Fixtures of the engine tests: weight directories and throwaway aiohttp servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.producers.engines.engine_helpers import AppThread


@pytest.fixture
def app_server() -> Iterator[Callable[[Callable[[], web.Application]], AppThread]]:
    servers: list[AppThread] = []

    def start(factory: Callable[[], web.Application]) -> AppThread:
        server = AppThread(factory)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def weight_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two tiny-model weight versions (0 and 1) with the same architecture."""
    from strawq.producers.engines.tiny_model import TinyConfig, init_model, save_weights

    root = tmp_path_factory.mktemp("tiny-weights")
    return {
        v: save_weights(init_model(TinyConfig(seed=100 + v, context_length=1024)), root / f"v{v}")
        for v in (0, 1)
    }
