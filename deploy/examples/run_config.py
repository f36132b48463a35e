"""Load and validate a run config file like ``run.json``; print one section for the CLI.

A run config has four sections, each built by the real config class (unknown keys are
refused by name, values type-checked and validated):

    queue      strawq.config.QueueConfig          -> strawq init --config, --queue-config
    collector  strawq.collector.config.CollectorConfig   -> strawq collector --config
    producer   strawq.producers.producer_config.ProducerConfig   (launch_producers.py)
    placement  strawq.producers.placement.PlacementConfig        (launch_producers.py)

    python deploy/examples/run_config.py deploy/examples/run.json --check
    python deploy/examples/run_config.py deploy/examples/run.json --section queue > queue.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

SECTIONS = ("queue", "collector", "producer", "placement")


@dataclass(frozen=True)
class RunConfig:
    raw: dict[str, Any]
    queue: Any
    collector: Any
    producer: Any
    placement: Any


def load(path: str) -> RunConfig:
    """Every section through its config class; ``ConfigError`` names a wrong key."""
    from strawq.collector.config import CollectorConfig
    from strawq.producers.producer_config import ProducerConfig
    from strawq.config import QueueConfig, from_dict
    from strawq.errors import ConfigError

    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or sorted(raw) != sorted(SECTIONS):
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(f"{path}: expected exactly the sections {list(SECTIONS)}, found "
                          f"{found}")
    queue = from_dict(QueueConfig, raw["queue"], where=f"{path}: queue")
    collector = from_dict(CollectorConfig, raw["collector"], where=f"{path}: collector")
    producer = ProducerConfig.from_dict(raw["producer"])
    return RunConfig(raw, queue, collector, producer, _placement(raw["placement"], path))


def _placement(data: dict[str, Any], path: str) -> Any:
    """``PlacementConfig`` lives in the module that imports Ray; build it from there."""
    from strawq.producers.placement import PlacementConfig
    from strawq.config import from_dict

    return from_dict(PlacementConfig, data, where=f"{path}: placement")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--section", choices=SECTIONS, help="print this section as JSON")
    p.add_argument("--check", action="store_true", help="validate every section, print OK")
    args = p.parse_args(argv)
    cfg = load(args.path)
    if args.section:
        json.dump(cfg.raw[args.section], sys.stdout, indent=2)
        print()
    if args.check or not args.section:
        print(f"{args.path}: OK (queue, collector, producer, placement)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
