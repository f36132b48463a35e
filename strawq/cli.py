"""The ``strawq`` command line. It parses arguments and calls library code, nothing else."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strawq.errors import StrawqError

DESCRIPTION = """\
strawq: a durable rollout queue for RL post-training, on a shared filesystem.

A run lives in one directory (local disk, or a JuiceFS/NFS mount shared by every node).
Producers lease prompt and partial tasks from it, engines generate, ready groups are
persisted there, and one collector feeds the trainer staleness-first.
"""


def _queue(path: str) -> Any:
    from strawq.queue import RunQueue
    from strawq.storage import open_storage

    if not os.path.isdir(path):
        raise StrawqError(f"{path} is not a directory; create a run with 'strawq init {path}'")
    return RunQueue.open(open_storage(path, writer_id="cli"))


def cmd_init(args: argparse.Namespace) -> int:
    from strawq.config import QueueConfig, load_config
    from strawq.queue import RunQueue
    from strawq.storage import open_storage

    config = load_config(QueueConfig, args.config, args.set, where="queue config")
    os.makedirs(args.path, exist_ok=True)
    if args.declaration:
        from strawq.doctor import require_healthy

        require_healthy(args.path, args.declaration)
    q = RunQueue.create(open_storage(args.path, writer_id="cli"), config)
    print(f"run ready at {args.path}")
    print(json.dumps({"config": vars(q.config)}, indent=2))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from strawq.dataset import Dataset
    from strawq.feeder import Feeder

    q = _queue(args.path)
    feeder = Feeder(q, Dataset(args.dataset, prompt_key=q.config.prompt_key))
    n = feeder.release(args.count)
    print(f"released {n} rows; cursor at index {feeder.cursor.next_index}"
          + (" (dataset exhausted)" if feeder.exhausted else ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from strawq.status import run_status

    st = run_status(_queue(args.path))
    if args.json:
        print(json.dumps(st.to_dict(), indent=2, sort_keys=True))
        return 0
    print(f"run {args.path}  (weight version {st.current_version})")
    print("  tasks:   " + "  ".join(f"{k}={v}" for k, v in st.counts.items()))
    if st.leases_by_producer or st.heartbeats:
        print("  producers:")
        for p in sorted(set(st.leases_by_producer) | set(st.heartbeats)):
            print(f"    {p:<32} leases={st.leases_by_producer.get(p, 0):<5} "
                  f"heartbeat={st.heartbeats.get(p, '-')}")
    if st.dropped_by_reason:
        print("  dropped: " + "  ".join(f"{k}={v}" for k, v in st.dropped_by_reason.items()))
    if st.staleness:
        print("  staleness of ready groups: " + "  ".join(
            f"{k}={v:.2f}" for k, v in st.staleness.items()))
    if st.oldest:
        print("  oldest:  " + "  ".join(f"{k}={v}" for k, v in st.oldest.items()))
    print(f"  cursor:  {st.cursor or 'none'}   unacked batches: {st.batches_unacked}   "
          f"quarantined: {st.quarantined}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from strawq.inspect import describe_record

    q = _queue(args.path)
    print(json.dumps(describe_record(q, args.key, tokens=args.tokens), indent=2, default=str))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from strawq.batches import BatchStore

    q = _queue(args.path)
    rep = BatchStore(q).gc(full=args.full)
    tmp = sum(q.storage.clean_tmp(w) for w in args.tmp_of or [])
    print(f"gc: {rep.batches} batches, {rep.payloads} group payloads, {rep.stale} stale "
          f"payloads, {tmp} temporary files removed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strawq", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("init", help="create a run directory (layout + config)",
                       description="Create the run layout in PATH. Idempotent with the same "
                       "config; refuses to reopen a run with a different one.")
    s.add_argument("path", help="run directory (local path or a shared mount)")
    s.add_argument("--config", help="JSON file with queue config keys (unknown keys refused)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one config key, e.g. --set max_attempts=5")
    s.add_argument("--declaration", help="storage declaration to verify with the doctor "
                   "before creating the run (refuses a mount that fails)")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("release", help="release prompts from a dataset into the queue",
                       description="Advance the durable dataset cursor by COUNT rows. Safe to "
                       "re-run after a crash: no row is released twice.")
    s.add_argument("path")
    s.add_argument("dataset", help="JSONL or Parquet file (any fsspec URL)")
    s.add_argument("--count", type=int, default=None, help="rows (default: release_batch)")
    s.set_defaults(func=cmd_release)

    s = sub.add_parser("status", help="tasks per state, leases, producers, staleness",
                       description="Summarise a run: tasks per state, leases per producer, "
                       "heartbeat counters, dropped work by reason, staleness, oldest items.")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("inspect", help="show one record, readable",
                       description="Decode and verify one record (task, group, partial, "
                       "manifest, cursor, drop note). KEY is a path inside the run, e.g. "
                       "'ready/<name>' or 'data/<id>~g0.group', or a task id.")
    s.add_argument("path")
    s.add_argument("key")
    s.add_argument("--tokens", type=int, default=16, help="token ids to show per sample")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("gc", help="delete consumed batches and stale payloads",
                       description="Garbage-collect acked batches; --full also removes "
                       "payloads of generations older than each task's current one.")
    s.add_argument("path")
    s.add_argument("--full", action="store_true")
    s.add_argument("--tmp-of", action="append", metavar="WRITER",
                   help="also remove temporary files of WRITER (a producer id), which must be "
                   "known dead: a live writer's temporary file is in use")
    s.set_defaults(func=cmd_gc)

    for entry in SUBCOMMANDS:
        entry.register(sub)
    return p


@dataclass(frozen=True)
class Subcommand:
    """A command that lives outside the core CLI module (it may need an optional extra)."""

    name: str
    module: str
    add: str  # function in ``module`` that adds the parser(s) to a subparsers object
    help: str
    extra: str | None = None  # the pip extra that brings its dependencies
    nested: bool = False  # ``add`` takes the command's own subparsers (``strawq engine ...``)
    description: str | None = None

    def register(self, sub: Any) -> None:
        try:
            mod = importlib.import_module(self.module)
        except ImportError as exc:
            self._register_missing(sub, exc)
            return
        add = getattr(mod, self.add)
        if self.nested:
            p = sub.add_parser(self.name, help=self.help,
                               description=self.description or self.help)
            add(p.add_subparsers(dest=f"{self.name}_command", metavar="COMMAND"))
        else:
            add(sub)

    def _register_missing(self, sub: Any, exc: ImportError) -> None:
        hint = (f"pip install 'strawq[{self.extra}]'" if self.extra
                else "reinstall strawq")
        why = f"strawq {self.name} is unavailable: {exc} (install it with: {hint})"

        def unavailable(_args: argparse.Namespace) -> int:
            raise StrawqError(why)

        p = sub.add_parser(self.name, help=f"{self.help} [unavailable: {hint}]",
                           description=why)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=unavailable)


#: Every command that is not defined above, in the order ``--help`` lists them. A missing
#: optional dependency turns a command into one that says what to install, never into a
#: command that silently disappears.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("doctor", "strawq.doctor_cli", "add_doctor_parser",
               "verify a mount gives the guarantees the queue relies on"),
    Subcommand("engine", "strawq.producers.engines.cli", "add_engine_parser",
               "local SGLang-compatible engines (tiny, sim, router)", extra="engines",
               nested=True,
               description="Serve a local engine that speaks SGLang's native HTTP protocol: "
               "'tiny' is a real torch model on CPU, 'sim' a timing model for scale "
               "experiments, 'router' a minimal sglang-router."),
    Subcommand("collector", "strawq.collector.cli", "add_parsers",
               "run the global batch collector", extra="torch"),
    Subcommand("demo", "strawq.demo.cli", "add_parsers",
               "an end-to-end RL run on this machine (the main job)", extra="all"),
    Subcommand("lab", "strawq.demo.lab_cli", "add_lab_parser",
               "the rollout schedules compared at scale (sim engines)", extra="all"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc: int = args.func(args)
        return rc
    except StrawqError as exc:
        print(f"strawq {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
