"""slime generates, strawq keeps the data: ``StrawqDataSource`` and ``slime_rollout``.

``--data-source-path strawq.collector.integrations.slime.StrawqDataSource`` (with
``--rollout-function-path strawq.collector.integrations.slime.slime_rollout`` to tag each
hand-out with its rollout id). Prompts come from strawq's durable dataset cursor; the groups
slime aborts (``--partial-rollout``) are saved as durable partial tasks (prefix tokens,
log-probs, per-token versions, loss masks) and handed out again first; a group handed out is
leased under the producer id ``slime.r<rollout_id>``, so the lease's *name* says which
rollout it went to. ``save(c)`` records every group handed out to a rollout ≤ c as trained
(LEASED → TRAINED: the lease is retired, ``strawq.tasks.states.retire_lease``; nothing lands in
``dropped/``); ``load(c)`` after a crash does the same for leases of rollouts ≤ c (the
checkpoint holds them) and returns later ones to the queue, prefixes kept. Nothing lost,
nothing trained twice (``docs/slime.md``). A run an older strawq wrote holds its trained
groups in ``dropped/`` with reason ``trained``: they still count as trained
(``strawq.tasks.states.LEGACY_TRAINED``), never served again.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from strawq.collector.integrations.slime.samples import (
    META,
    _slime,
    group_to_samples,
    run_dir,
    samples_to_group,
)
from strawq.config import QueueConfig
from strawq.data.feeder import Feeder
from strawq.data.mixture import open_dataset
from strawq.errors import CorruptRecord, LeaseLost, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import data_key
from strawq.ondisk.records import Kind
from strawq.storage import open_storage
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.states import DIRS, LEGACY_TRAINED, TaskState, key_of, names_in, retire_lease

log = logging.getLogger(__name__)

#: producer id prefix of the data source's leases; the suffix is the rollout id
PRODUCER_PREFIX = "slime.r"
_PRODUCER_RE = re.compile(r"slime\.r(\d+)")
#: what an older strawq recorded as the drop reason of groups slime trained; they are
#: retired now (LEASED -> TRAINED) and such old entries count as trained
TRAINED = LEGACY_TRAINED
#: reason recorded for groups that slime's dynamic-sampling filter rejected
FILTERED = "filtered"
#: statuses of a sample slime finished (its dynamic-sampling filter judges the group)
FINISHED = ("completed", "truncated", "failed")
#: statuses slime returns as they are when the sample is handed out again
KEPT_AS_IS = ("completed", "truncated")


@dataclass
class _Held:
    lease: Lease
    rollout: int
    #: the Samples handed out (slime's rollout generates into these objects)
    samples: list[Any] = field(default_factory=list)


class StrawqDataSource:
    """slime's ``DataSource`` over a strawq run (``--data-source-path``).

    Implements slime's abstract ``DataSource`` (``get_samples``, ``add_samples``, ``save``,
    ``load``, ``__len__``) and registers itself as one. The data source is the run's only
    feeder and only producer: run no ``strawq collector`` on this run.
    """

    def __init__(self, args: Any) -> None:
        _slime("slime.rollout.data_source").DataSource.register(StrawqDataSource)
        self.args = args
        self.group_size = int(args.n_samples_per_prompt)
        self.prompt_key = getattr(args, "input_key", None) or "prompt"
        path = run_dir(args)
        os.makedirs(path, exist_ok=True)
        storage = open_storage(path, writer_id="slime")
        try:
            self.queue = RunQueue.open(storage)
        except NotFound:
            self.queue = RunQueue.create(storage, QueueConfig(
                group_size=self.group_size, prompt_key=self.prompt_key,
                release_batch=max(int(getattr(args, "rollout_batch_size", 64) or 64), 1),
                num_epochs=int(getattr(args, "num_epoch", None) or 1)))
        if self.queue.config.group_size != self.group_size:
            raise ValueError(f"the run at {path} has group_size {self.queue.config.group_size}"
                             f", slime's --n-samples-per-prompt is {self.group_size}")
        epochs = getattr(args, "num_epoch", None)
        if epochs is not None and int(epochs) != self.queue.config.num_epochs:
            raise ValueError(f"the run at {path} makes {self.queue.config.num_epochs} passes "
                             f"over the dataset (queue.num_epochs), slime's --num-epoch is "
                             f"{epochs}")
        self.dataset = open_dataset(args.prompt_data, prompt_key=self.prompt_key)
        self.feeder = Feeder(self.queue, self.dataset)
        self._held: dict[str, _Held] = {}
        #: rollout the next hand-outs belong to (``begin_rollout``; else last save + 1)
        self._rollout: int | None = None
        self._next_tag = 0
        self._recovered = False

    # -- rollout tagging ---------------------------------------------------------------------
    def begin_rollout(self, rollout_id: int) -> None:
        """Hand-outs from now on belong to ``rollout_id`` (``slime_rollout`` calls this)."""
        self._recover(int(rollout_id) - 1)
        self._rollout = int(rollout_id)
        if rollout_id > self.queue.current_version():
            self.queue.set_version(int(rollout_id))

    def _tag(self) -> int:
        return self._rollout if self._rollout is not None else self._next_tag

    # -- slime's DataSource API --------------------------------------------------------------
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """``num_samples`` groups: partial tasks first, then fresh prompts from the cursor."""
        self._recover(self._next_tag - 1)
        tag = self._tag()
        producer = f"{PRODUCER_PREFIX}{tag}"
        leases = self.queue.claim(producer, num_samples)
        while len(leases) < num_samples and not self.feeder.exhausted:
            want = num_samples - len(leases)
            self.feeder.release(max(want, self.queue.config.release_batch))
            leases += self.queue.claim(producer, want)
        if not leases and num_samples > 0:
            raise RuntimeError(f"strawq run {self.queue.storage.describe()}: the dataset is "
                               "exhausted and no partial or returned task is pending")
        out = []
        for lease in leases:
            prev = self.queue.load_partial(lease)
            group = group_to_samples(
                lease.task, prev, self.group_size, gen=lease.gen,
                label_key=getattr(self.args, "label_key", None),
                metadata_key=getattr(self.args, "metadata_key", None),
                prompt_key=self.prompt_key)
            out.append(group)
            self._held[lease.task_id] = _Held(lease, tag, list(group))
        return out

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Aborted groups come back: saved as durable partial tasks (or returned untouched
        when nothing was generated), handed out again before fresh prompts."""
        for group in samples:
            held = self._pop(group)
            if held is None:
                continue
            g = samples_to_group(held.lease.task_id, int(held.lease.task["index"]), group,
                                 version=self.queue.current_version())
            try:
                if g is None:
                    self.queue.release(held.lease)
                else:
                    self.queue.yield_partial(held.lease, g)
            except LeaseLost as exc:
                log.error("group %s could not be saved: %s", held.lease.task_id, exc)

    def trained(self, samples: Sequence[Sequence[Any]]) -> None:
        """Settle the groups of this rollout that slime did not train (``slime_rollout``
        calls this with the groups it trains; those stay held until ``save``).

        A group handed out but neither trained nor added back is, by the state of the
        Samples slime generated into:

        * **finished** (every sample completed, truncated or failed) and rejected by slime's
          dynamic-sampling filter (``--dynamic-sampling-filter-path``, asked again on the
          same group): recorded as consumed — dropped with reason ``filtered`` and the
          filter's reason in the note, in the drop audit like every drop (docs/design.md,
          invariant 1) — never served again;
        * **finished** and kept by the filter (slime had its batch full before this one
          came back): saved as a partial task that needs no generation, trained by a later
          rollout (with a failed sample, which slime would generate again from its
          output, returned untouched instead);
        * otherwise (aborted without ``--partial-rollout``, or never generated): returned
          to the queue untouched, no attempt spent.
        """
        keep = {self._task_id(g) for g in samples}
        verdict = self._filter()
        for tid in [t for t in self._held if t not in keep]:
            held = self._held.pop(tid)
            try:
                self._settle_unused(held, verdict)
            except LeaseLost as exc:
                log.error("group %s could not be settled: %s", tid, exc)

    def _filter(self) -> Any:
        """slime's dynamic-sampling filter as ``group -> DynamicFilterOutput`` (keeps every
        group when none is configured)."""
        path = getattr(self.args, "dynamic_sampling_filter_path", None)
        call = _slime("slime.rollout.filter_hub.base_types").call_dynamic_filter
        fn = _slime("slime.utils.misc").load_function(path) if path else None
        return lambda group: call(fn, self.args, group)

    def _settle_unused(self, held: _Held, verdict: Any) -> None:
        lease, group = held.lease, held.samples
        status = [s.status.value for s in group]
        if not group or not all(st in FINISHED for st in status):
            log.info("group %s was neither trained nor added back (aborted without "
                     "--partial-rollout); returned to the queue", lease.task_id)
            self.queue.release(lease)
            return
        out = verdict(group)
        rewards = [s.reward if isinstance(s.reward, (int, float)) else None for s in group]
        if not out.keep:
            reason = getattr(out, "reason", None) or "rejected"
            self._drop(lease, FILTERED, f"slime's dynamic-sampling filter: {reason}",
                       summary={"rollout": held.rollout, "index": lease.task["index"],
                                "filter_reason": str(reason), "rewards": rewards})
            log.info("group %s rejected by slime's dynamic-sampling filter (%s): dropped",
                     lease.task_id, reason)
            return
        if not all(st in KEPT_AS_IS for st in status):  # slime generates a failed one again
            self.queue.release(lease)
            return
        g = samples_to_group(lease.task_id, int(lease.task["index"]), group,
                             version=self.queue.current_version())
        if g is None:
            self.queue.release(lease)
            return
        self.queue.yield_partial(lease, g)
        log.info("group %s finished after slime's batch was full: kept for a later rollout",
                 lease.task_id)

    def save(self, rollout_id: int) -> None:
        """Groups handed out to rollouts ≤ ``rollout_id`` are trained: recorded durably."""
        rollout_id = int(rollout_id)
        for tid in [t for t, h in self._held.items() if h.rollout <= rollout_id]:
            self._consume(self._held.pop(tid).lease, rollout_id)
        self.queue.storage.sync_dirs([DIRS[TaskState.LEASED]])  # the retirements, durable
        self._next_tag = max(self._next_tag, rollout_id + 1)
        save_dir = getattr(self.args, "save", None)
        if save_dir:
            path = os.path.join(save_dir, f"rollout/strawq_data_source_{rollout_id}.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"rollout_id": rollout_id, "run": self.queue.storage.describe(),
                           "next_index": self.feeder.cursor.next_index}, f)

    def load(self, rollout_id: int | None = None) -> None:
        """Resume after a crash: leases of rollouts ≤ ``rollout_id`` were trained into the
        checkpoint, later ones go back to the queue (their prefixes kept)."""
        last = -1 if rollout_id is None else int(rollout_id)
        self._recovered = False
        self._recover(last)
        self._next_tag = last + 1

    def __len__(self) -> int:
        return len(self.dataset)

    # -- internals ---------------------------------------------------------------------------
    def _recover(self, last_trained: int) -> None:
        """Once per process: settle the leases a previous process left (by rollout tag)."""
        if self._recovered:
            return
        self._recovered = True
        for name in names_in(self.queue.storage, TaskState.LEASED):
            m = _PRODUCER_RE.fullmatch(name.producer or "")
            if m is None or name.id in self._held:
                continue
            key = key_of(TaskState.LEASED, name)
            try:
                rec = records.decode(self.queue.storage.read(key), expect=Kind.TASK, name=key)
            except (NotFound, CorruptRecord) as exc:
                log.error("cannot settle %s: %s", key, exc)
                continue
            lease = Lease(name, rec.meta["task"])
            try:
                if int(m[1]) <= last_trained:
                    self._consume(lease, last_trained)
                else:
                    self.queue.release(lease)
                    log.warning("returned %s (handed out to rollout %s, after the checkpoint "
                                "of rollout %d) to the queue", name.id, m[1], last_trained)
            except LeaseLost:
                continue
        self.queue.storage.sync_dirs([DIRS[TaskState.LEASED]])

    def _consume(self, lease: Lease, rollout_id: int) -> None:
        """The group is trained (its rollout ≤ ``rollout_id``, whose checkpoint holds it):
        LEASED -> TRAINED, the lease retired (fsync'd by the caller, once per save); the
        prefix it resumed from is read by nobody again."""
        try:
            retire_lease(self.queue.storage, lease.name, sync_dir=False)
        except NotFound:
            log.error("group %s: lease %s is no longer held (it expired and was re-queued, "
                      "or was retired already); not recorded as trained by rollout %d",
                      lease.task_id, lease.name, rollout_id)
            return
        log.debug("group %s (index %s) trained by slime: checkpoint of rollout %d",
                  lease.task_id, lease.task["index"], rollout_id)
        self._forget_prefix(lease)

    def _drop(self, lease: Lease, reason: str, message: str,
              summary: dict[str, Any]) -> None:
        """Record a group as consumed; the prefix it resumed from is read by nobody."""
        self.queue.drop(lease, reason, message, summary=summary)
        self._forget_prefix(lease)

    def _forget_prefix(self, lease: Lease) -> None:
        if lease.has_partial:  # the prefix it resumed from is consumed: nothing reads it again
            self.queue.storage.delete(data_key(lease.task_id, lease.name.resume, "partial"))

    @staticmethod
    def _task_id(group: Sequence[Any]) -> str | None:
        for s in group:
            tid = (s.metadata or {}).get(META, {}).get("task_id")
            if tid:
                return str(tid)
        return None

    def _pop(self, group: Sequence[Any]) -> _Held | None:
        tid = self._task_id(group)
        held = self._held.pop(tid, None) if tid else None
        if held is None:
            log.error("add_samples: a group that this data source did not hand out (task %s)"
                      "; ignored", tid)
        return held


def slime_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
                  ) -> Any:
    """slime's own SGLang rollout, with the rollout id handed to ``StrawqDataSource``.

    ``--rollout-function-path strawq.collector.integrations.slime.slime_rollout``: tags the
    hand-outs (exact save/load under ``train_async``) and settles at once the groups slime
    neither trained nor added back (``StrawqDataSource.trained``: a dynamic-sampling filter
    reject is dropped as ``filtered``, a finished surplus group kept for a later rollout,
    an aborted one returned).
    """
    train_output = _slime("slime.rollout.base_types").RolloutFnTrainOutput
    slime_generate = _slime("slime.rollout.sglang_rollout").generate_rollout

    if evaluation or not isinstance(data_source, StrawqDataSource):
        return slime_generate(args, rollout_id, data_source, evaluation=evaluation)
    data_source.begin_rollout(rollout_id)
    out = slime_generate(args, rollout_id, data_source, evaluation=False)
    samples = out.samples if isinstance(out, train_output) else out
    data_source.trained(samples)
    return out
