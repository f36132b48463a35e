"""Command lines for a slime job on strawq, in either mode (docs/slime.md).

    # slime generates with its own SGLang rollout; strawq keeps prompts and partial groups
    python deploy/examples/slime_job.py data-source --run /mnt/jfs/strawq/runs/r1 \
        --config strawq.yaml -- --prompt-data /data/dapo.jsonl --input-key prompt ...

    # strawq's producers generate, slime trains: also prints the generation side's commands
    # (strawq collector, strawq producer against slime's router)
    python deploy/examples/slime_job.py collector --run /mnt/jfs/strawq/runs/r1 \
        --config strawq.yaml --dataset /data/dapo.jsonl --router http://HEAD:3000 \
        -- --rollout-batch-size 64 --n-samples-per-prompt 8 ...

Writes the ``--custom-config-path`` YAML that carries the run directory (slime sets its
keys on ``args``) and prints the ``python train.py`` command with the strawq flags added to
the slime arguments after ``--``. ``--exec`` runs it instead (from slime's checkout).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from strawq.collector.integrations.slime.flags import MODES


def config_yaml(run: str, *, ack_lag: int = 1, batch_timeout_s: float = 600.0,
                bracket_timeout_s: float = 300.0) -> str:
    """The ``--custom-config-path`` file: keys slime copies onto ``args``."""
    return (f"strawq_run: {run}\n"
            f"strawq_ack_lag: {ack_lag}  # 2 under train_async.py\n"
            f"strawq_batch_timeout_s: {batch_timeout_s}\n"
            f"strawq_bracket_timeout_s: {bracket_timeout_s}\n")


def command(mode: str, config_path: str, slime_args: list[str]) -> list[str]:
    return [sys.executable, "train.py", *slime_args, *MODES[mode],
            "--custom-config-path", config_path]


def generation_commands(run: str, dataset: str, router: str) -> list[list[str]]:
    """Mode 2's generation side: the collector on the dataset, and producers that send
    their requests to slime's SGLang router (``--sglang-router-ip``/``--sglang-router-port``:
    the engines whose weights slime updates)."""
    return [["strawq", "collector", run, dataset],
            ["strawq", "producer", run, "--router", router]]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--run", required=True, help="the strawq run directory (shared mount)")
    p.add_argument("--config", default="strawq.yaml")
    p.add_argument("--async-train", action="store_true",
                   help="slime's train_async.py (acks lag two rollouts)")
    p.add_argument("--dataset", help="collector mode: the prompt dataset (strawq collector)")
    p.add_argument("--router", help="collector mode: slime's SGLang router URL "
                   "(http://<--sglang-router-ip>:<--sglang-router-port>) for the producers")
    p.add_argument("--exec", action="store_true", help="run the command (from slime's tree)")
    args = p.parse_args(argv)
    with open(args.config, "w", encoding="utf-8") as f:
        f.write(config_yaml(os.path.abspath(args.run), ack_lag=2 if args.async_train else 1))
    cmd = command(args.mode, args.config, rest)
    if args.async_train:
        cmd[1] = "train_async.py"
    if args.mode == "collector" and args.dataset and args.router:
        for gen in generation_commands(os.path.abspath(args.run), args.dataset, args.router):
            print(shlex.join(gen))
    print(shlex.join(cmd))
    if args.exec:
        os.execv(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
