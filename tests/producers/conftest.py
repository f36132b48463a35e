from __future__ import annotations

from collections.abc import Iterator

import pytest

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread

#: fast sim engine: ~0.1 ms per decode step, responses of ~20 tokens (long tail to 120)
FAST_SIM = SimConfig(time_scale=0.01, len_median=20, len_sigma=0.8, len_cap=120, cap_prob=0.02)


@pytest.fixture(scope="module")
def sim_engine() -> Iterator[EngineThread]:
    with EngineThread(EngineOptions(kind="sim", max_running=256, sim=FAST_SIM)) as eng:
        yield eng
