"""A sample's trajectory: the turns, appended tokens and tool calls that made its response.

A multi-turn sample's response is one token sequence (what the trainer trains on) cut into
*spans*: generated turns (loss mask 1, rollout log-probs, the engine's versions) and appended
tokens (tool results, observations, chat-template glue: loss mask 0, log-prob 0, no weight
of their own). Tool calls sit between spans with their idempotency key and result. The
trajectory is an append-only list of events, persisted with the sample in every partial and
ready record (``meta["trajectories"][i]``)::

    {"op": "gen", "start": s, "end": e | None, "finish": "stop" | "length" | None}
    {"op": "append", "start": s, "end": e, "kind": "tool" | "obs" | "glue" | ...}
    {"op": "tool", "key": k, "name": n, "args": {...}, "result": ..., "attempts": a,
     "seconds": t, "started": wall-clock start (time.time())}

and, beside the events, ``epoch`` (fresh-environment restarts) and ``gen`` (the lease
generation the trajectory started under; both go into the tool calls' idempotency keys),
``inflight`` (the tool-call journal's open entry: a call started and not yet finished —
key, name, args, ``idempotent``, ``started``; a resumed trajectory re-runs it with the same
key, or asks the tool's ``reconcile`` hook when it is not idempotent) and ``env`` (the
environment's snapshot at the checkpoint, with ``at``: the event count it belongs to).

A ``gen`` event whose ``end`` is None is a turn cut by an abort (weight update, stop): the
next generation continues it from the saved prefix. A resumed trajectory is *replayed*: the
generate plugin runs again from the start and every operation that the record already holds
returns the recorded outcome (no engine call, no tool execution), so a tool call whose result
was persisted is never executed again. Pure data: no I/O, no asyncio.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strawq.errors import StrawqError

TRAJECTORY_SCHEMA = 1
OPS = ("gen", "append", "tool")


class TrajectoryError(StrawqError, ValueError):
    """A trajectory record is malformed, or a replay does not match what was recorded (the
    generate plugin is not deterministic given the trajectory so far)."""


def idempotency_key(task_id: str, sample: int, epoch: int, ordinal: int, name: str,
                    args: Any, prefix: Sequence[int], gen: int | None = None) -> str:
    """The key a tool call carries: the same call at the same point of the same trajectory
    gets the same key on every producer and after every crash (so a re-executed call can be
    deduplicated by the tool); a call after different tokens, in a fresh environment
    (``epoch``), or in a trajectory started afresh (``gen``: the lease generation the
    trajectory started under, ``Trajectory.gen``) gets another one. ``gen`` None (a
    trajectory recorded without one) leaves it out of the key."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps([name, args], sort_keys=True, default=str).encode())
    h.update(b"|")
    h.update(",".join(str(int(t)) for t in prefix).encode())
    g = "" if gen is None else f"g{int(gen)}."
    return f"{task_id}.{sample}.{g}e{epoch}.c{ordinal}.{h.hexdigest()}"


@dataclass
class Trajectory:
    """The events of one sample's trajectory; ``epoch`` counts fresh-environment restarts;
    ``gen`` is the lease generation the trajectory started under (set by the generate
    context: the generation of the partial it resumes, else the lease's own), so that a
    trajectory started afresh — its prefix discarded and regenerated, or begun again from
    the prompt with nothing saved — gets idempotency keys of its own, while every resume
    of the same record keeps the keys it had."""

    events: list[dict[str, Any]] = field(default_factory=list)
    epoch: int = 0
    gen: int | None = None
    #: the journal's open tool call (started, no result yet), or None
    inflight: dict[str, Any] | None = None
    #: {"at": event count, "state": the environment's snapshot}, or None
    env: dict[str, Any] | None = None

    # -- derived -----------------------------------------------------------------------
    @property
    def turns(self) -> int:
        """Generated turns so far (an open one counts)."""
        return sum(1 for e in self.events if e["op"] == "gen")

    def tool_calls(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["op"] == "tool"]

    def open_turn(self) -> dict[str, Any] | None:
        """The last event if it is a turn cut by an abort (it continues from its prefix)."""
        if self.events and self.events[-1]["op"] == "gen" and self.events[-1]["end"] is None:
            return self.events[-1]
        return None

    def check(self, response_len: int, loss_mask: Any = None) -> None:
        """Spans tile ``[0, response_len)`` in order; appended spans have loss mask 0."""
        pos = 0
        for k, e in enumerate(self.events):
            op = e.get("op")
            if op not in OPS:
                raise TrajectoryError(f"trajectory event {k}: unknown op {op!r}; expected {OPS}")
            if op == "tool":
                continue
            end = e["end"] if e["end"] is not None else response_len
            if e["start"] != pos or end < pos:
                raise TrajectoryError(f"trajectory event {k} spans [{e['start']}, {end}); "
                                      f"expected it to start at {pos}")
            if e["end"] is None and k != len(self.events) - 1:
                raise TrajectoryError(f"trajectory event {k} is an open turn but not the last")
            if op == "append" and loss_mask is not None and any(
                    int(m) for m in loss_mask[e["start"]:end]):
                raise TrajectoryError(f"trajectory event {k}: appended tokens must have "
                                      "loss mask 0")
            pos = end
        if pos != response_len:
            raise TrajectoryError(f"trajectory spans cover {pos} tokens, the response has "
                                  f"{response_len}")

    # -- persistence -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": TRAJECTORY_SCHEMA, "epoch": self.epoch,
                               "events": [dict(e) for e in self.events]}
        if self.gen is not None:
            out["gen"] = self.gen
        if self.inflight is not None:
            out["inflight"] = dict(self.inflight)
        if self.env is not None:
            out["env"] = dict(self.env)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, response_len: int = 0) -> Trajectory:
        """Rebuild a saved trajectory. ``None`` (a record written before trajectories, or a
        fresh sample) with a saved prefix is one open turn: it continues mid-turn."""
        if data is None:
            events = [{"op": "gen", "start": 0, "end": None, "finish": None}] if (
                response_len) else []
            return cls(events=events)
        if data.get("schema") != TRAJECTORY_SCHEMA:
            raise TrajectoryError(f"trajectory schema {data.get('schema')!r} is not supported; "
                                  f"expected {TRAJECTORY_SCHEMA}")
        gen = data.get("gen")
        inflight, env = data.get("inflight"), data.get("env")
        return cls(events=[dict(e) for e in data.get("events") or []],
                   epoch=int(data.get("epoch", 0)), gen=None if gen is None else int(gen),
                   inflight=dict(inflight) if isinstance(inflight, Mapping) else None,
                   env=dict(env) if isinstance(env, Mapping) else None)
