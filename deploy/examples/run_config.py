"""Load and validate a run config file like ``run.json``; print one section for the CLI.

The file is one ``strawq.app.run_config.RunConfig``: four sections, each built by its real
config class (unknown keys are refused by name, values type-checked and validated), and
each value held once (G lives in ``queue.group_size`` and in no other section):

    queue      strawq.config.QueueConfig          -> strawq init --config, --queue-config
    collector  strawq.collector.config.CollectorConfig   -> strawq collector --config
    producer   strawq.producers.producer_config.ProducerConfig   (launch_producers.py)
    placement  strawq.producers.placement_config.PlacementConfig (launch_producers.py)

    python deploy/examples/run_config.py deploy/examples/run.json --check
    python deploy/examples/run_config.py deploy/examples/run.json --section queue > queue.json
    python deploy/examples/run_config.py run.json --set collector.max_staleness=1 --check

A wrong key or value is one line on stderr (exit status 1), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

SECTIONS = ("queue", "collector", "producer", "placement")


def load(path: str, overrides: Sequence[str] = ()) -> Any:
    """The ``RunConfig`` of ``path`` plus ``section.key=value`` overrides."""
    from strawq.config import load_config
    from strawq.app.run_config import RunConfig

    return load_config(RunConfig, path, overrides, where="run config")


def main(argv: list[str] | None = None) -> int:
    from strawq.app.run_config import slots_explicit
    from strawq.config import add_keys_help
    from strawq.errors import ConfigError

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--section", choices=SECTIONS, help="print this section as JSON")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one value (repeatable; the keys are listed below)")
    p.add_argument("--check", action="store_true", help="validate every section, print OK")
    add_keys_help(p, "strawq.app.run_config:RunConfig")
    args = p.parse_args(argv)
    try:
        cfg = load(args.path, args.set)
    except ConfigError as exc:
        print(f"error: {args.path}: {exc}", file=sys.stderr)
        return 1
    if args.section:
        section = getattr(cfg, args.section)
        if section is None:
            print(f"error: {args.path} has no {args.section} section", file=sys.stderr)
            return 1
        data = section.to_dict()
        if args.section == "producer" and not slots_explicit(args.path, args.set):
            # no silent one-slot default: strawq producer derives or asks for its slots
            data.get("budget", {}).pop("slots", None)
        json.dump(data, sys.stdout, indent=2)
        print()
    if args.check or not args.section:
        present = ", ".join(s for s in SECTIONS if getattr(cfg, s) is not None)
        print(f"{args.path}: OK ({present}; G = {cfg.group_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
