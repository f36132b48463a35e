"""The registry of the ``strawq`` commands that live outside the core CLI (``doctor``,
``collector``, ``producer``, ...): each ``Subcommand`` names its module and the function that
adds its parser, imported only when the command line names it. A command whose optional
dependency is missing says what to install; it never silently disappears.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Any

from strawq.errors import StrawqError


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
