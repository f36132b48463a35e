"""The slime adapters against slime's real classes (the project's pinned peer source).

slime's ``Sample`` (its ``append_response_tokens`` is how slime's own SGLang rollout
records a generation step, abort included), ``DataSource``, ``RolloutFnTrainOutput``,
``call_rollout_fn`` and ``validate_rollout_id_annotated`` are the real ones. What needs
SGLang engines or Megatron (slime's rollout manager, its HTTP rollout) is not run here.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.delivery.requeue import requeue_dropped
from strawq.delivery.retention import compact_drops, drop_totals, latest_audit
from strawq.errors import StrawqError, TaskNotFound
from strawq.ondisk import records
from strawq.ondisk.names import note_key, requeued_name
from strawq.tasks.states import DIRS, TaskState, move, names_in
from strawq.views.status import run_status
from strawq.weights.control import Control
from tests.collector.helpers import SimProducer, drive, make_run, write_dataset
from tests.collector.integrations.conftest import SLIME_MISSING, make_batch

slime_types = pytest.importorskip("slime.utils.types", reason=SLIME_MISSING)
from slime.observability.rollout_data_utils import validate_rollout_id_annotated  # noqa: E402
from slime.rollout.base_types import RolloutFnTrainOutput, call_rollout_fn  # noqa: E402
from slime.rollout.data_source import DataSource  # noqa: E402

from strawq.collector.integrations import slime as adapter  # noqa: E402
from strawq.collector.integrations.slime.adapter import _ReaderState  # noqa: E402
from strawq.testing.slime_train import RolloutManager, flatten  # noqa: E402

Sample = slime_types.Sample
pytestmark = pytest.mark.slime
G = 4


@pytest.fixture(autouse=True)
def _fresh_readers():
    yield
    for r in _ReaderState.readers.values():
        r.close()
    _ReaderState.readers.clear()
    _ReaderState.delivered.clear()


@pytest.fixture
def args(tmp_path):
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 12)
    return SimpleNamespace(n_samples_per_prompt=G, prompt_data=ds, input_key="prompt",
                           label_key=None, metadata_key=None, rollout_batch_size=2,
                           save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"),
                           strawq_run=str(tmp_path / "run"))


def _generate(sample, n: int, *, finish: str, version: int, args, seed: int = 0) -> None:
    """One SGLang call as slime's rollout records it (``Sample.append_response_tokens``)."""
    rng = np.random.default_rng(seed)
    sample.append_response_tokens(
        args, tokens=[int(x) for x in rng.integers(100, 200, n)],
        log_probs=[float(-x) for x in rng.random(n)], trainable=True,
        meta_info={"finish_reason": {"type": finish}, "weight_version": str(version)},
        text="x" * n)


def _where(ds, task_id: str) -> str:
    """The directory of a released task now; "trained" when it is in none (retired)."""
    try:
        return ds.queue.find(task_id)[0]
    except TaskNotFound:
        return "trained"


# -- mode 1: StrawqDataSource ------------------------------------------------------------------
def test_is_a_slime_data_source(args):
    ds = adapter.StrawqDataSource(args)
    assert isinstance(ds, DataSource)
    assert all(callable(getattr(ds, m)) for m in DataSource.__abstractmethods__)
    assert len(ds) == 12


def test_fresh_groups_come_from_the_cursor(args):
    ds = adapter.StrawqDataSource(args)
    groups = ds.get_samples(3)
    rows = [json.loads(line) for line in open(args.prompt_data)]
    assert [len(g) for g in groups] == [G] * 3
    for k, g in enumerate(groups):
        for j, s in enumerate(g):
            assert isinstance(s, Sample) and s.status == Sample.Status.PENDING
            assert s.group_index == k and s.index == k * G + j
            assert s.tokens == rows[k]["prompt"] and s.response_length == 0
            assert s.metadata["strawq"]["task_id"] == f"i{k:012d}"
    assert all(_where(ds, f"i{k:012d}") == "leased" for k in range(3))


def test_slimes_num_epoch_makes_the_runs_passes(args):
    args.num_epoch = 2
    ds = adapter.StrawqDataSource(args)
    assert ds.queue.config.num_epochs == 2
    rows = [json.loads(line) for line in open(args.prompt_data)]
    groups = ds.get_samples(len(rows) + 2)  # a whole pass, then into the second
    assert [g[0].tokens for g in groups] == [r["prompt"] for r in rows + rows[:2]]
    assert groups[-1][0].metadata["strawq"]["task_id"] == f"i{len(rows) + 1:012d}"
    args.num_epoch = 3  # the same run, restarted with another --num-epoch: refused
    with pytest.raises(ValueError, match="num-epoch is 3"):
        adapter.StrawqDataSource(args)


def test_aborted_groups_resume_with_prefix_logprobs_versions_and_masks(args):
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    g0, g1 = ds.get_samples(2)
    _generate(g0[0], 5, finish="stop", version=0, args=args)
    g0[0].reward = 1.0
    _generate(g0[1], 3, finish="abort", version=0, args=args, seed=1)
    for s in g0[2:]:
        s.status = Sample.Status.ABORTED  # aborted before its first request (slime's path)
    for s in g1:
        _generate(s, 2, finish="abort", version=0, args=args, seed=2)
    before = [[(list(s.tokens), s.response_length, list(s.rollout_log_probs or []),
                list(s.loss_mask or []), s.status, s.reward) for s in g] for g in (g0, g1)]
    ds.add_samples([g0, g1])
    pending = ds.queue.list_pending()
    assert sum(1 for k in pending if k.split("/")[-1].startswith("a")) == 2  # durable partials

    ds.begin_rollout(1)
    again = ds.get_samples(3)
    assert [g[0].metadata["strawq"]["task_id"] for g in again[:2]] == ["i000000000000",
                                                                      "i000000000001"]
    assert again[2][0].status == Sample.Status.PENDING  # then fresh work
    for g, was in zip(again[:2], before, strict=True):
        for s, (tokens, rlen, lps, mask, status, reward) in zip(g, was, strict=True):
            if rlen == 0:
                assert s.response_length == 0 and s.status == Sample.Status.ABORTED
                continue
            assert s.tokens == tokens and s.response_length == rlen
            assert s.loss_mask == mask
            assert np.allclose(s.rollout_log_probs, lps)
            assert s.status == status and s.reward == reward
            assert s.metadata["strawq"]["versions"] == [0] * rlen
            assert s.weight_versions == ["0"]
    # slime resumes the aborted ones (remaining budget) under version 1, aborts again
    s = again[0][1]
    _generate(s, 4, finish="abort", version=1, args=args, seed=3)
    ds.add_samples([again[0]])
    partial = names_in(ds.queue.storage, TaskState.PARTIAL)
    assert any(n.id == "i000000000000" for n in partial)
    ds.begin_rollout(2)
    (g,) = ds.get_samples(1)
    assert g[1].metadata["strawq"]["versions"] == [0] * 3 + [1] * 4  # per token, aligned
    assert g[1].response_length == 7 and len(g[1].rollout_log_probs) == 7
    assert g[1].weight_versions == ["0", "1"]


def test_save_records_trained_groups_and_load_resumes_after_a_crash(args):
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    trained0 = [g[0].metadata["strawq"]["task_id"] for g in ds.get_samples(2)]
    ds.save(0)
    assert all(_where(ds, t) == "trained" for t in trained0)
    assert os.path.exists(os.path.join(args.save, "rollout/strawq_data_source_0.json"))
    ds.begin_rollout(1)
    ga, gb = ds.get_samples(2)
    _generate(ga[0], 3, finish="abort", version=1, args=args)
    ds.add_samples([ga])  # partial, durable
    held = gb[0].metadata["strawq"]["task_id"]  # in slime's training when the job dies
    assert _where(ds, held) == "leased"
    del ds

    ds2 = adapter.StrawqDataSource(args)  # restarted from the checkpoint of rollout 0
    ds2.load(0)
    assert _where(ds2, held) == "pending"  # after the checkpoint: generated again
    ds2.begin_rollout(1)
    got = ds2.get_samples(3)
    ids = [g[0].metadata["strawq"]["task_id"] for g in got]
    assert ids[0] == ga[0].metadata["strawq"]["task_id"]  # the partial first, prefix kept
    assert got[0][0].response_length == 3
    assert held in ids and not set(trained0) & set(ids)  # nothing trained twice
    # every dataset index is in exactly one place
    seen = {}
    for state in (TaskState.PENDING, TaskState.PARTIAL, TaskState.LEASED, TaskState.DROPPED):
        for n in names_in(ds2.queue.storage, state):
            assert n.id not in seen
            seen[n.id] = state
    assert not set(trained0) & set(seen)  # trained: in no state
    assert set(ids) <= set(seen)


def test_save_retires_the_trained_leases_nothing_lands_in_dropped(args):
    """LEASED -> TRAINED: after slime's save, dropped/ is empty, no drop note is written,
    and neither the status nor the drop audit counts a drop."""
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    ids = [g[0].metadata["strawq"]["task_id"] for g in ds.get_samples(3)]
    ds.save(0)
    st = ds.queue.storage
    assert st.list(DIRS[TaskState.DROPPED]) == []
    assert not [k for k in st.list("data") if ".drop." in k]
    assert not names_in(st, TaskState.LEASED)
    assert drop_totals(st) == {}
    status = run_status(ds.queue)
    assert status.counts["dropped"] == 0 and status.dropped_by_reason == {}
    assert all(_where(ds, t) == "trained" for t in ids)


def test_a_lease_lost_before_save_is_not_recorded_as_trained(args, caplog):
    """Fenced: a lease the grantor expired (renamed away, gen + 1) is not retired by the
    old holder's save; the re-queued task stays queued."""
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    (g,) = ds.get_samples(1)
    tid = g[0].metadata["strawq"]["task_id"]
    (name,) = names_in(ds.queue.storage, TaskState.LEASED)
    new = requeued_name(name, refund=False)
    move(ds.queue.storage, name, TaskState.LEASED, TaskState.PENDING, new)  # expiry
    ds.save(0)
    assert _where(ds, tid) == "pending"
    assert "no longer held" in caplog.text


def test_an_older_runs_trained_drops_still_count_as_trained(args, monkeypatch):
    """A run an older strawq wrote: groups slime trained sit in dropped/ with reason
    ``trained`` (one of them already folded into the drop audit). They are not served again,
    not counted as drops, and ``strawq requeue --reason trained`` refuses them."""
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    old = [g[0].metadata["strawq"]["task_id"] for g in ds.get_samples(3)]
    leases = [h.lease for h in ds._held.values()]
    ds._held.clear()

    queue = ds.queue

    def old_save(lease):  # what save() did before LEASED -> TRAINED existed
        queue.drop(lease, "trained", "trained by slime; checkpoint of rollout 0",
                      summary={"rollout": 0, "index": lease.task["index"]})

    st = ds.queue.storage
    for lease in leases[:2]:
        old_save(lease)
    with monkeypatch.context() as m:  # an older compaction folded those two in
        import strawq.tasks.states as states

        m.setattr(states, "LEGACY_TRAINED", "not-a-reason", raising=False)
        assert compact_drops(st) == 2
    assert latest_audit(st).counts == {"trained": 2}
    old_save(leases[2])
    assert len(st.list(DIRS[TaskState.DROPPED])) == 1
    del ds

    ds2 = adapter.StrawqDataSource(args)
    ds2.load(0)
    ds2.begin_rollout(1)
    got = [g[0].metadata["strawq"]["task_id"] for g in ds2.get_samples(3)]
    assert not set(old) & set(got)  # never served again
    assert drop_totals(st) == {}
    assert run_status(ds2.queue).counts["dropped"] == 0
    assert all(_where(ds2, t) == "trained" for t in old)
    with pytest.raises(StrawqError, match="train them twice"):
        requeue_dropped(ds2.queue, "trained")


def test_a_trained_partial_leaves_no_prefix_payload(args):
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    (g,) = ds.get_samples(1)
    _generate(g[0], 3, finish="abort", version=0, args=args)
    ds.add_samples([g])
    ds.begin_rollout(1)
    (g,) = ds.get_samples(1)
    assert g[0].response_length == 3
    before = {k for k in ds.queue.storage.list("data") if k.endswith(".partial")}
    assert len(before) == 1
    ds.save(1)
    assert _where(ds, "i000000000000") == "trained"
    assert not [k for k in ds.queue.storage.list("data") if k.endswith(".partial")]


def test_load_of_a_later_checkpoint_counts_its_leases_as_trained(args):
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(3)
    tid = ds.get_samples(1)[0][0].metadata["strawq"]["task_id"]
    del ds  # crash after the model checkpoint of rollout 3, before the data source's save
    ds2 = adapter.StrawqDataSource(args)
    ds2.load(3)
    assert _where(ds2, tid) == "trained"
    assert not ds2.queue.storage.list(DIRS[TaskState.DROPPED])


def test_stock_rollout_without_tags_saves_everything_handed_out(args):
    ds = adapter.StrawqDataSource(args)
    first = [g[0].metadata["strawq"]["task_id"] for g in ds.get_samples(2)]
    ds.save(0)
    assert all(_where(ds, t) == "trained" for t in first)
    ds.get_samples(1)
    assert {n.producer for n in names_in(ds.queue.storage, TaskState.LEASED)} == {"slime.r1"}


def _finish(group, rewards, args, seed=0):
    """slime's rollout finishing every sample of a group (generation, then its reward)."""
    for k, (s, r) in enumerate(zip(group, rewards, strict=True)):
        _generate(s, 3, finish="stop", version=0, args=args, seed=seed + k)
        s.reward = r


def test_a_filter_reject_is_recorded_as_consumed_not_served_again(args):
    """slime's dynamic-sampling filter rejects a finished group: it is dropped with the
    filter's reason (in the drop audit), never handed out again; a group aborted without
    --partial-rollout goes back untouched; a finished group slime had no room for is kept
    and comes back finished (slime does not generate it again)."""
    args.reward_key = None
    args.dynamic_sampling_filter_path = (
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    trained, rejected, aborted, surplus = ds.get_samples(4)
    ids = [g[0].metadata["strawq"]["task_id"] for g in (trained, rejected, aborted, surplus)]
    _finish(trained, [1.0, 0.0, 1.0, 0.0], args)
    _finish(rejected, [1.0] * G, args)  # zero std: check_reward_nonzero_std rejects it
    _generate(aborted[0], 2, finish="abort", version=0, args=args)
    _finish(surplus, [0.0, 1.0, 0.0, 0.0], args, seed=7)
    ds.trained([trained])
    assert _where(ds, ids[1]) == "dropped"
    (name,) = [n for n in names_in(ds.queue.storage, TaskState.DROPPED) if n.id == ids[1]]
    assert name.producer == adapter.FILTERED
    note = records.decode(ds.queue.storage.read(note_key(ids[1], name.gen, "drop",
                                                         adapter.FILTERED)))
    assert "zero_std_1.0" in note.meta["message"]
    assert note.meta["summary"]["rewards"] == [1.0] * G
    assert drop_totals(ds.queue.storage) == {adapter.FILTERED: 1}
    assert _where(ds, ids[2]) == "pending"
    assert ids[3] in {n.id for n in names_in(ds.queue.storage, TaskState.PARTIAL)}
    ds.save(0)
    assert _where(ds, ids[0]) == "trained"
    ds.begin_rollout(1)
    again = ds.get_samples(3)
    got = [g[0].metadata["strawq"]["task_id"] for g in again]
    assert ids[1] not in got  # the rejected group is not served again
    assert got[0] == ids[3]  # the finished surplus first, as slime left it
    back = again[0]
    assert [s.status for s in back] == [Sample.Status.COMPLETED] * G
    assert [s.reward for s in back] == [0.0, 1.0, 0.0, 0.0]
    assert [s.tokens for s in back] == [s.tokens for s in surplus]
    assert ids[2] in got
    assert drop_totals(ds.queue.storage) == {adapter.FILTERED: 1}  # trained is no drop


def test_groups_neither_trained_nor_added_back_without_a_filter(args):
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    a, b, c, d = ds.get_samples(4)
    _finish(a, [1.0, 0.0, 1.0, 0.0], args)
    _finish(b, [1.0] * G, args)  # no filter: nothing rejects it
    _finish(d, [1.0, 0.0, 1.0, 0.0], args)
    d[1].status = Sample.Status.FAILED  # slime would generate it again: not kept
    ds.trained([a])
    assert b[0].metadata["strawq"]["task_id"] in {
        n.id for n in names_in(ds.queue.storage, TaskState.PARTIAL)}
    assert _where(ds, c[0].metadata["strawq"]["task_id"]) == "pending"  # never generated
    assert d[0].metadata["strawq"]["task_id"] not in {
        n.id for n in names_in(ds.queue.storage, TaskState.PARTIAL)}
    assert _where(ds, d[0].metadata["strawq"]["task_id"]) == "pending"
    ds.save(0)
    assert _where(ds, a[0].metadata["strawq"]["task_id"]) == "trained"


def test_samples_to_group_refuses_misaligned_samples(args):
    s = Sample(tokens=[1, 2], status=Sample.Status.ABORTED)
    _generate(s, 3, finish="abort", version=0, args=args)
    s.rollout_log_probs = s.rollout_log_probs[:-1]  # broken by hand
    with pytest.raises(Exception, match="logprobs|shape"):
        adapter.samples_to_group("i000000000000", 0, [s], version=0)


# -- per-token extras -------------------------------------------------------------------------
def test_extras_map_onto_sample_fields_and_slime_validates_them(args):
    s = Sample(tokens=[1, 2], status=Sample.Status.PENDING)
    _generate(s, 3, finish="stop", version=0, args=args)
    adapter.apply_extras(s, {"teacher_logprobs": np.array([-0.1, -0.2, -0.3]),
                             "top_p_token_ids": np.array([5, 6, 7, 8]),
                             "top_p_token_offsets": np.array([0, 1, 3, 4]),
                             "routed_experts": np.zeros((4, 2, 2), np.int32),
                             "mine": [1, 2, 3]})
    assert s.teacher_log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert s.rollout_top_p_token_offsets.tolist() == [0, 1, 3, 4]
    assert tuple(s.rollout_routed_experts.shape) == (4, 2, 2)
    assert s.metadata["strawq"]["extras"]["mine"] == [1, 2, 3]
    with pytest.raises(ValueError, match="offsets"):
        adapter.apply_extras(s, {"top_p_token_offsets": np.array([0, 1, 4])})


def _generate_with_extras(sample, n: int, *, finish: str, args, start: int = 0) -> None:
    """One SGLang call with R3 routing and top-p replay, as slime records it: routed rows
    for positions [start, len(tokens) − 1) (position j routes to (j, j + 50) in both
    layers), kept ids per new token."""
    first = len(sample.tokens)
    new = [100 + first + k for k in range(n)]
    total = first + n
    routed = [[[j, j + 50], [j, j + 50]] for j in range(start, total - 1)]
    kept = [[t, t + 1] for t in new]
    offsets = np.concatenate([[0], np.cumsum([len(k) for k in kept])]).tolist()
    sample.append_response_tokens(
        args, tokens=new, log_probs=[-0.5] * n, trainable=True,
        meta_info={"finish_reason": {"type": finish}, "weight_version": "0",
                   "routed_experts": routed, "routed_experts_start_len": start,
                   "top_p_kept_token_ids": [t for k in kept for t in k],
                   "top_p_kept_token_offsets": offsets})


def test_slimes_extras_survive_an_abort_and_a_resume_through_the_data_source(args):
    """R3 routed experts, top-p kept ids and teacher log-probs of an aborted group are
    saved in the partial record, given back, and slime's own resume appends to them."""
    args.num_layers, args.moe_router_topk = 2, 2
    ds = adapter.StrawqDataSource(args)
    ds.begin_rollout(0)
    (g,) = ds.get_samples(1)
    s = g[0]
    p = len(s.tokens)
    _generate_with_extras(s, 3, finish="abort", args=args)
    s.teacher_log_probs = [-1.0, -2.0, -3.0]
    for other in g[1:]:
        other.status = Sample.Status.ABORTED
    ds.add_samples([g])
    ds.begin_rollout(1)
    (back,) = ds.get_samples(1)
    r = back[0]
    assert r.tokens == s.tokens and r.response_length == 3
    assert r.rollout_routed_experts.tolist() == s.rollout_routed_experts.tolist()
    assert tuple(r.rollout_routed_experts.shape) == (p + 2, 2, 2)
    assert r.rollout_top_p_token_ids.tolist() == s.rollout_top_p_token_ids.tolist()
    assert r.rollout_top_p_token_offsets.tolist() == s.rollout_top_p_token_offsets.tolist()
    assert r.teacher_log_probs == [-1.0, -2.0, -3.0]
    assert back[1].rollout_routed_experts is None  # nothing generated: nothing restored
    # slime resumes it; its own merge keeps the restored rows before routed_experts_start_len
    _generate_with_extras(r, 2, finish="abort", args=args, start=p + 2)
    assert tuple(r.rollout_routed_experts.shape) == (p + 4, 2, 2)
    assert r.rollout_routed_experts[:, 0, 0].tolist() == list(range(p + 4))
    r.teacher_log_probs = None
    ds.add_samples([back])
    ds.begin_rollout(2)
    (last,) = ds.get_samples(1)
    t = last[0]
    assert t.rollout_routed_experts[:, 0, 0].tolist() == list(range(p + 4))
    assert t.rollout_top_p_token_offsets.tolist() == [0, 2, 4, 6, 8, 10]
    assert t.rollout_top_p_token_ids.tolist() == r.rollout_top_p_token_ids.tolist()
    assert t.teacher_log_probs is None
    t._validate_response_metadata_lengths()


def test_batch_to_samples_fields(args):
    batch = make_batch([2, 2, 3, 3], [3, 0, 4, 2], group_size=2)
    batch.versions[11] = 11  # sample 2's response (tokens 10..13) spans two versions
    groups = adapter.batch_to_samples(batch)
    assert [len(g) for g in groups] == [2, 2]
    s = groups[1][0]
    a, b = int(batch.cu_seqlens[2]), int(batch.cu_seqlens[3])
    assert s.tokens == batch.tokens[a:b].tolist() and s.response_length == 4
    assert s.loss_mask == batch.loss_mask[a + 3:b].tolist()
    assert s.metadata["strawq"]["versions"] == batch.versions[a + 3:b].tolist()
    assert s.metadata["strawq"]["versions"] == [12, 11, 12, 12]
    assert s.weight_versions == ["12", "11", "12"]  # one entry per run of equal versions
    assert s.group_index == 1 and s.index == 2 and s.reward == 0.0
    assert groups[0][1].response_length == 0 and groups[0][1].rollout_log_probs == []
    validate_rollout_id_annotated(groups)


# -- mode 2: strawq's producers, slime trains ---------------------------------------------------
@pytest.fixture
def world(tmp_path):
    run = str(tmp_path / "run")
    q = make_run(run, group_size=G)
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 24))
    col = Collector(q, ds, CollectorConfig(batch_groups=2, max_running=16, max_ready=16,
                                           max_prefetch_batches=3, poll_interval_s=0,
                                           gc_interval_s=0, max_staleness=None))
    col.start(wait=False)
    prods = [SimProducer(q, "p0", seed=1, max_new=(1, 9)), SimProducer(q, "p1", seed=2)]
    for _ in range(200):
        drive(col, prods, 1)
        if len(col.batches.batch_seqs()[0]) >= 3:
            break
    assert len(col.batches.batch_seqs()[0]) >= 3
    return SimpleNamespace(run=run, q=q, col=col, prods=prods, tmp=tmp_path)


@pytest.mark.timeout(120)
def test_generate_rollout_returns_the_collector_batch_as_samples(world):
    a = SimpleNamespace(strawq_run=world.run, rollout_batch_size=2, save=str(world.tmp / "c"),
                        load=None, custom_reward_post_process_path=adapter.REWARD_POST_PROCESS)
    out = call_rollout_fn(adapter.generate_rollout, a, 0, None, evaluation=False)
    assert isinstance(out, RolloutFnTrainOutput)
    validate_rollout_id_annotated(out.samples)
    ref = BatchReader(world.q).load(world.col.batches.read_manifest(1))
    assert out.metrics["strawq/batch_seq"] == 1
    flat = [s for g in out.samples for s in g]
    assert len(out.samples) == len(ref.groups) and len(flat) == ref.num_samples
    cu = ref.cu_seqlens.tolist()
    for i, s in enumerate(flat):
        a0, b0 = cu[i], cu[i + 1]
        p = int(ref.prompt_lens[i])
        assert s.tokens == ref.tokens[a0:b0].tolist()
        assert s.response_length == b0 - a0 - p
        assert s.loss_mask == ref.loss_mask[a0 + p:b0].tolist()
        assert np.allclose(s.rollout_log_probs, ref.rollout_logprobs[a0 + p:b0].numpy())
        assert s.metadata["strawq"]["versions"] == ref.versions[a0 + p:b0].tolist()
        assert s.reward == pytest.approx(float(ref.rewards[i]))
        assert s.status == Sample.Status.COMPLETED
        assert s.group_index == int(ref.sample_index[i])
        s._validate_response_metadata_lengths()  # slime's own alignment check
    # slime's own conversion trains the manifest's advantages (its reward post-processing)
    data = RolloutManager(a)._convert_samples_to_train_data(flatten(out.samples))
    assert data["rewards"] == pytest.approx(ref.sample_advantages.tolist())
    with pytest.raises(NotImplementedError, match="eval"):
        adapter.generate_rollout(a, 0, None, evaluation=True)
    call_rollout_fn(adapter.generate_rollout, a, 1, None, evaluation=False)
    assert 1 in world.col.batches.batch_seqs()[1]  # rollout 0's batch acked (lag 1)
    assert 2 not in world.col.batches.batch_seqs()[1]


@pytest.mark.timeout(120)
def test_weight_update_bracket_around_slimes_update(world):
    a = SimpleNamespace(strawq_run=world.run, rollout_batch_size=2, strawq_bracket_timeout_s=30,
                      custom_reward_post_process_path=adapter.REWARD_POST_PROCESS)
    adapter.generate_rollout(a, 0, None)
    stop = threading.Event()

    def producers() -> None:
        while not stop.is_set():
            for p in world.prods:
                p.step()
            time.sleep(0.01)

    t = threading.Thread(target=producers)
    t.start()
    try:
        adapter.begin_weight_update_hook(a, "/weights/v1", None)  # slime wrote the weights
        st = Control(world.q.storage).state()
        assert st.paused and set(st.acks) == {"p0", "p1"}
        assert not world.q.storage.list("leased")  # producers hold nothing while paused
    finally:
        stop.set()
        t.join()
    adapter.generate_rollout(a, 1, None)  # the engines have loaded them: bracket closed
    st = Control(world.q.storage).state()
    assert not st.paused and world.q.current_version() == 1


def _paused_by_the_hook(world, a, version_dir: str = "/weights/v1") -> None:
    """slime wrote new weights: the hook pauses strawq's producers (they ack meanwhile)."""
    stop = threading.Event()

    def producers() -> None:
        while not stop.is_set():
            for p in world.prods:
                p.step()
            time.sleep(0.01)

    t = threading.Thread(target=producers)
    t.start()
    try:
        adapter.begin_weight_update_hook(a, version_dir, None)
    finally:
        stop.set()
        t.join()


@pytest.mark.timeout(120)
def test_with_strawq_attest_the_hook_publishes_the_checkpoints_fingerprint(world):
    """``strawq_attest``: the hook publishes the fingerprint of the checkpoint slime wrote,
    and the next rollout closes the bracket after every engine was checked against it: the
    engine that loaded it passes; one that loaded other weights under the label fails
    (issue 39). A directory with no checkpoint is refused before producers are paused."""
    import asyncio

    st = pytest.importorskip("safetensors.torch")
    from strawq.producers.engines.launch import EngineOptions
    from strawq.producers.engines.testing import EngineThread
    from strawq.producers.engines.tiny_config import TinyConfig
    from strawq.producers.engines.tiny_model import init_model, save_weights
    from strawq.producers.sglang_client import SGLangClient
    from strawq.weights.engine_weights import EngineWeights
    from strawq.weights.fingerprint import Fingerprints

    tiny = TinyConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, context_length=64, seed=4)
    model = init_model(tiny)

    def checkpoint(name: str) -> str:
        """What slime writes for a disk update (here also the tiny engine's own format)."""
        d = world.tmp / name
        save_weights(model, d)
        st.save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                     str(d / "model.safetensors"))
        return str(d)

    def load(path: str, version: int) -> None:
        async def go() -> None:
            async with SGLangClient([engine.url]) as c:
                await c.push_weights(path, weight_version=version, url=engine.url)
        asyncio.run(go())

    v0 = checkpoint("v0")
    a = SimpleNamespace(strawq_run=world.run, rollout_batch_size=2, strawq_bracket_timeout_s=30,
                        custom_reward_post_process_path=adapter.REWARD_POST_PROCESS,
                        strawq_attest=True, strawq_attest_dtype="float32")
    engine = EngineThread(EngineOptions(kind="tiny", max_running=4, weight_version="0",
                                        model_path=v0, tiny=tiny))
    try:
        EngineWeights(world.q.storage).register(engine.url)  # as strawq's producers do
        adapter.generate_rollout(a, 0, None)
        with pytest.raises(ValueError, match="no safetensors checkpoint"):
            adapter.begin_weight_update_hook(a, str(world.tmp / "empty"), None)
        assert not Control(world.q.storage).state().paused
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        v1 = checkpoint("v1")
        _paused_by_the_hook(world, a, v1)
        book = Fingerprints(world.q.storage)
        assert book.get(1) is not None
        load(v1, 1)  # slime's engines load what it wrote
        adapter.generate_rollout(a, 1, None)
        assert world.q.current_version() == 1 and book.verdicts(1)[engine.url].ok
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        _paused_by_the_hook(world, a, checkpoint("v2"))
        load(v1, 2)  # the wrong directory under the right label
        adapter.generate_rollout(a, 2, None)
        assert world.q.current_version() == 2 and not book.verdicts(2)[engine.url].ok
        assert engine.url in EngineWeights(world.q.storage).needing()
    finally:
        engine.stop()


@pytest.mark.timeout(120)
def test_the_next_rollout_closes_the_bracket_by_what_the_engines_hold(world):
    """slime's push failed (its engine still reports version 0): the next rollout does not
    announce version 1, which every producer would take and then keep that engine out of
    rotation on; the update is undone. Once the engine holds it, it is announced."""
    from strawq.producers.engines.launch import EngineOptions
    from strawq.producers.engines.testing import EngineThread
    from strawq.weights.engine_weights import EngineWeights

    a = SimpleNamespace(strawq_run=world.run, rollout_batch_size=2, strawq_bracket_timeout_s=30,
                        custom_reward_post_process_path=adapter.REWARD_POST_PROCESS)
    engine = EngineThread(EngineOptions(kind="sim", weight_version="0"))
    try:
        EngineWeights(world.q.storage).register(engine.url)  # as strawq's producers do
        adapter.generate_rollout(a, 0, None)
        _paused_by_the_hook(world, a)
        adapter.generate_rollout(a, 1, None)  # the engine did not load the new weights
        st = Control(world.q.storage).state()
        assert not st.paused and world.q.current_version() == 0
        _paused_by_the_hook(world, a)  # the next update reaches the engine
        req = urllib.request.Request(f"{engine.url}/update_weight_version", method="POST",
                                     data=json.dumps({"new_version": "2"}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        adapter.generate_rollout(a, 2, None)
        assert world.q.current_version() == 2
    finally:
        engine.stop()


@pytest.mark.timeout(120)
def test_batch_source_ties_slime_checkpoints_to_the_reader(world):
    a = SimpleNamespace(strawq_run=world.run, rollout_batch_size=2,
                        save=str(world.tmp / "ckpt"), load=str(world.tmp / "ckpt"),
                        custom_reward_post_process_path=adapter.REWARD_POST_PROCESS)
    src = adapter.StrawqBatchSource(a)
    assert isinstance(src, DataSource)
    assert adapter.generate_rollout(a, 0, None).metrics["strawq/batch_seq"] == 1
    src.save(0)
    with open(os.path.join(a.save, "rollout/strawq_reader_0.json")) as f:
        assert json.load(f)["batch_seq"] == 1
    for r in _ReaderState.readers.values():  # the job dies before acking batch 1
        r.close()
    _ReaderState.readers.clear()
    _ReaderState.delivered.clear()
    src2 = adapter.StrawqBatchSource(a)
    src2.load(0)
    assert adapter.generate_rollout(a, 1, None).metrics["strawq/batch_seq"] == 2
    with pytest.raises(NotImplementedError):
        src2.get_samples(1)


@pytest.mark.timeout(120)
def test_batch_source_resumes_a_job_killed_between_slimes_two_saves(world):
    """slime's train.py saves the model checkpoint of rollout c, then calls the data
    source's save(c): a job killed between the two restarts from model checkpoint c
    (load(c)) and must not be given a batch that checkpoint already trained."""
    a = SimpleNamespace(strawq_run=world.run, rollout_batch_size=2,
                        save=str(world.tmp / "ckpt"), load=str(world.tmp / "ckpt"),
                        custom_reward_post_process_path=adapter.REWARD_POST_PROCESS)
    src = adapter.StrawqBatchSource(a)
    assert adapter.generate_rollout(a, 0, None).metrics["strawq/batch_seq"] == 1
    src.save(0)
    assert adapter.generate_rollout(a, 1, None).metrics["strawq/batch_seq"] == 2
    # trained; slime's model checkpoint of rollout 1 is written; the job dies before save(1)
    for r in _ReaderState.readers.values():
        r.close()
    _ReaderState.readers.clear()
    _ReaderState.delivered.clear()
    adapter.StrawqBatchSource(a).load(1)
    assert adapter.generate_rollout(a, 2, None).metrics["strawq/batch_seq"] == 3
    names = os.listdir(os.path.join(a.save, "rollout"))
    assert not [n for n in names if ".tmp." in n], names  # each state file written whole


def test_run_dir_comes_from_args_or_env(monkeypatch):
    monkeypatch.delenv("STRAWQ_RUN", raising=False)
    with pytest.raises(ValueError, match="STRAWQ_RUN"):
        adapter.run_dir(SimpleNamespace())
    monkeypatch.setenv("STRAWQ_RUN", "/x")
    assert adapter.run_dir(SimpleNamespace()) == "/x"
    assert adapter.run_dir(SimpleNamespace(strawq_run="/y")) == "/y"
    assert torch.__version__
