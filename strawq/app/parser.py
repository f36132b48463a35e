"""The ``strawq`` argument parser: every command's arguments, the options every command
takes before or after it (``-q``, ``-v``, ``--json``), and ``--version``. Only the command the
arguments name is built in full; every other one is listed by name and help, so
``strawq --help`` imports no command's code (``strawq.app.registry``). The command bodies are
``strawq.app.commands``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from strawq.app.commands import (cmd_bracket, cmd_forget_engine, cmd_gc, cmd_init, cmd_inspect,
                                 cmd_release, cmd_status)
from strawq.app.registry import SUBCOMMANDS, Subcommand
from strawq.argtypes import non_negative_float, positive_float, positive_int
from strawq.config import add_keys_help

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

def _share(value: str) -> float:
    """An argparse type: a share from 0 to 1 (a usage error otherwise)."""
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {value!r}")
    return share



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


def build_parser(argv: Sequence[str] | None = None,
                 subcommands: Sequence[Subcommand] | None = None) -> argparse.ArgumentParser:
    """The ``strawq`` parser. With ``argv``, only the command it names is built in full (its
    module imported); every other command is listed by name and help, so ``strawq --help``
    shows them all and ``strawq --version`` or ``strawq status`` import nothing they do not
    use. Without ``argv``, every command is built. ``subcommands``: the commands of other
    packages (``strawq.app.registry.SUBCOMMANDS`` by default)."""
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

    for entry in SUBCOMMANDS if subcommands is None else subcommands:
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
