"""The bodies of the ``strawq`` commands defined in the core CLI (``init``, ``release``,
``status``, ``inspect``, ``gc``, ``bracket``, ``forget-engine``): each takes the parsed
arguments, calls library code and prints its result (``emit``). Every library import is inside
the command that needs it, so loading this module for ``strawq --help`` costs nothing.
The arguments are built in ``strawq.app.parser``; errors are rendered by ``strawq.app.cli``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from strawq.argtypes import UsageError
from strawq.errors import StrawqError


def open_queue(path: str, *, read_only: bool = False) -> Any:
    """Open an existing run; ``read_only``: nothing in ``path`` is created or changed."""
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    if not os.path.isdir(path):
        what = "is a file, not" if os.path.exists(path) else "is not"
        raise StrawqError(f"{path} {what} a run directory; create a run with "
                          f"'strawq init {path}'")
    return RunQueue.open(open_storage(path, writer_id="cli", read_only=read_only))


def emit(args: argparse.Namespace, payload: dict[str, Any], text: str, *,
          report: bool = False) -> None:
    """Print ``payload`` as JSON with --json, else ``text``: a summary, which -q silences,
    or with ``report`` what the command was asked to show (printed with -q too)."""
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, sort_keys=True, default=str))
    elif text and (report or not getattr(args, "quiet", False)):
        print(text)


#: Names in a directory that ``init`` accepts besides a run's own (mount bookkeeping).
_IGNORABLE = ("lost+found",)


def _check_init_target(path: str) -> None:
    from strawq.tasks.queue import RUN_KEY

    if os.path.exists(path) and not os.path.isdir(path):
        raise StrawqError(f"{path} is a file; expected a new or empty directory for the run")
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, RUN_KEY)):
        return
    try:
        present = sorted(n for n in os.listdir(path)
                         if not n.startswith(".") and n not in _IGNORABLE)
    except OSError as exc:
        raise StrawqError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if present:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise StrawqError(f"{path} is not empty ({shown}) and holds no strawq run (no run.meta);"
                          " expected a new or empty directory: choose another path, e.g. "
                          f"{os.path.join(path, 'run')}")


def cmd_init(args: argparse.Namespace) -> int:
    from strawq.config import QueueConfig, load_config, redact, to_dict
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    config = load_config(QueueConfig, args.config, args.set, where="queue config")
    _check_init_target(args.path)
    try:
        from strawq.storage.posix import make_dirs

        make_dirs(args.path)  # no access for others (docs/security.md)
    except OSError as exc:
        raise StrawqError(f"cannot create the run directory {args.path}: "
                          f"{exc.strerror or exc}; choose a writable path") from exc
    if not os.access(args.path, os.W_OK | os.X_OK):
        raise StrawqError(f"{args.path} is not writable by this user; choose a writable path "
                          "or fix its permissions")
    if args.declaration:
        from strawq.doctor import require_healthy

        require_healthy(args.path, args.declaration)
    q = RunQueue.create(open_storage(args.path, writer_id="cli"), config)
    shown = redact(to_dict(q.config))  # no secret in a printed config (docs/security.md)
    payload = {"path": args.path, "config": shown}
    emit(args, payload, "" if args.quiet else
          f"run ready at {args.path}\n" + json.dumps({"config": shown}, indent=2))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from strawq.app.progress import Progress
    from strawq.data.binding import check_binding, require_rows
    from strawq.data.cursor import read_cursor_state
    from strawq.data.feeder import Feeder
    from strawq.data.mixture import open_dataset
    from strawq.data.release_check import BadRowsRefused
    from strawq.tasks.states import dropped_by_reason

    if args.dry_run and args.dataset_grew:
        raise UsageError("--dry-run previews a release from the dataset the cursor records; "
                         "--dataset-grew is for a release (without --dry-run)")
    q = open_queue(args.path)
    share = args.max_bad_row_share
    dataset = open_dataset(args.dataset, prompt_key=q.config.prompt_key)
    if args.dry_run:
        require_rows(dataset)
        return _release_dry_run(args, q, dataset)
    # an empty dataset, or another one, is refused before anything is written to the run
    grew = check_binding(dataset, read_cursor_state(q.storage), grew=args.dataset_grew)
    feeder = Feeder(q, dataset, check_dataset=not grew, max_bad_row_share=share)
    if grew:
        feeder.continue_grown()
    bad_before = dropped_by_reason(q.storage).get("bad_row", 0)
    progress = Progress("releasing", None if args.quiet else sys.stderr)
    feeder.on_progress = progress  # a long release says it is working (strawq.app.progress)
    try:
        rows = feeder.release(args.count)
    except BadRowsRefused as exc:
        progress.done()
        # nothing was released: the rows judged and the cursor, then exit 1 with the message
        emit(args, {"refused": str(exc), "rows": exc.rows, "released": 0,
                     "dropped_bad_rows": 0, "next_index": exc.next_index,
                     "bad_rows": [b.to_dict() for b in exc.bad]}, "")
        raise
    progress.done()
    bad = max(dropped_by_reason(q.storage).get("bad_row", 0) - bad_before, 0)
    payload = {"rows": rows, "released": rows - bad, "dropped_bad_rows": bad,
               "next_index": feeder.cursor.next_index, "exhausted": feeder.exhausted}
    text = (f"released {rows - bad} of {rows} rows ({bad} bad dropped: see "
            f"'strawq status {args.path}')" if bad else f"released {rows} rows")
    text += (f"; cursor at index {feeder.cursor.next_index}"
             + (" (dataset exhausted)" if feeder.exhausted else ""))
    emit(args, payload, text)
    return 0


def _release_dry_run(args: argparse.Namespace, q: Any, dataset: Any) -> int:
    from strawq.data.feeder import preview_release

    p = preview_release(q, dataset, args.count, max_bad_row_share=args.max_bad_row_share)
    payload = {"dry_run": True, "refused": p.refused, "next_index": p.start,
               "would_move_to": p.end, "would_release": p.good, "would_drop": len(p.bad),
               "bad_rows": [b.to_dict() for b in p.bad],
               "prompt_kinds": p.kinds, "exhausted": p.exhausted}
    emit(args, payload, p.describe(), report=True)
    return 0 if p.refused is None else 1


def cmd_status(args: argparse.Namespace) -> int:
    from strawq.views.glance import Watcher, default_sample_s, glance
    from strawq.views.glance_text import find_runs, list_runs, render, watch

    if os.path.isdir(args.path) and not os.path.exists(os.path.join(args.path, "run.meta")):
        runs = find_runs(args.path)
        if runs:
            payload, text = list_runs(args.path, runs)
            emit(args, payload, text, report=True)
            return 0
    q = open_queue(args.path, read_only=True)
    watcher = Watcher(q.storage)
    sample = default_sample_s(q) if args.sample is None else args.sample

    def look() -> Any:
        return glance(q, args.path, watcher, sample_s=sample)

    def show(g: Any) -> None:
        if args.json:
            print(json.dumps(g.to_dict(), indent=None if args.watch else 2, sort_keys=True,
                             default=str), flush=True)
            return
        if args.watch and sys.stdout.isatty():
            print("\033[H\033[2J", end="")
        print(render(g), flush=True)

    if args.watch is None:
        show(look())
        return 0
    watch(look, show, args.watch)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from strawq.views.inspect import describe_record

    q = open_queue(args.path, read_only=True)
    out = describe_record(q, args.key, tokens=args.tokens)
    print(json.dumps(out, indent=2, default=str))
    if "error" in out:
        print(f"strawq inspect: error: {out['key']} fails its checks: {out['error']}",
              file=sys.stderr)
        return 1
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from strawq.delivery.batches import BatchStore
    from strawq.delivery.retention import sweep_staging

    q = open_queue(args.path)
    rep = BatchStore(q).gc(full=args.full, sweep=True, compact_drops_at=0,
                           keep_drops_days=0 if args.expire else None)
    tmp = sum(q.storage.clean_tmp(w) for w in args.tmp_of or [])
    tmp += q.storage.clean_dead_tmp(grace_s=args.tmp_grace)
    staged = sweep_staging(q.storage, grace_s=args.tmp_grace)
    payload = {"batches": rep.batches, "group_payloads": rep.payloads,
               "stale_records": rep.stale, "turn_checkpoints": rep.turns,
               "journal_records": rep.journal,
               "drops_compacted": rep.drops, "drops_expired": rep.expired, "tmp": tmp,
               "staging": staged}
    emit(args, payload, "" if args.quiet else
          f"gc: {rep.batches} batches, {rep.payloads} group payloads, {rep.stale} stale or "
          f"orphaned records, {rep.turns} turn checkpoints, {rep.journal} journal records, "
          f"{rep.drops} drops compacted into "
          f"the audit (still requeueable), {rep.expired} expired drops, {tmp} temporary "
          f"files and {staged} abandoned release records removed")
    return 0


def cmd_bracket(args: argparse.Namespace) -> int:
    from strawq.app.bracket_cli import run_bracket

    return run_bracket(args, open_queue, emit)


def cmd_forget_engine(args: argparse.Namespace) -> int:
    from strawq.weights.engine_weights import EngineWeights

    q = open_queue(args.path)
    weights = EngineWeights(q.storage)
    url = args.url.rstrip("/")
    known = weights.known()
    if url not in known:
        raise StrawqError(f"no note says {url} needs weights and no producer registered it "
                          f"at {args.path} (known: {', '.join(known) or 'none'})")
    gone = weights.forget(url)
    emit(args, {"url": url, "notes_deleted": gone},
          f"forgot {url}: {gone} note(s) deleted; the trainer no longer pushes to it (a "
          "producer that still lists it and finds it behind notes it again)")
    return 0
