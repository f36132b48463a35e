"""slime's ``Sample`` and strawq's records, both ways (``docs/slime.md``).

A reader ``Batch`` becomes slime ``Sample`` groups (``batch_to_samples``: strawq's producers
generate, slime trains); a leased task becomes the G Samples slime generates for
(``group_to_samples``), and slime's Samples of one group become a strawq group record
(``samples_to_group``: slime generates, strawq keeps the data). Per-token extras (R3 routed
experts, top-p kept ids, teacher log-probs) map onto slime's own fields both ways.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strawq.collector.trainer.packing import offsets_name
from strawq.collector.trainer.reader import Batch
from strawq.ondisk.extras import (
    ROUTED_EXPERTS,
    SPECS,
    TEACHER_LOGPROBS,
    TOP_P_TOKEN_IDS,
    Extra,
    cat_samples,
    first_placeholder,
)
from strawq.ondisk.groups import SAMPLE_STATUSES, GroupData

log = logging.getLogger(__name__)

_INSTALL = ("slime is not installed: install the pinned slime source with "
            "`make slime SLIME_SRC=pinned` (docs/slime.md, Install)")
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
    ``status``, ``group_index`` (dataset index), ``index`` (dataset index · G + position,
    G the batch's largest group)
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
    # G for ``index``: the batch's largest group (the queue's group size unless every group
    # is short), so that a short group (a group of one) takes no other sample's index
    width = max((len(summ["status"]) for summ in batch.summaries), default=1)
    for gpos, summ in enumerate(batch.summaries):
        group = []
        for j, status in enumerate(summ["status"]):
            a, b = cu[i], cu[i + 1]
            r0 = a + plens[i]
            v = vers[r0:b].tolist()
            s = sample_cls(
                group_index=int(summ["index"]), index=int(summ["index"]) * width + j,
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
