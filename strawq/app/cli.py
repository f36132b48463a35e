"""The ``strawq`` command line. It parses arguments and calls library code, nothing else.

``main`` runs one command and renders what goes wrong as one line and an exit status, never a
traceback. The parser is ``strawq.app.parser``, the command bodies ``strawq.app.commands``, the
commands of other packages ``strawq.app.registry``; their public names are importable from here.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from strawq.app.commands import (cmd_bracket, cmd_forget_engine, cmd_gc, cmd_init, cmd_inspect,
                                 cmd_release, cmd_status)
from strawq.app.parser import DESCRIPTION, EPILOG, GLOBAL_OPTIONS, build_parser, command_of
from strawq.app.registry import SUBCOMMANDS, Subcommand
from strawq.argtypes import UsageError
from strawq.errors import StrawqError, os_error_text

__all__ = ["DESCRIPTION", "EPILOG", "GLOBAL_OPTIONS", "SUBCOMMANDS", "Subcommand", "build_parser",
           "cmd_bracket", "cmd_forget_engine", "cmd_gc", "cmd_init", "cmd_inspect", "cmd_release",
           "cmd_status", "command_of", "main"]

log = logging.getLogger("strawq.app.cli")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv, SUBCOMMANDS)
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
