"""Attestation against the real SGLang 0.5.23 server (the CPU fixture, SmolLM2-135M bf16).

What ``/get_weights_by_name`` does on 0.5.23, recorded: ``truncate_size`` cuts the first
dimension (a 2-D parameter comes back as that many whole rows, a 1-D one as that many
values), as float32 values exactly equal to the bf16 checkpoint's; an unknown name is a 400;
its answer changes after ``update_weights_from_disk`` of the perturbed copy (one tensor
scaled by 1.05). Then the fault: the perturbed checkpoint loaded under the run's version
label fails its check after the bracket, the producer keeps the engine out (nothing
generated on it), the trainer's repair push of the right weights passes and it is back.

Real tier (marker ``sglang_real``): skipped with the reason without the CPU fixture."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    SamplerParams,
    TimingConfig,
)
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing.real_sglang import PERTURBED_TENSOR, PROMPTS, RealServer
from strawq.weights.fingerprint import (
    AttestationError,
    Fingerprints,
    attest,
    fingerprint_of,
    read_parameter,
)

pytestmark = [pytest.mark.sglang_real, pytest.mark.slow, pytest.mark.timeout(600)]

safetensors_torch = pytest.importorskip("safetensors.torch")


def _weights(model_dir: str) -> dict[str, object]:
    return dict(safetensors_torch.load_file(str(Path(model_dir) / "model.safetensors")))


def _push(server: RealServer, path: str, version: int) -> None:
    cfg = ClientConfig(api_key=server.api_key, admin_api_key=server.admin_api_key)

    async def go() -> None:
        async with SGLangClient([server.url], config=cfg) as c:
            await c.push_weights(path, weight_version=version)
    asyncio.run(go())


def _producer(server: RealServer, run_dir: Path, cfg: ClientConfig, groups: int) -> Producer:
    """A producer on ``server`` alone, ``groups`` slots, the count task's reward."""
    return Producer(ProducerConfig(
        run_dir=str(run_dir), engine=EngineConfig(workers=(server.url,), client=cfg),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        sampling=SamplerParams(max_new_tokens=16, ignore_eos=True, seed=1),
        budget=BudgetConfig(slots=groups),
        timing=TimingConfig(control_poll_s=0.05, idle_poll_s=0.05)))


def test_get_weights_by_name_on_sglang_0_5_23(sglang_real: RealServer) -> None:
    s, key = sglang_real, sglang_real.admin_api_key or sglang_real.api_key
    w = _weights(s.model_dir)
    q = "model.layers.0.self_attn.q_proj.weight"  # a slice of SGLang's fused qkv_proj
    rows = read_parameter(s.url, q, 2, api_key=key)
    assert rows.shape == (2, 576) and rows.dtype == np.float32
    assert np.array_equal(rows, w[q][:2].float().numpy())  # type: ignore[index,union-attr]
    down = "model.layers.29.mlp.down_proj.weight"
    assert read_parameter(s.url, down, 1, api_key=key).shape == (1, 1536)
    norm = read_parameter(s.url, PERTURBED_TENSOR, 3, api_key=key)
    assert norm.shape == (3,)
    with pytest.raises(AttestationError, match="HTTP 400"):
        read_parameter(s.url, "model.no_such.weight", 1, api_key=key)

    fp = fingerprint_of(w, dtype="bfloat16")  # the trainer's side, from the checkpoint
    t0 = time.monotonic()
    assert attest(s.url, 0, fp, api_key=key).ok
    print(f"attestation: {len(fp.slices)} slices read back in {time.monotonic() - t0:.2f}s")
    fp_master = fingerprint_of({k: v.float() for k, v in w.items()})  # type: ignore[union-attr]
    assert fp_master.digest == fp.digest  # fp32 master weights, cast as the engine holds them

    t0 = time.monotonic()
    _push(s, s.perturbed_dir, 0)
    print(f"attestation: the push it follows took {time.monotonic() - t0:.2f}s")
    try:
        after = read_parameter(s.url, PERTURBED_TENSOR, 3, api_key=key)
        assert not np.array_equal(after, norm)
        np.testing.assert_allclose(after, norm * 1.05, rtol=1e-2)
        assert not attest(s.url, 0, fp, api_key=key).ok
        assert attest(s.url, 0, fingerprint_of(_weights(s.perturbed_dir)), api_key=key).ok
    finally:
        _push(s, s.model_dir, 0)
    assert attest(s.url, 0, fp, api_key=key).ok


def test_wrong_checkpoint_under_the_run_label_is_refused_and_repaired(
        sglang_real: RealServer, tmp_path: Path) -> None:
    s, groups = sglang_real, 2
    cfg = ClientConfig(api_key=s.api_key, admin_api_key=s.admin_api_key, max_retries=1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    q = RunQueue.create(PosixStorage(str(run_dir), writer_id="setup", fsync=False),
                        QueueConfig(fsync=False, lease_timeout_s=30.0,
                                    heartbeat_interval_s=0.2, group_size=2,
                                    release_batch=groups))
    data = run_dir / "dataset.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPTS[i % 2], "target": 7, "count": 3})
                            + "\n" for i in range(groups)))

    def push_to(urls: list[str], version: int) -> None:
        _push(s, s.model_dir, version)

    # no repair configured: the engine that fails stays out until repair_engines below
    bracket = WeightUpdateBracket(q, engine_urls=[s.url], api_key=s.api_key,
                                  admin_api_key=s.admin_api_key)
    bracket.begin_weight_update(30.0)
    bracket.publish_fingerprint(1, fingerprint_of(_weights(s.model_dir)))
    _push(s, s.perturbed_dir, 1)  # the fault: the wrong checkpoint, labelled version 1
    try:
        bracket.end_weight_update(1)
        assert Fingerprints(q.storage).verdicts(1)[s.url].ok is False
        assert s.url in bracket.engines_needing_weights()
        Feeder(q, Dataset(str(data))).release(groups)
        p = _producer(s, run_dir, cfg, groups)
        seen: dict[str, int] = {}

        async def main() -> None:
            task = asyncio.create_task(p.run())
            try:
                deadline = time.monotonic() + 120
                while not p.stats().waiting_for_weights:
                    assert time.monotonic() < deadline, "the producer never held back"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # a producer that ignored the verdict generates now
                seen["ready"] = len(q.storage.list("ready"))
                seen["generated"] = p.stats().tokens_generated
                assert await asyncio.to_thread(bracket.repair_engines, push_to) == [s.url]
                deadline = time.monotonic() + 300
                while len(q.storage.list("ready")) < groups:
                    assert time.monotonic() < deadline, "groups not ready after the repair"
                    await asyncio.sleep(0.1)
            finally:
                p.request_stop()
                await asyncio.wait([task], timeout=60)

        asyncio.run(main())
    finally:
        _push(s, s.model_dir, 0)
    assert seen == {"ready": 0, "generated": 0}, f"generated on the wrong weights: {seen}"
    assert Fingerprints(q.storage).verdicts(1)[s.url].ok
    assert not bracket.engines_needing_weights()
    st = p.stats()
    assert st.engines_marked_stale == 1 and st.engines_restored == 1


def test_rolling_a_wrong_checkpoint_under_the_label_is_refused_the_right_one_attests(
        sglang_real: RealServer, tmp_path: Path) -> None:
    """The rolling mode: version 1 publishes the perturbed checkpoint with the fingerprint of
    the right one (the wrong weights under the right label); the producer loads it, the
    check fails, the engine stays out and generates nothing. Version 2, the right weights:
    the check passes and the groups are generated on it."""
    s, groups = sglang_real, 2
    cfg = ClientConfig(api_key=s.api_key, admin_api_key=s.admin_api_key, max_retries=1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    q = RunQueue.create(PosixStorage(str(run_dir), writer_id="setup", fsync=False),
                        QueueConfig(fsync=False, lease_timeout_s=30.0,
                                    heartbeat_interval_s=0.2, group_size=2,
                                    release_batch=groups))
    data = run_dir / "dataset.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPTS[i % 2], "target": 7, "count": 3})
                            + "\n" for i in range(groups)))
    fp = fingerprint_of(_weights(s.model_dir))
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=0,
                                  engine_urls=[s.url], api_key=s.api_key,
                                  admin_api_key=s.admin_api_key)
    bracket.weight_update(lambda v: s.perturbed_dir, fingerprint=fp)
    Feeder(q, Dataset(str(data))).release(groups)
    p = _producer(s, run_dir, cfg, groups)
    seen: dict[str, int] = {}

    async def main() -> None:
        task = asyncio.create_task(p.run())
        try:
            deadline = time.monotonic() + 300
            while p.stats().rolling_load_failures < 1:
                assert time.monotonic() < deadline, "the wrong checkpoint was never refused"
                await asyncio.sleep(0.05)
            seen["ready"] = len(q.storage.list("ready"))
            seen["generated"] = p.stats().tokens_generated
            await asyncio.to_thread(bracket.weight_update, lambda v: s.model_dir,
                                    fingerprint=fp)
            deadline = time.monotonic() + 300
            while len(q.storage.list("ready")) < groups:
                assert time.monotonic() < deadline, "groups not ready on the right weights"
                await asyncio.sleep(0.1)
        finally:
            p.request_stop()
            await asyncio.wait([task], timeout=60)

    try:
        asyncio.run(main())
    finally:
        _push(s, s.model_dir, 0)
    assert seen == {"ready": 0, "generated": 0}, f"generated on the wrong weights: {seen}"
    assert Fingerprints(q.storage).verdicts(1)[s.url].ok is False
    assert Fingerprints(q.storage).verdicts(2)[s.url].ok
    assert p.stats().rolling_loads >= 1
