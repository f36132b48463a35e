"""Fixtures of the engine tests: tiny-model weight directories."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def weight_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two tiny-model weight versions (0 and 1) with the same architecture."""
    from strawq.producers.engines.tiny_model import TinyConfig, init_model, save_weights

    root = tmp_path_factory.mktemp("tiny-weights")
    return {
        v: save_weights(init_model(TinyConfig(seed=100 + v, context_length=1024)), root / f"v{v}")
        for v in (0, 1)
    }
