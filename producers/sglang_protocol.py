"""SGLang 0.5.x ``/generate`` payloads and responses: building and strict parsing.

Pure functions, no I/O. The parser rejects anything that does not match the protocol
(SGLang 0.5.x's ``/generate`` response, as documented in docs/engines.md) with
:class:`EngineProtocolError`; a response that passes is safe to store.

Weight versions are integers in strawq. The engine's version strings are parsed with
``int()``; a non-numeric version (SGLang's default is ``"default"``) is an error unless
the caller maps it with ``default_version``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strawq.producers.engine_errors import EngineProtocolError
from strawq.producers.sample import LOGPROB_DTYPE, TOKEN_DTYPE, VERSION_DTYPE, Segment

FINISH_TYPES = ("stop", "length", "abort")
WAITING_ABORT_MESSAGE = "Abort in waiting queue"


def parse_version(value: Any, *, url: str | None = None, default_version: int | None = None) -> int:
    """Parse an engine weight version string into an int, with an actionable error."""
    if isinstance(value, bool):
        raise EngineProtocolError(
            f"weight version must be an integer string, found {value!r}", url=url
        )
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            if value == "default" and default_version is not None:
                return default_version
    raise EngineProtocolError(
        f"weight version {value!r} is not an integer; strawq stamps integer versions. Start "
        "the engine with --weight-version 0 (or send /update_weight_version with an integer), "
        "or set ClientConfig.default_version to map SGLang's 'default'",
        url=url,
    )


@dataclass(frozen=True)
class GenerateResult:
    """One validated ``/generate`` answer."""

    rid: str
    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    versions: np.ndarray  # int64, one per output token
    finish_reason: dict[str, Any]
    weight_version: int
    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    num_retractions: int | None
    text: str
    url: str | None
    meta_info: dict[str, Any]
    #: the client aborted it at the segment deadline (``ClientConfig.generate_timeout_s``);
    #: its tokens are the segment, the sample resumes from them
    deadline_abort: bool = False

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason["type"])

    @property
    def is_abort(self) -> bool:
        return self.finish_type == "abort"

    @property
    def is_waiting_abort(self) -> bool:
        return self.is_abort and self.finish_reason.get("message") == WAITING_ABORT_MESSAGE

    def to_segment(self) -> Segment:
        return Segment(
            token_ids=self.output_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason,
        )


def finalize_abort_at_stop(
    result: GenerateResult,
    *,
    eos_ids: Iterable[int],
    stop_token_ids: Iterable[int],
    min_new_tokens: int = 0,
) -> GenerateResult:
    """An aborted reply that ends on a stop token is finished, not resumable.

    SGLang 0.5.23's ``Req.update_finish_state`` applies a pending abort before its EOS /
    stop-token check, so an aborted reply can end with the token that would have stopped
    it. Such a reply is returned as ``{"type": "stop", "matched": id, "aborted": True}``.
    Do not call it for an ``ignore_eos`` request: SGLang 0.5.23 then ignores
    ``stop_token_ids`` too. Below ``min_new_tokens`` no token stops a request, so nothing
    changes there. Stop *strings* are not detected (no tokenizer).
    """
    n = len(result.output_ids)
    if not result.is_abort or n == 0 or n < min_new_tokens:
        return result
    last = int(result.output_ids[-1])
    if last not in set(eos_ids) and last not in {int(t) for t in stop_token_ids}:
        return result
    finish = {"type": "stop", "matched": last, "aborted": True}
    return dataclasses.replace(result, finish_reason=finish)


#: ``sampling_params.custom_params`` key: how many trailing ``input_ids`` are the sample's own
#: earlier output in this turn (a resumed prefix). SGLang 0.5.23 accepts custom_params without
#: ``--enable-custom-logit-processor`` and reads none but its own keys, so the real server
#: ignores it; strawq's ``sim`` engine uses it to find where the prompt ends exactly.
RESUMED_TOKENS_KEY = "strawq_resumed_tokens"


def with_resumed_tokens(sampling_params: Mapping[str, Any], n: int) -> dict[str, Any]:
    """``sampling_params`` with :data:`RESUMED_TOKENS_KEY` set to ``n`` in custom_params."""
    out = dict(sampling_params)
    out["custom_params"] = {**(out.get("custom_params") or {}), RESUMED_TOKENS_KEY: int(n)}
    return out


def build_generate_payload(
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    rid: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": dict(sampling_params),
        "return_logprob": True,
    }
    if rid is not None:
        payload["rid"] = rid
    if extra:
        payload.update(extra)
    return payload


def _int_field(meta: Mapping[str, Any], key: str, url: str | None, *, required: bool) -> int | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise EngineProtocolError(f"meta_info.{key} is missing", url=url)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineProtocolError(
            f"meta_info.{key} must be a non-negative int, found {value!r}", url=url
        )
    return value


def _parse_finish(value: Any, url: str | None) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise EngineProtocolError(
            f"meta_info.finish_reason must be a dict with 'type' in {FINISH_TYPES}, found "
            f"{value!r} (a null finish_reason is only valid in a non-final stream chunk)",
            url=url,
        )
    kind = value.get("type")
    if kind not in FINISH_TYPES:
        raise EngineProtocolError(
            f"finish_reason.type must be one of {FINISH_TYPES}, found {kind!r}", url=url
        )
    return dict(value)


def _parse_spans(spans: Any, n: int, url: str | None, default_version: int | None) -> np.ndarray:
    if not isinstance(spans, list):
        raise EngineProtocolError(
            f"meta_info.weight_versions must be a list of spans, found {type(spans).__name__}",
            url=url,
        )
    out = np.empty(n, dtype=VERSION_DTYPE)
    cursor = 0
    for span in spans:
        if not isinstance(span, Mapping) or not {"version", "start", "end"} <= set(span):
            raise EngineProtocolError(
                f"weight_versions span must have version/start/end, found {span!r}", url=url
            )
        start, end = span["start"], span["end"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise EngineProtocolError(
                f"weight_versions span bounds must be ints, found {span!r}", url=url
            )
        if start != cursor or end < start or end > n:
            raise EngineProtocolError(
                f"weight_versions spans must tile [0, {n}) in order; span {span!r} does not "
                f"start at {cursor} or ends out of range",
                url=url,
            )
        out[start:end] = parse_version(span["version"], url=url, default_version=default_version)
        cursor = end
    if cursor != n:
        raise EngineProtocolError(
            f"weight_versions spans cover [0, {cursor}) but there are {n} output tokens", url=url
        )
    return out


def parse_generate_response(
    body: Any, *, url: str | None = None, default_version: int | None = None
) -> GenerateResult:
    """Validate one ``/generate`` response object (already JSON-decoded)."""
    if not isinstance(body, Mapping):
        raise EngineProtocolError(
            f"/generate response must be a JSON object, found {type(body).__name__}", url=url
        )
    if "error" in body and "meta_info" not in body:
        raise EngineProtocolError(
            f"/generate answered 200 with an error body: {body['error']!r}", url=url
        )
    meta = body.get("meta_info")
    if not isinstance(meta, Mapping):
        raise EngineProtocolError("/generate response has no meta_info object", url=url)
    ids = body.get("output_ids")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise EngineProtocolError(
            f"output_ids must be a list of non-negative ints, found {str(ids)[:80]}", url=url
        )
    n = len(ids)
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise EngineProtocolError(
            "meta_info.output_token_logprobs is missing; send return_logprob=true", url=url
        )
    if len(triples) != n:
        raise EngineProtocolError(
            f"output_token_logprobs has {len(triples)} entries but output_ids has {n}", url=url
        )
    logprobs = np.empty(n, dtype=LOGPROB_DTYPE)
    for i, triple in enumerate(triples):
        if not isinstance(triple, list) or len(triple) < 2:
            raise EngineProtocolError(
                f"output_token_logprobs[{i}] must be [logprob, id, text], found {triple!r}", url=url
            )
        lp, tok = triple[0], triple[1]
        if (
            isinstance(lp, bool)
            or not isinstance(lp, (int, float))
            or not math.isfinite(lp)
            or lp > 1e-3
        ):
            raise EngineProtocolError(
                f"output_token_logprobs[{i}] log-prob must be a finite value <= 0, found {lp!r}",
                url=url,
            )
        if tok != ids[i]:
            raise EngineProtocolError(
                f"output_token_logprobs[{i}] is for token {tok!r} but output_ids[{i}] is {ids[i]}",
                url=url,
            )
        logprobs[i] = lp
    declared = meta.get("output_token_logprobs_length")
    if declared is not None and declared != n:
        raise EngineProtocolError(
            f"output_token_logprobs_length={declared!r} but {n} tokens were returned", url=url
        )
    completion = _int_field(meta, "completion_tokens", url, required=True)
    if completion != n:
        raise EngineProtocolError(
            f"completion_tokens={completion} but output_ids has {n} tokens", url=url
        )
    finish = _parse_finish(meta.get("finish_reason"), url)
    if "weight_version" not in meta:
        raise EngineProtocolError("meta_info.weight_version is missing", url=url)
    version = parse_version(meta["weight_version"], url=url, default_version=default_version)
    spans = meta.get("weight_versions")
    if spans is None:
        versions = np.full(n, version, dtype=VERSION_DTYPE)
    else:
        versions = _parse_spans(spans, n, url, default_version)
    prompt_tokens = _int_field(meta, "prompt_tokens", url, required=False)
    if prompt_tokens is None and not (finish["type"] == "abort" and n == 0):
        raise EngineProtocolError(
            "meta_info.prompt_tokens is missing (only a waiting-queue abort may omit it)", url=url
        )
    rid = meta.get("id")
    text = body.get("text", "")
    return GenerateResult(
        rid=str(rid) if rid is not None else "",
        output_ids=np.asarray(ids, dtype=TOKEN_DTYPE),
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish,
        weight_version=version,
        completion_tokens=n,
        prompt_tokens=prompt_tokens,
        cached_tokens=_int_field(meta, "cached_tokens", url, required=False),
        num_retractions=_int_field(meta, "num_retractions", url, required=False),
        text=text if isinstance(text, str) else "",
        url=url,
        meta_info=dict(meta),
    )


def parse_generate_body(
    body: Any, *, url: str | None = None, default_version: int | None = None
) -> list[GenerateResult]:
    """Parse a single response or the JSON list returned for ``n>1`` / batches."""
    items = body if isinstance(body, list) else [body]
    if not items:
        raise EngineProtocolError("/generate returned an empty list", url=url)
    return [
        parse_generate_response(item, url=url, default_version=default_version) for item in items
    ]
