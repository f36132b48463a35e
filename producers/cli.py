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
import sys
from typing import Any

log = logging.getLogger(__name__)

DESCRIPTION = """\
Run one producer in this process, without Ray: it claims prompt and partial tasks from the
run at PATH, generates them on the SGLang-protocol engines given by --engine (or the router
given by --router), and persists ready and partial groups. Start one per node (e.g.
'srun --ntasks-per-node=1 strawq producer ...' under Slurm, or a systemd unit); the
collector's grantor expires the leases of one that dies.

SIGTERM or SIGINT drains it: every request in flight is aborted and its tokens kept, every
held group is completed or yielded as a partial, and it exits 0, all within the grace period
(--grace-period, timing.grace_period_s, 30 s by default; set Kubernetes'
terminationGracePeriodSeconds or Slurm's KillWait above it). A drain still running at the
end of the grace period exits 3 (what was handed back is kept; the other leases expire and
resume from their last saved partial). A second SIGINT exits 130 at once; a second SIGTERM
is ignored.

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


def _config(args: argparse.Namespace, group_size: int | None = None) -> Any:
    """The producer config from --config, --set and the flags; ``group_size`` (the run's G)
    derives the slots from --concurrency when they are not given."""
    from strawq.config import merge, parse_overrides, read_json_object
    from strawq.errors import ConfigError
    from strawq.producers.producer_config import ProducerConfig

    data: dict[str, Any] = {}
    if args.config:
        data = read_json_object(args.config, what="producer config")
    data = merge(data, parse_overrides(args.set, where="producer config"))
    flags = {"run_dir": args.path, "producer_id": args.producer_id,
             "engine": {"workers": tuple(args.engine) if args.engine else None,
                        "router_url": args.router,
                        "client": {"routing_policy": getattr(args, "routing_policy", None)}},
             "plugins": {"reward": args.reward}, "budget": {"slots": args.slots},
             "timing": {"grace_period_s": getattr(args, "grace_period", None)}}
    data = merge(data, _given(flags))
    plugins = data.get("plugins")
    if not (isinstance(plugins, dict) and plugins.get("reward")):
        raise ConfigError("producer config: no reward function; pass --reward "
                          "module.function (e.g. strawq.producers.rewards.math_answer)")
    budget = data.get("budget")
    if not (isinstance(budget, dict) and "slots" in budget):
        slots, how = derive_slots(args, data, group_size)
        data = merge(data, {"budget": {"slots": slots}})
        args.slots_chosen = how
    return ProducerConfig.from_dict(data, where="producer config")


def derive_slots(args: argparse.Namespace, data: dict[str, Any],
                 group_size: int | None) -> tuple[int, str]:
    """This producer's group slots when neither --slots nor ``budget.slots`` gives them:
    its share of K = floor(C*E/G) for C = --concurrency, E = the --engine URLs, G = the
    run's group size and W = --producers; a usage error naming the flags otherwise."""
    from strawq.argtypes import UsageError
    from strawq.errors import ConfigError
    from strawq.producers.budget import split_budget

    if args.concurrency is None:
        raise UsageError("how many groups this producer generates at once is not given: pass "
                         "--slots N, or --concurrency C (requests each engine runs at once) "
                         "to derive N = floor(C*E/G) from the --engine URLs and the run's "
                         "group size (or set budget.slots in --config)")
    engine = data.get("engine")
    workers = (engine.get("workers") if isinstance(engine, dict) else None) or ()
    if not workers or not isinstance(workers, (list, tuple)):
        raise UsageError("--concurrency derives the slots from the --engine URLs; with "
                         "--router (or no --engine) pass --slots N")
    if group_size is None:
        raise UsageError("--concurrency needs the run's group size; pass --slots N")
    try:
        budget = split_budget(args.concurrency, len(workers), group_size, args.producers)
    except ConfigError as exc:
        raise UsageError(f"--concurrency {args.concurrency}: {exc}") from exc
    slots = min(budget.slots)
    k = budget.total
    how = (f"{slots} group slots: K = floor(C*E/G) = floor({args.concurrency}*{len(workers)}"
           f"/{group_size}) = {k}" + (f", shared by {args.producers} producers"
                                      if args.producers > 1 else ""))
    return slots, how


def cmd_producer(args: argparse.Namespace) -> int:
    from strawq.errors import StrawqError
    from strawq.producers.drain import Drain
    from strawq.producers.producer import Producer

    if not os.path.isfile(os.path.join(args.path, "run.meta")):
        raise StrawqError(f"{args.path} holds no strawq run (no run.meta); create it with "
                          f"'strawq init {args.path}' or start the collector first")
    config = _config(args, group_size=_group_size(args.path))
    if not args.quiet:
        how = getattr(args, "slots_chosen", None) or (
            "--slots" if args.slots is not None else "budget.slots of the config")
        chosen = how if how[0].isdigit() else f"{config.budget.slots} group slots ({how})"
        print(f"strawq producer: {chosen}", file=sys.stderr)
    producer = Producer(config)
    exporter = None
    if args.prometheus_port is not None:
        from strawq.producers.metrics import serve_producer_metrics
        from strawq.views.status import run_label

        exporter = serve_producer_metrics(lambda: producer.stats().to_dict(),
                                          run=run_label(producer.queue.storage),
                                          producer=producer.producer_id,
                                          port=args.prometheus_port,
                                          host=args.prometheus_host)
        print(f"strawq producer: metrics on http://{args.prometheus_host}:{exporter.port}"
              "/metrics", file=sys.stderr)
    drain = Drain(producer.request_stop, config.timing.grace_period_s,
                  who=f"producer {producer.producer_id}")

    async def _run() -> None:
        task = asyncio.ensure_future(producer.run())
        if args.max_seconds is not None:
            done, _ = await asyncio.wait({task}, timeout=args.max_seconds)
            if not done:
                drain.begin("--max-seconds")
        await task

    try:
        with drain.signals():
            log.info("producer %s on %s (%d slots)", producer.producer_id, args.path,
                     config.budget.slots)
            try:
                asyncio.run(_run())
            finally:
                drain.finish()
    finally:
        if exporter is not None:
            exporter.close()
    stats = producer.stats().to_dict()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))
    elif not args.quiet:
        print(f"producer {producer.producer_id} stopped: "
              f"{stats.get('groups_completed', 0)} groups completed, "
              f"{stats.get('groups_yielded', 0)} yielded as partials")
    return 0


def _group_size(path: str) -> int:
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    return int(RunQueue.open(open_storage(path, writer_id="cli", read_only=True))
               .config.group_size)


def add_parsers(subparsers: Any) -> None:
    from strawq.argtypes import engine_url, listen_port, positive_float, positive_int
    from strawq.config import add_keys_help

    s = subparsers.add_parser(
        "producer", help="run one producer in this process, without Ray (Slurm, systemd)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="run directory (the same path on every node)")
    s.add_argument("--engine", action="append", metavar="URL", type=engine_url,
                   help="an engine URL (repeat for several; see --routing-policy)")
    s.add_argument("--router", metavar="URL", type=engine_url,
                   help="an sglang-router URL instead of --engine")
    s.add_argument("--routing-policy", choices=("round_robin", "cache_aware"), default=None,
                   help="without --router: how /generate picks an --engine (cache_aware: "
                   "every request of a task, its G samples, resumes and turns, to the engine "
                   "that holds its prefix; = engine.client.routing_policy, default "
                   "round_robin)")
    s.add_argument("--reward", metavar="DOTTED.PATH",
                   help="reward function, e.g. strawq.producers.rewards.math_answer")
    s.add_argument("--slots", type=positive_int, default=None,
                   help="group slots of this producer (its share of K = floor(C*E/G)); "
                   "or give --concurrency to derive them (one of the two is required, "
                   "unless budget.slots is in --config)")
    s.add_argument("--concurrency", type=positive_int, default=None, metavar="C",
                   help="requests each engine runs at once: the slots are derived as "
                   "floor(C*E/G) for the E --engine URLs and the run's G (printed at start)")
    s.add_argument("--producers", type=positive_int, default=1, metavar="W",
                   help="with --concurrency: producers sharing these engines (each gets "
                   "floor(K/W) slots; default 1)")
    s.add_argument("--producer-id", default=None, help="fixed producer id (default: a new "
                   "p-<host>-<random> per start)")
    s.add_argument("--config", help="JSON file of producer config keys (unknown refused)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one producer config key, e.g. --set "
                   "sampling.max_new_tokens=512 "
                   "(the keys are listed below)")
    s.add_argument("--max-seconds", type=float, default=None,
                   help="stop (handing back held groups) after this long")
    s.add_argument("--grace-period", type=positive_float, default=None, metavar="SECONDS",
                   help="SIGTERM/SIGINT: drain (abort the requests in flight keeping their "
                   "tokens, hand back every held group) within this long, else exit 3 "
                   "(= timing.grace_period_s, default 30; keep Kubernetes' "
                   "terminationGracePeriodSeconds or Slurm's KillWait above it)")
    s.add_argument("--json", action="store_true", help="print the final stats as JSON")
    s.add_argument("--prometheus-port", type=listen_port, default=None, metavar="PORT",
                   help="serve this producer's metrics for Prometheus on PORT (0: any free "
                   "port, printed at start), as the collector's prometheus_port and "
                   "sglang-router's --prometheus-port (docs/operations.md#metrics)")
    s.add_argument("--prometheus-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics endpoint listens on (default 127.0.0.1; "
                   "0.0.0.0 for a Prometheus on another host)")
    add_keys_help(s, "strawq.producers.producer_config:ProducerConfig")
    s.set_defaults(func=cmd_producer)
