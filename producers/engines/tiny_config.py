"""Configuration of the tiny engine's model (kept free of torch so it imports fast)."""

from __future__ import annotations

from dataclasses import dataclass

from strawq.config import Config
from strawq.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TinyConfig(Config):
    """Architecture of :class:`TinyLM`.

    Fields:
        vocab_size: number of token ids (ids are ``0 .. vocab_size-1``).
        hidden_size: model width; must be divisible by ``num_heads``.
        num_layers / num_heads: transformer depth and attention heads.
        intermediate_size: SwiGLU hidden width.
        context_length: maximum sequence length (prompt + response).
        rope_theta: rotary base.
        init_std: standard deviation of the random init (larger = peakier outputs).
        eos_token_id: the model's end-of-sequence token.
        seed: seed of the random init.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 352
    context_length: int = 1024
    rope_theta: float = 10000.0
    init_std: float = 0.05
    eos_token_id: int = 2
    seed: int = 0

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "context_length",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"TinyConfig.{name} must be >= 1, found {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                f"TinyConfig.hidden_size={self.hidden_size} must split into {self.num_heads} "
                "heads of even size"
            )
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(
                f"TinyConfig.eos_token_id={self.eos_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
