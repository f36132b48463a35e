"""The weight push of the framework launchers (``verl_strawq_trainer.py``,
``slime_strawq_trainer.py``) in their ``--cpu-stand-ins`` mode: the trainer's weights saved
for strawq's version and loaded by every engine with that ``weight_version`` (the producers
refuse replies from other versions, so they resume on the new one)."""

from __future__ import annotations

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
