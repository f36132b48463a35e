"""Teacher log-probs (on-policy distillation): a teacher engine scores each finished sample.

With ``teacher_logprobs`` in ``ProducerConfig.record.extras`` and a ``teacher_url``, every final
sample is sent once, before its reward, to the teacher's ``/generate`` as SGLang 0.5.23
scores a sequence (slime's ``on_policy_distillation.reward_func`` does the same)::

    {"input_ids": prompt + response, "sampling_params": {"max_new_tokens": 0, ...},
     "return_logprob": true, "logprob_start_len": len(prompt) - 1}

``meta_info.input_token_logprobs`` then holds one ``[logprob, id, text]`` per input
position from ``len(prompt) − 1`` on; SGLang leaves the first log-prob ``None``, the other
R are the response tokens' — the sample's ``teacher_logprobs`` [R]. An answer that does not
line up (count, token ids, values) fails the sample with the engine-protocol error; so does
a teacher that cannot be reached after the client's retries: such a sample is recorded,
never trained, and no record holds made-up teacher values.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from strawq.ondisk.extras import TEACHER_LOGPROBS, Extra
from strawq.producers.engine_errors import EngineError
from strawq.producers.extras_protocol import ExtrasMismatch
from strawq.producers.group import GroupRun
from strawq.producers.sample import Sample
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sglang_protocol import GenerateResult

log = logging.getLogger(__name__)


def teacher_payload(sample: Sample) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """``input_ids``, ``sampling_params`` and top-level fields of a scoring request."""
    return (sample.resume_input_ids(),
            {"max_new_tokens": 0, "temperature": sample.params.temperature},
            {"logprob_start_len": len(sample.prompt_ids) - 1})


def parse_teacher(result: GenerateResult, sample: Sample) -> Extra:
    """The response tokens' log-probs from a scoring answer (``ExtrasMismatch`` else)."""
    entries = result.meta_info.get("input_token_logprobs")
    r = sample.response_length
    if not isinstance(entries, list) or len(entries) != r + 1:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ExtrasMismatch(f"teacher: meta_info.input_token_logprobs has {got} entries, "
                             f"expected {r + 1} (from position {len(sample.prompt_ids) - 1})",
                             url=result.url)
    out = np.empty(r, dtype=np.float32)
    for i, (e, tok) in enumerate(zip(entries[1:], sample.response_ids.tolist(), strict=True)):
        if not isinstance(e, list) or len(e) < 2 or e[1] != tok:
            raise ExtrasMismatch(f"teacher: input_token_logprobs[{i + 1}] is {e!r}, expected "
                                 f"a log-prob of token {tok}", url=result.url)
        lp = e[0]
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) \
                or lp > 1e-3:
            raise ExtrasMismatch(f"teacher: input_token_logprobs[{i + 1}] log-prob {lp!r} is "
                                 "not a finite value <= 0", url=result.url)
        out[i] = lp
    return Extra(out)


class Teacher:
    """Scores final samples on the teacher engine at ``url``."""

    def __init__(self, url: str, config: ClientConfig) -> None:
        self.url = url
        self.config = config
        #: one client (one connection pool) for every score; started at the first one
        self._client: SGLangClient | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _started(self) -> SGLangClient:
        if self._client is None:
            client = SGLangClient([self.url], config=self.config)
            await client.start()
            self._client = client
        return self._client

    async def score(self, run: GroupRun, i: int) -> bool:
        """Record sample ``i``'s teacher log-probs; False when the sample failed instead."""
        s = run.samples[i]
        if TEACHER_LOGPROBS in s.extras:
            return True
        if not s.response_length:
            s.extras[TEACHER_LOGPROBS] = Extra(np.zeros(0, np.float32))
            return True
        ids, params, extra = teacher_payload(s)
        try:
            client = await self._started()
            result = await client.generate(ids, params, rid=f"{s.uid}.teacher", extra=extra)
            s.extras[TEACHER_LOGPROBS] = parse_teacher(result, s)
        except EngineError as exc:
            log.warning("sample %s: teacher log-probs failed: %s", s.uid, exc)
            run.fail_sample(i, f"engine protocol error: teacher: {exc}"
                            if isinstance(exc, ExtrasMismatch) else f"teacher: {exc}")
            return False
        s.check()
        return True


__all__ = ["Teacher", "parse_teacher", "teacher_payload"]
