"""``StrawqFullyAsyncLLMServerClient``: verl's resuming rollout client, with durable prefixes.

verl's ``FullyAsyncLLMServerClient.generate`` loops over single attempts (its parent's
``generate``), appending each attempt's tokens and resuming after every abort. This client
slots one layer between that loop and the single attempt (``_DurableAttempt``: the loop's
``super().generate``), so after each aborted attempt the prefix so far is saved in the
queue's ``PartialStore`` (durable on return), and the first attempt of a request whose
prompt has a saved prefix (left by a crashed rollout process) continues it instead of
starting over: prompt + prefix, the token budget less the prefix. The weight version of every
token is recorded; the result's ``min_global_steps``/``max_global_steps`` are the minimum
and maximum over its tokens, and ``extra_fields["token_versions"]`` carries them all.
"""

from __future__ import annotations

import logging
from typing import Any

from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from strawq.collector.integrations.verl.partial import PartialStore, Prefix, prompt_key
from strawq.collector.integrations.verl.config import queue_dir
from strawq.storage import PosixStorage

log = logging.getLogger(__name__)
_ABORTED = ("aborted", "abort")


class _State:
    def __init__(self, key: str, prompt: list[int]) -> None:
        self.key = key
        self.prefix = Prefix(prompt_ids=prompt)
        self.handle: str | None = None
        self.first = True


class _DurableAttempt(LLMServerClient):
    """One attempt, with the request's prefix kept durable across aborts."""

    _strawq_store: PartialStore | None = None

    def _store(self) -> PartialStore:
        if self._strawq_store is None:
            self._strawq_store = PartialStore(PosixStorage(queue_dir(self.config),
                                                           writer_id="verlp"))
        return self._strawq_store

    def _states(self) -> dict[str, _State]:
        st: dict[str, _State] | None = self.__dict__.get("_strawq_states")
        if st is None:
            st = self.__dict__["_strawq_states"] = {}
        return st

    async def generate(self, request_id: Any, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:
        states = self._states()
        st = states.get(request_id)
        resumed: Prefix | None = None
        if st is None:  # the request's first attempt: a prefix a crash left?
            prompt = [int(t) for t in prompt_ids]
            st = states[request_id] = _State(prompt_key(prompt), prompt)
            got = self._store().claim(st.key)
            if got is not None:
                st.handle, resumed = got
                st.prefix = resumed
                log.info("verl request %s continues a saved prefix of %d tokens", request_id,
                         len(resumed.tokens))
        if resumed is not None and resumed.tokens:
            params = dict(sampling_params)
            limit = next((k for k in ("max_tokens", "max_new_tokens") if k in params), None)
            if limit is not None:
                params[limit] = int(params[limit]) - len(resumed.tokens)
                if params[limit] <= 0:
                    return TokenOutput(token_ids=list(resumed.tokens),
                                       log_probs=list(resumed.logprobs), stop_reason="length",
                                       extra_fields={"global_steps": max(resumed.versions)})
            out = await super().generate(request_id, prompt_ids=list(prompt_ids) + resumed.tokens,
                                         sampling_params=params, **kwargs)
        else:
            out = await super().generate(request_id, prompt_ids=prompt_ids,
                                         sampling_params=sampling_params, **kwargs)
        new = list(out.token_ids)
        st.prefix.extend(new, out.log_probs if out.log_probs is not None else None,
                         out.extra_fields.get("global_steps"))
        if out.stop_reason in _ABORTED:
            st.prefix.meta["aborts"] = int(st.prefix.meta.get("aborts", 0)) + 1
            st.handle = self._store().save(st.key, st.prefix, replaces=st.handle)
        if resumed is not None and resumed.tokens:
            n = len(resumed.tokens)
            out = out.model_copy(update={
                "token_ids": list(st.prefix.tokens[:n + len(new)]),
                "log_probs": list(st.prefix.logprobs[:n + len(new)])})
        return out  # type: ignore[no-any-return]


class StrawqFullyAsyncLLMServerClient(FullyAsyncLLMServerClient, _DurableAttempt):
    """verl's ``FullyAsyncLLMServerClient`` whose aborted prefixes survive a crash."""

    async def generate(self, request_id: Any, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:
        try:
            out: TokenOutput = await super().generate(request_id, prompt_ids=prompt_ids,
                                                      sampling_params=sampling_params, **kwargs)
        except BaseException:
            st = self._states().pop(request_id, None)
            if st is not None and st.handle:
                self._store().release(st.handle)
            raise
        st = self._states().pop(request_id, None)
        if st is not None:
            self._store().finish(st.handle)
            known = [v for v in st.prefix.versions if v >= 0]
            if known:
                out.extra_fields["min_global_steps"] = min(known)
                out.extra_fields["max_global_steps"] = max(known)
            out.extra_fields["token_versions"] = list(st.prefix.versions)
        return out


def install_partial_client() -> None:
    """Make verl's Rollouter build its rollout client from this class."""
    from verl.experimental.fully_async_policy import fully_async_rollouter

    setattr(fully_async_rollouter, "FullyAsyncLLMServerClient",  # noqa: B010 (mypy: a class)
            StrawqFullyAsyncLLMServerClient)
