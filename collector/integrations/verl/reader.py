"""A verl trainer reading strawq batches: strawq's producers generate, verl trains.

``batch_to_dataproto(batch)`` turns a reader ``Batch`` (one collector batch, read whole on
the trainer's driver with ``BatchReader(world_size=1)``: verl is single-controller and
dispatches the rows to its data-parallel workers itself) into the ``DataProto`` verl's
agent loop hands its trainer: left-padded ``prompts``, right-padded ``responses``,
``input_ids`` / ``attention_mask`` / ``position_ids``, ``response_mask`` (the loss mask:
0 over tool output and padding), ``rollout_log_probs`` (the engine's per-token log-probs;
``old_log_probs`` too, the way verl's bypass mode sets them), ``rm_scores`` /
``token_level_scores`` / ``token_level_rewards`` (the sample's reward on its last response
token), ``advantages`` / ``returns`` (the manifest's GRPO advantage on every response token;
or left to verl's ``compute_advantage`` over the group index ``uid``), per-token
``versions``, the sampling parameters, and strawq's bookkeeping in ``non_tensor_batch`` and
``meta_info`` (``DATAPROTO_FIELDS`` lists every key and its source).

``verl_actor_config(objective, ...)`` is the verl actor configuration that trains strawq's
documented objective (``strawq.testing.reference.Objective``) with verl's own loss code:
``policy_loss.loss_mode=bypass_mode`` with ``rollout_correction.loss_type=reinforce``
(−w·A·log π, w from the rollout log-probs), ``rollout_is=token`` at threshold 2 (TIS) or
``"0.5_5.0"`` (IcePop), ``rollout_rs=token_k1`` for the IcePop mask alone, and the
``loss_agg_mode`` of the aggregation, with verl's global denominators (the data-parallel
group's token count, the mini-batch's sample count). What one verl actor rank does with
its shard of that ``DataProto`` (``actor_step``) and this path of the reference-equivalence
check (``verl_path_gradients`` / ``verl_distributed_gradients``; docs/design.md,
invariant 11) are test harness: ``strawq.testing.verl_train``.

``StrawqParameterSync`` wraps verl's ``CheckpointEngineManager``: its ``update_weights``
opens strawq's weight-update bracket (producers pause), runs verl's parameter sync, and
closes the bracket with the new version (producers resume on it). ``hook_parameter_sync``
installs it on a trainer (``RayPPOTrainer`` and the fully-async trainer both sync through
``self.checkpoint_manager.update_weights``).

verl is imported lazily; a missing verl is an ``ImportError`` saying what to install.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from strawq.collector.trainer.bracket import BracketReport, WeightUpdateBracket
from strawq.collector.trainer.reader import Batch, BatchReader

log = logging.getLogger(__name__)

VERL_MISSING = ("verl is not installed: pip install 'verl==0.9.1' (with tensordict>=0.10, "
                "hydra-core, codetiming, datasets, torchdata, cachetools, peft)")

#: DataProto key -> where it comes from in strawq (docs/verl.md prints this table)
DATAPROTO_FIELDS: dict[str, str] = {
    "batch.prompts": "the group's prompt_ids, left-padded with pad_token_id [S, P]",
    "batch.responses": "the sample's response tokens, right-padded [S, R]",
    "batch.input_ids": "prompts ‖ responses [S, P + R]",
    "batch.attention_mask": "1 over the prompt and response tokens, 0 over padding",
    "batch.position_ids": "verl's compute_position_id_with_mask(attention_mask)",
    "batch.response_mask": "the record's loss_mask over the response (0: tool output, padding)",
    "batch.rollout_log_probs": "the engine's per-token log-probs (record column logprobs)",
    "batch.old_log_probs": "the same log-probs (verl's bypass mode; old_log_probs=False "
                           "leaves them to verl's recompute)",
    "batch.advantages": "the manifest's per-sample advantage × response_mask "
                        "(advantages=False leaves them to verl's compute_advantage)",
    "batch.returns": "= advantages (verl's GRPO returns)",
    "batch.rm_scores": "the sample's reward on its last response token",
    "batch.token_level_scores": "= rm_scores",
    "batch.token_level_rewards": "= rm_scores (no KL in the reward)",
    "batch.versions": "the weight version of each response token (-1 over padding)",
    "batch.temperature": "per-sample recorded temperature [S] (only when the batch mixes "
                         "temperatures, or temperature='tensor')",
    "non_tensor_batch.uid": "the group's task id: verl's GRPO group index",
    "non_tensor_batch.index": "the prompt's dataset index",
    "non_tensor_batch.top_p / top_k": "per-sample recorded top-p / top-k (-1: all)",
    "non_tensor_batch.min_global_steps / max_global_steps":
        "the sample's oldest / newest token version (verl's fully-async staleness fields)",
    "non_tensor_batch.strawq_group": "the group's manifest name (id:gen)",
    "non_tensor_batch.over_eta": "the read-time staleness re-check (True: staler than eta)",
    "meta_info.temperature": "the batch's one recorded temperature (when uniform)",
    "meta_info.global_token_num": "attention_mask sums (verl's MFU / balance bookkeeping)",
    "meta_info.strawq": "seq, version, rank, world_size, total_samples, total_loss_tokens, "
                        "groups, skipped, stats (staleness/*)",
    "extras": "per-token extras as response-aligned [S, R, ...] tensors named "
              "strawq_<extra> (routed_experts: verl's [S, P + R, layers, top_k] layout)",
}


def _verl(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{VERL_MISSING} (importing {module}: {exc})") from exc


# -- the batch as verl's DataProto -------------------------------------------------------------
def _layout(batch: Batch, prompt_length: int | None, response_length: int | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Per token: its row, its column in the [S, P + R] layout, whether it is a response
    token; P and R."""
    cu = batch.cu_seqlens.to(torch.int64).numpy()
    plen = batch.prompt_lens.to(torch.int64).numpy()
    rlen = batch.response_lens.to(torch.int64).numpy()
    n = int(plen.shape[0])
    width_p = int(plen.max()) if n else 1
    width_r = max(int(rlen.max()) if n else 0, 1)
    if prompt_length is not None:
        if prompt_length < width_p:
            raise ValueError(f"prompt_length={prompt_length} but batch {batch.seq} has a "
                             f"{width_p}-token prompt: expected prompt_length >= {width_p}")
        width_p = prompt_length
    if response_length is not None:
        if response_length < width_r:
            raise ValueError(f"response_length={response_length} but batch {batch.seq} has a "
                             f"{width_r}-token response: expected response_length >= "
                             f"{width_r}")
        width_r = response_length
    row = np.repeat(np.arange(n, dtype=np.int64), cu[1:] - cu[:-1])
    off = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][row]
    is_resp = off >= plen[row]
    col = np.where(is_resp, width_p + off - plen[row], width_p - plen[row] + off)
    return row, col, is_resp, width_p, width_r


def batch_to_dataproto(batch: Batch, *, advantages: bool = True, old_log_probs: bool = True,
                       temperature: str = "auto", pad_token_id: int = 0,
                       prompt_length: int | None = None,
                       response_length: int | None = None) -> Any:
    """The reader ``Batch`` as the ``DataProto`` a verl trainer trains on (``DATAPROTO_FIELDS``).

    ``advantages=False`` leaves ``advantages`` / ``returns`` out, for verl's own estimator
    (``compute_advantage`` over ``uid``; for GRPO with every reward present it reproduces the
    manifest's). ``old_log_probs=False`` leaves ``old_log_probs`` out, for verl's
    decoupled mode (it recomputes them, and refuses a batch that already has them).
    ``temperature``: ``"meta"`` puts the batch's one recorded temperature in
    ``meta_info["temperature"]`` (ValueError if the samples differ), ``"tensor"`` puts each
    sample's in ``batch["temperature"]`` (verl's engines read a per-sample tensor; the
    trainer must then not set ``meta_info["temperature"]``), ``"auto"`` the first when they
    are all equal, else the second. ``prompt_length`` / ``response_length`` fix the padded
    widths (default: the batch's longest).
    """
    protocol = _verl("verl.protocol")
    compute_position_id_with_mask = _verl("verl.utils.model").compute_position_id_with_mask
    if temperature not in ("auto", "meta", "tensor"):
        raise ValueError(f"temperature must be 'auto', 'meta' or 'tensor', got {temperature!r}")
    n = batch.num_samples
    row, col, is_resp, width_p, width_r = _layout(batch, prompt_length, response_length)
    width = width_p + width_r
    rcol = col[is_resp] - width_p
    rrow = row[is_resp]

    def full(fill: float | int, dtype: torch.dtype, cols: int = width) -> torch.Tensor:
        return torch.full((n, cols), fill, dtype=dtype)

    input_ids = full(pad_token_id, torch.int64)
    input_ids[row, col] = batch.tokens.to(torch.int64)
    attention_mask = full(0, torch.int64)
    attention_mask[row, col] = 1
    resp_sel = torch.from_numpy(is_resp)
    response_mask = full(0, torch.int64, width_r)
    response_mask[rrow, rcol] = batch.loss_mask[resp_sel].to(torch.int64)
    logprobs = full(0.0, torch.float32, width_r)
    logprobs[rrow, rcol] = batch.rollout_logprobs[resp_sel].to(torch.float32)
    versions = full(-1, torch.int64, width_r)
    versions[rrow, rcol] = batch.versions[resp_sel].to(torch.int64)
    rlen = batch.response_lens.to(torch.int64)
    scores = full(0.0, torch.float32, width_r)
    scores[torch.arange(n), (rlen - 1).clamp(min=0)] = batch.rewards.to(torch.float32)
    tensors: dict[str, torch.Tensor] = {
        "prompts": input_ids[:, :width_p].clone(), "responses": input_ids[:, width_p:].clone(),
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask, "rollout_log_probs": logprobs, "versions": versions,
        "rm_scores": scores, "token_level_scores": scores.clone(),
        "token_level_rewards": scores.clone()}
    if old_log_probs:
        tensors["old_log_probs"] = logprobs.clone()
    if advantages:
        adv = batch.sample_advantages.to(torch.float32).unsqueeze(1) * response_mask
        tensors["advantages"] = adv
        tensors["returns"] = adv.clone()
    temps = (batch.temperature.to(torch.float32) if batch.temperature is not None
             else torch.ones(n, dtype=torch.float32))
    uniform = n == 0 or bool((temps == temps[0]).all())
    meta_temp = temperature == "meta" or (temperature == "auto" and uniform)
    if temperature == "meta" and not uniform:
        raise ValueError(f"batch {batch.seq} was sampled at temperatures "
                         f"{sorted(set(temps.tolist()))}: one meta_info['temperature'] cannot "
                         "score it; use temperature='tensor' (a per-sample column)")
    if not meta_temp:
        tensors["temperature"] = temps
    for name, t in batch.extras.items():
        tensors.update(_extra(name, t, batch, row, col, is_resp, width_p, width_r))
    smin = np.full(n, -1, dtype=np.int64)
    smax = np.full(n, -1, dtype=np.int64)
    if rrow.size:
        v = batch.versions[resp_sel].to(torch.int64).numpy()
        np.maximum.at(smax, rrow, v)
        smin_f = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(smin_f, rrow, v)
        smin = np.where(smax >= 0, smin_f, smin)
    empty = smax < 0  # no response token: its group's version
    smin[empty] = batch.sample_min_version.to(torch.int64).numpy()[empty]
    smax[empty] = smin[empty]
    gidx = batch.sample_group.to(torch.int64).numpy()
    names = np.array([f"{g.id}:{g.gen}" for g in batch.groups], dtype=object)
    non_tensor: dict[str, np.ndarray] = {
        "uid": np.array([batch.groups[i].id for i in gidx], dtype=object),
        "index": batch.sample_index.to(torch.int64).numpy().copy(),
        "top_p": (batch.top_p.numpy().astype(np.float32) if batch.top_p is not None
                  else np.ones(n, dtype=np.float32)),
        "top_k": (batch.top_k.numpy().astype(np.int64) if batch.top_k is not None
                  else np.full(n, -1, dtype=np.int64)),
        "min_global_steps": smin, "max_global_steps": smax,
        "strawq_group": names[gidx] if n else np.empty(0, dtype=object),
        "over_eta": (batch.over_eta.numpy().astype(bool) if batch.over_eta is not None
                     else np.zeros(n, dtype=bool))}
    meta: dict[str, Any] = {
        "global_token_num": attention_mask.sum(-1).tolist(),
        "strawq": {"seq": batch.seq, "version": batch.version, "rank": batch.rank,
                   "world_size": batch.world_size, "total_samples": batch.total_samples,
                   "total_loss_tokens": batch.total_loss_tokens,
                   "groups": [f"{g.id}:{g.gen}" for g in batch.groups],
                   "skipped": list(batch.skipped), "stats": dict(batch.stats)}}
    if meta_temp:
        meta["temperature"] = float(temps[0]) if n else 1.0
    return protocol.DataProto.from_dict(tensors=tensors, non_tensors=non_tensor,
                                        meta_info=meta)


def check_temperature(data: Any, temperature: float) -> None:
    """Raise ``ValueError`` unless the ``DataProto`` was sampled at ``temperature``: verl
    0.9.1's trainers set one ``meta_info["temperature"]`` (the config's
    ``actor_rollout_ref.rollout.temperature``) in ``_update_actor`` and score every sample
    at it, and ``to_tensordict`` refuses a batch that also carries a per-sample
    ``temperature`` column. Call it on each batch with the trainer's temperature."""
    if "temperature" in data.batch.keys():
        raise ValueError("this DataProto carries per-sample temperatures (batch['temperature'"
                         "]) and verl's _update_actor sets meta_info['temperature'] as well: "
                         "sample at one temperature (the producers' sampling config) or "
                         "override _update_actor so that it does not set it")
    got = float(data.meta_info.get("temperature", 1.0))
    if abs(got - float(temperature)) > 1e-6:
        raise ValueError(f"batch {data.meta_info.get('strawq', {}).get('seq')} was sampled at "
                         f"temperature {got}, the trainer scores at {temperature} "
                         "(actor_rollout_ref.rollout.temperature): expected equal; set the "
                         "producers' temperature or the trainer's to match")


def _extra(name: str, t: torch.Tensor, batch: Batch, row: np.ndarray, col: np.ndarray,
           is_resp: np.ndarray, width_p: int, width_r: int) -> dict[str, torch.Tensor]:
    """A per-token extra as a padded tensor (ragged ones are left in the reader Batch)."""
    n = batch.num_samples
    total = batch.num_tokens
    if name == "top_p_token_offsets" or name == "top_p_token_ids":
        return {}  # ragged over tokens: no padded form
    if t.shape[0] != total:
        return {}
    if name == "routed_experts":  # verl's layout: aligned with input_ids, int16
        out = torch.zeros((n, width_p + width_r, *t.shape[1:]), dtype=torch.int16)
        out[row, col] = t.clamp(min=0).to(torch.int16)
        return {"routed_experts": out}
    sel = torch.from_numpy(is_resp)
    out = torch.zeros((n, width_r, *t.shape[1:]), dtype=t.dtype)
    out[row[is_resp], col[is_resp] - width_p] = t[sel]
    return {f"strawq_{name}": out}


# -- the objective in verl's configuration ---------------------------------------------------
#: strawq's aggregation -> verl's ``actor.loss_agg_mode``
LOSS_AGG = {"token_mean": "token-mean", "seq_mean_token_sum": "seq-mean-token-sum",
            "seq_mean_token_mean": "seq-mean-token-mean"}
#: ``bypass``: old_log_probs = the rollout's, REINFORCE with the IS weight in the actor's
#: loss; ``decoupled``: verl recomputes old_log_probs, the driver computes the IS weights
#: against the rollout's (``compute_rollout_correction_and_add_to_batch``), the actor's PPO
#: loss is weighed by them (exact for the first mini-batch of a batch: ratio 1, no clip)
MODES = ("bypass", "decoupled")


def rollout_correction(objective: Any = None, *, mode: str = "bypass") -> dict[str, Any]:
    """verl's ``algorithm.rollout_correction`` for strawq's importance weight.

    ``tis``: ``rollout_is=token``, threshold 2 (min(ρ, 2)); ``icepop``: threshold
    ``"0.5_5.0"`` (ρ kept in [0.5, 5], 0 outside); ``icepop_mask``: no IS weight and
    ``rollout_rs=token_k1`` at ``"0.2_2.0"`` (token_k1 is −log ρ, so its bounds are those of
    1/ρ: the tokens with ρ in [0.5, 5] stay in the mask); ``none``: neither.
    ``mode="bypass"``: ``bypass_mode`` (old_log_probs are the rollout's) with
    ``loss_type=reinforce``; ``"decoupled"``: verl recomputes old_log_probs and weighs its
    PPO loss by the weights against the rollout's (``bypass_mode=False``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    is_mode = getattr(objective, "is_mode", "tis")
    base: dict[str, Any] = dict(rollout_is=None, rollout_is_threshold=None,
                                rollout_is_batch_normalize=False, rollout_rs=None,
                                rollout_rs_threshold=None, bypass_mode=mode == "bypass",
                                loss_type="reinforce" if mode == "bypass" else "ppo_clip")
    if is_mode == "tis":
        base.update(rollout_is="token", rollout_is_threshold=2.0)
    elif is_mode == "icepop":
        base.update(rollout_is="token", rollout_is_threshold="0.5_5.0")
    elif is_mode == "icepop_mask":
        base.update(rollout_rs="token_k1", rollout_rs_threshold="0.2_2.0")
    elif is_mode != "none":
        raise ValueError(f"unknown importance weight {is_mode!r}")
    return base


def check_objective(objective: Any = None, *, mode: str = "bypass") -> None:
    """Raise ``ValueError`` for an objective verl's loss code does not compute exactly.

    * ``truncated`` scoring: verl's engines score the tempered full softmax; no top-k /
      top-p truncation of the trainer's log-probs.
    * ``icepop_mask`` with ``seq_mean_token_mean``: verl's rejection mask is applied to the
      ``response_mask`` its aggregation divides by, so each sample's token mean is over the
      tokens kept, where strawq's is over its loss tokens (``token_mean`` and
      ``seq_mean_token_sum`` are exact: their denominators are the batch's, fixed before the
      mask).
    * ``icepop_mask`` with ``token_mean`` in the decoupled mode: the driver applies the
      rejection mask before the actor counts the batch's tokens, so the denominator is the
      tokens kept.
    """
    if mode == "decoupled" and getattr(objective, "is_mode", "tis") == "icepop_mask" and \
            getattr(objective, "aggregation", "seq_mean_token_mean") == "token_mean":
        raise ValueError("icepop_mask with token_mean has no exact verl equivalent in the "
                         "decoupled mode: the rejection mask is applied before the actor "
                         "counts the batch's tokens; use the bypass mode")
    if getattr(objective, "truncated", False):
        raise ValueError("verl scores log-probs at the temperature only (the tempered full "
                         "softmax): an objective scored under the recorded top-k / top-p "
                         "truncation has no verl equivalent")
    agg = getattr(objective, "aggregation", "seq_mean_token_mean")
    if agg not in LOSS_AGG:
        raise ValueError(f"unknown aggregation {agg!r}")
    if getattr(objective, "is_mode", "tis") == "icepop_mask" and agg == "seq_mean_token_mean":
        raise ValueError("icepop_mask with seq_mean_token_mean has no exact verl equivalent: "
                         "verl's rejection mask shrinks each sample's token-mean denominator "
                         "to the tokens kept; use token_mean or seq_mean_token_sum, or "
                         "is_mode='icepop'")


def verl_actor_config(objective: Any = None, *, batch_samples: int, rollout_n: int = 1,
                      mode: str = "bypass", **overrides: Any) -> Any:
    """verl's ``FSDPActorConfig`` that trains strawq's documented objective on batches of
    ``batch_samples`` samples (one optimizer step per strawq batch: ``ppo_mini_batch_size``
    × ``rollout_n`` = the batch's samples, one epoch; no KL, no entropy term; the policy
    loss and the rollout correction of ``rollout_correction``: ``bypass_mode`` /
    REINFORCE, or verl's default ``vanilla`` PPO loss in the decoupled ``mode``).
    ``overrides`` set other fields (``ppo_max_token_len_per_gpu``, ``use_dynamic_bsz``,
    ...)."""
    check_objective(objective, mode=mode)
    actor = _verl("verl.workers.config.actor")
    rc_cls = _verl("verl.trainer.config").RolloutCorrectionConfig
    if batch_samples % rollout_n:
        raise ValueError(f"batch_samples={batch_samples} is not a multiple of rollout_n="
                         f"{rollout_n}: expected the collector's batch_groups × group_size")
    agg = getattr(objective, "aggregation", "seq_mean_token_mean")
    kw: dict[str, Any] = dict(
        rollout_n=rollout_n, ppo_mini_batch_size=batch_samples // rollout_n, ppo_epochs=1,
        loss_agg_mode=LOSS_AGG[agg], entropy_coeff=0.0, use_kl_loss=False,
        use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384, shuffle=False,
        policy_loss=actor.PolicyLossConfig(
            loss_mode="bypass_mode" if mode == "bypass" else "vanilla",
            rollout_correction=rc_cls(**rollout_correction(objective, mode=mode))))
    kw.update(overrides)
    return actor.FSDPActorConfig(**kw)


def compute_verl_advantages(data: Any, *, norm_adv_by_std_in_grpo: bool = True) -> Any:
    """verl's own GRPO advantages over ``uid`` (``ray_trainer.compute_advantage``), in place
    of the manifest's. Equal to them for groups of two or more samples with every reward
    present (the same formula: unbiased std, ε = 1e-6); verl counts a missing reward as 0
    where strawq leaves it out, and gives a group of one its reward where strawq gives 0."""
    rt = _verl("verl.trainer.ppo.ray_trainer")
    core = _verl("verl.trainer.ppo.core_algos")
    return rt.compute_advantage(data, adv_estimator=core.AdvantageEstimator.GRPO,
                                norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)


# -- the weight-update bracket around verl's parameter sync ------------------------------------
class StrawqParameterSync:
    """verl's ``CheckpointEngineManager`` with strawq's weight-update bracket around its
    ``update_weights``: producers pause (``begin_weight_update``, every live producer acks)
    before verl pushes the weights, and resume on the new version (``end_weight_update``)
    once the push returned. Every other attribute is the manager's.

    ``bracket``: a rank-0 ``BatchReader`` (its bracket) or a ``WeightUpdateBracket``.
    ``version``: the strawq version to announce, from verl's ``global_steps`` (default: the
    bracket's next version, which moves one per update). ``after_push(version)`` (plain or
    async) runs after verl's push, before the bracket closes: verl's push sets no weight
    version on its engines, and strawq's producers require the run's (tell the engines it
    there, SGLang's ``/update_weight_version``). If verl's push raises, the
    bracket stays open (producers stay paused, nothing generated on half-pushed weights)
    and the error propagates: the next ``update_weights`` continues it, or call
    ``abort_weight_update()``. ``update_weights`` follows verl's calling convention
    (``auto_await``): ``await`` it in a coroutine, or call it plainly.

    ``fingerprint(version)`` (plain or async; attestation, ``strawq.weights.fingerprint``)
    returns the fingerprint of the weights just pushed (``fingerprint_of`` of the actor's
    Hugging Face state dict, or ``fingerprint_of_checkpoint`` of a checkpoint of them), or
    None: it is published for the version before the bracket closes, and every engine is
    checked against it before producers resume.
    """

    def __init__(self, manager: Any, bracket: BatchReader | WeightUpdateBracket, *,
                 timeout: float = 300.0,
                 version: Callable[[int | None, BracketReport], int | None] | None = None,
                 after_push: Callable[[int], Any] | None = None,
                 fingerprint: Callable[[int], Any] | None = None) -> None:
        self.manager = manager
        self.after_push = after_push
        self.fingerprint = fingerprint
        self.bracket = bracket.bracket if isinstance(bracket, BatchReader) else bracket
        self.timeout = timeout
        self.version = version
        #: the last bracket's report and the version it announced
        self.last_report: BracketReport | None = None
        self.last_version: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    async def _update_weights(self, global_steps: int | None = None, **kwargs: Any) -> Any:
        rep = self.bracket.begin_weight_update(self.timeout)
        self.last_report = rep
        result = self.manager.update_weights(global_steps=global_steps, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        target = self.version(global_steps, rep) if self.version is not None else None
        announced = rep.version if target is None else int(target)
        if self.after_push is not None:  # e.g. the engines told strawq's version
            done = self.after_push(announced)
            if inspect.isawaitable(done):
                await done
        if self.fingerprint is not None:  # engines attested against it by the end
            fp = self.fingerprint(announced)
            if inspect.isawaitable(fp):
                fp = await fp
            if fp is not None:
                self.bracket.publish_fingerprint(announced, fp)
        self.last_version = self.bracket.end_weight_update(target)
        return result

    def update_weights(self, global_steps: int | None = None, **kwargs: Any) -> Any:
        """Bracketed ``manager.update_weights(global_steps=...)``; returns its result."""
        coro = self._update_weights(global_steps, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        caller = inspect.currentframe()
        caller = caller.f_back if caller is not None else None
        if caller is not None and caller.f_code.co_flags & inspect.CO_COROUTINE:
            return coro  # the caller awaits it
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, coro).result()

    def abort_weight_update(self) -> None:
        """Resume producers on the current version after a failed push."""
        self.bracket.abort_weight_update()


def hook_parameter_sync(trainer: Any, bracket: BatchReader | WeightUpdateBracket, *,
                        attribute: str = "checkpoint_manager", **kwargs: Any
                        ) -> StrawqParameterSync:
    """Install ``StrawqParameterSync`` on a verl trainer's ``checkpoint_manager`` (call it
    after the trainer built it: ``init_workers`` for ``RayPPOTrainer``, ``set_rollouter``
    for the fully-async trainer); returns it. Idempotent."""
    current = getattr(trainer, attribute, None)
    if current is None:
        raise ValueError(f"the trainer has no {attribute} yet: hook the parameter sync after "
                         "init_workers() (RayPPOTrainer) or set_rollouter() (fully-async)")
    if isinstance(current, StrawqParameterSync):
        return current
    sync = StrawqParameterSync(current, bracket, **kwargs)
    setattr(trainer, attribute, sync)
    return sync


__all__ = ["DATAPROTO_FIELDS", "LOSS_AGG", "MODES", "StrawqParameterSync", "VERL_MISSING",
           "batch_to_dataproto", "check_objective", "check_temperature",
           "compute_verl_advantages", "hook_parameter_sync", "rollout_correction",
           "verl_actor_config"]
