"""Megatron-core adapter: a reader ``Batch`` → THD micro-batches for one rank.

What a Megatron-core trainer needs from one data-parallel rank's shard:

* **dynamic batch size**: micro-batches formed under a tokens-per-GPU budget
  (``max_tokens_per_gpu``, counted after the context-parallel split, as slime's flag of the
  same name). The shard is cut into *contiguous* runs of samples (``plan_micro_batches``):
  the fewest micro-batches the budget allows, split at equal token shares where that fits.
  Contiguous runs keep the shard's staleness-first order and GRPO groups together, and let
  the common case (no context parallelism, no padding) hand out *views* of the reader's
  tensors, one ``torch.split`` per column: the adapter then costs a few calls per
  micro-batch, whatever the token count.
* **THD packing** with ``megatron.core.packed_seq_params.PackedSeqParams``
  (``qkv_format="thd"``; ``cu_seqlens_q`` over the real lengths, ``cu_seqlens_q_padded`` over
  the padded ones, both in the global, pre-split layout as Megatron's THD attention expects).
* **padding** to the parallel multiples: with context parallelism (CP > 1) every sequence is
  padded to a multiple of 2·CP (× TP under sequence parallelism), so that it splits into 2·CP
  equal chunks; without CP, sequence parallelism pads the micro-batch's tail to a multiple
  of TP (as one extra padding "sequence" in ``cu_seqlens``). ``pad_multiple`` adds a tail
  multiple of your own (e.g. 128 against memory fragmentation).
* **load-balanced CP split**: each (padded) sequence is cut into 2·CP chunks and CP rank r
  keeps chunks r and 2·CP−1−r (Megatron's ``get_batch_on_this_cp_rank`` /
  Transformer Engine's ``thd_get_partitioned_indices`` layout), so causal attention work is
  even over the CP ranks.
* **next-token alignment**: Megatron's loss at position t scores ``labels[t]``, the token
  at t + 1. Every per-token tensor that describes a *generated* token (loss mask, rollout
  log-probs, versions, advantages, ``target`` extras) is shifted with the labels, so
  ``rollout_logprobs[t]`` is the engine's log-prob of ``labels[t]``. The last position of
  every sequence has ``loss_mask`` 0 (what follows it in the stream is the next sample's
  first prompt token, or padding, and is never trained). ``input`` extras (e.g. routed
  experts, recorded per input position) are not shifted.
* **the behaviour policy and the loss denominators per label**: ``temperature``, ``top_p``
  and ``top_k`` are each label's sample's recorded sampling parameters (score at
  ``temperature``: the engines record tempered log-probs), ``sample_loss_tokens`` its
  sample's trained tokens over every CP rank, and ``totals`` the whole batch's
  denominators with DP × CP as the ranks averaged over: ``importance.batch_loss(per_token,
  mb, mode)`` summed over a rank's micro-batches, gradients averaged over DP × CP, is the
  single-process gradient of the whole batch (docs/design.md, invariant 11).

Dtypes are the reader's (int32 ids, uint8 mask, float32 log-probs and advantages, int64
versions): Megatron's embedding and ``vocab_parallel_cross_entropy`` take int32 ids, and
half the bytes cross the host-to-device link; convert on the device when a kernel wants
int64 or a float mask.

The adapter is four modules: ``planning`` (the parallel layout and the micro-batch plan:
lengths only), ``micro_batch`` (``MicroBatch``), ``thd`` (the tensor layout: views, padding,
the CP split) and this one, the ``MegatronBatcher`` that ties them together; every public
name is importable from here and from the package.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from strawq.collector.integrations.megatron.micro_batch import COLUMN_NAMES, Align, MicroBatch
from strawq.collector.integrations.megatron.planning import (
    ParallelLayout,
    packed_seq_params_cls,
    plan_micro_batches,
    sync_num_micro_batches,
)
from strawq.collector.integrations.megatron.thd import ShardPacker
from strawq.collector.trainer.importance import LossTotals
from strawq.collector.trainer.reader import Batch
from strawq.ondisk.extras import SPECS

__all__ = ["COLUMN_NAMES", "Align", "MegatronBatcher", "MicroBatch", "ParallelLayout",
           "plan_micro_batches", "sync_num_micro_batches"]


class MegatronBatcher:
    """Cuts a reader ``Batch`` into micro-batches for one rank of a Megatron-core job.

    ``max_tokens_per_gpu`` is the budget per GPU *after* the CP split (the micro-batch holds
    up to ``max_tokens_per_gpu · cp_size`` padded tokens before it). ``pad_token_id`` fills
    padding. ``min_micro_batches`` forces at least that many (see
    ``sync_num_micro_batches``).
    """

    def __init__(self, layout: ParallelLayout | None = None, *, max_tokens_per_gpu: int,
                 pad_token_id: int = 0) -> None:
        self.layout = layout or ParallelLayout()
        if max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu must be >= 1, got {max_tokens_per_gpu}")
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.pad_token_id = pad_token_id
        self._psp = packed_seq_params_cls()

    def plan(self, batch: Batch, *, min_micro_batches: int = 1) -> list[tuple[int, int]]:
        """The micro-batches' sample ranges (cheap: lengths only)."""
        lens = np.diff(batch.cu_seqlens.numpy())
        return plan_micro_batches(lens, self.max_tokens_per_gpu * self.layout.cp_size,
                                  seq_multiple=self.layout.seq_multiple,
                                  min_micro_batches=min_micro_batches)

    def micro_batches(self, batch: Batch, *, min_micro_batches: int = 1,
                      extras: Mapping[str, torch.Tensor] | None = None,
                      extra_align: Mapping[str, Align] | None = None) -> list[MicroBatch]:
        """Every micro-batch of ``batch`` for this rank, in plan order.

        ``extras``: per-token tensors ``[T, ...]`` over the batch's packed tokens (e.g. teacher
        log-probs, routed experts); None: the batch's own fixed-row extras (``Batch.extras``,
        the ragged top-p ids aside). ``extra_align[name]`` is ``"target"`` (default: shifted
        with the labels) or ``"input"`` (aligned with the tokens; the default of a prompt
        extra such as ``routed_experts``, the routing of each input token).
        """
        cols = self._columns(batch)
        if extras is None:
            extras = {n: t for n, t in batch.extras.items()
                      if n in SPECS and not SPECS[n].ragged}
        ext = dict(extras)
        align: dict[str, Align] = {n: "input" for n in ext if n in SPECS and SPECS[n].prompt}
        align.update(extra_align or {})
        total = batch.num_tokens
        for name, t in ext.items():
            if t.shape[0] != total:
                raise ValueError(f"extra {name!r} has {t.shape[0]} rows, the batch has {total} "
                                 "tokens")
            if align.setdefault(name, "target") not in ("input", "target"):
                raise ValueError(f"extra_align[{name!r}] must be 'input' or 'target'")
        cu = batch.cu_seqlens.numpy().astype(np.int64)
        if cu.shape[0] > 2 and batch.loss_mask[torch.from_numpy(cu[1:-1])].any():
            raise ValueError("a sample starts with a trained token (no prompt): the next-token "
                             "shift needs every sample to start with a prompt token")
        bt = batch.totals
        packer = ShardPacker(
            self.layout, self.pad_token_id, self._psp, cols, ext, align, cu,
            totals=LossTotals(total_samples=bt.total_samples,
                              total_loss_tokens=bt.total_loss_tokens,
                              grad_ranks=bt.grad_ranks * self.layout.cp_size),
            samples=self._sample_columns(batch, cu))
        parts = self.plan(batch, min_micro_batches=min_micro_batches)
        if parts and self.layout.seq_multiple == 1 and self.layout.tail_multiple == 1:
            return packer.all_views(parts)
        return [packer.build(a, b) for a, b in parts]

    # -- the batch's columns ------------------------------------------------------------------
    @staticmethod
    def _columns(batch: Batch) -> dict[str, torch.Tensor]:
        return {"tokens": batch.tokens, "labels": batch.tokens, "loss_mask": batch.loss_mask,
                "rollout_logprobs": batch.rollout_logprobs, "versions": batch.versions,
                "advantages": batch.advantages}

    @staticmethod
    def _sample_columns(batch: Batch, cu: np.ndarray) -> dict[str, torch.Tensor]:
        """Per sample [S]: the recorded sampling parameters and the trained-token count."""
        n = batch.num_samples
        mask = batch.loss_mask.numpy()
        lens = np.diff(cu)
        if n and mask.shape[0]:
            starts = np.minimum(cu[:-1], mask.shape[0] - 1)
            counts = np.add.reduceat(mask, starts, dtype=np.int64)
            counts[lens == 0] = 0
        else:
            counts = np.zeros(n, dtype=np.int64)
        return {
            "temperature": batch.temperature if batch.temperature is not None
            else torch.ones(n, dtype=torch.float32),
            "top_p": batch.top_p if batch.top_p is not None
            else torch.ones(n, dtype=torch.float32),
            "top_k": batch.top_k if batch.top_k is not None
            else torch.full((n,), -1, dtype=torch.int32),
            "loss_tokens": torch.from_numpy(counts.astype(np.float32))}
