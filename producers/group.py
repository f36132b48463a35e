"""One leased group while a producer works on it: build, resume, and persist.

A ``GroupRun`` is the bridge between the engines' ``Sample`` records and the queue's
``GroupData``: it builds G fresh samples for a task, or rebuilds them from a saved partial
(completed samples are kept as they are, unfinished ones resume from their prefixes with
the remaining budget), and packs them back into a ``GroupData`` — a ready group or a
partial one. Pure logic: no I/O, no asyncio, testable on its own.

What a group record's ``meta`` holds (besides ``version_hint``)::

    producer        id of the producer that wrote it
    params          per sample: SamplerParams.to_dict() (budget and seed survive a resume)
    sample_status   per sample: generation status (pending/aborted/completed/truncated)
    finish_reasons  per sample: the engine's last finish_reason (or None)
    num_segments    per sample: engine responses that contributed tokens
    reward_errors   {sample index: message} for rewards that raised
    texts           partial records only: response text so far (text-based rewards)
    trajectories    per sample: Trajectory.to_dict() (turns, appended spans, tool calls);
                    written only when some sample has more than one plain turn
                    (``strawq.producers.trajectory``); absent: one turn each
    failures        {sample index: message} for samples that failed (tool/environment):
                    status ``failed``, reward None, loss mask 0

Per-token extras (``strawq.ondisk.extras``) go to ``GroupData.extras``: each sample's rows, or
placeholder rows for a sample that holds none of an extra another sample holds; a partial's
extras are its prefixes' rows, and ``from_partial`` gives them back to the samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strawq.data.tokenize import FunctionTokenizer, PromptTokenizer, prompt_ids
from strawq.errors import ConfigError, DatasetError, StrawqError
from strawq.ondisk.extras import Extra, cat_samples
from strawq.ondisk.groups import GroupData
from strawq.producers.sample import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    Sample,
    SampleError,
    SamplerParams,
    SampleStatus,
    mask_offpolicy_prefix,
)
from strawq.producers.trajectory import Trajectory
from strawq.tasks.queue import Lease


class TaskError(StrawqError, ValueError):
    """The task itself cannot be run (bad prompt, bad row overrides): fail it for good."""


def sample_seed(base: int, index: int, i: int, gen: int = 0) -> int:
    """A stable 63-bit seed for sample ``i`` of dataset row ``index``.

    ``gen`` is the lease generation of a group generated from scratch: a group sent back
    (re-generated for staleness, released, expired) draws fresh samples instead of the same
    ones again (a re-queued long-tail group would be exactly as long and cycle). A resumed
    prefix keeps the seed recorded in its params. Generation 0 hashes ``base:index:i``,
    generation g ≥ 1 ``base:index:i:g<g>``.
    """
    key = f"{base}:{index}:{i}" if gen == 0 else f"{base}:{index}:{i}:g{gen}"
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


def prompt_ids_of(task: Mapping[str, Any], prompt_key: str,
                  tokenizer: PromptTokenizer | Callable[[str], list[int]] | None) -> list[int]:
    """The prompt's token ids: a list in the row, or text / chat messages through the
    tokenizer plugin (``strawq.data.tokenize``); a plain function tokenizes text only."""
    row = task.get("row", {})
    if tokenizer is not None and not isinstance(tokenizer, PromptTokenizer):
        tokenizer = FunctionTokenizer(tokenizer)
    try:
        return prompt_ids(row if isinstance(row, Mapping) else {}, prompt_key, tokenizer)
    except DatasetError as exc:
        raise TaskError(f"task {task.get('id')}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a plugin's failure becomes the task's
        raise TaskError(f"task {task.get('id')}: tokenizer failed: "
                        f"{type(exc).__name__}: {exc}") from exc


@dataclass(eq=False)
class GroupRun:
    """The in-memory state of one leased group."""

    lease: Lease
    samples: list[Sample]
    rewards: list[float | None]
    reward_errors: dict[int, str] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    #: samples rebuilt from a saved prefix (they resume; tokens > 0 or status aborted)
    resumed: list[bool] = field(default_factory=list)
    #: requests sent per sample by this producer (rid suffix: never reuses a rid)
    requests: list[int] = field(default_factory=list)
    #: per sample: its turns, appended spans and tool calls
    trajectories: list[Trajectory] = field(default_factory=list)
    #: samples that failed (tool or environment): never trained
    failures: dict[int, str] = field(default_factory=dict)
    #: per sample, its environment's snapshot hooks (``GenerateContext.environment``):
    #: every partial record (turn checkpoint or yield) holds their snapshots
    envs: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = len(self.samples)
        self.trajectories = self.trajectories or [
            Trajectory.from_dict(None, s.response_length) for s in self.samples]
        self.texts = self.texts or [""] * g
        self.resumed = self.resumed or [False] * g
        self.requests = self.requests or [0] * g

    # -- building --------------------------------------------------------------------------
    @classmethod
    def fresh(cls, lease: Lease, prompt_ids: list[int], params: list[SamplerParams]) -> GroupRun:
        samples = [Sample.new(f"{lease.task_id}.{i}", prompt_ids, p) for i, p in enumerate(params)]
        return cls(lease=lease, samples=samples, rewards=[None] * len(samples))

    @classmethod
    def from_partial(cls, lease: Lease, group: GroupData,
                     default_params: Callable[[int], SamplerParams]) -> GroupRun:
        """Rebuild the samples of a saved partial group.

        Completed/truncated samples stay final with their reward; aborted/pending ones
        resume from their prefix. Parameters come from the record (so the budget and seed
        are the original ones), else from ``default_params(i)`` with the budget raised to
        at least the saved length.
        """
        if group.task_id != lease.task_id:
            raise ConfigError(f"partial record is for task {group.task_id!r}, lease is for "
                              f"{lease.task_id!r}")
        meta = group.meta or {}
        saved_params = meta.get("params") or []
        gen_status = meta.get("sample_status") or list(group.status)
        finish = meta.get("finish_reasons") or [None] * group.num_samples
        nseg = meta.get("num_segments") or [0] * group.num_samples
        texts = meta.get("texts") or [""] * group.num_samples
        errors = {int(k): str(v) for k, v in (meta.get("reward_errors") or {}).items()}
        failures = {int(k): str(v) for k, v in (meta.get("failures") or {}).items()}
        saved_traj = meta.get("trajectories") or [None] * group.num_samples
        samples, rewards, resumed = [], [], []
        for i in range(group.num_samples):
            cols = group.sample(i)
            n = int(cols["tokens"].shape[0])
            if i < len(saved_params) and saved_params[i]:
                try:
                    params = SamplerParams.from_dict(saved_params[i])
                except ConfigError as exc:  # a damaged record: the task cannot run
                    raise SampleError(f"partial of {lease.task_id}: sample {i}: {exc}") from None
            else:
                params = default_params(i)
                if params.max_new_tokens < n:
                    params = SamplerParams.from_dict({**params.to_dict(), "max_new_tokens": n})
            status = str(gen_status[i]) if i < len(gen_status) else str(group.status[i])
            if status == "failed":  # a reward failure on a finished sample
                status = "completed"
            if status not in {s.value for s in SampleStatus}:
                status = "aborted"
            s = Sample(uid=f"{lease.task_id}.{i}", prompt_ids=group.prompt_ids, params=params,
                       response_ids=cols["tokens"], logprobs=cols["logprobs"],
                       versions=cols["versions"], loss_mask=cols["loss_mask"],
                       status=SampleStatus(status),
                       finish_reason=finish[i] if i < len(finish) else None,
                       num_segments=int(nseg[i]) if i < len(nseg) else 0,
                       extras=group.sample_extras(i))
            samples.append(s)
            rewards.append(group.rewards[i] if s.is_final else None)
            resumed.append(not s.is_final)
        return cls(lease=lease, samples=samples, rewards=rewards,
                   reward_errors={k: v for k, v in errors.items() if samples[k].is_final},
                   failures={k: v for k, v in failures.items() if samples[k].is_final},
                   trajectories=[Trajectory.from_dict(
                       saved_traj[i] if i < len(saved_traj) else None, s.response_length)
                       for i, s in enumerate(samples)],
                   texts=[str(t) for t in texts][:len(samples)] + [""] * max(
                       0, len(samples) - len(texts)),
                   resumed=resumed)

    # -- state -----------------------------------------------------------------------------
    @property
    def task_id(self) -> str:
        return self.lease.task_id

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def all_final(self) -> bool:
        return all(s.is_final for s in self.samples)

    def unfinished(self) -> list[int]:
        return [i for i, s in enumerate(self.samples) if not s.is_final]

    def oldest_version(self) -> int | None:
        """The oldest weight version of a token it holds (None: no token yet)."""
        vs = [int(s.versions.min()) for s in self.samples if len(s.versions)]
        return min(vs) if vs else None

    def rid_prefix(self, producer: str) -> str:
        """Prefix of every rid of this lease: aborting it touches nothing else."""
        return f"{producer}/{self.task_id}.g{self.lease.gen}/"

    def next_rid(self, producer: str, i: int) -> str:
        self.requests[i] += 1
        return f"{self.rid_prefix(producer)}{i}.{self.requests[i]}"

    def sample_meta(self, i: int) -> dict[str, Any]:
        """What a reward function sees besides the task and the response ids (``text`` is
        added by ``call_reward`` when the producer's tokenizer decodes the ids)."""
        s = self.samples[i]
        return {"status": s.status.value,
                "finish_reason": s.finish_reason, "sample_index": i,
                "num_segments": s.num_segments, "prompt_ids": s.prompt_ids.tolist(),
                "min_version": s.min_version(),
                "max_version": int(s.versions.max()) if len(s.versions) else None,
                "trajectory": self.trajectories[i].to_dict()}

    def want_extras(self, names: tuple[str, ...],
                    routed_experts_shape: tuple[int, ...] = ()) -> None:
        """Ask the engine for these per-token extras on every sample's next segments."""
        for s in self.samples:
            s.want_extras = tuple(names)
            s.routed_experts_shape = tuple(routed_experts_shape)

    def rewards_for_filter(self) -> list[float]:
        return [r for r in self.rewards if r is not None]

    def fail_sample(self, i: int, message: str) -> None:
        """End sample ``i`` as failed: kept in the record, never trained (reward None,
        loss mask 0)."""
        s = self.samples[i]
        s.status = SampleStatus.TRUNCATED
        s.finish_reason = {"type": "failed", "message": message[:500]}
        s.loss_mask = np.zeros_like(s.loss_mask)
        self.failures[i] = message[:500]
        self.rewards[i] = None

    def restart_sample(self, i: int) -> None:
        """Start sample ``i`` again from its prompt in a fresh environment (next epoch)."""
        s = self.samples[i]
        epoch = self.trajectories[i].epoch + 1
        self.samples[i] = Sample.new(s.uid, s.prompt_ids, s.params)
        self.samples[i].want_extras = s.want_extras
        self.samples[i].routed_experts_shape = s.routed_experts_shape
        self.trajectories[i] = Trajectory(epoch=epoch)
        self.texts[i] = ""
        self.envs.pop(i, None)

    def _trajectories_meta(self) -> list[dict[str, Any]] | None:
        """Per-sample trajectories, or None when each is one plain turn (old layout)."""
        def plain(s: Sample, t: Trajectory) -> bool:
            return t.epoch == 0 and t.env is None and t.inflight is None and (not t.events or (
                len(t.events) == 1 and t.events[0]["op"] == "gen"
                and (t.events[0]["end"] is None or s.is_final)))
        if all(plain(s, t) for s, t in zip(self.samples, self.trajectories, strict=True)):
            return None
        return [t.to_dict() for t in self.trajectories]

    def snapshot_envs(self) -> None:
        """Each unfinished sample's environment snapshot, with the event count it belongs
        to, into its trajectory (read back by ``GenerateContext`` on resume). While a
        sample's tool call runs, the snapshot taken before it stands (the call may be
        half-applied; on resume it is re-run or reconciled against that state)."""
        for i, env in self.envs.items():
            t = self.trajectories[i]
            if self.samples[i].is_final:
                t.env = None
            elif t.inflight is not None and t.env is not None and t.env.get("at") == len(
                    t.events):
                continue  # its tool call is running: the state before that call stands
            else:
                t.env = {"at": len(t.events), "state": env.snapshot()}

    # -- packing ---------------------------------------------------------------------------
    def to_group(self, *, producer: str, version_hint: int, partial: bool,
                 mask_offpolicy: bool = False, trajectories: bool = False) -> GroupData:
        """Pack the samples as a ready (``partial=False``) or partial group record
        (``trajectories``: write them even when each is one plain turn — a turn
        checkpoint keeps the generation its tool keys name)."""
        if partial:
            self.snapshot_envs()
        if mask_offpolicy and not partial:
            for s in self.samples:
                if len(s.versions):
                    mask_offpolicy_prefix(s, int(s.versions.max()))
        status = []
        for i, s in enumerate(self.samples):
            st = s.status.value
            if s.is_final and (i in self.reward_errors or i in self.failures):
                st = "failed"
            status.append(st)
        meta: dict[str, Any] = {
            "producer": producer,
            "version_hint": int(version_hint),
            "params": [s.params.to_dict() for s in self.samples],
            "sample_status": [s.status.value for s in self.samples],
            "finish_reasons": [None if s.finish_reason is None else dict(s.finish_reason)
                               for s in self.samples],
            "num_segments": [s.num_segments for s in self.samples],
            "reward_errors": {str(k): v for k, v in self.reward_errors.items()},
        }
        if "source" in self.lease.task:  # the mixture dataset the prompt came from
            meta["source"] = self.lease.task["source"]
        if partial:
            meta["texts"] = list(self.texts)
        trajs = ([t.to_dict() for t in self.trajectories] if trajectories
                 else self._trajectories_meta())
        if trajs is not None:
            if not partial:  # environment snapshots and journal entries serve resumes only
                for t in trajs:
                    t.pop("env", None)
                    t.pop("inflight", None)
            meta["trajectories"] = trajs
        if self.failures:
            meta["failures"] = {str(k): v for k, v in self.failures.items()}

        def cat(name: str, dtype: Any) -> np.ndarray:
            parts = [getattr(s, name) for s in self.samples]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(
                0, dtype)

        task = self.lease.task
        return GroupData(
            task_id=self.task_id, index=int(task.get("index", -1)),
            prompt_ids=self.samples[0].prompt_ids if self.samples else np.zeros(0, TOKEN_DTYPE),
            sample_lens=[s.response_length for s in self.samples],
            tokens=cat("response_ids", TOKEN_DTYPE), logprobs=cat("logprobs", LOGPROB_DTYPE),
            versions=cat("versions", VERSION_DTYPE), loss_mask=cat("loss_mask", MASK_DTYPE),
            rewards=[r if s.is_final else None
                     for r, s in zip(self.rewards, self.samples, strict=True)],
            status=status, meta=meta, extras=self._extras())

    def _extras(self) -> dict[str, Extra]:
        """Every extra some sample holds, samples' rows one after another."""
        p = len(self.samples[0].prompt_ids) if self.samples else 0
        return cat_samples([s.extras for s in self.samples], p,
                           [s.response_length for s in self.samples])
