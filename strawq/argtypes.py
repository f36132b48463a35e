"""argparse value types shared by every command line (usage errors, never tracebacks)."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1 (a usage error otherwise)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n
