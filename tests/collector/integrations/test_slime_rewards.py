"""strawq generates, slime trains: what slime's own reward post-processing and step split
make of the batches ``generate_rollout`` returns.

The oracle is slime's pinned source: its ``Sample``, its ``RolloutManager``'s
``_post_process_rewards`` and ``_convert_samples_to_train_data`` (compiled from slime's
``ray/rollout.py``, ``strawq.testing.slime_train``) and its
``build_dp_schedule``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strawq.collector.ordering import group_advantages
from tests.collector.integrations.conftest import SLIME_MISSING, make_batch

slime_types = pytest.importorskip("slime.utils.types", reason=SLIME_MISSING)
from slime.utils.dp_schedule import build_dp_schedule  # noqa: E402

from strawq.collector.integrations import slime as adapter  # noqa: E402
from strawq.testing.slime_train import RolloutManager, flatten  # noqa: E402

pytestmark = pytest.mark.slime
G = 4


def slime_args(**kw):
    """slime's defaults for what the conversion and the step split read."""
    base = dict(advantage_estimator="grpo", rewards_normalization=True,
                grpo_std_normalization=True, reward_key=None, n_samples_per_prompt=G,
                rollout_batch_size=4, custom_reward_post_process_path=adapter.REWARD_POST_PROCESS,
                custom_convert_samples_to_train_data_path=None, normalize_advantages=False,
                global_batch_size=None, calculate_per_token_loss=False,
                use_dynamic_batch_size=False, max_tokens_per_gpu=None, micro_batch_size=1,
                balance_data=False, balance_by_flops=False)
    base.update(kw)
    return SimpleNamespace(**base)


def graded_batch(rewards, *, seed=0):
    """A batch of len(rewards) groups of G samples whose manifest advantages are the
    collector's (``group_advantages``, grpo); None is a failed sample."""
    n = len(rewards) * G
    rng = np.random.default_rng(seed)
    b = make_batch(rng.integers(2, 5, n).tolist(), rng.integers(1, 6, n).tolist(),
                   group_size=G, seed=seed)
    flat = []
    for summ, rs in zip(b.summaries, rewards, strict=True):
        summ["rewards"] = list(rs)
        summ["advantages"] = group_advantages(rs, "grpo", 1e-6)
        summ["status"] = ["failed" if r is None else "completed" for r in rs]
        flat += summ["advantages"]
    b.sample_advantages = torch.tensor(flat, dtype=torch.float32)
    b.rewards = torch.tensor([0.0 if r is None else r for rs in rewards for r in rs],
                             dtype=torch.float32)
    return b


def per_group_by_slime(rewards):
    """slime's own group normalisation, one full group at a time (its reshape path)."""
    out = []
    for rs in rewards:
        one = adapter.batch_to_samples(graded_batch([rs]))
        a = slime_args(custom_reward_post_process_path=None, rollout_batch_size=1)
        out += RolloutManager(a)._post_process_rewards(flatten(one))[1]
    return out


def test_a_failed_sample_reaches_slimes_reward_post_processing():
    rewards = [[1.0, 0.0, None, 1.0], [0.0, 0.0, 1.0, 0.5]]
    samples = flatten(adapter.batch_to_samples(graded_batch(rewards)))
    assert samples[2].reward is None and samples[2].status == slime_types.Sample.Status.FAILED
    default = RolloutManager(slime_args(custom_reward_post_process_path=None,
                                        rollout_batch_size=2))
    with pytest.raises(TypeError):  # slime's default cannot take a failed sample's reward
        default._post_process_rewards(samples)
    data = RolloutManager(slime_args(rollout_batch_size=2))._convert_samples_to_train_data(
        samples)
    manifest = [a for rs in rewards for a in group_advantages(rs, "grpo", 1e-6)]
    assert data["rewards"] == pytest.approx(manifest)
    assert data["rewards"][2] == 0.0  # the failed sample: no advantage, as recorded
    assert data["raw_reward"] == [0.0 if r is None else r for rs in rewards for r in rs]
    # the full group beside it is normalised as slime itself normalises a full group
    assert data["rewards"][4:] == pytest.approx(per_group_by_slime(rewards[1:]), abs=1e-5)


def test_a_short_batch_is_normalised_per_group():
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.2, 0.4, 0.6, 0.8]]
    samples = flatten(adapter.batch_to_samples(graded_batch(rewards)))  # 3 groups, 4 expected
    default = RolloutManager(slime_args(custom_reward_post_process_path=None))
    across = default._post_process_rewards(samples)[1]
    per_group = per_group_by_slime(rewards)
    assert not np.allclose(across, per_group, atol=1e-3)  # slime's default: one big group
    data = RolloutManager(slime_args())._convert_samples_to_train_data(samples)
    assert data["rewards"] == pytest.approx(per_group, abs=1e-5)


def test_generate_rollout_refuses_slimes_default_post_processing(tmp_path):
    a = SimpleNamespace(strawq_run=str(tmp_path / "nowhere"), rollout_batch_size=2,
                        custom_reward_post_process_path=None)
    with pytest.raises(ValueError, match="custom-reward-post-process-path"):
        adapter.generate_rollout(a, 0, None)
    assert not (tmp_path / "nowhere").exists()  # refused before opening anything


@pytest.mark.parametrize("bad, match", [
    (dict(advantage_estimator="ppo"), "advantage-estimator ppo"),
    (dict(advantage_estimator="reinforce_plus_plus"), "grpo, gspo, cispo"),
    (dict(normalize_advantages=True), "normalize-advantages")])
def test_settings_that_would_not_train_the_manifests_advantages_are_refused(bad, match):
    samples = flatten(adapter.batch_to_samples(graded_batch([[1.0, 0.0, 1.0, 0.0]])))
    with pytest.raises(ValueError, match=match):
        adapter.reward_post_process(slime_args(**bad), samples)


def test_samples_from_elsewhere_are_refused_with_a_reason():
    s = slime_types.Sample(tokens=[1, 2, 3], response_length=1, reward=1.0)
    with pytest.raises(ValueError, match="carries no strawq advantage"):
        adapter.reward_post_process(slime_args(), [s])


def _schedule(args, data):
    return build_dp_schedule(args, {"dp_size": 1, "cp_size": 1, "vpp_size": 1,
                                    "microbatch_group_size_per_vp_stage": 1},
                             [len(t) for t in data["tokens"]],
                             global_batch_size=args.global_batch_size,
                             rollout_indices=data["rollout_ids"])


@pytest.mark.parametrize("gbs", [8, 16])
def test_a_short_batch_fills_slimes_last_step_and_loses_no_sample(gbs):
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, None, 0.0], [0.2, 0.4, 0.6, 0.8]]
    args = slime_args(global_batch_size=gbs)
    groups = adapter.batch_to_samples(graded_batch(rewards))
    unpadded = RolloutManager(args)._convert_samples_to_train_data(flatten(groups))
    try:  # slime as it stands: the last, incomplete step is dropped (or there is none)
        parts = _schedule(args, unpadded)[0]
        assert sorted(i for p in parts for i in p) != list(range(12))
    except AssertionError as exc:
        assert "global_batch_size" in str(exc)
    added = adapter.pad_steps(groups, args)
    assert added == gbs - 12 % gbs and len(flatten(groups)) % gbs == 0
    data = RolloutManager(args)._convert_samples_to_train_data(flatten(groups))
    parts, _, _, sizes = _schedule(args, data)
    assert sorted(i for p in parts for i in p) == list(range(len(data["tokens"])))
    assert all(sum(m) == 0 for m in data["loss_masks"][12:])  # padding: no loss
    assert data["rewards"][12:] == [0.0] * added
    manifest = np.array([a for rs in rewards for a in group_advantages(rs, "grpo", 1e-6)])
    tail = 12 % gbs
    scale = np.ones(12)
    scale[12 - tail:] = gbs / tail  # slime divides each step by gbs: the padded step's
    assert data["rewards"][:12] == pytest.approx(manifest * scale)  # real samples make up
    assert np.mean(data["raw_reward"]) == pytest.approx(np.mean(data["raw_reward"][:12]))


def test_per_token_steps_count_only_loss_tokens():
    """--calculate-per-token-loss: slime counts max(loss tokens, 1) per sample; a step with
    k samples without a loss token (here the padding) is scaled by (N + k) / N."""
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, None, 0.0], [0.2, 0.4, 0.6, 0.8]]
    args = slime_args(global_batch_size=8, calculate_per_token_loss=True)
    groups = adapter.batch_to_samples(graded_batch(rewards))
    assert adapter.pad_steps(groups, args) == 4
    flat = flatten(groups)
    for start in (0, 8):
        step = flat[start:start + 8]
        n = sum(sum(s.loss_mask) for s in step if not s.remove_sample)
        empty = sum(1 for s in step if s.remove_sample or not sum(s.loss_mask))
        want = (n + empty) / n if empty else 1.0
        assert all(s.metadata["strawq"].get("advantage_scale", 1.0) == pytest.approx(want)
                   for s in step)
    assert flat[8].metadata["strawq"]["advantage_scale"] == pytest.approx(
        (sum(sum(s.loss_mask) for s in flat[8:12]) + 4) / sum(sum(s.loss_mask)
                                                              for s in flat[8:12]))


def test_a_full_batch_is_left_as_it_is():
    groups = adapter.batch_to_samples(graded_batch([[1.0, 0.0, 0.0, 0.0]] * 2))
    assert adapter.pad_steps(groups, slime_args(global_batch_size=8)) == 0
    assert adapter.pad_steps(groups, slime_args(global_batch_size=None)) == 0
    assert all("advantage_scale" not in s.metadata["strawq"] for s in flatten(groups))


def test_a_batch_sampled_at_another_temperature_is_refused():
    b = graded_batch([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    b.temperature = torch.full((8,), 0.6)
    adapter.check_temperature(b, SimpleNamespace(rollout_temperature=0.6))
    b.temperature[5] = 1.0
    with pytest.raises(ValueError, match=r"1 of 8 samples were sampled at temperature \[1.0\]"):
        adapter.check_temperature(b, SimpleNamespace(rollout_temperature=0.6))
    with pytest.raises(ValueError, match="rollout-temperature is 1.0"):
        adapter.check_temperature(b, SimpleNamespace())  # slime's default, 1.0
