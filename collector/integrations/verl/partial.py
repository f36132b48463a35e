"""verl's partial rollout, durable: saved prefixes of samples aborted at a parameter sync.

verl (``async_training.partial_rollout: True``) aborts in-flight requests at every parameter
sync and its ``FullyAsyncLLMServerClient`` resumes them from the tokens generated so far, in
memory: a crash of the rollout process loses every prefix. ``PartialStore`` keeps each
aborted prefix (prompt, response tokens, log-probs, the weight version of every token) as a
strawq PARTIAL record (``strawq.ondisk.groups.GroupData``, one sample, status ``aborted``: the
format of strawq's own partial tasks) in the queue directory; its directories and moves are
declared in the core's table (``strawq.tasks.states.VERL_PREFIXES``):

* ``held/<key>~<n>``: the prefix of a request a live rollout process is resuming; replaced at
  each abort (new record first, then the old one deleted);
* ``partials/<key>~<n>``: a prefix nobody holds, to be claimed (one atomic rename back into
  ``held/``: one winner) by the next request for the same prompt.

``recover()`` (run when the queue starts, i.e. when verl's job starts again and no rollout
process is alive) returns every ``held/`` prefix to ``partials/``. The key is a digest of the
prompt's token ids: the samples of one prompt are exchangeable, so any request for the
prompt may continue any saved prefix of it, and verl's per-request ids (fresh for every
agent-loop run) need not survive the crash. ``strawq.collector.integrations.verl.client``
is the client that uses it.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.groups import GroupData
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.states import VERL_PREFIXES, TaskState

log = logging.getLogger(__name__)

S = TaskState
#: the store's directories (``strawq.tasks.states.VERL_PREFIXES``): saved, and held by a request
PARTIALS = VERL_PREFIXES.dir_of(S.PARTIAL)
HELD = VERL_PREFIXES.dir_of(S.LEASED)


def prompt_key(prompt_ids: Sequence[int] | np.ndarray) -> str:
    """The store key of a prompt: a digest of its token ids."""
    ids = np.ascontiguousarray(np.asarray(prompt_ids, dtype=np.int64))
    return "p" + hashlib.blake2b(ids.tobytes(), digest_size=12).hexdigest()


@dataclass
class Prefix:
    """What an aborted request generated so far (per-token columns of equal length)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: the weight version (verl's ``global_steps``) each token was sampled with; -1 unknown
    versions: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def extend(self, tokens: Sequence[int], logprobs: Sequence[float] | None,
               version: int | None) -> None:
        tokens = [int(t) for t in tokens]
        lps = [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(tokens)
        if len(lps) != len(tokens):
            raise ValueError(f"an attempt returned {len(tokens)} tokens and {len(lps)} "
                             "log-probs; per-token columns must align")
        self.tokens += tokens
        self.logprobs += lps
        self.versions += [-1 if version is None else int(version)] * len(tokens)

    def to_group(self, key: str) -> GroupData:
        n = len(self.tokens)
        return GroupData(task_id=key, index=0, prompt_ids=np.asarray(self.prompt_ids),
                         sample_lens=[n], tokens=np.asarray(self.tokens),
                         logprobs=np.asarray(self.logprobs, dtype=np.float32),
                         versions=np.asarray(self.versions, dtype=np.int64),
                         loss_mask=np.ones(n, dtype=np.uint8), rewards=[None],
                         status=["aborted"], meta={"verl": dict(self.meta)})

    @classmethod
    def from_group(cls, g: GroupData) -> Prefix:
        return cls(prompt_ids=[int(t) for t in g.prompt_ids], tokens=[int(t) for t in g.tokens],
                   logprobs=[float(x) for x in g.logprobs],
                   versions=[int(v) for v in g.versions], meta=dict(g.meta.get("verl", {})))


class PartialStore:
    """Durable prefixes of aborted verl requests (see the module docstring)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        for directory in VERL_PREFIXES.directories():
            storage.makedirs(directory)

    def _publish(self, state: TaskState, key: str, prefix: Prefix) -> str:
        handle = f"{key}~{uuid.uuid4().hex[:12]}"
        self.storage.publish(VERL_PREFIXES.key(state, handle),
                             prefix.to_group(key).encode(Kind.PARTIAL))
        return handle

    def save(self, key: str, prefix: Prefix, *, replaces: str | None = None) -> str:
        """Keep ``prefix`` held by the caller (durable on return); delete the one it replaces."""
        VERL_PREFIXES.check(S.LEASED, S.LEASED)
        handle = self._publish(S.LEASED, key, prefix)
        if replaces:
            self.storage.delete(VERL_PREFIXES.key(S.LEASED, replaces))
        return handle

    def put(self, key: str, prefix: Prefix) -> str:
        """Keep ``prefix`` for the next request of its prompt to claim."""
        return self._publish(S.PARTIAL, key, prefix)

    def claim(self, key: str) -> tuple[str, Prefix] | None:
        """Take a saved prefix of ``key`` (held by the caller from now on), or None."""
        for name in self.storage.list(PARTIALS):
            if not name.startswith(key + "~"):
                continue
            try:
                held = VERL_PREFIXES.move(self.storage, name, S.PARTIAL, S.LEASED)
            except (NotFound, AlreadyExists):
                continue  # another request won it
            try:
                rec = records.decode(self.storage.read(held), expect=Kind.PARTIAL, name=name)
                return name, Prefix.from_group(GroupData.from_record(rec))
            except (CorruptRecord, NotFound) as exc:
                log.error("verl partial %s unreadable (%s): dropped", name, exc)
                VERL_PREFIXES.retire(self.storage, name, S.LEASED, S.DROPPED)
        return None

    def release(self, handle: str) -> None:
        """Give a held prefix back (its request failed; the next one may continue it)."""
        try:
            VERL_PREFIXES.move(self.storage, handle, S.LEASED, S.PARTIAL)
        except (NotFound, AlreadyExists):
            pass

    def finish(self, handle: str | None) -> None:
        """The request finished: its prefix is part of a sample now."""
        if handle:
            VERL_PREFIXES.retire(self.storage, handle, S.LEASED, S.READY)

    def recover(self) -> int:
        """Return every held prefix to ``partials/`` (no rollout process is alive)."""
        n = 0
        for name in self.storage.list(HELD):
            self.release(name)
            n += 1
        return n

    def count(self) -> dict[str, int]:
        return {"partials": len(self.storage.list(PARTIALS)),
                "held": len(self.storage.list(HELD))}
