"""A Megatron-core trainer loop on strawq, reduced to its skeleton.

Launch one process per GPU (``torchrun``); each data-parallel rank reads its own shard:

    torchrun --nproc-per-node 8 deploy/examples/megatron_trainer_loop.py RUN_DIR \
        --tp 2 --cp 2 --max-tokens-per-gpu 16384 --model-provider mypkg.model:provider \
        --router-url http://router:30000 --weights-dir /mnt/jfs/strawq/weights

``--toy`` runs the same loop on a CPU in one process with a tiny embedding + linear model
(gloo, TP = CP = 1): the data path, the loss, the acks and the weight push are the real
ones. Without a router, name every engine (``--engine-url`` once per engine):

    python deploy/examples/megatron_trainer_loop.py RUN_DIR --toy --steps 10 \
        --engine-url http://127.0.0.1:30001 --weights-dir /tmp/weights

Rank 0 saves each version's weights under ``--weights-dir`` and loads them into every
engine (``SGLangClient.push_weights``: pause, update, continue), inside the weight-update
bracket; engines producers found on other weights get the run's version again. What you
replace for a real job: ``--model-provider`` (returns your ``GPTModel``) and
``save_weights`` (here the toy model's ``state_dict``; yours gathers the TP/PP shards and
writes a checkpoint your engines load). Docs: docs/megatron.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from strawq.collector.trainer.importance import (DEFAULT_LOSS_AGG, LOSS_AGG_MODES, batch_loss,
                                                 masked_tis_weights, sampling_bias_warning)
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.errors import RunFinished
from strawq.producers.sglang_client import SGLangClient

with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from strawq.collector.integrations.megatron import (
        MegatronBatcher,
        MicroBatch,
        ParallelLayout,
        sync_num_micro_batches,
    )

log = logging.getLogger("megatron_trainer_loop")


class ToyModel(torch.nn.Module):
    """Stands in for a ``GPTModel``: logits ``[s, b, vocab]`` from input ids ``[b, s]``."""

    def __init__(self, vocab: int = 512, hidden: int = 32) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        return self.out(self.emb(input_ids % self.vocab)).transpose(0, 1).contiguous()


def token_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """log π(labels[t]) per position, ``[1, t]``, at each label's recorded temperature (the
    engines record ``log_softmax(logits / T)``: scored at T = 1 a T = 0.6 rollout's
    on-policy tokens get ratios far from 1). Vocab-parallel under TP; logits from the
    model in float32, divided per position by the micro-batch's ``temperature``."""
    logits = model(input_ids=mb.tokens, position_ids=None, attention_mask=None,
                   packed_seq_params=mb.packed_seq_params)          # [t, 1, V]
    labels = mb.labels.t() % logits.shape[-1]                       # [t, 1], int32 is fine
    temp = mb.temperature.t().unsqueeze(-1).clamp(min=1e-6)         # [t, 1, 1]
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.float() / temp, labels)
    return -nll.t()                                                  # [1, t]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batcher: MegatronBatcher,
               batch: Batch, loss_agg: str = DEFAULT_LOSS_AGG) -> float:
    """One optimizer step over this rank's shard: micro-batches under the token budget."""
    sampling_bias_warning(batch.top_p, batch.top_k)  # the engines record untruncated log-probs
    plan = batcher.plan(batch)
    # every DP rank must run as many micro-batches (pipeline schedules need one count)
    n_mb = sync_num_micro_batches(len(plan), ps.get_data_parallel_group())
    mbs = batcher.micro_batches(batch, min_micro_batches=n_mb)
    opt.zero_grad()
    total = 0.0
    for mb in mbs:
        logp = token_logprobs(model, mb)
        w = masked_tis_weights(logp, mb.rollout_logprobs, mb.loss_mask, mode="tis")
        # this micro-batch's share of the whole batch's loss (global denominators, scaled
        # for the mean over DP × CP below): summed over micro-batches, not averaged
        loss = -batch_loss(w * mb.advantages * logp, mb, loss_agg)
        loss.backward()
        total += float(loss.detach())
    # gradients: the mean over DP × CP (Megatron's DDP wrapper does this for a real model)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    ranks = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= ranks
    opt.step()
    return total


def save_weights(model: torch.nn.Module, weights_dir: str, version: int) -> str:
    """Your checkpoint writer: a directory every engine can load (on the shared mount).
    Here the toy model's ``state_dict``; a real job gathers the TP/PP shards first (and
    converts them to the engine's format, e.g. Hugging Face)."""
    path = os.path.join(weights_dir, f"v{version:06d}")
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, "model.pt.tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, os.path.join(path, "model.pt"))
    return path


class WeightPush:
    """Rank 0's push path: save the weights of ``version`` and load them into every engine
    (the workers a router lists, or the ``--engine-url`` list). ``SGLangClient.push_weights``
    pauses each engine (abort), waits until it is idle, updates and continues."""

    def __init__(self, model: torch.nn.Module, weights_dir: str, *,
                 router_url: str | None = None, urls: tuple[str, ...] = ()) -> None:
        self.model = model
        self.weights_dir = weights_dir
        self.router_url = router_url
        self.urls = urls

    def __call__(self, version: int) -> None:
        """The bracket's push: the current weights become ``version`` on every engine."""
        self._push(save_weights(self.model, self.weights_dir, version), version, None)

    def repair(self, urls: list[str], version: int) -> None:
        """Engines producers found on other weights get ``version``'s saved weights."""
        self._push(os.path.join(self.weights_dir, f"v{version:06d}"), version, urls)

    def _push(self, path: str, version: int, only: list[str] | None) -> None:
        if not self.urls and self.router_url is None:
            log.warning("weights for version %d saved at %s, loaded into no engine (no "
                        "--router-url or --engine-url)", version, path)
            return

        async def go() -> None:
            client = (SGLangClient(only) if only else
                      SGLangClient(self.urls, router_url=None if self.urls else self.router_url))
            async with client:
                await client.push_weights(path, weight_version=version)

        asyncio.run(go())
        log.info("weights for version %d (%s) loaded into the engines", version, path)


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write the reader state durably (yours: with the model and optimizer checkpoint)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_trainer(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 state: dict[str, Any]) -> None:
    """The model, the optimizer and the reader state in one atomic write: a job killed
    while saving restarts from the previous checkpoint whole, never a model of step k with
    a reader state of step k − 1 (batch k trained twice) or the reverse (batch k lost).
    Yours: Megatron's ``save_checkpoint`` with the reader state in its extra state."""
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "reader": state},
               tmp)
    os.replace(tmp, path)


def load_provider(path: str) -> Callable[[], torch.nn.Module]:
    mod, _, name = path.replace(":", ".").rpartition(".")
    fn: Callable[[], torch.nn.Module] = getattr(importlib.import_module(mod), name)
    return fn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    p.add_argument("--pad-multiple", type=int, default=1)
    p.add_argument("--model-provider", default=None, help="dotted path to your GPTModel provider")
    p.add_argument("--toy", action="store_true", help="CPU, one process, a tiny model")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--router-url", help="a router: the weights go to every worker it lists")
    where.add_argument("--engine-url", action="append", metavar="URL",
                       help="an engine, without a router (repeat for every engine)")
    p.add_argument("--weights-dir", default=None,
                   help="where each version's weights are saved (a mount every engine reads; "
                        "default: weights/ next to --checkpoint)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint", default="trainer_state.json")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss-agg", default=DEFAULT_LOSS_AGG, choices=LOSS_AGG_MODES,
                   help="loss reduction over the whole batch (docs/tuning.md)")
    args = p.parse_args(argv)
    if not args.toy and args.router_url is None and not args.engine_url:
        p.error("expected --router-url URL or --engine-url URL (the engines the new weights "
                "go to); found neither. Only --toy runs without engines")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if not dist.is_initialized():
        if args.toy:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("gloo" if args.toy else "nccl")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                     context_parallel_size=args.cp)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    first = dist.get_rank() == 0
    model = ToyModel() if args.toy or args.model_provider is None else \
        load_provider(args.model_provider)()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # one reader per DP rank: every TP/CP rank of a DP group reads the same shard
    reader = BatchReader.open(args.run_dir, rank=dp_rank, world_size=dp_size)
    batcher = MegatronBatcher(ParallelLayout.from_parallel_state(pad_multiple=args.pad_multiple),
                              max_tokens_per_gpu=args.max_tokens_per_gpu)
    weights_dir = args.weights_dir or os.path.join(
        os.path.dirname(os.path.abspath(args.checkpoint)), "weights")
    push = WeightPush(model, weights_dir, router_url=args.router_url,
                      urls=tuple(args.engine_url or ()))
    if first:  # engines producers keep out of rotation (on other weights) get the run's version
        reader.bracket.start_repairs(push.repair)
    trainer_ckpt = f"{args.checkpoint}.trainer.pt"
    restored = os.path.exists(trainer_ckpt) or os.path.exists(args.checkpoint)
    if os.path.exists(trainer_ckpt):  # the model, optimizer and reader state of one step
        saved = torch.load(trainer_ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        reader.load_state_dict(saved["reader"])
    elif restored:  # a reader state without a model (written by an older version)
        with open(args.checkpoint, encoding="utf-8") as f:
            reader.load_state_dict(json.load(f))
    if first and restored:
        # the engines run whatever was pushed last (weights trained after this checkpoint,
        # or an interrupted update): the restored weights go out, under a new version,
        # before training resumes
        reader.bracket.restore(push, reader.state_dict(), timeout=600)
    elif first and reader.bracket.is_open:  # a previous trainer died inside an update
        reader.bracket.weight_update(push, timeout=600)

    for step in range(args.steps):
        try:
            batch = reader.next_batch(timeout=600)
        except RunFinished as end:  # the dataset's last pass is trained: nothing more
            log.info("step %d: %s", step, end)
            break
        loss = train_step(model, opt, batcher, batch, args.loss_agg)
        reader.ack(batch)  # rank 0 of the DP ranks publishes the ack
        if first:  # the one order (docs/api.md): step -> ack -> update -> save -> commit
            reader.bracket.weight_update(push, timeout=600)
            state = reader.state_dict()
            save_trainer(trainer_ckpt, model, opt, state)
            save_checkpoint(args.checkpoint, state)  # the reader state alone, readable
            reader.commit(state)  # the checkpoint is durable: GC may collect what it covers
        log.info("step %d batch %d: %d tokens, loss %.4f, %s", step, batch.seq,
                 batch.num_tokens, loss, batch.stats)
    reader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
