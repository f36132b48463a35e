"""Scoring a group: the teacher's log-probs and the reward of each final sample, then the
group filter's verdict — what happens between a sample's end and the group's hand-back
(``strawq.producers.runner``).

Each step is optional and plugged in by the producer's configuration: a teacher
(``record.teacher_url``) scores a final sample before its reward, the reward plugin
(``plugins.reward``) gives its reward, the filter plugin (``plugins.filter``) may drop the
finished group with a reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from strawq.data.tokenize import FunctionTokenizer, PromptTokenizer
from strawq.errors import ConfigError
from strawq.ondisk.names import validate_id
from strawq.producers.group import GroupRun
from strawq.producers.handback import MisconfiguredProducer
from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload
from strawq.producers.plugins import FilterFn, RewardFn, call_reward, load_filter, load_reward
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.teacher import Teacher

log = logging.getLogger(__name__)


class GroupScorer:
    """The teacher, the reward and the filter of one producer's groups."""

    def __init__(self, config: ProducerConfig, *, threads: Offload, book: StatsBook,
                 tokenizer: PromptTokenizer | None) -> None:
        self.config = config
        self.reward_fn: RewardFn = load_reward(config.plugins.reward, config.plugins.reward_args)
        self.filter_fn: FilterFn | None = load_filter(config.plugins.filter)
        #: scores final samples for ``teacher_logprobs`` (``strawq.producers.teacher``)
        teacher_url = config.record.teacher_url
        self.teacher = None if teacher_url is None else Teacher(teacher_url, config.engine.client)
        #: rewards see the decoded response ids, not the segments' texts stitched together
        self.decode: Callable[[list[int]], str] | None = (
            tokenizer.decode if tokenizer is not None
            and not isinstance(tokenizer, FunctionTokenizer) else None)
        self.threads = threads
        self.book = book

    async def score(self, run: GroupRun, i: int) -> None:
        """Reward one final sample; an error is recorded on it, never raised — except a
        ``ConfigError`` or ``ImportError`` of the plugin (this producer's configuration or
        installation): ``MisconfiguredProducer``. With a teacher, its log-probs first (a
        failure there fails the sample)."""
        if self.teacher is not None and not await self.teacher.score(run, i):
            return
        s = run.samples[i]
        try:
            run.rewards[i] = await call_reward(self.reward_fn, self.threads, run.lease.task,
                                               [int(t) for t in s.response_ids],
                                               run.sample_meta(i), self.decode)
            run.reward_errors.pop(i, None)
        except (ConfigError, ImportError) as exc:
            raise MisconfiguredProducer(
                f"task {run.task_id}: the reward plugin {self.config.plugins.reward} cannot "
                f"run here: {type(exc).__name__}: {exc}", key="plugins.reward") from exc
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is the sample's
            run.rewards[i] = None
            run.reward_errors[i] = f"{type(exc).__name__}: {exc}"[:500]
            self.book.bump("reward_errors")
            log.warning("task %s sample %d: reward failed: %s", run.task_id, i, exc)

    async def score_missing(self, run: GroupRun) -> None:
        """Score the final samples not scored yet (a group resumed with its samples final)."""
        for i in range(run.size):
            if run.rewards[i] is None and i not in run.reward_errors and i not in run.failures:
                await self.score(run, i)

    def drop_reason(self, run: GroupRun) -> tuple[str | None, str]:
        """The filter's verdict (a failing filter keeps the group), or ``sample_failed`` /
        ``reward_error`` when no sample has a reward; (None, "") keeps the group."""
        reason: str | None = None
        if self.filter_fn is not None:
            try:
                reason = self.filter_fn(run.lease.task, run.rewards_for_filter())
                if reason is not None:
                    validate_id(reason, "filter drop reason")
            except Exception as exc:  # noqa: BLE001 - keep the group, note the failure
                log.warning("task %s: filter failed (%s); keeping the group", run.task_id, exc)
                reason = None
        if reason is None and run.size and not run.rewards_for_filter():
            if not run.reward_errors:
                return "sample_failed", "; ".join(sorted(set(run.failures.values())))
            return "reward_error", "; ".join(sorted(set(run.reward_errors.values())))
        return reason, ""

    async def close(self) -> None:
        if self.teacher is not None:
            await self.teacher.close()
