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
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strawq.collector.packing import offsets_name
from strawq.collector.reader import Batch, BatchReader
from strawq.config import QueueConfig
from strawq.dataset import Dataset
from strawq import records
from strawq.errors import CorruptRecord, LeaseLost, NotFound
from strawq.extras import (ROUTED_EXPERTS, SPECS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS, Extra,
                           cat_samples, first_placeholder)
from strawq.feeder import Feeder
from strawq.groups import SAMPLE_STATUSES, GroupData
from strawq.names import data_key
from strawq.queue import Lease, RunQueue
from strawq.records import Kind
from strawq.states import TaskState, names_in
from strawq.storage import open_storage

log = logging.getLogger(__name__)

_INSTALL = ("slime is not installed: install the project's pinned slime source with "
            "`pip install --no-deps <slime source tarball>` and `pip install httpx pillow "
            "transformers` (see docs/slime.md)")
#: producer id prefix of the data source's leases; the suffix is the rollout id
PRODUCER_PREFIX = "slime.r"
_PRODUCER_RE = re.compile(r"slime\.r(\d+)")
#: reason recorded for groups that slime trained (data-source mode)
TRAINED = "trained"
#: metadata key that carries strawq's bookkeeping on every Sample handed out
META = "strawq"
#: per-token extra columns and the Sample field each maps onto
EXTRA_FIELDS = {"teacher_logprobs": "teacher_log_probs",
                "routed_experts": "rollout_routed_experts",
                "top_p_token_ids": "rollout_top_p_token_ids",
                "top_p_token_offsets": "rollout_top_p_token_offsets"}


def _slime(module: str) -> Any:
    """Import a slime module, or say how to install slime."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{_INSTALL} ({exc})") from exc


def _sample_cls() -> Any:
    return _slime("slime.utils.types").Sample


def run_dir(args: Any) -> str:
    """``args.strawq_run`` or ``$STRAWQ_RUN``."""
    path = getattr(args, "strawq_run", None) or os.environ.get("STRAWQ_RUN")
    if not path:
        raise ValueError("no strawq run directory: set strawq_run in slime's "
                         "--custom-config-path YAML, or the STRAWQ_RUN environment variable")
    return str(path)


# -- Sample mapping ---------------------------------------------------------------------------
def run_versions(versions: Sequence[int]) -> list[str]:
    """Per-token versions → slime's ``weight_versions`` (one string per run of equal ones)."""
    out: list[str] = []
    prev = None
    for v in versions:
        if v != prev:
            out.append(str(int(v)))
            prev = v
    return out


def apply_extras(sample: Any, extras: Mapping[str, Any]) -> None:
    """Map per-token extra columns of one sample's response onto its Sample fields.

    ``teacher_logprobs`` [R] → ``teacher_log_probs``; ``routed_experts`` [rows, layers,
    top-k] → ``rollout_routed_experts``; ``top_p_token_ids`` (flat) and
    ``top_p_token_offsets`` [R + 1] → ``rollout_top_p_token_ids`` / ``_offsets``. Unknown
    names go to ``sample.metadata["strawq"]["extras"]``. Lengths are checked by slime's own
    validation.
    """
    import torch

    for name, value in extras.items():
        field_name = EXTRA_FIELDS.get(name)
        if field_name is None:
            sample.metadata.setdefault(META, {}).setdefault("extras", {})[name] = value
        elif name == "teacher_logprobs":
            sample.teacher_log_probs = [float(x) for x in np.asarray(value).reshape(-1)]
        else:
            setattr(sample, field_name, torch.as_tensor(np.asarray(value), dtype=torch.int32))
    sample._validate_response_metadata_lengths()


def batch_extras(batch: Batch, a: int, b: int, prompt_len: int) -> dict[str, Any]:
    """Packed sample ``[a, b)``'s extras in ``apply_extras``'s form: ``routed_experts``
    [len(tokens) − 1, ...] (slime's rows: the last token's routing is not computed),
    ``teacher_logprobs`` [R], ``top_p_token_ids`` (flat) and ``top_p_token_offsets``
    [R + 1] over the response."""
    out: dict[str, Any] = {}
    r0 = a + prompt_len
    for name, t in batch.extras.items():
        spec = SPECS.get(name)
        if spec is None:
            continue
        if spec.ragged:
            off = batch.extras[offsets_name(name)][r0:b + 1].numpy()
            out[name] = t[int(off[0]):int(off[-1])].numpy()
            out[offsets_name(name)] = off - off[0]
        elif spec.prompt:
            out[name] = t[a:b - 1].numpy()
        else:
            out[name] = t[r0:b].numpy()
    return out


def batch_to_samples(batch: Batch, *, extras: Sequence[Mapping[str, Any]] | None = None
                     ) -> list[list[Any]]:
    """A reader ``Batch`` as slime ``Sample`` groups (one list per group, batch order).

    Per sample: ``tokens`` (prompt + response), ``response_length``, ``loss_mask``,
    ``rollout_log_probs`` (response only), ``weight_versions`` (one string per run of equal
    token versions), ``reward`` (the raw reward: slime normalises per group itself),
    ``status``, ``group_index`` (dataset index), ``index`` (dataset index · G + position)
    and ``metadata["strawq"]`` (task id, batch seq, per-token ``versions``, ``advantage``,
    ``min_version``). ``extras[i]`` (per sample; default: the batch's own ``Batch.extras``,
    ``batch_extras``) maps through ``apply_extras``.
    """
    sample_cls = _sample_cls()
    status_cls = sample_cls.Status
    cu = batch.cu_seqlens.tolist()
    tokens = batch.tokens.numpy()
    mask = batch.loss_mask.numpy()
    lps = batch.rollout_logprobs.numpy()
    vers = batch.versions.numpy()
    plens = batch.prompt_lens.tolist()
    rewards = batch.rewards.tolist()
    adv = batch.sample_advantages.tolist()
    minv = batch.sample_min_version.tolist()
    out: list[list[Any]] = []
    i = 0
    for gpos, summ in enumerate(batch.summaries):
        group = []
        for j, status in enumerate(summ["status"]):
            a, b = cu[i], cu[i + 1]
            r0 = a + plens[i]
            v = vers[r0:b].tolist()
            s = sample_cls(
                group_index=int(summ["index"]), index=int(summ["index"]) * len(
                    summ["status"]) + j,
                tokens=tokens[a:b].tolist(), response_length=b - r0,
                loss_mask=mask[r0:b].tolist(), rollout_log_probs=lps[r0:b].tolist(),
                weight_versions=run_versions(v),
                reward=None if summ["rewards"][j] is None else float(rewards[i]),
                status=status_cls(status if status in SAMPLE_STATUSES else "completed"),
                metadata={META: {"task_id": summ["task_id"], "seq": batch.seq,
                                 "group": gpos, "versions": v, "advantage": adv[i],
                                 "min_version": minv[i]}})
            if extras is not None:
                apply_extras(s, extras[i])
            elif batch.extras:
                apply_extras(s, batch_extras(batch, a, b, plens[i]))
            group.append(s)
            i += 1
        out.append(group)
    return out


def group_to_samples(task: Mapping[str, Any], prev: GroupData | None, group_size: int, *,
                     gen: int, label_key: str | None = None,
                     metadata_key: str | None = None, prompt_key: str = "prompt"
                     ) -> list[Any]:
    """The G Samples for a leased task: fresh prompts, or the saved prefixes of a partial.

    A token-id prompt goes to ``tokens`` (slime sends them as ``input_ids``), a string to
    ``prompt`` (slime tokenises it). A partial sample continues where it stopped: ``tokens``
    = prompt + prefix, status ``aborted`` (slime asks only for the remaining budget), loss
    mask, log-probs and rewards as saved; its per-token versions ride along in
    ``metadata["strawq"]["versions"]`` and come back through ``add_samples``.
    """
    sample_cls = _sample_cls()
    status_cls = sample_cls.Status
    row = task["row"]
    index = int(task["index"])
    prompt = row[prompt_key]
    label = row.get(label_key) if label_key else row.get("label", row.get("answer"))
    meta_row = row.get(metadata_key) if metadata_key else row.get("metadata")
    meta_row = dict(meta_row) if isinstance(meta_row, Mapping) else {}
    pmeta = dict(prev.meta) if prev is not None else {}
    texts = pmeta.get("responses") or [""] * group_size
    samples = []
    for j in range(group_size):
        s = sample_cls(group_index=index, index=index * group_size + j,
                       label=None if label is None else str(label),
                       metadata={**meta_row, META: {"task_id": task["id"], "gen": gen,
                                                    "versions": []}})
        if isinstance(prompt, str):
            s.prompt = prompt
        else:
            s.tokens = [int(t) for t in prompt]
        if prev is not None and j < prev.num_samples:
            cols = prev.sample(j)
            n = int(cols["tokens"].shape[0])
            status = prev.status[j]
            if n or status != "pending":
                s.tokens = prev.prompt_ids.tolist() + cols["tokens"].tolist()
                s.response_length = n
                s.loss_mask = cols["loss_mask"].tolist()
                s.rollout_log_probs = cols["logprobs"].tolist()
                s.response = str(texts[j]) if j < len(texts) else ""
                s.status = status_cls(status if status != "pending" else "aborted")
                s.reward = prev.rewards[j]
                s.metadata[META]["versions"] = cols["versions"].tolist()
                s.weight_versions = run_versions(cols["versions"].tolist())
                for k, v in (pmeta.get("sample_meta") or [{}] * group_size)[j].items():
                    s.metadata.setdefault(k, v)
                _restore_extras(s, prev.sample_extras(j))
        samples.append(s)
    return samples


def _restore_extras(s: Any, extras: Mapping[str, Extra]) -> None:
    """A saved prefix's extras back onto slime's fields (``rollout_routed_experts``: only
    when every row but the last is known, ``rollout_top_p_token_*``,
    ``teacher_log_probs``)."""
    import torch

    if not s.response_length:
        return  # nothing generated: slime's first request records them
    for name, x in extras.items():
        if name == ROUTED_EXPERTS:
            if first_placeholder(name, x) == x.rows - 1:  # every row slime keeps is known
                s.rollout_routed_experts = torch.as_tensor(np.array(x.values[:-1]))
        elif name == TOP_P_TOKEN_IDS:
            s.rollout_top_p_token_ids = torch.as_tensor(np.array(x.values), dtype=torch.int32)
            s.rollout_top_p_token_offsets = torch.as_tensor(x.offsets(), dtype=torch.int32)
        elif name == TEACHER_LOGPROBS:
            s.teacher_log_probs = [float(v) for v in x.values]


def _sample_extras(s: Any, prompt_len: int, n: int) -> dict[str, Extra]:
    """slime's per-token fields of one Sample as strawq extras (rows checked; a field that
    does not line up with the tokens is left out, with an error logged)."""
    out: dict[str, Extra] = {}
    total = prompt_len + n
    routed = getattr(s, "rollout_routed_experts", None)
    if routed is not None:
        arr = np.asarray(routed.cpu() if hasattr(routed, "cpu") else routed, dtype=np.int32)
        if arr.ndim >= 1 and arr.shape[0] == total - 1:
            fill = np.full((1, *arr.shape[1:]), SPECS[ROUTED_EXPERTS].fill, np.int32)
            out[ROUTED_EXPERTS] = Extra(np.concatenate([arr, fill]))
        else:
            log.error("sample %s: rollout_routed_experts has %s rows, expected %d; not saved",
                      s.index, arr.shape[:1], total - 1)
    ids, off = (getattr(s, "rollout_top_p_token_ids", None),
                getattr(s, "rollout_top_p_token_offsets", None))
    if ids is not None and off is not None:
        o = np.asarray(off, dtype=np.int64).reshape(-1)
        v = np.asarray(ids, dtype=np.int32).reshape(-1)
        if o.size == n + 1 and o[0] == 0 and o[-1] == v.size and (np.diff(o) >= 0).all():
            out[TOP_P_TOKEN_IDS] = Extra(v, np.diff(o).astype(np.int32))
        else:
            log.error("sample %s: rollout_top_p_token_offsets do not cover its %d response "
                      "tokens; not saved", s.index, n)
    teacher = getattr(s, "teacher_log_probs", None)
    if teacher is not None:
        t = np.asarray(teacher, dtype=np.float32).reshape(-1)
        if t.size == n:
            out[TEACHER_LOGPROBS] = Extra(t)
        else:
            log.error("sample %s: teacher_log_probs has %d values for %d response tokens; "
                      "not saved", s.index, t.size, n)
    return out


def samples_to_group(task_id: str, index: int, samples: Sequence[Any], *,
                     version: int) -> GroupData | None:
    """slime's Samples of one group as a strawq group record (None: nothing generated).

    Response tokens beyond the prefix saved before (``metadata["strawq"]["versions"]``) were
    generated in this hand-out: they get the version of the last ``weight_versions`` entry
    when it is a number, else ``version``. Invariant 4 is checked by ``GroupData``.
    """
    prompt: list[int] | None = None
    lens, toks, lps, vers, masks, status, rewards, texts, smeta = ([] for _ in range(9))
    extras: list[dict[str, Extra]] = []
    for s in samples:
        n = int(s.response_length)
        tokens = list(s.tokens)
        if tokens and prompt is None:
            prompt = tokens[:len(tokens) - n]
        extras.append(_sample_extras(s, len(tokens) - n, n) if tokens else {})
        old = list(s.metadata.get(META, {}).get("versions", []))[:n]
        wv = s.weight_versions[-1] if s.weight_versions else None
        new_v = int(wv) if isinstance(wv, str) and wv.lstrip("-").isdigit() else version
        lens.append(n)
        toks += tokens[len(tokens) - n:] if n else []
        lps += list(s.rollout_log_probs) if s.rollout_log_probs is not None else [0.0] * n
        vers += old + [new_v] * (n - len(old))
        masks += list(s.loss_mask) if s.loss_mask is not None else [1] * n
        st = s.status.value
        status.append(st if st in SAMPLE_STATUSES else "aborted")
        reward = s.reward
        rewards.append(float(reward) if isinstance(reward, (int, float)) else None)
        texts.append(s.response or "")
        smeta.append({k: v for k, v in s.metadata.items()
                      if k != META and isinstance(v, (str, int, float, bool))})
    if prompt is None or (not any(lens) and all(x in ("aborted", "pending") for x in status)):
        return None
    return GroupData(task_id=task_id, index=index, prompt_ids=np.asarray(prompt, np.int32),
                     sample_lens=lens, tokens=np.asarray(toks, np.int32),
                     logprobs=np.asarray(lps, np.float32), versions=np.asarray(vers, np.int64),
                     loss_mask=np.asarray(masks, np.uint8), rewards=rewards, status=status,
                     meta={"responses": texts, "sample_meta": smeta, "source": "slime"},
                     extras=cat_samples(extras, len(prompt), lens))


# -- mode 1: slime generates, strawq keeps the data -------------------------------------------
@dataclass
class _Held:
    lease: Lease
    rollout: int


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
                release_batch=max(int(getattr(args, "rollout_batch_size", 64) or 64), 1)))
        if self.queue.config.group_size != self.group_size:
            raise ValueError(f"the run at {path} has group_size {self.queue.config.group_size}"
                             f", slime's --n-samples-per-prompt is {self.group_size}")
        self.dataset = Dataset(args.prompt_data, prompt_key=self.prompt_key)
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
            out.append(group_to_samples(
                lease.task, prev, self.group_size, gen=lease.gen,
                label_key=getattr(self.args, "label_key", None),
                metadata_key=getattr(self.args, "metadata_key", None),
                prompt_key=self.prompt_key))
            self._held[lease.task_id] = _Held(lease, tag)
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
        """Mark groups as returned for training (``slime_rollout`` calls this); groups
        handed out but neither trained nor added back are returned to the queue at once."""
        keep = {self._task_id(g) for g in samples}
        for tid in [t for t in self._held if t not in keep]:
            held = self._held.pop(tid)
            log.info("group %s was neither trained nor added back (filtered or aborted without "
                     "--partial-rollout); returned to the queue", tid)
            try:
                self.queue.release(held.lease)
            except LeaseLost as exc:
                log.error("group %s could not be returned: %s", tid, exc)

    def save(self, rollout_id: int) -> None:
        """Groups handed out to rollouts ≤ ``rollout_id`` are trained: recorded durably."""
        rollout_id = int(rollout_id)
        for tid in [t for t, h in self._held.items() if h.rollout <= rollout_id]:
            self._consume(self._held.pop(tid).lease, rollout_id)
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
            key = f"leased/{name}"
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

    def _consume(self, lease: Lease, rollout_id: int) -> None:
        try:
            self.queue.drop(lease, TRAINED, f"trained by slime; checkpoint of rollout "
                                            f"{rollout_id}",
                            summary={"rollout": rollout_id, "index": lease.task["index"]})
        except LeaseLost as exc:
            log.error("group %s: %s", lease.task_id, exc)
            return
        if lease.has_partial:  # the prefix it resumed from is trained: nothing reads it again
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
    hand-outs (exact save/load under ``train_async``), and returns to the queue at once the
    groups slime neither trained nor added back (dynamic-sampling filters).
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


__all__ = ["StrawqBatchSource", "StrawqDataSource", "apply_extras",
           "batch_to_samples", "begin_weight_update_hook", "generate_rollout",
           "group_to_samples", "run_versions", "samples_to_group", "slime_rollout"]
