"""The sample-state record every downstream part (producers, queue, collector) shares.

A :class:`Sample` is one response being generated for one prompt. It may be produced by
several engine requests ("segments"): a request can be aborted (pause for a weight update,
producer shutdown) and the sample resumed later from its prefix. The per-token arrays —
response ids, rollout log-probs, weight versions, loss mask — always have equal length;
:meth:`Sample.check` verifies it and every mutation calls it.

Budget arithmetic for a resume (see ``docs/engines.md``)::

    remaining = max_new_tokens - len(response)
    if context_length is known:
        remaining = min(remaining, context_length - 1 - len(prompt) - len(response))
    remaining <= 0  ->  the sample finishes as TRUNCATED without any request

(SGLang rejects a request whose ``input + max_new_tokens >= context_length``.)

**Per-token extras** (``strawq.ondisk.extras``): a sample that asks for extras
(``Sample.want_extras``) gets their rows with each segment and keeps them aligned with its
tokens: a response extra has one row per response token, a prompt extra (routed experts)
one row per position of prompt + response, the last a placeholder until the next segment
(or a resume) feeds that token to the model. :meth:`Sample.check` verifies every extra the
sample holds.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from strawq.config import Config
from strawq.errors import ConfigError, StrawqError
from strawq.ondisk.extras import (
    Extra,
    ExtraError,
    cat,
    check_names,
    first_placeholder,
    placeholder,
    rows_for,
    spec_of,
)

logger = logging.getLogger(__name__)

SAMPLE_SCHEMA_VERSION = 1

TOKEN_DTYPE = np.int32
LOGPROB_DTYPE = np.float32
VERSION_DTYPE = np.int64
MASK_DTYPE = np.uint8


class SampleError(StrawqError, ValueError):
    """A sample operation would break the sample's invariants (lengths, budget, state)."""


class SampleStatus(str, enum.Enum):
    """Lifecycle of a sample.

    ::

        PENDING --stop--> COMPLETED
           |  ^ \\--length / zero budget--> TRUNCATED
           |  |
         abort  resume (same transitions as PENDING)
           v  |
          ABORTED

    ``ABORTED`` means "partial, resumable": it is not a final state.
    """

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


_FINISH_TO_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass(frozen=True, kw_only=True)
class SamplerParams(Config):
    """Sampling parameters of one sample; constant across its segments.

    A config section (``strawq.config.Config``): the producer config holds the defaults,
    and a task row's ``sampling_params`` mapping overrides any of these keys for that row's
    samples.
    """

    #: Total response budget over all segments (>= 0).
    max_new_tokens: int = 1024
    #: Sampling temperature (>= 0); below 1e-6 the engine samples greedily.
    temperature: float = 1.0
    #: Nucleus sampling: sample from the most likely tokens whose probabilities add up to
    #: ``top_p``, in (0, 1] (1: all).
    top_p: float = 1.0
    #: Sample from the ``top_k`` most likely tokens: -1 (all) or >= 1.
    top_k: int = -1
    #: Token ids that end the response (the stop token is kept).
    stop_token_ids: tuple[int, ...] = ()
    #: The engine's ``sampling_seed``, or None for engine randomness (SGLang 0.5.23 ignores
    #: it unless the server runs with ``--enable-deterministic-inference``). As a producer's
    #: default it is the base seed: each sample's own seed is derived from it, the task
    #: index, the sample index and the lease generation.
    seed: int | None = None
    #: Keep generating past the model's EOS. On SGLang 0.5.23 it switches off
    #: ``stop_token_ids`` too (every token-based stop); the local engines do the same.
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, found {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:  # also refuses NaN
            raise ConfigError(f"temperature must be >= 0, found {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], found {self.top_p!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"top_k must be -1 (all) or >= 1, found {self.top_k!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be non-negative, found "
                              f"{list(self.stop_token_ids)}")

    def to_sglang(self, max_new_tokens: int | None = None) -> dict[str, Any]:
        """The ``sampling_params`` dict for one request, with an optional reduced budget."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


@dataclass(frozen=True, kw_only=True)
class Segment:
    """One engine response, already validated by the protocol parser.

    ``finish_reason`` is SGLang's dict (``{"type": "stop" | "length" | "abort", ...}``).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: Mapping[str, Any]
    #: per-token extras of this response: a response extra's rows for the new tokens; a
    #: prompt extra's rows for positions ``[extras_start, prompt + response - 1)`` of the
    #: whole sequence after this segment (SGLang's ``routed_experts_start_len``)
    extras: Mapping[str, Extra] = field(default_factory=dict)
    extras_start: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise SampleError(
                f"segment arrays differ in length: {n} ids, {len(self.logprobs)} logprobs, "
                f"{len(self.versions)} versions"
            )
        kind = self.finish_reason.get("type") if isinstance(self.finish_reason, Mapping) else None
        if kind not in _FINISH_TO_STATUS:
            raise SampleError(
                "segment finish_reason type must be stop/length/abort, "
                f"found {self.finish_reason!r}"
            )


def _arr(values: Any, dtype: Any) -> np.ndarray:
    if isinstance(values, (bytes, bytearray)):
        return np.frombuffer(values, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    return np.asarray(values if values is not None else [], dtype=dtype).reshape(-1).copy()


@dataclass(kw_only=True, eq=False)
class Sample:
    """Mutable state of one response. See the module docstring for the invariants."""

    uid: str
    prompt_ids: np.ndarray
    params: SamplerParams
    response_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, TOKEN_DTYPE))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, LOGPROB_DTYPE))
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, VERSION_DTYPE))
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, MASK_DTYPE))
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: dict[str, Any] | None = None
    num_segments: int = 0
    reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: per-token extras asked of the engine (``strawq.ondisk.extras`` names)
    want_extras: tuple[str, ...] = ()
    #: row shape of ``routed_experts`` ([layers, top_k]); empty: one flat row per position
    routed_experts_shape: tuple[int, ...] = ()
    #: per-token extras held, aligned with the tokens (see the module docstring)
    extras: dict[str, Extra] = field(default_factory=dict)
    #: the current turn's end: the response may not pass this length while it is set (the
    #: per-turn token cap, ``ToolsConfig.max_turn_tokens``); None: no turn cap
    turn_limit: int | None = None
    #: the segment in flight, as much of it as the engine has streamed so far, shaped as
    #: the abort reply that would end it now (``finish_reason`` type ``abort``); None while
    #: no segment streams. Not part of the sample's record: :func:`received` applies it to
    #: a copy, which is what a crash right now could keep.
    streamed: Segment | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_ids = _arr(self.prompt_ids, TOKEN_DTYPE)
        self.response_ids = _arr(self.response_ids, TOKEN_DTYPE)
        self.logprobs = _arr(self.logprobs, LOGPROB_DTYPE)
        self.versions = _arr(self.versions, VERSION_DTYPE)
        self.loss_mask = _arr(self.loss_mask, MASK_DTYPE)
        self.status = SampleStatus(self.status)
        try:
            self.want_extras = check_names(self.want_extras)
        except ExtraError as exc:
            raise SampleError(f"sample {self.uid}: {exc}") from None
        self.extras = dict(self.extras)
        self.routed_experts_shape = tuple(int(d) for d in self.routed_experts_shape)
        self.check()

    @classmethod
    def new(cls, uid: str, prompt_ids: Sequence[int] | np.ndarray, params: SamplerParams) -> Sample:
        return cls(uid=uid, prompt_ids=np.asarray(prompt_ids, dtype=TOKEN_DTYPE), params=params)

    # -- invariants -------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`SampleError` unless every invariant holds."""
        n = len(self.response_ids)
        lengths = (len(self.logprobs), len(self.versions), len(self.loss_mask))
        if any(m != n for m in lengths):
            raise SampleError(
                f"sample {self.uid}: per-token arrays differ in length: response_ids={n}, "
                f"logprobs={lengths[0]}, versions={lengths[1]}, loss_mask={lengths[2]}"
            )
        if len(self.prompt_ids) == 0:
            raise SampleError(
                f"sample {self.uid}: prompt_ids is empty; a prompt needs at least one token"
            )
        if n > self.params.max_new_tokens:
            raise SampleError(
                f"sample {self.uid}: response has {n} tokens, "
                f"more than max_new_tokens={self.params.max_new_tokens}"
            )
        if n and (self.loss_mask > 1).any():
            raise SampleError(f"sample {self.uid}: loss_mask must hold only 0/1")
        for name, x in self.extras.items():
            try:
                want = rows_for(name, len(self.prompt_ids), n)
                x.check(f"sample {self.uid}: extra {name!r}")
            except ExtraError as exc:
                raise SampleError(str(exc)) from None
            if x.rows != want:
                raise SampleError(
                    f"sample {self.uid}: extra {name!r} has {x.rows} rows but the sample has "
                    f"{len(self.prompt_ids)} prompt and {n} response tokens (expected {want})"
                )

    def extras_start(self, name: str) -> int:
        """Rows of prompt extra ``name`` already known (up to its first placeholder): the
        next request asks only for the rest (``routed_experts_start_len``)."""
        x = self.extras.get(name)
        if x is None:
            return 0
        return min(first_placeholder(name, x), len(self.prompt_ids) + self.response_length)

    def pad_extras(self, n: int) -> None:
        """Placeholder rows for ``n`` tokens appended without the engine (a tool's output),
        before :meth:`check`: the next request fills those of a prompt extra."""
        for name, x in list(self.extras.items()):
            self.extras[name] = cat([x, placeholder(name, n, x.shape)])

    # -- derived ----------------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def is_final(self) -> bool:
        return self.status.is_final

    def remaining_budget(self, context_length: int | None = None) -> int:
        """Tokens the next segment may generate (>= 0); see the module docstring."""
        remaining = self.params.max_new_tokens - self.response_length
        if self.turn_limit is not None:
            remaining = min(remaining, self.turn_limit - self.response_length)
        if context_length is not None:
            remaining = min(
                remaining, context_length - 1 - len(self.prompt_ids) - self.response_length
            )
        return max(0, remaining)

    def resume_input_ids(self) -> list[int]:
        """Prompt followed by every generated token: the next request's ``input_ids``."""
        return [int(t) for t in self.prompt_ids] + [int(t) for t in self.response_ids]

    def min_version(self) -> int | None:
        return int(self.versions.min()) if len(self.versions) else None

    # -- mutation ---------------------------------------------------------------------
    def finish_without_request(self) -> None:
        """Mark the sample TRUNCATED because its budget is spent (no engine call)."""
        self._require_resumable()
        self.status = SampleStatus.TRUNCATED
        self.finish_reason = {"type": "length", "length": 0}
        self.check()

    def _require_resumable(self) -> None:
        if self.status.is_final:
            raise SampleError(
                f"sample {self.uid} is already {self.status.value}; "
                "only pending or aborted samples can be extended"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain python types only (ints, floats, str, lists, dicts): msgpack- and JSON-able."""
        return {
            "schema": SAMPLE_SCHEMA_VERSION,
            "uid": self.uid,
            "prompt_ids": self.prompt_ids.tolist(),
            "params": self.params.to_dict(),
            "response_ids": self.response_ids.tolist(),
            "logprobs": self.logprobs.tolist(),
            "versions": self.versions.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "status": self.status.value,
            "finish_reason": None if self.finish_reason is None else dict(self.finish_reason),
            "num_segments": self.num_segments,
            "reward": self.reward,
            "extra": dict(self.extra),
            "want_extras": list(self.want_extras),
            "routed_experts_shape": list(self.routed_experts_shape),
            "extras": {k: x.to_dict() for k, x in self.extras.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        schema = data.get("schema")
        if schema != SAMPLE_SCHEMA_VERSION:
            raise SampleError(
                f"sample record schema {schema!r} is not supported; "
                f"expected {SAMPLE_SCHEMA_VERSION}"
            )
        known = {f.name for f in fields(cls)} | {"schema"}
        unknown = set(data) - known
        if unknown:
            raise SampleError(
                f"unknown sample record keys {sorted(unknown)}; "
                f"expected a subset of {sorted(known)}"
            )
        kwargs = {k: v for k, v in data.items() if k != "schema"}
        try:
            kwargs["params"] = SamplerParams.from_dict(data["params"])
        except ConfigError as exc:
            raise SampleError(f"sample record params are invalid: {exc}") from None
        if kwargs.get("finish_reason") is not None:
            kwargs["finish_reason"] = dict(kwargs["finish_reason"])
        kwargs["extra"] = dict(kwargs.get("extra") or {})
        kwargs["want_extras"] = tuple(kwargs.get("want_extras") or ())
        kwargs["routed_experts_shape"] = tuple(kwargs.get("routed_experts_shape") or ())
        try:
            kwargs["extras"] = {k: Extra.from_dict(k, v)
                                for k, v in (kwargs.get("extras") or {}).items()}
        except (ExtraError, ValueError, TypeError) as exc:
            raise SampleError(f"sample record extras are invalid: {exc}") from None
        return cls(**kwargs)


def received(sample: Sample) -> Sample:
    """A copy of ``sample`` holding every token the producer has received: its applied
    segments and, when a segment is streaming (``Sample.streamed``), that segment's tokens
    so far as an aborted (resumable) segment. The copy's ``streamed`` is None; ``sample``
    is untouched."""
    copy = Sample.from_dict(sample.to_dict())
    seg = sample.streamed
    if seg is not None and len(seg.token_ids) and not copy.is_final:
        apply_segment(copy, seg)
    return copy


def apply_segment(sample: Sample, segment: Segment) -> int:
    """Append one engine response onto ``sample``; return the number of tokens appended.

    The new tokens get loss mask 1. The status follows ``finish_reason``: stop →
    COMPLETED, length → TRUNCATED, abort → ABORTED (resumable). The sample is untouched
    if the segment would overrun ``max_new_tokens`` or the sample is already final.
    """
    sample._require_resumable()
    n_new = len(segment.token_ids)
    if sample.response_length + n_new > sample.params.max_new_tokens:
        raise SampleError(
            f"sample {sample.uid}: segment of {n_new} tokens would overrun max_new_tokens="
            f"{sample.params.max_new_tokens} (already {sample.response_length}); segment rejected"
        )
    extras = (_extend_extras(sample, segment, sample.response_length)
              if segment.extras or sample.extras else {})
    sample.response_ids = np.concatenate(
        [sample.response_ids, np.asarray(segment.token_ids, TOKEN_DTYPE)]
    )
    sample.extras = extras
    sample.logprobs = np.concatenate([sample.logprobs, np.asarray(segment.logprobs, LOGPROB_DTYPE)])
    sample.versions = np.concatenate([sample.versions, np.asarray(segment.versions, VERSION_DTYPE)])
    sample.loss_mask = np.concatenate([sample.loss_mask, np.ones(n_new, MASK_DTYPE)])
    sample.status = _FINISH_TO_STATUS[str(segment.finish_reason["type"])]
    sample.finish_reason = dict(segment.finish_reason)
    if n_new:
        sample.num_segments += 1
    sample.check()
    logger.debug("sample %s: +%d tokens, status %s", sample.uid, n_new, sample.status.value)
    return n_new


def _extend_extras(sample: Sample, segment: Segment, old_len: int) -> dict[str, Extra]:
    """The sample's extras after ``segment`` (before its tokens are appended)."""
    p, n_new = len(sample.prompt_ids), len(segment.token_ids)
    out: dict[str, Extra] = {}
    for name in dict.fromkeys([*sample.extras, *segment.extras]):
        old = sample.extras.get(name)
        new = segment.extras.get(name)
        try:
            if not spec_of(name).prompt:
                base = old if old is not None else placeholder(name, old_len)
                add = new if new is not None else placeholder(name, n_new)
                out[name] = cat([base, add])
                continue
            shape = (new or old or placeholder(name, 0)).shape
            if new is None:  # nothing returned (no tokens): the placeholders stay
                out[name] = cat([old.take(0, p + old_len) if old is not None
                                 else placeholder(name, p + old_len, shape),
                                 placeholder(name, n_new, shape)])
                continue
            start = segment.extras_start
            have = old.rows if old is not None else 0
            if start and (old is None or have < start):
                raise SampleError(f"sample {sample.uid}: extra {name!r} resumes at row "
                                  f"{start} but the sample holds {have} rows")
            head = old.take(0, start) if old is not None else placeholder(name, 0, shape)
            out[name] = cat([head, new, placeholder(name, 1, shape)])
        except ExtraError as exc:
            raise SampleError(f"sample {sample.uid}: {exc}") from None
        want = rows_for(name, p, old_len + n_new)
        if out[name].rows != want:
            raise SampleError(f"sample {sample.uid}: extra {name!r} would have "
                              f"{out[name].rows} rows after this segment, expected {want}")
    return out


def mask_offpolicy_prefix(sample: Sample, current_version: int) -> int:
    """Zero the loss mask of tokens generated by weights older than ``current_version``.

    The behaviour of slime's ``--mask-offpolicy-in-partial-rollout``. Returns how many
    tokens were newly masked.
    """
    old = (sample.versions < current_version) & (sample.loss_mask == 1)
    count = int(old.sum())
    if count:
        sample.loss_mask = sample.loss_mask.copy()
        sample.loss_mask[old] = 0
    sample.check()
    return count
