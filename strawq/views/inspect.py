"""Readable views of single records, for ``strawq inspect`` and for people debugging a run."""

from __future__ import annotations

from typing import Any

from strawq.data.history import HISTORY_DIR, history_view
from strawq.delivery.retention import find_drop
from strawq.errors import CorruptRecord, NotFound, TaskNotFound
from strawq.ondisk import records
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import TaskName, data_key
from strawq.ondisk.records import Kind
from strawq.tasks.queue import RunQueue


def _resolve(queue: RunQueue, key: str) -> str:
    if "/" in key:
        return key
    _state, found, _name = queue.locate(key)  # a bare task id
    return found


def describe_record(queue: RunQueue, key: str, *, tokens: int = 16) -> dict[str, Any]:
    """A readable view of one record; ``"error"`` is set when it fails its checks.

    ``history`` is the per-prompt history's totals, ``history/<task id>`` one prompt's
    (``strawq.data.history``).

    A bare task id that is in no state is looked up in the drop audit (a dropped task
    whose entry ``gc`` compacted); ``TaskNotFound`` if it is not there either.
    """
    if key == HISTORY_DIR or key.startswith(f"{HISTORY_DIR}/"):  # the per-prompt history
        tid = key.partition("/")[2]
        return history_view(queue.storage, tid or None)
    if "/" not in key:
        try:
            key = _resolve(queue, key)
        except TaskNotFound:
            row = find_drop(queue.storage, key)
            if row is None:
                raise
            return {"key": row["segment"], "kind": "DROP", "state": "dropped",
                    "compacted": True, "meta": row}
    out: dict[str, Any] = {"key": key}
    leaf = key.rsplit("/", 1)[1]
    name = TaskName.try_parse(leaf)
    if name is not None:
        out["name"] = {"id": name.id, "generation": name.gen, "attempts": name.attempts,
                       "resume_from_generation": name.resume, "holder_or_reason": name.producer,
                       "order_key": name.key}
    try:
        data = queue.storage.read(key)
    except NotFound:
        raise NotFound(2, f"{key}: no such record in this run") from None
    try:
        rec = records.decode(data, name=key)
    except CorruptRecord as exc:
        out["error"] = str(exc)
        return out
    out["kind"] = rec.kind.name
    out["bytes"] = len(data)
    if rec.kind in (Kind.GROUP, Kind.PARTIAL):
        g = GroupData.from_record(rec)
        out["group"] = g.summary()
        out["samples"] = [
            {k: v[:tokens].tolist() for k, v in g.sample(i).items()} | {
                "length": g.sample_lens[i], "status": g.status[i], "reward": g.rewards[i]}
            for i in range(g.num_samples)
        ]
    else:
        out["meta"] = {k: v for k, v in rec.meta.items() if k != "tables"}
    if rec.kind == Kind.TASK and name is not None and name.resume >= 0:
        out["resumes_from"] = data_key(name.id, name.resume, "partial")
    return out
