"""The argparse value types every command line shares: a bad value is a usage error."""

from __future__ import annotations

import argparse

import pytest

from strawq.argtypes import engine_url, listen_port, non_negative_float, port, positive_float


@pytest.mark.parametrize("value", ["0", "65536", "99999", "-1", "http", "1.5", ""])
def test_a_port_is_1_to_65535(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a TCP port 1-65535"):
        port(value)


def test_a_listen_port_may_be_0_for_a_free_one() -> None:
    assert listen_port("0") == 0 and listen_port("65535") == 65535 and port("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match="0 picks a free one"):
        listen_port("65536")


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-1", "x"])
def test_numbers_from_flags_are_finite(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(value)
    with pytest.raises(argparse.ArgumentTypeError):
        non_negative_float(value)
    assert positive_float("0.5") == 0.5 and non_negative_float("0") == 0.0


@pytest.mark.parametrize("bad", ["localhost:30000", "127.0.0.1:30000", "http://", "ftp://h:1",
                                 "http://host:99999", "http://host:0", "http://:8000", ""])
def test_an_engine_url_without_scheme_host_or_valid_port_is_refused(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected|port|host"):
        engine_url(bad)


def test_a_scheme_less_engine_url_is_told_the_spelling_that_works() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean http://localhost:30000"):
        engine_url("localhost:30000")


@pytest.mark.parametrize("good", ["http://127.0.0.1:30000", "https://engines.example/",
                                  "http://[::1]:8000"])
def test_an_engine_url_with_scheme_and_host_is_accepted(good: str) -> None:
    assert engine_url(good) == good.rstrip("/")


def test_a_producer_config_with_a_scheme_less_worker_is_refused_when_parsed() -> None:
    from strawq.errors import ConfigError
    from strawq.producers.producer_config import EngineConfig

    with pytest.raises(ConfigError, match=r"engine.workers\[1\]: .*localhost:30000"):
        EngineConfig(workers=("http://h:1", "localhost:30000"))
    with pytest.raises(ConfigError, match="engine.router_url"):
        EngineConfig(router_url="router:32000")
