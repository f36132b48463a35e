"""strawq generates, verl trains: verl's fully-async trainer (the shipped
``strawq_trainer(FullyAsyncTrainer)``) on the batches of a strawq run whose producers
generate on the engines this trainer pushes weights to (docs/verl.md, "Strawq generates,
verl trains: the processes").

    python deploy/examples/verl_strawq_trainer.py RUN_DIR --engine-url http://node1:30001 \\
        --engine-url http://node2:30001 --weights-dir /mnt/jfs/strawq/weights \\
        --ckpt-dir /mnt/jfs/verl/ckpt --steps 100 --cpu-stand-ins

The run, its collector and its producers are started first (``strawq init``,
``strawq collector``, ``strawq producer --engine URL ...`` with the same engine URLs).
This script runs verl's own loop (``fit``: ``fit_step`` after ``fit_step``, verl's
checkpoints, its restore through ``load_checkpoint``) with strawq's bracket around every
weight push: producers pause, the weights go to every ``--engine-url``, the engines are
told strawq's version (``weight_version``: producers refuse replies from other versions),
producers resume.

``--cpu-stand-ins`` (the only mode this script implements): verl's GPU and Ray parts are
the stand-ins of ``strawq.testing.verl_loop`` — the actor worker group trains a small
``TinyPolicy`` with verl's actor-side loss code, verl's push is a save of its weights
under ``--weights-dir`` loaded by every engine (``/update_weights_from_disk``, with the
version). On GPUs, verl's task runner builds the real worker group, rollouter and
checkpoint-engine manager instead; the trainer class, ``attach_strawq`` and the version
push (``after_push``) are the same.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import types
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_push import engine_version_push, launcher_parser  # noqa: E402

log = logging.getLogger("verl_strawq_trainer")


def main(argv: list[str] | None = None) -> int:
    p = launcher_parser(__doc__, "verl", ckpt="trainer.default_local_dir",
                        steps="verl's trainer.total_training_steps",
                        batch="ppo_mini_batch_size", group="rollout.n", stand_ins="GPU and Ray")
    p.add_argument("--trigger", type=int, default=1,
                   help="verl's async_training.trigger_parameter_sync_step")
    p.add_argument("--save-freq", type=int, default=1, help="verl's trainer.save_freq")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.cpu_stand_ins:
        print("error: only --cpu-stand-ins is implemented by this script; on GPUs build "
              "verl's trainer with strawq_trainer(FullyAsyncTrainer) in verl's task runner "
              "(docs/verl.md)", file=sys.stderr)
        return 2
    try:
        from verl.experimental.fully_async_policy import fully_async_trainer as fat
    except ImportError:
        print("error: verl is not installed: pip install 'verl==0.9.1' (docs/verl.md)",
              file=sys.stderr)
        return 2

    from strawq.collector.integrations.verl.reader import verl_actor_config
    from strawq.collector.integrations.verl.trainer import strawq_trainer
    from strawq.testing.reference import Objective, TinyPolicy
    from strawq.testing.verl_loop import ActorGroup, _ray_get, make_trainer, verl_config

    config = verl_config(args.ckpt_dir, trigger=args.trigger, save_freq=args.save_freq,
                         batch_groups=args.batch_groups, group_size=args.group_size)
    actor_cfg = verl_actor_config(Objective(), batch_samples=args.batch_groups * args.group_size,
                                  rollout_n=args.group_size, ppo_max_token_len_per_gpu=4096)
    model = TinyPolicy(vocab=32000)
    group = ActorGroup(model, actor_cfg, 0.01, lambda: None)
    cls = strawq_trainer(fat.FullyAsyncTrainer)
    with mock.patch.object(fat, "ray", types.SimpleNamespace(get=_ray_get)):
        trainer = make_trainer(cls, config, args.run_dir, group, timeout=600.0,
                               after_push=engine_version_push(args.engine_url,
                                                              args.weights_dir, model))
        restored = asyncio.run(trainer.load_checkpoint())
        if restored:
            log.info("restored verl's checkpoint of version %d", restored)
        trainer.set_total_train_steps(args.steps)
        asyncio.run(trainer.fit())
        trainer.strawq.close()
    samples = sum(len(s["samples"]) for s in group.steps)
    print(json.dumps({"steps": len(group.steps), "samples": samples,
                      "batches": [s["seq"] for s in group.steps],
                      "version": trainer.strawq.queue.current_version()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
