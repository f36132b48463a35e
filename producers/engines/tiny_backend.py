"""Backend of the ``tiny`` engine: a :class:`TinyLM` on CPU with a slot-based KV cache.

Each running request owns one slot of a preallocated cache ``[slots, heads, context,
head_dim]`` per layer. Admission prefills ``input + generated[:-1]`` into the slot; each
decode step feeds every running request's last token at its position, in one batched
forward, then samples the next token. Model compute runs on one dedicated thread so
the HTTP server keeps answering while the model works.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from strawq.producers.engines.core import Req
from strawq.producers.engines.sampling import sample_batch
from strawq.producers.engines.seeding import position_uniform
from strawq.producers.engines.tiny_model import TinyConfig, TinyLM, init_model, load_weights

logger = logging.getLogger(__name__)


class TinyBackend:
    kind = "tiny"

    def __init__(
        self, model: TinyLM, *, max_running: int, model_path: str = "", threads: int | None = None
    ) -> None:
        self.model = model.eval()
        self.cfg: TinyConfig = model.cfg
        self.vocab_size = self.cfg.vocab_size
        self.context_length = self.cfg.context_length
        self.eos_token_id = self.cfg.eos_token_id
        self.model_path = model_path
        self.max_running = max_running
        shape = (max_running, self.cfg.num_heads, self.cfg.context_length, self.cfg.head_dim)
        self.k_caches = [torch.zeros(shape) for _ in range(self.cfg.num_layers)]
        self.v_caches = [torch.zeros(shape) for _ in range(self.cfg.num_layers)]
        self.free_slots = list(range(max_running - 1, -1, -1))
        self._threads = threads
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tiny-model", initializer=self._init_thread
        )

    @classmethod
    def from_path_or_config(
        cls,
        model_path: str | None,
        cfg: TinyConfig | None,
        *,
        max_running: int,
        threads: int | None = None,
    ) -> TinyBackend:
        model = load_weights(model_path) if model_path else init_model(cfg or TinyConfig())
        return cls(model, max_running=max_running, model_path=model_path or "", threads=threads)

    def _init_thread(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- scheduling hooks -------------------------------------------------------------------
    async def prefill(self, reqs: Sequence[Req]) -> None:
        for req in reqs:
            req.backend_state = {"slot": self.free_slots.pop()}
        await self._run(self._prefill_sync, list(reqs))

    @torch.inference_mode()
    def _prefill_sync(self, reqs: list[Req]) -> None:
        for req in reqs:
            seq = req.input_ids + req.out_ids
            slot = req.backend_state["slot"]
            prefix = seq[:-1]
            if prefix:
                _, kvs = self.model.forward_with_kv(torch.tensor([prefix], dtype=torch.long))
                for (k, v), kc, vc in zip(kvs, self.k_caches, self.v_caches, strict=False):
                    kc[slot, :, : len(prefix)] = k[0]
                    vc[slot, :, : len(prefix)] = v[0]
            req.backend_state["pos"] = len(seq) - 1
            req.backend_state["feed"] = seq[-1]

    async def decode(self, reqs: Sequence[Req]) -> list[tuple[int, float]]:
        out: list[tuple[int, float]] = await self._run(self._decode_sync, list(reqs))
        return out

    @torch.inference_mode()
    def _decode_sync(self, reqs: list[Req]) -> list[tuple[int, float]]:
        states = [r.backend_state for r in reqs]
        tokens = torch.tensor([s["feed"] for s in states], dtype=torch.long)
        positions = torch.tensor([s["pos"] for s in states], dtype=torch.long)
        slots = torch.tensor([s["slot"] for s in states], dtype=torch.long)
        order = torch.argsort(slots)  # sorted slots are usually contiguous: attention reads a view
        if not bool((order == torch.arange(len(order))).all()):
            return self._decode_permuted(reqs, order.tolist())
        logits = self.model.forward_decode(tokens, positions, slots, self.k_caches, self.v_caches)
        p = [r.params for r in reqs]
        new_tokens, logprobs = sample_batch(
            logits,
            torch.tensor([x.temperature for x in p], dtype=torch.float32),
            torch.tensor([x.top_p for x in p], dtype=torch.float32),
            torch.tensor([x.top_k for x in p], dtype=torch.long),
            torch.tensor([x.min_p for x in p], dtype=torch.float32),
            torch.tensor(
                [
                    position_uniform(r.seed, s["pos"] + 1)
                    for r, s in zip(reqs, states, strict=False)
                ],
                dtype=torch.float64,
            ),
        )
        out = []
        for s, tok, lp in zip(states, new_tokens.tolist(), logprobs.tolist(), strict=False):
            s["feed"] = tok
            s["pos"] += 1
            out.append((tok, lp))
        return out

    def _decode_permuted(self, reqs: list[Req], order: list[int]) -> list[tuple[int, float]]:
        results = self._decode_sync([reqs[i] for i in order])
        out: list[tuple[int, float]] = [(0, 0.0)] * len(reqs)
        for j, i in enumerate(order):
            out[i] = results[j]
        return out

    def release(self, req: Req) -> None:
        state = req.backend_state
        if state is not None and "slot" in state:
            self.free_slots.append(state["slot"])
        req.backend_state = None

    async def load_weights(self, path: str) -> None:
        model = await self._run(load_weights, path)
        if model.cfg != self.cfg and _shape_key(model.cfg) != _shape_key(self.cfg):
            raise ValueError(
                f"new weights have a different architecture ({model.cfg}) than the running "
                f"model ({self.cfg}); "
                "restart the engine to change architecture"
            )
        self.model = model
        self.model_path = path

    def weights_by_name(self, name: str, truncate_size: int) -> list[Any] | None:
        """The first ``truncate_size`` rows of parameter ``name`` (its ``state_dict`` name)
        as float32 lists, as SGLang's ``/get_weights_by_name``; None: no such parameter."""
        param = dict(self.model.named_parameters()).get(name)
        if param is None:
            return None
        values: list[Any] = param.detach().float()[: max(0, truncate_size)].tolist()
        return values

    def model_info(self) -> dict[str, Any]:
        return {
            "model_type": "strawq-tiny",
            "architectures": ["StrawqTinyForCausalLM"],
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "eos_token_id": self.eos_token_id,
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
        }

    async def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _shape_key(cfg: TinyConfig) -> tuple[int, ...]:
    return (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.intermediate_size,
        cfg.context_length,
    )
