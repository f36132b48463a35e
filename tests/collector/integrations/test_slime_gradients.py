"""The slime path against a single-process reference: the loss and gradients slime's own
training code (its sample conversion with ``reward_post_process``, its
``compute_advantages_and_returns`` and ``loss_function``, Megatron's scaling) computes from
the samples ``generate_rollout`` hands it equal the documented objective's on the same batch
(docs/design.md, invariant 11).

The oracle is the project's one reference, ``strawq.testing.reference.reference_gradients``:
every group of the published manifest read straight from its record, −Σ w·A·log π reduced
the documented way, one sample at a time, in one process. (The loss values differ: slime's
surrogate is −w·A·ρ at ρ = 1, the reference's −w·A·log π; the gradients agree.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.collector.integrations.conftest import SLIME_MISSING

pytest.importorskip("slime.utils.types", reason=SLIME_MISSING)
pytest.importorskip("megatron.core", reason="slime's loss code needs megatron-core")

from strawq.delivery.batches import BatchStore  # noqa: E402
from strawq.ondisk.groups import GroupData  # noqa: E402
from strawq.storage import open_storage  # noqa: E402
from strawq.tasks.queue import Lease, RunQueue  # noqa: E402
from strawq.testing.reference import (  # noqa: E402
    Objective,
    max_relative_error,
    publish_batch,
    reference_gradients,
)
from strawq.testing.slime_train import (
    slime_args,  # noqa: E402
    slime_path_gradients,  # noqa: E402
)

# slime's loss is torch.compile'd: the first call in a process compiles with g++
pytestmark = [pytest.mark.slime, pytest.mark.process, pytest.mark.timeout(300)]
VOCAB = 32
TOL = 1e-5


Obj = Objective


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
    prompts = [[int(x) for x in rng.integers(0, VOCAB, rng.integers(1, 6))]
               for _ in range(groups)]
    built = 0

    def build(lease: Lease) -> GroupData:
        nonlocal built
        hi = 30 if rng.random() < 0.3 else 6
        lens = rng.integers(0 if empty else 1, hi + 1, group_size)
        total = int(lens.sum())
        mask = (rng.random(total) > 0.15).astype(np.uint8)
        if not empty:  # every sample has a loss token (see the per-token bias test)
            mask[np.cumsum(lens) - lens] = 1
        rewards: list[float | None] = [float(x) for x in rng.random(group_size).round(2)]
        status = ["completed"] * group_size
        if built == 1:
            rewards[2], status[2] = None, "failed"
        built += 1
        return GroupData(
            task_id=lease.task_id, index=int(lease.task["index"]),
            prompt_ids=np.asarray(lease.task["row"]["prompt"], np.int32),
            sample_lens=lens.tolist(), tokens=rng.integers(0, VOCAB, total).astype(np.int32),
            logprobs=np.log(rng.uniform(0.01, 1.0, total)).astype(np.float32),
            versions=rng.integers(0, 3, total).astype(np.int64),
            loss_mask=mask, rewards=rewards,
            status=status, meta={"params": [
                {"temperature": float(rng.choice(temperatures)), "max_new_tokens": hi}
                for _ in range(group_size)]})

    return publish_batch(path, prompts, group_size, build)


def reference(run_dir: str, seq: int, model: torch.nn.Module, obj: Objective
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """The oracle: the documented objective on the whole batch, from the group records."""
    return reference_gradients(run_dir, seq, model, objective=obj)


rel_err = max_relative_error


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    return make_run(str(tmp_path_factory.mktemp("one_t")))


@pytest.mark.parametrize("obj", [Obj(m, w) for m in ("seq_mean_token_mean", "token_mean",
                                                    "seq_mean_token_sum")
                                 for w in ("tis", "icepop", "none")])
@pytest.mark.process
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
        adapter.pad_steps = lambda groups, args, **_: 0  # type: ignore[assignment]
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




def _corrupt_one_group(run_dir: str, seq: int) -> str:
    """Overwrite the tail of the batch's second group record; returns its task id."""
    import os

    q = RunQueue.open(open_storage(run_dir, writer_id="corrupt"))
    victim = BatchStore(q).read_manifest(seq).groups[1]
    path = q.storage.local_path(f"data/{victim.id}~g{victim.gen}.group")
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    return victim.id


@pytest.mark.parametrize("obj", [Obj(), Obj("token_mean"), Obj("seq_mean_token_sum")])
def test_a_skipped_corrupt_group_stays_counted_as_on_the_other_paths(
        tmp_path: object, obj: Objective) -> None:
    """A group skipped at read time (corrupt record) stays in the manifest's totals: every
    real sample weighs 1 / total_samples (per token: 1 / total_loss_tokens) on the reader,
    Megatron and verl paths. slime's padded step weighed it 1 / (the samples read) before
    the padding counted the manifest's totals."""
    run_dir, seq = make_run(str(tmp_path), groups=2, group_size=4, seed=7)
    victim = _corrupt_one_group(run_dir, seq)
    _, ref = reference_gradients(run_dir, seq, Policy(), objective=obj, skip={victim})
    _, grads = slime_path_gradients(run_dir, seq, Policy(), objective=obj)
    assert rel_err(grads, ref) <= TOL
