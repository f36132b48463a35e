"""``strawq requeue RUN --reason R``: put the tasks dropped with one reason back into the queue.

The command parses its arguments and calls ``strawq.delivery.requeue.requeue_dropped``;
nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from strawq.argtypes import positive_int
from strawq.errors import StrawqError

DESCRIPTION = """\
Put the tasks dropped with reason REASON back into the queue, as fresh generations (gen + 1,
no attempt spent, no prefix), for any producer to claim. Use it once the cause is fixed: a
misconfigured producer's drops, an engine outage that spent the attempts of its tasks
(engine_error.max_attempts), a filter since changed. 'strawq status RUN' lists the reasons.

Safe beside a live collector and producers: each task moves by one atomic rename, so it is in
exactly one state and is trained at most once. The drop's note is kept and a requeue note
records the move. Drops already folded into the drop audit (strawq gc, or the collector once
dropped/ holds 1000 entries) are requeued too while their task records are kept (7 days,
until 'strawq gc --expire'); after that they are gone. bad_row drops (rows that failed
validation at release) have no task to run: fix the rows and release them again.

Exit status: 0 when tasks were requeued (or, with --dry-run, would be); 1 when no dropped task
has the reason, or the reason cannot be requeued.
"""


def cmd_requeue(args: argparse.Namespace) -> int:
    from strawq.delivery.requeue import requeue_dropped
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue
    from strawq.tasks.states import dropped_by_reason

    if not os.path.isdir(args.path):
        raise StrawqError(f"{args.path} is not a run directory; expected the path of a run "
                          "made by 'strawq init'")
    queue = RunQueue.open(open_storage(args.path, writer_id="cli", read_only=args.dry_run))
    rep = requeue_dropped(queue, args.reason, dry_run=args.dry_run, limit=args.limit)
    payload: dict[str, Any] = {"reason": rep.reason, "dry_run": rep.dry_run,
                               "requeued": len(rep.requeued), "task_ids": rep.requeued,
                               "skipped": rep.skipped, "compacted": rep.compacted,
                               "from_audit": rep.from_audit,
                               "audit_corrected": rep.corrected}
    if not rep.requeued:
        present = dropped_by_reason(queue.storage)
        if getattr(args, "json", False):
            print(json.dumps(payload, indent=2, sort_keys=True))
        raise StrawqError(
            f"no dropped task in {args.path} has reason {args.reason!r}"
            + (f" ({rep.compacted} were folded into the drop audit and expired: they cannot be "
               "requeued)"
               if rep.compacted else "")
            + "; reasons in dropped/: "
            + (", ".join(f"{k}={v}" for k, v in sorted(present.items())) or "none"))
    verb = "would requeue" if rep.dry_run else "requeued"
    text = (f"{verb} {len(rep.requeued)} tasks dropped with reason {rep.reason}"
            + (f" ({len(rep.skipped)} taken by another mover first)" if rep.skipped else "")
            + (f" ({len(rep.from_audit)} of them from the drop audit)" if rep.from_audit
               else "")
            + (f"; {rep.compacted} more were folded into the drop audit and expired: they "
               "cannot be requeued" if rep.compacted else ""))
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, sort_keys=True))
    elif not getattr(args, "quiet", False):
        print(text)
    return 0


def add_parser(subparsers: Any) -> None:
    s = subparsers.add_parser("requeue", help="put the tasks dropped with one reason back into "
                              "the queue", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="run directory")
    s.add_argument("--reason", required=True,
                   help="the drop reason, as 'strawq status' lists it (e.g. bad_task)")
    s.add_argument("--dry-run", action="store_true",
                   help="list the tasks that would be requeued; write nothing")
    s.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="requeue at most N tasks (in listing order)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_requeue)
