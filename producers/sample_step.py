"""The sample step: one segment of one sample, from its budget to its tokens applied.

The producer's runner (``strawq.producers.runner.GroupRunner.generate_turn``) calls
:func:`step_sample` once per segment; the engine client under it only speaks the protocol::

    budget   Sample.remaining_budget(context_length)   (0: TRUNCATED, no request)
    payload  resume_input_ids + sampling params with the budget and the resumed prefix
             (+ the extras' request fields)
    engine   client.generate(...)   (a GuardedClient: a reply from the wrong weights
             raises StaleEngine before it reaches this step)
    check    no more tokens than the budget; an abort that landed on a stop token is final
    apply    apply_segment(sample, segment_for(result, sample))

A streaming client (``ClientConfig.stream``) hands each chunk before the last to the step,
which checks it as the reply (budget, the stop rule, extras) and holds it as
``Sample.streamed``: the segment so far, shaped as the abort that would end it now (what
``strawq.producers.sample.received`` applies to a copy). The last chunk is applied as an
unstreamed reply is, and ``streamed`` cleared. When the engine or the connection dies
mid-segment (``EngineUnavailable`` / ``EngineTimeout``), or the step is cancelled, what
arrived is applied as an aborted segment (:func:`keep_received`) before the fault goes
up: the turn's retry resumes from the longer prefix, on another engine, and only the
tokens not received are lost.

The check needs the model's EOS ids: a producer resolves them once, when it starts
(``strawq.producers.eos.resolve_eos_ids``). The step's settings are
:class:`GenerationConfig` (``ProducerConfig.engine.generation``); the resumed prefix a
request declares is :func:`resumed_tokens`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, MutableSet
from dataclasses import dataclass
from typing import Any

import numpy as np

from strawq.config import Config
from strawq.errors import ConfigError

from strawq.producers.engine_client import EngineClient, takes_chunks
from strawq.producers.engine_errors import EngineProtocolError, EngineTimeout, EngineUnavailable
from strawq.producers.extras_protocol import ExtrasMismatch, extras_payload, segment_for
from strawq.producers.engine_versions import resuming
from strawq.producers.sample import Sample, SampleError, SampleStatus, apply_segment
from strawq.producers.sglang_protocol import (GenerateResult, finalize_abort_at_stop,
                                              with_resumed_tokens)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GenerationConfig(Config):
    """The sample step's settings (``ProducerConfig.engine.generation``): what a reply
    means for a sample. The engine client's own settings (timeouts, retries, keys, routing)
    are ``ClientConfig`` (``engine.client``)."""

    #: The engines' context length (SGLang ``--context-length``): a segment's budget is
    #: clamped so that prompt + response stay below it, and an appended (tool) turn that
    #: would pass it ends the sample truncated. None: only ``max_new_tokens`` bounds them.
    context_length: int | None = None
    #: The model's EOS ids (an aborted reply ending on one is final). None: resolved when
    #: the producer starts, from the engine (``/model_info`` ``eos_token_id``), the
    #: tokenizer or the model's config files; a producer refuses to start when none of them
    #: names one, unless ``ignore_eos`` (``strawq.producers.eos.resolve_eos_ids``).
    eos_token_ids: tuple[int, ...] | None = None
    #: Before a fresh group's samples, send its prompt once with ``max_new_tokens`` 0 and
    #: wait for it (what SGLang does itself for an ``n > 1`` request, which the client sends
    #: as n requests): the G samples then find the prompt in the engine's radix cache
    #: instead of all prefilling it side by side. It goes where the samples go with
    #: ``engine.client.routing_policy`` ``cache_aware`` (or a router's cache-aware policy);
    #: with ``round_robin`` over several engines it mostly misses. Costs one prefill round
    #: trip before each fresh group; one that fails is ignored.
    warm_prefix: bool = False

    def validate(self) -> None:
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"GenerationConfig.context_length must be >= 2, found "
                              f"{self.context_length}")


def resumed_tokens(sample: Sample) -> int:
    """The prefix a request for ``sample`` resumes: 0 when it starts a turn; after an abort,
    the trailing response tokens the engine generated (loss mask 1) since the prompt or the
    last appended (tool) token."""
    if sample.status is not SampleStatus.ABORTED:
        return 0
    appended = np.flatnonzero(sample.loss_mask == 0)
    return sample.response_length - (int(appended[-1]) + 1 if len(appended) else 0)


async def step_sample(client: EngineClient, sample: Sample, *, rid: str | None = None,
                      context_length: int | None = None,
                      eos_ids: Iterable[int] | None = None,
                      live: MutableSet[str] | None = None) -> GenerateResult | None:
    """Run (or resume) ``sample`` for one segment and apply the reply onto it.

    Sends prompt + generated ids with the remaining budget, and how many of them are the
    resumed prefix (``custom_params``, which SGLang ignores). With a zero budget the
    sample becomes TRUNCATED and no request is made (returns None). The reply is checked
    against the budget before anything is appended; an aborted reply ending on one of
    ``eos_ids`` or the sample's stop tokens is final (unless ``ignore_eos``). Every wire
    rid in flight is in ``live`` while it is.
    """
    if sample.is_final:
        raise SampleError(
            f"sample {sample.uid} is already {sample.status.value}; nothing to generate")
    budget = sample.remaining_budget(context_length)
    if budget <= 0:
        sample.finish_without_request()
        return None
    params = with_resumed_tokens(sample.params.to_sglang(max_new_tokens=budget),
                                 resumed_tokens(sample))
    stop = _stop_rule(sample, eos_ids)

    def on_chunk(chunk: GenerateResult) -> None:
        # a streamed chunk: the reply so far, checked as the reply is, held on the sample
        _check_budget(chunk, budget)
        try:
            sample.streamed = segment_for(stop(chunk), sample)
        except ExtrasMismatch:
            pass  # extras not (yet) aligned with the tokens: the last chunk held stays

    try:
        chunks: dict[str, Any] = {"on_chunk": on_chunk} if takes_chunks(client) else {}
        with resuming(sample.versions):  # routed by its prefix's version (rolling updates)
            result = await client.generate(sample.resume_input_ids(), params, rid=rid,
                                           extra=extras_payload(sample) or None, live=live,
                                           **chunks)
    except (EngineUnavailable, EngineTimeout, asyncio.CancelledError):
        # the engine or the connection died, or the step was cancelled (a halt that did
        # not wait for the reply): keep what arrived
        keep_received(sample)
        raise
    finally:
        sample.streamed = None
    _check_budget(result, budget)
    apply_segment(sample, segment_for(stop(result), sample))
    return result


def keep_received(sample: Sample) -> int:
    """Apply the tokens a segment streamed before it was cut (``Sample.streamed``, an
    aborted segment; final when it ends on a stop token) and clear it; returns how many
    were applied. The next segment resumes from them."""
    seg, sample.streamed = sample.streamed, None
    if seg is None or not len(seg.token_ids) or sample.is_final:
        return 0
    n = apply_segment(sample, seg)
    log.info("sample %s: segment cut after %d streamed tokens; they are kept", sample.uid, n)
    return n


def _check_budget(result: GenerateResult, budget: int) -> None:
    if len(result.output_ids) > budget:
        raise EngineProtocolError(
            f"engine returned {len(result.output_ids)} tokens for a budget of {budget} "
            f"(rid {result.rid}); segment rejected", url=result.url)


def _stop_rule(sample: Sample, eos_ids: Iterable[int] | None
               ) -> Callable[[GenerateResult], GenerateResult]:
    """An aborted reply ending on one of ``eos_ids`` or the sample's stop tokens is final
    (not with ``ignore_eos``, which switches off every token-based stop on SGLang 0.5.23)."""
    if eos_ids is None or sample.params.ignore_eos:
        return lambda r: r
    eos = frozenset(int(t) for t in eos_ids)
    return lambda r: finalize_abort_at_stop(r, eos_ids=eos,
                                            stop_token_ids=sample.params.stop_token_ids)
