"""Per-token extras of the local engines, under SGLang 0.5.23's names and shapes.

* ``return_routed_experts`` (with ``routed_experts_start_len`` s): ``meta_info.routed_experts``
  is base64 of int32 ``[seq_len − 1 − s, LAYERS, TOP_K]`` — the experts that routed each
  position ``[s, seq_len − 1)`` of prompt + output as the model's input. The local engines
  pretend to be an MoE of ``LAYERS`` layers choosing ``TOP_K`` of ``NUM_EXPERTS`` experts;
  the choice is :func:`routed_experts_row` of the position and its token, so a test can
  recompute it from the final tokens alone.
* ``return_sampling_mask``: ``meta_info.output_token_sampling_mask``, per output token the
  ids its sampling kept (:func:`kept_ids`: the token itself and up to two neighbours, at
  most ``top_k``), plus ``output_token_sampling_logprobs`` and
  ``output_token_sampling_mask_length`` as SGLang sends them. As in SGLang 0.5.23 the
  request needs greedy sampling (top_k 1) or a finite ``1 < top_k <= 4096``
  (``--sampling-mask-max-tokens``); otherwise it is refused.
* ``return_logprob`` with ``logprob_start_len`` s >= 0: ``meta_info.input_token_logprobs``
  ``[[logprob, id, None], ...]`` for input positions ``[s, len(input_ids))``, the first
  entry's log-prob ``None`` as SGLang 0.5.23 sends it (a teacher scores a finished
  sample this way: ``max_new_tokens`` 0). The values are :func:`teacher_logprob` of the
  position and its token.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LAYERS = 2
TOP_K = 2
NUM_EXPERTS = 8
#: SGLang 0.5.23's default ``--sampling-mask-max-tokens``
SAMPLING_MASK_MAX_TOKENS = 4096


def routed_experts_row(position: int, token: int) -> np.ndarray:
    """int32 [LAYERS, TOP_K]: the pretend routing of ``token`` at ``position``."""
    base = np.arange(LAYERS * TOP_K, dtype=np.int64).reshape(LAYERS, TOP_K)
    return ((token * 5 + position * 3 + base * 7) % NUM_EXPERTS).astype(np.int32)


def routed_experts(ids: Sequence[int], start: int) -> np.ndarray:
    """int32 [len(ids) − 1 − start, LAYERS, TOP_K] for positions ``[start, len − 1)``."""
    rows = [routed_experts_row(j, int(ids[j])) for j in range(start, len(ids) - 1)]
    if not rows:
        return np.zeros((0, LAYERS, TOP_K), dtype=np.int32)
    return np.stack(rows)


def effective_top_k(temperature: float, top_k: int) -> int:
    """SGLang's top_k after its defaults: 1 when greedy, 2^30 for "all" (−1)."""
    if temperature < 1e-6:
        return 1
    return top_k if top_k > 0 else 1 << 30


def teacher_logprob(position: int, token: int) -> float:
    """The pretend teacher-forced log-prob of ``token`` at ``position`` (in [-2, -0.02])."""
    return -(((token * 31 + position * 17) % 97) + 1) / 50


def kept_ids(token: int, position: int, vocab_size: int, top_k: int) -> list[int]:
    """The pretend sampling support of an output ``token`` at ``position`` (1 to 3 ids)."""
    return [(token + d) % vocab_size for d in range(min(1 + position % 3, top_k))]


def check_request(body: Mapping[str, Any], input_len: int, temperature: float,
                  top_k: int) -> str | None:
    """SGLang 0.5.23's checks of the extras flags (None: fine)."""
    if body.get("return_sampling_mask"):
        k = effective_top_k(temperature, top_k)
        if k != 1 and not 1 < k <= SAMPLING_MASK_MAX_TOKENS:
            return ("return_sampling_mask requires top_k=1 for greedy sampling or finite "
                    f"1 < top_k <= {SAMPLING_MASK_MAX_TOKENS}; got top_k={k}. Lower top_k or "
                    "increase --sampling-mask-max-tokens.")
    if not body.get("return_routed_experts"):
        return None
    start = body.get("routed_experts_start_len", 0)
    if isinstance(start, bool) or not isinstance(start, int):
        return f"routed_experts_start_len must be an int, found {start!r}"
    if start < 0:
        return (f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a "
                "non-negative routed_experts_start_len.")
    if start > input_len:
        return (f"recv_req.routed_experts_start_len={start} is higher than the number of "
                f"input tokens len(req.origin_input_ids)={input_len}. Please use a smaller "
                "routed_experts_start_len.")
    return None


def add_extras(meta: dict[str, Any], body: Mapping[str, Any], input_ids: Sequence[int],
               out_ids: Sequence[int], out_logprobs: Sequence[float], vocab_size: int,
               temperature: float, top_k: int) -> None:
    """Put the extras ``body`` asks for into ``meta`` (a response's ``meta_info``)."""
    if body.get("return_routed_experts"):
        ids = [*input_ids, *out_ids]
        rows = routed_experts(ids, int(body.get("routed_experts_start_len") or 0))
        meta["routed_experts"] = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    start = body.get("logprob_start_len")
    if body.get("return_logprob") and isinstance(start, int) and not isinstance(start, bool) \
            and 0 <= start < len(input_ids):
        meta["input_token_logprobs"] = [
            [None if j == start else teacher_logprob(j, int(input_ids[j])), int(input_ids[j]),
             None] for j in range(start, len(input_ids))]
    if body.get("return_sampling_mask"):
        p = len(input_ids)
        k = effective_top_k(temperature, top_k)
        meta["output_token_sampling_mask"] = [kept_ids(int(t), p + i, vocab_size, k)
                                              for i, t in enumerate(out_ids)]
        meta["output_token_sampling_logprobs"] = [float(x) for x in out_logprobs]
        meta["output_token_sampling_mask_length"] = len(out_ids)
