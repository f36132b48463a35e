"""A Megatron-core trainer loop on strawq, reduced to its skeleton.

Launch one process per GPU (``torchrun``); each data-parallel rank reads its own shard:

    torchrun --nproc-per-node 8 deploy/examples/megatron_trainer_loop.py RUN_DIR \
        --tp 2 --cp 2 --max-tokens-per-gpu 16384 --model-provider mypkg.model:provider \
        --router-url http://router:30000 --weights-dir /mnt/jfs/strawq/weights

``--toy`` runs the same loop on a CPU in one process with a tiny embedding + linear model
(gloo, TP = CP = 1): the data path, the loss and the acks are the real ones. What you replace
for a real job: ``--model-provider`` (returns your ``GPTModel``), ``push_weights`` (save and
load the weights into the engines; see deploy/examples/trainer_loop.py). Docs:
docs/megatron.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from strawq.collector.importance import (DEFAULT_LOSS_AGG, LOSS_AGG_MODES, batch_loss,
                                         masked_tis_weights, sampling_bias_warning)
from strawq.collector.reader import Batch, BatchReader

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


def push_weights(version: int) -> None:
    """Your hook: save the weights where every engine can read them, load them into every
    engine (``SGLangClient(router_url=...).push_weights``: pause, update, continue)."""
    log.info("weights for version %d pushed (placeholder)", version)


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
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint", default="trainer_state.json")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss-agg", default=DEFAULT_LOSS_AGG, choices=LOSS_AGG_MODES,
                   help="loss reduction over the whole batch (docs/tuning.md)")
    args = p.parse_args(argv)
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
    restored = os.path.exists(args.checkpoint)
    if restored:
        with open(args.checkpoint, encoding="utf-8") as f:
            reader.load_state_dict(json.load(f))
        # restore your model and optimizer from the checkpoint saved with this state here
    if first and restored:
        # the engines run whatever was pushed last (weights trained after this checkpoint,
        # or an interrupted update): the restored weights go out, under a new version,
        # before training resumes
        reader.bracket.restore(push_weights, reader.state_dict())
    elif first and reader.bracket.is_open:  # a previous trainer died inside an update
        reader.bracket.weight_update(push_weights)

    for step in range(args.steps):
        batch = reader.next_batch(timeout=600)
        loss = train_step(model, opt, batcher, batch, args.loss_agg)
        reader.ack(batch)  # rank 0 of the DP ranks publishes the ack
        if first:  # the one order (docs/api.md): step -> ack -> update -> save -> commit
            reader.bracket.weight_update(push_weights)
            state = reader.state_dict()
            with open(args.checkpoint, "w", encoding="utf-8") as f:
                json.dump(state, f)  # save it with the model checkpoint
            reader.commit(state)
        log.info("step %d batch %d: %d tokens, loss %.4f, %s", step, batch.seq,
                 batch.num_tokens, loss, batch.stats)
    reader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
