"""Pytest fixtures for the real tier: a real SGLang 0.5.23 server and the real sglang-router.

Import them from the top-level ``tests/conftest.py``::

    from tests.sglang_fixtures import *  # noqa: F401,F403

``sglang_real`` (session): a :class:`RealServer`, started once per session.

1. If ``STRAWQ_SGLANG_URL`` is set, that running server is used as it is (its keys, if any,
   from ``STRAWQ_SGLANG_API_KEY`` / ``STRAWQ_SGLANG_ADMIN_KEY``). It must serve the
   fixture's model, so that the perturbed copy made here is loadable by it.
2. Otherwise, when the CPU fixture is built (``SGLANG_CPU_HOME``, default
   ``~/.cache/sglang-cpu``; build it with ``deploy/sglang/cpu_fixture.sh build``), a server is
   started on a free port with ``--weight-version 0`` and an API key and an admin key, and
   stopped at the end of the session.
3. Otherwise the tests skip, saying why. With ``STRAWQ_REQUIRE_SGLANG=1`` they fail instead
   (CI sets it, so a broken fixture cannot pass as a skip).

The second weight directory (``perturbed_dir``) is a copy of the model with one tensor
scaled by 1.05, made once next to the model (outside the checkout).

``sglang_router_cmd`` (session): the command that starts the real ``sglang-router``
(PyPI ``sglang-router``, the project's ``sglang-test`` extra), or a skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

__all__ = [
    "RealServer",
    "RouterProcess",
    "free_port",
    "make_perturbed_copy",
    "sglang_real",
    "sglang_router_cmd",
    "start_router",
]

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2-135m-instruct-bf16"
PERTURBED_TENSOR = "model.norm.weight"


@dataclass(frozen=True)
class RealServer:
    url: str
    model_dir: str
    perturbed_dir: str
    api_key: str | None
    admin_api_key: str | None
    started_s: float  # seconds the start took (0: an external server)


def _unavailable(reason: str) -> None:
    if os.environ.get("STRAWQ_REQUIRE_SGLANG") == "1":
        pytest.fail(f"real SGLang server required (STRAWQ_REQUIRE_SGLANG=1) but {reason}")
    pytest.skip(f"no real SGLang server: {reason}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tools_dir() -> Path:
    explicit = os.environ.get("STRAWQ_SGLANG_TOOLS")
    return Path(explicit) if explicit else REPO.parent / "shared" / "tools" / "sglang-cpu"


def _fixture_home() -> Path:
    return Path(os.environ.get("SGLANG_CPU_HOME") or Path.home() / ".cache" / "sglang-cpu")


def _get_json(url: str, key: str | None = None) -> dict[str, object]:
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    if not isinstance(body, dict):
        raise ValueError(f"{url} did not return an object")
    return body


def make_perturbed_copy(model_dir: Path, out: Path, *, scale: float = 1.05) -> Path:
    """Copy ``model_dir`` to ``out`` with ``PERTURBED_TENSOR`` (bf16) multiplied by ``scale``.

    Pure numpy on the safetensors layout (8-byte header length, JSON header, raw data), so
    it needs neither torch nor the safetensors package. Idempotent: an existing complete
    copy is reused.
    """
    done = out / ".strawq-perturbed"
    if done.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    raw = bytearray((model_dir / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    entry = header[PERTURBED_TENSOR]
    if entry["dtype"] != "BF16":
        raise ValueError(f"{PERTURBED_TENSOR} is {entry['dtype']}, expected BF16")
    start, end = (8 + n + int(x) for x in entry["data_offsets"])
    bits = np.frombuffer(bytes(raw[start:end]), dtype=np.uint16).astype(np.uint32) << 16
    values = bits.view(np.float32) * np.float32(scale)
    raw[start:end] = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    (tmp / "model.safetensors").write_bytes(bytes(raw))
    (tmp / ".strawq-perturbed").write_text(f"{PERTURBED_TENSOR} x {scale}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def sglang_real() -> Iterator[RealServer]:
    external = os.environ.get("STRAWQ_SGLANG_URL")
    home = _fixture_home()
    if external:
        url = external.rstrip("/")
        api_key = os.environ.get("STRAWQ_SGLANG_API_KEY") or None
        admin = os.environ.get("STRAWQ_SGLANG_ADMIN_KEY") or None
        try:
            info = _get_json(url + "/model_info", api_key)
        except (OSError, ValueError) as exc:
            _unavailable(f"STRAWQ_SGLANG_URL={url} does not answer /model_info ({exc})")
        model_dir = Path(str(info["model_path"]))
        perturbed = make_perturbed_copy(model_dir, model_dir.with_name(MODEL_NAME + "-perturbed"))
        yield RealServer(url, str(model_dir), str(perturbed), api_key, admin, 0.0)
        return
    serve = _tools_dir() / "serve.sh"
    model_dir = home / "model" / MODEL_NAME
    if not serve.exists():
        _unavailable(f"{serve} not found (set STRAWQ_SGLANG_TOOLS to the sglang-cpu tools)")
    if not (home / "venv" / "bin" / "python").exists() or not (model_dir / "config.json").exists():
        _unavailable(
            f"the CPU fixture is not built in {home} (run 'deploy/sglang/cpu_fixture.sh build')"
        )
    perturbed = make_perturbed_copy(model_dir, home / "model" / (MODEL_NAME + "-perturbed"))
    port = free_port()
    api_key, admin = "strawq-test-key", "strawq-test-admin-key"
    env = dict(os.environ, SGLANG_CPU_HOME=str(home))
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(serve), str(port), "--", "--weight-version", "0", "--api-key", api_key,
         "--admin-api-key", admin],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    if proc.returncode != 0 or not proc.stdout.strip().isdigit():
        _unavailable(f"serve.sh failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    pid = int(proc.stdout.strip())
    try:
        yield RealServer(
            f"http://127.0.0.1:{port}", str(model_dir), str(perturbed), api_key, admin,
            time.monotonic() - t0,
        )
    finally:
        try:
            os.killpg(pid, 15)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)


@pytest.fixture(scope="session")
def sglang_router_cmd() -> list[str]:
    if importlib.util.find_spec("sglang_router") is None:
        reason = "the sglang-router package is not installed (pip install -e '.[sglang-test]')"
        if os.environ.get("STRAWQ_REQUIRE_SGLANG") == "1":
            pytest.fail(f"real router required (STRAWQ_REQUIRE_SGLANG=1) but {reason}")
        pytest.skip(reason)
    return [sys.executable, "-m", "sglang_router.launch_router"]


class RouterProcess:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def start_router(
    cmd: list[str],
    worker_urls: list[str],
    *,
    timeout_s: float = 60.0,
    log: Path | None = None,
    extra_args: tuple[str, ...] = (),
    api_key: str | None = None,
) -> RouterProcess:
    """Start the real router in front of ``worker_urls``; returns once ``GET /workers`` lists
    them all. With ``api_key`` the router is started with ``--api-key``: it then wants that
    key from its clients and sends it to the workers."""
    if api_key:
        extra_args = (*extra_args, "--api-key", api_key)
    port = free_port()
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [*cmd, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
         "--log-level", "warn", *extra_args, "--worker-urls", *worker_urls],
        stdout=out, stderr=subprocess.STDOUT,
    )
    router = RouterProcess(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            body = _get_json(router.url + "/workers", api_key)
            workers = body.get("workers")
            if isinstance(workers, list) and len(workers) >= len(worker_urls):
                return router
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(
                f"sglang-router did not list {len(worker_urls)} workers within {timeout_s:.0f}s "
                f"(exit code {proc.poll()})"
            )
        time.sleep(0.2)
