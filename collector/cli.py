"""``strawq collector``: run the global batch collector loop against a run directory.

The CLI parses arguments and calls ``strawq.collector.core.Collector``; nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from typing import Any

log = logging.getLogger(__name__)

DESCRIPTION = """\
Run the run's one global batch collector: the lease grantor (expires silent producers'
leases), the feeder (releases prompts from DATASET under admission control), and the batch
builder (staleness-first batches of B ready groups, published as manifests the trainer's
BatchReader reads).

Exactly one collector runs per run. A second one refuses while the first one's heartbeat
moves; after takeover_timeout_s of silence it takes over with a higher epoch, and the old
one can no longer act (FencedOut). Stops when the dataset is exhausted and every batch is
acked (or after --max-steps, or on SIGTERM/SIGINT, closing cleanly so a successor starts
at once).

Resume: with the queue intact everything on disk survives. If the run directory holds no
readable queue, --checkpoint (the trainer's BatchReader.state_dict() as JSON) supplies the
dataset cursor, weight version and batch number; without it the run starts at row 0.

Collector config keys (--set KEY=VALUE, or --config FILE): batch_groups, max_staleness
(null = unbounded), eta_mode (drop|requeue|off), batches_per_version, max_running,
max_ready, max_prefetch_batches, flush_at_end, advantages (grpo|grpo_mean_only|none),
advantage_eps, poll_interval_s, gc_interval_s, takeover_timeout_s, metrics_interval_s,
metrics_jsonl, prometheus_port. See docs/collector.md.
"""


def _load_config(args: argparse.Namespace) -> Any:
    from strawq.collector.config import CollectorConfig
    from strawq.config import load_config

    return load_config(CollectorConfig, args.config, args.set, where="collector config")


def cmd_collector(args: argparse.Namespace) -> int:
    from strawq.collector.core import Collector
    from strawq.config import QueueConfig, from_dict
    from strawq.dataset import Dataset

    config = _load_config(args)
    queue_config = None
    if args.queue_config:
        with open(args.queue_config, encoding="utf-8") as f:
            queue_config = from_dict(QueueConfig, json.load(f), where="queue config")
    checkpoint = None
    if args.checkpoint:
        with open(args.checkpoint, encoding="utf-8") as f:
            checkpoint = json.load(f)
    if queue_config is not None:
        prompt_key = queue_config.prompt_key
    else:  # an existing run knows its own prompt key
        from strawq.errors import NotFound
        from strawq.queue import RunQueue
        from strawq.storage import open_storage

        try:
            prompt_key = RunQueue.open(open_storage(args.path, writer_id="cli")).config.prompt_key
        except NotFound:
            prompt_key = QueueConfig().prompt_key
    col = Collector.open(args.path, Dataset(args.dataset, prompt_key=prompt_key), config,
                         queue_config=queue_config, checkpoint=checkpoint,
                         wait=not args.no_wait, fsync=not args.no_fsync, owner=args.owner)
    stop = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after this pass", signum)
        stop["flag"] = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        info = col.resume_info
        log.info("collector epoch %d on %s (%s)", col.fence.epoch, args.path,
                 info.message if info else "")
        rep = col.run(max_steps=args.max_steps, until_drained=not args.forever,
                      should_stop=lambda: stop["flag"])
        d = rep.depths
        log.info("collector stopped: version %d pending=%d partial=%d leased=%d ready=%d "
                 "batched=%d", rep.version, d.pending, d.partial, d.leased, d.ready, d.batched)
    finally:
        col.close()
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def add_parsers(subparsers: Any) -> None:
    s = subparsers.add_parser(
        "collector", help="run the global batch collector (grantor, feeder, batches)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="run directory (created if missing)")
    s.add_argument("dataset", help="JSONL or Parquet prompt dataset (any fsspec URL)")
    s.add_argument("--config", help="JSON file of collector config keys (unknown refused)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one collector config key, e.g. --set batch_groups=128")
    s.add_argument("--queue-config", help="JSON file of queue config keys, used only when "
                   "the run has to be created")
    s.add_argument("--checkpoint", help="trainer state JSON (BatchReader.state_dict()) for "
                   "resuming when the queue state is missing")
    s.add_argument("--no-wait", action="store_true", help="refuse at once if another "
                   "collector holds the run, instead of watching its heartbeat")
    s.add_argument("--max-steps", type=int, default=None, help="stop after N passes")
    s.add_argument("--forever", action="store_true", help="keep running after the dataset "
                   "is exhausted and drained")
    s.add_argument("--owner", default="collector", help="name recorded in the epoch record")
    s.add_argument("--no-fsync", action="store_true", help="skip fsyncs (throwaway runs)")
    s.set_defaults(func=cmd_collector)
