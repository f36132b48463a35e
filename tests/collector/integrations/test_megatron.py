"""The Megatron-core adapter against the real package: micro-batches under a token budget,
THD ``PackedSeqParams``, padding to the parallel multiples, the load-balanced CP split
(checked against Megatron's own ``get_batch_on_this_cp_rank``), next-token alignment, and
Megatron's ``vocab_parallel_cross_entropy`` run on the labels."""

from __future__ import annotations

import os
import socket
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.collector.integrations.conftest import make_batch

with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
    warnings.simplefilter("ignore")
    megatron_core = pytest.importorskip(
        "megatron.core", reason="megatron-core not installed: pip install 'strawq[megatron]'")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.utils import get_batch_on_this_cp_rank

from strawq.collector.integrations.megatron import (  # noqa: E402
    MegatronBatcher,
    MicroBatch,
    ParallelLayout,
    plan_micro_batches,
    sync_num_micro_batches,
)

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def gloo():
    """A one-process gloo group with Megatron's parallel state initialised (TP = CP = 1)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class _Group:
    """A process-group stand-in with a size and a rank, for the CP slicing oracle only."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _lengths(seed: int, n: int = 40) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return ([int(x) for x in rng.integers(1, 30, n)],
            [int(x) for x in rng.integers(0, 200, n)])


# -- planning --------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=0, max_size=60), st.integers(1, 700),
       st.sampled_from([1, 2, 4]), st.integers(1, 5))
def test_plan_is_contiguous_within_budget_and_minimal(lens, budget, mult, min_mb):
    parts = plan_micro_batches(lens, budget, seq_multiple=mult, min_micro_batches=min_mb)
    if not lens:
        assert parts == []
        return
    w = [-(-x // mult) * mult for x in lens]
    assert parts[0][0] == 0 and parts[-1][1] == len(lens)
    assert all(a < b for a, b in parts)
    assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
    for a, b in parts:  # over the budget only as a single, oversized sequence
        assert sum(w[a:b]) <= budget or b - a == 1
    # the fewest contiguous parts a greedy fill allows (a lower bound for any plan)
    greedy, load = 0, None
    for x in w:
        if load is None or load + x > budget:
            greedy, load = greedy + 1, x
        else:
            load += x
    assert len(parts) == max(greedy, min(min_mb, len(lens)))


def test_plan_balances_the_parts():
    lens = [100] * 10
    parts = plan_micro_batches(lens, 450)  # 3 parts needed; balanced: 4+3+3 or 3+4+3
    assert len(parts) == 3
    assert max(b - a for a, b in parts) == 4
    assert plan_micro_batches(lens, 450) == parts  # deterministic


def test_plan_gives_an_oversized_sequence_its_own_micro_batch(caplog):
    parts = plan_micro_batches([10, 500, 10], 100)
    assert parts == [(0, 1), (1, 2), (2, 3)]
    assert "exceeds the micro-batch budget" in caplog.text


def test_sync_num_micro_batches_without_a_group_is_identity():
    assert sync_num_micro_batches(3) == 3


# -- layout ----------------------------------------------------------------------------------
def test_layout_multiples_and_validation():
    assert ParallelLayout().seq_multiple == 1 and ParallelLayout().tail_multiple == 1
    assert ParallelLayout(cp_size=2).seq_multiple == 4
    assert ParallelLayout(cp_size=2, tp_size=2, sequence_parallel=True).seq_multiple == 8
    assert ParallelLayout(tp_size=4, sequence_parallel=True).tail_multiple == 4
    assert ParallelLayout(tp_size=4, sequence_parallel=True, pad_multiple=6).tail_multiple == 12
    with pytest.raises(ValueError, match="cp_rank"):
        ParallelLayout(cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="tp_size"):
        ParallelLayout(tp_size=0)


def test_layout_from_parallel_state(gloo):
    lay = ParallelLayout.from_parallel_state(pad_multiple=8)
    assert lay == ParallelLayout(tp_size=1, cp_size=1, cp_rank=0, sequence_parallel=False,
                                 pad_multiple=8)


# -- packing and alignment -------------------------------------------------------------------
def _check_alignment(batch, mbs: list[MicroBatch]) -> None:
    """Every sample's tokens in order; labels and per-token columns one step ahead."""
    seen = []
    cu = batch.cu_seqlens.tolist()
    loss_tokens = 0
    for mb in mbs:
        assert isinstance(mb.packed_seq_params, PackedSeqParams)
        assert mb.packed_seq_params.qkv_format == "thd"
        psp_cu = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
        assert psp_cu[-1] == mb.num_tokens  # no CP here: local = global
        for k, s in enumerate(mb.sample_ids.tolist()):
            seen.append(s)
            a, b = cu[s], cu[s + 1]
            o = psp_cu[k]
            n = b - a
            assert int(mb.packed_seq_params.cu_seqlens_q[k + 1]
                       - mb.packed_seq_params.cu_seqlens_q[k]) == n
            got = mb.tokens[0, o:o + n]
            assert torch.equal(got, batch.tokens[a:b])
            assert torch.equal(mb.labels[0, o:o + n - 1], batch.tokens[a + 1:b])
            for name in ("loss_mask", "rollout_logprobs", "versions", "advantages"):
                col = getattr(mb, name)[0, o:o + n - 1]
                assert torch.equal(col, getattr(batch, name)[a + 1:b]), name
            assert mb.loss_mask[0, o + n - 1] == 0  # a sequence's last position: never trained
            assert torch.equal(mb.position_ids()[0, o:o + n], torch.arange(n))
        pad = mb.tokens.shape[1] - int(mb.packed_seq_params.cu_seqlens_q[-1])
        assert pad >= 0
        loss_tokens += mb.num_loss_tokens()
    assert seen == list(range(batch.num_samples))
    assert loss_tokens == int(batch.loss_mask.sum())  # every trained token exactly once


def test_views_without_padding_are_aligned_and_zero_copy(gloo):
    p, r = _lengths(1)
    batch = make_batch(p, r, group_size=4)
    b = MegatronBatcher(max_tokens_per_gpu=600)
    mbs = b.micro_batches(batch)
    assert len(mbs) == len(b.plan(batch)) > 1
    _check_alignment(batch, mbs)
    for mb in mbs:
        assert mb.tokens.dtype == torch.int32 and mb.labels.dtype == torch.int32
        assert mb.loss_mask.dtype == torch.uint8 and mb.versions.dtype == torch.int64
        assert mb.num_tokens <= 600 or mb.num_samples == 1
    # not the shard's last micro-batch: views of the reader's tensors (no copy)
    assert mbs[0].tokens.untyped_storage().data_ptr() == \
        batch.tokens.untyped_storage().data_ptr()
    last = mbs[-1]
    assert last.labels[0, -1] == 0 and last.versions[0, -1] == -1


def test_sequence_parallel_tail_padding(gloo):
    p, r = _lengths(2)
    batch = make_batch(p, r)
    lay = ParallelLayout(tp_size=4, sequence_parallel=True, pad_multiple=16)
    mbs = MegatronBatcher(lay, max_tokens_per_gpu=700, pad_token_id=7).micro_batches(batch)
    _check_alignment(batch, mbs)
    for mb in mbs:
        psp = mb.packed_seq_params
        assert mb.num_tokens % 16 == 0
        real = int(mb.seqlens.sum())
        tail = mb.num_tokens - real
        if tail:  # the tail is one extra padding "sequence" in cu_seqlens
            assert psp.cu_seqlens_q.shape[0] == mb.num_samples + 2
            assert (mb.tokens[0, real:] == 7).all() and (mb.loss_mask[0, real:] == 0).all()
            assert (mb.versions[0, real:] == -1).all()
            assert torch.equal(mb.position_ids()[0, real:], torch.arange(tail))
        assert psp.max_seqlen_q == max(int(mb.padded_seqlens.max()), tail)


@pytest.mark.parametrize("cp,tp,sp", [(2, 1, False), (4, 1, False), (2, 2, True)])
def test_context_parallel_split_matches_megatron(gloo, cp, tp, sp):
    p, r = _lengths(3, n=12)
    batch = make_batch(p, r)
    extra = torch.arange(batch.num_tokens, dtype=torch.float32) * 0.5
    per_rank = []
    for rank in range(cp):
        lay = ParallelLayout(cp_size=cp, cp_rank=rank, tp_size=tp, sequence_parallel=sp)
        b = MegatronBatcher(lay, max_tokens_per_gpu=300, pad_token_id=5)
        per_rank.append(b.micro_batches(batch, extras={"teacher": extra}))
    # the padded, unsplit micro-batch every rank's part comes from (no CP)
    mult = 2 * cp * (tp if sp else 1)
    assert len({len(m) for m in per_rank}) == 1
    cu = batch.cu_seqlens.tolist()
    for i in range(len(per_rank[0])):
        mb0 = per_rank[0][i]
        psp = mb0.packed_seq_params
        assert int(psp.cu_seqlens_q_padded[-1]) == mb0.num_tokens * cp
        assert all(int(x) % mult == 0 for x in mb0.padded_seqlens)
        for rank in range(cp):
            mb = per_rank[rank][i]
            parts = {k: [] for k in ("tokens", "labels", "loss_mask", "versions", "teacher",
                                     "positions")}
            for k, s in enumerate(mb.sample_ids.tolist()):
                a, b_ = cu[s], cu[s + 1]
                n, pl = b_ - a, int(mb.padded_seqlens[k])
                full = {
                    "tokens": torch.full((pl,), 5, dtype=torch.int32),
                    "labels": torch.full((pl,), 5, dtype=torch.int32),
                    "loss_mask": torch.zeros(pl, dtype=torch.uint8),
                    "versions": torch.full((pl,), -1, dtype=torch.int64),
                    "teacher": torch.zeros(pl, dtype=torch.float32),
                    "positions": torch.arange(pl, dtype=torch.int64)}
                full["tokens"][:n] = batch.tokens[a:b_]
                nxt = min(b_ + 1, batch.num_tokens)
                full["labels"][:nxt - a - 1] = batch.tokens[a + 1:nxt]
                full["loss_mask"][:nxt - a - 1] = batch.loss_mask[a + 1:nxt]
                full["versions"][:nxt - a - 1] = batch.versions[a + 1:nxt]
                full["teacher"][:nxt - a - 1] = extra[a + 1:nxt]
                got = get_batch_on_this_cp_rank({k: v.view(1, -1) for k, v in full.items()},
                                                cp_group=_Group(cp, rank))
                for k in parts:
                    parts[k].append(got[k].view(-1))
            assert torch.equal(mb.tokens[0], torch.cat(parts["tokens"]))
            assert torch.equal(mb.labels[0], torch.cat(parts["labels"]))
            assert torch.equal(mb.loss_mask[0], torch.cat(parts["loss_mask"]))
            assert torch.equal(mb.versions[0], torch.cat(parts["versions"]))
            assert torch.equal(mb.extras["teacher"][0], torch.cat(parts["teacher"]))
            assert torch.equal(mb.position_ids()[0], torch.cat(parts["positions"]))
            assert mb.num_tokens <= 300 or mb.num_samples == 1
    # over the CP ranks, every trained token is scored exactly once
    total = sum(mb.num_loss_tokens() for mbs in per_rank for mb in mbs)
    assert total == int(batch.loss_mask.sum())


def test_extras_input_and_target_alignment(gloo):
    batch = make_batch([3, 2], [4, 5])
    experts = torch.arange(batch.num_tokens * 2, dtype=torch.int32).view(-1, 2)
    teacher = -torch.arange(batch.num_tokens, dtype=torch.float32)
    (mb,) = MegatronBatcher(max_tokens_per_gpu=100).micro_batches(
        batch, extras={"experts": experts, "teacher": teacher},
        extra_align={"experts": "input"})
    assert torch.equal(mb.extras["experts"][0], experts)
    assert torch.equal(mb.extras["teacher"][0, :-1], teacher[1:])
    with pytest.raises(ValueError, match="rows"):
        MegatronBatcher(max_tokens_per_gpu=100).micro_batches(
            batch, extras={"bad": teacher[:-1]})


def test_the_batchs_own_extras_by_default_routed_experts_with_the_inputs(gloo):
    batch = make_batch([3, 2], [4, 5])
    t = batch.num_tokens
    batch.extras = {"routed_experts": torch.arange(t * 4, dtype=torch.int32).view(t, 2, 2),
                    "teacher_logprobs": -torch.arange(t, dtype=torch.float32),
                    "top_p_token_ids": torch.arange(7, dtype=torch.int32),
                    "top_p_token_offsets": torch.zeros(t + 1, dtype=torch.int64)}
    (mb,) = MegatronBatcher(max_tokens_per_gpu=100).micro_batches(batch)
    assert set(mb.extras) == {"routed_experts", "teacher_logprobs"}  # ragged ids stay out
    assert torch.equal(mb.extras["routed_experts"][0], batch.extras["routed_experts"])
    assert torch.equal(mb.extras["teacher_logprobs"][0, :-1],
                       batch.extras["teacher_logprobs"][1:])


def test_a_sample_without_prompt_is_refused(gloo):
    batch = make_batch([2, 1], [3, 3])
    batch.loss_mask[5] = 1  # the second sample's first token marked trained
    with pytest.raises(ValueError, match="prompt"):
        MegatronBatcher(max_tokens_per_gpu=100).micro_batches(batch)


def test_min_micro_batches_and_to_device(gloo):
    batch = make_batch([2] * 6, [5] * 6)
    mbs = MegatronBatcher(max_tokens_per_gpu=1000).micro_batches(batch, min_micro_batches=4)
    assert len(mbs) == 4
    moved = mbs[0].to("cpu")
    assert torch.equal(moved.tokens, mbs[0].tokens)
    assert isinstance(moved.packed_seq_params, PackedSeqParams)


def test_megatron_cross_entropy_takes_the_labels(gloo):
    """Megatron's vocab-parallel loss runs on the int32 labels; masked by loss_mask."""
    batch = make_batch([3, 4, 2], [6, 2, 7])
    (mb,) = MegatronBatcher(max_tokens_per_gpu=100).micro_batches(batch)
    vocab = 2000
    logits = torch.randn(mb.num_tokens, 1, vocab, requires_grad=True)  # [s, b, v]
    labels = (mb.labels.t() - 1000).clamp(0, vocab - 1)
    ref = torch.nn.functional.cross_entropy(logits.detach()[:, 0], labels[:, 0].long(),
                                            reduction="none")  # before: Megatron works in place
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
    mask = mb.loss_mask.t().float()
    ((loss * mask).sum() / mask.sum()).backward()
    assert logits.grad is not None and loss.shape == (mb.num_tokens, 1)
    assert torch.allclose(loss.detach()[:, 0], ref, atol=1e-4)
    assert megatron_core.__version__ == "0.16.1"


# -- against the single-process reference (docs/design.md, invariant 11) ----------------------
@pytest.fixture(scope="module")
def ref_run(tmp_path_factory):
    from strawq.testing.reference import make_reference_run

    return make_reference_run(str(tmp_path_factory.mktemp("megref")), groups=10, group_size=4,
                              seed=13, max_response=40)


_LAYOUTS = [  # (dp, tp, cp, sequence_parallel, pad_multiple, max_tokens_per_gpu)
    (1, 1, 1, False, 1, 10_000),   # THD views, one micro-batch
    (2, 1, 1, False, 1, 48),       # THD views, several micro-batches per rank
    (1, 2, 1, True, 1, 64),        # sequence parallel: tail padding to TP
    (2, 1, 1, False, 8, 64),       # a padding multiple of your own
    (3, 1, 1, False, 128, 200),
    (1, 1, 2, False, 1, 40),       # the load-balanced CP split
    (2, 2, 2, True, 1, 64),
    (2, 1, 2, False, 8, 64),       # CP with a tail padding sequence
    (1, 1, 3, False, 16, 64),
    (4, 2, 3, True, 128, 300),
]


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,cp,sp,pad,budget", _LAYOUTS)
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_micro_batches_give_the_reference_gradient(ref_run, dp, tp, cp, sp, pad, budget, mode):
    """The Megatron path: reader shards over DP, ``MegatronBatcher`` micro-batches (THD
    ``PackedSeqParams``, padding, CP split) through a model that consumes the packed layout,
    summed per rank, averaged over DP × CP: the whole batch's gradient on one process."""
    from strawq.testing.reference import (
        Objective,
        TinyPolicy,
        max_relative_error,
        megatron_gradients,
        reference_gradients,
    )

    run_dir, seq = ref_run
    obj = Objective(aggregation=mode)
    loss, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)
    got_loss, got = megatron_gradients(run_dir, seq, TinyPolicy(), dp_size=dp, tp_size=tp,
                                       cp_size=cp, sequence_parallel=sp, pad_multiple=pad,
                                       max_tokens_per_gpu=budget, objective=obj)
    assert got_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert max_relative_error(got, ref) <= 1e-5


def test_tail_padding_under_cp_splits_into_chunks():
    """With CP and a padding multiple the tail is a padded sequence like the others: a
    multiple of 2·CP, cut into the same two chunks per rank (it lost positions before)."""
    lay = ParallelLayout(cp_size=3, pad_multiple=16)
    assert lay.tail_multiple == 48
    batch = make_batch([3, 4], [9, 10])
    parts = [MegatronBatcher(ParallelLayout(cp_size=3, cp_rank=r, pad_multiple=16),
                             max_tokens_per_gpu=1000).micro_batches(batch)[0] for r in range(3)]
    psp = parts[0].packed_seq_params
    total = int(psp.cu_seqlens_q_padded[-1])
    assert total % 48 == 0 and sum(mb.num_tokens for mb in parts) == total


def test_micro_batch_carries_the_sampling_parameters_per_label(gloo, ref_run):
    """Each label's temperature / top-p / top-k are its sample's recorded ones."""
    from strawq.collector.trainer.reader import BatchReader
    from strawq.delivery.batches import BatchStore
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    run_dir, seq = ref_run
    q = RunQueue.open(open_storage(run_dir, writer_id="t"))
    batch = BatchReader(q, checkpointed=False).load(BatchStore(q).read_manifest(seq))
    for lay in (ParallelLayout(), ParallelLayout(cp_size=2, cp_rank=1, pad_multiple=8)):
        for mb in MegatronBatcher(lay, max_tokens_per_gpu=64).micro_batches(batch):
            m = mb.loss_mask[0].bool()
            # this rank holds plens / CP tokens of each padded sequence, in order
            psp = mb.packed_seq_params
            plens = (psp.cu_seqlens_q_padded[1:] - psp.cu_seqlens_q_padded[:-1]).long()
            seq_of = torch.repeat_interleave(torch.arange(plens.numel()),
                                             plens // lay.cp_size)[:mb.num_tokens]
            sample = mb.sample_ids[seq_of.clamp(max=mb.num_samples - 1)]
            assert torch.equal(mb.temperature[0][m], batch.temperature[sample][m])
            assert torch.equal(mb.top_k[0][m], batch.top_k[sample][m])
            assert torch.equal(mb.top_p[0][m], batch.top_p[sample][m])


def test_on_policy_tokens_have_ratio_one_at_the_recorded_temperature(gloo):
    """Finding 2: a T = 0.6 rollout whose recorded log-probs are the policy's own. Scored at
    the micro-batch's temperature every trained token has ratio 1 (IcePop keeps all, TIS
    clips none); scored at T = 1, as the example did, IcePop masks many of them."""
    from strawq.collector.trainer.importance import icepop_mask, importance_ratios, policy_logprobs
    from strawq.testing.reference import TinyPolicy, positions_from_cu

    batch = make_batch([3, 5, 2, 4], [30, 25, 40, 12])
    model = TinyPolicy(vocab=64)
    batch.tokens = batch.tokens % 64
    n = batch.num_samples
    batch.temperature = torch.full((n,), 0.6)
    batch.top_p, batch.top_k = torch.ones(n), torch.full((n,), -1, dtype=torch.int32)
    cu = batch.cu_seqlens.long()
    with torch.no_grad():  # the engine's record: log_softmax(logits / 0.6) of each token
        logits = model(batch.tokens, positions_from_cu(cu), cu)
        lp = torch.log_softmax(logits[:-1] / 0.6, -1).gather(
            -1, batch.tokens[1:].long().unsqueeze(-1)).squeeze(-1)
    batch.rollout_logprobs = torch.cat([torch.zeros(1), lp]) * (batch.loss_mask > 0)
    for mb in MegatronBatcher(max_tokens_per_gpu=60).micro_batches(batch):
        with torch.no_grad():
            lg = model(mb.tokens[0], mb.position_ids()[0],
                       mb.packed_seq_params.cu_seqlens_q_padded)
        m = mb.loss_mask[0].bool()
        at_t = policy_logprobs(lg, mb.labels[0], mb.temperature[0])
        rho = importance_ratios(at_t, mb.rollout_logprobs[0])[m]
        assert torch.allclose(rho, torch.ones_like(rho), atol=1e-4)
        at_1 = policy_logprobs(lg, mb.labels[0])
        masked = 1 - icepop_mask(importance_ratios(at_1, mb.rollout_logprobs[0]))[m]
        assert float(masked.mean()) > 0.05


def test_megatron_cross_entropy_at_the_temperature_is_policy_logprobs(gloo):
    """The example's scoring: Megatron's vocab-parallel cross-entropy of logits / T equals
    ``policy_logprobs`` at the micro-batch's per-token temperature."""
    from strawq.collector.trainer.importance import policy_logprobs

    batch = make_batch([3, 4, 2], [6, 2, 7])
    batch.temperature = torch.tensor([0.6, 1.0, 0.8])
    (mb,) = MegatronBatcher(max_tokens_per_gpu=100).micro_batches(batch)
    vocab = 2000
    logits = torch.randn(mb.num_tokens, 1, vocab)
    labels = (mb.labels.t() - 1000).clamp(0, vocab - 1)
    t = mb.temperature.t().unsqueeze(-1)  # [s, 1, 1]
    nll = tensor_parallel.vocab_parallel_cross_entropy((logits / t).clone(), labels)
    want = policy_logprobs(logits[:, 0], labels[:, 0], mb.temperature[0])
    assert torch.allclose(-nll[:, 0], want, atol=1e-4)


class _PackedTiny(torch.nn.Module):
    """``TinyPolicy`` behind Megatron's calling convention: ``input_ids`` [1, t] and
    ``packed_seq_params`` in, logits [t, 1, V] out (CP = 1)."""

    def __init__(self) -> None:
        super().__init__()
        from strawq.testing.reference import TinyPolicy

        self.inner = TinyPolicy()

    def forward(self, input_ids, position_ids=None, attention_mask=None,
                packed_seq_params=None):
        from strawq.testing.reference import positions_from_cu

        cu = packed_seq_params.cu_seqlens_q_padded
        return self.inner(input_ids[0], positions_from_cu(cu), cu).unsqueeze(1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_the_example_train_step_gives_the_reference_gradient(gloo, ref_run, mode):
    """deploy/examples/megatron_trainer_loop.py's own ``train_step`` (Megatron's
    vocab-parallel cross-entropy at the recorded temperature, ``batch_loss`` per
    micro-batch, the DP × CP mean) on one rank: the whole batch's reference gradient."""
    import importlib.util
    from pathlib import Path

    from strawq.collector.trainer.reader import BatchReader
    from strawq.delivery.batches import BatchStore
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue
    from strawq.testing.reference import (
        Objective,
        TinyPolicy,
        gradients,
        max_relative_error,
        reference_gradients,
    )

    path = Path(__file__).resolve().parents[3] / "deploy" / "examples" / \
        "megatron_trainer_loop.py"
    spec = importlib.util.spec_from_file_location("megatron_trainer_loop", path)
    assert spec is not None and spec.loader is not None
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    run_dir, seq = ref_run
    q = RunQueue.open(open_storage(run_dir, writer_id="t"))
    batch = BatchReader(q, checkpointed=False).load(BatchStore(q).read_manifest(seq))
    model = _PackedTiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loop.train_step(model, opt, MegatronBatcher(max_tokens_per_gpu=64), batch, mode)
    got = {k.removeprefix("inner."): g for k, g in gradients(model).items()}
    _, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=Objective(
        aggregation=mode))
    assert max_relative_error(got, ref) <= 1e-5
