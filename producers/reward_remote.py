"""A remote reward model over HTTP: one POST per sample, bounded, timed out and retried.

``PluginsConfig(reward="strawq.producers.reward_remote.remote_reward",
reward_args={"url": "http://rm:8000/score", "concurrency": 32, ...})`` (the producer's
``plugins`` section). The request body is
JSON::

    {"task_id": ..., "index": ..., "prompt": row[prompt_key], "prompt_ids": [...],
     "response": <decoded response>, "response_ids": [...], "label": row[label_key],
     "metadata": row[metadata_key], "sample_index": i}

and the reply is a number, or an object with the reward under ``reward_key`` (``reward``,
else ``score``). Connection errors, timeouts, 429 and 5xx are retried (``retries`` times,
exponential back-off); other 4xx and malformed replies are not. A call that still fails
raises, so the runner records the error on the sample (status ``failed``, reward None,
``meta.reward_errors``): a failed call is never trained as a success.

Concurrency is limited per producer process (per event loop), across all its samples.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward model did not give a usable reward for a sample."""


class RemoteReward:
    """``async (task, response_ids, sample_meta) -> float`` calling a reward model server."""

    def __init__(self, url: str, *, concurrency: int = 16, timeout_s: float = 60.0,
                 retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 10.0,
                 headers: Mapping[str, str] | None = None, reward_key: str | None = None,
                 prompt_key: str = "prompt", label_key: str = "label",
                 metadata_key: str = "metadata") -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must be http(s)://..., got {url!r}")
        if concurrency < 1 or retries < 0 or not timeout_s > 0 or backoff_s < 0:
            raise ValueError("remote reward: concurrency >= 1, retries >= 0, timeout_s > 0 "
                             "and backoff_s >= 0 are required")
        self.url = url
        self.concurrency = int(concurrency)
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.headers = dict(headers or {})
        self.reward_key = reward_key
        self.prompt_key = prompt_key
        self.label_key = label_key
        self.metadata_key = metadata_key
        #: per event loop: (semaphore, aiohttp session); a producer has one loop
        self._loops: dict[int, tuple[asyncio.Semaphore, Any]] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    def payload(self, task: Mapping[str, Any], response_ids: list[int],
                meta: Mapping[str, Any]) -> dict[str, Any]:
        row = task.get("row", {})
        row = row if isinstance(row, Mapping) else {}
        return {"task_id": task.get("id"), "index": task.get("index"),
                "prompt": row.get(self.prompt_key), "prompt_ids": meta.get("prompt_ids"),
                "response": meta.get("text"), "response_ids": list(response_ids),
                "label": row.get(self.label_key, row.get("answer")),
                "metadata": row.get(self.metadata_key),
                "sample_index": meta.get("sample_index")}

    def _state(self) -> tuple[asyncio.Semaphore, Any]:
        import aiohttp

        loop = asyncio.get_running_loop()
        st = self._loops.get(id(loop))
        if st is None or st[1].closed:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers,
                connector=aiohttp.TCPConnector(limit=self.concurrency))
            st = (asyncio.Semaphore(self.concurrency), session)
            self._loops[id(loop)] = st
        return st

    async def aclose(self) -> None:
        loop_id = id(asyncio.get_running_loop())
        st = self._loops.pop(loop_id, None)
        if st is not None:
            await st[1].close()

    def _value(self, body: Any) -> float:
        value = body
        if isinstance(body, Mapping):
            keys = [self.reward_key] if self.reward_key else ["reward", "score"]
            value = next((body[k] for k in keys if k in body), None)
            if value is None:
                raise RemoteRewardError(f"reward model reply has none of {keys}: "
                                        f"{str(body)[:200]}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise RemoteRewardError(f"reward model returned {str(value)[:100]!r}; expected a "
                                    "finite number")
        return float(value)

    async def __call__(self, task: dict[str, Any], response_ids: list[int],
                       meta: dict[str, Any]) -> float:
        import aiohttp

        sem, session = self._state()
        body = self.payload(task, response_ids, meta)
        last: str = ""
        async with sem:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                for attempt in range(self.retries + 1):
                    if attempt:
                        delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                        await asyncio.sleep(delay * (0.5 + random.random() / 2))
                    try:
                        async with session.post(self.url, json=body) as resp:
                            text = await resp.text()
                            if resp.status == 429 or resp.status >= 500:
                                last = f"HTTP {resp.status}: {text[:200]}"
                                continue
                            if resp.status >= 400:
                                raise RemoteRewardError(f"reward model refused the request: "
                                                        f"HTTP {resp.status}: {text[:200]}")
                            try:
                                reply = json.loads(text)
                            except ValueError as exc:
                                raise RemoteRewardError(f"reward model reply is not JSON: "
                                                        f"{text[:200]!r}") from exc
                            return self._value(reply)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        last = f"{type(exc).__name__}: {exc}"
                        log.info("remote reward %s: %s (try %d/%d)", self.url, last,
                                 attempt + 1, self.retries + 1)
            finally:
                self.in_flight -= 1
        raise RemoteRewardError(f"reward model {self.url} failed after {self.retries + 1} "
                                f"tries: {last}")


def remote_reward(**kwargs: Any) -> RemoteReward:
    """Reward factory for ``ProducerConfig.plugins.reward_args`` (see ``RemoteReward``)."""
    return RemoteReward(**kwargs)
