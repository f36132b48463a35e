"""The model's EOS ids: which token ends a response, resolved once when a producer starts.

An aborted reply can end on EOS (SGLang 0.5.23 applies a pending abort before its stop
check): such a segment is final, and only a producer that knows the EOS ids can tell. Where
they come from is :func:`resolve_eos_ids`; a producer that cannot find them refuses to
start (unless ``ignore_eos``) instead of resuming past the end of a response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from strawq.errors import ConfigError

from strawq.producers.engine_client import EngineClient, optional_calls
from strawq.producers.engine_errors import EngineError

log = logging.getLogger(__name__)


async def resolve_eos_ids(client: EngineClient, *, configured: Iterable[int] | None,
                          tokenizer: Any = None, ignore_eos: bool = False,
                          who: str = "producer") -> frozenset[int]:
    """The model's EOS ids, from the first source that names them.

    1. ``configured`` (``GenerationConfig.eos_token_ids``, ``engine.generation``);
    2. the engine: ``/model_info``'s ``eos_token_id`` (strawq's local engines report it;
       SGLang 0.5.23 does not);
    3. the tokenizer plugin: its ``eos_token_id`` / ``eos_token_ids`` (a Hugging Face
       tokenizer's own);
    4. the model's ``generation_config.json`` / ``config.json``, when the engine's
       ``model_path`` (or ``tokenizer_path``) is a directory readable here.

    None of them: :class:`ConfigError` saying what was tried, unless ``ignore_eos`` (then
    no token is a stop token and nothing needs them; an empty set is returned).
    """
    if configured is not None:
        return frozenset(int(t) for t in configured)
    tried: list[str] = []
    infos: list[tuple[str, Mapping[str, Any]]] = []
    probe = optional_calls(client).model
    if probe is None:
        tried.append("the engine client makes no model_info call")
    else:
        for url in client.worker_urls:
            try:
                reply: Any = await probe.model_info(url)
            except EngineError as exc:
                tried.append(f"{url}/model_info failed ({exc})")
                continue
            if isinstance(reply, Mapping):
                infos.append((url, reply))
                break
    for url, info in infos:
        found = _as_ids(info.get("eos_token_id"))
        if found:
            return found
        tried.append(f"{url}/model_info reports no eos_token_id")
    found = tokenizer_eos_ids(tokenizer)
    if found:
        return found
    tried.append("no tokenizer" if tokenizer is None else
                 f"the tokenizer ({type(tokenizer).__name__}) names no EOS id")
    for _, info in infos:
        found, where = config_file_eos_ids(info)
        if found:
            return found
        tried.append(where)
    if ignore_eos:
        log.info("%s: the model's EOS ids are unknown (%s); ignore_eos is set, so none is "
                 "needed", who, "; ".join(tried))
        return frozenset()
    raise ConfigError(
        f"{who} cannot find the model's EOS ids ({'; '.join(tried)}). Without them an abort "
        "that lands on EOS would resume past the end of the response. Set "
        "engine.generation.eos_token_ids (e.g. --set engine.generation.eos_token_ids=[2]), "
        "give a tokenizer (--set plugins.tokenizer=hf:<model>), or set sampling.ignore_eos "
        "when no token should stop a response")


def tokenizer_eos_ids(tokenizer: Any) -> frozenset[int]:
    """EOS ids a tokenizer plugin names: ``eos_token_ids`` / ``eos_token_id`` on it, or on
    the Hugging Face tokenizer it wraps (``HFTokenizer.tokenizer``)."""
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        if obj is None:
            continue
        for attr in ("eos_token_ids", "eos_token_id"):
            found = _as_ids(getattr(obj, attr, None))
            if found:
                return found
    return frozenset()


def config_file_eos_ids(info: Mapping[str, Any]) -> tuple[frozenset[int], str]:
    """EOS ids from the model's ``generation_config.json`` / ``config.json`` under the
    engine's ``model_path`` / ``tokenizer_path``, when readable here; else what was tried."""
    tried = []
    for key in ("model_path", "tokenizer_path"):
        path = info.get(key)
        if not isinstance(path, str) or not path:
            continue
        for name in ("generation_config.json", "config.json"):
            try:
                config = json.loads((Path(path) / name).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(config, Mapping):
                found = _as_ids(config.get("eos_token_id"))
                if found:
                    return found, ""
        tried.append(f"{key} {path!r} has no readable config naming eos_token_id here")
    return frozenset(), "; ".join(tried) or "the engine reports no model_path"


def eos_ids_from_model_info(info: Mapping[str, Any]) -> frozenset[int]:
    """EOS ids from ``/model_info``: its ``eos_token_id`` (strawq's local engines), else the
    model's config files when ``model_path`` is readable here (SGLang 0.5.23 reports none)."""
    return _as_ids(info.get("eos_token_id")) or config_file_eos_ids(info)[0]


def _as_ids(value: Any) -> frozenset[int]:
    if isinstance(value, bool):
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, (list, tuple, set, frozenset)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return frozenset(value)
    return frozenset()
