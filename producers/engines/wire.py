"""SGLang's native ``/generate`` request and reply, as the local engines read and write them.

The generation model behind the HTTP routes of ``strawq.producers.engines.server``: a body
checked as SGLang 0.5.23 checks it (``parse_generate``: its prompts, its sampling
parameters, its rid), the engine requests it makes (``make_reqs``: sub-rids and seeds as
SGLang gives them), and a finished request's reply (``build_response``). No HTTP here: a
bad request is a :class:`BadRequest`, which the server answers with status 400.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strawq.errors import StrawqError
from strawq.producers.engines.core import ABORT_WAITING, EngineCore, Req, ReqParams, detokenize
from strawq.producers.engines.extras import check_request as check_extras_request
from strawq.producers.engines.sim_backend import seed_for_rid
from strawq.producers.sglang_protocol import RESUMED_TOKENS_KEY

SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
)
UNSUPPORTED_NON_DEFAULT = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}


class BadRequest(StrawqError, ValueError):
    """A request the engine answers with HTTP 400 (the message is the reply's body)."""


def _num(sp: Mapping[str, Any], key: str, default: float) -> float:
    value = sp.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"sampling_params.{key} must be a number, found {value!r}")
    return float(value)


def _int(sp: Mapping[str, Any], key: str, default: int) -> int:
    value = sp.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"sampling_params.{key} must be an integer, found {value!r}")
    return value


def parse_sampling_params(sp: Any) -> tuple[ReqParams, int]:
    """Validate ``sampling_params`` like SGLang 0.5.23; returns ``(params, n)``."""
    if sp is None:
        sp = {}
    if not isinstance(sp, Mapping):
        raise BadRequest("sampling_params must be an object")
    unknown = [k for k in sp if k not in SAMPLING_KEYS]
    if unknown:
        raise BadRequest(
            f"unknown field `{unknown[0]}`, expected one of "
            f"{', '.join(f'`{k}`' for k in SAMPLING_KEYS)}"
        )
    for key, default in UNSUPPORTED_NON_DEFAULT.items():
        if sp.get(key) is not None and sp.get(key) != default:
            raise BadRequest(f"sampling_params.{key} is not supported by strawq's local engines")
    max_new = _int(sp, "max_new_tokens", 128)
    if max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    temperature = _num(sp, "temperature", 1.0)
    if temperature < 0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}.")
    top_p = _num(sp, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    top_k = _int(sp, "top_k", -1)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    min_p = _num(sp, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}.")
    min_new = _int(sp, "min_new_tokens", 0)
    if not 0 <= min_new <= max(max_new, 0):
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise BadRequest("stop_token_ids must be a list of integers")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or not all(isinstance(s, str) and s for s in stop)
        or len(stop) > 32
    ):
        raise BadRequest(
            "stop must be a non-empty string or a list of at most 32 non-empty strings"
        )
    n = _int(sp, "n", 1)
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    interval = sp.get("stream_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)
                                 or interval < 1):
        raise BadRequest(f"sampling_params.stream_interval must be an integer >= 1, found "
                         f"{interval!r}")
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_seed must be an integer, found {seed!r}")
    custom = sp.get("custom_params")
    if custom is not None and not isinstance(custom, Mapping):
        raise BadRequest(f"sampling_params.custom_params must be an object, found {custom!r}")
    resumed = (custom or {}).get(RESUMED_TOKENS_KEY)
    if resumed is not None and (
        isinstance(resumed, bool) or not isinstance(resumed, int) or resumed < 0
    ):
        raise BadRequest(
            f"custom_params.{RESUMED_TOKENS_KEY} must be an integer >= 0, found {resumed!r}"
        )
    params = ReqParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop_token_ids=frozenset(stop_ids),
        stop=tuple(stop),
        ignore_eos=bool(sp.get("ignore_eos", False)),
        no_stop_trim=bool(sp.get("no_stop_trim", False)),
        seed=seed,
        resumed_tokens=resumed,
        stream_interval=interval,
    )
    return params, n


def version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def stream_due(req: Req, sent: int) -> bool:
    """Whether a streamed request's next chunk is due, ``sent`` tokens having gone out: as
    SGLang 0.5.23's output streamer, the first token at once, then each time at least
    ``stream_interval`` tokens are unsent (the last chunk goes at the end regardless)."""
    unsent = len(req.out_ids) - sent
    interval = req.params.stream_interval or 1
    return unsent > 0 and (interval == 1 or unsent >= interval or sent == 0)


def stream_event(body: Mapping[str, Any] | None) -> bytes:
    """One SSE event as SGLang 0.5.23 frames it (``None``: the closing ``[DONE]``)."""
    if body is None:
        return b"data: [DONE]\n\n"
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def build_response(
    req: Req, core: EngineCore, *, return_logprob: bool, text_in_logprobs: bool, latency: float
) -> dict[str, Any]:
    finish = req.finish or {}
    ids = req.out_ids
    text_ids = ids
    if (
        finish.get("type") == "stop"
        and not req.params.no_stop_trim
        and isinstance(finish.get("matched"), int)
        and ids
    ):
        text_ids = ids[:-1]
    text = detokenize(text_ids)
    if (
        finish.get("type") == "stop"
        and isinstance(finish.get("matched"), str)
        and not req.params.no_stop_trim
    ):
        text = text.removesuffix(finish["matched"])
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish,  # null in a stream chunk before the last
        "prompt_tokens": len(req.input_ids),
        "weight_version": core.version,
        "weight_versions": version_spans(req.out_versions, core.version),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "cached_tokens_details": None,
        "num_retractions": req.num_retractions,
        "reasoning_tokens": 0,
        "dp_rank": None,
        "e2e_latency": round(latency, 6),
    }
    if finish == ABORT_WAITING:
        for key in ("prompt_tokens", "cached_tokens", "cached_tokens_details", "num_retractions"):
            meta.pop(key)
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, f" {tok}" if text_in_logprobs else None]
            for lp, tok in zip(req.out_logprobs, ids, strict=False)
        ]
        meta["output_token_logprobs_length"] = len(ids)
        meta["input_token_logprobs"] = []
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


@dataclass(frozen=True)
class GenerateBody:
    """A checked ``/generate`` body: its prompts (one, or a batch), each prompt's sampling
    parameters and ``n``, and the rid the client gave (None: a random one)."""

    body: dict[str, Any]
    prompts: list[list[int]]
    parsed: list[tuple[ReqParams, int]]
    batch: bool
    rid: str | None


def parse_generate(body: dict[str, Any], *, vocab_size: int, context_length: int) -> GenerateBody:
    """Check a ``/generate`` body as SGLang 0.5.23 does (:class:`BadRequest` else)."""
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("Either text, input_ids or input_embeds should be provided (exactly one).")
    if given[0] != "input_ids":
        raise BadRequest(
            f"{given[0]} is not supported by strawq's local engines (no tokenizer); "
            "send input_ids"
        )
    if body.get("top_logprobs_num") or body.get("token_ids_logprob") is not None:
        raise BadRequest(
            "top_logprobs_num / token_ids_logprob are not supported by strawq's local engines"
        )
    inputs = body["input_ids"]
    batch = isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], list)
    prompts = inputs if batch else [inputs]
    for p in prompts:
        if not isinstance(p, list) or not p:
            raise BadRequest("input_ids cannot be empty.")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p
        ):
            raise BadRequest(f"input_ids must be integers in [0, {vocab_size})")
    sps = body.get("sampling_params")
    sps_list = sps if isinstance(sps, list) else [sps] * len(prompts)
    if len(sps_list) != len(prompts):
        raise BadRequest("sampling_params list length must match the batch size")
    parsed = [parse_sampling_params(sp) for sp in sps_list]
    for p, (params, _) in zip(prompts, parsed, strict=False):
        check_fits(body, p, params, context_length)
    if body.get("stream") and (batch or any(n > 1 for _, n in parsed)):
        raise BadRequest("stream=true with a batch or n > 1 is not supported by strawq's "
                         "local engines; stream one request at a time")
    rid = body.get("rid")
    if isinstance(rid, list):
        raise BadRequest(
            "a list of rids is not supported; send one rid (batch sub-requests get "
            "'{rid}_{i}', n>1 sub-requests random rids)"
        )
    return GenerateBody(body, prompts, parsed, batch,
                        str(rid) if isinstance(rid, str) and rid else None)


def check_fits(body: Mapping[str, Any], p: list[int], params: ReqParams, ctx: int) -> None:
    """One prompt's per-token extras, resumed-token count and length against the model's
    context (SGLang's messages)."""
    extras_error = check_extras_request(body, len(p), params.temperature, params.top_k)
    if extras_error is not None:
        raise BadRequest(extras_error)
    if len(p) >= ctx:
        raise BadRequest(
            f"The input ({len(p)} tokens) is longer than the model's context length "
            f"({ctx} tokens)."
        )
    if params.resumed_tokens is not None and params.resumed_tokens >= len(p):
        raise BadRequest(
            f"custom_params.{RESUMED_TOKENS_KEY}={params.resumed_tokens} must be less "
            f"than the {len(p)} input tokens (the prompt keeps at least one)"
        )
    if len(p) + params.max_new_tokens >= ctx:
        raise BadRequest(
            "Requested token count exceeds the model's maximum context length of "
            f"{ctx} tokens. You requested a total of {len(p) + params.max_new_tokens} "
            f"tokens: {len(p)} tokens from the input messages and "
            f"{params.max_new_tokens} tokens for the completion. Please reduce the "
            "number of tokens in the input messages or the completion to fit within "
            "the limit."
        )


def make_reqs(g: GenerateBody) -> list[Req]:
    """The engine requests of a checked body: ``n`` per prompt, rids and seeds as SGLang
    0.5.23 gives them (a batch's sub-rids ``{rid}_{i}``, ``n>1`` random ones)."""
    loop = asyncio.get_running_loop()
    reqs = [Req(rid="", input_ids=list(p), params=params, seed=0, done=loop.create_future())
            for p, (params, n) in zip(g.prompts, g.parsed, strict=False) for _ in range(n)]
    base = g.rid or uuid.uuid4().hex
    multi = len(reqs) > 1
    for i, req in enumerate(reqs):
        req.rid = (f"{base}_{i}" if g.batch else uuid.uuid4().hex) if multi else base
        if req.params.seed is not None:
            req.seed = req.params.seed + (i if multi else 0)
        elif g.rid is not None:
            req.seed = seed_for_rid(req.rid)
        else:
            req.seed = random.getrandbits(63)
    return reqs
