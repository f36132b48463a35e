"""The trainer side against the single-process reference (docs/design.md, invariant 11):
the reader's shards on real gloo ranks, averaged like DDP, give the whole batch's gradient
at every world size and in every ``aggregate_loss`` mode."""

from __future__ import annotations

import math

import pytest
import torch

from strawq.collector.trainer.importance import LOSS_AGG_MODES, LossTotals, aggregate_loss
from strawq.collector.trainer.reader import BatchReader
from strawq.delivery.batches import BatchStore
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from strawq.testing.reference import (
    Objective,
    PaddedPolicy,
    TinyPolicy,
    distributed_gradients,
    gradients,
    make_reference_run,
    max_relative_error,
    reader_loss,
    reference_gradients,
    reference_loss,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One published batch: 10 groups of 4, mixed lengths, temperatures, mask holes."""
    return make_reference_run(str(tmp_path_factory.mktemp("ref")), groups=10, group_size=4,
                              seed=7, max_response=48)


def _queue(run_dir: str) -> RunQueue:
    return RunQueue.open(open_storage(run_dir, writer_id="test"))


def _shards(run_dir: str, seq: int, world: int):
    q = _queue(run_dir)
    man = BatchStore(q).read_manifest(seq)
    out = []
    for r in range(world):
        reader = BatchReader(q, rank=r, world_size=world, checkpointed=False)
        out.append(reader.load(man))
        reader.close()
    return out


def test_reference_is_the_objective_by_hand(tmp_path):
    """The oracle itself on one group: −mean over samples of token means of w·A·logp, with
    logp at the recorded temperature, checked against a direct computation."""
    run_dir, seq = make_reference_run(str(tmp_path), groups=1, group_size=3, seed=3,
                                      max_response=12)
    q = _queue(run_dir)
    man = BatchStore(q).read_manifest(seq)
    g = q.read_group(man.groups[0].id, man.groups[0].gen)
    model = TinyPolicy()
    want = []
    p = g.prompt_ids.shape[0]
    for i in range(g.num_samples):
        s = g.sample(i)
        r = s["tokens"].shape[0]
        if r == 0:
            want.append(0.0)
            continue
        seqt = torch.cat([torch.tensor(g.prompt_ids, dtype=torch.int64),
                          torch.tensor(s["tokens"], dtype=torch.int64)])
        logits = model(seqt, torch.arange(p + r), torch.tensor([0, p + r]))[p - 1:p + r - 1]
        temp = g.meta["params"][i]["temperature"]
        logp = torch.log_softmax(logits / temp, -1).gather(
            -1, seqt[p:].unsqueeze(-1)).squeeze(-1)
        w = torch.exp(logp - torch.tensor(s["logprobs"])).clamp(max=2.0)
        m = torch.tensor(s["loss_mask"], dtype=torch.float32)
        adv = man.summaries[0]["advantages"][i]
        want.append(float((-(w * adv * logp * m).sum() / m.sum().clamp(min=1)).detach()))
    got = float(reference_loss(q, man, model))
    assert got == pytest.approx(sum(want) / len(want), rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_batch_carries_the_whole_batchs_denominators(run):
    run_dir, seq = run
    man = BatchStore(_queue(run_dir)).read_manifest(seq)
    samples = sum(len(s["sample_lens"]) for s in man.summaries)
    tokens = sum(sum(s["loss_tokens"]) for s in man.summaries)
    one = _shards(run_dir, seq, 1)[0]
    assert int(one.loss_mask.sum()) == tokens and one.num_samples == samples
    for b in _shards(run_dir, seq, 3):
        assert b.totals == LossTotals(total_samples=samples, total_loss_tokens=tokens,
                                      grad_ranks=3)


def test_rank_local_normalisation_is_what_the_global_one_fixes(run):
    """Finding 1 measured: the shard's own denominators (``aggregate_loss`` without totals,
    the former default) averaged over 4 ranks miss the whole batch's gradient by far more
    than rounding; the global form matches it."""
    run_dir, seq = run
    obj = Objective(aggregation="seq_mean_token_mean")
    _, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)
    local: dict[str, torch.Tensor] = {}
    glob: dict[str, torch.Tensor] = {}
    for b in _shards(run_dir, seq, 4):
        for store, use_totals in ((local, False), (glob, True)):
            model = TinyPolicy()
            loss = reader_loss(model, b, obj, scope="global" if use_totals else "local")
            loss.backward()
            for k, g in gradients(model).items():
                store[k] = store.get(k, torch.zeros_like(g)) + g / 4
    assert max_relative_error(glob, ref) <= TOL
    assert max_relative_error(local, ref) > 1e-2


def test_token_mean_without_counts_is_refused_across_ranks():
    x = torch.ones(4)
    m = torch.ones(4)
    with pytest.raises(ValueError, match="loss_tokens"):
        aggregate_loss(x, m, "token_mean", torch.tensor([0, 4]),
                       totals=LossTotals(total_samples=2, total_loss_tokens=None, grad_ranks=2))
    one = aggregate_loss(x, m, "token_mean", torch.tensor([0, 4]),
                         totals=LossTotals(total_samples=1, total_loss_tokens=None))
    assert float(one) == pytest.approx(1.0)


@pytest.mark.process
def test_gloo_ranks_equal_the_reference_at_world_sizes_2_and_4(run):
    """The CI check: real torch.distributed ranks (gloo, CPU), DDP-style mean of the
    gradients, every aggregation mode, against the single-process reference."""
    run_dir, seq = run
    objs = [Objective(aggregation=m) for m in LOSS_AGG_MODES]
    got = distributed_gradients(run_dir, seq, world_sizes=(2, 4), objectives=objs,
                                start_method="fork")
    for obj in objs:
        loss, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)
        for w in (2, 4):
            l_w, g_w = got[(w, obj)]
            assert math.isclose(l_w, loss, rel_tol=1e-5, abs_tol=1e-7), (w, obj)
            assert max_relative_error(g_w, ref) <= TOL, (w, obj)


@pytest.mark.process
def test_a_rank_with_an_empty_shard_still_matches(tmp_path):
    """3 groups over 4 ranks: one rank holds nothing and still steps with a zero loss."""
    run_dir, seq = make_reference_run(str(tmp_path), groups=3, group_size=2, seed=5)
    assert any(b.num_samples == 0 for b in _shards(run_dir, seq, 4))
    obj = Objective(aggregation="token_mean")
    got = distributed_gradients(run_dir, seq, world_sizes=(4,), objectives=[obj],
                                start_method="fork")
    _, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)
    assert max_relative_error(got[(4, obj)][1], ref) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("is_mode,truncated", [("tis", False), ("icepop", False),
                                               ("icepop_mask", True), ("none", True)])
def test_gloo_ranks_equal_the_reference_at_world_sizes_1_to_4(tmp_path, is_mode, truncated):
    run_dir, seq = make_reference_run(str(tmp_path), groups=16, group_size=4, seed=11,
                                      max_response=80)
    objs = [Objective(aggregation=m, is_mode=is_mode, truncated=truncated)
            for m in LOSS_AGG_MODES]
    got = distributed_gradients(run_dir, seq, world_sizes=(1, 2, 3, 4), objectives=objs)
    for obj in objs:
        _, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)
        for w in (1, 2, 3, 4):
            assert max_relative_error(got[(w, obj)][1], ref) <= TOL, (w, obj)


@pytest.mark.slow
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_demo_trainer_step_is_the_reference(run, tmp_path, mode):
    """``GRPOTrainer.train_step`` (padded layout, the recorded temperatures, TIS) takes the
    reference gradient, clipped to norm 1 as it clips."""
    from strawq.demo.trainer import GRPOTrainer

    run_dir, seq = run
    (batch,) = _shards(run_dir, seq, 1)
    model = PaddedPolicy()
    trainer = GRPOTrainer(model=model, workdir=str(tmp_path), engine_urls=[],  # type: ignore[arg-type]
                          lr=0.0, loss_agg=mode)
    out = trainer.train_step(batch)
    got = {k.removeprefix("inner."): g for k, g in gradients(model).items()}
    loss, ref = reference_gradients(run_dir, seq, TinyPolicy(),
                                    objective=Objective(aggregation=mode))
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values())))
    clipped = {k: g * min(1.0, 1.0 / (norm + 1e-6)) for k, g in ref.items()}
    assert out["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert max_relative_error(got, clipped) <= TOL


def test_truncated_scoring_is_finite_and_nan_never_agrees(run):
    """The reference batch's tokens are drawn under each sample's joint top-k / top-p cut,
    so scoring under that truncation is finite; a non-finite gradient never 'agrees'."""
    run_dir, seq = run
    loss, grads = reference_gradients(run_dir, seq, TinyPolicy(),
                                      objective=Objective(truncated=True, is_mode="icepop"))
    assert math.isfinite(loss)
    assert max_relative_error(grads, grads) == 0.0
    bad = {k: torch.full_like(g, float("nan")) for k, g in grads.items()}
    assert max_relative_error(bad, grads) == math.inf
