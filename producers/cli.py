"""``strawq producer``: one producer in this process, without Ray.

For clusters that place processes themselves (a Slurm step per node, a systemd unit): the
same ``Producer`` the Ray actor wraps, built from a ``ProducerConfig`` and run on this
process's event loop until SIGTERM/SIGINT (it then hands back every group it holds) or
``--max-seconds``. The CLI parses and calls library code; nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)

DESCRIPTION = """\
Run one producer in this process, without Ray: it claims prompt and partial tasks from the
run at PATH, generates them on the SGLang-protocol engines given by --engine (or the router
given by --router), and persists ready and partial groups. Start one per node (e.g.
'srun --ntasks-per-node=1 strawq producer ...' under Slurm, or a systemd unit); the
collector's grantor expires the leases of one that dies.

SIGTERM or SIGINT stops it cleanly: every held group is completed or yielded as a partial.

The producer config keys (--set KEY=VALUE, or --config FILE) are listed below; see
docs/producers.md.
"""


def _given(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags that were given (not None), sections kept only where one key was given."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, dict):
            value = _given(value) or None
        if value is not None:
            out[key] = value
    return out


def _config(args: argparse.Namespace) -> Any:
    from strawq.config import merge, parse_overrides
    from strawq.errors import ConfigError

    from strawq.producers.producer_config import ProducerConfig

    data: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"producer config: cannot read {args.config}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"producer config: {args.config} must hold a JSON object")
    data = merge(data, parse_overrides(args.set, where="producer config"))
    flags = {"run_dir": args.path, "producer_id": args.producer_id,
             "engine": {"workers": tuple(args.engine) if args.engine else None,
                        "router_url": args.router},
             "plugins": {"reward": args.reward}, "budget": {"slots": args.slots}}
    data = merge(data, _given(flags))
    plugins = data.get("plugins")
    if not (isinstance(plugins, dict) and plugins.get("reward")):
        raise ConfigError("producer config: no reward function; pass --reward "
                          "module.function (e.g. strawq.producers.rewards.math_answer)")
    return ProducerConfig.from_dict(data, where="producer config")


def cmd_producer(args: argparse.Namespace) -> int:
    from strawq.errors import StrawqError

    from strawq.producers.producer import Producer

    config = _config(args)
    if not os.path.isfile(os.path.join(args.path, "run.meta")):
        raise StrawqError(f"{args.path} holds no strawq run (no run.meta); create it with "
                          f"'strawq init {args.path}' or start the collector first")
    producer = Producer(config)
    stopped = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: handing back held groups and stopping", signum)
        stopped.set()
        producer.request_stop()

    async def _run() -> None:
        task = asyncio.ensure_future(producer.run())
        if args.max_seconds is not None:
            done, _ = await asyncio.wait({task}, timeout=args.max_seconds)
            if not done:
                producer.request_stop()
        await task

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        log.info("producer %s on %s (%d slots)", producer.producer_id, args.path,
                 config.budget.slots)
        asyncio.run(_run())
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    stats = producer.stats().to_dict()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))
    elif not args.quiet:
        print(f"producer {producer.producer_id} stopped: "
              f"{stats.get('groups_completed', 0)} groups completed, "
              f"{stats.get('groups_yielded', 0)} yielded as partials")
    return 0


def add_parsers(subparsers: Any) -> None:
    from strawq.argtypes import positive_int
    from strawq.config import add_keys_help

    s = subparsers.add_parser(
        "producer", help="run one producer in this process, without Ray (Slurm, systemd)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="run directory (the same path on every node)")
    s.add_argument("--engine", action="append", metavar="URL",
                   help="an engine URL (repeat for several; /generate goes round-robin)")
    s.add_argument("--router", metavar="URL", help="an sglang-router URL instead of --engine")
    s.add_argument("--reward", metavar="DOTTED.PATH",
                   help="reward function, e.g. strawq.producers.rewards.math_answer")
    s.add_argument("--slots", type=positive_int, default=None,
                   help="group slots of this producer (its share of K = floor(C*E/G))")
    s.add_argument("--producer-id", default=None, help="fixed producer id (default: a new "
                   "p-<host>-<random> per start)")
    s.add_argument("--config", help="JSON file of producer config keys (unknown refused)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one producer config key, e.g. --set "
                   "sampling.max_new_tokens=512 "
                   "(the keys are listed below)")
    s.add_argument("--max-seconds", type=float, default=None,
                   help="stop (handing back held groups) after this long")
    s.add_argument("--json", action="store_true", help="print the final stats as JSON")
    add_keys_help(s, "strawq.producers.producer_config:ProducerConfig")
    s.set_defaults(func=cmd_producer)
