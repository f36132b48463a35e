"""A sample's turn on the engines: segment after segment until the engine ends the turn.

``EngineTurns`` is the runner's engine-call part. Each segment is one
:func:`~strawq.producers.sample_step.step_sample` on the producer's guarded client (budget,
payload, reply check, tokens applied), its wire rids recorded in the group's ``live_rids``
while in flight. A reply from stale weights is re-issued; with every engine stale the turn
waits for the trainer's push; an engine fault is retried ``engine.sample_retries`` times
(backing off), then the sample's group is halted (``GroupHalts.stop_samples``). With a
streaming client, the tokens a faulted segment streamed are already applied
(``sample_step.keep_received``): the retry resumes from them on another engine. A segment
cut by its deadline resumes at once from the longer prefix.

Prefix warming (``GenerationConfig.warm_prefix``) is here too: the group's prompt
prefilled once before its samples, under the group's rid prefix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from strawq.producers.engine_client import EngineClient, warm_prefix
from strawq.producers.engine_errors import EngineAuthError, EngineError, EngineUnavailable
from strawq.producers.engine_versions import NoFreshEngine, StaleEngine, born_at
from strawq.producers.extras_protocol import ExtrasMismatch
from strawq.producers.generate import Halted, SampleFailed
from strawq.producers.group import GroupRun
from strawq.producers.handback import MisconfiguredProducer
from strawq.producers.held import ActiveGroup, GroupHalts
from strawq.producers.meter import StatsBook
from strawq.producers.producer_config import EngineConfig
from strawq.producers.sample import SampleError, SampleStatus
from strawq.producers.sample_step import step_sample

log = logging.getLogger(__name__)


class EngineTurns:
    """Engine turns of the held groups' samples, on the producer's guarded client."""

    def __init__(self, engine: EngineConfig, *, producer_id: str,
                 client: Callable[[], EngineClient], halts: GroupHalts, book: StatsBook,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.producer_id = producer_id
        self._client = client
        self.halts = halts
        self.book = book
        self.clock = clock
        #: the model's EOS ids (``Producer.run`` resolves them at start, strawq.producers.eos)
        self.eos_ids: frozenset[int] | None = None

    async def warm(self, run: GroupRun, todo: list[int]) -> None:
        """The group's prompt prefilled once before its samples (``warm_prefix``, more than
        one fresh sample), so cache-aware routing sends it where they go."""
        if not (self.engine.generation.warm_prefix and len(todo) > 1
                and all(run.samples[i].response_length == 0 for i in todo)):
            return
        rid = f"{run.rid_prefix(self.producer_id)}warm.0"
        try:
            await warm_prefix(self._client(), run.samples[0].prompt_ids.tolist(), rid=rid)
            self.book.bump("prefix_warmups")
        except (EngineError, SampleError, ValueError) as exc:
            log.info("task %s: prefix warm-up failed (%s); the samples go ahead", run.task_id,
                     exc)

    async def turn(self, a: ActiveGroup, i: int, halted: Callable[[], bool]) -> str:
        """Generate sample ``i`` segment by segment until the engine ends the turn; returns
        its finish type (``stop`` / ``length``). Raises :class:`Halted` when the sample must
        stop (``halted()``: parking, pausing, lease lost; an engine fault that gave up)."""
        run = a.run
        if run is None:
            raise Halted()
        s = run.samples[i]
        failures = 0
        engine = self.engine
        while not s.is_final:
            if halted():
                raise Halted()
            rid = run.next_rid(self.producer_id, i)
            a.live_rids.add(rid)  # the client adds each wire rid it sends (retries too)
            if not a.generating:
                a.generating = True
                self.book.hop("claim_to_generate", self.clock() - a.claimed_at)
            held = s.response_length
            try:
                with born_at(a.version):  # a fresh segment: no token older than its group
                    res = await step_sample(self._client(), s, rid=rid,
                                            context_length=engine.generation.context_length,
                                            eos_ids=self.eos_ids, live=a.live_rids)
            except StaleEngine:
                continue  # tokens of the wrong weights discarded; re-issued in rotation
            except NoFreshEngine:  # every engine stale: wait for the trainer's push
                await asyncio.sleep(engine.backoff_s)
                continue
            except EngineAuthError as exc:  # this producer's key: no task can run on it
                a.fault = MisconfiguredProducer(f"task {run.task_id}: {exc}",
                                                key="engine.client.api_key")
                self.halts.stop_samples(a, keep=i)
                raise Halted() from None
            except ExtrasMismatch as exc:  # misaligned per-token extras: this sample fails
                self.book.bump("engine_faults")
                raise SampleFailed(f"engine protocol error: {exc}") from None
            except (EngineError, SampleError) as exc:
                failures += 1
                self.book.bump("engine_faults")
                kept = s.response_length - held  # streamed before the fault: kept
                if kept > 0:
                    self.book.bump("tokens_generated", kept)
                    log.info("task %s sample %d: %d streamed tokens kept; it resumes from "
                             "them", run.task_id, i, kept)
                if isinstance(exc, SampleError) or failures > engine.sample_retries:
                    log.warning("task %s sample %d: giving up after %d failures: %s",
                                run.task_id, i, failures, exc)
                    a.fault = exc
                    self.halts.stop_samples(a, keep=i)
                    raise Halted() from None
                log.info("task %s sample %d: %s; retry %d/%d", run.task_id, i, exc,
                         failures, engine.sample_retries)
                if isinstance(exc, EngineUnavailable):  # maybe still running somewhere
                    self.halts.aborter.abort_soon(rid)
                await asyncio.sleep(engine.backoff_s * failures)
                continue
            finally:
                a.live_rids.discard(rid)
            if res is None:
                continue
            run.texts[i] += res.text
            self.book.bump("tokens_generated", len(res.output_ids))
            if res.deadline_abort:  # cut at the segment deadline: resume from its tokens
                self.book.bump("segment_deadlines")
            elif res.is_abort and not halted():
                # Aborted by someone else (an operator, an engine-side pause): resume.
                self.book.bump("unexpected_aborts")
                await asyncio.sleep(min(0.05 * run.requests[i], 1.0))
        return "stop" if s.status is SampleStatus.COMPLETED else "length"
