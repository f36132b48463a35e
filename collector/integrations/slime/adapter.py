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
   ≤ c as trained (its lease retired, LEASED → TRAINED); ``load(c)`` after a crash does the same
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
   the reader's checkpoint state. ``--custom-reward-post-process-path
   strawq.collector.integrations.slime.reward_post_process`` (required) makes slime train
   the manifest's advantages, computed within each group; ``pad_steps`` fits a batch to
   slime's training steps so that no sample is dropped and each step's denominators are
   the documented ones; ``--custom-pg-loss-reducer-function-path
   strawq.collector.integrations.slime.seq_mean_token_sum_reducer`` trains strawq's
   ``seq_mean_token_sum`` aggregation. ``strawq.testing.slime_train.slime_path_gradients``
   (the test harness) is this path's gradient for the reference-equivalence check.

Modules of the package ``strawq.collector.integrations.slime``: ``samples`` (the Sample
mapping both ways), ``source`` (mode 1), ``adapter`` (this one: mode 2 and the reducer).
The package re-exports every name slime is given, so the dotted paths above
(``strawq.collector.integrations.slime.<name>``) resolve.

The run directory comes from ``args.strawq_run`` (``--custom-config-path`` YAML) or the
``STRAWQ_RUN`` environment variable.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strawq.collector.integrations.slime.samples import (META, _slime, batch_to_samples, run_dir)
from strawq.collector.trainer.reader import Batch, BatchReader

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


#: ``--custom-reward-post-process-path`` that ``generate_rollout`` needs
REWARD_POST_PROCESS = "strawq.collector.integrations.slime.reward_post_process"
#: ``--custom-pg-loss-reducer-function-path`` for ``seq_mean_token_sum``
SEQ_MEAN_TOKEN_SUM = "strawq.collector.integrations.slime.seq_mean_token_sum_reducer"
#: slime's advantage estimators whose per-token advantage is the post-processed reward of
#: the sample (``get_grpo_returns``): the only ones the manifest's advantages can feed
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo")
_warned_custom: set[str] = set()


def check_train_args(args: Any) -> None:
    """Refuse slime settings under which slime would not train the manifest's advantages.

    The collector computes each sample's advantage within its group (``advantages`` mode,
    failed samples left out) and the manifest records it. slime's default reward
    post-processing recomputes advantages from the rewards instead: it reshapes the batch
    into groups of ``--n-samples-per-prompt`` only when it holds exactly
    ``--rollout-batch-size`` groups (else it normalises across the whole batch), and a
    failed sample's reward (``None``) makes it raise. ``reward_post_process`` hands slime
    the manifest's advantages; it needs an estimator that takes them as they are
    (``ADVANTAGE_ESTIMATORS``) and no second whitening (``--normalize-advantages``).
    """
    path = getattr(args, "custom_reward_post_process_path", None)
    if path is None:
        raise ValueError(
            "strawq's generate_rollout needs --custom-reward-post-process-path "
            f"{REWARD_POST_PROCESS}: the collector's batch carries each sample's advantage, "
            "computed within its group (the manifest's); slime's default post-processing "
            "recomputes them across the whole batch when it holds fewer than "
            "--rollout-batch-size groups, and raises on a failed sample's reward (None). "
            "See docs/slime.md")
    if path != REWARD_POST_PROCESS:
        if path not in _warned_custom:
            _warned_custom.add(path)
            log.warning("--custom-reward-post-process-path %s: it receives strawq's samples "
                        "(a failed sample has reward None; the manifest's advantage is "
                        "metadata['strawq']['advantage']); %s ships them as they are",
                        path, REWARD_POST_PROCESS)
        return
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"--advantage-estimator {estimator}: {REWARD_POST_PROCESS} ships the manifest's "
            f"per-sample advantages, which slime uses as they are only with "
            f"{', '.join(ADVANTAGE_ESTIMATORS)}; choose one of them (the collector's "
            "`advantages` mode sets how the group normalises)")
    if getattr(args, "normalize_advantages", False):
        raise ValueError(
            "--normalize-advantages whitens the manifest's advantages a second time, across "
            "the whole batch: drop it (the collector's `advantages` mode sets the "
            "normalisation, within each group)")


def reward_post_process(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """``--custom-reward-post-process-path``: the manifest's advantages, as slime's rewards.

    Returns ``(raw_rewards, rewards)`` in ``samples``' order, the contract of slime's
    ``_post_process_rewards``. ``rewards`` is each sample's advantage from the manifest
    (``metadata["strawq"]["advantage"]``, times its ``advantage_scale`` in a padded step,
    ``pad_steps``), which slime's grpo/gspo/cispo estimators put on every response token.
    ``raw_rewards`` (slime logs them) is the reward, 0 for a failed sample (no reward; its
    advantage is 0, as the collector recorded it).
    """
    check_train_args(args)
    raw: list[float] = []
    adv: list[float] = []
    for k, s in enumerate(samples):
        meta = (s.metadata or {}).get(META) if isinstance(s.metadata, Mapping) else None
        if not isinstance(meta, Mapping) or "advantage" not in meta:
            raise ValueError(
                f"sample {k} (index {getattr(s, 'index', None)}) carries no strawq advantage "
                f"(metadata['{META}']['advantage']): {REWARD_POST_PROCESS} serves the samples "
                "strawq's generate_rollout returns, not others")
        adv.append(float(meta["advantage"]) * float(meta.get("advantage_scale", 1.0)))
        raw.append(0.0 if s.reward is None else float(s.reward))
    return raw, adv


def check_temperature(batch: Batch, args: Any) -> None:
    """Refuse a batch sampled at a temperature other than ``--rollout-temperature``.

    slime scores every sample's log-probs at that one temperature; a token sampled at
    another has an importance ratio ≠ 1 while on-policy, so TIS clips and IcePop masks
    tokens that are not stale at all. The producers' ``temperature`` (and any per-row
    ``sampling_params.temperature``) must equal slime's ``--rollout-temperature``.
    """
    if batch.temperature is None or not batch.num_samples:
        return
    want = float(getattr(args, "rollout_temperature", 1.0))
    temps = batch.temperature.to(torch.float64)
    bad = (temps - want).abs() > 1e-6 * max(1.0, want)
    if bool(bad.any()):
        found = sorted({round(float(t), 6) for t in temps[bad].tolist()})
        raise ValueError(
            f"strawq batch {batch.seq}: {int(bad.sum())} of {batch.num_samples} samples were "
            f"sampled at temperature {found}, slime's --rollout-temperature is {want}: slime "
            "scores every sample at that one temperature, so their importance ratios would "
            "be off while on-policy. Set the producers' temperature (and any per-row "
            "sampling_params) to --rollout-temperature")


def _loss_tokens(s: Any) -> int:
    """The loss tokens slime counts for a Sample (``_convert_samples_to_train_data``: no
    mask is all ones; ``remove_sample`` zeroes it)."""
    if s.remove_sample:
        return 0
    return int(sum(s.loss_mask)) if s.loss_mask is not None else int(s.response_length)


def pad_steps(groups: list[list[Any]], args: Any, *,
              totals: tuple[int, int | None] | None = None) -> int:
    """Fit the samples to slime's training steps; returns how many padding samples it added.

    slime trains a rollout in steps of ``--global-batch-size`` samples, in order, and drops
    the samples of a last, incomplete step (or raises when there is no complete one): a
    batch shorter than expected (groups skipped at read time) would lose samples strawq then
    acks as trained. The last step is filled with copies of the shortest sample with
    ``remove_sample`` set (slime zeroes their loss masks) and advantage 0.

    ``totals`` is the manifest's ``(total_samples, total_loss_tokens)`` (``Batch.totals``):
    the samples of groups skipped at read time (corrupt records) stay counted, as they are
    on the reader's, Megatron's and verl's paths (``manifest_totals``): their share of the
    loss is missing, the rest of the gradient unchanged. They are counted in the padded
    step (as many as it holds padding). Without ``totals`` the samples given are the whole
    batch.

    Then each step's denominators are made the documented ones, through each sample's
    ``advantage_scale`` (the policy-gradient loss is linear in the advantage):

    * per-sample mean (slime's default): slime divides a step's per-sample means by
      ``--global-batch-size``, so the real samples of a padded step get scale global
      batch size / (their number + the skipped samples counted there) — the mean over the
      step's samples, as in a full step;
    * ``--calculate-per-token-loss``: slime divides a step by Σ max(loss tokens of a
      sample, 1), so every sample without a loss token (an empty response, every token
      masked, a padding sample) adds 1; the step's samples get scale (N + k) / (N + s) for
      its N loss tokens, k such samples and s loss tokens of skipped samples counted there
      — the mean over the step's loss tokens.

    Without ``--global-batch-size`` the batch is one step (of the manifest's samples).
    """
    flat = [s for g in groups for s in g]
    if not flat:
        return 0
    total_samples, total_tokens = totals if totals is not None else (len(flat), None)
    skipped = max(int(total_samples) - len(flat), 0)
    gbs = int(getattr(args, "global_batch_size", None) or (len(flat) + skipped))
    tail = len(flat) % gbs
    pads: list[Any] = []
    if tail:
        template = min(flat, key=lambda s: len(s.tokens))
        mean_reward = float(np.mean([0.0 if s.reward is None else float(s.reward)
                                     for s in flat]))
        for k in range(gbs - tail):
            p = copy.deepcopy(template)
            p.remove_sample = True
            p.loss_mask = [0] * int(p.response_length)
            p.reward = mean_reward  # slime logs raw rewards: the padding leaves their mean
            p.index = -1 - k
            p.metadata = {META: {"padding": True, "advantage": 0.0,
                                 "versions": list(template.metadata[META]["versions"])}}
            pads.append(p)
        log.warning("strawq batch: %d samples do not fill slime's steps of --global-batch-size"
                    " %d; %d inert padding samples added to the last step", len(flat), gbs,
                    len(pads))
    counted = min(skipped, len(pads))  # skipped samples standing in the padding
    real_tokens = sum(_loss_tokens(s) for s in flat)
    skipped_tokens = (max(int(total_tokens) - real_tokens, 0)
                      if total_tokens is not None and skipped else 0)
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    every = flat + pads
    for start in range(0, len(every), gbs):
        step = every[start:start + gbs]
        here = sum(1 for s in step if s.metadata.get(META, {}).get("padding")
                   and -1 - int(s.index) < counted)
        if per_token:
            tokens = [_loss_tokens(s) for s in step]
            n, empty = sum(tokens), sum(1 for t in tokens if t == 0)
            virtual = skipped_tokens * here / skipped if skipped else 0.0
            scale = (n + empty) / (n + virtual) if n and (empty or virtual) else 1.0
        else:
            real = sum(1 for s in step if not s.remove_sample) + here
            scale = gbs / real if real and real < gbs else 1.0
        if scale != 1.0:
            for s in step:
                s.metadata[META]["advantage_scale"] = scale
    if pads:
        groups.append(pads)
    return len(pads)


def seq_mean_token_sum_reducer(total_lengths: Sequence[int], response_lengths: Sequence[int],
                               loss_masks: Sequence[Any], calculate_per_token_loss: bool
                               ) -> Callable[[Any], Any]:
    """slime's ``--custom-pg-loss-reducer-function-path`` for strawq's
    ``seq_mean_token_sum``: each sample's masked token sum, summed (slime divides the step
    by ``--global-batch-size``: the mean over samples of token sums, Dr. GRPO's constant
    denominator). Context parallelism is not supported by this reducer (cp = 1)."""
    if calculate_per_token_loss:
        raise ValueError("seq_mean_token_sum is a per-sample mean: drop "
                         "--calculate-per-token-loss")
    lens = [int(n) for n in response_lengths]

    def reduce(x: Any) -> Any:
        return sum((xi * m).sum() for xi, m in zip(x.split(lens, dim=0), loss_masks,
                                                    strict=True))
    return reduce


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
                     ) -> Any:
    """``--rollout-function-path``: one strawq collector batch as slime Sample groups.

    Refuses settings under which slime would not train the manifest's advantages
    (``check_train_args``) before reading anything. Closes a weight-update bracket left open
    by ``begin_weight_update_hook`` (slime's engines have loaded the new weights before it
    asks for the next rollout) by what the engines hold (``finish_weight_update``: their
    version is announced; engines still on the old version undo the update; engines that
    disagree raise ``BracketError`` naming each; with no engine known, the bracket's version
    is announced), acks the batches of rollouts ≤ ``rollout_id −
    strawq_ack_lag`` (default 1: slime's synchronous loop; use 2 with ``train_async``),
    then reads the next batch; a batch that does not fill slime's last training step is
    padded (``pad_steps``).
    """
    train_output = _slime("slime.rollout.base_types").RolloutFnTrainOutput
    if evaluation:
        raise NotImplementedError("strawq's rollout function serves training batches; "
                                  "evaluate with slime's --eval-function-path "
                                  "slime.rollout.sglang_rollout.generate_rollout")
    check_train_args(args)
    path = run_dir(args)
    reader = _ReaderState.reader(path)
    delivered = _ReaderState.delivered[path]
    if reader.bracket.is_open:  # by what the engines hold: a failed push is not announced
        reader.bracket.finish_weight_update(if_unknown="end")
    lag = int(getattr(args, "strawq_ack_lag", 1))
    while delivered and delivered[0][0] <= rollout_id - lag:
        reader.ack(delivered.popleft()[1])
    batch = reader.next_batch(timeout=float(getattr(args, "strawq_batch_timeout_s", 600.0)))
    delivered.append((int(rollout_id), batch.seq))
    root = getattr(args, "save", None)
    if root:  # before slime trains it, so before any model checkpoint that holds it
        _write_state(_state_file(root, int(rollout_id)), reader.checkpoint_state(batch.seq))
    want = getattr(args, "rollout_batch_size", None)
    if want is not None and len(batch.groups) != int(want):
        log.warning("strawq batch %d has %d groups, slime's --rollout-batch-size is %s: set "
                    "the collector's batch_groups to match", batch.seq, len(batch.groups), want)
    check_temperature(batch, args)
    samples = batch_to_samples(batch)
    bt = batch.totals
    padding = pad_steps(samples, args,
                        totals=(bt.total_samples, bt.total_loss_tokens))
    metrics = {f"strawq/{k}": v for k, v in batch.stats.items()}
    metrics.update({"strawq/batch_seq": batch.seq, "strawq/version": batch.version,
                    "strawq/skipped": len(batch.skipped), "strawq/padding": padding})
    return train_output(samples=samples, metrics=metrics)


def begin_weight_update_hook(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """``--custom-update-weight-post-write-path``: pause strawq's producers (trainer rank 0)
    after slime wrote the new weights and before the engines read them.

    With ``strawq_attest`` (a ``--custom-config-path`` key) the fingerprint of the
    checkpoint slime wrote (``fingerprint_of_checkpoint(version_dir)``, cast to
    ``strawq_attest_dtype``, default ``bfloat16``) is published for the bracket's version:
    the next ``generate_rollout`` closes the bracket only after every engine was checked
    against it (``strawq.weights.fingerprint``). A ``version_dir`` that holds no readable
    checkpoint raises ``ValueError`` before producers are paused."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    fp = None
    if getattr(args, "strawq_attest", False):
        from strawq.weights.fingerprint import fingerprint_of_checkpoint

        fp = fingerprint_of_checkpoint(
            version_dir, dtype=str(getattr(args, "strawq_attest_dtype", "bfloat16")))
    reader = _ReaderState.reader(run_dir(args))
    rep = reader.begin_weight_update(float(getattr(args, "strawq_bracket_timeout_s", 300.0)))
    if fp is not None:
        reader.bracket.publish_fingerprint(rep.version, fp)
    log.info("strawq producers paused for weight version %d (%s)%s", rep.version, version_dir,
             "; its fingerprint published" if fp is not None else "")


def _state_file(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"rollout/strawq_reader_{rollout_id}.json")


def _write_state(path: str, state: Mapping[str, Any]) -> None:
    """Write a reader state file whole or not at all (a job killed while writing it leaves
    the previous file, never a torn one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    def save(self, rollout_id: int) -> None:
        """slime calls it after the model checkpoint of ``rollout_id``: the reader state of
        that checkpoint (also written when the rollout's batch was delivered, so that a job
        killed between slime's model checkpoint and this call resumes right)."""
        reader = _ReaderState.reader(self.path)
        seqs = [s for r, s in _ReaderState.delivered[self.path] if r <= int(rollout_id)]
        state = reader.state_dict(consumed=max(seqs) if seqs else None)
        root = getattr(self.args, "save", None)
        if root:
            _write_state(_state_file(root, int(rollout_id)), state)

    def load(self, rollout_id: int | None = None) -> None:
        root = getattr(self.args, "load", None)
        if root is None or rollout_id is None:
            return
        path = _state_file(root, int(rollout_id))
        if not os.path.exists(path):
            log.info("no strawq reader state at %s", path)
            return
        with open(path, encoding="utf-8") as f:
            _ReaderState.reader(self.path).load_state_dict(json.load(f))

    def __len__(self) -> int:
        return 0


__all__ = ["ADVANTAGE_ESTIMATORS", "REWARD_POST_PROCESS", "SEQ_MEAN_TOKEN_SUM",
           "StrawqBatchSource", "begin_weight_update_hook", "check_temperature",
           "check_train_args", "generate_rollout", "pad_steps", "reward_post_process",
           "seq_mean_token_sum_reducer"]
