"""Command line of the local engines: ``python -m strawq.producers.engines serve --kind tiny ...``.

``add_engine_parser(subparsers)`` adds the ``serve`` and ``init-tiny`` commands to any
argparse subparsers object (``strawq engine serve ...``); ``main(argv)`` runs standalone.
When serving, one line ``STRAWQ_ENGINE_READY <url>`` is printed on stdout once the port
is bound (``--port 0`` picks a free port), so a parent process can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from strawq.argtypes import listen_port
from strawq.producers.engines.launch import KINDS, EngineOptions, start_engine
from strawq.producers.engines.server import DISCONNECT_POLL_S
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.tiny_config import TinyConfig

logger = logging.getLogger(__name__)

READY_PREFIX = "STRAWQ_ENGINE_READY"


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kind",
        choices=KINDS,
        required=True,
        help="tiny: torch model; sim: timing model; router: mini router",
    )
    p.add_argument(
        "--host", default="127.0.0.1",
        help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 = every "
        "interface: set --api-key then)")
    p.add_argument(
        "--port", type=listen_port, default=30000,
        help="0-65535; 0 picks a free port (printed on the ready line)"
    )
    p.add_argument(
        "--max-running-requests", type=int, default=None, help="slot limit (tiny 32, sim 256)"
    )
    p.add_argument("--weight-version", default="0", help="initial weight version (integer string)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--health-check-timeout", type=float, default=20.0)
    p.add_argument(
        "--disconnect-poll-s", type=float, default=DISCONNECT_POLL_S,
        help="check a waiting request's client this often and abort the requests of a "
        "client that is gone (SGLang: 4 s, SGLANG_REQUEST_STATE_WAIT_TIMEOUT)")
    p.add_argument("--api-key", default=None, help="as SGLang --api-key (bearer token)")
    p.add_argument(
        "--admin-api-key", default=None, help="as SGLang --admin-api-key (control endpoints)"
    )
    t = p.add_argument_group("tiny")
    t.add_argument(
        "--model-path",
        default=None,
        help="directory from save_weights / init-tiny; default: random init",
    )
    t.add_argument("--vocab-size", type=int, default=None)
    t.add_argument("--hidden-size", type=int, default=None)
    t.add_argument("--num-layers", type=int, default=None)
    t.add_argument("--num-heads", type=int, default=None)
    t.add_argument("--context-length", type=int, default=None)
    t.add_argument("--seed", type=int, default=None, help="random-init seed")
    t.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)"
    )
    s = p.add_argument_group("sim")
    s.add_argument("--step-base-ms", type=float, default=None)
    s.add_argument("--step-per-req-ms", type=float, default=None)
    s.add_argument("--prefill-ms-per-token", type=float, default=None)
    s.add_argument("--len-median", type=float, default=None)
    s.add_argument("--len-sigma", type=float, default=None)
    s.add_argument("--len-cap", type=int, default=None)
    s.add_argument("--cap-prob", type=float, default=None)
    s.add_argument("--prompt-scale-sigma", type=float, default=None,
                   help="per-prompt length scale, lognormal of mean 1 (default 0: off)")
    s.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="multiply every simulated duration (0.1 = 10x faster)",
    )
    r = p.add_argument_group("router")
    r.add_argument("--worker-urls", default="", help="comma-separated worker URLs")


def _pick(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    tiny = TinyConfig(
        **_pick(
            args, ("vocab_size", "hidden_size", "num_layers", "num_heads", "context_length", "seed")
        )
    )
    sim_keys = (
        "step_base_ms",
        "step_per_req_ms",
        "prefill_ms_per_token",
        "len_median",
        "len_sigma",
        "len_cap",
        "cap_prob",
        "time_scale",
        "prompt_scale_sigma",
    )
    sim_kwargs = _pick(args, sim_keys)
    sim_kwargs.update(_pick(args, ("vocab_size", "context_length")) if args.kind == "sim" else {})
    default_running = 256 if args.kind == "sim" else 32
    return EngineOptions(
        kind=args.kind,
        max_running=args.max_running_requests or default_running,
        weight_version=str(args.weight_version),
        model_path=args.model_path,
        tiny=tiny,
        sim=SimConfig(**sim_kwargs),
        threads=args.threads or None,
        served_model_name=args.served_model_name,
        health_check_timeout_s=args.health_check_timeout,
        disconnect_poll_s=args.disconnect_poll_s,
        worker_urls=tuple(u for u in args.worker_urls.split(",") if u),
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
    )


async def _serve(opts: EngineOptions, host: str, port: int) -> None:
    runner, url = await start_engine(opts, host=host, port=port)
    print(f"{READY_PREFIX} {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        opts = options_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        from strawq.errors import os_error_text

        why = os_error_text(exc, "read") if isinstance(exc, OSError) else str(exc)
        print(f"error: {why}", file=sys.stderr)
        return 2
    asyncio.run(_serve(opts, args.host, args.port))
    return 0


def cmd_init_tiny(args: argparse.Namespace) -> int:
    from strawq.producers.engines.tiny_model import init_model, save_weights

    cfg = TinyConfig(
        **_pick(
            args, ("vocab_size", "hidden_size", "num_layers", "num_heads", "context_length", "seed")
        )
    )
    path = save_weights(init_model(cfg), args.out)
    print(path)
    return 0


def add_engine_parser(subparsers: Any) -> None:
    """Add ``serve`` and ``init-tiny`` to an argparse ``subparsers`` object."""
    serve = subparsers.add_parser("serve", help="serve a local SGLang-compatible engine")
    _add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    init = subparsers.add_parser(
        "init-tiny", help="write a randomly initialised tiny model directory"
    )
    init.add_argument("--out", required=True)
    for name in ("vocab-size", "hidden-size", "num-layers", "num-heads", "context-length", "seed"):
        init.add_argument(f"--{name}", type=int, default=None)
    init.set_defaults(func=cmd_init_tiny)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m strawq.producers.engines", description=__doc__.splitlines()[0]
    )
    add_engine_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
