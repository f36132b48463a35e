"""slime adapters: strawq as slime's data source, and strawq's collector as slime's rollout.

Two ways to run slime on strawq (``docs/slime.md``):

1. **slime generates, strawq keeps the data** — ``--data-source-path
   strawq.collector.integrations.slime.StrawqDataSource`` (with
   ``--rollout-function-path strawq.collector.integrations.slime.slime_rollout`` to tag each
   hand-out with its rollout id). Prompts come from strawq's durable dataset cursor; the
   groups slime aborts (``--partial-rollout``) are saved as durable partial tasks (prefix
   tokens, log-probs, per-token versions, loss masks) and handed out again first; a group
   handed out is leased under the producer id ``slime.r<rollout_id>``, so the lease's *name*
   says which rollout it went to. ``save(c)`` records every group handed out to a rollout
   ≤ c as trained (dropped with reason ``trained``); ``load(c)`` after a crash does the same
   for leases of rollouts ≤ c (the checkpoint holds them) and returns later ones to the
   queue, prefixes kept. Nothing lost, nothing trained twice.
2. **strawq's producers generate, slime trains** — ``--rollout-function-path
   strawq.collector.integrations.slime.generate_rollout`` reads one collector batch per
   rollout through ``BatchReader`` and returns slime ``Sample`` groups;
   ``--custom-update-weight-post-write-path
   strawq.collector.integrations.slime.begin_weight_update_hook`` opens the weight-update
   bracket once slime has written new weights, and the next ``generate_rollout`` closes it
   (the engines have loaded them by then). ``--data-source-path
   strawq.collector.integrations.slime.StrawqBatchSource`` ties slime's ``save``/``load`` to
   the reader's checkpoint state.

The run directory comes from ``args.strawq_run`` (``--custom-config-path`` YAML) or the
``STRAWQ_RUN`` environment variable.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from typing import Any

from strawq.collector.integrations.slime_samples import (EXTRA_FIELDS, META, _slime,
                                                         apply_extras, batch_extras,
                                                         batch_to_samples, group_to_samples,
                                                         run_dir, run_versions,
                                                         samples_to_group)
from strawq.collector.integrations.slime_source import (PRODUCER_PREFIX, TRAINED,
                                                        StrawqDataSource, slime_rollout)
from strawq.collector.reader import BatchReader

log = logging.getLogger(__name__)


# -- mode 2: strawq's producers generate, slime trains ----------------------------------------
class _ReaderState:
    """One reader per process and run, and the batches delivered per rollout."""

    readers: dict[str, BatchReader] = {}
    delivered: dict[str, deque[tuple[int, int]]] = {}

    @classmethod
    def reader(cls, path: str) -> BatchReader:
        if path not in cls.readers:
            cls.readers[path] = BatchReader.open(path, rank=0, world_size=1)
            cls.delivered[path] = deque()
        return cls.readers[path]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
                     ) -> Any:
    """``--rollout-function-path``: one strawq collector batch as slime Sample groups.

    Closes a weight-update bracket left open by ``begin_weight_update_hook`` (slime's
    engines have loaded the new weights before it asks for the next rollout), acks the
    batches of rollouts ≤ ``rollout_id − strawq_ack_lag`` (default 1: slime's synchronous
    loop; use 2 with ``train_async``), then reads the next batch.
    """
    train_output = _slime("slime.rollout.base_types").RolloutFnTrainOutput
    if evaluation:
        raise NotImplementedError("strawq's rollout function serves training batches; "
                                  "evaluate with slime's --eval-function-path "
                                  "slime.rollout.sglang_rollout.generate_rollout")
    path = run_dir(args)
    reader = _ReaderState.reader(path)
    delivered = _ReaderState.delivered[path]
    if reader.bracket.is_open:
        reader.end_weight_update()
    lag = int(getattr(args, "strawq_ack_lag", 1))
    while delivered and delivered[0][0] <= rollout_id - lag:
        reader.ack(delivered.popleft()[1])
    batch = reader.next_batch(timeout=float(getattr(args, "strawq_batch_timeout_s", 600.0)))
    delivered.append((int(rollout_id), batch.seq))
    want = getattr(args, "rollout_batch_size", None)
    if want is not None and len(batch.groups) != int(want):
        log.warning("strawq batch %d has %d groups, slime's --rollout-batch-size is %s: set "
                    "the collector's batch_groups to match", batch.seq, len(batch.groups), want)
    metrics = {f"strawq/{k}": v for k, v in batch.stats.items()}
    metrics.update({"strawq/batch_seq": batch.seq, "strawq/version": batch.version,
                    "strawq/skipped": len(batch.skipped)})
    return train_output(samples=batch_to_samples(batch), metrics=metrics)


def begin_weight_update_hook(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """``--custom-update-weight-post-write-path``: pause strawq's producers (trainer rank 0)
    after slime wrote the new weights and before the engines read them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    reader = _ReaderState.reader(run_dir(args))
    rep = reader.begin_weight_update(float(getattr(args, "strawq_bracket_timeout_s", 300.0)))
    log.info("strawq producers paused for weight version %d (%s)", rep.version, version_dir)


class StrawqBatchSource:
    """``--data-source-path`` for ``generate_rollout``: slime's ``save``/``load`` carry the
    reader's checkpoint state (the last batch trained), so a restarted job is never given a
    batch its checkpoint already holds. Prompts come from the collector, not from here."""

    def __init__(self, args: Any) -> None:
        _slime("slime.rollout.data_source").DataSource.register(StrawqBatchSource)
        self.args = args
        self.path = run_dir(args)

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        raise NotImplementedError("with strawq's generate_rollout the collector releases the "
                                  "prompts; this data source only carries save/load")

    def add_samples(self, samples: list[list[Any]]) -> None:
        raise NotImplementedError("strawq's producers keep their own partial groups")

    def _file(self, root: str, rollout_id: int) -> str:
        return os.path.join(root, f"rollout/strawq_reader_{rollout_id}.json")

    def save(self, rollout_id: int) -> None:
        reader = _ReaderState.reader(self.path)
        seqs = [s for r, s in _ReaderState.delivered[self.path] if r <= int(rollout_id)]
        state = reader.state_dict(consumed=max(seqs) if seqs else None)
        root = getattr(self.args, "save", None)
        if root:
            os.makedirs(os.path.join(root, "rollout"), exist_ok=True)
            with open(self._file(root, int(rollout_id)), "w", encoding="utf-8") as f:
                json.dump(state, f)

    def load(self, rollout_id: int | None = None) -> None:
        root = getattr(self.args, "load", None)
        if root is None or rollout_id is None:
            return
        path = self._file(root, int(rollout_id))
        if not os.path.exists(path):
            log.info("no strawq reader state at %s", path)
            return
        with open(path, encoding="utf-8") as f:
            _ReaderState.reader(self.path).load_state_dict(json.load(f))

    def __len__(self) -> int:
        return 0


__all__ = ["EXTRA_FIELDS", "META", "PRODUCER_PREFIX", "TRAINED", "StrawqBatchSource",
           "StrawqDataSource", "apply_extras", "batch_extras", "batch_to_samples",
           "begin_weight_update_hook", "generate_rollout", "group_to_samples", "run_dir",
           "run_versions", "samples_to_group", "slime_rollout"]
