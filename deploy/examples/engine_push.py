"""What the framework launchers (``verl_strawq_trainer.py``, ``slime_strawq_trainer.py``)
share: their common flags, and the weight push of their ``--cpu-stand-ins`` mode: the
trainer's weights saved for strawq's version and loaded by every engine with that
``weight_version`` (the producers refuse replies from other versions, so they resume on the
new one)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("engine_push")


def engine_version_push(urls: list[str], weights_dir: str,
                        model: Any) -> Callable[[int], Awaitable[None]]:
    """``push(version)``: ``model``'s state saved under ``weights_dir/v<version>`` and
    loaded by every engine in ``urls`` (``/update_weights_from_disk`` with
    ``weight_version``)."""
    import torch

    from strawq.producers.sglang_client import SGLangClient

    async def push(version: int) -> None:
        path = os.path.join(weights_dir, f"v{version:06d}")
        os.makedirs(path, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(path, "model.pt"))
        async with SGLangClient(urls) as client:
            await client.push_weights(path, weight_version=version)
        log.info("weights of version %d on %d engines", version, len(urls))

    return push


def launcher_parser(doc: str | None, framework: str, *, ckpt: str, steps: str, batch: str,
                    group: str, stand_ins: str) -> argparse.ArgumentParser:
    """The flags both launchers take; ``framework``'s own spelling of each in its help."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--engine-url", action="append", metavar="URL", required=True,
                   help="an engine the producers generate on (repeat for every engine)")
    p.add_argument("--weights-dir", required=True)
    p.add_argument("--ckpt-dir", required=True, help=f"{framework}'s {ckpt}")
    p.add_argument("--steps", type=int, default=100, help=steps)
    p.add_argument("--batch-groups", type=int, required=True,
                   help=f"the collector's batch_groups ({framework}'s {batch})")
    p.add_argument("--group-size", type=int, required=True,
                   help=f"the run's group_size ({framework}'s {group})")
    p.add_argument("--cpu-stand-ins", action="store_true",
                   help=f"{framework}'s {stand_ins} parts as CPU stand-ins (the only mode here)")
    return p
