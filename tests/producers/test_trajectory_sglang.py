"""The generate plugin against the real SGLang 0.5.23 server: a two-turn chat with the
model's chat template (marker ``sglang_real``; skipped with the reason without the CPU
fixture)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.producer import Producer
from strawq.producers.producer_config import (BudgetConfig, EngineConfig, PluginsConfig,
                                              ProducerConfig, SamplerParams)
from strawq.producers.sglang_client import ClientConfig
from tests.producers.helpers import ids, make_run, ready_groups, run_producers, wait_for
from tests.producers.test_trajectory import check_sample

pytestmark = [pytest.mark.sglang_real, pytest.mark.timeout(420)]

SECOND = "And of Italy? One word."


def test_two_turn_chat_with_the_chat_template(tmp_path: Path, sglang_real: Any) -> None:
    from transformers import AutoTokenizer

    server = sglang_real
    first = [{"role": "user", "content": "What is the capital of France? One word."}]
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=[{"prompt": first}], group_size=2)
    cfg = ClientConfig(api_key=server.api_key, admin_api_key=server.admin_api_key)
    p = Producer(ProducerConfig(
        run_dir=str(run),
        engine=EngineConfig(workers=(server.url,), client=cfg),
        plugins=PluginsConfig(reward="tests.producers.plugins_for_tests.length_reward",
                              tokenizer=f"hf:{server.model_dir}",
                              tokenizer_args={"local_files_only": True},
                              generate="tests.producers.trajectory_plugins.chat_two_turns",
                              generate_args={"model_dir": server.model_dir, "second": SECOND}),
        sampling=SamplerParams(max_new_tokens=96, temperature=0.0),
        budget=BudgetConfig(slots=1)))

    async def body() -> None:
        await wait_for(lambda: len(ids(q, "ready")) == 1, 300, "the chat group ready")

    asyncio.run(run_producers([p], body))
    tok = AutoTokenizer.from_pretrained(server.model_dir, local_files_only=True)
    (grp,) = ready_groups(q).values()
    for i in range(2):
        t = check_sample(grp, i, max_new=96)
        assert [e["op"] for e in t.events] == ["gen", "append", "gen"], t.events
        c = grp.sample(i)
        glue = t.events[1]
        text = tok.decode([*grp.prompt_ids.tolist(), *c["tokens"].tolist()])
        # the conversation reads as the template renders it, with both answers in place
        assert text.count("<|im_start|>assistant\n") == 2, text
        assert f"<|im_start|>user\n{SECOND}<|im_end|>\n<|im_start|>assistant\n" in text, text
        assert tok.decode(c["tokens"][glue["start"]:glue["end"]].tolist()).strip().startswith(
            "<|im_start|>user")
        assert grp.status[i] == "completed"
