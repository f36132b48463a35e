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
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strawq.producers.engine_errors import (EngineProtocolError, EngineRequestError,
                                             EngineUnavailable)
from strawq.producers.sample import LOGPROB_DTYPE, TOKEN_DTYPE, VERSION_DTYPE, Segment

FINISH_TYPES = ("stop", "length", "abort")
WAITING_ABORT_MESSAGE = "Abort in waiting queue"
#: the finish a non-final stream chunk is given: the abort reply that would end the request
#: with the tokens received so far (the request itself still runs on the engine)
STREAMED_SO_FAR: dict[str, Any] = {"type": "abort", "message": "Streamed so far"}


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
    #: a non-final chunk of a streamed reply: the tokens so far, its finish the
    #: abort-shaped :data:`STREAMED_SO_FAR` (the request still runs)
    streaming: bool = False

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
    stream: bool = False,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": dict(sampling_params),
        "return_logprob": True,
    }
    if stream:
        payload["stream"] = True
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


def _parse_finish(value: Any, url: str | None, *, chunk: bool = False) -> dict[str, Any]:
    if value is None and chunk:
        return dict(STREAMED_SO_FAR)
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
    body: Any, *, url: str | None = None, default_version: int | None = None,
    chunk: bool = False,
) -> GenerateResult:
    """Validate one ``/generate`` response object (already JSON-decoded).

    ``chunk``: the object is one chunk of a streamed reply (``"stream": true``); a
    non-final chunk's ``finish_reason`` is null and it is returned shaped as the abort
    reply that would end the request now (:data:`STREAMED_SO_FAR`, ``streaming`` set).
    Everything else is checked as in a whole reply."""
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
    finish = _parse_finish(meta.get("finish_reason"), url, chunk=chunk)
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
        streaming=chunk and meta.get("finish_reason") is None,
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


class StreamReader:
    """The chunks of one streamed ``/generate`` reply (``"stream": true``), line by line.

    SGLang 0.5.23 answers ``text/event-stream``: one ``data: {json}`` event per chunk,
    then ``data: [DONE]``. Without ``--incremental-streaming-output`` (its default) every
    chunk is **cumulative**: the whole reply so far (``output_ids``, the log-probs, the
    weight-version spans, ``completion_tokens``), its ``finish_reason`` null until the last
    one. Each chunk is checked as a whole reply (:func:`parse_generate_response`) and must
    extend the one before (an incremental server breaks that: a clear error). An error
    raised on the server after the headers comes as a ``data: {"error": {...}}`` event.
    The per-token ``weight_versions`` spans come with the last chunk only: a chunk before
    it stamps its new tokens with its ``weight_version`` (:meth:`holdable` is False once
    that changed during the stream).
    """

    def __init__(self, *, url: str | None = None, default_version: int | None = None) -> None:
        self.url = url
        self.default_version = default_version
        #: the newest chunk (None: none yet)
        self.last: GenerateResult | None = None
        #: ``data: [DONE]`` was read
        self.done = False
        #: the weight version changed mid-stream: the chunks' stamps are unsure before the
        #: last (which carries the spans)
        self.unsure = False

    def feed(self, line: bytes | str) -> GenerateResult | None:
        """One line of the stream; returns the chunk it completes (None: framing only)."""
        text = (line.decode("utf-8", "replace") if isinstance(line, bytes) else line).strip()
        if not text or text.startswith(":") or not text.startswith("data:"):
            return None  # blank separator, SSE comment, or a field strawq does not use
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return None
        if self.done:
            raise EngineProtocolError("stream chunk after data: [DONE]", url=self.url)
        if self.last is not None and not self.last.streaming:
            raise EngineProtocolError("stream chunk after the final one", url=self.url)
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise EngineProtocolError(f"stream chunk is not JSON ({exc}): {data[:120]!r}",
                                      url=self.url) from None
        if isinstance(body, Mapping) and "error" in body and "meta_info" not in body:
            err = body["error"]
            message = err.get("message") if isinstance(err, Mapping) else err
            code = err.get("code") if isinstance(err, Mapping) else None
            raise EngineRequestError(f"/generate stream ended with an error: {message}",
                                     url=self.url, status=code if isinstance(code, int) else 400)
        chunk = parse_generate_response(body, url=self.url, chunk=True,
                                        default_version=self.default_version)
        prev = self.last
        if prev is not None:
            n = len(prev.output_ids)
            if (len(chunk.output_ids) < n
                    or not np.array_equal(chunk.output_ids[:n], prev.output_ids)
                    or not np.array_equal(chunk.logprobs[:n], prev.logprobs)):
                raise EngineProtocolError(
                    f"stream chunk of {len(chunk.output_ids)} tokens does not extend the one "
                    f"before ({n} tokens): strawq reads cumulative chunks; start SGLang "
                    "without --incremental-streaming-output", url=self.url)
        if chunk.streaming and "weight_versions" not in chunk.meta_info:
            # SGLang 0.5.23 sends the per-token spans with the last chunk only; before it,
            # the tokens already received keep their stamps, the new ones get the chunk's
            # version, and a version that changed makes the stamps unsure until the last
            if prev is not None:
                new = len(chunk.output_ids) - len(prev.output_ids)
                chunk = dataclasses.replace(chunk, versions=np.concatenate(
                    [prev.versions, np.full(new, chunk.weight_version, VERSION_DTYPE)]))
                if chunk.weight_version != prev.weight_version:
                    self.unsure = True
        self.last = chunk
        return chunk

    def holdable(self, chunk: GenerateResult) -> bool:
        """Whether the producer may hold ``chunk`` as received: a chunk before the last,
        every token's version known (none changed during the stream)."""
        return chunk.streaming and not self.unsure

    def result(self) -> GenerateResult:
        """The final chunk: the reply. :class:`EngineUnavailable` when the stream ended
        before it (the connection closed, the engine died): :attr:`last` holds what came."""
        if self.last is None or self.last.streaming:
            got = 0 if self.last is None else len(self.last.output_ids)
            raise EngineUnavailable(f"/generate stream ended before its final chunk "
                                    f"({got} tokens received)", url=self.url)
        return self.last
