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
scaled by 1.05, made once next to the model (outside the checkout). The server and that
copy come from ``strawq.testing.real_sglang`` (``bench/engines.py`` uses it too).

``sglang_router_cmd`` (session): the command that starts the real ``sglang-router``
(PyPI ``sglang-router``, the project's ``sglang-test`` extra), or a skip.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from strawq.testing.real_sglang import (
    MODEL_NAME,
    RealServer,
    RouterProcess,
    default_fixture_home,
    default_tools_dir,
    fixture_problem,
    free_port,
    get_json,
    make_perturbed_copy,
    start_real_server,
    start_router,
)
from strawq.producers.sglang_client import ClientConfig, SGLangClient

__all__ = [
    "RealServer",
    "RouterProcess",
    "free_port",
    "sglang_real",
    "sglang_real_session",
    "sglang_router_cmd",
    "start_router",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("STRAWQ_REQUIRE_SGLANG") == "1":
        pytest.fail(f"real SGLang server required (STRAWQ_REQUIRE_SGLANG=1) but {reason}")
    pytest.skip(f"no real SGLang server: {reason}")


@pytest.fixture(scope="session")
def sglang_real_session() -> Iterator[RealServer]:
    external = os.environ.get("STRAWQ_SGLANG_URL")
    if external:
        url = external.rstrip("/")
        api_key = os.environ.get("STRAWQ_SGLANG_API_KEY") or None
        admin = os.environ.get("STRAWQ_SGLANG_ADMIN_KEY") or None
        try:
            info = get_json(url + "/model_info", api_key)
        except (OSError, ValueError) as exc:
            _unavailable(f"STRAWQ_SGLANG_URL={url} does not answer /model_info ({exc})")
        model_dir = Path(str(info["model_path"]))
        perturbed = make_perturbed_copy(model_dir, model_dir.with_name(MODEL_NAME + "-perturbed"))
        yield RealServer(url, str(model_dir), str(perturbed), api_key, admin)
        return
    home, tools = default_fixture_home(), default_tools_dir()
    problem = fixture_problem(home, tools)
    if problem:
        _unavailable(problem)
    try:
        server = start_real_server(home, tools)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        _unavailable(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sglang_router_cmd() -> list[str]:
    if importlib.util.find_spec("sglang_router") is None:
        reason = "the sglang-router package is not installed (pip install -e '.[sglang-test]')"
        if os.environ.get("STRAWQ_REQUIRE_SGLANG") == "1":
            pytest.fail(f"real router required (STRAWQ_REQUIRE_SGLANG=1) but {reason}")
        pytest.skip(reason)
    return [sys.executable, "-m", "sglang_router.launch_router"]


@pytest.fixture
def sglang_real(sglang_real_session: RealServer) -> RealServer:
    """The session's real server with its weight version label back at 0 (a fresh run's
    version): a test that pushed versions to it must not leave the next test's producers
    facing an engine on another version, which they rightly keep out of rotation."""
    server = sglang_real_session

    async def reset() -> None:
        config = ClientConfig(api_key=server.api_key, admin_api_key=server.admin_api_key)
        async with SGLangClient([server.url], config=config) as c:
            await c.update_weight_version(0, abort_all_requests=False)

    asyncio.run(reset())
    return server
