"""The verl path against the single-process reference: a collector batch as verl's
``DataProto`` (``batch_to_dataproto``), trained by verl's own actor code — its padding
conversion, micro-batching, the FSDP engine's input/output preparation (labels rolled,
logits ÷ temperature, ``logprobs_from_logits``), ``ppo_loss`` with
``policy_loss.loss_mode=bypass_mode`` / ``loss_type=reinforce`` and verl's rollout
correction — gives the gradient of the documented objective on the same batch
(``strawq.testing.reference``; docs/design.md, invariant 11), on one rank and on real gloo
ranks. The failure cases show what each setting guards against: rank-local or wrong
denominators, a missing loss mask, verl's default PPO loss, the rejection-sampling bound's
direction, one temperature for a batch sampled at several.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'verl==0.9.1' "
                                   "(docs/verl.md)")

from strawq.collector.integrations.verl import reader as vr  # noqa: E402
from strawq.collector.trainer.bracket import WeightUpdateBracket  # noqa: E402
from strawq.collector.trainer.reader import Batch, BatchReader  # noqa: E402
from strawq.delivery.batches import BatchStore  # noqa: E402
from strawq.ondisk.groups import GroupData  # noqa: E402
from strawq.storage import open_storage  # noqa: E402
from strawq.tasks.queue import Lease, RunQueue  # noqa: E402
from strawq.testing import verl_train as vt  # noqa: E402
from strawq.testing.reference import (  # noqa: E402
    Objective,
    TinyPolicy,
    make_reference_run,
    max_relative_error,
    publish_batch,
    reference_gradients,
)
from strawq.weights.control import Control  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TOL = 1e-6
OBJECTIVES = [Objective(a, w) for a in ("token_mean", "seq_mean_token_sum",
                                        "seq_mean_token_mean")
              for w in ("tis", "icepop", "icepop_mask", "none")
              if not (a == "seq_mean_token_mean" and w == "icepop_mask")]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """One published batch, 6 groups × 4: mixed lengths and temperatures, top-k / top-p,
    loss-mask holes, three versions, off-policy log-probs."""
    return make_reference_run(str(tmp_path_factory.mktemp("verl")), groups=6, group_size=4,
                              seed=21, max_response=30)


Ref = tuple[float, dict[str, torch.Tensor]]


class _Refs(dict[Objective, Ref]):
    """The oracle per objective, computed on first use."""

    def __init__(self, run: tuple[str, int]) -> None:
        super().__init__()
        self.run = run

    def __missing__(self, obj: Objective) -> Ref:
        got = reference_gradients(*self.run, TinyPolicy(), objective=obj)
        self[obj] = got
        return got


@pytest.fixture(scope="module")
def refs(run: tuple[str, int]) -> _Refs:
    return _Refs(run)


def _batch(run_dir: str, seq: int) -> tuple[RunQueue, Batch]:
    q = RunQueue.open(open_storage(run_dir, writer_id="t"))
    reader = BatchReader(q, checkpointed=False, watch=None, sleep=lambda _s: None)
    try:
        return q, reader.load(BatchStore(q).read_manifest(seq))
    finally:
        reader.close()


def _step(run: tuple[str, int], obj: Objective, *, dp: int = 1, local: bool = False,
          data: Any = None, config: Any = None) -> dict[str, torch.Tensor]:
    """verl's actor ranks in one process; ``local``: each rank's own token count."""
    run_dir, seq = run
    data = data if data is not None else vt.driver_dataproto(run_dir, seq, balance_dp=dp)
    config = config or vr.verl_actor_config(obj, batch_samples=len(data))
    whole = int(data.batch["response_mask"].sum())
    model = TinyPolicy()
    for shard in data.chunk(dp):
        tokens = int(shard.batch["response_mask"].sum()) if local else whole
        vt.actor_step(model, shard, config, dp_size=dp, batch_num_tokens=tokens,
                      max_token_len_per_gpu=100)
    return {k: q.grad / dp for k, q in model.named_parameters() if q.grad is not None}


# -- the DataProto ---------------------------------------------------------------------------
@pytest.mark.slow
def test_dataproto_holds_each_record_in_verls_layout(run: tuple[str, int]) -> None:
    """Every row against its group record read straight from the queue: left-padded prompt,
    right-padded response, the loss mask, the engine's log-probs, per-token versions, the
    reward on the last response token, the manifest's advantage, the group as ``uid``."""
    run_dir, seq = run
    q, batch = _batch(run_dir, seq)
    data = vr.batch_to_dataproto(batch)
    b, nt = data.batch, data.non_tensor_batch
    width_p = b["prompts"].shape[1]
    man = BatchStore(q).read_manifest(seq)
    rows = {(str(u), i) for i, u in enumerate(nt["uid"])}
    assert len(rows) == len(data) == 24
    row = 0
    for name, summ in zip(batch.groups, batch.summaries, strict=True):
        g = q.read_group(name.id, name.gen)
        prompt = np.asarray(g.prompt_ids, dtype=np.int64)
        for i in range(g.num_samples):
            s = g.sample(i)
            toks = np.asarray(s["tokens"], dtype=np.int64)
            p, r = prompt.shape[0], toks.shape[0]
            assert nt["uid"][row] == name.id
            assert b["prompts"][row, width_p - p:].tolist() == prompt.tolist()
            assert b["attention_mask"][row, :width_p - p].sum() == 0
            assert b["responses"][row, :r].tolist() == toks.tolist()
            assert b["attention_mask"][row, width_p:].sum() == r
            assert b["response_mask"][row, :r].tolist() == np.asarray(s["loss_mask"]).tolist()
            assert b["response_mask"][row, r:].sum() == 0
            assert torch.equal(b["rollout_log_probs"][row, :r],
                               torch.tensor(np.asarray(s["logprobs"], np.float32)))
            assert torch.equal(b["old_log_probs"][row], b["rollout_log_probs"][row])
            assert b["versions"][row, :r].tolist() == np.asarray(s["versions"]).tolist()
            assert float(b["token_level_scores"][row].sum()) == pytest.approx(
                float(summ["rewards"][i]))
            if r:
                assert float(b["rm_scores"][row, r - 1]) == pytest.approx(summ["rewards"][i])
            adv = float(summ["advantages"][i])
            assert torch.allclose(b["advantages"][row, :r],
                                  torch.tensor(adv) * b["response_mask"][row, :r])
            pos = b["position_ids"][row, width_p - p:width_p + r]
            assert pos.tolist() == list(range(p + r))
            row += 1
    assert row == len(data)
    assert data.meta_info["strawq"]["total_samples"] == 24
    assert data.meta_info["strawq"]["total_loss_tokens"] == int(b["response_mask"].sum())
    assert [f"{g.id}:{g.gen}" for g in man.groups] == data.meta_info["strawq"]["groups"]
    # this run mixes temperatures: a per-sample column, no meta temperature
    assert "temperature" not in data.meta_info
    assert batch.temperature is not None
    assert b["temperature"].tolist() == batch.temperature.tolist()
    # verl's own padding conversion reads it back: response slices line up with the mask
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(data.to_tensordict())
    back = no_padding_2_padding(td["input_ids"], td)  # the token before each response token
    full = b["input_ids"]
    for k in range(len(data)):
        r = int(b["attention_mask"][k, width_p:].sum())
        if r:
            assert back[k, 0] == full[k, width_p - 1]


def test_extras_line_up_with_their_tokens() -> None:
    """``routed_experts`` in verl's layout (aligned with ``input_ids``, int16, −1 → 0), other
    per-token extras response-aligned as ``strawq_<name>``; ragged ones left out."""
    from tests.collector.integrations.conftest import make_batch

    b = make_batch([2, 3, 1], [4, 0, 2], group_size=3)
    t = b.num_tokens
    experts = torch.arange(t * 2 * 3, dtype=torch.int32).reshape(t, 2, 3)
    experts[-1] = -1
    teacher = -torch.arange(t, dtype=torch.float32) / 100
    b.extras = {"routed_experts": experts, "teacher_logprobs": teacher,
                "top_p_token_ids": torch.zeros(5, dtype=torch.int32),
                "top_p_token_offsets": torch.zeros(t + 1, dtype=torch.int64)}
    data = vr.batch_to_dataproto(b)
    re_, tl = data.batch["routed_experts"], data.batch["strawq_teacher_logprobs"]
    assert re_.dtype == torch.int16 and re_.shape == (3, 3 + 4, 2, 3)
    assert "strawq_top_p_token_ids" not in data.batch.keys()
    cu = b.cu_seqlens.tolist()
    for i, (p, r) in enumerate([(2, 4), (3, 0), (1, 2)]):
        seq = torch.arange(cu[i], cu[i + 1])
        assert torch.equal(re_[i, 3 - p:3 + r], experts[seq].clamp(min=0).to(torch.int16))
        assert torch.equal(tl[i, :r], teacher[seq[p:]])
        assert bool((tl[i, r:] == 0).all()) and bool((re_[i, :3 - p] == 0).all())
    assert data.non_tensor_batch["min_global_steps"].tolist() == [10, 11, 12]
    assert data.non_tensor_batch["uid"].tolist() == [b.groups[0].id] * 3


@pytest.mark.slow
def test_temperature_modes(run: tuple[str, int]) -> None:
    run_dir, seq = run
    _, batch = _batch(run_dir, seq)
    with pytest.raises(ValueError, match="temperature='tensor'"):
        vr.batch_to_dataproto(batch, temperature="meta")
    assert batch.temperature is not None
    one = dataclasses.replace(batch, temperature=torch.full_like(batch.temperature, 0.8))
    data = vr.batch_to_dataproto(one)
    assert data.meta_info["temperature"] == pytest.approx(0.8)
    assert "temperature" not in data.batch.keys()
    assert "temperature" in vr.batch_to_dataproto(one, temperature="tensor").batch.keys()
    vr.check_temperature(data, 0.8)
    with pytest.raises(ValueError, match="sampled at temperature 0.8"):
        vr.check_temperature(data, 1.0)
    with pytest.raises(ValueError, match="per-sample temperatures"):
        vr.check_temperature(vr.batch_to_dataproto(batch), 1.0)
    no_adv = vr.batch_to_dataproto(batch, advantages=False, old_log_probs=False)
    assert "advantages" not in no_adv.batch.keys() and "old_log_probs" not in no_adv.batch.keys()


# -- the equivalence -------------------------------------------------------------------------
#: one per aggregation, each with another importance weight (every pair: the slow sweep)
QUICK = [Objective("token_mean", "icepop_mask"), Objective("seq_mean_token_sum", "none"),
         Objective("seq_mean_token_mean", "icepop")]


@pytest.mark.parametrize("obj", [pytest.param(o, marks=[] if o in QUICK else
                                              [pytest.mark.slow]) for o in OBJECTIVES],
                         ids=lambda o: f"{o.aggregation}-{o.is_mode}")
@pytest.mark.slow
def test_verls_loss_on_one_rank_is_the_reference(run: tuple[str, int], refs: _Refs,
                                                 obj: Objective) -> None:
    run_dir, seq = run
    ref_loss, ref = refs[obj]
    loss, grads = vt.verl_path_gradients(run_dir, seq, TinyPolicy(), objective=obj,
                                         max_token_len_per_gpu=100)
    assert max_relative_error(grads, ref) <= TOL
    assert loss == pytest.approx(ref_loss, rel=1e-5)  # REINFORCE: the same surrogate


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_verls_dispatch_over_ranks_in_one_process(run: tuple[str, int], refs: _Refs,
                                                  dp: int) -> None:
    run_dir, seq = run
    for obj in (Objective("token_mean"), Objective("seq_mean_token_mean", "icepop")):
        _, grads = vt.verl_path_gradients(run_dir, seq, TinyPolicy(), objective=obj,
                                          dp_size=dp, max_token_len_per_gpu=60)
        assert max_relative_error(grads, refs[obj][1]) <= TOL


@pytest.mark.process
def test_gloo_ranks_equal_the_reference(run: tuple[str, int], refs: _Refs) -> None:
    """Real torch.distributed ranks: verl's token count all-reduced over the group, the
    gradients averaged (FSDP's mean)."""
    run_dir, seq = run
    objs = [Objective("token_mean"), Objective("seq_mean_token_sum", "icepop_mask"),
            Objective("seq_mean_token_mean")]
    got = vt.verl_distributed_gradients(run_dir, seq, world_sizes=(2, 4), objectives=objs,
                                        max_token_len_per_gpu=80, start_method="fork")
    assert set(got) == {(w, o) for w in (2, 4) for o in objs}
    for (w, obj), (loss, grads) in got.items():
        assert max_relative_error(grads, refs[obj][1]) <= TOL, (w, obj)
        assert loss == pytest.approx(refs[obj][0], rel=1e-5)


@pytest.mark.process
def test_gloo_ranks_in_verls_decoupled_mode(run: tuple[str, int], refs: _Refs) -> None:
    """verl's default mode: old_log_probs recomputed by the actor before the step, the IS
    weights against the rollout's computed on the driver
    (``compute_rollout_correction_and_add_to_batch``), the actor's ``vanilla`` PPO loss
    weighed by them: at ρ = 1 (the first mini-batch) its gradient is the objective's."""
    run_dir, seq = run
    objs = [Objective("token_mean", "icepop"), Objective("seq_mean_token_sum", "icepop_mask")]
    got = vt.verl_distributed_gradients(run_dir, seq, world_sizes=(1, 2), objectives=objs,
                                        max_token_len_per_gpu=80, mode="decoupled",
                                        start_method="fork")
    for (w, obj), (_loss, grads) in got.items():
        assert max_relative_error(grads, refs[obj][1]) <= TOL, (w, obj)
    obj = Objective("seq_mean_token_mean")
    _, grads = vt.verl_path_gradients(run_dir, seq, TinyPolicy(), objective=obj,
                                      mode="decoupled", dp_size=2, max_token_len_per_gpu=60)
    assert max_relative_error(grads, refs[obj][1]) <= TOL


@pytest.mark.slow
def test_verls_own_grpo_advantages_are_the_manifests(run: tuple[str, int], refs: _Refs) -> None:
    run_dir, seq = run
    mine = vt.driver_dataproto(run_dir, seq)
    theirs = vt.driver_dataproto(run_dir, seq, advantages="verl")
    assert (mine.batch["advantages"] - theirs.batch["advantages"]).abs().max() <= 1e-5
    obj = Objective("token_mean")
    _, grads = vt.verl_path_gradients(run_dir, seq, TinyPolicy(), objective=obj,
                                      advantages="verl")
    assert max_relative_error(grads, refs[obj][1]) <= TOL


# -- what each setting guards against --------------------------------------------------------
@pytest.mark.slow
def test_rank_local_token_counts_are_caught(run: tuple[str, int], refs: _Refs) -> None:
    obj = Objective("token_mean")
    assert max_relative_error(_step(run, obj, dp=4), refs[obj][1]) <= TOL
    assert max_relative_error(_step(run, obj, dp=4, local=True), refs[obj][1]) > 1e-2


def test_a_wrong_sample_denominator_is_caught(run: tuple[str, int], refs: _Refs) -> None:
    """``global_batch_size`` is the whole mini-batch's samples (ppo_mini_batch_size ×
    rollout_n): the per-rank count instead scales the gradient by the world size."""
    obj = Objective("seq_mean_token_sum")
    run_dir, seq = run
    data = vt.driver_dataproto(run_dir, seq, balance_dp=2)
    wrong = vr.verl_actor_config(obj, batch_samples=len(data) // 2)
    grads = _step(run, obj, dp=2, data=data, config=wrong)
    assert max_relative_error(grads, refs[obj][1]) > 0.5
    scaled = {k: g / 2 for k, g in grads.items()}
    assert max_relative_error(scaled, refs[obj][1]) <= TOL


def test_a_missing_loss_mask_is_caught(run: tuple[str, int], refs: _Refs) -> None:
    """``response_mask`` is strawq's loss mask (0 over tool output): a mask of every
    response token trains the holes too."""
    run_dir, seq = run
    obj = Objective("token_mean")
    data = vt.driver_dataproto(run_dir, seq)
    resp = data.batch["attention_mask"][:, data.batch["prompts"].shape[1]:]
    assert bool((resp != data.batch["response_mask"]).any())  # the run has holes
    data.batch["response_mask"] = resp.clone()
    assert max_relative_error(_step(run, obj, data=data), refs[obj][1]) > 1e-2


def test_verls_default_ppo_loss_is_not_the_objective(run: tuple[str, int], refs: _Refs) -> None:
    """With old_log_probs = the rollout's, verl's default ``vanilla`` loss is PPO's clipped
    ratio against the rollout policy, not the TIS-weighted policy gradient."""
    run_dir, seq = run
    obj = Objective("token_mean")
    data = vt.driver_dataproto(run_dir, seq)
    cfg = vr.verl_actor_config(obj, batch_samples=len(data))
    vanilla = dataclasses.replace(cfg, policy_loss=dataclasses.replace(
        cfg.policy_loss, loss_mode="vanilla"))
    assert max_relative_error(_step(run, obj, data=data, config=vanilla), refs[obj][1]) > 1e-2


def test_the_rejection_bound_is_on_the_inverse_ratio(run: tuple[str, int], refs: _Refs) -> None:
    """verl's ``token_k1`` bounds −log ρ: keeping ρ in [0.5, 5] is ``"0.2_2.0"``; the
    IcePop bounds written as they read (``"0.5_5.0"``) keep another set of tokens."""
    run_dir, seq = run
    obj = Objective("token_mean", "icepop_mask")
    data = vt.driver_dataproto(run_dir, seq)
    cfg = vr.verl_actor_config(obj, batch_samples=len(data))
    assert cfg.policy_loss.rollout_correction.rollout_rs_threshold == "0.2_2.0"
    rc = dataclasses.replace(cfg.policy_loss.rollout_correction, rollout_rs_threshold="0.5_5.0")
    naive = dataclasses.replace(cfg, policy_loss=dataclasses.replace(
        cfg.policy_loss, rollout_correction=rc))
    assert max_relative_error(_step(run, obj, data=data, config=naive), refs[obj][1]) > 1e-2


def test_one_temperature_for_a_mixed_batch_is_caught(run: tuple[str, int], refs: _Refs) -> None:
    run_dir, seq = run
    obj = Objective("token_mean")
    data = vt.driver_dataproto(run_dir, seq)
    data.batch["temperature"] = torch.ones(len(data))
    assert max_relative_error(_step(run, obj, data=data), refs[obj][1]) > 1e-2


@pytest.mark.slow
def test_objectives_verl_cannot_express_are_refused(run: tuple[str, int], refs: _Refs
                                                     ) -> None:
    with pytest.raises(ValueError, match="temperature only"):
        vr.verl_actor_config(Objective(truncated=True), batch_samples=4)
    with pytest.raises(ValueError, match="no exact verl equivalent"):
        vr.verl_actor_config(Objective("seq_mean_token_mean", "icepop_mask"), batch_samples=4)
    with pytest.raises(ValueError, match="decoupled mode"):
        vr.verl_actor_config(Objective("token_mean", "icepop_mask"), batch_samples=4,
                             mode="decoupled")
    # ...and it does differ: the rejection mask shrinks each sample's token-mean denominator
    obj = Objective("seq_mean_token_mean", "icepop_mask")
    run_dir, seq = run
    ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)[1]
    data = vt.driver_dataproto(run_dir, seq)
    cfg = vr.verl_actor_config(Objective("seq_mean_token_mean"), batch_samples=len(data))
    forced = dataclasses.replace(cfg, policy_loss=dataclasses.replace(
        cfg.policy_loss, rollout_correction=dataclasses.replace(
            cfg.policy_loss.rollout_correction, **vr.rollout_correction(obj))))
    assert max_relative_error(_step(run, obj, data=data, config=forced), ref) > 1e-3
    # decoupled: the driver's rejection mask shrinks the batch's token count
    obj = Objective("token_mean", "icepop_mask")
    data = vt.driver_dataproto(run_dir, seq, objective=obj, mode="decoupled",
                               model=TinyPolicy())
    cfg = vr.verl_actor_config(Objective("token_mean"), batch_samples=len(data),
                               mode="decoupled")
    assert max_relative_error(_step(run, obj, data=data, config=cfg), refs[obj][1]) > 1e-3


# -- the documented trainer ------------------------------------------------------------------
def _doc_trainer_code() -> str:
    text = (Path(__file__).resolve().parents[3] / "docs" / "verl.md").read_text("utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = [b for b in blocks if "StrawqTrainer = " in b]
    assert len(code) == 1, "docs/verl.md shows one StrawqTrainer"
    lines = str(code[0]).splitlines()
    end = next(i for i, ln in enumerate(lines) if ln.startswith("StrawqTrainer = "))
    return "\n".join(lines[:end + 1]) + "\n"  # the class; its use needs verl's objects


def _uniform_run(path: str) -> tuple[str, int]:
    """Two groups of two samples, all at temperature 0.8."""
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(0, 64, 4)] for _ in range(2)]

    def build(lease: Lease) -> GroupData:
        return GroupData(
            task_id=lease.task_id, index=int(lease.task["index"]),
            prompt_ids=np.asarray(lease.task["row"]["prompt"], np.int32), sample_lens=[3, 5],
            tokens=rng.integers(0, 64, 8).astype(np.int32),
            logprobs=np.full(8, -1.0, np.float32), versions=np.zeros(8, np.int64),
            loss_mask=np.ones(8, np.uint8), rewards=[0.0, 1.0], status=["completed"] * 2,
            meta={"params": [{"temperature": 0.8, "max_new_tokens": 5}] * 2})

    return publish_batch(path, prompts, 2, build)


def test_the_documented_trainer_reads_and_acks(tmp_path: Path) -> None:
    """The docs' ``StrawqTrainer`` (``strawq_trainer`` over verl's ``FullyAsyncTrainer``,
    a Ray actor class): its ``_fit_generate`` hands verl the collector's batch, refuses one
    sampled at another temperature than the trainer's, and its ``_fit_update_actor``
    (verl's, around the actor worker group's update, which needs GPUs and is left out
    here) acks the batch."""
    from omegaconf import OmegaConf
    from verl.protocol import DataProto

    namespace: dict[str, Any] = {}
    exec(compile(_doc_trainer_code(), "docs/verl.md", "exec"), namespace)  # noqa: S102
    cls = namespace["StrawqTrainer"].__ray_actor_class__
    run_dir, seq = _uniform_run(str(tmp_path))

    def trainer(temperature: float) -> Any:
        t = object.__new__(cls)  # verl's __init__ builds Ray worker groups
        t.attach_strawq(run_dir)
        t.timing_raw, t.metrics, t.global_steps = {}, {}, 1
        t.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
            "temperature": temperature}}, "trainer": {"critic_warmup": 0}})
        return t

    wrong = trainer(1.0)
    with pytest.raises(ValueError, match="sampled at temperature 0.8"):
        asyncio.run(wrong._fit_generate())
    wrong.strawq.close()
    t = trainer(0.8)  # a new reader: the unacked batch is delivered again
    data = asyncio.run(t._fit_generate())
    assert len(data) == 4 and data.meta_info["temperature"] == pytest.approx(0.8)
    assert data.meta_info["strawq"]["seq"] == seq and "gen" in t.timing_raw
    q = RunQueue.open(open_storage(run_dir, writer_id="check"))
    assert seq not in BatchStore(q).batch_seqs()[1]
    updated: list[int] = []

    def update_actor(batch: Any) -> Any:  # the actor worker group's update (GPUs)
        updated.append(len(batch))
        return DataProto(meta_info={"metrics": {}})

    t._update_actor = update_actor
    t._fit_update_actor(data)
    assert updated == [4]
    assert seq in BatchStore(q).batch_seqs()[1]  # acked after the step
    t.strawq.close()


# -- the weight-update bracket around verl's parameter sync ----------------------------------
class Manager:
    """In place of verl's CheckpointEngineManager (Ray actors, GPUs): its calling convention
    (verl's ``auto_await``), and what the run's control files say while it pushes."""

    def __init__(self, queue: RunQueue, fail: bool = False) -> None:
        from verl.utils.ray_utils import auto_await

        self.queue, self.fail = queue, fail
        self.seen: list[tuple[int | None, bool, int, int]] = []
        self.replicas = ["r0"]

        async def update_weights(global_steps: int | None = None) -> dict[str, int]:
            st = Control(self.queue.storage).state()
            self.seen.append((global_steps, st.paused, st.pause_version,
                              self.queue.current_version()))
            if self.fail:
                raise RuntimeError("push failed")
            return {"pushed": int(global_steps or 0)}

        self.update_weights = auto_await(update_weights)  # type: ignore[no-untyped-call]


def _queue(run: tuple[str, int]) -> RunQueue:
    return RunQueue.open(open_storage(run[0], writer_id="trainer"))


def test_parameter_sync_runs_inside_the_bracket(run: tuple[str, int]) -> None:
    q = _queue(run)
    v0 = q.current_version()
    trainer = type("T", (), {})()
    trainer.checkpoint_manager = Manager(q)
    sync = vr.hook_parameter_sync(trainer, WeightUpdateBracket(q, sleep=lambda _s: None))
    assert vr.hook_parameter_sync(trainer, sync.bracket) is sync  # idempotent
    assert trainer.checkpoint_manager.replicas == ["r0"]  # the rest is the manager's
    out = trainer.checkpoint_manager.update_weights(global_steps=7)  # plain call
    assert out == {"pushed": 7}
    assert sync.manager.seen == [(7, True, v0 + 1, v0)]  # paused for v0+1 while pushing
    assert q.current_version() == v0 + 1 and not Control(q.storage).state().paused

    async def loop() -> object:  # verl's async trainers await it
        return await trainer.checkpoint_manager.update_weights(global_steps=8)

    assert asyncio.run(loop()) == {"pushed": 8}
    assert q.current_version() == v0 + 2 and sync.manager.seen[-1][1:3] == (True, v0 + 2)


def test_a_failed_push_keeps_producers_paused(run: tuple[str, int]) -> None:
    q = _queue(run)
    v0 = q.current_version()
    sync = vr.StrawqParameterSync(Manager(q, fail=True),
                                  WeightUpdateBracket(q, sleep=lambda _s: None))
    with pytest.raises(RuntimeError, match="push failed"):
        sync.update_weights(global_steps=1)
    st = Control(q.storage).state()
    assert st.paused and st.pause_version == v0 + 1 and q.current_version() == v0
    sync.manager.fail = False
    sync.update_weights(global_steps=2)  # continues the open bracket, same version
    assert sync.manager.seen[-1][1:3] == (True, v0 + 1)
    assert q.current_version() == v0 + 1 and not Control(q.storage).state().paused


def test_parameter_sync_publishes_the_pushed_weights_fingerprint(run: tuple[str, int]) -> None:
    """``fingerprint(version)`` (plain or async) is published for the version before the
    bracket closes, and the engines are checked against it (issue 39)."""
    from strawq.producers.engines.launch import EngineOptions
    from strawq.producers.engines.sim_backend import sim_weights
    from strawq.producers.engines.testing import EngineThread
    from strawq.weights.fingerprint import Fingerprints, fingerprint_of

    q = _queue(run)
    v0 = q.current_version()
    engine = EngineThread(EngineOptions(kind="sim", weight_version=str(v0)))
    try:
        bracket = WeightUpdateBracket(q, sleep=lambda _s: None, engine_urls=[engine.url])
        right = fingerprint_of(sim_weights("sim"), dtype="float32")  # what the engine holds
        wrong = fingerprint_of(sim_weights("/other"), dtype="float32")
        asked: list[int] = []

        def label(v: int) -> None:  # verl's push sets no version: tell the engine
            req = urllib.request.Request(f"{engine.url}/update_weight_version", method="POST",
                                         data=json.dumps({"new_version": str(v)}).encode(),
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=5).read()

        def plain(v: int) -> Any:
            asked.append(v)
            return right

        sync = vr.StrawqParameterSync(Manager(q), bracket, after_push=label, fingerprint=plain)
        sync.update_weights(global_steps=1)
        book = Fingerprints(q.storage)
        assert asked == [v0 + 1] and book.get(v0 + 1) == right
        assert book.verdicts(v0 + 1)[engine.url].ok

        async def later(v: int) -> Any:
            return wrong

        sync.fingerprint = later
        sync.update_weights(global_steps=2)
        assert book.get(v0 + 2) == wrong and not book.verdicts(v0 + 2)[engine.url].ok
    finally:
        engine.stop()


def test_attach_strawq_passes_the_fingerprint_on(run: tuple[str, int]) -> None:
    from strawq.collector.integrations.verl.trainer import StrawqTrainerMixin

    q = _queue(run)
    t = type("T", (StrawqTrainerMixin,), {})()
    t.checkpoint_manager = Manager(q)

    def fingerprint(version: int) -> None:
        return None

    t.attach_strawq(BatchReader(q), fingerprint=fingerprint)
    sync = t.checkpoint_manager
    assert isinstance(sync, vr.StrawqParameterSync) and sync.fingerprint is fingerprint


def test_hooking_before_the_manager_exists_is_refused() -> None:
    with pytest.raises(ValueError, match="after init_workers"):
        vr.hook_parameter_sync(type("T", (), {"checkpoint_manager": None})(), None)  # type: ignore[arg-type]
