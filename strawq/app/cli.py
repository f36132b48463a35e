"""The ``strawq`` command line. It parses arguments and calls library code, nothing else."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strawq.argtypes import UsageError, non_negative_float, positive_float, positive_int
from strawq.config import add_keys_help
from strawq.errors import StrawqError, os_error_text

DESCRIPTION = """\
strawq: a durable rollout queue for RL post-training, on a shared filesystem.

A run lives in one directory (local disk, or a JuiceFS/NFS mount shared by every node).
Producers lease prompt and partial tasks from it, engines generate, ready groups are
persisted there, and one collector feeds the trainer staleness-first.
"""


EPILOG = """\
Options -q/--quiet, -v/--verbose and --json work before or after the command; --json is
taken by the commands that print state.

Exit status: 0 success; 1 an error (the message says what was expected, what was found and
what to do next); 2 a usage error (unknown option, bad value); 130 interrupted. A closed
output pipe (e.g. '| head') ends a command quietly with 0.

Troubleshooting: docs/troubleshooting.md (symptom -> cause -> command).
"""

log = logging.getLogger("strawq.app.cli")


def _queue(path: str, *, read_only: bool = False) -> Any:
    """Open an existing run; ``read_only``: nothing in ``path`` is created or changed."""
    from strawq.queue import RunQueue
    from strawq.storage import open_storage

    if not os.path.isdir(path):
        what = "is a file, not" if os.path.exists(path) else "is not"
        raise StrawqError(f"{path} {what} a run directory; create a run with "
                          f"'strawq init {path}'")
    return RunQueue.open(open_storage(path, writer_id="cli", read_only=read_only))


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str, *,
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
    from strawq.queue import RUN_KEY

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
    from strawq.queue import RunQueue
    from strawq.storage import open_storage

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
    _emit(args, payload, "" if args.quiet else
          f"run ready at {args.path}\n" + json.dumps({"config": shown}, indent=2))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from strawq.binding import check_binding, require_rows
    from strawq.release_check import BadRowsRefused
    from strawq.mixture import open_dataset
    from strawq.feeder import Feeder
    from strawq.cursor import read_cursor_state
    from strawq.states import dropped_by_reason
    from strawq.app.progress import Progress

    if args.dry_run and args.dataset_grew:
        raise UsageError("--dry-run previews a release from the dataset the cursor records; "
                         "--dataset-grew is for a release (without --dry-run)")
    q = _queue(args.path)
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
        _emit(args, {"refused": str(exc), "rows": exc.rows, "released": 0,
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
    _emit(args, payload, text)
    return 0


def _share(value: str) -> float:
    """An argparse type: a share from 0 to 1 (a usage error otherwise)."""
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {value!r}")
    return share


def _release_dry_run(args: argparse.Namespace, q: Any, dataset: Any) -> int:
    from strawq.feeder import preview_release

    p = preview_release(q, dataset, args.count, max_bad_row_share=args.max_bad_row_share)
    payload = {"dry_run": True, "refused": p.refused, "next_index": p.start,
               "would_move_to": p.end, "would_release": p.good, "would_drop": len(p.bad),
               "bad_rows": [b.to_dict() for b in p.bad],
               "prompt_kinds": p.kinds, "exhausted": p.exhausted}
    _emit(args, payload, p.describe(), report=True)
    return 0 if p.refused is None else 1


def cmd_status(args: argparse.Namespace) -> int:
    from strawq.glance import Watcher, default_sample_s, glance
    from strawq.glance_text import find_runs, list_runs, render, watch

    if os.path.isdir(args.path) and not os.path.exists(os.path.join(args.path, "run.meta")):
        runs = find_runs(args.path)
        if runs:
            payload, text = list_runs(args.path, runs)
            _emit(args, payload, text, report=True)
            return 0
    q = _queue(args.path, read_only=True)
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
    from strawq.inspect import describe_record

    q = _queue(args.path, read_only=True)
    out = describe_record(q, args.key, tokens=args.tokens)
    print(json.dumps(out, indent=2, default=str))
    if "error" in out:
        print(f"strawq inspect: error: {out['key']} fails its checks: {out['error']}",
              file=sys.stderr)
        return 1
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from strawq.batches import BatchStore

    from strawq.retention import sweep_staging

    q = _queue(args.path)
    rep = BatchStore(q).gc(full=args.full, sweep=True, compact_drops_at=0,
                           keep_drops_days=0 if args.expire else None)
    tmp = sum(q.storage.clean_tmp(w) for w in args.tmp_of or [])
    tmp += q.storage.clean_dead_tmp(grace_s=args.tmp_grace)
    staged = sweep_staging(q.storage, grace_s=args.tmp_grace)
    payload = {"batches": rep.batches, "group_payloads": rep.payloads,
               "stale_records": rep.stale, "turn_checkpoints": rep.turns,
               "drops_compacted": rep.drops, "drops_expired": rep.expired, "tmp": tmp,
               "staging": staged}
    _emit(args, payload, "" if args.quiet else
          f"gc: {rep.batches} batches, {rep.payloads} group payloads, {rep.stale} stale or "
          f"orphaned records, {rep.turns} turn checkpoints, {rep.drops} drops compacted into "
          f"the audit (still requeueable), {rep.expired} expired drops, {tmp} temporary "
          f"files and {staged} abandoned release records removed")
    return 0


def _tmp_grace(value: str) -> float:
    """``--tmp-grace``: a number of seconds, at least ``MIN_TMP_GRACE_S``."""
    from strawq.storage.posix import MIN_TMP_GRACE_S, tmp_grace_problem

    try:
        grace = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") \
            from None
    if not (math.isfinite(grace) and grace >= MIN_TMP_GRACE_S):
        raise argparse.ArgumentTypeError(tmp_grace_problem(grace))
    return grace


def cmd_bracket(args: argparse.Namespace) -> int:
    from strawq.app.bracket_cli import run_bracket

    return run_bracket(args, _queue, _emit)


def cmd_forget_engine(args: argparse.Namespace) -> int:
    from strawq.engine_weights import EngineWeights

    q = _queue(args.path)
    weights = EngineWeights(q.storage)
    url = args.url.rstrip("/")
    known = weights.known()
    if url not in known:
        raise StrawqError(f"no note says {url} needs weights and no producer registered it "
                          f"at {args.path} (known: {', '.join(known) or 'none'})")
    gone = weights.forget(url)
    _emit(args, {"url": url, "notes_deleted": gone},
          f"forgot {url}: {gone} note(s) deleted; the trainer no longer pushes to it (a "
          "producer that still lists it and finds it behind notes it again)")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strawq")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"strawq {_version()}")
        parser.exit()


#: Options every command takes, before or after it (none takes a value).
GLOBAL_OPTIONS = ("-q", "--quiet", "-v", "--verbose", "--json")


def command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the options before
    a command take no value), or None."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``strawq`` parser. With ``argv``, only the command it names is built in full (its
    module imported); every other command is listed by name and help, so ``strawq --help``
    shows them all and ``strawq --version`` or ``strawq status`` import nothing they do not
    use. Without ``argv``, every command is built."""
    wanted = None if argv is None else command_of(argv)
    p = argparse.ArgumentParser(prog="strawq", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_VersionAction)
    _add_verbosity(p, top=True)
    p.add_argument("--json", action="store_true", default=False,
                   help="machine-readable output (commands that print state)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("init", help="create a run directory (layout + config)",
                       description="Create the run layout in PATH (a new or empty directory). "
                       "Idempotent with the same config; refuses to reopen a run with a "
                       "different one, and refuses a non-empty directory that is not a run.")
    s.add_argument("path", help="run directory (local path or a shared mount)")
    s.add_argument("--config", help="JSON file with queue config keys (unknown keys refused)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one queue config key, e.g. --set max_attempts=5 (the keys "
                   "are listed below)")
    s.add_argument("--declaration", help="storage declaration to verify with the doctor "
                   "before creating the run (refuses a mount that fails)")
    _add_json(s)
    add_keys_help(s, "strawq.config:QueueConfig")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("release", help="release prompts from a dataset into the queue",
                       description="Advance the durable dataset cursor by COUNT rows. Safe to "
                       "re-run after a crash: no row is released twice. Rows that fail to "
                       "parse are dropped with reason bad_row and reported.")
    s.add_argument("path")
    s.add_argument("dataset", help="JSONL or Parquet: a file, a directory or a glob of shards "
                   "(any fsspec URL), or a mixture of several: a *.mixture.json file "
                   "(docs/datasets.md, Mixtures)")
    s.add_argument("--count", type=positive_int, default=None,
                   help="rows, >= 1 (default: release_batch)")
    s.add_argument("--dry-run", action="store_true",
                   help="validate the rows and report what would be released and dropped; "
                   "the cursor does not move and nothing is written")
    s.add_argument("--max-bad-row-share", type=_share, default=None, metavar="SHARE",
                   help="largest share (0..1) of bad rows this release may drop before it is "
                   "refused (default: the run's max_bad_row_share, 0.05 unless set at init); "
                   "1 releases whatever the rows, dropping the bad ones")
    s.add_argument("--dataset-grew", action="store_true",
                   help="DATASET is the run's dataset with rows appended (new shards after "
                   "the run's, or rows added to its last one): continue the cursor over it, "
                   "task ids continuing, and record it as the run's. Refused when its files' "
                   "names and sizes say it did not only grow (docs/datasets.md)")
    _add_json(s)
    s.set_defaults(func=cmd_release)

    s = sub.add_parser("status", help="what is stalled and why; liveness, bracket, tasks",
                       description="A run at a glance: what is stalled and why, the open "
                       "weight-update bracket and whom it waits for, each producer's and the "
                       "collector's liveness (live, idle, silent, dead: from heartbeat "
                       "counters watched on this host's clock, never file times), disk free, "
                       "tasks per state, dropped work, staleness, oldest items. On a folder "
                       "that holds runs, lists them. Read-only: writes nothing to the run "
                       "(docs/operations.md).")
    s.add_argument("path")
    s.add_argument("--watch", type=positive_float, nargs="?", const=2.0, default=None,
                   metavar="SECONDS", help="redraw every SECONDS (default 2) until Ctrl-C; "
                   "heartbeat ages grow exact as it watches")
    s.add_argument("--sample", type=non_negative_float, default=None, metavar="SECONDS",
                   help="watch heartbeats this long before judging liveness (default: one "
                   "heartbeat interval and a little, at most 10; it ends sooner once every "
                   "party beat); 0 judges from one listing")
    _add_json(s, "everything shown, as JSON (one line per redraw with --watch)")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("inspect", help="show one record, readable",
                       description="Decode and verify one record (task, group, partial, "
                       "manifest, cursor, drop note, drop audit). KEY is a path inside the "
                       "run, e.g. 'ready/<name>' or 'data/<id>~g0.group', or a task id; "
                       "'history' shows the per-prompt history, 'history/<task id>' one "
                       "prompt's attempts. "
                       "Exits 1 when the record fails its checks.")
    s.add_argument("path")
    s.add_argument("key")
    s.add_argument("--tokens", type=int, default=16, help="token ids to show per sample")
    _add_json(s, help="JSON output (the only format of inspect; accepted for uniformity)")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("gc", help="delete trained work, orphaned records and dead temp files",
                       description="Garbage-collect acked batches, payloads no live task needs "
                       "(trained, fenced generations, superseded partials), temporary files "
                       "of dead writers and abandoned release staging, and fold dropped/ "
                       "into the drop audit (audit/drops-<seq>, still read by status and "
                       "inspect). A compacted drop's task record is kept in audit/kept/ for "
                       "7 days, so 'strawq requeue' can still put it back; --expire deletes "
                       "them now. Afterwards the run holds live records only.")
    s.add_argument("path")
    s.add_argument("--full", action="store_true",
                   help="accepted for compatibility: every gc is full now")
    s.add_argument("--tmp-of", action="append", metavar="WRITER",
                   help="also remove every temporary file of WRITER (a producer id) at once, "
                   "which must be known dead")
    s.add_argument("--tmp-grace", type=_tmp_grace, default=3600.0, metavar="SECONDS",
                   help="a temporary file from another host is abandoned once this old "
                   "(default 3600, at least 900: its mtime may be a skewed host's clock); "
                   "dead writers on this host are found by pid at once")
    s.add_argument("--expire", action="store_true",
                   help="also delete the kept task records of compacted drops now: they can "
                   "no longer be requeued (default: after 7 days)")
    _add_json(s)
    s.set_defaults(func=cmd_gc)

    from strawq.app import bracket_cli

    s = sub.add_parser("bracket", help="show, finish or abort the weight-update bracket",
                       description=bracket_cli.DESCRIPTION)
    bsub = s.add_subparsers(dest="bracket_command", metavar="ACTION", required=True)
    for action, hlp in bracket_cli.ACTIONS:
        b = bsub.add_parser(action, help=hlp, description=hlp)
        b.add_argument("path")
        bracket_cli.add_bracket_arguments(b, action)
        _add_json(b)
        _add_verbosity(b)
        b.set_defaults(func=cmd_bracket)

    s = sub.add_parser("forget-engine", help="drop the notes of an engine retired for good",
                       description="Producers note an engine on weights other than the run's "
                       "in RUN/engines/ and the trainer keeps pushing the run's weights to it "
                       "until it catches up (strawq status lists them). For an engine that "
                       "was removed for good, this deletes its notes and its registration "
                       "(engine-urls/): the repairs stop, engines/needing_weights drops and "
                       "'strawq bracket status' no longer asks it. Notes on an engine that "
                       "reports the run's version again are deleted by whoever probes it.")
    s.add_argument("path")
    s.add_argument("url", help="the engine's base URL, as strawq status shows it")
    _add_json(s)
    s.set_defaults(func=cmd_forget_engine)

    for entry in SUBCOMMANDS:
        if argv is None or entry.name == wanted:
            entry.register(sub)
        else:
            entry.list_only(sub)
    _verbosity_everywhere(p)
    _json_everywhere(p)
    return p


def _add_json(p: argparse.ArgumentParser, help: str = "machine-readable output") -> None:
    p.add_argument("--json", action="store_true", help=help)


def _add_verbosity(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """-q/-v on ``p``; below the top level they default to SUPPRESS, so a flag given before
    the command is not reset by the command's parser."""
    taken = p._option_string_actions  # noqa: SLF001 - argparse has no public lookup
    default: Any = False if top else argparse.SUPPRESS
    if "-v" not in taken and "--verbose" not in taken:
        p.add_argument("-v", "--verbose", action="store_true", default=default,
                       help="log at DEBUG level (and show tracebacks of internal errors)")
    if "-q" not in taken and "--quiet" not in taken:
        p.add_argument("-q", "--quiet", action="store_true", default=default,
                       help="log warnings and errors only; print no summary")


def _verbosity_everywhere(p: argparse.ArgumentParser) -> None:
    for action in p._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in action.choices.values():
                _add_verbosity(child)
                _verbosity_everywhere(child)


def _json_everywhere(p: argparse.ArgumentParser) -> None:
    """A command's own --json defaults to SUPPRESS (like -q/-v), so ``strawq --json CMD`` is
    not reset by CMD's parser; the commands that take it are marked (``_takes_json``)."""
    for action in p._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in action.choices.values():
                own = child._option_string_actions.get("--json")  # noqa: SLF001
                if own is not None:
                    own.default = argparse.SUPPRESS
                    child.set_defaults(_takes_json=True)
                _json_everywhere(child)


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
            actions = p.add_subparsers(dest=f"{self.name}_command", metavar="COMMAND")
            add(actions)
            choices = ", ".join(actions.choices)

            def name_one(_args: argparse.Namespace) -> int:  # 'strawq engine' alone
                p.print_usage(sys.stderr)
                print(f"strawq {self.name}: error: name a command: {choices}", file=sys.stderr)
                return 2

            p.set_defaults(func=name_one)
        else:
            add(sub)

    def list_only(self, sub: Any) -> None:
        """Name the command in ``--help`` without importing its module (argv names another)."""
        sub.add_parser(self.name, help=self.help, add_help=False)

    def missing_dependency(self, exc: ImportError) -> str:
        """What to say when the command's code needs a package that is not installed."""
        hint = (f"pip install 'strawq[{self.extra}]'" if self.extra
                else "reinstall strawq")
        name = f"'{exc.name}'" if exc.name else "a package"
        return f"strawq {self.name} needs {name}, which is not installed; install it with: {hint}"

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
    Subcommand("doctor", "strawq.app.doctor_cli", "add_doctor_parser",
               "verify a mount gives the guarantees the queue relies on"),
    Subcommand("requeue", "strawq.app.requeue_cli", "add_parser",
               "put the tasks dropped with one reason back into the queue"),
    Subcommand("upgrade", "strawq.app.upgrade_cli", "add_parser",
               "raise a run's on-disk format once every part reads it"),
    Subcommand("engine", "strawq.producers.engines.cli", "add_engine_parser",
               "local SGLang-compatible engines (tiny, sim, router)", extra="engines",
               nested=True,
               description="Serve a local engine that speaks SGLang's native HTTP protocol: "
               "'tiny' is a real torch model on CPU, 'sim' a timing model for scale "
               "experiments, 'router' a minimal sglang-router."),
    Subcommand("collector", "strawq.collector.cli", "add_parsers",
               "run the global batch collector", extra="torch"),
    Subcommand("producer", "strawq.producers.cli", "add_parsers",
               "run one producer in this process, without Ray (Slurm, systemd)",
               extra="engines"),
    Subcommand("demo", "strawq.demo.cli", "add_parsers",
               "an end-to-end RL run on this machine (the main job)", extra="all"),
    Subcommand("lab", "strawq.demo.lab_cli", "add_lab_parser",
               "the rollout schedules compared at scale (sim engines)", extra="all"),
    Subcommand("cluster", "strawq.app.cluster", "add_parsers",
               "a whole run on this machine from one run config (engines, producers, "
               "collector)", extra="engines", nested=True,
               description="'strawq cluster up RUN.json' starts the run, its engines (sim by "
               "default), a router, the producers and the collector on this machine, from "
               "one run config (deploy/examples/quickstart.json works as shipped)."),
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    verbose, quiet = getattr(args, "verbose", False), getattr(args, "quiet", False)
    args.verbose, args.quiet = verbose, quiet
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    where = f"strawq {args.command}"
    if args.json and not getattr(args, "_takes_json", False):
        parser.exit(2, f"{parser.prog}: error: --json: {where} prints no state to give as "
                    "JSON (the commands that take it say so in their --help)\n")
    try:
        rc: int = args.func(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # The reader went away (``| head``): not an error of ours. Point stdout at devnull
        # so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except UsageError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    except StrawqError as exc:
        # a StorageError carries its whole message as strerror: no "[Errno N]" prefix
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"{where}: error: {text}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{where}: error: {os_error_text(exc)}", file=sys.stderr)
        return 1
    except ImportError as exc:  # a command's optional dependency is not installed
        entry = next((e for e in SUBCOMMANDS if e.name == args.command), None)
        if entry is None:
            return _internal_error(where, exc, verbose)
        print(f"{where}: error: {entry.missing_dependency(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: no traceback
        return _internal_error(where, exc, verbose)


def _internal_error(where: str, exc: BaseException, verbose: bool) -> int:
    log.debug("internal error", exc_info=exc)
    print(f"{where}: internal error: {type(exc).__name__}: {exc}"
          + ("" if verbose else " (rerun with -v for the traceback, and please report "
             "it)"), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
