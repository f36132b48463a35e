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
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from strawq.batches import BatchStore, Manifest
from strawq.collector.trainer.behaviour import sampling_columns
from strawq.collector.trainer.importance import (DEFAULT_LOSS_AGG, LOSS_AGG_MODES, aggregate_loss,
                                                 batch_loss, masked_tis_weights, policy_logprobs)
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.groups import GroupData
from strawq.queue import Lease, RunQueue
from strawq.storage import Storage, open_storage

#: the importance weights the objective can apply (``none``: w = 1, plain policy gradient)
IS_MODES = ("tis", "icepop", "icepop_mask", "none")

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """The documented RL objective, as options."""

    #: loss reduction (``importance.LOSS_AGG_MODES``)
    aggregation: str = DEFAULT_LOSS_AGG
    #: importance weight (``IS_MODES``)
    is_mode: str = "tis"
    #: score with the recorded top-k / top-p truncation as well as the temperature (for
    #: engines that record truncated log-probs); False: temperature only, SGLang's default
    #: log-prob convention
    truncated: bool = False

    def __post_init__(self) -> None:
        if self.aggregation not in LOSS_AGG_MODES:
            raise ValueError(f"aggregation must be one of {LOSS_AGG_MODES}, got "
                             f"{self.aggregation!r}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode must be one of {IS_MODES}, got {self.is_mode!r}")

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                 temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor) -> torch.Tensor:
        """log π(targets) under the behaviour sampling transform this objective scores."""
        if self.truncated:
            return policy_logprobs(logits, targets, temperature, top_p=top_p, top_k=top_k)
        return policy_logprobs(logits, targets, temperature)

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor,
                   rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                   advantages: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor) -> torch.Tensor:
        """Per token −w · A · log π (unmasked: the aggregation applies ``loss_mask``)."""
        logp = self.logprobs(logits, targets, temperature, top_p, top_k)
        if self.is_mode == "none":
            w = torch.ones_like(logp)
        else:
            w = masked_tis_weights(logp, rollout_logprobs, torch.ones_like(loss_mask),
                                   mode=self.is_mode)
        return -(w * advantages.to(logp.dtype) * logp)


class TinyPolicy(torch.nn.Module):
    """A deterministic packed-sequence model: ``forward(tokens [N], positions [N],
    cu_seqlens [S + 1]) -> logits [N, V]``.

    h_t = tanh(E[x_t] + P[pos_t] + mean_{s ≤ t in its sequence}(E[x_s]) · M); logits = h · O.
    The causal context stops at each ``cu_seqlens`` boundary (the prefix sums run in
    float64, so packing more sequences together does not change the figures beyond fp32
    rounding). Token ids are taken modulo ``vocab``. The same ``seed`` gives the same
    weights on every process and device.
    """

    def __init__(self, vocab: int = 64, hidden: int = 16, max_len: int = 1024,
                 seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.max_len = vocab, max_len
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(max_len, hidden, generator=g) * 0.1)
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.out = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        tok = tokens.to(torch.int64).remainder(self.vocab)
        e = self.emb[tok]
        n = tok.shape[0]
        cu = cu_seqlens.to(torch.int64).to(tok.device)
        lens = cu[1:] - cu[:-1]
        seg = torch.repeat_interleave(torch.arange(lens.numel(), device=tok.device), lens)
        if seg.shape[0] != n:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])}, tokens has {n}: expected "
                             "the packed layout of the tokens")
        csum = torch.cat([e.new_zeros((1, e.shape[1]), dtype=torch.float64),
                          e.double().cumsum(0)])
        start = cu[:-1][seg]
        idx = torch.arange(n, device=tok.device)
        prefix = (csum[idx + 1] - csum[start]) / (idx - start + 1).unsqueeze(1).double()
        pos = positions.to(torch.int64).clamp(0, self.max_len - 1)
        h = torch.tanh(e + self.pos[pos] + prefix.to(e.dtype) @ self.mix)
        out: torch.Tensor = h @ self.out
        return out


class PaddedPolicy(torch.nn.Module):
    """``TinyPolicy`` on padded rows ``[S, L]``: the demo trainer's model interface."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.inner = TinyPolicy(**kwargs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s, length = tokens.shape
        cu = torch.arange(0, s * length + 1, max(length, 1), device=tokens.device)
        pos = torch.arange(length, device=tokens.device).repeat(s)
        out: torch.Tensor = self.inner(tokens.reshape(-1), pos, cu).reshape(s, length, -1)
        return out


def positions_from_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [T]: each token's position within its sequence (on ``cu_seqlens``' device)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    return torch.arange(int(cu[-1]), device=cu.device) - torch.repeat_interleave(cu[:-1], lens)


def _device(model: torch.nn.Module) -> torch.device:
    for q in model.parameters():
        return q.device
    return torch.device("cpu")


def _zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A zero connected to every parameter (their gradients exist, and are 0)."""
    return sum((q.sum() * 0.0 for q in model.parameters()),
               torch.zeros((), device=_device(model)))


def batch_to(batch: Batch, device: torch.device | str) -> Batch:
    """A copy of a reader ``Batch`` with every tensor on ``device``."""
    import dataclasses

    moved: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            moved[f.name] = v.to(device)
        elif f.name == "extras":
            moved[f.name] = {k: t.to(device) for k, t in v.items()}
    return dataclasses.replace(batch, **moved)


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
                   model: torch.nn.Module, *, objective: Objective = Objective(),
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
    dev = _device(model)
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
        return _zero_loss(model)
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
                        model: torch.nn.Module, *, objective: Objective = Objective(),
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
def reader_loss(model: torch.nn.Module, batch: Batch, objective: Objective = Objective(),
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
        return _zero_loss(model)
    dev = _device(model)
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
                       objective: Objective = Objective()) -> list[torch.Tensor]:
    """The losses of one micro-batch on each of its CP ranks (``cp_parts[c]``: CP rank c's
    ``MicroBatch`` of the same plan position), each the documented per-token objective
    reduced by ``importance.batch_loss``.

    The model sees every sequence whole: the CP ranks' tokens are put back at their global
    padded positions (``packed_seq_params.cu_seqlens_q_padded`` and ``position_ids()``), as
    context-parallel attention exchanges them; each rank's loss then takes only its own
    positions. A position held by no rank or by two fails here.
    """
    dev = _device(model)
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
                       objective: Objective = Objective()) -> tuple[float, Grads]:
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
    total = torch.zeros((), device=_device(model))
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
            total = total + _zero_loss(model)
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


# -- a run to check against -------------------------------------------------------------------
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
    from strawq.dataset import Dataset

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
