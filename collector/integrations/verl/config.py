"""Where strawq reads verl's config: a dotted entry, and the queue directory it names.

Shared by the durable queue (``strawq.collector.integrations.verl.queue``) and the resuming
rollout client (``strawq.collector.integrations.verl.client``), which finds the queue's
``PartialStore`` there; neither imports the other for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from strawq.errors import ConfigError

#: the config entry that names the queue directory (default: under the checkpoint directory)
DIR_KEY = "async_training.strawq_queue_dir"


def _cfg(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b`` for an OmegaConf ``DictConfig``, a dict or None."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "get"):
            node = node.get(part, None)
        else:
            node = getattr(node, part, None)
    return default if node is None else node


def queue_dir(config: Any) -> str:
    """The queue directory a verl config names: ``async_training.strawq_queue_dir``, or
    ``<trainer.default_local_dir>/strawq_queue`` beside verl's checkpoints."""
    explicit = _cfg(config, DIR_KEY)
    if explicit:
        return os.path.abspath(str(explicit))
    ckpt = _cfg(config, "trainer.default_local_dir")
    if not ckpt:
        raise ConfigError("StrawqMessageQueue: expected async_training.strawq_queue_dir or "
                          "trainer.default_local_dir in the verl config, found neither; set "
                          "+async_training.strawq_queue_dir=/path/to/queue")
    return os.path.join(os.path.abspath(str(ckpt)), "strawq_queue")


__all__ = ["DIR_KEY", "queue_dir"]
