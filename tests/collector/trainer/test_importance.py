"""Token-level importance sampling helpers: ratios, TIS, IcePop, off-policy prefix mask."""

from __future__ import annotations

import math

import pytest
import torch

from strawq.collector.trainer.importance import (
    icepop_mask,
    LOSS_AGG_MODES,
    aggregate_loss,
    importance_ratios,
    masked_tis_weights,
    offpolicy_prefix_mask,
    policy_logprobs,
    sampling_bias_warning,
    truncated_is,
)


def test_ratios_tis_icepop():
    new = torch.tensor([0.0, -0.5, math.log(3.0), -50.0, 0.0])
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, math.log(0.1)])
    r = importance_ratios(new, old)
    assert torch.allclose(r[:3], torch.tensor([1.0, math.exp(-0.5), 3.0]), rtol=1e-5)
    assert torch.isfinite(r).all() and r[3] > 0  # clamped, no underflow to nan
    assert torch.allclose(truncated_is(r), torch.minimum(r, torch.tensor(2.0)))
    assert icepop_mask(r).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # 10.0 > 5, ~0 < 0.5
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.uint8)
    w = masked_tis_weights(new, old, mask, mode="icepop")
    assert w[2] == 0 and w[4] == 0 and torch.isclose(w[1], r[1])
    assert masked_tis_weights(new, old, mask)[4] == 2.0
    with pytest.raises(ValueError, match="expected equal"):
        importance_ratios(new, old[:2])
    with pytest.raises(ValueError, match="mode"):
        masked_tis_weights(new, old, mask, mode="nope")


def test_tis_has_no_gradient_through_the_weight():
    new = torch.tensor([0.1, 0.2], requires_grad=True)
    w = truncated_is(importance_ratios(new, torch.zeros(2)))
    assert not w.requires_grad


def test_offpolicy_prefix_mask_is_relative_to_each_sample():
    # sample 0: resumed at versions 3 -> 4 -> 5 (keep its version-5 tail); sample 1: one
    # segment at version 2 (kept whole, however old: it has no resumed prefix)
    versions = torch.tensor([-1, -1, 3, 3, 4, 5, -1, 2, 2], dtype=torch.int64)
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    assert offpolicy_prefix_mask(versions, cu).tolist() == [0, 0, 0, 0, 0, 1, 0, 1, 1]
    padded = torch.tensor([[-1, 3, 3, 4], [-1, 2, 2, -1]])
    assert offpolicy_prefix_mask(padded).tolist() == [[0, 0, 0, 1], [0, 1, 1, 0]]
    with pytest.raises(TypeError, match="cu_seqlens"):
        offpolicy_prefix_mask(versions, 4)  # type: ignore[arg-type]


def _draw(logits: torch.Tensor, temperature: float, top_k: int = -1,
          top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine side, as SGLang 0.5.x's torch sampler draws
    (``top_k_top_p_min_p_sampling_from_probs_torch``): sort the tempered probabilities
    once, take their cumulative sum over the full distribution, zero the ranks >= top_k and
    the tokens whose mass above exceeds top_p, draw from what is left. Returns the draws and
    their log-probs under the truncated, renormalised distribution."""
    probs = (logits / temperature).softmax(-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    if top_k > 0:
        probs_sort[(torch.arange(probs.shape[-1]).view(1, -1) >= top_k).expand_as(probs_sort)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_p] = 0.0
    picked = torch.multinomial(probs_sort, 1, generator=torch.Generator().manual_seed(0))
    tok = torch.gather(probs_idx, 1, picked)[:, 0]
    kept = probs_sort / probs_sort.sum(-1, keepdim=True)
    return tok, torch.log(torch.gather(kept, 1, picked)[:, 0])


def test_policy_logprobs_make_on_policy_ratios_one():
    logits = torch.randn(400, 50, generator=torch.Generator().manual_seed(1)) * 3
    tok, lp = _draw(logits, 0.6)
    # scored at T = 1 (what the demo did): per-token ratios far from 1
    plain = policy_logprobs(logits, tok)
    assert float((importance_ratios(plain, lp) - 1).abs().mean()) > 0.2
    mine = policy_logprobs(logits, tok, torch.full((400,), 0.6))
    assert torch.allclose(importance_ratios(mine, lp), torch.ones(400), atol=1e-4)
    # truncated sampling: only the same truncation gives ratio 1
    tok, lp = _draw(logits, 0.8, top_k=5, top_p=0.7)
    biased = policy_logprobs(logits, tok, 0.8)
    assert float((lp - biased).min()) > 0  # log of the kept mass, on every token
    exact = policy_logprobs(logits, tok, 0.8, top_k=5, top_p=0.7)
    assert torch.allclose(exact, lp, atol=1e-5)


def test_policy_logprobs_top_k_and_top_p_jointly_as_sglang():
    """Top-p is cut on the full tempered distribution, not on the top-k-renormalised one:
    probabilities [0.4, 0.3, 0.2, 0.1] with top-k 2, top-p 0.5 keep tokens 0 and 1 in
    SGLang (mass above token 1 is 0.4 <= 0.5); renormalising after top-k (0.57, 0.43) cut
    token 1, a token SGLang samples, to -inf (an inf loss)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    lp = policy_logprobs(logits, torch.tensor([1]), top_k=2, top_p=0.5)
    assert torch.isfinite(lp).all()
    assert float(lp[0]) == pytest.approx(math.log(0.3 / 0.7), abs=1e-6)
    # every token SGLang's sampler draws has a finite log-prob equal to the engine's, over
    # many rows and parameter pairs
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, 40, generator=g) * 2.5
    for temp, k, p in [(1.0, 3, 0.6), (0.7, 8, 0.5), (1.3, 2, 0.9), (0.6, 20, 0.3)]:
        tok, want = _draw(logits, temp, top_k=k, top_p=p)
        got = policy_logprobs(logits, tok, temp, top_k=k, top_p=p)
        assert torch.isfinite(got).all(), (temp, k, p)
        assert torch.allclose(got, want, atol=1e-5), (temp, k, p)


def test_sampling_bias_warning_once():
    assert sampling_bias_warning(torch.ones(3), torch.full((3,), -1)) is None
    with pytest.warns(RuntimeWarning, match="top_p < 1"):
        assert sampling_bias_warning(torch.tensor([1.0, 0.9]), None) is not None


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_flat_equals_padded(mode):
    flat = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 5.0, 7.0])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1])
    cu = torch.tensor([0, 3, 7])
    padded = torch.tensor([[9.0, 1.0, 2.0, 0.0], [9.0, 3.0, 5.0, 7.0]])
    pmask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    want = {"token_mean": 18 / 5, "seq_mean_token_sum": (3 + 15) / 2,
            "seq_mean_token_mean": (1.5 + 5) / 2}[mode]
    assert float(aggregate_loss(flat, mask, mode, cu)) == pytest.approx(want)
    assert float(aggregate_loss(padded, pmask, mode)) == pytest.approx(want)
    with pytest.raises(ValueError, match="loss aggregation"):
        aggregate_loss(flat, mask, "mean")
