"""Token-level importance sampling against the version that produced each token.

Tokens of one sample can come from several weight versions (a partial resumed after a
weight update), so the behaviour policy is per token: ``rollout_logprobs[t]`` under
``versions[t]``. With ``logp_new`` from the trainer's current policy:

* ``importance_ratios``  ρ_t = exp(logp_new − logp_rollout) (the log-difference is clamped
  to ±20 before ``exp`` so a bad token cannot make inf/nan);
* ``truncated_is``       TIS: min(ρ_t, C), C = 2.0 (the weight multiplies the loss);
* ``icepop_mask``        IcePop: keep tokens with ρ_t in [0.5, 5.0], mask the rest;
* ``offpolicy_prefix_mask`` keep each sample's last segment only: tokens older than the
  sample's own newest version (the prefix it resumed from) are masked — slime's
  ``--mask-offpolicy-in-partial-rollout``, relative to each sample, not to the trainer's
  current version (which masked whole samples that had simply waited a version);
* ``policy_logprobs``     the trainer's log-probs under the *behaviour* sampling transform
  (per-sample temperature, optionally the top-k / top-p truncation), so that ρ = 1 for an
  on-policy token: a rollout at T = 0.6 scored at T = 1 does not give ρ = 1;
* ``sampling_bias_warning`` one warning when top-p < 1 or top-k > 0 and the caller scores
  with the full distribution (ratios biased by log of the kept mass);
* ``aggregate_loss``      the loss reduction as an explicit option (``LOSS_AGG_MODES``);
  with ``LossTotals`` (the whole batch's denominators) it is rank-invariant: the mean of
  the ranks' gradients is the single-process gradient of the whole batch;
* ``batch_loss``          ``aggregate_loss`` for a reader ``Batch`` or a Megatron
  ``MicroBatch`` with its global totals: the call the demo trainer and the examples make.

Every weight function returns a tensor of the input's shape and leaves masking by
``loss_mask`` to the caller (``* loss_mask`` once, at the end), so they compose.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

TIS_THRESHOLD = 2.0
ICEPOP_LOW = 0.5
ICEPOP_HIGH = 5.0
_LOG_CLAMP = 20.0
#: Below this temperature an engine samples greedily and reports unscaled log-probs (the
#: tiny engine's and SGLang's convention).
GREEDY_TEMPERATURE = 1e-6
#: ``token_mean``: Σ_all tokens / #tokens of the batch (verl's default, DAPO; long samples
#: weigh more). ``seq_mean_token_sum``: mean over samples of each sample's token sum (Dr.
#: GRPO divides by a constant: lengths are not normalised away). ``seq_mean_token_mean``:
#: mean over samples of each sample's token mean (the original GRPO: every sample weighs the
#: same whatever its length).
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
#: What the demo trainer and the examples use unless told otherwise.
DEFAULT_LOSS_AGG = "seq_mean_token_mean"


def importance_ratios(logp_new: torch.Tensor, logp_rollout: torch.Tensor) -> torch.Tensor:
    """Per-token ρ = exp(logp_new − logp_rollout), computed in float32 or wider."""
    if logp_new.shape != logp_rollout.shape:
        raise ValueError(f"logp_new has shape {tuple(logp_new.shape)}, logp_rollout "
                         f"{tuple(logp_rollout.shape)}: expected equal (flat packed tokens)")
    dtype = torch.promote_types(logp_new.dtype, torch.float32)
    diff = logp_new.to(dtype) - logp_rollout.to(dtype)
    return torch.exp(diff.clamp(-_LOG_CLAMP, _LOG_CLAMP))


def truncated_is(ratios: torch.Tensor, threshold: float = TIS_THRESHOLD) -> torch.Tensor:
    """TIS weights: min(ρ, threshold), no gradient through the weight."""
    if threshold <= 0:
        raise ValueError(f"TIS threshold must be > 0, got {threshold}")
    return ratios.detach().clamp(max=threshold)


def icepop_mask(ratios: torch.Tensor, low: float = ICEPOP_LOW,
                high: float = ICEPOP_HIGH) -> torch.Tensor:
    """IcePop: 1.0 where low <= ρ <= high, else 0.0 (same dtype as ``ratios``)."""
    if not 0 <= low < high:
        raise ValueError(f"IcePop bounds must satisfy 0 <= low < high, got [{low}, {high}]")
    r = ratios.detach()
    return ((r >= low) & (r <= high)).to(r.dtype)


def offpolicy_prefix_mask(versions: torch.Tensor,
                          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """1 for the tokens of each sample's newest version, 0 for the prefix it resumed from.

    ``versions`` is flat over ``cu_seqlens`` (a reader ``Batch``: int64 [T], −1 over prompts)
    or padded ``[S, L]`` (one sample per row, pad with −1; then ``cu_seqlens`` is None). A
    sample generated in one segment keeps every response token; a resumed one keeps only
    the tokens after its last resume, whatever the trainer's version is now (slime's
    semantics). Prompt tokens (−1) come out 0; they are outside the loss mask anyway.
    """
    if isinstance(cu_seqlens, int):
        raise TypeError("offpolicy_prefix_mask(versions, current_version) masked against the "
                        "trainer's version; it now masks each sample's resumed prefix: pass "
                        "the batch's cu_seqlens (or padded [S, L] versions and no cu_seqlens)")
    if cu_seqlens is None:
        if versions.dim() != 2:
            raise ValueError(f"versions has shape {tuple(versions.shape)}: expected [S, L] "
                             "padded with -1, or flat [T] with cu_seqlens")
        newest = versions.max(dim=1, keepdim=True).values
        return ((versions == newest) & (versions >= 0)).to(torch.uint8)
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    if int(cu[-1]) != versions.numel():
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])}, versions has {versions.numel()} "
                         "tokens: expected the batch's flat layout")
    sample_of = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    newest = torch.full((lens.numel(),), -1, dtype=versions.dtype)
    newest = newest.scatter_reduce(0, sample_of, versions, reduce="amax")
    return ((versions == newest[sample_of]) & (versions >= 0)).to(torch.uint8)


def policy_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    temperature: torch.Tensor | float = 1.0, *,
                    top_p: torch.Tensor | float | None = None,
                    top_k: torch.Tensor | int | None = None) -> torch.Tensor:
    """log π(target) under the behaviour policy's sampling transform, differentiable.

    ``logits`` [..., V], ``targets`` [...]; ``temperature`` / ``top_p`` / ``top_k`` are a
    scalar or broadcast to ``targets`` (a ``Batch``'s per-sample columns expanded to its
    tokens, or a ``MicroBatch``'s per-token ones). Temperature below ``GREEDY_TEMPERATURE``
    means greedy: unscaled log-probs. With ``top_k`` (> 0) or ``top_p`` (< 1) the
    distribution is truncated and renormalised as SGLang's sampler does (``sampling_mask``).
    Match the engine's *recorded* log-probs: SGLang (by default) and the tiny engine record
    the tempered distribution before truncation, so score those with ``temperature`` only;
    ratios of truncated rollouts then stay biased by log of the kept mass
    (``sampling_bias_warning``). Pass ``top_k`` / ``top_p`` to score the truncated behaviour
    policy exactly, against engines that record truncated log-probs.
    """
    x = logits.float()
    t = torch.as_tensor(temperature, dtype=x.dtype, device=x.device)
    t = torch.where(t < GREEDY_TEMPERATURE, torch.ones_like(t), t)
    x = x / t.expand(targets.shape).unsqueeze(-1) if t.dim() else x / t
    drop = sampling_mask(x, targets.shape, top_p=top_p, top_k=top_k)
    if drop is not None:
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, -1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def sampling_mask(tempered: torch.Tensor, shape: torch.Size | tuple[int, ...], *,
                  top_p: torch.Tensor | float | None = None,
                  top_k: torch.Tensor | int | None = None) -> torch.Tensor | None:
    """bool [..., V]: the tokens SGLang's sampler can never draw (None when nothing is cut).

    SGLang 0.5.x applies top-k and top-p *jointly* on the tempered distribution
    (``top_k_top_p_min_p_sampling_from_probs_torch`` in ``sglang/srt/layers/sampler.py``,
    and flashinfer's ``top_k_top_p_sampling_from_probs(..., filter_apply_order="joint")``
    on CUDA): the probabilities are sorted once, ``probs_sum = cumsum(probs_sort)`` is taken
    over the *full* sorted distribution, then the ranks ``>= top_k`` are zeroed and the
    tokens with ``probs_sum - probs_sort > top_p`` (mass strictly above them over top_p)
    are zeroed; what is left is renormalised only by the draw. Top-p is therefore *not*
    computed over the top-k-renormalised probabilities: renormalising first cuts tokens
    SGLang keeps (which then score −inf and make the loss inf). Ranks, not values, bound
    top-k (ties at the k-th value are cut by position in the sort, as SGLang's are).
    """
    vocab = tempered.shape[-1]
    k = None
    if top_k is not None:
        k = torch.as_tensor(top_k, device=tempered.device).expand(shape)
        k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
        if not bool((k < vocab).any()):
            k = None
    p = None
    if top_p is not None:
        p = torch.as_tensor(top_p, dtype=tempered.dtype, device=tempered.device).expand(shape)
        if not bool((p < 1).any()):
            p = None
    if k is None and p is None:
        return None
    probs, order = tempered.detach().softmax(-1).sort(dim=-1, descending=True)
    drop_sorted = torch.zeros_like(probs, dtype=torch.bool)
    if k is not None:
        rank = torch.arange(vocab, device=tempered.device)
        drop_sorted |= rank >= k.unsqueeze(-1)
    if p is not None:
        before = probs.cumsum(-1) - probs  # mass strictly above each token, full distribution
        drop_sorted |= before > p.unsqueeze(-1)
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


_WARNED: set[str] = set()


def sampling_bias_warning(top_p: torch.Tensor | float | None,
                          top_k: torch.Tensor | int | None) -> str | None:
    """Warn (once per process and cause) if truncated sampling makes plain ratios biased.

    Returns the message (None when nothing is truncated). Call it where the trainer scores
    with the full softmax; ``policy_logprobs(..., top_p=, top_k=)`` removes the bias.
    """
    causes = []
    if top_p is not None and bool((torch.as_tensor(top_p) < 1).any()):
        causes.append("top_p < 1")
    if top_k is not None and bool((torch.as_tensor(top_k) > 0).any()):
        causes.append("top_k > 0")
    if not causes:
        return None
    msg = (f"rollouts were sampled with {' and '.join(causes)}: importance ratios against "
           "full-softmax log-probs are biased by log(kept probability mass) per token; score "
           "with strawq.collector.trainer.importance.policy_logprobs(..., top_p=, top_k=) "
           "or sample with top_p = 1, top_k = -1")
    key = "/".join(causes)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.warning("%s", msg)
    return msg


@dataclass(frozen=True)
class LossTotals:
    """The whole batch's loss denominators, and the ranks its gradients are averaged over.

    With them a rank's loss is its share of the *batch's* loss, whatever the shard holds:
    ``aggregate_loss(..., totals=)`` returns ``grad_ranks · Σ_shard / global denominator``,
    so DDP-style averaging (the mean of the ranks' gradients, ``grad_ranks`` of them)
    reproduces the single-process gradient of the whole batch exactly (docs/design.md,
    invariant 11). ``Batch.totals`` and ``MicroBatch.totals`` carry them.
    """

    #: samples in the whole batch (every rank's)
    total_samples: int
    #: trained tokens (``loss_mask`` = 1) in the whole batch; None where the manifest does
    #: not count them (records written without per-sample ``loss_tokens``)
    total_loss_tokens: int | None
    #: the ranks whose gradients are averaged: the data-parallel world size (× CP under
    #: Megatron, whose DDP averages over the DP × CP group)
    grad_ranks: int = 1

    def __post_init__(self) -> None:
        if self.grad_ranks < 1:
            raise ValueError(f"grad_ranks must be >= 1, got {self.grad_ranks}")
        if self.total_samples < 0:
            raise ValueError(f"total_samples must be >= 0, got {self.total_samples}")


def aggregate_loss(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str = DEFAULT_LOSS_AGG,
                   cu_seqlens: torch.Tensor | None = None, *, totals: LossTotals | None = None,
                   sample_loss_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar (``LOSS_AGG_MODES``), masked by ``loss_mask``.

    ``per_token`` and ``loss_mask`` are padded ``[S, L]`` (one sample per row), flat ``[T]``
    with ``cu_seqlens`` [S + 1] (the reader's layout), or any shape with
    ``sample_loss_tokens`` (per token: the trained tokens of its sample, the
    ``MicroBatch`` column; needed by ``seq_mean_token_mean`` only).

    Without ``totals`` the denominators are the input's own (one process holding the whole
    batch). With ``totals`` (``Batch.totals``, ``MicroBatch.totals``) they are the whole
    batch's and the result is scaled by ``totals.grad_ranks``: every mode is then
    rank-invariant by construction — the mean over ranks of their gradients equals the
    gradient of the whole batch on one process, at any world size and shard balance.
    ``batch_loss`` makes that call for a ``Batch`` or a ``MicroBatch``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGG_MODES}, got {mode!r}")
    m = loss_mask.to(per_token.dtype)
    x = per_token * m
    if totals is not None:
        scale = float(totals.grad_ranks)
        if mode == "token_mean":
            if totals.total_loss_tokens is None:
                if totals.grad_ranks > 1:
                    raise ValueError(
                        "token_mean needs the whole batch's trained-token count, and this "
                        "manifest does not record per-sample loss_tokens (records written by "
                        "an older producer): use seq_mean_token_mean or seq_mean_token_sum, "
                        "or train on one rank")
                return x.sum() / m.sum().clamp(min=1.0)
            return x.sum() * (scale / max(totals.total_loss_tokens, 1))
        denom = scale / max(totals.total_samples, 1)
        if mode == "seq_mean_token_sum":
            return x.sum() * denom
        counts = _token_sample_counts(m, cu_seqlens, sample_loss_tokens)
        return (x / counts.clamp(min=1.0)).sum() * denom
    if mode == "token_mean":
        return x.sum() / m.sum().clamp(min=1.0)
    if cu_seqlens is None:
        if x.dim() != 2:
            raise ValueError(f"per_token has shape {tuple(x.shape)}: expected padded [S, L] "
                             "or flat [T] with cu_seqlens")
        sums, counts = x.sum(-1), m.sum(-1)
    else:
        sample_of = _sample_of(cu_seqlens, x.device)
        n = int(cu_seqlens.numel()) - 1
        sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, sample_of, x)
        counts = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, sample_of, m)
    if sums.numel() == 0:
        return x.sum() * 0.0
    if mode == "seq_mean_token_sum":
        return sums.mean()
    return (sums / counts.clamp(min=1.0)).mean()


def _sample_of(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    cu = cu_seqlens.to(torch.int64).to(device)
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)


def _token_sample_counts(m: torch.Tensor, cu_seqlens: torch.Tensor | None,
                         sample_loss_tokens: torch.Tensor | None) -> torch.Tensor:
    """Per token: the trained tokens of its sample (a tensor of ``m``'s shape)."""
    if sample_loss_tokens is not None:
        if sample_loss_tokens.shape != m.shape:
            raise ValueError(f"sample_loss_tokens has shape {tuple(sample_loss_tokens.shape)}, "
                             f"the per-token losses {tuple(m.shape)}: expected equal")
        return sample_loss_tokens.to(m.dtype)
    if cu_seqlens is not None:
        sample_of = _sample_of(cu_seqlens, m.device)
        n = int(cu_seqlens.numel()) - 1
        counts = torch.zeros(n, dtype=m.dtype, device=m.device).index_add(0, sample_of, m)
        return counts[sample_of]
    if m.dim() != 2:
        raise ValueError(f"loss_mask has shape {tuple(m.shape)}: seq_mean_token_mean needs "
                         "padded [S, L], flat [T] with cu_seqlens, or sample_loss_tokens")
    return m.sum(-1, keepdim=True).expand_as(m)


def batch_loss(per_token: torch.Tensor, batch: Any, mode: str = DEFAULT_LOSS_AGG) -> torch.Tensor:
    """The rank's share of the whole batch's loss: the one call for a reader ``Batch``
    (``per_token`` flat [T]) or a Megatron ``MicroBatch`` (``[1, t]``, labels-aligned).

    Uses the batch's ``loss_mask``, its layout and its global ``totals``; the mean of the
    ranks' gradients (DDP) is the whole batch's gradient on one process. Over a rank's
    micro-batches, *sum* the losses (each is already its share of the batch).
    """
    totals = batch.totals
    cu = getattr(batch, "cu_seqlens", None)
    counts = getattr(batch, "sample_loss_tokens", None)
    return aggregate_loss(per_token, batch.loss_mask, mode, cu, totals=totals,
                          sample_loss_tokens=counts)


def masked_tis_weights(logp_new: torch.Tensor, logp_rollout: torch.Tensor,
                       loss_mask: torch.Tensor, *, mode: str = "tis",
                       threshold: float = TIS_THRESHOLD, low: float = ICEPOP_LOW,
                       high: float = ICEPOP_HIGH) -> torch.Tensor:
    """Per-token loss weights: ``tis`` (truncated ratio), ``icepop`` (masked ratio),
    ``icepop_mask`` (the 0/1 mask only) — multiplied by ``loss_mask``."""
    r = importance_ratios(logp_new, logp_rollout)
    if mode == "tis":
        w = truncated_is(r, threshold)
    elif mode == "icepop":
        w = r.detach() * icepop_mask(r, low, high)
    elif mode == "icepop_mask":
        w = icepop_mask(r, low, high)
    else:
        raise ValueError(f"mode must be 'tis', 'icepop' or 'icepop_mask', got {mode!r}")
    return w * loss_mask.to(w.dtype)
