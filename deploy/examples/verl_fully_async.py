"""verl's fully-async policy on strawq's durable queue (docs/verl.md).

    # the command line: verl's own entry point, one added entry (the queue directory is
    # optional: by default <trainer.default_local_dir>/strawq_queue, beside the checkpoints)
    python deploy/examples/verl_fully_async.py launch --queue-dir /mnt/jfs/verl/q1 -- \
        data.train_files=... actor_rollout_ref.model.path=... trainer.save_freq=10

    # the CPU part: the queue as verl's trainer and Rollouter use it, a checkpoint, a crash
    python deploy/examples/verl_fully_async.py check [--dir DIR]

``launch`` prints the command (``--exec`` runs it; verl's training needs GPUs). ``check``
puts verl ``RolloutSample`` objects into ``StrawqMessageQueue``, takes some as verl's trainer
does, writes verl's checkpoint tracker, drops the queue without a word (as a crash would)
and opens it again: what the checkpoint covers is gone, everything else is handed out again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any

HOOK = "strawq.collector.integrations.verl.queue.install"
#: the one entry that switches verl to the durable queue (and the durable partial rollout)
SWITCH = f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}"
ENTRY = [sys.executable, "-m", "verl.experimental.fully_async_policy.fully_async_main"]


def command(queue_dir: str | None, verl_args: list[str]) -> list[str]:
    extra = [f"+async_training.strawq_queue_dir={queue_dir}"] if queue_dir else []
    return [*ENTRY, SWITCH, *extra, *verl_args]


def check(directory: str, samples: int = 12) -> dict[str, Any]:
    """The CPU part: a put stream, a checkpoint of version 1 (4 gets), a crash, a restart."""
    import ray
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample

    from strawq.collector.integrations.verl.queue import StrawqMessageQueue

    ckpt = os.path.join(directory, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    cfg = OmegaConf.create({
        "trainer": {"default_local_dir": ckpt, "resume_mode": "auto"},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}},
        "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 2}})

    def sample(i: int) -> bytes:
        import torch

        batch = DataProto.from_single_dict({"responses": torch.full((2, 4), i)})
        return bytes(ray.cloudpickle.dumps(RolloutSample(
            full_batch=batch, sample_id=f"sample_0_{i}", epoch=0, rollout_status={})))

    async def first_life() -> list[str]:
        mq = StrawqMessageQueue(cfg, 100)
        for i in range(samples):
            await mq.put_sample(sample(i))
        got = [ray.cloudpickle.loads((await mq.get_sample())[0]).sample_id for _ in range(6)]
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")  # verl's trainer saved version 1: 2 steps of 2 samples
        return got

    async def second_life() -> dict[str, Any]:
        mq = StrawqMessageQueue(cfg, 100)
        stats = await mq.get_statistics()
        await mq.put_sample(None)
        again = []
        while (got := await mq.get_sample())[0] is not None:
            again.append(ray.cloudpickle.loads(got[0]).sample_id)
        return {"committed": stats["committed"], "handed_out_again": again}

    taken = asyncio.run(first_life())
    out = asyncio.run(second_life())
    return {"taken_before_crash": taken, **out}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verl_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, verl_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    la = sub.add_parser("launch", help="print (or --exec) verl's command with the switch")
    la.add_argument("--queue-dir", default=None)
    la.add_argument("--exec", action="store_true")
    ch = sub.add_parser("check", help="run the CPU part")
    ch.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    if a.mode == "launch":
        cmd = command(a.queue_dir, verl_args)
        print(shlex.join(cmd))
        return subprocess.call(cmd) if a.exec else 0
    directory = a.dir or tempfile.mkdtemp(prefix="verl-strawq-")
    res = check(directory)
    print(f"taken before the crash: {res['taken_before_crash']}")
    print(f"committed by verl's checkpoint: {res['committed']}")
    print(f"handed out again after it: {res['handed_out_again']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
