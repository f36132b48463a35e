"""A small decoder-only transformer in plain torch, for the ``tiny`` local engine.

RMSNorm, rotary positions, SwiGLU MLP, untied LM head, fp32. Random init from a seed.

Weights live in a directory: ``config.json`` (a :class:`TinyConfig`) and ``model.pt`` (a
``state_dict`` of tensors written by ``torch.save`` and read back with
``torch.load(weights_only=True)``: data only, never pickled objects).

Log-prob convention (same as SGLang's default, where ``SGLANG_RETURN_ORIGINAL_LOGPROB``
is unset): the log-prob of a sampled token is taken from ``log_softmax(logits /
temperature)`` — the temperature-scaled distribution, before top-k / top-p / min-p
truncation. With greedy decoding (temperature < 1e-6) it is ``log_softmax(logits)``.
:func:`recompute_logprobs` applies the same convention with teacher forcing.

The trainer-facing API: :class:`TinyLM` (an ``nn.Module``; ``forward(tokens)`` returns
logits for a ``[B, T]`` batch), :func:`init_model`, :func:`save_weights`,
:func:`load_weights`, :func:`recompute_logprobs`, :func:`token_logprobs`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from strawq.producers.engines.tiny_config import TinyConfig

__all__ = [
    "TinyConfig",
    "TinyLM",
    "init_model",
    "load_config",
    "load_weights",
    "recompute_logprobs",
    "save_weights",
    "token_logprobs",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pt"
GREEDY_TEMPERATURE = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_heads
        self.n_heads, self.head_dim = h, cfg.head_dim
        self.attn_norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.w_gate = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        shape = (b, t, self.n_heads, self.head_dim)
        q = self.wq(x).view(shape).transpose(1, 2)  # [B, H, T, D]
        k = self.wk(x).view(shape).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [B, H, T, D]
        b, _, t, _ = out.shape
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return result

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm(x)
        down: torch.Tensor = self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))
        return x + down

    def forward_full(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._qkv(self.attn_norm(x), cos, sin)
        x = x + self._attend(q, k, v, mask)
        return self._mlp(x), k, v

    def forward_decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self._qkv(self.attn_norm(x), cos, sin)  # T == 1
        k_cache[slots, :, positions] = k[:, :, 0]
        v_cache[slots, :, positions] = v[:, :, 0]
        length = mask.shape[-1]
        first = int(slots[0])
        if bool((slots == torch.arange(first, first + len(slots))).all()):
            keys = k_cache[
                first : first + len(slots), :, :length
            ]  # contiguous slots: a view, no copy
            values = v_cache[first : first + len(slots), :, :length]
        else:
            keys = k_cache[:, :, :length].index_select(0, slots)
            values = v_cache[:, :, :length].index_select(0, slots)
        x = x + self._attend(q, keys, values, mask)
        return self._mlp(x)


class TinyLM(nn.Module):
    """Decoder-only LM. ``forward(tokens[B, T]) -> logits[B, T, V]`` (causal, no padding)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        )
        angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float64), inv)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_with_kv(tokens)[0]

    def forward_with_kv(
        self, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Causal forward; also returns each layer's rotated keys and values ``[B, H, T, D]``."""
        _b, t = tokens.shape
        if t > self.cfg.context_length:
            raise ValueError(
                f"sequence of {t} tokens exceeds context_length={self.cfg.context_length}"
            )
        cos, sin = self.rope_cos[:t][None, None], self.rope_sin[:t][None, None]
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)[None, None]
        x = self.embed(tokens)
        kvs = []
        for layer in self.blocks():
            x, k, v = layer.forward_full(x, cos, sin, mask)
            kvs.append((k, v))
        return self.lm_head(self.norm(x)), kvs

    def blocks(self) -> list[Block]:
        return [b for b in self.layers if isinstance(b, Block)]

    def forward_decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """One decode step for ``B`` sequences: token ``b`` sits at ``positions[b]`` of
        cache slot ``slots[b]``. Writes its K/V into the caches; returns logits ``[B, V]``."""
        length = int(positions.max()) + 1
        cos = self.rope_cos[positions][:, None, None]  # [B, 1, 1, D/2]
        sin = self.rope_sin[positions][:, None, None]
        mask = (torch.arange(length)[None, :] > positions[:, None])[
            :, None, None, :
        ]  # [B, 1, 1, L]
        x = self.embed(tokens)[:, None, :]
        for layer, kc, vc in zip(self.blocks(), k_caches, v_caches, strict=False):
            x = layer.forward_decode(x, cos, sin, kc, vc, slots, positions, mask)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits[:, 0]


def init_model(cfg: TinyConfig | None = None) -> TinyLM:
    """A randomly initialised model; the same ``cfg.seed`` gives the same weights."""
    cfg = cfg or TinyConfig()
    gen = torch.Generator().manual_seed(cfg.seed)
    model = TinyLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.init_std)
        model.lm_head.weight.mul_(1.0 / (cfg.init_std * math.sqrt(cfg.hidden_size)))
    return model.eval()


def save_weights(model: TinyLM, directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` and ``model.pt`` into ``directory`` (atomically per file)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()
    }
    tmp = path / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path / WEIGHTS_FILE)
    tmp_cfg = path / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp_cfg.write_text(json.dumps(asdict(model.cfg), indent=1, sort_keys=True))
    os.replace(tmp_cfg, path / CONFIG_FILE)
    return path


def load_config(directory: str | os.PathLike[str]) -> TinyConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        return TinyConfig.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: a tiny model directory needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(write one with save_weights)"
        ) from None


def load_weights(directory: str | os.PathLike[str]) -> TinyLM:
    """Load a model saved by :func:`save_weights` (``torch.load(weights_only=True)``)."""
    cfg = load_config(directory)
    state = torch.load(Path(directory) / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    model = TinyLM(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``logits`` with the engine's temperature convention."""
    scaled = logits.float() if temperature < GREEDY_TEMPERATURE else logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def recompute_logprobs(
    model: TinyLM,
    prompt_ids: Sequence[int] | np.ndarray,
    response_ids: Sequence[int] | np.ndarray,
    temperature: float = 1.0,
) -> np.ndarray:
    """Teacher-forced fp32 log-probs of ``response_ids`` given ``prompt_ids`` (float32 array)."""
    prompt = [int(t) for t in prompt_ids]
    response = [int(t) for t in response_ids]
    if not prompt:
        raise ValueError("recompute_logprobs needs a non-empty prompt")
    if not response:
        return np.zeros(0, dtype=np.float32)
    tokens = torch.tensor([prompt + response], dtype=torch.long)
    logits = model(tokens)[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, tokens[0, len(prompt) :], temperature).numpy().astype(np.float32)
