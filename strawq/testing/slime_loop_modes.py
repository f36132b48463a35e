"""The two modes' setups for ``strawq.testing.slime_loop`` (test harness): the run, the
flags (``strawq.collector.integrations.slime.flags.MODES``, the launcher's), what a fresh
process and a weight update are, the reference of a step and the sample ids expected.

Mode 2's batches hold what a trainer path must get right: a failed reward (reward None,
status failed), a tool-failed sample (tool tokens masked, then failed), a group of one
(one sample), and a group whose record is corrupted on disk after publishing (the reader
skips it; it stays counted in the manifest's totals).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strawq.collector.integrations.slime.flags import MODES, flags_to_args

VOCAB = 48


def _slime_flags(mode: str) -> dict[str, Any]:
    return flags_to_args(MODES[mode])


@dataclass
class CollectorEnv:
    """Mode 2: strawq published the batches; slime trains them."""

    run_dir: str
    slime_overrides: dict[str, Any]
    expected: set[str]
    corrupt: set[str] = field(default_factory=set)

    def fresh_process(self) -> None:
        from strawq.collector.integrations.slime.adapter import _ReaderState

        for reader in _ReaderState.readers.values():
            reader.close()
        _ReaderState.readers.clear()
        _ReaderState.delivered.clear()

    def update_weights(self, args: Any) -> None:
        """slime's ``update_weights`` with disk transfer: the weights are written, then its
        ``--custom-update-weight-post-write-path`` hook runs (here: no engines)."""
        load_function = _load_function()
        hook = getattr(args, "custom_update_weight_post_write_path", None)
        if hook:
            load_function(hook)(args, os.path.join(args.save, "hf"), [])

    def reference(self, samples: list[Any], step_ids: list[str | None], model: Any,
                  objective: Any) -> dict[str, torch.Tensor] | None:
        from strawq.testing.reference import Objective, reference_gradients

        seqs = {s.metadata["strawq"]["seq"] for s in samples
                if not s.metadata["strawq"].get("padding")}
        if len(seqs) != 1:
            raise AssertionError(f"a rollout holds batches {sorted(seqs)}, expected one")
        obj = objective if objective is not None else Objective()
        return reference_gradients(self.run_dir, seqs.pop(), model, objective=obj,
                                   skip=self.corrupt)[1]

    def expected_ids(self) -> set[str]:
        return set(self.expected)


def _load_function() -> Any:
    from strawq.collector.integrations.slime.samples import _slime

    return _slime("slime.utils.misc").load_function


def collector_setup(workdir: str, *, rollouts: int, groups: int, group_size: int,
                    seed: int) -> CollectorEnv:
    from strawq.delivery.batches import BatchStore
    from strawq.ondisk.groups import GroupData
    from strawq.storage import open_storage
    from strawq.tasks.queue import Lease, RunQueue
    from strawq.testing.reference import publish_batch

    rng = np.random.default_rng(seed)
    n = rollouts * groups
    prompts = [[int(x) for x in rng.integers(0, VOCAB, int(rng.integers(1, 6)))]
               for _ in range(n)]
    expected: set[str] = set()

    def build(lease: Lease) -> GroupData:
        i = int(lease.task["index"])
        g = 1 if i == 1 else group_size  # a group of one, in the first batch
        lens = rng.integers(1, 12, g)
        total = int(lens.sum())
        mask = (rng.random(total) > 0.1).astype(np.uint8)
        mask[np.cumsum(lens) - lens] = 1
        rewards: list[float | None] = [float(x) for x in rng.random(g).round(2)]
        status = ["completed"] * g
        if i == 0:  # a failed reward
            rewards[1], status[1] = None, "failed"
        if i == 2:  # a tool call failed: its output tokens masked, the sample failed
            end = int(lens[0])
            mask[max(end - 3, 1):end] = 0
            rewards[0], status[0] = None, "failed"
        expected.update(f"{i}:{i * group_size + k}" for k in range(g))
        return GroupData(
            task_id=lease.task_id, index=i, prompt_ids=np.asarray(lease.task["row"]["prompt"],
                                                                  np.int32),
            sample_lens=lens.tolist(), tokens=rng.integers(0, VOCAB, total).astype(np.int32),
            logprobs=np.log(rng.uniform(0.05, 1.0, total)).astype(np.float32),
            versions=np.zeros(total, np.int64), loss_mask=mask, rewards=rewards,
            status=status, meta={"params": [{"temperature": 1.0, "max_new_tokens": 12}] * g})

    run_dir, _ = publish_batch(os.path.join(workdir, "strawq"), prompts, group_size, build,
                               batch_groups=groups)
    q = RunQueue.open(open_storage(run_dir, writer_id="corrupt"))
    seqs, _ = BatchStore(q).batch_seqs()
    if len(seqs) < rollouts:
        raise RuntimeError(f"the collector published {len(seqs)} batches, {rollouts} wanted")
    victim = BatchStore(q).read_manifest(sorted(seqs)[-1]).groups[1]  # the last rollout's
    path = q.storage.local_path(f"data/{victim.id}~g{victim.gen}.group")
    if path is None:
        raise RuntimeError(f"{run_dir}: the loop corrupts a record on a local directory")
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    corrupt_index = None
    for s in BatchStore(q).read_manifest(sorted(seqs)[-1]).summaries:
        if s.get("task_id") == victim.id:
            corrupt_index = int(s["index"])
    if corrupt_index is not None:
        expected -= {x for x in expected if x.startswith(f"{corrupt_index}:")}
    return CollectorEnv(run_dir, collector_overrides(run_dir, groups, group_size), expected,
                        {victim.id})


def collector_overrides(run_dir: str, groups: int, group_size: int, *,
                        timeout_s: float = 20.0) -> dict[str, Any]:
    """slime's ``args`` of mode 2 on the run at ``run_dir`` (the launcher's flags, one
    optimizer step per rollout of ``groups`` groups of ``group_size``), on top of
    ``slime_train.slime_args``; ``timeout_s``: the batch and bracket timeouts."""
    flags = _slime_flags("collector")
    flags.update(strawq_run=run_dir, global_batch_size=groups * group_size,
                 rollout_batch_size=groups, n_samples_per_prompt=group_size,
                 rollout_global_dataset=True, load_debug_rollout_data=None,
                 strawq_batch_timeout_s=timeout_s, strawq_bracket_timeout_s=timeout_s,
                 use_dynamic_batch_size=False, max_tokens_per_gpu=None, micro_batch_size=1,
                 balance_data=False, balance_by_flops=False)
    return flags


# -- mode 1: slime generates with its own rollout, strawq keeps the data ---------------------
async def tiny_generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's ``--custom-generate-function-path`` standing in for an SGLang engine: a
    response drawn from the sample's prompt (deterministic per sample index), rollout
    log-probs, a reward; sample index ≡ 1 (mod 5) fails (tool error: its reward None would
    make slime's default post-processing raise, so slime's own convention, reward 0 and
    ``remove_sample``)."""
    status = type(sample).Status
    prompt = list(sample.tokens)
    rng = np.random.default_rng(int(sample.index) + 7)
    n = int(rng.integers(1, 10))
    resp = [int(x) for x in rng.integers(0, VOCAB, n)]
    sample.tokens = prompt + resp
    sample.response_length = n
    sample.response = " ".join(map(str, resp))
    sample.rollout_log_probs = [float(x) for x in np.log(rng.uniform(0.05, 1.0, n))]
    sample.loss_mask = [1] * n
    sample.reward = round(float(rng.random()), 2)
    sample.status = status.COMPLETED
    if int(sample.index) % 5 == 1:
        sample.status, sample.reward, sample.remove_sample = status.FAILED, 0.0, True
    return sample


@dataclass
class DataSourceEnv:
    """Mode 1: slime's ``sglang_rollout`` generates (``tiny_generate``) from
    ``StrawqDataSource``; the engines' HTTP calls answer no worker."""

    run_dir: str
    slime_overrides: dict[str, Any]
    rows: int

    def fresh_process(self) -> None:
        from strawq.collector.integrations.slime.samples import _slime

        sr = _slime("slime.rollout.sglang_rollout")

        async def no_workers(url: str, *a: Any, **k: Any) -> dict[str, Any]:
            return {"workers": []}

        async def idle(urls: Any, *a: Any, **k: Any) -> None:
            return None

        sr.get, sr.abort_servers_until_idle = no_workers, idle
        sr.load_tokenizer = sr.load_processor = lambda *a, **k: None
        type(sr.GenerateState)._instances.pop(sr.GenerateState, None)  # a new process

    def update_weights(self, args: Any) -> None:
        return None

    def reference(self, samples: list[Any], step_ids: list[str | None], model: Any,
                  objective: Any) -> dict[str, torch.Tensor] | None:
        return None  # no manifest: slime computed the advantages itself

    def expected_ids(self) -> set[str]:
        return {f"{i}:{i * int(self.slime_overrides['n_samples_per_prompt']) + k}"
                for i in range(self.rows)
                for k in range(int(self.slime_overrides["n_samples_per_prompt"]))}


def data_source_setup(workdir: str, *, rollouts: int, groups: int, group_size: int,
                      seed: int) -> DataSourceEnv:
    import json

    rng = np.random.default_rng(seed)
    rows = rollouts * groups
    ds = os.path.join(workdir, "prompts.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": [int(x) for x in rng.integers(
                0, VOCAB, int(rng.integers(1, 6)))]}) + "\n")
    run_dir = os.path.join(workdir, "strawq-run")
    flags = _slime_flags("data-source")
    flags.update(
        strawq_run=run_dir, prompt_data=ds, input_key="prompt", label_key=None,
        metadata_key=None, n_samples_per_prompt=group_size, rollout_batch_size=groups,
        over_sampling_batch_size=groups, global_batch_size=groups * group_size, num_epoch=1,
        rollout_global_dataset=True, load_debug_rollout_data=None,
        custom_reward_post_process_path=None, use_tis=False,
        custom_generate_function_path="strawq.testing.slime_loop_modes.tiny_generate",
        sglang_server_concurrency=8, rollout_num_engines=1, sglang_dp_size=None,
        rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=16, rollout_stop=None,
        rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        dynamic_sampling_filter_path=None, rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None, mask_offpolicy_in_partial_rollout=False,
        group_rm=False, hf_checkpoint=None, sglang_router_ip="127.0.0.1",
        sglang_router_port=1, use_dynamic_batch_size=False, max_tokens_per_gpu=None,
        micro_batch_size=1, balance_data=False, balance_by_flops=False,
        sglang_enable_deterministic_inference=False)
    return DataSourceEnv(run_dir, flags, rows)


#: the setup of each mode (``run_slime_loop``'s ``mode``)
SETUPS: dict[str, Callable[..., Any]] = {"collector": collector_setup,
                                         "data-source": data_source_setup}

__all__ = ["CollectorEnv", "DataSourceEnv", "SETUPS", "collector_overrides", "collector_setup",
           "data_source_setup", "tiny_generate"]
