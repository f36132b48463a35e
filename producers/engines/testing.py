"""Helpers that start local engines for tests, benchmarks and demos.

* :func:`start_engine_subprocess` — a real ``python -m strawq.producers.engines serve`` process
  (kill it with ``kill -9`` to test a dying engine).
* :class:`EngineThread` — an in-process engine on its own event loop in a daemon thread,
  usable from synchronous code.
* :func:`running_engine` — an async context manager serving in the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from typing_extensions import Self

from strawq.producers.engines.cli import READY_PREFIX
from strawq.producers.engines.launch import EngineOptions, start_engine

_REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineProcess:
    """A running engine subprocess. Use as a context manager or call :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL (``kill -9``) — the engine disappears without any cleanup."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _flag(key: str, value: Any) -> list[str]:
    return [f"--{key.replace('_', '-')}", str(value)]


def start_engine_subprocess(
    kind: str,
    port: int = 0,
    *,
    ready_timeout_s: float = 90.0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    wrap: Sequence[str] = (),
    **opts: Any,
) -> EngineProcess:
    """Start ``python -m strawq.producers.engines serve --kind KIND --port PORT``; wait until
    ready.

    Keyword options become CLI flags (``max_running_requests=4`` → ``--max-running-requests 4``,
    ``model_path=...``, ``time_scale=0.1``, ``weight_version="3"``...). ``port=0`` picks a
    free port; the URL is read from the engine's ready line. ``wrap`` prefixes the command
    (``["ip", "netns", "exec", NS]``: the engine in another network namespace).
    """
    cmd = [*wrap, sys.executable, "-m", "strawq.producers.engines", "serve", "--kind", kind]
    cmd += ["--port", str(port)]
    for key, value in opts.items():
        if value is not None:
            cmd += _flag(key, value)
    cmd += list(extra_args)
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO_ROOT), child_env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env,
        cwd=str(_REPO_ROOT),
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name=f"engine-{kind}-stdout").start()
    deadline = time.monotonic() + ready_timeout_s
    seen: list[str] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            proc.kill()
            raise TimeoutError(
                f"engine {kind} not ready after {ready_timeout_s:.0f}s; output:\n"
                f"{''.join(seen[-20:])}"
            )
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(timeout=10)
            raise RuntimeError(
                f"engine {kind} exited with {proc.returncode} before ready; output:\n"
                f"{''.join(seen[-20:])}"
            )
        seen.append(line)
        if line.startswith(READY_PREFIX):
            return EngineProcess(proc, line.split()[1])


@contextlib.asynccontextmanager
async def running_engine(
    opts: EngineOptions, *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``opts`` in the current event loop; yields the base URL."""
    runner, url = await start_engine(opts, host=host, port=port)
    try:
        yield url
    finally:
        await runner.cleanup()


class EngineThread:
    """An engine served by a private event loop in a daemon thread (in-process)."""

    def __init__(
        self,
        opts: EngineOptions,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.opts = opts
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(host, port), daemon=True, name=f"engine-{opts.kind}"
        )
        self._thread.start()
        if not self._ready.wait(ready_timeout_s):
            raise TimeoutError(
                f"in-process {opts.kind} engine not ready after {ready_timeout_s:.0f}s"
            )
        if self._error is not None:
            raise RuntimeError(
                f"in-process {opts.kind} engine failed to start: {self._error}"
            ) from self._error

    def _main(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(host, port))

    async def _serve(self, host: str, port: int) -> None:
        self._stop = asyncio.Event()
        try:
            runner, self.url = await start_engine(self.opts, host=host, port=port)
        except BaseException as exc:  # noqa: BLE001  (reported to the constructor)
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
