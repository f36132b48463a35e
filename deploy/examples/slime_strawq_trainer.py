"""strawq generates, slime trains: slime's own training loop on the batches of a strawq run
whose producers generate on the engines this trainer pushes weights to (docs/slime.md,
"2. strawq's producers generate, slime trains": the processes).

    python deploy/examples/slime_strawq_trainer.py RUN_DIR --engine-url http://node1:30001 \\
        --engine-url http://node2:30001 --weights-dir /mnt/jfs/strawq/weights \\
        --ckpt-dir /mnt/jfs/slime/ckpt --steps 100 --batch-groups 64 --group-size 8 \\
        --cpu-stand-ins

The run, its collector and its producers are started first (``strawq init``,
``strawq collector``, ``strawq producer --engine URL ...`` with the same engine URLs). This
script runs the control flow of slime's ``train.py`` with mode 2's flags
(``strawq.collector.integrations.slime.flags.MODES["collector"]``): per rollout
``generate`` (strawq's ``generate_rollout``: it settles the last weight update by what the
engines hold, acks, reads a batch) → train → checkpoint → ``update_weights`` (the post-write
hook opens strawq's bracket; the engines load the weights with the bracket's version). At
the end it settles the last update, acks what it trained and commits its last checkpoint.

``--cpu-stand-ins`` (the only mode this script implements): slime's Megatron actor and Ray
are the stand-ins of ``strawq.testing.slime_loop`` — a small ``TinyPolicy`` trained with
slime's ``build_dp_schedule``, ``compute_advantages_and_returns`` and ``loss_function``, a
``torch.save`` checkpoint — and slime's disk weight update is a save under
``--weights-dir`` loaded by every engine with strawq's version (``engine_push.py``, as the
verl launcher). On GPUs, slime's own ``train.py`` runs with the same flags
(``slime_job.py collector`` prints its command line): its ``update_weight_from_disk``
writes the weights, runs the same hook and reloads its engines itself, with slime's own
version (``--update-weight-start-version`` + 1 per update), which has to be strawq's
(docs/slime.md, "Mode 2: the processes").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_push import engine_version_push, launcher_parser  # noqa: E402

log = logging.getLogger("slime_strawq_trainer")
#: the stand-in policy's vocabulary (the engines' token ids)
VOCAB = 32000


def update_weights(args: Any, push: Callable[[int], Awaitable[None]]) -> int:
    """slime's disk weight update: its post-write hook (strawq's bracket opens), then every
    engine loads the weights with the bracket's version; returns that version."""
    from strawq.collector.integrations.slime.adapter import _ReaderState
    from strawq.collector.integrations.slime.samples import _slime

    hook = _slime("slime.utils.misc").load_function(args.custom_update_weight_post_write_path)
    hook(args, args.weights_dir, [])
    version = int(_ReaderState.reader(args.strawq_run).bracket.control.state().pause_version)
    asyncio.run(push(version))
    return version


def end_of_job(run: str) -> int:
    """What the next job's first ``generate_rollout`` would do, without a batch: settle the
    last update by what the engines hold, ack the batches trained, commit the checkpoint."""
    from strawq.collector.integrations.slime.adapter import _ReaderState

    reader = _ReaderState.reader(run)
    if reader.bracket.is_open:
        reader.bracket.finish_weight_update(if_unknown="end")
    while _ReaderState.delivered[run]:
        reader.ack(_ReaderState.delivered[run].popleft()[1])
    reader.commit()
    version = reader.queue.current_version()
    reader.close()
    return version


def build_parser() -> argparse.ArgumentParser:
    p = launcher_parser(__doc__, "slime", ckpt="--save / --load", steps="slime's --num-rollout",
                        batch="--rollout-batch-size", group="--n-samples-per-prompt",
                        stand_ins="Megatron and Ray")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for a batch, and for the producers to pause")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.cpu_stand_ins:
        print("error: only --cpu-stand-ins is implemented by this script; on GPUs run slime's "
              "train.py with the flags deploy/examples/slime_job.py collector prints "
              "(docs/slime.md)", file=sys.stderr)
        return 2
    try:
        import slime  # noqa: F401
    except ImportError:
        print("error: slime is not installed (docs/slime.md, Install)", file=sys.stderr)
        return 2
    from strawq.errors import StrawqError

    try:
        print(json.dumps(train(args)))
    except (StrawqError, OSError) as exc:  # no run, an engine down, a bracket refused
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def train(args: argparse.Namespace) -> dict[str, Any]:
    """slime's loop from its checkpoint to rollout ``--steps``; what this job trained."""
    from strawq.errors import RunFinished
    from strawq.testing.slime_loop import _Manager, _sample_id, _Trainer
    from strawq.testing.slime_loop_modes import collector_overrides
    from strawq.testing.slime_train import slime_args

    run = os.path.abspath(args.run_dir)
    sargs = slime_args(None, **collector_overrides(run, args.batch_groups, args.group_size,
                                                   timeout_s=args.timeout))
    sargs.strawq_objective, sargs.weights_dir = None, args.weights_dir
    sargs.save = sargs.load = args.ckpt_dir
    trainer = _Trainer(sargs, args.ckpt_dir, 0, vocab=VOCAB)
    sargs.start_rollout_id = trainer.start_rollout_id
    push = engine_version_push(args.engine_url, args.weights_dir, trainer.model)
    manager = _Manager(sargs)
    manager.load(sargs.start_rollout_id - 1)
    update_weights(sargs, push)
    steps, samples, batches = 0, 0, []
    for rollout_id in range(sargs.start_rollout_id, args.steps):
        try:
            data, rollout = manager.generate(rollout_id)
        except RunFinished as end:
            log.info("the run's data is trained: %s", end)
            break
        real = [s for s in rollout if _sample_id(s) is not None]
        steps += trainer.train(data, lambda *_: None)
        samples += len(real)
        batches += sorted({int(s.metadata["strawq"]["seq"]) for s in real})
        trainer.save_model(rollout_id)  # --save-interval 1
        manager.save(rollout_id)
        log.info("rollout %d: batch %s, weights of version %d", rollout_id, batches[-1],
                 update_weights(sargs, push))
    return {"steps": steps, "samples": samples, "batches": batches,
            "version": end_of_job(run)}

if __name__ == "__main__":
    raise SystemExit(main())
