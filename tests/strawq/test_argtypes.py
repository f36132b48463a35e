"""The argparse value types every command line shares: a bad value is a usage error."""

from __future__ import annotations

import argparse

import pytest

from strawq.argtypes import listen_port, non_negative_float, port, positive_float


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
