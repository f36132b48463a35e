"""Loading a leased group: the queue's version, its saved prefixes or its prompt ids, the
η verdict on a partial, the samples' parameters — everything before the group's first
request (``strawq.producers.runner``).

A partial past the η bound is judged here, before a token is spent on it (the policy the
collector published, ``strawq.tasks.eta``): ``regenerate`` and ``drop`` raise :class:`PastEta`
and ``past_eta`` hands it back; ``train`` resumes it and counts it. A prompt this
producer's configuration cannot run (no tokenizer for text, a plain tokenizer for chat) is
``MisconfiguredProducer``: handed back untouched, never dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from strawq.data.dataset import prompt_kind
from strawq.data.tokenize import FunctionTokenizer
from strawq.errors import CorruptRecord, NotFound, StrawqError
from strawq.ondisk.groups import GroupData
from strawq.producers.group import GroupRun, TaskError, prompt_ids_of, sample_seed
from strawq.producers.handback import HandBack, MisconfiguredProducer
from strawq.producers.journal_flush import load_prefix
from strawq.producers.meter import StatsBook
from strawq.producers.plugins import load_tokenizer
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sample import SampleError, SamplerParams
from strawq.tasks.eta import STALE_REASON
from strawq.tasks.journal import JournalReader
from strawq.tasks.queue import Lease, RunQueue

log = logging.getLogger(__name__)


class PastEta(Exception):
    """A claimed partial is past the η bound and the policy discards it (not an error)."""

    def __init__(self, action: str, version: int) -> None:
        super().__init__(action)
        self.action = action
        self.version = version


class GroupLoader:
    """Builds a leased group's ``GroupRun`` (fresh, or from its saved prefixes)."""

    def __init__(self, config: ProducerConfig, *, queue: RunQueue, group_size: int,
                 book: StatsBook) -> None:
        self.config = config
        self.queue = queue
        self.group_size = group_size
        self.book = book
        self.prompt_key = queue.config.prompt_key
        self.tokenizer = load_tokenizer(config.plugins.tokenizer, config.plugins.tokenizer_args)
        #: the journals' segments read for earlier claims (``load_prefix``)
        self.journal_reader = JournalReader(queue.storage)

    def params(self, task: dict[str, Any], i: int, gen: int = 0) -> SamplerParams:
        row = task.get("row") if isinstance(task.get("row"), dict) else {}
        overrides = row.get("sampling_params") if isinstance(row, dict) else None
        seed = None if self.config.sampling.seed is None else sample_seed(
            self.config.sampling.seed, int(task.get("index", 0)), i, gen)
        try:
            return self.config.sampler_params(overrides, seed)
        except StrawqError as exc:
            raise TaskError(f"task {task.get('id')}: {exc}") from exc

    def load(self, lease: Lease, checkpoint: GroupData | None = None
              ) -> tuple[int, GroupData | None, list[int] | None]:
        """I/O thread: the current version and the saved prefixes (a turn checkpoint
        newer than the partial record, else the partial), or the prompt ids.

        A partial past the η bound under ``regenerate``/``drop`` raises ``PastEta`` before
        its prefix is read (``eta_action``)."""
        version = self.queue.current_version()
        if lease.has_partial:
            action = self.eta_action(lease, version)
            if action in ("regenerate", "drop"):
                raise PastEta(action, version)
        if checkpoint is not None:
            return version, checkpoint, None
        if lease.has_partial:
            problem: Exception | None = None
            if lease.journal is None:  # else the prefix is in its writer's journal
                try:
                    return version, self.queue.load_partial(lease), None
                except (NotFound, CorruptRecord) as exc:
                    problem = exc
            try:
                prefix = load_prefix(self.queue, lease, lambda i: self.params(lease.task, i),
                                     reader=self.journal_reader)
            except (CorruptRecord, SampleError) as exc:
                prefix, problem = None, exc
            if prefix is not None:
                self.book.bump("journal_resumes")
                return version, prefix, None
            log.error("task %s: no usable prefix of generation %d (%s); generating the "
                      "group afresh", lease.task_id, lease.name.resume,
                      problem or "its journal holds none")
        problem = self.config_problem(lease.task)
        if problem is not None:
            raise problem
        return version, None, prompt_ids_of(lease.task, self.prompt_key, self.tokenizer)

    def config_problem(self, task: dict[str, Any]) -> MisconfiguredProducer | None:
        """Why this producer's configuration cannot run ``task``'s prompt, or None: a text
        or chat prompt without a tokenizer, a chat prompt with a text-only one."""
        row = task.get("row")
        kind = prompt_kind(row.get(self.prompt_key)) if isinstance(row, dict) else None
        what = f"task {task.get('id')}: its prompt {self.prompt_key!r} is {kind}"
        if kind in ("text", "chat") and self.tokenizer is None:
            return MisconfiguredProducer(f"{what} but this producer has no tokenizer",
                                         key="plugins.tokenizer (e.g. 'hf:<model dir>')")
        if kind == "chat" and isinstance(self.tokenizer, FunctionTokenizer):
            return MisconfiguredProducer(
                f"{what} but the tokenizer {self.config.plugins.tokenizer} is a plain "
                "(text) -> ids function with no chat template",
                key="plugins.tokenizer (a chat tokenizer, e.g. 'hf:<model dir>')")
        return None

    def eta_action(self, lease: Lease, version: int, oldest: int | None = None) -> str | None:
        """The η policy's verdict on a claimed partial (``strawq.tasks.eta``): None within η (or
        with no published policy); ``train`` is resumed here and counted. ``oldest``: the
        prefix's oldest version (default: the claimed name's; a group held through a pause
        passes its own)."""
        oldest = lease.name.version if oldest is None else oldest
        policy = self.queue.eta_policy()
        action = None if policy is None else policy.partial_action(
            # the cap on regeneration cycles counts this task's generations, not its
            # failures (TaskName.regenerations: a regeneration spends no attempt)
            version, oldest, attempts=lease.name.regenerations + 1,
            max_attempts=self.queue.config.max_attempts)
        if action == "train":
            self.book.bump("partials_over_eta")
            log.info("task %s: its prefix (oldest version %d) is past eta %s at version %d; "
                     "resumed (eta_mode=train)", lease.task_id, oldest,
                     policy.max_staleness if policy else None, version)
        return action

    async def past_eta(self, lease: Lease, past: PastEta, handback: HandBack, *,
                       oldest: int | None = None) -> None:
        """Hand back a claimed partial past η before a token is spent on it (``oldest``: as
        for ``eta_action``)."""
        oldest = lease.name.version if oldest is None else oldest
        policy = self.queue.eta_policy()
        eta = policy.max_staleness if policy is not None else None
        behind = past.version - oldest
        msg = (f"partial prefix at version {oldest} is {behind} versions behind "
               f"version {past.version}, past eta {eta}")
        log.info("task %s: %s; %s (eta_mode=%s)", lease.task_id, msg,
                 "dropped" if past.action == "drop" else "generated afresh", past.action)
        if past.action == "drop":
            await handback.drop(lease, STALE_REASON, msg)
        else:
            await handback.regenerate(lease, STALE_REASON, msg)

    def build(self, lease: Lease, partial: GroupData | None,
               prompt: list[int] | None) -> GroupRun:
        if partial is not None:
            return GroupRun.from_partial(lease, partial, lambda i: self.params(lease.task, i))
        if prompt is None:
            raise TaskError(f"task {lease.task_id}: neither a partial nor a prompt to run")
        return GroupRun.fresh(lease, prompt, [self.params(lease.task, i, lease.gen)
                                              for i in range(self.group_size)])
