"""A stateful toy agent: its tool writes into a key-value store, so a resumed trajectory
that does not continue in the same world shows it.

Each turn is followed by a ``put`` tool call (``{"k": "k<t mod 3>", "v": <from the turn's
tokens>}``) that writes into the sample's ``KV`` environment and returns the store's checksum,
appended as one token (loss mask 0). The environment is registered with
``ctx.environment``: its snapshot travels with every partial record and turn checkpoint, and
a resumed trajectory restores it (``restore="none"`` keeps the fresh, empty store instead: a
wrong restore). At the end the agent checks the store against the one its recorded tool
calls describe; a difference fails the sample (``environment mismatch``) and leaves a file
``<ledger>/mismatch/<uid>``.

Files under ``ledger`` (a test or bench counts them):

* ``exec/<key>.<random>`` — one per execution of the tool (every try, every re-run);
* ``effect/<key>.e`` — the call's effect, its result as JSON (an idempotent tool applies a
  key once: a re-run returns the stored result; ``idempotent=False`` applies it blindly,
  a second effect leaving ``effect/<key>.<random>``);
* ``gen/<uid>.<start>.<random>`` — one per completed *live* (not replayed) model turn,
  holding its token count: model calls made, and regenerated ones;
* ``restored/<uid>.<random>`` — one per environment restore.

``block_at`` (a tool-call ordinal): that call waits for ``<ledger>/go`` before its effect
(after writing ``<ledger>/started.<key>``), so a test can pause or kill while it runs.

``tool_url``: the ``put`` effect runs in a tool server process instead (``POST <url>/put``
with the key, the args and the result; ``bench/chaos_agentic.py`` serves it and writes
``exec/`` and ``effect/`` in its own ledger). The store is still the sample's environment;
the server is the world outside, which applies a key once. A call the server does not
answer (killed, stopped, restarting) is tried again with the **same** key every
``tool_try_s`` at most, until ``tool_deadline_s`` passed: then the tool fails with the last
error (the context's failure policy applies: ``tools.timeout_s`` must be above it).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from strawq.producers.generate import NOT_APPLIED, GenerateContext, GenerateFn

TOKEN_BASE = 3


def _touch(path: str, content: str = "") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    try:
        os.write(fd, content.encode())
    finally:
        os.close(fd)


def counts(ledger: str, kind: str) -> Counter[str]:
    """Files per name (the part before the last ``.``) under ``<ledger>/<kind>``."""
    d = os.path.join(ledger, kind)
    if not os.path.isdir(d):
        return Counter()
    return Counter(n.rsplit(".", 1)[0] for n in os.listdir(d))


def live_turn_tokens(ledger: str) -> int:
    """Tokens of every completed live model turn (``gen/`` markers)."""
    d = os.path.join(ledger, "gen")
    if not os.path.isdir(d):
        return 0
    total = 0
    for n in os.listdir(d):
        with open(os.path.join(d, n), encoding="utf-8") as f:
            total += int(f.read() or 0)
    return total


class KV:
    """The environment: a key-value store the ``put`` tool writes into."""

    def __init__(self, ledger: str, uid: str, restore: str) -> None:
        self.data: dict[str, int] = {}
        self._ledger, self._uid, self._mode = ledger, uid, restore

    def snapshot(self) -> dict[str, int]:
        return dict(self.data)

    def restore(self, state: Any) -> None:
        _touch(os.path.join(self._ledger, "restored", f"{self._uid}.{uuid.uuid4().hex}"))
        if self._mode == "snapshot":
            self.data = {str(k): int(v) for k, v in dict(state or {}).items()}


class Fenced(RuntimeError):
    """The tool server refused the call: a newer lease of its task called it already."""


def remote_put(url: str, key: str, args: dict[str, Any], result: dict[str, int],
               try_s: float, deadline_s: float,
               stop: threading.Event | None = None, *, task: str = "",
               gen: int = -1) -> dict[str, int]:
    """``POST <url>/put`` until the server answers, always with the same ``key``; a
    ``TimeoutError`` naming the last error once ``deadline_s`` passed (blocking: run it
    in a thread). Once ``stop`` is set (the call was abandoned: its sample halted) it is
    not tried again (``RuntimeError``): a new holder of the trajectory runs the call, and
    a retry from here could reach the server after that holder persisted its result.
    ``task`` and ``gen`` (the lease generation, ``GenerateContext.lease_generation``) are
    the call's fencing token: the server refuses (409, :class:`Fenced`, not retried) a call
    of a generation below one it has seen for the task."""
    body = json.dumps({"key": key, "args": args, "result": result, "task": task, "gen": gen,
                       "caller": f"{os.getpid()}/{threading.get_ident()}"}).encode()
    end = time.monotonic() + deadline_s
    error = "no try"
    while True:
        if stop is not None and stop.is_set():
            raise RuntimeError(f"put {key} was abandoned: not tried again "
                               f"(last error: {error})")
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"tool server {url} did not answer put {key} within "
                               f"{deadline_s:g}s (last error: {error})")
        budget = min(try_s, left)
        req = urllib.request.Request(
            f"{url}/put", data=body, headers={"Content-Type": "application/json",
                                               "X-Deadline": str(time.time() + budget)})
        try:
            with urllib.request.urlopen(req, timeout=budget) as r:
                return {str(k): int(v) for k, v in json.load(r).items()}
        except urllib.error.HTTPError as exc:
            if exc.code == 409:
                raise Fenced(f"put {key}: generation {gen} of task {task} is fenced by the "
                             "tool server (a newer lease called it)") from None
            error = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # refused, reset, timed out, a torn answer
            error = f"{type(exc).__name__}: {exc}"
        (stop or threading.Event()).wait(min(0.2, max(end - time.monotonic(), 0)))


def kv_agent(ledger: str, turns: int = 6, tool_s: float = 0.0, restore: str = "snapshot",
             env: bool = True, idempotent: bool = True, reconcile: bool = True,
             block_at: int = -1, tool_url: str | None = None, tool_try_s: float = 10.0,
             tool_deadline_s: float = 60.0) -> GenerateFn:
    """The generate plugin (see the module docstring)."""
    if restore not in ("snapshot", "none"):
        raise ValueError(f"kv_agent: restore must be 'snapshot' or 'none', got {restore!r}")
    if tool_url is not None and not (0 < tool_try_s <= tool_deadline_s):
        raise ValueError(f"kv_agent: need 0 < tool_try_s <= tool_deadline_s, got "
                         f"{tool_try_s!r} and {tool_deadline_s!r}")

    threads: list[ThreadPoolExecutor] = []

    def pool() -> ThreadPoolExecutor:  # one thread per call in flight (not the loop's few)
        if not threads:
            threads.append(ThreadPoolExecutor(64, thread_name_prefix="kv-tool"))
        return threads[0]

    def effect_path(key: str) -> str:
        return os.path.join(ledger, "effect", f"{key}.e")

    def reconcile_put(args: Any, key: str) -> Any:
        try:
            with open(effect_path(key), encoding="utf-8") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return NOT_APPLIED

    async def agent(ctx: GenerateContext) -> None:
        s = ctx.sample
        store = KV(ledger, s.uid, restore)
        if env:
            ctx.environment(store)

        async def put_remote(args: dict[str, Any], key: str) -> dict[str, int]:
            assert tool_url is not None
            store.data[str(args["k"])] = int(args["v"])  # a put: applying it again is a no-op
            out = {"sum": sum(store.data.values()) % 97}
            stop = threading.Event()
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    pool(), functools.partial(remote_put, task=ctx.task_id,
                                              gen=ctx.lease_generation),
                    tool_url, key, args, out, tool_try_s, tool_deadline_s, stop)
            except BaseException:  # halted, timed out: the thread gives the call up
                stop.set()
                raise

        async def put(args: dict[str, Any], key: str) -> dict[str, int]:
            _touch(os.path.join(ledger, "exec", f"{key}.{uuid.uuid4().hex}"))
            if int(args["t"]) == block_at:
                _touch(os.path.join(ledger, f"started.{key}"))
                while not os.path.exists(os.path.join(ledger, "go")):
                    await asyncio.sleep(0.01)
            if tool_s:
                await asyncio.sleep(tool_s)
            store.data[str(args["k"])] = int(args["v"])  # a put: applying it again is a no-op
            if idempotent and os.path.exists(effect_path(key)):
                # a re-run (in flight at a crash): the world outside changes once
                return dict(json.loads(open(effect_path(key), encoding="utf-8").read()))
            out = {"sum": sum(store.data.values()) % 97}
            try:
                _touch(effect_path(key), json.dumps(out))
            except FileExistsError:
                _touch(os.path.join(ledger, "effect", f"{key}.{uuid.uuid4().hex}"),
                       json.dumps(out))
            return out

        for t in range(turns):
            start = s.response_length
            turn = await ctx.generate()
            if not turn.replayed:
                _touch(os.path.join(ledger, "gen", f"{s.uid}.{start}.{uuid.uuid4().hex}"),
                       str(len(turn.token_ids)))
            if t == turns - 1 or ctx.remaining_budget < 2:
                break
            args = {"t": t, "k": f"k{t % 3}", "v": int(sum(turn.token_ids)) % 50}
            out = await ctx.call_tool("put", args, put if tool_url is None else put_remote,
                                      idempotent=idempotent,
                                      reconcile=reconcile_put if reconcile else None)
            ctx.append([TOKEN_BASE + int(out["sum"]) % 50], kind="tool")
        if env:
            want: dict[str, int] = {}
            for e in ctx.trajectory.tool_calls():
                want[str(e["args"]["k"])] = int(e["args"]["v"])
            if store.data != want:
                _touch(os.path.join(ledger, "mismatch", f"{s.uid}.{uuid.uuid4().hex}"))
                ctx.fail(f"environment mismatch: the store holds {store.data}, its tool "
                         f"calls wrote {want}")
        ctx.finish("completed" if turn.finish == "stop" else "truncated")

    return agent


__all__ = ["KV", "Fenced", "counts", "kv_agent", "live_turn_tokens", "remote_put"]
