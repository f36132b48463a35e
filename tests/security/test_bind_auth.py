"""Every port strawq opens binds loopback unless told otherwise, and takes an API key where
it accepts writes (docs/security.md)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest

from strawq.config import from_dict
from strawq.errors import ConfigError
from strawq.producers.engine_transport import ClientConfig
from strawq.producers.engines.launch import EngineOptions, is_loopback
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.sim_backend import SimConfig

pytestmark = pytest.mark.timeout(60)

KEY = "strawq-test-router-key-4c1f"


def _call(url: str, *, method: str = "GET", body: Any = None,
          key: str | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_router_refuses_writes_without_its_api_key() -> None:
    fast = SimConfig(time_scale=0.01, len_median=4, len_cap=8)
    with EngineThread(EngineOptions(kind="sim", sim=fast, api_key=KEY)) as worker, \
            EngineThread(EngineOptions(kind="router", worker_urls=(worker.url,),
                                       api_key=KEY)) as router:
        gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        assert _call(router.url + "/health") == 200  # health stays open, as SGLang's
        assert _call(router.url + "/workers", method="POST", body={"url": "http://x"}) == 401
        assert _call(router.url + "/workers", method="POST", body={"url": "http://x"},
                     key="wrong") == 401
        assert _call(router.url + "/workers") == 401
        assert _call(router.url + "/generate", method="POST", body=gen) == 401
        # with the key: routed, and the key passed on to the worker (which needs it too)
        assert _call(router.url + "/generate", method="POST", body=gen, key=KEY) == 200


def test_an_engine_on_every_interface_without_a_key_warns(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    fast = SimConfig(time_scale=0.01)
    with caplog.at_level(logging.WARNING, logger="strawq.producers.engines.launch"):
        with EngineThread(EngineOptions(kind="sim", sim=fast), host="0.0.0.0"):
            pass
        with EngineThread(EngineOptions(kind="sim", sim=fast, api_key=KEY), host="0.0.0.0"):
            pass
        with EngineThread(EngineOptions(kind="sim", sim=fast)):  # default: 127.0.0.1
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "0.0.0.0" in warnings[0] and "--api-key" in warnings[0]


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")
    assert not is_loopback("10.0.0.1") and not is_loopback("node7")


def test_the_serve_command_binds_loopback_by_default() -> None:
    import argparse

    from strawq.producers.engines.cli import add_engine_parser

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--kind", "sim"])
    assert args.host == "127.0.0.1"


def test_the_metrics_exporter_binds_loopback_by_default(tmp_path: Any) -> None:
    pytest.importorskip("prometheus_client")
    from strawq.collector.trainer.metrics import MetricsSink

    sink = MetricsSink(None, 0)
    try:
        assert sink.exposition is not None and sink.exposition._server is not None
        assert sink.exposition._server.server_address[0] == "127.0.0.1"
    finally:
        sink.close()


def test_keys_never_appear_in_reprs_or_config_errors() -> None:
    secret = "sk-strawq-never-print-91d2"
    cfg = ClientConfig(api_key=secret, admin_api_key=secret + "-admin")
    opts = EngineOptions(kind="sim", api_key=secret, admin_api_key=secret)
    assert secret not in repr(cfg) and secret not in str(cfg)
    assert secret not in repr(opts)
    with pytest.raises(ConfigError) as err:
        from_dict(ClientConfig, {"api_key": [secret]}, where="engine.client")
    assert "api_key" in str(err.value) and secret not in str(err.value)
