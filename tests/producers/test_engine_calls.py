"""The engine seam's declarations: the optional engine calls (``strawq.producers.engine_client``)
and the split of the engine settings into the client's (``ClientConfig``) and the sample
step's (``GenerationConfig``), old keys refused with their new place named."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from strawq.app.run_config import RunConfig
from strawq.config import load_config
from strawq.errors import ConfigError
from strawq.producers.engine_client import (
    ModelInfoProbe,
    RouterClient,
    VersionProbe,
    optional_calls,
)
from strawq.producers.engine_transport import ClientConfig
from strawq.producers.engine_versions import VersionGuard
from strawq.producers.eos import resolve_eos_ids
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sample_step import GenerationConfig
from strawq.producers.sglang_client import SGLangClient
from strawq.weights.engine_weights import EngineWeights
from tests.producers.helpers import make_run


class Plain:
    """An engine client that makes the required calls only."""

    worker_urls = ["http://e1", "http://e2"]

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, input_ids: Any, sampling_params: Any, **kw: Any) -> Any:
        raise AssertionError("not asked to generate")

    async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
        pass


class Probed(Plain):
    """The same, with a version probe only."""

    async def weight_version(self, url: str) -> int:
        return 3


def _guard(tmp_path: Path, client: Callable[[], Any]) -> VersionGuard:
    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    return VersionGuard("p1", client=client, current_version=q.current_version,
                        notes=EngineWeights(q.storage), io=io, pausing=lambda: False,
                        book=StatsBook(ProducerStats()))


def test_the_optional_calls_are_declared_one_protocol_each() -> None:
    client = SGLangClient(["http://e1"])
    calls = optional_calls(client)
    assert calls.version is client and calls.model is client and calls.router is client
    assert isinstance(client, VersionProbe) and isinstance(client, ModelInfoProbe)
    assert isinstance(client, RouterClient) and calls.router_url is None
    assert optional_calls(SGLangClient(router_url="http://r:1/")).router_url == "http://r:1"
    plain = optional_calls(Plain())
    assert (plain.version, plain.model, plain.router, plain.router_url) == (None,) * 4
    probed = optional_calls(Probed())
    assert probed.version is not None and probed.model is None and probed.router is None
    assert optional_calls(None) == plain


def test_a_client_without_the_optional_calls_takes_the_declared_path(tmp_path: Path) -> None:
    """No version probe: nothing is probed and the engines count as reachable; no
    model_info: the EOS ids come from the other sources, and the refusal says why."""
    guard = _guard(tmp_path, Plain)

    async def go() -> None:
        assert await guard.reachable()
        await guard.probe_all(refresh_workers=True)
        assert not guard.stale and guard.usable(Plain.worker_urls) == Plain.worker_urls
        assert await resolve_eos_ids(Plain(), configured=None,  # type: ignore[arg-type]
                                     tokenizer=type("Tok", (), {"eos_token_id": 5})()) == {5}
        with pytest.raises(ConfigError, match="makes no model_info call"):
            await resolve_eos_ids(Plain(), configured=None)  # type: ignore[arg-type]

    asyncio.run(go())


def test_a_client_with_a_version_probe_only_is_probed(tmp_path: Path) -> None:
    """The run is at version 0 and the engines report 3: both go out of rotation."""
    guard = _guard(tmp_path, Probed)

    async def go() -> None:
        await guard.probe_all(refresh_workers=True)  # no router calls: no refresh
        assert guard.stale == {"http://e1": 3, "http://e2": 3}

    asyncio.run(go())


@pytest.mark.parametrize("key,value", [("context_length", 4096), ("eos_token_ids", [2]),
                                       ("warm_prefix", True)])
def test_a_sample_step_key_under_the_client_is_refused_naming_its_new_place(
        key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict({"producer": {"run_dir": "/r", "plugins": {"reward": "m.f"},
                                          "engine": {"workers": ["http://e1"],
                                                     "client": {key: value}}}})
    msg = str(info.value)
    assert msg.startswith("run config.producer.engine.client:")
    assert f"'{key}' moved to engine.generation.{key}" in msg and "docs/changes.md" in msg
    with pytest.raises(ConfigError, match=f"moved to engine.generation.{key}"):
        load_config(ProducerConfig, None, ["run_dir=/r", "plugins.reward=m.f",
                                           "engine.workers=[\"http://e1\"]",
                                           f"engine.client.{key}={value}".lower()])
    with pytest.raises(TypeError):
        ClientConfig(**{key: value})


def test_the_sample_step_keys_live_in_engine_generation() -> None:
    cfg = load_config(ProducerConfig, None, [
        "run_dir=/r", "plugins.reward=m.f", "engine.workers=[\"http://e1\"]",
        "engine.generation.context_length=4096", "engine.generation.eos_token_ids=[2, 7]",
        "engine.generation.warm_prefix=true", "engine.client.default_version=0"])
    assert cfg.engine.generation == GenerationConfig(context_length=4096,
                                                     eos_token_ids=(2, 7), warm_prefix=True)
    assert cfg.engine.client.default_version == 0  # read where replies are parsed
    with pytest.raises(ConfigError, match="context_length must be >= 2"):
        GenerationConfig(context_length=1)
    with pytest.raises(ConfigError, match="unknown key"):
        GenerationConfig.from_dict({"max_retries": 3})
