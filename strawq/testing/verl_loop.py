"""verl's own training loop over strawq batches, on a CPU: ``run_verl_loop``.

The trainer class (``strawq_trainer(FullyAsyncTrainer)``, or any class given) runs verl's
real ``FullyAsyncTrainer.fit_step`` chain — ``_fit_generate``, ``_fit_compute_reward``,
``_fit_compute_log_prob``, ``_fit_compute_ref_log_prob``, ``_fit_compute_critic``,
``_fit_compute_advantage``, ``_fit_update_critic``, ``_fit_update_actor`` (verl's
``_update_actor``), ``_fit_update_local_step``, ``_fit_update_weights``, ``_fit_validate``,
``_fit_save_checkpoint`` (verl's ``_save_checkpoint``), ``_fit_collect_metrics``,
``_fit_postprocess_step`` — then a kill (the trainer object and its reader dropped), a
restart through verl's own ``load_checkpoint``, and verl's ``fit`` to the end (its forced
final checkpoint included). Stubbed, as needing GPUs or a Ray cluster: the object's
construction (``object.__new__`` and the attributes verl's ``__init__`` sets), the actor
worker group (its ``update_actor`` is verl's actor-side loss code on a ``TinyPolicy``:
``strawq.testing.verl_train``; an SGD step follows), the rollouter, the checkpoint-engine
manager and the message-queue client (small stand-ins), and ``ray.get`` in verl's trainer
module (it resolves the stand-ins' values).

The run (``publish_run``) holds a failed reward, a tool-failed sample (status ``failed``,
no reward, loss mask 0), a group of one and a group whose record is corrupted after
publishing (the reader skips it). Each step's gradient is compared with
``reference_gradients`` on that step's batch at the same weights (a skipped group counts
in the denominators with no loss: its advantages zeroed in the oracle's manifest, read from
a copy of the run taken before the corruption).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import os
import shutil
import types
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from strawq.delivery.batches import BatchStore, Manifest
from strawq.ondisk.groups import GroupData
from strawq.storage import open_storage
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing.reference import (
    Objective,
    TinyPolicy,
    complete_groups,
    max_relative_error,
    reference_gradients,
)

#: dataset index of each special group in ``publish_run``
FAILED_REWARD, TOOL_FAILED, GROUP_OF_ONE, CORRUPT = 1, 2, 4, 7


def publish_run(path: str, *, batches: int = 4, batch_groups: int = 3, group_size: int = 4,
                seed: int = 0, vocab: int = 64) -> tuple[str, dict[str, Any]]:
    """A run with ``batches`` published batches of ``batch_groups`` groups (temperature
    1.0), the special groups among them; returns the run directory and
    ``{"oracle": a copy taken before the corruption, "corrupt": the corrupted group id,
    "expected": sample ids every trained batch holds}``."""
    import json

    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.config import QueueConfig
    from strawq.data.dataset import Dataset

    groups = batches * batch_groups
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    ds = os.path.join(path, "dataset.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        for i in range(groups):
            prompt = [int(x) for x in rng.integers(0, vocab, int(rng.integers(2, 7)))]
            f.write(json.dumps({"prompt": prompt, "i": i}) + "\n")
    run_dir = os.path.join(path, "run")
    q = RunQueue.create(open_storage(run_dir, writer_id="setup", fsync=False),
                        QueueConfig(fsync=False, group_size=group_size, release_batch=groups))
    col = Collector(q, Dataset(ds), CollectorConfig(
        batch_groups=batch_groups, max_running=groups, max_ready=groups, poll_interval_s=0,
        gc_interval_s=1e9, max_staleness=None, max_prefetch_batches=batches))
    policy = TinyPolicy(vocab=vocab)

    def build(lease: Lease) -> GroupData:
        index = int(lease.task["index"])
        n = 1 if index == GROUP_OF_ONE else group_size
        lens = [int(x) for x in rng.integers(1, 9, n)]
        prompt = [int(t) for t in lease.task["row"]["prompt"]]
        toks: list[int] = []
        lps: list[float] = []
        with torch.no_grad():
            for ln in lens:
                seq = list(prompt)
                for _ in range(ln):
                    x = torch.tensor(seq)
                    logits = policy(x, torch.arange(len(seq)), torch.tensor([0, len(seq)]))[-1]
                    p = torch.softmax(logits.float(), -1)
                    tok = int(torch.multinomial(p, 1, generator=torch.Generator().manual_seed(
                        int(rng.integers(0, 2**31)))))
                    lps.append(float(torch.log(p[tok])) + float(rng.normal(0, 0.3)))
                    seq.append(tok)
                toks += seq[len(prompt):]
        mask = (rng.random(sum(lens)) > 0.15).astype(np.uint8)
        rewards: list[float | None] = [float(x) for x in rng.random(n).round(2)]
        status = ["completed"] * n
        if index == FAILED_REWARD:
            rewards[2] = None  # the reward function failed on a finished sample
        if index == TOOL_FAILED:
            rewards[1] = None
            status[1] = "failed"  # a tool's last try failed: never trained as finished
            mask[lens[0]:lens[0] + lens[1]] = 0
        return GroupData(
            task_id=lease.task_id, index=index, prompt_ids=np.asarray(prompt, np.int32),
            sample_lens=lens, tokens=np.asarray(toks, np.int32),
            logprobs=np.minimum(np.asarray(lps), 0.0).astype(np.float32),
            versions=np.zeros(sum(lens), np.int64), loss_mask=mask, rewards=rewards,
            status=status, meta={"params": [{"temperature": 1.0, "max_new_tokens": 8}] * n})

    complete_groups(col, groups, build, "verl-loop")
    for _ in range(batches + 2):
        col.step()
    store = BatchStore(q)
    seqs = sorted(store.batch_seqs()[0])
    if len(seqs) != batches:
        raise RuntimeError(f"{path}: the collector published {len(seqs)} batches, expected "
                           f"{batches}")
    oracle = os.path.join(path, "oracle")
    shutil.copytree(run_dir, oracle)
    corrupt = None
    expected: list[str] = []
    for s in seqs:
        man = store.read_manifest(s)
        for name, summ in zip(man.groups, man.summaries, strict=True):
            if q.read_group(name.id, name.gen).index == CORRUPT:
                corrupt = name
                continue
            expected += [f"{name.id}:{i}" for i in range(len(summ["sample_lens"]))]
    if corrupt is None:
        raise RuntimeError("the corrupt group was not published")
    local = q.storage.local_path(f"data/{corrupt.id}~g{corrupt.gen}.group")
    if local is None:
        raise RuntimeError("the run's storage has no local path to corrupt")
    data = bytearray(Path(local).read_bytes())
    data[-5] ^= 0xFF
    Path(local).write_bytes(bytes(data))
    return run_dir, {"oracle": oracle, "corrupt": corrupt.id, "expected": expected,
                     "seqs": seqs}


# -- the stand-ins -----------------------------------------------------------------------------
def _done(value: Any) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class _Remote:
    """``actor.method.remote(...)``: a value, an awaitable, and ``.future()``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        value = self.fn(*args, **kwargs)
        return _Ref(value)


class _Ref:
    def __init__(self, value: Any) -> None:
        self.value = value

    def future(self) -> concurrent.futures.Future[Any]:
        return _done(self.value)

    def __await__(self) -> Any:
        return asyncio.sleep(0, self.value).__await__()


def _ray_get(x: Any) -> Any:
    if isinstance(x, list):
        return [_ray_get(v) for v in x]
    return x.value if isinstance(x, _Ref) else x


class Rollouter:
    """The rollouter as the trainer calls it (its replicas and generation are the engines')."""

    def __init__(self) -> None:
        self.saved: list[str] = []
        self.get_total_produced_samples = _Remote(lambda: 0)
        self.get_completed_steps = _Remote(lambda: 0)
        self.reset_staleness = _Remote(lambda: {})
        self.save_checkpoint = _Remote(self.saved.append)
        self.do_validate = _Remote(lambda: {})


class CheckpointManager:
    """verl's ``CheckpointEngineManager`` (weight push to the rollout replicas) stand-in."""

    def __init__(self) -> None:
        self.pushed: list[int] = []

    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        self.pushed.append(int(global_steps or 0))
        return {}


class ActorGroup:
    """The actor worker group: ``update_actor`` runs verl's actor-side loss on the tensordict
    verl's ``_update_actor`` built (``verl_train.actor_td_step``), records the gradient and
    the weights it was taken at, then an SGD step; checkpoints hold the weights and the
    samples trained into them."""

    def __init__(self, model: torch.nn.Module, config: Any, lr: float,
                 current: Any) -> None:
        self.model, self.config, self.lr, self.current = model, config, lr, current
        self.steps: list[dict[str, Any]] = []  # the lineage of the weights

    def update_actor(self, td: Any) -> Any:
        from strawq.testing.verl_train import actor_td_step

        tu = _verl_tu()
        batch = self.current()
        before = copy.deepcopy(self.model.state_dict())
        self.model.zero_grad(set_to_none=True)
        loss, _ = actor_td_step(self.model, td, self.config)
        grads = {k: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q))
                 for k, q in self.model.named_parameters()}
        with torch.no_grad():
            for q in self.model.parameters():
                if q.grad is not None:
                    q.sub_(self.lr * q.grad)
        names = [f"{g.id}:{i}" for g, s in zip(batch.groups, batch.summaries, strict=True)
                 for i in range(len(s["sample_lens"]))]
        self.steps.append({"seq": batch.seq, "weights": before, "grads": grads,
                           "samples": names,
                           "global_batch_size": int(tu.get(td, "global_batch_size"))})
        out = tu.get_tensordict({}, non_tensor_dict={"metrics": {"mfu": 0.0,
                                                                 "pg_loss": float(loss)}})
        return out

    def save_checkpoint(self, local_path: str, hdfs_path: Any = None, step: int = 0,
                        max_ckpt_to_keep: Any = None) -> None:
        os.makedirs(local_path, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "trained": len(self.steps)},
                   os.path.join(local_path, "model.pt"))

    def load_checkpoint(self, path: str, del_local_after_load: bool = False) -> None:
        got = torch.load(os.path.join(path, "model.pt"))
        self.model.load_state_dict(got["model"])
        self.steps = self.steps[:int(got["trained"])]

    def start_profile(self, **_kw: Any) -> None:
        return None

    def stop_profile(self) -> None:
        return None


def _verl_tu() -> Any:
    from strawq.collector.integrations.verl.reader import _verl

    return _verl("verl.utils.tensordict_utils")


def verl_config(ckpt_dir: str, *, trigger: int, save_freq: int, batch_groups: int,
                group_size: int) -> Any:
    """The verl config keys the loop reads (bypass mode, REINFORCE, TIS, token-mean)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "trainer": {"default_local_dir": ckpt_dir, "default_hdfs_dir": None,
                    "save_freq": save_freq, "test_freq": -1, "critic_warmup": 0,
                    "esi_redundant_time": 0, "resume_mode": "auto", "resume_from_path": None,
                    "del_local_ckpt_after_load": False, "balance_batch": False,
                    "rollout_data_dir": None, "max_actor_ckpt_to_keep": None,
                    "max_critic_ckpt_to_keep": None, "project_name": "p",
                    "experiment_name": "e", "logger": [], "nnodes": 1,
                    "n_gpus_per_node": 1, "device": "cpu"},
        "global_profiler": {"steps": None, "profile_continuous_steps": False},
        "async_training": {"trigger_parameter_sync_step": trigger, "require_batches": 1,
                           "staleness_threshold": 1, "use_trainer_do_validate": False,
                           "use_dynamic_resource_scheduling": False},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True,
                      "use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0,
                      "rollout_correction": {"bypass_mode": True, "loss_type": "reinforce",
                                             "rollout_is": "token",
                                             "rollout_is_threshold": 2.0,
                                             "rollout_is_batch_normalize": False,
                                             "rollout_rs": None, "rollout_rs_threshold": None}},
        "actor_rollout_ref": {
            "rollout": {"n": group_size, "temperature": 1.0, "multi_turn": {"enable": False}},
            "actor": {"ppo_mini_batch_size": batch_groups, "ppo_epochs": 1,
                      "data_loader_seed": 0, "shuffle": False, "calculate_entropy": False,
                      "entropy_coeff": 0.0, "loss_agg_mode": "token-mean",
                      "loss_scale_factor": None,
                      "policy_loss": {"loss_mode": "bypass_mode"}}},
        "rollout": {"nnodes": 0, "n_gpus_per_node": 0},
    })


class _Queue:
    def get_queue_size_sync(self) -> int:
        return 0


class _Logger:
    def log(self, data: Any, step: int) -> None:
        return None


class _Pools:
    def get_n_gpus(self) -> int:
        return 1


def make_trainer(cls: Any, config: Any, run_dir: str, group: ActorGroup, *,
                 after_push: Any = None, timeout: float = 30.0) -> Any:
    """``cls`` built as verl's ``__init__`` leaves a fully-async trainer (its Ray and GPU
    parts as stand-ins), the strawq reader attached, verl's rollouter and manager set."""
    from verl.experimental.fully_async_policy.detach_utils import MetricsAggregator
    from verl.experimental.fully_async_policy.dynamic_schedule import DynamicScheduleContext

    from strawq.collector.trainer.reader import BatchReader

    t = object.__new__(cls)
    trig = int(config.async_training.trigger_parameter_sync_step)
    required = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    t.__dict__.update(
        config=config, tokenizer=None, hybrid_engine=False, use_reference_policy=False,
        use_rm=False, distillation_config=None, use_critic=False, ref_in_actor=False,
        use_prefix_grouper=False, global_steps=0, epoch=0, max_steps_duration=0,
        progress_bar=None, is_last_step=False, prev_step_profile=False,
        curr_step_profile=False, next_step_profile=False, last_val_metrics={}, metrics={},
        timing_raw={}, future_reward=None, reward_tensor=None, reward_extra_infos_dict={},
        logger=_Logger(), message_queue_client=_Queue(), local_trigger_step=1,
        processed_samples=0, stale_trajectory_processed=0, current_param_version=0,
        total_train_steps=None, trigger_parameter_sync_step=trig, last_ckpt_version=0,
        require_batches=1, required_samples=required, _step_wait_times=[],
        _step_wait_samples=[], metrics_aggregator=MetricsAggregator(
            total_gpus=1, hybrid_gpus=1, standalone_gpus=0),
        rollouter=Rollouter(), checkpoint_manager=CheckpointManager(),
        hybrid_checkpoint_manager=None, dynamic_resource_controller=None,
        dynamic_schedule_enabled=False, staleness_threshold=1.0, only_hybrid=False,
        dynamic_schedule_ctx=DynamicScheduleContext(
            required_samples=required, trigger_parameter_sync_step=trig,
            total_generated_samples=0, expected_samples=0, buffer_samples=0,
            only_hybrid=False),
        actor_rollout_wg=group, actor_wg=group, resource_pool_manager=_Pools(),
        _dump_executor=None)
    reader = BatchReader.open(run_dir, poll_interval_s=0.01)
    if hasattr(t, "attach_strawq"):
        t.attach_strawq(reader, timeout=timeout, after_push=after_push)
    group.current = lambda: t.strawq_batch
    return t


def run_verl_loop(path: str, *, trainer_cls: Any = None, batches: int = 6,
                  batch_groups: int = 3, group_size: int = 4, trigger: int = 2,
                  save_freq: int = 1, before_kill: int = 3, lr: float = 0.05,
                  objective: Objective | None = None, kill: bool = True,
                  seed: int = 0) -> dict[str, Any]:
    """Publish ``publish_run``'s batches, train ``before_kill`` steps through verl's
    ``fit_step``, kill, restore through verl's ``load_checkpoint`` and run verl's ``fit``
    to the last batch (``kill=False``: ``fit`` from the start). Returns ``{"steps",
    "trained_twice", "missing", "max_rel_grad_err", "skipped", "denominators",
    "committed"}``: per sample id, over the steps the final weights hold."""
    from verl.experimental.fully_async_policy import fully_async_trainer as fat

    from strawq.collector.integrations.verl.reader import verl_actor_config
    from strawq.collector.integrations.verl.trainer import strawq_trainer
    from strawq.delivery.commits import committed_seq

    cls = trainer_cls or strawq_trainer(fat.FullyAsyncTrainer)
    objective = objective or Objective()
    run_dir, info = publish_run(path, batches=batches, batch_groups=batch_groups,
                                group_size=group_size, seed=seed)
    ckpt = os.path.join(path, "ckpt")
    config = verl_config(ckpt, trigger=trigger, save_freq=save_freq,
                         batch_groups=batch_groups, group_size=group_size)
    actor_cfg = verl_actor_config(objective, batch_samples=batch_groups * group_size,
                                  rollout_n=group_size, ppo_max_token_len_per_gpu=64)
    group = ActorGroup(TinyPolicy(), actor_cfg, lr, lambda: None)
    shim = types.SimpleNamespace(get=_ray_get)
    skipped: list[str] = []
    with mock.patch.object(fat, "ray", shim):
        t = make_trainer(cls, config, run_dir, group)
        t.set_total_train_steps(batches)
        if kill:
            t.global_steps = 1
            for _ in range(before_kill):
                asyncio.run(t.fit_step())
                skipped += list(t.strawq_batch.skipped)
            t.strawq.close()
            del t  # the trainer process dies: its reader, its un-checkpointed steps
            t = make_trainer(cls, config, run_dir, group)
            t.set_total_train_steps(batches)
            asyncio.run(t.load_checkpoint())
        asyncio.run(t.fit())
        skipped += list(t.strawq_batch.skipped) if t.strawq_batch is not None else []
        t.strawq.close()
    oracle = RunQueue.open(open_storage(info["oracle"], writer_id="oracle"))
    store = BatchStore(oracle)
    worst = 0.0
    errors: list[float] = []
    for step in group.steps:
        man = store.read_manifest(int(step["seq"]))
        man = _without(man, info["corrupt"])
        model = TinyPolicy()
        model.load_state_dict(step["weights"])
        _, ref = reference_gradients(oracle, man, model, objective=objective)
        err = max_relative_error(step["grads"], ref)
        errors.append(err)
        worst = max(worst, err)
    counts = Counter(s for step in group.steps for s in step["samples"])
    q = RunQueue.open(open_storage(run_dir, writer_id="check"))
    return {"steps": len(group.steps),
            "trained_twice": sum(c - 1 for c in counts.values() if c > 1),
            "missing": len(set(info["expected"]) - set(counts)),
            "max_rel_grad_err": worst, "skipped": sorted(set(skipped)),
            "corrupt": info["corrupt"],
            "denominators": [s["global_batch_size"] for s in group.steps],
            "committed": committed_seq(q.storage), "last_batch": info["seqs"][-1],
            "errors": errors, "seqs": [s["seq"] for s in group.steps]}


def _without(man: Manifest, group_id: str) -> Manifest:
    """The manifest with ``group_id``'s advantages zeroed: counted, no loss."""
    out = []
    for name, s in zip(man.groups, man.summaries, strict=True):
        if name.id == group_id:
            s = {**s, "advantages": [0.0] * len(s["sample_lens"])}
        out.append(s)
    return dataclasses.replace(man, summaries=out)


__all__ = ["ActorGroup", "CheckpointManager", "Rollouter", "make_trainer", "publish_run",
           "run_verl_loop", "verl_config"]
