"""The engine contract (``strawq.testing.engine_contract``) on the local engines.

The same tests run against the real SGLang server in ``test_contract_sglang.py``; a local
engine must pass every test the real server passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from strawq.testing.engine_contract import EngineContract, EngineTarget
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.tiny_model import TinyConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny_target(weight_dirs: dict[int, Path]) -> Iterator[EngineTarget]:
    opts = EngineOptions(
        kind="tiny",
        max_running=4,
        model_path=str(weight_dirs[0]),
        tiny=TinyConfig(context_length=1024),
    )
    with EngineThread(opts) as engine:
        yield EngineTarget(
            url=engine.url,
            eos_token_id=opts.tiny.eos_token_id,
            vocab_size=opts.tiny.vocab_size,
            prompt=(11, 22, 33, 44, 55),
            weight_dirs=(str(weight_dirs[0]), str(weight_dirs[1])),
            max_running=4,
            long_tokens=1000,
            orphan_tokens=None,  # its 1024-token context takes ~1 s: the sim target covers it
        )


@pytest.fixture(scope="module")
def sim_target() -> Iterator[EngineTarget]:
    """The sim engine, started with SGLang's API and admin keys."""
    sim = SimConfig(step_base_ms=20.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)
    opts = EngineOptions(
        kind="sim", max_running=4, sim=sim, api_key="user-key", admin_api_key="admin-key",
        disconnect_poll_s=0.5,
    )
    with EngineThread(opts) as engine:
        yield EngineTarget(
            url=engine.url,
            eos_token_id=sim.eos_token_id,
            vocab_size=sim.vocab_size,
            prompt=(11, 22, 33, 44, 55),
            weight_dirs=("/sim/weights-a", "/sim/weights-b"),
            max_running=4,
            long_tokens=2000,
            orphan_tokens=20000,
            disconnect_deadline_s=5.0,
            api_key="user-key",
            admin_api_key="admin-key",
        )


@pytest.mark.slow
class TestTinyContract(EngineContract):
    @pytest.fixture
    def target(self, tiny_target: EngineTarget) -> EngineTarget:
        return tiny_target


@pytest.mark.slow
class TestSimContract(EngineContract):
    @pytest.fixture
    def target(self, sim_target: EngineTarget) -> EngineTarget:
        return sim_target
