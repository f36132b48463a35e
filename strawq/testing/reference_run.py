"""The trainer side's oracle, a run to check against: ``make_reference_run`` (one published
batch of mixed lengths, temperatures, truncations, loss-mask holes and versions) and
``publish_batch`` (a run whose collector publishes the groups a test builds).

Part of ``strawq.testing.reference``, which exports all of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strawq.delivery.batches import BatchStore
from strawq.ondisk.groups import GroupData
from strawq.storage import open_storage
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing.reference_model import TinyPolicy


def make_reference_run(path: str, *, groups: int = 12, group_size: int = 4, seed: int = 0,
                       max_response: int = 60, vocab: int = 64,
                       policy: torch.nn.Module | None = None,
                       logprob_noise: float = 0.3,
                       pack_ranks: int | None = None) -> tuple[str, int]:
    """Create a run under ``path`` with one published batch of ``groups`` groups; returns
    the run's queue directory and the batch number.

    The samples mix what the trainer side must get right: response lengths from 0 to
    ``max_response`` (a few groups much longer than the rest, so token-balanced shards hold
    very different sample counts), prompt lengths 1 to 8, loss-mask holes (tool-output
    tokens), tokens from up to three weight versions, rewards giving non-trivial GRPO
    advantages, and per-sample sampling parameters (temperature 0.6 to 1.2, some with top-k
    and top-p) recorded in ``meta["params"]`` as producers record them.

    Responses are sampled from ``policy`` (default ``TinyPolicy(vocab=vocab)``, the model the
    checks score with) at each sample's parameters, top-k and top-p cut jointly as SGLang
    does, so every token is one the truncated behaviour policy can draw; the recorded
    log-probs are the policy's tempered, untruncated ones (SGLang's convention) plus
    Gaussian noise of ``logprob_noise`` nats, so the importance weights spread over their
    clipping and masking ranges as an off-policy batch's do.
    """
    from strawq.collector.trainer.importance import sampling_mask

    gen = policy if policy is not None else TinyPolicy(vocab=vocab)
    torch_rng = torch.Generator().manual_seed(seed)

    def sample(prompt: list[int], n: int, p: Mapping[str, Any]) -> tuple[list[int], list[float]]:
        toks = list(prompt)
        lps: list[float] = []
        with torch.no_grad():
            for _ in range(n):
                x = torch.tensor(toks)
                logits = gen(x, torch.arange(len(toks)), torch.tensor([0, len(toks)]))[-1]
                tempered = logits.float() / float(p["temperature"])
                drop = sampling_mask(tempered, (), top_p=float(p["top_p"]),
                                     top_k=int(p["top_k"]))
                cut = tempered if drop is None else tempered.masked_fill(drop, float("-inf"))
                tok = int(torch.multinomial(cut.softmax(-1), 1, generator=torch_rng))
                lps.append(float(torch.log_softmax(tempered, -1)[tok]))
                toks.append(tok)
        return toks[len(prompt):], lps
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(0, vocab, int(rng.integers(1, 9)))]
               for _ in range(groups)]

    def build(lease: Lease) -> GroupData:
        long_group = rng.random() < 0.2
        hi = max_response if long_group else max(max_response // 6, 2)
        lens = rng.integers(0 if not long_group else hi // 2, hi + 1, group_size)
        total = int(lens.sum())
        mask = (rng.random(total) > 0.15).astype(np.uint8)
        params = []
        for _ in range(group_size):  # per sample
            truncated = rng.random() < 0.4
            params.append({"temperature": float(rng.choice([0.6, 0.8, 1.0, 1.2])),
                           "top_p": float(rng.choice([0.7, 0.9])) if truncated else 1.0,
                           "top_k": int(rng.choice([5, 20])) if truncated else -1,
                           "max_new_tokens": int(hi)})
        prompt = [int(t) for t in lease.task["row"]["prompt"]]
        toks: list[int] = []
        lps: list[float] = []
        for i in range(group_size):
            t_i, lp_i = sample(prompt, int(lens[i]), params[i])
            toks += t_i
            lps += lp_i
        noisy = np.asarray(lps, np.float64) + rng.normal(0.0, logprob_noise, total)
        grp = GroupData(
            task_id=lease.task_id, index=int(lease.task["index"]),
            prompt_ids=np.asarray(prompt, np.int32), sample_lens=lens.tolist(),
            tokens=np.asarray(toks, np.int32),
            logprobs=np.minimum(noisy, 0.0).astype(np.float32),
            versions=rng.integers(0, 3, total).astype(np.int64), loss_mask=mask,
            rewards=[float(x) for x in rng.random(group_size).round(2)],
            status=["completed"] * group_size, meta={"params": params})
        return grp

    return publish_batch(path, prompts, group_size, build, pack_ranks=pack_ranks)


def complete_groups(col: Any, groups: int, build: Callable[[Lease], GroupData],
                    producer: str) -> None:
    """Start ``col`` (a ``Collector``) and complete ``groups`` tasks of its run, each with
    ``build(lease)``, stepping the collector between claims (it releases and batches)."""
    col.start(wait=False)
    col.step()
    done = 0
    for _ in range(20 * groups + 1):
        if done >= groups:
            return
        leases = col.queue.claim(producer, groups)
        if not leases:
            col.step()
            continue
        for lease in leases:
            col.queue.complete(lease, build(lease))
            done += 1
    raise RuntimeError(f"only {done} of {groups} tasks were released to complete")


def publish_batch(path: str, prompts: Sequence[Sequence[int]], group_size: int,
                  build: Callable[[Lease], GroupData], *,
                  pack_ranks: int | None = None,
                  batch_groups: int | None = None) -> tuple[str, int]:
    """A run under ``path`` whose collector publishes one batch of ``len(prompts)`` groups,
    each ``build(lease)`` for its claimed task (rows ``{"prompt": ids, "i": index}``);
    returns the run's queue directory and the batch number. ``pack_ranks``: the collector
    also packs the batch's rank shards for that world size (``CollectorConfig``).
    ``batch_groups``: publish batches of that many groups instead, all at once (no prefetch
    or staleness bound; the number returned is the last one's)."""
    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.config import QueueConfig
    from strawq.data.dataset import Dataset

    os.makedirs(path, exist_ok=True)
    ds = os.path.join(path, "dataset.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"prompt": [int(t) for t in prompt], "i": i}) + "\n")
    groups = len(prompts)
    run_dir = os.path.join(path, "run")
    q = RunQueue.create(open_storage(run_dir, writer_id="setup", fsync=False),
                        QueueConfig(fsync=False, group_size=group_size,
                                    release_batch=max(groups, 1)))
    cfg = CollectorConfig(
        batch_groups=batch_groups or groups, max_running=groups, max_ready=groups,
        poll_interval_s=0, gc_interval_s=1e9, pack_ranks=pack_ranks)
    if batch_groups is not None:  # every batch published at once
        cfg = dataclasses.replace(cfg, max_prefetch_batches=groups, max_staleness=None)
    col = Collector(q, Dataset(ds), cfg)
    complete_groups(col, groups, build, "reference")
    col.step()
    seqs, _ = BatchStore(q).batch_seqs()
    if not seqs:
        raise RuntimeError(f"{path}: the collector published no batch")
    return run_dir, int(max(seqs))
