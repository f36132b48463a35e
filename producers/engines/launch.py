"""Build and start a local engine (or the mini router) from Python."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from strawq.config import Config
from strawq.producers.engines.core import EngineCore
from strawq.producers.engines.router import build_router_app
from strawq.producers.engines.server import DISCONNECT_POLL_S, build_app
from strawq.producers.engines.sim_backend import SimBackend, SimConfig
from strawq.producers.engines.tiny_config import TinyConfig

logger = logging.getLogger(__name__)

KINDS = ("tiny", "sim", "router")


@dataclass(frozen=True, kw_only=True)
class EngineOptions(Config):
    """Everything needed to build one local engine.

    Fields:
        kind: ``tiny`` (torch model), ``sim`` (timing model) or ``router``.
        max_running: slot limit (``--max-running-requests``); more requests wait.
        weight_version: initial version string; strawq wants an integer string.
        model_path: tiny only: a directory written by ``save_weights``; None = random
            init from ``tiny`` (the config's seed).
        tiny / sim: backend configurations.
        threads: torch threads for the tiny model (1 is fastest for the default size on
            small CPUs; None = torch default).
        served_model_name: reported by ``/model_info``.
        health_check_timeout_s: ``/health_generate`` answers 503 after this.
        disconnect_poll_s: how often a request with no answer yet checks that its client is
            still connected; a gone client's requests are aborted (SGLang 0.5.23: 4 s,
            ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT``).
        update_wait_timeout_s: an unpaused weight update gives up (400) after waiting
            this long for in-flight requests.
        worker_urls: router only: the workers to route to.
        api_key / admin_api_key: as SGLang's ``--api-key`` / ``--admin-api-key``: every
            endpoint but health needs the API key; with an admin key, the control
            endpoints (abort, pause, continue, weight updates, flush) need that one.
    """

    kind: str
    max_running: int = 32
    weight_version: str = "0"
    model_path: str | None = None
    tiny: TinyConfig = field(default_factory=TinyConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    threads: int | None = 1
    served_model_name: str | None = None
    health_check_timeout_s: float = 20.0
    disconnect_poll_s: float = DISCONNECT_POLL_S
    update_wait_timeout_s: float = 600.0
    worker_urls: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"engine kind must be one of {KINDS}, found {self.kind!r}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, found {self.max_running}")
        if self.disconnect_poll_s <= 0:
            raise ValueError(f"disconnect_poll_s must be > 0, found {self.disconnect_poll_s}")
        if self.model_path is not None and self.kind != "tiny":
            raise ValueError("model_path only applies to the tiny engine")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to bind) is a loopback one (``""`` is all)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_engine_app(opts: EngineOptions) -> web.Application:
    if opts.kind == "router":
        return build_router_app(list(opts.worker_urls), api_key=opts.api_key)
    backend: Any
    if opts.kind == "tiny":
        from strawq.producers.engines.tiny_backend import TinyBackend  # torch only where needed

        backend = TinyBackend.from_path_or_config(
            opts.model_path, opts.tiny, max_running=opts.max_running, threads=opts.threads
        )
        model_path = opts.model_path or f"random-init:seed={opts.tiny.seed}"
    else:
        backend = SimBackend(opts.sim)
        model_path = "sim"
    core = EngineCore(
        backend,
        max_running=opts.max_running,
        weight_version=opts.weight_version,
        model_path=model_path,
        update_wait_timeout_s=opts.update_wait_timeout_s,
    )
    return build_app(
        core,
        served_model_name=opts.served_model_name or f"strawq-{opts.kind}",
        health_check_timeout_s=opts.health_check_timeout_s,
        disconnect_poll_s=opts.disconnect_poll_s,
        api_key=opts.api_key,
        admin_api_key=opts.admin_api_key,
    )


async def start_engine(
    opts: EngineOptions, *, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Start serving in the running event loop; returns the runner and the base URL.

    Stop it with ``await runner.cleanup()``.
    """
    if not is_loopback(host) and not opts.api_key:
        logger.warning("%s engine listening on %s, which is not a loopback address, with no "
                       "--api-key: anyone who can reach this port can generate, abort requests "
                       "and load weights (set --api-key, or bind 127.0.0.1)", opts.kind, host)
    app = build_engine_app(opts)
    # The router drops its upstream request when its client goes away, as sglang-router
    # does (its worker then aborts the request); an engine watches its clients itself.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                           handler_cancellation=opts.kind == "router")
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    url = f"http://{host}:{bound}"
    logger.info("%s engine listening on %s", opts.kind, url)
    return runner, url
