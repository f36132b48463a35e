"""Per-token extras over SGLang 0.5.x's ``/generate``: the request flags and the parsing.

What a sample asks for (``Sample.want_extras``, from ``ProducerConfig.record.extras``) and where
SGLang 0.5.23 answers it (its ``io_struct.GenerateReqInput`` and ``tokenizer_manager``):

==================  =======================================  ==================================
extra               request                                  ``meta_info``
==================  =======================================  ==================================
routed_experts      ``return_routed_experts: true``,         ``routed_experts``: base64 of
                    ``routed_experts_start_len: s``          int32 [seq_len − 1 − s, layers,
                    (server: ``--enable-return-routed-       top_k] (seq_len = prompt_tokens +
                    experts``, an MoE model)                 completion_tokens)
top_p_token_ids     ``return_sampling_mask: true``           ``output_token_sampling_mask``:
                                                             per output token, the ids its
                                                             sampling kept (top-p/top-k/min-p)
==================  =======================================  ==================================

slime's patched engines answer top-p with flat ``top_p_kept_token_ids`` /
``top_p_token_ids`` plus ``…_offsets`` [n + 1]; both forms are read. A row count or shape
that does not match the tokens is an :class:`ExtrasMismatch`: the sample fails (recorded,
never trained), the response is not appended — a record is never misaligned.
``teacher_logprobs`` are not a generation output (a teacher scores the finished sample).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

from strawq.ondisk.extras import ROUTED_EXPERTS, TOP_P_TOKEN_IDS, Extra
from strawq.producers.engine_errors import EngineProtocolError
from strawq.producers.sample import Sample, Segment
from strawq.producers.sglang_protocol import GenerateResult

#: the extras an engine returns with a generation segment
GENERATED = (ROUTED_EXPERTS, TOP_P_TOKEN_IDS)
_TOP_P_FLAT = (("top_p_kept_token_ids", "top_p_kept_token_offsets"),
               ("top_p_token_ids", "top_p_token_offsets"))


class ExtrasMismatch(EngineProtocolError):
    """An engine's per-token extras do not line up with its tokens (or are missing)."""


def extras_payload(sample: Sample) -> dict[str, Any]:
    """Top-level ``/generate`` fields that ask for the sample's extras."""
    out: dict[str, Any] = {}
    if ROUTED_EXPERTS in sample.want_extras:
        out["return_routed_experts"] = True
        out["routed_experts_start_len"] = sample.extras_start(ROUTED_EXPERTS)
    if TOP_P_TOKEN_IDS in sample.want_extras:
        out["return_sampling_mask"] = True
    return out


def _int32s(value: Any, what: str, url: str | None) -> np.ndarray:
    """An int32 array from base64 bytes (SGLang's encoding) or a list."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
            raise ExtrasMismatch(f"meta_info.{what} is not valid base64: {exc}", url=url) \
                from None
        if len(raw) % 4:
            raise ExtrasMismatch(f"meta_info.{what} has {len(raw)} bytes, not a whole number "
                                 "of int32 values", url=url)
        return np.frombuffer(raw, dtype="<i4").astype(np.int32)
    try:
        arr = np.asarray(value, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: past int64
        raise ExtrasMismatch(f"meta_info.{what} must be base64 int32 or a list of ints: "
                             f"{exc}", url=url) from None
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ExtrasMismatch(f"meta_info.{what} holds values outside int32", url=url)
    return arr.astype(np.int32)


def _routed(meta: Mapping[str, Any], n: int, sample: Sample, start: int,
            shape: tuple[int, ...], url: str | None) -> Extra | None:
    value = meta.get("routed_experts")
    if value is None:
        if n:
            raise ExtrasMismatch(
                "meta_info.routed_experts is missing (asked with return_routed_experts); "
                "start the server with --enable-return-routed-experts on an MoE model",
                url=url)
        return None
    flat = _int32s(value, "routed_experts", url)
    rows = len(sample.prompt_ids) + sample.response_length + n - 1 - start
    if rows <= 0:
        if flat.size:
            raise ExtrasMismatch(f"meta_info.routed_experts has {flat.size} values for no "
                                 "new position", url=url)
        return Extra(flat.reshape(0, *shape) if shape else flat.reshape(0, 0))
    per_row = int(np.prod(shape)) if shape else flat.size // rows
    if per_row == 0 or flat.size != rows * per_row:
        raise ExtrasMismatch(
            f"meta_info.routed_experts has {flat.size} values, expected {rows} rows "
            f"(positions [{start}, {rows + start})) of {list(shape) or 'k'} values", url=url)
    return Extra(flat.reshape(rows, *(shape or (per_row,))))


def _top_p(meta: Mapping[str, Any], n: int, url: str | None) -> Extra | None:
    rows = meta.get("output_token_sampling_mask")
    if rows is not None:
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise ExtrasMismatch("meta_info.output_token_sampling_mask must be a list of id "
                                 "lists", url=url)
        if len(rows) != n:
            raise ExtrasMismatch(f"meta_info.output_token_sampling_mask has {len(rows)} rows "
                                 f"but {n} tokens were returned", url=url)
        counts = np.array([len(r) for r in rows], dtype=np.int32)
        values = _int32s([t for r in rows for t in r], "output_token_sampling_mask", url)
        return Extra(values, counts)
    for ids_key, off_key in _TOP_P_FLAT:
        if meta.get(ids_key) is None and meta.get(off_key) is None:
            continue
        if meta.get(ids_key) is None or meta.get(off_key) is None:
            raise ExtrasMismatch(f"meta_info has one of {ids_key}/{off_key} without the "
                                 "other", url=url)
        ids = _int32s(meta[ids_key], ids_key, url)
        off = _int32s(meta[off_key], off_key, url).astype(np.int64)
        if (off.size != n + 1 or off[0] != 0 or off[-1] != ids.size
                or (np.diff(off) < 0).any()):
            raise ExtrasMismatch(f"meta_info.{off_key} must be {n + 1} non-decreasing offsets "
                                 f"from 0 to {ids.size} (len {off.size})", url=url)
        return Extra(ids, np.diff(off).astype(np.int32))
    if n:
        raise ExtrasMismatch("meta_info.output_token_sampling_mask is missing (asked with "
                             "return_sampling_mask)", url=url)
    return None


def segment_for(result: GenerateResult, sample: Sample) -> Segment:
    """``result`` as a segment of ``sample``, with the extras the sample asked for
    (``ExtrasMismatch`` when they do not line up with the tokens)."""
    seg = result.to_segment()
    want = [w for w in sample.want_extras if w in GENERATED]
    if not want:
        return seg
    n, meta, url = len(result.output_ids), result.meta_info, result.url
    extras: dict[str, Extra] = {}
    start = sample.extras_start(ROUTED_EXPERTS)
    if ROUTED_EXPERTS in want:
        x = _routed(meta, n, sample, start, sample.routed_experts_shape or _held_shape(sample), url)
        if x is not None:
            extras[ROUTED_EXPERTS] = x
    if TOP_P_TOKEN_IDS in want:
        y = _top_p(meta, n, url)
        if y is not None:
            extras[TOP_P_TOKEN_IDS] = y
    return Segment(token_ids=seg.token_ids, logprobs=seg.logprobs, versions=seg.versions,
                   finish_reason=seg.finish_reason, extras=extras, extras_start=start)


def _held_shape(sample: Sample) -> tuple[int, ...]:
    x = sample.extras.get(ROUTED_EXPERTS)
    return x.shape if x is not None and x.rows else ()


__all__ = ["ExtrasMismatch", "GENERATED", "extras_payload", "segment_for"]
