"""The trainer side's oracle: the whole batch's loss and gradients in one process.

``reference_gradients(run, manifest, model, objective=)`` reads every group a published
manifest names *straight from its record* (``RunQueue.read_group``: no reader, no shard,
no packing), scores each sample on its own, and reduces the documented objective over the
whole batch (docs/design.md, invariant 11):

    loss = −aggregate_t( w_t · A_s · log π(y_t) )

* ``log π(y_t)``: the model's log-prob of each generated token under the sample's
  *recorded* sampling parameters (``meta["params"]`` of the record: temperature, and with
  ``Objective.truncated`` top-k / top-p too, ``importance.policy_logprobs``);
* ``w_t``: the token-level importance weight against the engine's recorded log-prob of
  that token (``Objective.is_mode``: ``tis`` min(ρ, 2), ``icepop``, ``icepop_mask``, or
  ``none``), detached;
* ``A_s``: the sample's advantage from the manifest (computed by the collector);
* ``aggregate``: ``Objective.aggregation``, one of ``importance.LOSS_AGG_MODES``, over the
  whole batch — ``token_mean`` Σ/#trained tokens, ``seq_mean_token_sum`` mean over samples
  of token sums, ``seq_mean_token_mean`` mean over samples of token means — computed here
  with its own arithmetic, not with ``aggregate_loss``.

Every path a user trains on must give the same gradient: the reader's shards averaged
over data-parallel ranks (``reader_loss`` per rank; ``distributed_gradients`` runs it on
real gloo ranks), the Megatron micro-batches (``megatron_gradients``), the slime adapters.
``TinyPolicy`` is a small deterministic model that consumes packed sequences (token ids,
positions, ``cu_seqlens``) with a causal context inside each sequence, so a misplaced
boundary, label or column changes its gradient; ``make_reference_run`` writes a run with one
published batch of mixed lengths, temperatures, truncations, loss-mask holes and multi-version
samples. ``max_relative_error`` is the agreement measure: per parameter, max |g − g_ref| /
max |g_ref|, the worst parameter.

The oracle is test harness (``strawq.testing``): the trainer library
(``strawq.collector.trainer``) and the integrations never import it; it imports them.

This module holds the oracle and the paths under test; the model and the objective are
``strawq.testing.reference_model``, the run to check against ``strawq.testing.reference_run``;
every public name of both is exported here too.
"""


from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from strawq.collector.trainer.behaviour import sampling_columns
from strawq.collector.trainer.importance import aggregate_loss, batch_loss
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.delivery.batches import BatchStore, Manifest
from strawq.storage import Storage, open_storage
from strawq.tasks.queue import RunQueue
from strawq.testing.reference_model import (
    DEFAULT_OBJECTIVE,
    IS_MODES,
    Grads,
    Objective,
    PaddedPolicy,
    TinyPolicy,
    batch_to,
    device_of,
    positions_from_cu,
    zero_loss,
)
from strawq.testing.reference_run import complete_groups, make_reference_run, publish_batch

__all__ = ["DEFAULT_OBJECTIVE", "IS_MODES", "Grads", "Objective", "PaddedPolicy", "TinyPolicy",
           "batch_to", "complete_groups", "distributed_gradients", "gradients",
           "make_reference_run", "max_relative_error", "megatron_gradients", "micro_batch_losses",
           "positions_from_cu", "publish_batch", "reader_loss", "reference_gradients",
           "reference_loss"]


# -- the oracle ------------------------------------------------------------------------------
def _queue(run: RunQueue | Storage | str) -> RunQueue:
    if isinstance(run, RunQueue):
        return run
    if isinstance(run, str):
        return RunQueue.open(open_storage(run, writer_id="reference"))
    return RunQueue.open(run)


def _manifest(queue: RunQueue, manifest: Manifest | int) -> Manifest:
    return manifest if isinstance(manifest, Manifest) else \
        BatchStore(queue).read_manifest(int(manifest))


def reference_loss(run: RunQueue | Storage | str, manifest: Manifest | int,
                   model: torch.nn.Module, *, objective: Objective = DEFAULT_OBJECTIVE,
                   skip: Collection[str] = ()) -> torch.Tensor:
    """The whole batch's loss (a scalar with its graph), one sample at a time.

    ``run``: the run's ``RunQueue``, its storage, or its directory; ``manifest``: a
    ``Manifest`` or its batch number. Raises ``ValueError`` for a sample with a response
    and no prompt token (nothing predicts its first token).

    ``skip``: ids of groups the reader skipped (a corrupt record): they stay counted in the
    denominators from the manifest (samples, ``loss_tokens``), as every trainer path counts
    them (``manifest_totals``), and add no loss.
    """
    queue = _queue(run)
    man = _manifest(queue, manifest)
    dev = device_of(model)
    sums: list[torch.Tensor] = []
    counts: list[float] = []
    for name, summ in zip(man.groups, man.summaries, strict=True):
        if name.id in skip:
            lt = list(summ.get("loss_tokens") or [0] * len(summ["sample_lens"]))
            sums += [torch.zeros((), device=dev)] * len(lt)
            counts += [float(x) for x in lt]
            continue
        g = queue.read_group(name.id, name.gen)
        params = sampling_columns([g.summary()])
        adv = list(summ.get("advantages") or [])
        if len(adv) != g.num_samples:
            adv = [0.0] * g.num_samples
        prompt = torch.from_numpy(np.array(g.prompt_ids, dtype=np.int64)).to(dev)
        p = int(prompt.shape[0])
        for i in range(g.num_samples):
            s = g.sample(i)
            resp = torch.from_numpy(np.array(s["tokens"], dtype=np.int64)).to(dev)
            r = int(resp.shape[0])
            mask = torch.from_numpy(np.array(s["loss_mask"], dtype=np.float32)).to(dev)
            counts.append(float(mask.sum()))
            if r == 0:
                sums.append(torch.zeros((), device=dev))
                continue
            if p == 0:
                raise ValueError(f"group {name.id} sample {i} has a response and no prompt: "
                                 "nothing predicts its first token")
            seq = torch.cat([prompt, resp])
            length = p + r
            logits = model(seq, torch.arange(length, device=dev),
                           torch.tensor([0, length], device=dev))
            ones = torch.ones(r, device=dev)
            per = objective.token_loss(
                logits[p - 1:length - 1], resp,
                torch.from_numpy(np.array(s["logprobs"], dtype=np.float32)).to(dev), mask,
                ones * float(adv[i]), ones * float(params["temperature"][i]),
                ones * float(params["top_p"][i]),
                torch.full((r,), int(params["top_k"][i]), dtype=torch.int64, device=dev))
            sums.append((per * mask).sum())
    if not any(t.requires_grad for t in sums):
        return zero_loss(model)
    total = torch.stack(sums)
    c = torch.tensor(counts, device=dev)
    mode = objective.aggregation
    if mode == "token_mean":
        return total.sum() / max(float(c.sum()), 1.0)
    if mode == "seq_mean_token_sum":
        return total.sum() / len(sums)
    return (total / c.clamp(min=1.0)).sum() / len(sums)


def gradients(model: torch.nn.Module) -> Grads:
    """{name: grad} of every parameter (zeros for one without a gradient), detached copies."""
    return {n: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q))
            for n, q in model.named_parameters()}


def reference_gradients(run: RunQueue | Storage | str, manifest: Manifest | int,
                        model: torch.nn.Module, *, objective: Objective = DEFAULT_OBJECTIVE,
                        skip: Collection[str] = ()) -> tuple[float, Grads]:
    """(loss, {parameter name: gradient}) of the whole batch on one process.

    The model's existing gradients are cleared first; the model is left with the
    reference gradients in ``.grad``.
    """
    model.zero_grad(set_to_none=True)
    loss = reference_loss(run, manifest, model, objective=objective, skip=skip)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach()), gradients(model)


def max_relative_error(grads: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
                       ) -> float:
    """max over parameters of max |g − g_ref| / max |g_ref| (a parameter whose reference
    gradient is all zero compares the absolute difference)."""
    if set(grads) != set(ref):
        raise ValueError(f"parameters differ: {sorted(set(grads) ^ set(ref))}")
    worst = 0.0
    for n, r in ref.items():
        g64, r64 = grads[n].detach().cpu().double(), r.detach().cpu().double()
        if not (bool(torch.isfinite(g64).all()) and bool(torch.isfinite(r64).all())):
            return float("inf")  # a non-finite gradient agrees with nothing
        d = float((g64 - r64).abs().max()) if r.numel() else 0.0
        scale = float(r64.abs().max()) if r.numel() else 0.0
        worst = max(worst, d / scale if scale > 0 else d)
    return worst


# -- the paths under test --------------------------------------------------------------------
def reader_loss(model: torch.nn.Module, batch: Batch, objective: Objective = DEFAULT_OBJECTIVE,
                *, scope: str = "global") -> torch.Tensor:
    """One rank's loss on its reader shard: the documented trainer code.

    The model scores the packed shard in one forward; token t's loss (aligned with
    ``batch.tokens``) uses the logits at t − 1 and the sample's recorded sampling
    parameters; ``importance.batch_loss`` reduces it with the whole batch's denominators.
    ``scope="local"`` reduces with the shard's own instead (``aggregate_loss`` without
    totals), to measure that form's bias across ranks. An empty shard gives a zero loss
    connected to every parameter (every rank steps).
    """
    if scope not in ("global", "local"):
        raise ValueError(f"scope must be 'global' or 'local', got {scope!r}")
    t = batch.num_tokens
    if t < 2:
        return zero_loss(model)
    dev = device_of(model)
    if batch.tokens.device != dev:
        batch = batch_to(batch, dev)
    cu = batch.cu_seqlens.to(torch.int64)
    logits = model(batch.tokens, positions_from_cu(cu), cu)
    n = batch.num_samples
    temp = batch.temperature if batch.temperature is not None else torch.ones(n, device=dev)
    top_p = batch.top_p if batch.top_p is not None else torch.ones(n, device=dev)
    top_k = batch.top_k if batch.top_k is not None else torch.full((n,), -1, device=dev)
    per = objective.token_loss(
        logits[:-1], batch.tokens[1:], batch.rollout_logprobs[1:], batch.loss_mask[1:],
        batch.advantages[1:], batch.token_column(temp)[1:], batch.token_column(top_p)[1:],
        batch.token_column(top_k)[1:])
    per = torch.cat([per.new_zeros(1), per])  # token 0 is a prompt token: never trained
    if scope == "local":
        return aggregate_loss(per, batch.loss_mask, objective.aggregation, batch.cu_seqlens)
    return batch_loss(per, batch, objective.aggregation)


def micro_batch_losses(model: torch.nn.Module, cp_parts: Sequence[Any],
                       objective: Objective = DEFAULT_OBJECTIVE) -> list[torch.Tensor]:
    """The losses of one micro-batch on each of its CP ranks (``cp_parts[c]``: CP rank c's
    ``MicroBatch`` of the same plan position), each the documented per-token objective
    reduced by ``importance.batch_loss``.

    The model sees every sequence whole: the CP ranks' tokens are put back at their global
    padded positions (``packed_seq_params.cu_seqlens_q_padded`` and ``position_ids()``), as
    context-parallel attention exchanges them; each rank's loss then takes only its own
    positions. A position held by no rank or by two fails here.
    """
    dev = device_of(model)
    cp_parts = [mb if mb.tokens.device == dev else mb.to(dev) for mb in cp_parts]
    first = cp_parts[0]
    psp = first.packed_seq_params
    cu_pad = psp.cu_seqlens_q_padded.to(torch.int64)
    total = int(cu_pad[-1])
    cp = len(cp_parts)
    if cp == 1:
        full_tokens = first.tokens[0]
        index = [torch.arange(total, device=dev)]
    else:
        plens = cu_pad[1:] - cu_pad[:-1]
        per_rank = plens // cp  # each rank holds 2 chunks of plens / (2 cp)
        seq_of = torch.repeat_interleave(torch.arange(plens.numel(), device=dev), per_rank)
        index = [cu_pad[:-1][seq_of] + mb.position_ids()[0].to(dev) for mb in cp_parts]
        full_tokens = torch.full((total,), -1, dtype=first.tokens.dtype, device=dev)
        seen = torch.zeros(total, dtype=torch.int64, device=dev)
        for mb, idx in zip(cp_parts, index, strict=True):
            full_tokens[idx] = mb.tokens[0]
            seen.index_add_(0, idx, torch.ones_like(idx))
        if not bool((seen == 1).all()):
            raise AssertionError("the CP ranks' chunks do not cover every padded position "
                                 "exactly once")
    logits = model(full_tokens, positions_from_cu(cu_pad), cu_pad)
    out = []
    for mb, idx in zip(cp_parts, index, strict=True):
        lg = logits[idx]
        per = objective.token_loss(lg, mb.labels[0], mb.rollout_logprobs[0], mb.loss_mask[0],
                                   mb.advantages[0], mb.temperature[0], mb.top_p[0],
                                   mb.top_k[0])
        out.append(batch_loss(per.unsqueeze(0), mb, objective.aggregation))
    return out


def megatron_gradients(run: RunQueue | Storage | str, manifest: Manifest | int,
                       model: torch.nn.Module, *, dp_size: int = 1, tp_size: int = 1,
                       cp_size: int = 1, sequence_parallel: bool = False,
                       pad_multiple: int = 1, max_tokens_per_gpu: int = 256,
                       objective: Objective = DEFAULT_OBJECTIVE) -> tuple[float, Grads]:
    """The gradient a Megatron-core job takes from this batch, on one process.

    Each DP rank reads its reader shard; each of its CP ranks cuts it with
    ``MegatronBatcher`` (THD ``PackedSeqParams``, padding, the load-balanced CP split); the
    micro-batch losses are summed per rank and the ranks' gradients averaged over DP × CP
    (Megatron's DDP), as the arithmetic mean of one backward over their sum.
    """
    from strawq.collector.integrations.megatron import MegatronBatcher, ParallelLayout

    queue = _queue(run)
    man = _manifest(queue, manifest)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device_of(model))
    for r in range(dp_size):
        reader = BatchReader(queue, rank=r, world_size=dp_size, checkpointed=False,
                             watch=None, sleep=lambda _s: None)
        batch = reader.load(man)
        reader.close()
        batchers = [MegatronBatcher(ParallelLayout(
            tp_size=tp_size, cp_size=cp_size, cp_rank=c, sequence_parallel=sequence_parallel,
            pad_multiple=pad_multiple), max_tokens_per_gpu=max_tokens_per_gpu)
            for c in range(cp_size)]
        per_cp = [b.micro_batches(batch) for b in batchers]
        for parts in zip(*per_cp, strict=True):
            for loss in micro_batch_losses(model, parts, objective):
                total = total + loss
        if not per_cp[0]:  # an empty shard still steps
            total = total + zero_loss(model)
    total.backward()  # type: ignore[no-untyped-call]
    n = dp_size * cp_size
    grads = {k: g / n for k, g in gradients(model).items()}
    return float(total.detach()) / n, grads


# -- real data-parallel ranks ---------------------------------------------------------------
def _rank_main(rank: int, run_dir: str, seq: int, world_sizes: Sequence[int],
               objectives: Sequence[dict[str, Any]], model_kw: dict[str, Any], init: str,
               size: int, out_dir: str) -> None:
    """One gloo process: for each world size w (ranks < w take part) and objective, the
    shard's loss, backward, gradients all-reduced and divided by w (DDP's mean)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        queue = RunQueue.open(open_storage(run_dir, writer_id=f"ddp{rank}"))
        man = BatchStore(queue).read_manifest(seq)
        results: dict[str, Any] = {}
        for w in world_sizes:
            group = dist.new_group(list(range(w)))  # every process creates every group
            if rank >= w:
                continue
            reader = BatchReader(queue, rank=rank, world_size=w, checkpointed=False,
                                 watch=None, sleep=lambda _s: None)
            batch = reader.load(man)
            reader.close()
            for k, obj in enumerate(objectives):
                model = TinyPolicy(**model_kw)
                loss = reader_loss(model, batch, Objective(**obj))
                loss.backward()  # type: ignore[no-untyped-call]
                lt = loss.detach().reshape(1).clone()
                dist.all_reduce(lt, group=group)
                for q in model.parameters():
                    assert q.grad is not None
                    dist.all_reduce(q.grad, group=group)
                    q.grad /= w
                if rank == 0:
                    results[f"{w}/{k}"] = (float(lt) / w, gradients(model),
                                           batch.num_samples)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "grads.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def distributed_gradients(run_dir: str, seq: int, *, world_sizes: Iterable[int] = (1, 2, 3, 4),
                          objectives: Iterable[Objective] = (Objective(),),
                          model_kw: Mapping[str, Any] | None = None,
                          start_method: str = "spawn"
                          ) -> dict[tuple[int, Objective], tuple[float, Grads]]:
    """The reader path on real ``torch.distributed`` ranks (gloo, CPU, spawned processes).

    One job of ``max(world_sizes)`` processes runs every world size on a subgroup of the
    first w ranks, and every objective; returns {(w, objective): (loss, DDP-averaged
    gradients of ``TinyPolicy(**model_kw)``)}. ``start_method="fork"`` saves each process
    importing torch again (tests); ``spawn`` is what ``torchrun``-like launchers give.
    """
    import torch.multiprocessing as mp

    sizes = sorted(set(int(w) for w in world_sizes))
    objs = list(objectives)
    if not sizes or sizes[0] < 1:
        raise ValueError(f"world sizes must be >= 1, got {sizes}")
    with tempfile.TemporaryDirectory(prefix="strawq-ddp-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        args = (run_dir, seq, sizes, [asdict(o) for o in objs], dict(model_kw or {}), init,
                sizes[-1], tmp)
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _rank_main, args=args, nprocs=sizes[-1], join=True, start_method=start_method)
        raw = torch.load(os.path.join(tmp, "grads.pt"))
    return {(w, o): (raw[f"{w}/{k}"][0], raw[f"{w}/{k}"][1])
            for w in sizes for k, o in enumerate(objs)}
