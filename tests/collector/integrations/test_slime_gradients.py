"""The slime path against a single-process reference: the loss and gradients slime's own
training code (its sample conversion with ``reward_post_process``, its
``compute_advantages_and_returns`` and ``loss_function``, Megatron's scaling) computes from
the samples ``generate_rollout`` hands it equal the documented objective's on the same batch
(docs/design.md, invariant 11).

The reference here is self-contained: it reads every group of the published manifest
straight from its record and reduces −Σ w·A·log π the documented way (``OBJECTIVE``), one
sample at a time. Where ``strawq.collector.reference`` is importable, its
``reference_gradients`` is compared as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.collector.integrations.conftest import SLIME_MISSING

pytest.importorskip("slime.utils.types", reason=SLIME_MISSING)
pytest.importorskip("megatron.core", reason="slime's loss code needs megatron-core")

from strawq.batches import BatchStore  # noqa: E402
from strawq.collector.config import CollectorConfig  # noqa: E402
from strawq.collector.core import Collector  # noqa: E402
from strawq.collector.importance import policy_logprobs  # noqa: E402
from strawq.collector.integrations.slime import slime_path_gradients  # noqa: E402
from strawq.collector.integrations.slime_train import slime_args  # noqa: E402
from strawq.config import QueueConfig  # noqa: E402
from strawq.dataset import Dataset  # noqa: E402
from strawq.groups import GroupData  # noqa: E402
from strawq.queue import RunQueue  # noqa: E402
from strawq.storage import open_storage  # noqa: E402

pytestmark = [pytest.mark.slime, pytest.mark.timeout(300)]
VOCAB = 32
TOL = 1e-5


@dataclass(frozen=True)
class Obj:
    """The documented objective's options (``strawq.collector.reference.Objective``)."""

    aggregation: str = "seq_mean_token_mean"
    is_mode: str = "tis"
    truncated: bool = False


class Policy(torch.nn.Module):
    """A small packed-sequence model: ``(tokens [N], positions [N], cu_seqlens [S+1]) ->
    logits [N, V]``, with a causal running mean inside each sequence (a misplaced boundary
    or label changes its gradient)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=g) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(128, 8, generator=g) * 0.1)
        self.mix = torch.nn.Parameter(torch.randn(8, 8, generator=g) * 0.3)
        self.out = torch.nn.Parameter(torch.randn(8, VOCAB, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        e = self.emb[tokens.long() % VOCAB]
        cu = cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
        seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        csum = torch.cat([e.new_zeros(1, 8, dtype=torch.float64), e.double().cumsum(0)])
        idx = torch.arange(tokens.shape[0])
        start = cu[:-1][seg]
        prefix = ((csum[idx + 1] - csum[start]) / (idx - start + 1).unsqueeze(1)).to(e.dtype)
        h = torch.tanh(e + self.pos[positions.long()] + prefix @ self.mix)
        out: torch.Tensor = h @ self.out
        return out


def make_run(path: str, *, groups: int = 6, group_size: int = 4, seed: int = 0,
             temperatures: tuple[float, ...] = (0.7,), empty: bool = False) -> tuple[str, int]:
    """One published batch: mixed lengths, loss-mask holes, three versions, rewards with
    GRPO advantages, a failed sample, recorded temperatures; every sample has a loss token,
    unless ``empty``: then some responses have none (length 0, or every token masked)."""
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    ds = os.path.join(path, "ds.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        for i in range(groups):
            f.write(json.dumps({"prompt": [int(x) for x in rng.integers(0, VOCAB,
                                                                          rng.integers(1, 6))],
                                "i": i}) + "\n")
    run_dir = os.path.join(path, "run")
    q = RunQueue.create(open_storage(run_dir, writer_id="setup", fsync=False),
                        QueueConfig(fsync=False, group_size=group_size, release_batch=groups))
    col = Collector(q, Dataset(ds), CollectorConfig(
        batch_groups=groups, max_running=groups, max_ready=groups, poll_interval_s=0,
        gc_interval_s=1e9))
    col.start(wait=False)
    col.step()
    done = 0
    while done < groups:
        leases = q.claim("test", groups)
        if not leases:
            col.step()
            continue
        for lease in leases:
            hi = 30 if rng.random() < 0.3 else 6
            lens = rng.integers(0 if empty else 1, hi + 1, group_size)
            total = int(lens.sum())
            mask = (rng.random(total) > 0.15).astype(np.uint8)
            if not empty:  # every sample has a loss token (see the per-token bias test)
                mask[np.cumsum(lens) - lens] = 1
            rewards: list[float | None] = [float(x) for x in rng.random(group_size).round(2)]
            status = ["completed"] * group_size
            if done == 1:
                rewards[2], status[2] = None, "failed"
            grp = GroupData(
                task_id=lease.task_id, index=int(lease.task["index"]),
                prompt_ids=np.asarray(lease.task["row"]["prompt"], np.int32),
                sample_lens=lens.tolist(), tokens=rng.integers(0, VOCAB, total).astype(np.int32),
                logprobs=np.log(rng.uniform(0.01, 1.0, total)).astype(np.float32),
                versions=rng.integers(0, 3, total).astype(np.int64),
                loss_mask=mask, rewards=rewards,
                status=status, meta={"params": [
                    {"temperature": float(rng.choice(temperatures)), "max_new_tokens": hi}
                    for _ in range(group_size)]})
            q.complete(lease, grp)
            done += 1
    col.step()
    seqs, _ = BatchStore(q).batch_seqs()
    assert seqs, "the collector published no batch"
    return run_dir, int(max(seqs))


def reference(run_dir: str, seq: int, model: torch.nn.Module, obj: Obj
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """The documented objective over the whole batch, from the group records."""
    q = RunQueue.open(open_storage(run_dir, writer_id="ref"))
    man = BatchStore(q).read_manifest(seq)
    sums, counts = [], []
    for name, summ in zip(man.groups, man.summaries, strict=True):
        g = q.read_group(name.id, name.gen)
        params = g.meta["params"]
        prompt = torch.from_numpy(g.prompt_ids.astype(np.int64))
        p = prompt.shape[0]
        for i in range(g.num_samples):
            s = g.sample(i)
            resp = torch.from_numpy(s["tokens"].astype(np.int64))
            r = resp.shape[0]
            mask = torch.from_numpy(s["loss_mask"].astype(np.float32))
            counts.append(float(mask.sum()))
            if r == 0:
                sums.append(torch.zeros(()))
                continue
            seq_t = torch.cat([prompt, resp])
            logits = model(seq_t, torch.arange(p + r), torch.tensor([0, p + r]))
            logp = policy_logprobs(logits[p - 1:p + r - 1], resp,
                                   float(params[i]["temperature"]))
            rho = torch.exp((logp - torch.from_numpy(s["logprobs"])).clamp(-20, 20)).detach()
            w = {"tis": rho.clamp(max=2.0), "none": torch.ones_like(rho),
                 "icepop": rho * ((rho >= 0.5) & (rho <= 5.0))}[obj.is_mode]
            adv = float(summ["advantages"][i])
            sums.append((-(w * adv * logp) * mask).sum())
    total, c = torch.stack(sums), torch.tensor(counts)
    if obj.aggregation == "token_mean":
        loss = total.sum() / c.sum().clamp(min=1.0)
    elif obj.aggregation == "seq_mean_token_sum":
        loss = total.sum() / len(sums)
    else:
        loss = (total / c.clamp(min=1.0)).sum() / len(sums)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss), {n: q.grad.detach().clone() for n, q in model.named_parameters()}


def rel_err(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((grads[n] - r).abs().max() / r.abs().max().clamp(min=1e-30))
               for n, r in ref.items())


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    return make_run(str(tmp_path_factory.mktemp("one_t")))


@pytest.mark.parametrize("obj", [Obj(m, w) for m in ("seq_mean_token_mean", "token_mean",
                                                    "seq_mean_token_sum")
                                 for w in ("tis", "icepop", "none")])
def test_slimes_loss_on_strawqs_samples_is_the_reference(batch_run: tuple[str, int],
                                                          obj: Obj) -> None:
    run_dir, seq = batch_run
    ref_loss, ref = reference(run_dir, seq, Policy(), obj)
    loss, grads = slime_path_gradients(run_dir, seq, Policy(), objective=obj)
    assert rel_err(grads, ref) <= TOL


def test_several_temperatures_one_micro_batch_each(tmp_path: object) -> None:
    run_dir, seq = make_run(str(tmp_path), temperatures=(0.6, 1.0, 1.2), seed=3)
    for obj in (Obj(), Obj("token_mean"), Obj("seq_mean_token_sum", "icepop")):
        ref_loss, ref = reference(run_dir, seq, Policy(1), obj)
        loss, grads = slime_path_gradients(run_dir, seq, Policy(1), objective=obj)
        assert rel_err(grads, ref) <= TOL


def test_samples_without_loss_tokens_leave_the_per_token_mean_exact(tmp_path: object
                                                                    ) -> None:
    """slime's --calculate-per-token-loss divides a step by Σ max(loss tokens, 1): each
    sample without a loss token adds 1. Uncorrected that scales the gradient by
    N / (N + k); the advantage scale pad_steps gives the step makes it exact."""
    from strawq.collector.integrations import slime as adapter

    run_dir, seq = make_run(str(tmp_path), empty=True, seed=5)
    q = RunQueue.open(open_storage(run_dir, writer_id="count"))
    man = BatchStore(q).read_manifest(seq)
    masks = [q.read_group(n.id, n.gen).sample(i)["loss_mask"] for n in man.groups
             for i in range(4)]
    n_tokens = sum(int(m.sum()) for m in masks)
    k = sum(1 for m in masks if int(m.sum()) == 0)
    assert k > 0
    for obj in (Obj("token_mean"), Obj(), Obj("seq_mean_token_sum")):
        _, ref = reference(run_dir, seq, Policy(), obj)
        _, grads = slime_path_gradients(run_dir, seq, Policy(), objective=obj)
        assert rel_err(grads, ref) <= TOL
    # without the scale: exactly slime's N / (N + k)
    real = adapter.pad_steps
    try:
        adapter.pad_steps = lambda groups, args: 0  # type: ignore[assignment]
        _, ref = reference(run_dir, seq, Policy(), Obj("token_mean"))
        _, grads = slime_path_gradients(run_dir, seq, Policy(), objective=Obj("token_mean"))
    finally:
        adapter.pad_steps = real  # type: ignore[assignment]
    assert rel_err(grads, ref) > 1e-3
    assert rel_err(grads, {n: g * n_tokens / (n_tokens + k) for n, g in ref.items()}) <= TOL


@pytest.mark.parametrize("obj, match", [(Obj(is_mode="icepop_mask"), "no slime equivalent"),
                                        (Obj(truncated=True), "rollout-temperature")])
def test_objectives_slime_cannot_express_are_refused(obj: Obj, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        slime_args(obj)


def test_the_shared_reference_agrees_where_it_is_importable(batch_run: tuple[str, int]
                                                            ) -> None:
    ref_mod = pytest.importorskip(
        "strawq.collector.reference",
        reason="strawq.collector.reference (the trainer side's oracle) is not in this tree")
    run_dir, seq = batch_run
    for m in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum"):
        obj = ref_mod.Objective(aggregation=m)
        ref_loss, ref = ref_mod.reference_gradients(run_dir, seq, Policy(), objective=obj)
        loss, grads = slime_path_gradients(run_dir, seq, Policy(), objective=obj)
        assert ref_mod.max_relative_error(grads, ref) <= TOL  # (the loss values differ:
        # slime's surrogate is -w·A·ρ at ρ = 1, the reference's -w·A·log π)
