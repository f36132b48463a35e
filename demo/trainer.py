"""Trainers the schedules drive: a real GRPO trainer on the tiny model, and a sleeping one.

``GRPOTrainer.train_step`` takes one packed ``Batch`` from the reader API and does one
policy-gradient step with the token-level importance-sampling correction: per token,
``w = min(pi_theta / mu, 2.0)`` (TIS, no gradient through w) against the log-probs the
engine recorded (``mu``, from whatever weight version produced that token), and loss
``-aggregate(w * A * log pi_theta)`` (``loss_agg``, default the mean over samples of token
means) with the collector's GRPO group-normalised advantages; ``log pi_theta`` is taken
at each sample's recorded temperature (``GRPOTrainer.logprobs``).
``push_weights`` saves the weights to a new directory and loads them into every engine;
an engine the push fails on is logged and left out (``failed_engines``) unless every engine
failed. ``fingerprint()`` is then the fingerprint of the weights pushed (published for their
version by the schedule: every engine is attested before producers resume).
``repair_engines(urls, version)`` is the same push of an already saved version, limited to
``urls``: what ``WeightUpdateBracket(repair=...)`` calls for the engines that producers
found on other weights (``engines/``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from strawq.collector.trainer.importance import (DEFAULT_LOSS_AGG, aggregate_loss,
                                                 masked_tis_weights, policy_logprobs,
                                                 sampling_bias_warning)
from strawq.collector.trainer.reader import Batch
from strawq.producers.engines.tiny_model import TinyLM, load_weights, save_weights
from strawq.weights.fingerprint import Fingerprint, fingerprint_of

log = logging.getLogger(__name__)


class TrainerBackend(Protocol):
    def train_step(self, batch: Batch) -> dict[str, float]: ...

    def push_weights(self, version: int) -> None: ...

    def repair_engines(self, urls: list[str], version: int) -> list[str]: ...

    def write_weights(self, version: int) -> str:
        """The rolling update's write: version ``version``'s weights to a directory every
        engine reads; returns it."""
        ...

    def fingerprint(self) -> Fingerprint | None:
        """The fingerprint of the weights ``push_weights`` just pushed
        (``strawq.weights.fingerprint.fingerprint_of``), published for their version so
        every engine is attested before producers resume; None: no attestation."""
        ...


def unpack(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """Packed flat tensors -> padded [S, L] tokens, mask, rollout log-probs, advantages."""
    cu = batch.cu_seqlens.to(torch.int64)
    lens = (cu[1:] - cu[:-1])
    s, length = int(lens.numel()), int(lens.max()) if lens.numel() else 0
    pos = torch.arange(length).unsqueeze(0)
    valid = pos < lens.unsqueeze(1)
    idx = (cu[:-1].unsqueeze(1) + pos).clamp(max=max(int(cu[-1]) - 1, 0))
    def gather(t: torch.Tensor, fill: float = 0) -> torch.Tensor:
        out = t[idx]
        return torch.where(valid, out, torch.as_tensor(fill, dtype=out.dtype))
    tokens = gather(batch.tokens.to(torch.int64))
    mask = gather(batch.loss_mask.to(torch.float32))
    logp_old = gather(batch.rollout_logprobs)
    adv = gather(batch.advantages)
    return tokens, mask, logp_old, adv, valid.reshape(s, length)


@dataclass
class GRPOTrainer:
    """One process owns the model; weights go to the engines through a directory."""

    model: TinyLM
    workdir: str
    engine_urls: list[str]
    lr: float = 1e-3
    is_mode: str = "tis"
    #: loss reduction (``strawq.collector.trainer.importance.LOSS_AGG_MODES``), as the examples
    loss_agg: str = DEFAULT_LOSS_AGG
    keep_versions: int = 3
    history: list[dict[str, float]] = field(default_factory=list)
    #: engines the last push failed on (producers find them behind and keep them out)
    failed_engines: list[str] = field(default_factory=list)
    #: where the model trains (``cpu``, ``cuda``); the weights pushed to the engines are
    #: saved from it and load on any device
    device: str = "cpu"

    def __post_init__(self) -> None:
        torch.manual_seed(0)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"trainer device {self.device!r}: torch sees no CUDA device here; "
                             "use device='cpu'")
        self.model.to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        os.makedirs(self.workdir, exist_ok=True)

    @classmethod
    def from_dir(cls, weights_dir: str, workdir: str, engine_urls: list[str],
                 **kw: Any) -> GRPOTrainer:
        return cls(load_weights(weights_dir), workdir, engine_urls, **kw)

    def logprobs(self, batch: Batch, tokens: torch.Tensor,
                 model: torch.nn.Module | None = None) -> torch.Tensor:
        """[S, L-1] log-probs of ``tokens[:, 1:]`` at each sample's recorded temperature,
        the engines' log-prob convention (SGLang's default: tempered, before top-k / top-p
        truncation), so an on-policy token has ratio 1 at any temperature. Truncated
        sampling is warned about in ``train_step`` (its ratios stay biased)."""
        logits = (model or self.model)(tokens[:, :-1])
        temp = batch.temperature
        t = 1.0 if temp is None else \
            temp.to(tokens.device)[:, None].expand(tokens[:, 1:].shape)
        return policy_logprobs(logits, tokens[:, 1:], t)

    def train_step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        tokens, mask, logp_old, adv, _valid = (t.to(self.device) for t in unpack(batch))
        self.model.train()
        sampling_bias_warning(batch.top_p, batch.top_k)
        logp = self.logprobs(batch, tokens)
        m, lo, a = mask[:, 1:], logp_old[:, 1:], adv[:, 1:]
        w = masked_tis_weights(logp, lo, m, mode=self.is_mode)
        denom = m.sum().clamp(min=1.0)
        # the loss reduction is an explicit option (docs/tuning.md); the default, GRPO's
        # sequence mean of token means, weighs each sample the same whatever its length;
        # over the whole batch's denominators (Batch.totals), as on any number of ranks
        loss = -aggregate_loss(w * a * logp, m, self.loss_agg, totals=batch.totals)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        with torch.no_grad():
            ratio = torch.exp((logp - lo).clamp(-20, 20))
            kl = ((ratio - 1) - (logp - lo)) * m
        resp = batch.response_lens.to(torch.float32)
        out = {
            "loss": float(loss.detach()),
            "reward/mean": float(batch.rewards.mean()) if batch.rewards.numel() else 0.0,
            "response_len/mean": float(resp.mean()) if resp.numel() else 0.0,
            "response_len/max": float(resp.max()) if resp.numel() else 0.0,
            "is/ratio_mean": float((ratio * m).sum() / denom),
            "is/k3_kl": float(kl.sum() / denom),
            "grad_norm": float(grad_norm),
            "train_s": time.perf_counter() - t0,
        }
        out.update({k: float(v) for k, v in batch.stats.items()})
        self.history.append(out)
        return out

    def save(self, version: int) -> str:
        path = os.path.join(self.workdir, f"v{version:06d}")
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_weights(self.model, tmp)
        if os.path.exists(path):  # this version was saved already (a resumed run)
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, path)
        for name in sorted(os.listdir(self.workdir))[:-self.keep_versions]:
            if name.startswith("v") and name != os.path.basename(path):
                shutil.rmtree(os.path.join(self.workdir, name), ignore_errors=True)
        return path

    def write_weights(self, version: int) -> str:
        return self.save(version)

    def push_weights(self, version: int) -> None:
        path = self.save(version)
        self.failed_engines = _push_all(self.engine_urls, path, version)

    def fingerprint(self) -> Fingerprint:
        """Of the model's parameters as the tiny engines serve them (by their parameter
        names, float32: the engines hold what ``save`` wrote)."""
        return fingerprint_of(dict(self.model.named_parameters()), dtype="float32")

    def repair_engines(self, urls: list[str], version: int) -> list[str]:
        """Push the saved weights of ``version`` to ``urls`` (engines on other weights);
        returns the URLs that failed again."""
        path = os.path.join(self.workdir, f"v{version:06d}")
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"cannot repair engines {urls}: the weights of version {version} are not in "
                f"{self.workdir} any more (keep_versions={self.keep_versions}); the next "
                "weight update reaches them")
        return asyncio.run(_push(urls, path, version))

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])


async def _push(urls: list[str], path: str, version: int) -> list[str]:
    """``push_weights`` to each engine on its own; returns those that failed (logged)."""
    from strawq.producers.engine_errors import EngineError
    from strawq.producers.sglang_client import SGLangClient

    async with SGLangClient(urls) as client:
        async def one(u: str) -> str | None:
            try:
                await client.push_weights(path, weight_version=version, url=u)
                return None
            except EngineError as exc:
                log.error("push of version %d to %s failed: %s; producers keep it out of "
                          "rotation until it is repaired", version, u, exc)
                return u
        failed = await asyncio.gather(*(one(u) for u in urls))
    return [u for u in failed if u is not None]


def _push_all(urls: list[str], path: str, version: int) -> list[str]:
    """The update's push: tolerated on some engines, an error when it reached none."""
    failed = asyncio.run(_push(urls, path, version))
    if urls and len(failed) == len(urls):
        raise RuntimeError(f"push of version {version} failed on every engine ({urls}); "
                           "the bracket stays open: retry or abort_weight_update()")
    return failed


@dataclass
class SleepTrainer:
    """The lab's trainer: a step takes ``step_s`` seconds of wall time, per batch."""

    step_s: float
    engine_urls: list[str]
    history: list[dict[str, float]] = field(default_factory=list)
    #: where ``write_weights`` writes (the rolling mode's published versions)
    weights_dir: str | None = None

    def train_step(self, batch: Batch) -> dict[str, float]:
        time.sleep(self.step_s)
        resp = batch.response_lens.to(torch.float32)
        out = {"reward/mean": float(batch.rewards.mean()) if batch.rewards.numel() else 0.0,
               "response_len/mean": float(resp.mean()) if resp.numel() else 0.0,
               "tokens": float(batch.loss_mask.to(torch.float32).sum()),
               "train_s": self.step_s}
        out.update({k: float(v) for k, v in batch.stats.items()})
        self.history.append(out)
        return out

    def push_weights(self, version: int) -> None:
        self.repair_engines(self.engine_urls, version)

    def fingerprint(self) -> Fingerprint | None:
        """None: a sleeping trainer moves the engines' version labels, not their weights."""
        return None

    def write_weights(self, version: int) -> str:
        """The rolling mode's write: a small stand-in for version ``version``'s weights
        (the sim engines load any directory); returns the directory."""
        if self.weights_dir is None:
            raise RuntimeError("SleepTrainer(weights_dir=...) is needed to write weights")
        path = os.path.join(self.weights_dir, f"v{version:06d}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "weights.bin"), "wb") as f:
            f.write(version.to_bytes(8, "little"))
        # a file every version shares, as a checkpoint's config: a version published as a
        # delta (``publish_dir``) copies only ``weights.bin``
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write(json.dumps({"model": "sim", "pad": "x" * 64}))
        return path

    def repair_engines(self, urls: list[str], version: int) -> list[str]:
        from strawq.producers.sglang_client import SGLangClient

        async def go() -> None:
            async with SGLangClient(urls) as client:
                await client.update_weight_version(version, abort_all_requests=True)

        asyncio.run(go())
        return []


def mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")
