"""Waiting for a condition in tests: a deadline, never a timing assertion.

One helper for every test that waits for something another process or task does (a file to
appear, a producer to finish, an engine to report a load). The deadline only bounds a hang;
a test asserts what happened, not how fast.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


class WaitTimeout(AssertionError):
    """The condition did not hold before the deadline (a test failure, not a flake guard)."""


def _fail(what: str, timeout_s: float, detail: Callable[[], str] | None) -> WaitTimeout:
    extra = detail() if detail is not None else ""
    return WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}"
                       + (f": {extra}" if extra else ""))


def wait_until(cond: Callable[[], bool], timeout_s: float = 60.0, *, what: str = "a condition",
               poll_s: float = 0.02, on_poll: Callable[[], None] | None = None,
               detail: Callable[[], str] | None = None) -> None:
    """Poll ``cond`` until it holds; raise ``WaitTimeout`` naming ``what`` after ``timeout_s``.

    ``on_poll`` runs before each check (e.g. let a lease monitor scan, or fail early when a
    child process died); ``detail`` adds what was seen to the failure message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if on_poll is not None:
            on_poll()
        if cond():
            return
        if time.monotonic() > deadline:
            raise _fail(what, timeout_s, detail)
        time.sleep(poll_s)


async def async_wait_until(cond: Callable[[], bool | Awaitable[bool]], timeout_s: float = 60.0,
                           *, what: str = "a condition", poll_s: float = 0.02,
                           detail: Callable[[], str] | None = None) -> None:
    """``wait_until`` for an event loop: ``cond`` may be a plain or an async predicate."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok = cond()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise _fail(what, timeout_s, detail)
        await asyncio.sleep(poll_s)
