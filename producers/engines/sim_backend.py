"""Backend of the ``sim`` engine: a timing model, no neural network.

* One decode step takes ``step_base_ms + step_per_req_ms * batch`` (times ``time_scale``);
  admitting requests adds ``prefill_ms_per_token`` per input token (prompt + resumed
  prefix) to that step.
* Response lengths are long-tailed: ``L = round(exp(N(ln(len_median), len_sigma)))``,
  capped at ``len_cap``; with probability ``cap_prob`` a response runs to the cap (the
  spike of responses that never stop). The response ends with ``eos_token_id`` at
  ``L`` tokens unless ``max_new_tokens`` comes first.
* Optionally (``prompt_scale_sigma`` > 0) each prompt has its own length scale: the body
  of the draw above is multiplied by ``exp(sigma·z - sigma²/2)`` (mean 1), ``z`` a
  standard normal drawn from a hash of the prompt's tokens (``prompt_scale``), so a few
  prompts answer much longer than the rest, on every pass over the dataset and across
  resumes (the scale hashes the original prompt, never the resumed output). The spike at
  the cap is unchanged. Off by default.
* Everything is a pure function of the request's seed (``sampling_seed``, else a hash
  of the rid): token ids are ``3 + hash(seed, position) % (vocab - 3)``, log-probs are
  hash-derived values in (-4, 0). A resumed request is recognised by counting the
  trailing input tokens that equal the seed's own tokens at those positions, no further
  back than the resumed prefix the client declares
  (``sampling_params.custom_params.strawq_resumed_tokens``, which SGLang ignores), so with
  the same seed a resumed sample continues exactly as the uninterrupted one would. A
  request without that field is matched against the whole input: a prompt that happens
  to end in the seed's token (1 in ``vocab - 3``) ends one token early.

No thread per request: decode is a plain loop on the event loop, then one
``asyncio.sleep`` for the whole batch.
"""

from __future__ import annotations

import asyncio
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from strawq.config import Config
from strawq.producers.engines.core import Req
from strawq.producers.engines.seeding import position_hash, position_uniform
from strawq.weights.publish import checksum_dir

_LEN_SALT = 0x5EED_1E57
_PROMPT_SALT = 0x9A0_5CA1E


@dataclass(frozen=True, kw_only=True)
class SimConfig(Config):
    """Timing model of the ``sim`` engine (all times in milliseconds of model time)."""

    step_base_ms: float = 10.0
    step_per_req_ms: float = 0.05
    prefill_ms_per_token: float = 0.002
    len_median: float = 200.0
    len_sigma: float = 1.0
    len_cap: int = 4096
    cap_prob: float = 0.02
    vocab_size: int = 32000
    context_length: int = 32768
    eos_token_id: int = 2
    time_scale: float = 1.0
    #: per-prompt length scale, lognormal of mean 1 with this sigma (0: off)
    prompt_scale_sigma: float = 0.0

    def validate(self) -> None:
        for name in (
            "step_base_ms",
            "step_per_req_ms",
            "prefill_ms_per_token",
            "time_scale",
            "len_sigma",
            "prompt_scale_sigma",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, found {getattr(self, name)}")
        if self.len_median < 1 or self.len_cap < 1:
            raise ValueError("SimConfig.len_median and len_cap must be >= 1")
        if not 0.0 <= self.cap_prob <= 1.0:
            raise ValueError(f"SimConfig.cap_prob must be in [0, 1], found {self.cap_prob}")
        if self.vocab_size < 8 or not 0 <= self.eos_token_id < 3:
            raise ValueError(
                "SimConfig needs vocab_size >= 8 and eos_token_id in 0..2 (ids >= 3 are content)"
            )


def seed_for_rid(rid: str) -> int:
    return zlib.crc32(rid.encode()) * 0x9E3779B1


def sim_token(seed: int, position: int, vocab_size: int) -> int:
    return 3 + position_hash(seed, position) % (vocab_size - 3)


def sim_logprob(seed: int, position: int) -> float:
    return -4.0 * position_uniform(seed ^ 0xA5A5, position) - 1e-3


def _normal(seed: int) -> float:
    """A standard normal drawn from ``seed`` (Box-Muller)."""
    u1 = max(position_uniform(seed ^ _LEN_SALT, -2), 1e-12)
    u2 = position_uniform(seed ^ _LEN_SALT, -3)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def prompt_scale(prompt_ids: Sequence[int], sigma: float) -> float:
    """The length scale of a prompt: ``exp(sigma·z - sigma²/2)`` (lognormal, mean 1), ``z``
    a standard normal from a hash of ``prompt_ids``; 1.0 when ``sigma`` is 0."""
    if sigma <= 0:
        return 1.0
    h = zlib.crc32(b"".join(int(t).to_bytes(8, "little", signed=True) for t in prompt_ids))
    return math.exp(sigma * _normal(h ^ _PROMPT_SALT) - sigma * sigma / 2)


def target_length(seed: int, cfg: SimConfig, scale: float = 1.0) -> int:
    """The response length this seed stops at (before ``max_new_tokens``); ``scale``: the
    prompt's length scale (``prompt_scale``), applied to the lognormal body, not the spike
    at the cap."""
    u_cap = position_uniform(seed ^ _LEN_SALT, -1)
    if u_cap < cfg.cap_prob:
        return cfg.len_cap
    x = math.exp(math.log(cfg.len_median) + cfg.len_sigma * _normal(seed))
    length = round(x * scale) if scale != 1.0 else round(x)
    return max(1, min(cfg.len_cap, length))


class SimBackend:
    kind = "sim"

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.context_length = cfg.context_length
        self.eos_token_id = cfg.eos_token_id
        self.model_path = "sim"
        #: the values ``weights_by_name`` serves: those of what it loaded last
        self._weights = sim_weights(self.model_path)
        self._pending_prefill_ms = 0.0

    async def prefill(self, reqs: Sequence[Req]) -> None:
        for req in reqs:
            seq = req.input_ids + req.out_ids
            if req.backend_state is None or "prompt_len" not in req.backend_state:
                n = self.prompt_len(req.input_ids, req.seed, req.params.resumed_tokens)
                # the prompt's own tokens only: a resumed request's input ends in its output
                scale = prompt_scale(req.input_ids[:n], self.cfg.prompt_scale_sigma)
                req.backend_state = {"prompt_len": n,
                                     "target": target_length(req.seed, self.cfg, scale)}
            self._pending_prefill_ms += self.cfg.prefill_ms_per_token * len(seq)

    def prompt_len(self, input_ids: Sequence[int], seed: int, resumed: int | None) -> int:
        """Where the prompt of a request ends: before its trailing input tokens that are
        this seed's own tokens at their positions (an earlier answer being resumed).

        With ``resumed`` (the client's count of the resumed prefix, ``custom_params``) the
        scan never goes past it, so a prompt that happens to end in the seed's token is
        not taken for output; it still stops at a token that is not the seed's (the EOS
        that ended an earlier turn). Without it the scan runs to the prompt's first
        token: a prompt ending in the seed's token (1 in ``vocab_size - 3``) is taken as
        one token shorter.
        """
        n = len(input_ids)
        floor = 0 if resumed is None else max(n - resumed - 1, 0)
        pos = n - 1
        while pos > floor and input_ids[pos] == sim_token(seed, pos, self.vocab_size):
            pos -= 1
        return pos + 1

    async def decode(self, reqs: Sequence[Req]) -> list[tuple[int, float]]:
        out = []
        vocab = self.vocab_size
        for req in reqs:
            state = req.backend_state
            pos = req.seq_len
            if pos - state["prompt_len"] == state["target"] - 1 and not req.params.ignore_eos:
                token = self.eos_token_id
            else:
                token = sim_token(req.seed, pos, vocab)
            out.append((token, sim_logprob(req.seed, pos)))
        delay_ms = (
            self.cfg.step_base_ms + self.cfg.step_per_req_ms * len(reqs) + self._pending_prefill_ms
        )
        self._pending_prefill_ms = 0.0
        delay = delay_ms * self.cfg.time_scale / 1000.0
        await asyncio.sleep(delay) if delay > 0 else await asyncio.sleep(0)
        return out

    def release(self, req: Req) -> None:
        """Nothing to free; the per-request state is kept so a retracted request resumes."""

    async def load_weights(self, path: str) -> None:
        """Take ``path`` as the weights: their values follow its content (read once, in a
        thread), or the path itself when nothing is there (:func:`sim_weights`)."""
        self._weights = await asyncio.to_thread(sim_weights, path)
        self.model_path = path

    def model_info(self) -> dict[str, Any]:
        return {
            "model_type": "strawq-sim",
            "architectures": ["StrawqSimTimingModel"],
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "eos_token_id": self.eos_token_id,
            "sim": {f.name: getattr(self.cfg, f.name) for f in fields(self.cfg)},
        }

    def weights_by_name(self, name: str, truncate_size: int) -> list[float] | None:
        """The timing model's one parameter, ``sim.weights``: values derived from the
        weights it loaded last (:func:`sim_weights`: their content), so that attestation
        tells two versions apart and a version's delta build from its full copy not; None
        for any other name."""
        values = self._weights.get(name)
        return None if values is None else values[: max(0, truncate_size)]

    async def close(self) -> None:
        return None


#: the values of ``sim.weights``
SIM_WEIGHT_VALUES = 8


def sim_weights(path: str) -> dict[str, list[float]]:
    """The ``sim`` engine's weights after loading ``path`` (name -> values), for the
    trainer's side of attestation (``strawq.weights.fingerprint.fingerprint_of``).

    Where ``path`` exists they follow what it holds (the checksum of its files, names and
    bytes: ``strawq.weights.publish.checksum_dir``), not where it is: the directory a
    trainer wrote, the full copy a rolling update published and a delta version a producer
    built from its base give the same weights, and other content under the same path other
    weights. A path with nothing there (the sim engine loads any path; ``"sim"``, its
    start) gives values derived from the path itself. Reads every file once."""
    if os.path.exists(path):
        seed = int(checksum_dir(path)[0][:16], 16)
    else:
        seed = zlib.crc32(path.encode())
    return {"sim.weights": [position_uniform(seed, i) - 0.5
                            for i in range(SIM_WEIGHT_VALUES)]}
