"""A producer that cannot run tasks for a reason of its own configuration hands them back
and stops; tasks bad in themselves are still dropped (docs/design.md, invariant 12)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from strawq.ondisk import records
from strawq.ondisk.names import note_key
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.handback import REFUSED_REASON, MisconfiguredProducer
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from tests.producers.conftest import FAST_SIM
from tests.producers.helpers import config_with, ids, make_run, names, run_producers, wait_for

pytestmark = pytest.mark.timeout(90)

PLUGINS = "tests.producers.plugins_for_tests"


def config(run: Path, url: str, **sections: Any) -> ProducerConfig:
    base: dict[str, Any] = {"run_dir": str(run), "engine": {"workers": (url,)},
                            "plugins": {"reward": f"{PLUGINS}.length_reward"},
                            "budget": {"slots": 4}, "sampling": {"max_new_tokens": 16, "seed": 7},
                            "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}}
    return config_with(base, sections)


def _settled(q: Any, n: int) -> bool:
    return len(ids(q, "ready")) + len(ids(q, "dropped")) == n


def _refused_notes(q: Any) -> list[str]:
    return sorted(k for k in q.storage.list("data") if f".fail.{REFUSED_REASON}" in k)


def test_text_tasks_without_a_tokenizer_are_handed_back_and_the_producer_stops(
        tmp_path: Path, sim_engine: Any) -> None:
    rows = [{"prompt": [5, 6, 7]}, {"prompt": "hello"}, {"prompt": "world"}, {"prompt": [8, 9]}]
    q = make_run(str(tmp_path / "run"), 0, rows=rows)
    p = Producer(config(tmp_path / "run", sim_engine.url))  # no tokenizer
    with pytest.raises(MisconfiguredProducer, match="no tokenizer.*fix plugins.tokenizer") as exc:
        asyncio.run(p.run())  # the first queued task holds ids: it starts, then refuses
    assert exc.value.key.startswith("plugins.tokenizer") and "none dropped" in str(exc.value)
    assert not ids(q, "dropped") and not ids(q, "leased")
    back = {t.id: t for t in names(q, "pending")}
    for i in (1, 2):  # claimed, handed back untouched: no attempt spent, a new generation
        t = back[f"i{i:012d}"]
        assert (t.attempts, t.gen) == (0, 1)
        note = records.decode(q.storage.read(note_key(t.id, 0, "fail", REFUSED_REASON)))
        assert "no tokenizer" in note.meta["message"]
    assert p.stats().groups_released >= 2 and p.stats().groups_dropped == 0
    # a producer configured right runs all of them
    ok = Producer(config(tmp_path / "run", sim_engine.url,
                         plugins={"tokenizer": f"{PLUGINS}.char_tokenizer"}))
    asyncio.run(run_producers([ok], lambda: wait_for(lambda: _settled(q, 4), 60, "ready")))
    assert len(ids(q, "ready")) == 4


def test_a_producer_whose_tokenizer_cannot_chat_refuses_before_claiming(
        tmp_path: Path, sim_engine: Any) -> None:
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [1, 2]}]
    q = make_run(str(tmp_path / "run"), 0, rows=rows)
    p = Producer(config(tmp_path / "run", sim_engine.url,
                        plugins={"tokenizer": f"{PLUGINS}.char_tokenizer"}))
    with pytest.raises(MisconfiguredProducer, match="refuses to start, claiming nothing.*chat"):
        asyncio.run(p.run())
    assert [(t.gen, t.attempts) for t in names(q, "pending")] == [(0, 0), (0, 0)]
    assert not q.storage.list("hb") and not _refused_notes(q)


def test_an_engine_refusing_the_api_key_gets_its_tasks_handed_back(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"), 3)
    with EngineThread(EngineOptions(kind="sim", sim=FAST_SIM, api_key="right")) as eng:
        p = Producer(config(tmp_path / "run", eng.url,
                            engine={"client": {"api_key": "wrong"},
                                    "generation": {"eos_token_ids": (2,)}}))
        with pytest.raises(MisconfiguredProducer, match="fix engine.client.api_key"):
            asyncio.run(p.run())
    assert not ids(q, "dropped") and not ids(q, "leased") and len(ids(q, "pending")) == 3
    assert all(t.attempts == 0 for t in names(q, "pending")) and _refused_notes(q)


def test_a_reward_plugin_missing_here_hands_back_and_a_bad_task_is_still_dropped(
        tmp_path: Path, sim_engine: Any) -> None:
    rows = [{"prompt": [4, 5]}, {"prompt": [6, 7], "sampling_params": {"temperature": -1}}]
    q = make_run(str(tmp_path / "run"), 0, rows=rows)
    p = Producer(config(tmp_path / "run", sim_engine.url,
                        plugins={"reward": f"{PLUGINS}.missing_module_reward"}))
    with pytest.raises(MisconfiguredProducer, match="verifier_backend.*fix plugins.reward"):
        asyncio.run(p.run())
    assert ids(q, "pending") == ["i000000000000"] and not ids(q, "ready")
    # the row's own bad sampling parameters are the task's fault: dropped for good, as before
    (bad,) = names(q, "dropped")
    assert bad.id == "i000000000001" and bad.producer == "bad_task"
