"""``strawq upgrade RUN``: raise a run's on-disk format (``strawq.tasks.formats``).

The command parses its arguments and calls ``strawq.tasks.formats.upgrade``; nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from strawq.argtypes import positive_int
from strawq.errors import StrawqError

DESCRIPTION = """\
Raise the on-disk format of run RUN to FORMAT (default: the newest this strawq writes). Until
then every part writes the run's format, whatever its own release, so parts of the old and the
new release share the run safely. Upgrade every part first (collector and trainer, then the
producers one by one), then run this once: it refuses, naming them, while a live part reads
only older formats, and changes nothing then. A part older than the run's format refuses to
start on it. See docs/operations.md, "Upgrading a live run".

Exit status: 0 when the run is at FORMAT (raised now, or already); 1 when refused.
"""


def cmd_upgrade(args: argparse.Namespace) -> int:
    from strawq.storage import open_storage
    from strawq.tasks.formats import live_parts, newest, run_format, upgrade
    from strawq.tasks.queue import RunQueue

    if not os.path.isdir(args.path):
        raise StrawqError(f"{args.path} is not a run directory; expected the path of a run "
                          "made by 'strawq init'")
    queue = RunQueue.open(open_storage(args.path, writer_id="cli", read_only=args.dry_run))
    target = args.to if args.to is not None else newest()
    live = live_parts(queue.storage)
    current = run_format(queue.storage)
    payload: dict[str, Any] = {"from": current, "to": target, "live_parts": live,
                               "dry_run": args.dry_run}
    if args.dry_run:
        behind = sorted(p for p, f in live.items() if f < target)
        payload["behind"] = behind
        text = (f"the run is at format {current}; upgrading to {target} "
                + (f"would be refused: {', '.join(behind)} read only older formats"
                   if behind and target > current else "would go through"))
        rc = 1 if behind and target > current else 0
    else:
        old = upgrade(queue.storage, target, live)
        text = (f"the run is at format {target} already" if old >= target
                else f"the run's format raised from {old} to {target}")
        rc = 0
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, sort_keys=True))
    elif not getattr(args, "quiet", False):
        print(text)
    return rc


def add_parser(subparsers: Any) -> None:
    s = subparsers.add_parser("upgrade", help="raise a run's on-disk format once every part "
                              "reads it", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="run directory")
    s.add_argument("--to", type=positive_int, default=None, metavar="FORMAT",
                   help="the run format to raise to (default: the newest this strawq writes)")
    s.add_argument("--dry-run", action="store_true",
                   help="say whether the upgrade would go through; write nothing")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_upgrade)
