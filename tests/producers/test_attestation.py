"""Attestation end to end on the local engines: an engine that loaded the wrong checkpoint
under the right version label fails its check after the bracket's push, is kept out of the
producers' rotation (it generates nothing until repaired), noted in engines/, repaired by
the trainer's push path, checked again and put back; and the guard refuses a reply on the
run's version from an engine that failed (strawq.weights.fingerprint)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.demo.trainer import GRPOTrainer
from strawq.producers.engine_versions import StaleEngine, VersionGuard
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import sim_weights
from strawq.producers.engines.testing import EngineThread
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.metrics import producer_values
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.engines.tiny_model import init_model
from strawq.storage import MemoryStorage
from strawq.tasks.queue import RunQueue
from strawq.weights.engine_weights import EngineWeights
from strawq.weights.fingerprint import Fingerprints, Verdict, attest, fingerprint_of
from tests.producers.helpers import run_producers, wait_for
from tests.producers.test_engine_versions import (
    PHASE,
    TINY,
    _reply,
    phased_run,
    port_of,
    producer,
    release,
    sim,
    versions_by_index,
)

pytestmark = pytest.mark.timeout(180)


def tiny(path: str, version: str, port: int = 0) -> EngineThread:
    return EngineThread(EngineOptions(kind="tiny", max_running=16, weight_version=version,
                                      model_path=path, tiny=TINY), port=port)


def generated_tokens(url: str) -> int:
    with urllib.request.urlopen(f"{url}/strawq/live_requests", timeout=5) as r:
        return int(json.loads(r.read())["generated_tokens"])


async def push(url: str, path: str, version: int) -> None:
    async with SGLangClient([url]) as c:
        await c.push_weights(path, weight_version=version, url=url)


@pytest.mark.parametrize("hold", [None, False], ids=["hold-default", "park"])
def test_wrong_checkpoint_under_the_right_label_generates_nothing_until_repaired(
        tmp_path: Path, hold: bool | None) -> None:
    """Held through the pause (the default), a group goes on only once the probe after the
    resume took the failed engine out of rotation (it sent it requests before); parked, its
    claim comes after that probe."""
    run_dir = str(tmp_path / "run")
    q = phased_run(run_dir, 3 * PHASE, 0)
    trainer = GRPOTrainer(init_model(TINY), str(tmp_path / "weights"), [])
    v0 = trainer.save(0)
    good, bad = tiny(v0, "0"), tiny(v0, "0")
    trainer.engine_urls = [good.url, bad.url]
    bracket = WeightUpdateBracket(q, lease_timeout_s=3.0, poll_interval_s=0.02)
    notes = EngineWeights(q.storage)
    p = producer(run_dir, (good.url, bad.url), hold=hold)
    seen: dict[str, int] = {}

    async def body() -> None:
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) >= PHASE // 2, 60, "phase 1")
        with torch.no_grad():  # the trainer's step: version 1's weights differ from v0's
            trainer.model.norm.weight.mul_(1.05)
        await asyncio.to_thread(bracket.begin_weight_update, 30.0)
        bracket.publish_fingerprint(1, fingerprint_of(trainer.model.state_dict(),
                                                      dtype="float32"))
        v1 = trainer.save(1)
        await push(good.url, v1, 1)
        await push(bad.url, v0, 1)  # the fault: the old checkpoint, labelled version 1
        seen["wrong"] = generated_tokens(bad.url)
        await asyncio.to_thread(bracket.end_weight_update, 1)
        verdicts = Fingerprints(q.storage).verdicts(1)
        assert verdicts[good.url].ok and not verdicts[bad.url].ok
        assert bad.url in bracket.engines_needing_weights()
        await wait_for(lambda: bad.url in p.guard.stale, 30, "the engine out of rotation")
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) >= 2 * PHASE, 60, "phase 2")
        seen["repair"] = generated_tokens(bad.url)
        assert await asyncio.to_thread(bracket.repair_engines,
                                       trainer.repair_engines) == [bad.url]
        assert Fingerprints(q.storage).verdicts(1)[bad.url].ok
        await wait_for(lambda: p.guard.serves(bad.url), 30, "the engine back in rotation")
        assert not notes.notes()
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) == 3 * PHASE, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
    finally:
        good.stop()
        bad.stop()
    assert seen["repair"] == seen["wrong"], \
        f"{seen['repair'] - seen['wrong']} tokens generated on the wrong checkpoint"
    late = {i: v for i, v in versions_by_index(q).items() if i >= PHASE and v != {1}}
    assert not late, f"groups released after the update with other versions: {late}"
    st = p.stats()
    assert st.engines_marked_stale == 1 and st.engines_restored == 1
    # through the collector and the reader: every group is trained, and every token of a
    # group released after the update is version 1's, generated on attested weights
    trained = _train_all(q, run_dir, 3 * PHASE)
    assert sorted(trained) == list(range(3 * PHASE))
    assert all(trained[i] == {1} for i in range(PHASE, 3 * PHASE))
    m = bracket.attestation_metrics()
    assert m["attest/failures_total"] == 1 and m["attest/checks_total"] >= 3


def _train_all(q: RunQueue, run_dir: str, n: int) -> dict[int, set[int]]:
    """Batch every ready group (the collector) and read the batches (the trainer's reader);
    returns dataset index -> the versions of its trained response tokens."""
    col = Collector(q, Dataset(f"{run_dir}/dataset.jsonl"), CollectorConfig(
        batch_groups=PHASE, max_running=n, max_ready=n, poll_interval_s=0, gc_interval_s=1e9))
    col.start(wait=False)
    reader = BatchReader(q, rank=0, world_size=1)
    out: dict[int, set[int]] = {}
    try:
        for _ in range(n // PHASE):
            col.step()
            batch = reader.next_batch(timeout=30)
            cu = batch.cu_seqlens.tolist()
            for i, idx in enumerate(batch.sample_index.tolist()):
                span = batch.versions[cu[i]:cu[i + 1]]
                out.setdefault(int(idx), set()).update(int(v) for v in span[span >= 0])
            reader.ack(batch)
    finally:
        reader.close()
        col.close()
    return out


class _Client:
    worker_urls = ["http://e1"]
    router_url = None


def test_a_reply_on_the_run_version_from_an_engine_that_failed_is_refused() -> None:
    st = MemoryStorage()
    st.makedirs("versions")
    st.publish("versions/v000000000002", b"")
    book = Fingerprints(st)
    fp = fingerprint_of({"x": [1.0, 2.0]}, dtype="float32")
    book.publish(2, fp)
    counts = ProducerStats()
    stats = StatsBook(counts)

    async def io(fn):  # type: ignore[no-untyped-def]
        return fn()

    guard = VersionGuard("p1", client=lambda: _Client(),  # type: ignore[arg-type,return-value]
                         current_version=lambda: 2, notes=EngineWeights(st), io=io,
                         pausing=lambda: False, book=stats)

    async def main() -> None:
        book.record(Verdict("http://e1", 2, True, fp.digest, fp.digest, at=1.0))
        await guard.check(_reply(2, [2, 2, 2]))  # attested: applied
        book.record(Verdict("http://e1", 2, False, "other", fp.digest, at=2.0))
        guard.expected = None  # the next reply is judged afresh (as after a version change)
        with pytest.raises(StaleEngine, match="failed attestation"):
            await guard.check(_reply(2, [2, 2, 2]))
        assert not guard.serves("http://e1")
        with pytest.raises(StaleEngine):  # out of rotation: even the fast path refuses it
            await guard.check(_reply(2, [2, 2]))

    asyncio.run(main())
    assert counts.attestation_refused_replies == 2
    assert counts.attestation_refused_tokens == 5
    assert producer_values(counts.to_dict())["producer/attestation_refused_replies_total"] == 2
    assert EngineWeights(st).needing()["http://e1"].reason.startswith("failed attestation")


def test_a_joining_engine_is_checked_before_its_notes_go_and_only_a_failing_one_is_pushed(
        tmp_path: Path) -> None:
    q = phased_run(str(tmp_path / "run"), 0, 1)
    Fingerprints(q.storage).publish(1, fingerprint_of(sim_weights("/w/v1"), dtype="float32"))
    right, wrong = sim("1"), sim("1")  # both claim version 1; only one loaded its weights
    notes = EngineWeights(q.storage)
    pushed: list[list[str]] = []

    def push_to(urls: list[str], version: int) -> None:
        pushed.append(urls)
        for u in urls:
            asyncio.run(push(u, "/w/v1", version))

    try:
        asyncio.run(push(right.url, "/w/v1", 1))
        for e in (right, wrong):  # as a producer notes an engine it found unchecked
            notes.mark(e.url, writer="p1", engine_version=1, run_version=1,
                       reason="not attested at version 1")
        assert WeightUpdateBracket(q).repair_engines(push_to) == [wrong.url]
    finally:
        right.stop()
        wrong.stop()
    assert pushed == [[wrong.url]]  # the right one passed its check: no push
    verdicts = Fingerprints(q.storage).verdicts(1)
    assert verdicts[right.url].ok and verdicts[wrong.url].ok and not notes.notes()


def test_the_demo_trainers_fingerprint_attests_the_engines_it_pushed_to(
        tmp_path: Path) -> None:
    """``GRPOTrainer.fingerprint()`` (what the demo's schedule publishes after each push) is
    what a tiny engine serves once ``push_weights`` loaded the trainer's weights, and not
    what it served before (issue 39)."""
    trainer = GRPOTrainer(init_model(TINY), str(tmp_path / "weights"), [])
    engine = tiny(trainer.save(0), "0")
    trainer.engine_urls = [engine.url]
    try:
        with torch.no_grad():  # a training step: the next version's weights differ
            for prm in trainer.model.parameters():
                prm.add_(0.01)
        fp = trainer.fingerprint()
        assert not attest(engine.url, 1, fp).ok  # still version 0's weights
        trainer.push_weights(1)
        assert attest(engine.url, 1, fp).ok
    finally:
        engine.stop()


def test_an_engine_that_does_not_answer_is_skipped_not_failed_nor_pushed_to(
        tmp_path: Path) -> None:
    """A resumed run knows its killed incarnation's engines (``engine-urls/``) though they
    are gone. Before: each update failed their attestation and the repair pushed to them,
    waiting out the push path's retries, at every update. Now: not checked, noted once,
    never pushed to while they do not answer, counted apart; one that answers again is
    pushed the run's weights and checked."""
    run_dir = str(tmp_path / "run")
    q = phased_run(run_dir, PHASE, 0)
    trainer = GRPOTrainer(init_model(TINY), str(tmp_path / "weights"), [])
    v0 = trainer.save(0)
    live, gone = tiny(v0, "0"), tiny(v0, "0")
    gone.stop()  # its URL refuses connections from now on
    notes = EngineWeights(q.storage)
    assert notes.register(gone.url)  # a producer of the previous incarnation used it
    pushed: list[list[str]] = []

    def push_to(urls: list[str], version: int) -> list[str]:
        pushed.append(list(urls))
        return trainer.repair_engines(urls, version)

    bracket = WeightUpdateBracket(q, lease_timeout_s=3.0, poll_interval_s=0.02,
                                  engine_urls=[live.url], repair=push_to,
                                  repair_interval_s=None)
    try:
        for version in (1, 2):
            with torch.no_grad():
                trainer.model.norm.weight.mul_(1.05)
            bracket.begin_weight_update(30.0)
            bracket.publish_fingerprint(version, trainer.fingerprint())
            asyncio.run(push(live.url, trainer.save(version), version))
            bracket.end_weight_update(version)
            verdicts = Fingerprints(q.storage).verdicts(version)
            assert set(verdicts) == {live.url} and verdicts[live.url].ok
            assert gone.url in bracket.engines_needing_weights()
        assert all(gone.url not in urls for urls in pushed), pushed
        m = bracket.attestation_metrics()
        assert (m["attest/checks_total"], m["attest/failures_total"],
                m["attest/unreachable_total"]) == (2, 0, 2)
        assert len([n for n in notes.notes() if n.url == gone.url]) == 1  # noted once
        back = tiny(v0, "0", port=port_of(gone.url))  # restarted on its old weights
        try:
            assert bracket.repair_engines() == [gone.url] and pushed[-1] == [gone.url]
            assert Fingerprints(q.storage).verdicts(2)[gone.url].ok
            assert not bracket.engines_needing_weights()
        finally:
            back.stop()
    finally:
        bracket.close()
        live.stop()
