"""argparse value types shared by every command line (usage errors, never tracebacks)."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit

from strawq.errors import StrawqError


class UsageError(StrawqError):
    """A value on the command line that cannot be used (the CLI exits 2, as argparse does).

    For values argparse cannot judge alone (a flag whose range depends on another, a config
    built from several flags); the message says which flag, what was expected and what was
    found."""


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1 (a usage error otherwise)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _port(value: str, low: int) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not low <= n <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a TCP port {low}-65535{' (0 picks a free one)' if low == 0 else ''}, "
            f"got {value!r}")
    return n


def port(value: str) -> int:
    """An argparse type: a TCP port to connect to, 1-65535."""
    return _port(value, 1)


def listen_port(value: str) -> int:
    """An argparse type: a TCP port to listen on, 0-65535 (0: the system picks a free one)."""
    return _port(value, 0)


def positive_float(value: str) -> float:
    """An argparse type: a finite number > 0 (``inf``, ``nan`` and ``1e400`` are refused)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value!r}")
    return x


def non_negative_float(value: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}") from None
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value!r}")
    return x


def non_negative_int(value: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def url_problem(value: str) -> str | None:
    """What is wrong with an engine or router URL (None: usable). It needs an ``http`` or
    ``https`` scheme, a host and a port in 1-65535 (given or the scheme's); a scheme-less
    ``localhost:30000`` is read by URL parsers as scheme ``localhost``, so it is refused
    here, with the spelling that works, rather than fail later as something else."""
    text = value.strip() if isinstance(value, str) else value
    if not isinstance(text, str) or not text:
        return f"expected an engine URL like http://HOST:PORT, got {value!r}"
    parts = urlsplit(text)
    if "://" not in text or parts.scheme not in ("http", "https"):
        hint = f"; did you mean http://{text}?" if "://" not in text else ""
        return (f"expected an engine URL like http://HOST:PORT (scheme http or https), got "
                f"{value!r}{hint}")
    try:
        port_ = parts.port
    except ValueError:
        return f"{value!r} has no valid port (expected 1-65535)"
    if not parts.hostname:
        return f"{value!r} names no host (expected http://HOST:PORT)"
    if port_ == 0:
        return f"{value!r} has port 0 (expected 1-65535)"
    return None


def engine_url(value: str) -> str:
    """An argparse type: an engine or router URL (``url_problem``), stripped of a trailing
    slash."""
    problem = url_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value.strip().rstrip("/")
