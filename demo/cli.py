"""``strawq demo``: argument parsing only; the work is in ``strawq.demo.run``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

DEMO_HELP = """\
Run a real RL loop on this machine with every part of strawq: a two-node Ray cluster, two
tiny engines (torch models behind SGLang's HTTP protocol), one producer per node, the
collector, and a GRPO trainer that reads batches through the reader API and pushes new
weights through the weight-update bracket after every step. The task ("write exactly k
tokens, then stop") is verifiable and has long-tailed response lengths.

Writes to --workdir: timeline.png (who is busy, weight updates marked), reward.png,
staleness.png, metrics.jsonl, summary.json, and the queue itself under run/.
Ctrl-C stops cleanly after the current step; --resume continues where it stopped.
"""


def cmd_demo(args: argparse.Namespace) -> int:
    from strawq.argtypes import UsageError
    from strawq.errors import ConfigError

    from strawq.demo.run import DemoConfig, format_summary, run_demo

    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    try:
        cfg = DemoConfig(**{k: v for k, v in vars(args).items()
                            if k in fields and v is not None})
    except ConfigError as exc:
        raise UsageError(f"{exc} (see strawq demo --help)") from exc
    if not args.verbose:  # the progress bar says what matters; warnings still show
        logging.getLogger().setLevel(logging.WARNING)
    result = run_demo(cfg)
    if not args.quiet:
        print(format_summary(result))
    return 0


def _at_least_one_float(value: str) -> float:
    from strawq.argtypes import positive_float

    x = positive_float(value)
    if x < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value!r}")
    return x


def add_parsers(sub: Any) -> None:
    from strawq.argtypes import non_negative_int, positive_int

    p = sub.add_parser("demo", help="an end-to-end RL run on this machine (the main job)",
                       description=DEMO_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sync", "partial", "async"), default=None,
                   help="sync: barrier per batch; partial: over-sample, interrupted groups "
                   "resume next step; async: generate while training, staleness bound "
                   "--max-staleness (default)")
    p.add_argument("--task", choices=("count", "tools"), default=None,
                   help="count: write exactly k tokens (default); tools: arithmetic the model "
                   "delegates to a calculator tool (multi-turn trajectories)")
    p.add_argument("--steps", type=positive_int, help="training steps (default 60)")
    p.add_argument("--batch-groups", dest="batch_groups", type=positive_int,
                   help="prompt groups per batch B (default 8)")
    p.add_argument("--group-size", dest="group_size", type=positive_int,
                   help="samples per prompt G")
    p.add_argument("--max-staleness", dest="max_staleness", type=non_negative_int,
                   help="async bound η (>= 0)")
    p.add_argument("--oversample", type=_at_least_one_float,
                   help="partial: groups admitted per batch ÷ B (>= 1)")
    p.add_argument("--workdir", help="output directory (default runs/demo)")
    p.add_argument("--run-root", dest="run_root",
                   help="put the queue on this mount (e.g. a JuiceFS mount) instead")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue the run in --workdir where it stopped")
    p.add_argument("--fresh", action="store_true", default=None,
                   help="discard a previous run in --workdir and start over")
    p.add_argument("--seed", type=int)
    p.add_argument("--trainer-device", dest="trainer_device", choices=("cpu", "cuda"),
                   help="where the GRPO trainer's model trains (default cpu)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.set_defaults(func=cmd_demo)
