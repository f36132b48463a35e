"""``strawq doctor PATH``: the command-line face of ``strawq.doctor``.

Parses arguments, calls the library, renders the report. Wire it into the main CLI with
``add_doctor_parser(subparsers)``; ``python -m strawq.app.doctor_cli PATH ...`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

from strawq.doctor import (
    DoctorReport,
    Status,
    load_declaration,
    run_doctor,
    write_declaration,
)
from strawq.errors import StrawqError

DESCRIPTION = """\
Verify that a directory's filesystem gives the guarantees the queue relies on, by
measuring them in a scratch directory PATH/.strawq-doctor-<id>/ (removed afterwards)
instead of trusting how the mount was declared.

What is checked, and why:
  filesystem         the mount's type (/proc/self/mountinfo); object-store FUSE mounts
                     (s3fs, goofys, ...) fail: their rename is copy+delete
  juicefs_*          for JuiceFS, the client's own settings (.config at the mount root and
                     the mount's command line): a direct mount, no --writeback (durability),
                     --open-cache 0 (close-to-open), no --readdir-cache, metadata TTLs
                     <= 1 s, the client version, the metadata engine (redis, sqlite3,
                     tikv, ...) and its durability
                     (sqlite3: one host only; redis: needs appendfsync always)
  reachable/scratch  the path answers (a dead FUSE daemon gives ENOTCONN) and a scratch
                     directory can be created (read-only or full mounts fail here)
  fsync_file/dir     fsync works on files and directories (a publish is durable)
  rename_noreplace   renameat2(RENAME_NOREPLACE) refuses an existing target (exclusive
                     publish)
  atomic_rename      N processes rename the same file to their own names: exactly one
                     winner per round (this is how tasks are claimed)
  exclusive_create   N processes O_EXCL-create one name: exactly one winner per round
  noreplace_publish  N processes publish onto one name: exactly one winner per round
  publish_no_torn    records published by tmp+fsync+close+rename are never seen partial
                     by a concurrent reader (on the peer mount when given)
  visibility_*       with --peer (the same directory through a second client of the
                     volume, e.g. another JuiceFS mount): how long until a new file is
                     listed and readable there, until a deleted name is gone there, and
                     how long a file replaced by rename stays stale there (p50/p99/max)

With --peer the racing processes alternate between PATH and PEER, so the races are
cross-client. Timing numbers are reported, never judged harshly: a window above 2 s is a
warning (longer caches than the queue is tuned for), only "never" is a failure.
"""

EPILOG = """\
exit status: 0 when no check failed (warnings allowed), 1 when a check failed or the
declaration does not match, 2 when doctor could not run (bad PATH, unreadable or invalid
declaration).

examples:
  strawq doctor /mnt/jfs/queue --peer /mnt/jfs2/queue --write-declaration decl.json
  strawq doctor /mnt/jfs/queue --check-declaration decl.json --rounds 5
"""

log = logging.getLogger(__name__)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="a directory on the mount to verify")
    p.add_argument("--peer", metavar="PATH2",
                   help="the same directory seen through a second client of the volume "
                        "(enables cross-client races and visibility measurements)")
    p.add_argument("--rounds", type=int, default=20, metavar="N",
                   help="race rounds and visibility samples (default: 20)")
    p.add_argument("--processes", type=int, default=8, metavar="N",
                   help="racing processes (default: 8)")
    p.add_argument("--quick", action="store_true",
                   help="the start-up check: 3 rounds, 4 processes, small records")
    p.add_argument("--write-declaration", metavar="FILE",
                   help="save the verified storage declaration (JSON) to FILE; refused if "
                        "a check failed")
    p.add_argument("--check-declaration", metavar="FILE",
                   help="compare the mount with a saved declaration; every mismatch fails")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``doctor`` to a ``parser.add_subparsers()`` object; returns the sub-parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "doctor", help="verify a mount (atomic rename, O_EXCL, fsync, cross-client visibility)",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_doctor_command)
    return p


def render(report: DoctorReport, width: int | None = None) -> str:
    """A readable table of checks, then the measured numbers."""
    width = width or max(80, min(shutil.get_terminal_size((100, 20)).columns, 140))
    lines = [f"strawq doctor {report.path}" + (f"  (peer {report.peer})" if report.peer else "")]
    lines.append(f"  filesystem  {report.mount.fs_type} at {report.mount.mount_point} "
                 f"(profile {report.profile})"
                 + (f", client {report.client_version}" if report.client_version else ""))
    if report.juicefs is not None and report.juicefs.meta_engine:
        lines.append(f"  metadata    {report.juicefs.meta_engine} engine "
                     f"({report.juicefs.meta_url})")
    if report.durability_description:
        lines += textwrap.wrap(report.durability_description, width,
                               initial_indent="  durability  ", subsequent_indent=" " * 14)
    lines.append("")
    name_w = max(len(c.name) for c in report.checks) + 2
    lines.append(f"{'CHECK':<{name_w}}RESULT  DETAIL")
    for c in report.checks:
        head = f"{c.name:<{name_w}}{c.status.value.upper():<8}"
        lines += textwrap.wrap(c.detail, width, initial_indent=head,
                               subsequent_indent=" " * len(head)) or [head]
    measured = report.measured()
    if measured:
        lines += ["", "measured:"]
        key_w = max(len(k) for k in measured) + 2
        for k, v in measured.items():
            shown = f"{v * 1e3:.3f} ms" if k.endswith("_s") else f"{v:.10g}"
            lines.append(f"  {k:<{key_w}}{shown}")
    counts = {s: sum(c.status is s for c in report.checks) for s in Status}
    summary = (f"{counts[Status.PASS]} passed, {counts[Status.WARN]} warning(s), "
               f"{counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped in "
               f"{report.elapsed_s:.1f}s: {'OK' if report.ok else 'FAILED'}")
    lines += ["", summary]
    return "\n".join(lines)


def run_doctor_command(args: argparse.Namespace, out: TextIO | None = None,
                       err: TextIO | None = None) -> int:
    """Run doctor for parsed ``args``; returns the exit status (0 ok, 1 failed, 2 error)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        declaration = load_declaration(args.check_declaration) \
            if args.check_declaration else None
        report = run_doctor(args.path, peer=args.peer, rounds=args.rounds,
                            processes=args.processes, quick=args.quick, declaration=declaration)
    except StrawqError as exc:
        err.write(f"strawq doctor: error: {exc}\n")
        return 2
    status = 0 if report.ok else 1
    note = ""
    if args.write_declaration:
        if report.ok:
            write_declaration(report, args.write_declaration)
            note = f"declaration written to {args.write_declaration}"
        else:
            note = (f"declaration NOT written to {args.write_declaration}: "
                    f"{len(report.failed())} check(s) failed")
    if args.json:
        payload = report.to_dict()
        if note:
            payload["note"] = note
        out.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        out.write(render(report) + "\n")
        if note:
            out.write(note + "\n")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strawq doctor", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_doctor_command(args)


if __name__ == "__main__":
    sys.exit(main())
