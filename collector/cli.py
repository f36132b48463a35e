"""``strawq collector``: run the global batch collector loop against a run directory.

The CLI parses arguments and calls ``strawq.collector.core.Collector``; nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
from typing import Any

from strawq.argtypes import positive_int
from strawq.config import add_keys_help

log = logging.getLogger(__name__)

DESCRIPTION = """\
Run the run's one global batch collector: the lease grantor (expires silent producers'
leases), the feeder (releases prompts from DATASET under admission control), and the batch
builder (staleness-first batches of B ready groups, published as manifests the trainer's
BatchReader reads).

PATH must be a strawq run ('strawq init PATH --config queue.json' creates one). A path that
holds no run (a typo'd path, a new or empty directory) is refused with exit status 1 and
nothing created, unless --create says to create the run there (with --queue-config, or the
default queue config); a directory holding other files is refused even then, never turned
into a run.

Exactly one collector runs per run. A second one refuses while the first one's heartbeat
moves; after takeover_timeout_s of silence it takes over with a higher epoch, and the old
one can no longer act (FencedOut). Stops when the dataset is exhausted and every batch is
acked, collecting the acked batches before it exits (or after --max-steps published
batches, --max-passes loop passes, or on SIGTERM/SIGINT, closing cleanly so a successor
starts at once).

A release that would drop more than the run's max_bad_row_share of its rows as bad (rows
without the run's prompt_key, say) stops the collector with exit status 1 and a message
naming the cause; nothing is released and the dataset cursor does not move.

A DATASET without rows (an empty file, a Parquet file of 0 rows, a shard set of such files,
a mixture with such a source), or one the run's cursor does not count over, is refused with
exit status 1 before anything is written: no run is created. A dataset that grew (rows
appended) is continued with --dataset-grew (docs/datasets.md).

Resume: with the queue intact everything on disk survives. If the run directory holds no
readable queue, --checkpoint (the trainer's BatchReader.state_dict() as JSON) supplies the
dataset cursor, weight version and batch number; without it the run starts at row 0. A run
whose run.meta is unreadable has lost its queue config with it: pass --queue-config too
(the unreadable directory is moved aside to PATH.unreadable-<time>).

The collector config keys (--set KEY=VALUE, or --config FILE) are listed below; see
docs/collector.md.
"""


def _load_config(args: argparse.Namespace) -> Any:
    from strawq.collector.config import CollectorConfig
    from strawq.config import load_config

    return load_config(CollectorConfig, args.config, args.set, where="collector config")


#: Names whose presence makes a directory a (possibly damaged) strawq run.
_RUN_MARKERS = ("run.meta", "pending", "leased", "ready", "batched", "cursor", "data")


def _check_target(path: str, *, create: bool = False) -> None:
    """A run; with ``create`` also a new path or an empty directory: anything else is
    refused untouched (nothing is created)."""
    from strawq.errors import StrawqError

    if os.path.exists(path) and not os.path.isdir(path):
        raise StrawqError(f"{path} is a file; expected a run directory (or a new path)")
    names = [n for n in os.listdir(path) if not n.startswith(".") and n != "lost+found"] \
        if os.path.isdir(path) else []
    if names and not any(m in names for m in _RUN_MARKERS):
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise StrawqError(f"{path} holds files ({shown}) but no strawq run; refusing to turn "
                          "it into one: pass a new or empty directory, or the run's own path")
    if not names and not create:
        what = "an empty directory" if os.path.isdir(path) else "does not exist"
        raise StrawqError(
            f"{path} holds no strawq run ({what}); nothing was created. Check the path, or "
            f"create the run first: 'strawq init {path} --config queue.json' (or pass "
            "--create to create it here with --queue-config)")


def _prompt_key(args: argparse.Namespace, queue_config: Any) -> str:
    """The run's prompt key: an existing run's wins (--queue-config is used only to create a
    run, and one naming another prompt_key is an error); a run whose run.meta is unreadable
    needs --queue-config."""
    from strawq.config import QueueConfig
    from strawq.errors import ConfigError, CorruptRecord, NotFound, StrawqError
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    fallback = str(queue_config.prompt_key) if queue_config is not None else \
        QueueConfig().prompt_key
    if not os.path.isdir(args.path):
        return fallback
    try:
        run_key = RunQueue.open(open_storage(args.path, writer_id="cli")).config.prompt_key
    except NotFound:
        return fallback
    except (CorruptRecord, StrawqError) as exc:
        if queue_config is not None:
            return fallback
        raise StrawqError(
            f"{args.path}/run.meta is unreadable ({exc}); the run's queue config is lost with "
            "it. To resume, pass --queue-config FILE (a JSON object of the queue config the "
            "run was created with, e.g. from 'strawq status' output saved earlier or your "
            "launch script) together with --checkpoint FILE (the trainer's "
            "BatchReader.state_dict()): the damaged directory is moved aside to "
            f"{args.path.rstrip('/')}.unreadable-<time> and releases resume at the "
            "checkpoint's dataset cursor") from exc
    named = _read_json(args.queue_config, "queue config").get("prompt_key") \
        if queue_config is not None else None
    if named is not None and named != run_key:
        raise ConfigError(f"--queue-config names prompt_key {named!r} but the run at {args.path} "
                          f"was created with prompt_key {run_key!r}; the run's key wins (the "
                          "queue config is used only to create a run): remove prompt_key from "
                          f"the file or set it to {run_key!r}")
    return run_key


def _read_json(path: str, what: str) -> Any:
    from strawq.config import read_json_file

    return read_json_file(path, what=what)


def cmd_collector(args: argparse.Namespace) -> int:
    from strawq.collector.core import Collector
    from strawq.config import QueueConfig, from_dict
    from strawq.data.mixture import open_dataset

    config = _load_config(args)
    queue_config = None
    if args.queue_config:
        queue_config = from_dict(QueueConfig, _read_json(args.queue_config, "queue config"),
                                 where="queue config")
    checkpoint = _read_json(args.checkpoint, "checkpoint") if args.checkpoint else None
    _check_target(args.path, create=args.create)
    prompt_key = _prompt_key(args, queue_config)
    col = Collector.open(args.path, open_dataset(args.dataset, prompt_key=prompt_key), config,
                         queue_config=queue_config, checkpoint=checkpoint,
                         wait=not args.no_wait, fsync=not args.no_fsync, owner=args.owner,
                         dataset_grew=args.dataset_grew)
    stop = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after this pass", signum)
        stop["flag"] = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        info = col.resume_info
        log.info("collector epoch %d on %s (%s)", col.fence.epoch, args.path,
                 info.message if info else "")
        rep = col.run(max_steps=args.max_passes, max_batches=args.max_steps,
                      until_drained=not args.forever, should_stop=lambda: stop["flag"])
        d = rep.depths
        log.info("collector stopped: version %d pending=%d partial=%d leased=%d ready=%d "
                 "batched=%d", rep.version, d.pending, d.partial, d.leased, d.ready, d.batched)
        if getattr(args, "json", False):
            print(json.dumps({"version": rep.version, "epoch": col.fence.epoch,
                              "drained": rep.drained, "exhausted": rep.exhausted,
                              "depths": dataclasses.asdict(d)}, indent=2, sort_keys=True))
    finally:
        col.close()
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def add_parsers(subparsers: Any) -> None:
    s = subparsers.add_parser(
        "collector", help="run the global batch collector (grantor, feeder, batches)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="run directory (made by 'strawq init'; see --create)")
    s.add_argument("dataset", help="JSONL or Parquet prompt dataset (any fsspec URL), or a "
                   "mixture of several: a *.mixture.json file (docs/datasets.md, Mixtures)")
    s.add_argument("--config", help="JSON file of collector config keys (unknown refused)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one collector config key, e.g. --set batch_groups=128 "
                   "(the keys are listed below)")
    s.add_argument("--queue-config", help="JSON file of queue config keys, used only when "
                   "the run has to be created (--create) or its run.meta is unreadable")
    s.add_argument("--create", action="store_true", help="create the run when PATH holds "
                   "none (a new path or an empty directory); without it such a PATH is "
                   "refused: 'strawq init' is the usual way to create a run")
    s.add_argument("--checkpoint", help="trainer state JSON (BatchReader.state_dict()) for "
                   "resuming when the queue state is missing")
    s.add_argument("--no-wait", action="store_true", help="refuse at once if another "
                   "collector holds the run, instead of watching its heartbeat")
    s.add_argument("--max-steps", type=positive_int, default=None, metavar="N",
                   help="stop after publishing N batches (trainer steps)")
    s.add_argument("--max-passes", type=positive_int, default=None, metavar="N",
                   help="stop after N loop passes (each polls the queue once; for tests)")
    s.add_argument("--forever", action="store_true", help="keep running after the dataset "
                   "is exhausted and drained")
    s.add_argument("--dataset-grew", action="store_true",
                   help="DATASET is the run's dataset with rows appended (new shards after "
                   "the run's, or rows added to its last one): continue the cursor over it, "
                   "task ids continuing, and record it as the run's. Refused when its files' "
                   "names and sizes say it did not only grow (docs/datasets.md)")
    s.add_argument("--owner", default="collector", help="name recorded in the epoch record")
    s.add_argument("--no-fsync", action="store_true", help="skip fsyncs (throwaway runs)")
    s.add_argument("--json", action="store_true", help="print the final state as JSON")
    add_keys_help(s, "strawq.collector.config:CollectorConfig")
    s.set_defaults(func=cmd_collector)
