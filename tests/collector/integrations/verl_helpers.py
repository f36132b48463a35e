"""verl's real objects for the queue tests: ``RolloutSample`` streams, a rollout worker and a
trainer reader that run verl's own code against a queue actor (``test_verl_queue_ray``)."""

from __future__ import annotations

import asyncio
import os
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"


def rollout_sample(i: int, *, epoch: int = 0, version: int = 0, n: int = 2,
                   prompt_len: int = 8, resp_len: int = 8) -> Any:
    """A ``RolloutSample`` shaped as verl's Rollouter puts it: one prompt, ``n`` responses."""
    from verl import DataProto
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample

    g = torch.Generator().manual_seed(i)
    seq = prompt_len + resp_len
    batch = DataProto.from_single_dict({
        "prompts": torch.randint(0, 1000, (n, prompt_len), generator=g),
        "responses": torch.randint(0, 1000, (n, resp_len), generator=g),
        "input_ids": torch.randint(0, 1000, (n, seq), generator=g),
        "attention_mask": torch.ones(n, seq, dtype=torch.long),
        "rollout_log_probs": -torch.rand(n, resp_len, generator=g),
        "min_global_steps": np.array([version] * n, dtype=object),
        "max_global_steps": np.array([version] * n, dtype=object),
    })
    sid = f"sample_{epoch}_{i}"
    batch.non_tensor_batch["uid"] = np.array([f"uid_{sid}"] * n, dtype=object)
    batch.meta_info["metrics"] = [{"generate_sequences": 0.01, "tool_calls": 0.0}] * n
    return RolloutSample(full_batch=batch, sample_id=sid, epoch=epoch, rollout_status={})


def blob(i: int, **kw: Any) -> bytes:
    import ray

    return bytes(ray.cloudpickle.dumps(rollout_sample(i, **kw)))


def trained_ids(ckpt_dir: Path) -> list[str]:
    """Every sample id in the checkpoints the tracker covers (with repeats, if any)."""
    tracker = ckpt_dir / TRACKER
    if not tracker.exists():
        return []
    last = int(tracker.read_text())
    out: list[str] = []
    for v in range(1, last + 1):
        f = ckpt_dir / f"global_step_{v}" / "ids.txt"
        out += f.read_text().split()
    return out


class RolloutWorker:
    """Puts ``sample_0_<i>`` for i in [start, end) through verl's ``MessageQueueClient`` (or
    ``client``, made by the driver and handed over by Ray as verl's entry point hands its
    client to the Rollouter), logging each id once its put returned."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, queue: Any, start: int, end: int, log_path: str, client: Any = None) -> int:
        from verl.experimental.fully_async_policy.message_queue import MessageQueueClient

        if client is None:
            client = MessageQueueClient(queue)

        async def go() -> int:
            with open(log_path, "a", encoding="utf-8") as log:
                for i in range(start, end):
                    await client.put_sample(sample=blob(i))
                    log.write(f"sample_0_{i}\n")
                    log.flush()
            return end - start

        return asyncio.run(go())


class TrainerReader:
    """verl's own ``FullyAsyncTrainer._get_samples_from_queue`` taking ``required`` samples per
    step; every ``trigger`` steps a checkpoint as verl writes one: ``global_step_<v>/`` (here
    the ids it trained) and then the tracker file."""

    def __init__(self, queue: Any, ckpt_dir: str, required: int, trigger: int) -> None:
        from omegaconf import OmegaConf
        from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
        from verl.experimental.fully_async_policy.message_queue import MessageQueueClient

        self.fn = FullyAsyncTrainer.__ray_metadata__.modified_class._get_samples_from_queue
        self.me = types.SimpleNamespace(
            required_samples=required, dynamic_schedule_enabled=False,
            message_queue_client=MessageQueueClient(queue), tokenizer=None,
            config=OmegaConf.create({"trainer": {"balance_batch": False}}),
            _step_wait_times=[], _step_wait_samples=[])
        self.ckpt = Path(ckpt_dir)
        self.trigger = trigger
        tracker = self.ckpt / TRACKER
        self.version = int(tracker.read_text()) if tracker.exists() else 0
        self.pending: list[str] = []
        self.steps = 0

    def pid(self) -> int:
        return os.getpid()

    def run(self, versions: int) -> int:
        """Train until weight version ``versions`` is checkpointed; returns the version."""
        async def go() -> None:
            while self.version < versions:
                _epoch, batch = await self.fn(self.me)
                if batch is None:
                    return
                uids = batch.non_tensor_batch["uid"]
                self.pending += sorted({str(u)[len("uid_"):] for u in uids})
                self.steps += 1
                if self.steps % self.trigger == 0:
                    self.version += 1
                    d = self.ckpt / f"global_step_{self.version}"
                    d.mkdir(parents=True, exist_ok=True)
                    (d / "ids.txt").write_text("\n".join(self.pending) + "\n")
                    (self.ckpt / TRACKER).write_text(str(self.version))
                    self.pending = []

        asyncio.run(go())
        return self.version
