"""Call a slime reward function unchanged: ``--custom-rm-path`` functions, or slime's own
``rm_hub.async_rm`` (``--rm-type math``, ``deepscaler``, ``dapo``, ``remote_rm``, ...).

``PluginsConfig(reward="strawq.producers.reward_slime.slime_rm",
reward_args={"path": "my_pkg.rm.custom_rm", "args": {"rm_type": "math"}})`` (the producer's
``plugins`` section)

slime calls ``await rm(args, sample)`` with its argparse namespace and a
``slime.utils.types.Sample``; this adapter builds both: ``args`` from ``reward_args["args"]``
(slime's flag names with underscores; ``custom_rm_path`` and ``rm_type`` default to None),
and a real slime ``Sample`` per finished strawq sample:

===================  ====================================================================
Sample field         from
===================  ====================================================================
``prompt``           ``row[prompt_key]`` (text or chat messages; slime's ``input_key``)
``tokens``           prompt ids + response ids
``response``         the response ids decoded by the producer's tokenizer (needed: without
                     one the reward raises, rather than score an empty response)
``response_length``  ``len(response_ids)``
``label``            ``row[label_key]`` as a string (slime's ``label_key``)
``metadata``         ``row[metadata_key]`` (slime's ``metadata_key``) when a mapping
``status``           completed / truncated (from the strawq sample)
``index``            task index · G + sample index; ``group_index`` = task index
===================  ====================================================================

A reward that returns a mapping is read at ``reward_key`` (slime's ``--reward-key``). A
plain (non-async) function is called too. Needs slime importable on the producer nodes.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from strawq.errors import ConfigError

from strawq.producers.plugins import finite_reward, resolve


def _sample_cls() -> Any:
    try:
        from slime.utils.types import Sample
    except ImportError as exc:
        raise ConfigError("the slime reward adapter needs slime installed on every producer "
                          f"node ({exc}); see docs/slime.md") from exc
    return Sample


def make_sample(task: Mapping[str, Any], response_ids: list[int], meta: Mapping[str, Any], *,
                prompt_key: str = "prompt", label_key: str = "label",
                metadata_key: str = "metadata", group_size: int = 1) -> Any:
    """A slime ``Sample`` for one finished strawq sample. Raises ``ValueError`` without
    ``meta["text"]`` (a producer without a decoding tokenizer): slime's reward functions
    read ``Sample.response``."""
    cls = _sample_cls()
    if meta.get("text") is None:
        raise ValueError("slime_rm needs the decoded response (slime's Sample.response): "
                         "configure the producer's tokenizer (ProducerConfig.tokenizer)")
    row = task.get("row", {})
    row = row if isinstance(row, Mapping) else {}
    index = int(task.get("index", 0))
    label = row.get(label_key, row.get("answer") if label_key == "label" else None)
    md = row.get(metadata_key)
    status = {"completed": cls.Status.COMPLETED, "truncated": cls.Status.TRUNCATED}.get(
        str(meta.get("status")), cls.Status.COMPLETED)
    prompt_ids = [int(t) for t in meta.get("prompt_ids") or []]
    sample = cls(group_index=index, index=index * group_size + int(meta.get("sample_index") or 0),
                 prompt=row.get(prompt_key, ""), tokens=prompt_ids + [int(t) for t in response_ids],
                 response=str(meta["text"]), response_length=len(response_ids),
                 label=None if label is None else str(label),
                 metadata=dict(md) if isinstance(md, Mapping) else {})
    sample.status = status
    return sample


def slime_rm(path: str | None = None, *, args: Mapping[str, Any] | None = None,
             reward_key: str | None = None, prompt_key: str = "prompt",
             label_key: str = "label", metadata_key: str = "metadata",
             group_size: int = 1) -> Callable[..., Any]:
    """Reward factory: ``async (task, response_ids, meta) -> float`` calling slime's
    ``rm(args, sample)`` at ``path`` (default: ``slime.rollout.rm_hub.async_rm``)."""
    _sample_cls()
    ns_args = {"custom_rm_path": None, "rm_type": None, "reward_key": reward_key,
               **dict(args or {})}
    namespace = argparse.Namespace(**ns_args)
    if path is None:
        path = "slime.rollout.rm_hub.async_rm"
    fn = resolve(path, what="slime reward function", arity=2)
    key = reward_key or ns_args.get("reward_key")

    async def reward(task: dict[str, Any], response_ids: list[int],
                     meta: dict[str, Any]) -> float:
        sample = make_sample(task, response_ids, meta, prompt_key=prompt_key,
                             label_key=label_key, metadata_key=metadata_key,
                             group_size=group_size)
        value = fn(namespace, sample)
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, Mapping):
            if not key or key not in value:
                raise ValueError(f"slime reward returned a mapping {sorted(value)}; set "
                                 "reward_key (slime's --reward-key) to the reward's key")
            value = value[key]
        return finite_reward(value)

    reward.__name__ = f"slime_rm[{path}]"
    return reward
