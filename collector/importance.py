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
* ``aggregate_loss``      the loss reduction as an explicit option (``LOSS_AGG_MODES``),
  the one the demo trainer and the examples call.

Every weight function returns a tensor of the input's shape and leaves masking by
``loss_mask`` to the caller (``* loss_mask`` once, at the end), so they compose.
"""

from __future__ import annotations

import logging
import warnings

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
    tokens). Temperature below ``GREEDY_TEMPERATURE`` means greedy: unscaled log-probs. With
    ``top_k`` (> 0) or ``top_p`` (< 1) the distribution is truncated and renormalised as the
    engine's sampler does. Match the engine's *recorded* log-probs: SGLang (by default) and
    the tiny engine record the tempered distribution before truncation, so score those with
    ``temperature`` only; ratios of truncated rollouts then stay biased by log of the kept
    mass (``sampling_bias_warning``). Pass ``top_k`` / ``top_p`` to score the truncated
    behaviour policy exactly, against engines that record truncated log-probs.
    """
    x = logits.float()
    t = torch.as_tensor(temperature, dtype=x.dtype, device=x.device)
    t = torch.where(t < GREEDY_TEMPERATURE, torch.ones_like(t), t)
    x = x / t.expand(targets.shape).unsqueeze(-1) if t.dim() else x / t
    if top_k is not None:
        k = torch.as_tensor(top_k, device=x.device).expand(targets.shape)
        if bool((k > 0).any()):
            vocab = x.shape[-1]
            kk = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
            ranked = x.sort(dim=-1, descending=True).values
            kth = ranked.gather(-1, (kk - 1).unsqueeze(-1).long())
            x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None:
        p = torch.as_tensor(top_p, dtype=x.dtype, device=x.device).expand(targets.shape)
        if bool((p < 1).any()):
            probs, order = x.softmax(-1).sort(dim=-1, descending=True)
            before = probs.cumsum(-1) - probs  # mass strictly above each token
            drop_sorted = before >= p.unsqueeze(-1)
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, -1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


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
           "with strawq.collector.importance.policy_logprobs(..., top_p=, top_k=) or sample "
           "with top_p = 1, top_k = -1")
    key = "/".join(causes)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.warning("%s", msg)
    return msg


def aggregate_loss(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str = DEFAULT_LOSS_AGG,
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar (``LOSS_AGG_MODES``), masked by ``loss_mask``.

    ``per_token`` and ``loss_mask`` are padded ``[S, L]`` (one sample per row) or flat
    ``[T]`` with ``cu_seqlens`` [S + 1] (the reader's layout).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGG_MODES}, got {mode!r}")
    m = loss_mask.to(per_token.dtype)
    x = per_token * m
    if mode == "token_mean":
        return x.sum() / m.sum().clamp(min=1.0)
    if cu_seqlens is None:
        if x.dim() != 2:
            raise ValueError(f"per_token has shape {tuple(x.shape)}: expected padded [S, L] "
                             "or flat [T] with cu_seqlens")
        sums, counts = x.sum(-1), m.sum(-1)
    else:
        cu = cu_seqlens.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        sample_of = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        sums = torch.zeros(lens.numel(), dtype=x.dtype).index_add(0, sample_of, x)
        counts = torch.zeros(lens.numel(), dtype=x.dtype).index_add(0, sample_of, m)
    if sums.numel() == 0:
        return x.sum() * 0.0
    if mode == "seq_mean_token_sum":
        return sums.mean()
    return (sums / counts.clamp(min=1.0)).mean()


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
