"""The trainer side of a strawq run, reduced to its skeleton (rank 0 of one process).

    python deploy/examples/trainer_loop.py RUN_DIR --router-url http://router:30000 \
        --weights-dir /mnt/jfs/strawq/weights --steps 100

or, without a router, every engine by URL (``--engine-url`` once per engine):

    python deploy/examples/trainer_loop.py RUN_DIR --engine-url http://node1:30001 \
        --engine-url http://node2:30001 --weights-dir /mnt/jfs/strawq/weights --steps 100

Replace ``train_step`` and ``save_weights`` with your model. Everything else is the real
API: ``BatchReader`` (packed batches, acks, checkpoint state), ``WeightUpdateBracket``
(pause producers, push weights to every engine, resume) and the importance-sampling
helpers. See docs/api.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os

from strawq.collector.trainer.importance import (DEFAULT_LOSS_AGG, batch_loss, masked_tis_weights,
                                                 sampling_bias_warning)
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.errors import RunFinished
from strawq.producers.sglang_client import SGLangClient

log = logging.getLogger("trainer_loop")


def train_step(batch: Batch) -> float:
    """Your optimizer step. Here: the loss with logp_new = the rollout log-probs.

    Your model's log-probs must be taken under each sample's sampling transform
    (``batch.temperature``, ``batch.top_k``, ``batch.top_p``: see
    ``strawq.collector.trainer.importance.policy_logprobs``), or on-policy ratios are not 1.
    """
    sampling_bias_warning(batch.top_p, batch.top_k)  # if you score the full softmax
    logp_new = batch.rollout_logprobs.clone().requires_grad_()   # float32 [T]: your model's
    w = masked_tis_weights(logp_new, batch.rollout_logprobs, batch.loss_mask, mode="tis")
    # the same reduction as the demo trainer (docs/tuning.md, "Loss aggregation"), over the
    # whole batch's denominators: with several data-parallel ranks, the mean of their
    # gradients (DDP) is the whole batch's gradient (docs/api.md, "Loss over ranks")
    loss = -batch_loss(w * batch.advantages * logp_new, batch, DEFAULT_LOSS_AGG)
    loss.backward()
    return float(loss.detach())


def restore_model(checkpoint: str) -> None:
    """Your model and optimizer restore, from the checkpoint saved with the reader state."""
    log.info("model restored from %s (placeholder)", checkpoint)


def save_weights(weights_dir: str, version: int) -> str:
    """Your checkpoint writer: a directory every engine can load (on the shared mount)."""
    path = os.path.join(weights_dir, f"v{version:06d}")
    os.makedirs(path, exist_ok=True)
    return path


class Engines:
    """Where the weights go: the workers a router lists, or a plain list of engine URLs."""

    def __init__(self, router_url: str | None = None, urls: tuple[str, ...] = ()) -> None:
        self.router_url = router_url
        self.urls = urls

    def client(self, only: list[str] | None = None) -> SGLangClient:
        """A client for every engine (``only``: just those URLs). Control calls go to each
        worker directly: a router lists its workers but does not route weight updates."""
        if only:
            return SGLangClient(only)
        return SGLangClient(self.urls, router_url=None if self.urls else self.router_url)


def push_weights(engines: Engines, weights_dir: str, version: int,
                 urls: list[str] | None = None) -> None:
    """Load version ``version`` into every engine (those the router lists, or the
    ``--engine-url`` list). ``push_weights`` pauses each engine (abort), waits until it is
    idle, updates and continues: SGLang refuses to flush its cache while requests run.
    With ``urls``: only those engines, with the weights already saved for ``version`` (the
    repair of engines producers found on other weights, docs/operations.md)."""
    path = (os.path.join(weights_dir, f"v{version:06d}") if urls
            else save_weights(weights_dir, version))

    async def push() -> None:
        async with engines.client(urls) as client:
            await client.push_weights(path, weight_version=version)

    asyncio.run(push())


def save_checkpoint(path: str, state: dict[str, object]) -> None:
    """Write the reader state durably (yours: with the model and optimizer state)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--router-url", help="a router: the weights go to every worker it lists")
    where.add_argument("--engine-url", action="append", metavar="URL",
                       help="an engine, without a router (repeat for every engine)")
    p.add_argument("--weights-dir", required=True,
                   help="where each version's weights are saved (a mount every engine reads)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint", default="trainer_state.json",
                   help="where the reader state is saved (with your model checkpoint)")
    p.add_argument("--metrics-jsonl", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    engines = Engines(args.router_url, tuple(args.engine_url or ()))
    reader = BatchReader.open(args.run_dir, rank=0, world_size=1,
                              metrics_jsonl=args.metrics_jsonl)
    restored = os.path.exists(args.checkpoint)
    if restored:
        with open(args.checkpoint, encoding="utf-8") as f:
            reader.load_state_dict(json.load(f))
        restore_model(args.checkpoint)
    # engines producers keep out of rotation (on other weights) get the run's version
    reader.bracket.start_repairs(
        lambda urls, v: push_weights(engines, args.weights_dir, v, urls))
    push = functools.partial(push_weights, engines, args.weights_dir)
    if restored:
        # The engines run whatever was pushed last: weights trained after this checkpoint
        # (lost with the crash), or a previous trainer stopped inside a weight update. Put
        # the restored weights on every engine, under a new version, before training
        # resumes; rollouts of the lost weights are then older versions, corrected per
        # token and bounded by the staleness rule like any other.
        rep = reader.bracket.restore(push, reader.state_dict(), timeout=600)
        log.info("restored weights pushed to the engines as version %d", rep.version)
    elif reader.bracket.is_open:  # a previous trainer died inside a weight update
        reader.bracket.weight_update(push, timeout=600)

    for step in range(args.steps):
        try:
            batch = reader.next_batch(timeout=600)
        except RunFinished as end:  # the dataset's last pass is trained: nothing more
            log.info("step %d: %s", step, end)
            break
        loss = train_step(batch)
        # the one order (docs/api.md): optimizer step -> ack -> weight update ->
        # checkpoint (state_dict, save) -> commit
        reader.ack(batch)
        rep = reader.bracket.weight_update(push, timeout=600)
        state = reader.state_dict()
        save_checkpoint(args.checkpoint, state)
        reader.commit(state)  # the checkpoint is durable: GC may collect what it covers
        log.info("step %d: batch %d (%d samples, %d tokens), loss %.4f, version %d, "
                 "staleness mean %.2f", step, batch.seq, batch.num_samples, batch.num_tokens,
                 loss, rep.version, batch.stats.get("staleness/mean", 0.0))
    reader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
