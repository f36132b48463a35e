"""The chaos benchmark's agentic workload (``chaos.py --workload agentic``): the tool server,
what the trainer records of each trained trajectory, and the oracle.

A module of ``chaos.py`` (not a benchmark of its own). The producers run the stateful
key-value agent (``strawq.demo.agentic_kv.kv_agent``: a model turn, then a ``put`` tool call
that writes into the sample's store and answers its checksum, ``turns`` turns deep) with
``tool_url`` set: every ``put`` effect runs in the *tool server*, a process of its own
(``chaos.py --role tool-server``, a victim of the nemesis like the engines and producers).

The tool server (stdlib ``http.server``, one thread per call, on 127.0.0.1): ``POST /put``
with the call's idempotency key, its args and its result. Each execution writes, fsync'd,
``<ledger>/exec/<key>.<random>`` first, then waits a latency drawn log-uniformly from
``[lat_min, lat_max]``, then applies the effect once per key: ``<ledger>/effect/<key>.e``
(args and result, published by an exclusive link of a synced file); a call with a key that
already has its effect answers the stored result. Each call carries its task and lease
generation (``GenerateContext.lease_generation``), a fencing token: the server keeps the
highest generation it has seen per task (``<ledger>/fence/<task>``, fsync'd) and refuses a
lower one (409, not executed; each refusal leaves ``<ledger>/fenced/<key>.<random>``), so
a holder whose lease expired (stopped, then woken) cannot run a call after a newer holder
called the tool. A call whose caller's deadline
(``X-Deadline``) has passed before it starts is refused (504) and not executed: a request
left in the socket of a stopped server is not run when the server wakes.

The oracle, over every trajectory in the final model's lineage (what the trainer recorded
of each trained group before acking it):

* **tool effects applied twice**: keys with more than one effect (over the whole ledger);
* **environment mismatches**: samples the agent itself failed because its store did not
  hold what its recorded calls wrote (``<ledger>/mismatch/``), plus trained trajectories
  whose recorded calls disagree with the world: a call without its effect in the server's
  ledger, an effect with other args or another result, or a result that is not the
  checksum of the store recomputed from the trajectory's own calls (a resume in a wrong
  environment shows there);
* **persisted tool calls re-executed**: calls whose result was in a turn checkpoint (or a
  partial record) that a next holder would load, executed again after that — the nemesis
  loop scans the run's records at every tick and notes each such call's executions.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEY_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")


# -- the tool server -------------------------------------------------------------------------

def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsync'd."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_beside(path: str) -> str:
    """A fresh name in the ledger's ``tmp/`` (``path`` is ``<ledger>/<dir>/<name>``)."""
    return os.path.join(os.path.dirname(os.path.dirname(path)), "tmp", uuid.uuid4().hex)


def _durable(path: str, data: bytes, *, exclusive_link: bool = False) -> bool:
    """Write ``path`` durably; with ``exclusive_link`` publish it only if it does not exist
    (False: it did)."""
    d = os.path.dirname(path)
    if not exclusive_link:
        _write_synced(path, data)
        _fsync_dir(d)
        return True
    tmp = _tmp_beside(path)
    _write_synced(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    _fsync_dir(d)
    return True


def read_effect(ledger: str, key: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(ledger, "effect", f"{key}.e"), encoding="utf-8") as f:
            out: dict[str, Any] = json.load(f)
            return out
    except FileNotFoundError:
        return None


def _replace_durable(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably (a synced temporary file renamed over it)."""
    tmp = _tmp_beside(path)
    _write_synced(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def read_fence(ledger: str, task: str) -> int:
    """The highest lease generation the server has seen call a tool for ``task`` (-1: none)."""
    try:
        with open(os.path.join(ledger, "fence", task), encoding="utf-8") as f:
            return int(f.read() or -1)
    except FileNotFoundError:
        return -1


def serve(port: int, ledger: str, lat_min: float, lat_max: float) -> int:
    """The tool server (see the module docstring); runs until killed."""
    for d in ("exec", "effect", "tmp", "fence", "fenced"):
        os.makedirs(os.path.join(ledger, d), exist_ok=True)
    rng = random.Random()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def _answer(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/put":
                self._answer(404, {"error": f"no route {self.path}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key, args, result = str(body["key"]), body["args"], body["result"]
                task, gen = str(body.get("task", "")), int(body.get("gen", -1))
            except (TypeError, ValueError, KeyError) as exc:
                self._answer(400, {"error": f"expected JSON {{key, args, result[, task, gen]}}:"
                                            f" {exc}"})
                return
            if not KEY_RE.fullmatch(key):
                self._answer(400, {"error": f"key {key!r} is not [A-Za-z0-9._-]+"})
                return
            if time.time() > float(self.headers.get("X-Deadline") or math.inf):
                self._answer(504, {"error": "the caller's deadline passed: not executed"})
                return
            if task and not KEY_RE.fullmatch(task):
                self._answer(400, {"error": f"task {task!r} is not [A-Za-z0-9._-]+"})
                return
            with lock:  # fence check and exec record together: no lower generation slips by
                seen = read_fence(ledger, task) if task else -1
                if gen < seen:
                    _durable(os.path.join(ledger, "fenced", f"{key}.{uuid.uuid4().hex}"),
                             json.dumps({"t": time.time(), "task": task, "gen": gen,
                                         "seen": seen}).encode())
                    self._answer(409, {"error": f"generation {gen} of task {task} is fenced: "
                                                f"generation {seen} called already"})
                    return
                if task and gen > seen:
                    _replace_durable(os.path.join(ledger, "fence", task), str(gen).encode())
                _durable(os.path.join(ledger, "exec", f"{key}.{uuid.uuid4().hex}"),
                         json.dumps({"t": time.time(), "pid": os.getpid(), "gen": gen,
                                     "caller": str(body.get("caller", ""))}).encode())
            with lock:
                latency = math.exp(rng.uniform(math.log(lat_min), math.log(lat_max)))
            time.sleep(latency)
            stored = read_effect(ledger, key)
            if stored is None:
                rec = {"args": args, "result": result}
                if _durable(os.path.join(ledger, "effect", f"{key}.e"),
                            json.dumps(rec).encode(), exclusive_link=True):
                    stored = rec
                else:  # a concurrent execution of the same key applied it first
                    stored = read_effect(ledger, key)
            assert stored is not None
            self._answer(200, stored["result"])

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"tool server on 127.0.0.1:{port}, ledger {ledger}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


# -- what the trainer records ----------------------------------------------------------------

def trained_group(grp: Any) -> dict[str, Any]:
    """One trained group's samples: status, tool calls (key, args, result), generated
    tokens; and its failure reasons."""
    from strawq.producers.trajectory import Trajectory

    trajs = grp.meta.get("trajectories")
    samples = []
    for i in range(grp.num_samples):
        c = grp.sample(i)
        tr = Trajectory.from_dict(trajs[i] if trajs else None, len(c["tokens"]))
        samples.append({
            "status": str(grp.status[i]),
            "gen_tokens": sum(e["end"] - e["start"] for e in tr.events
                              if e["op"] == "gen" and e["end"] is not None),
            "tools": [[e["key"], e["args"], e["result"]] for e in tr.tool_calls()]})
    return {"samples": samples,
            "failures": {str(k): str(v) for k, v in (grp.meta.get("failures") or {}).items()}}


# -- persisted calls -------------------------------------------------------------------------

def saved_keys(storage: Any) -> dict[str, str]:
    """Tool keys in the records a next holder would load now: each task's newest turn
    checkpoint unless a newer generation wrote anything in its directory (a stale holder's
    save, never loaded), and the partial records of pending tasks."""
    from strawq.ondisk import records
    from strawq.ondisk.groups import GroupData
    from strawq.ondisk.names import TaskName, data_key
    from strawq.ondisk.records import Kind
    from strawq.producers.trajectory import Trajectory
    from strawq.tasks.turns import TURNS_DIR

    groups: list[tuple[str, Any]] = []
    for task in storage.list(TURNS_DIR):
        newest: tuple[int, Any] | None = None
        top = -1
        for n in sorted((n for n in storage.list(f"{TURNS_DIR}/{task}") if n.isdigit()),
                        key=int, reverse=True):
            try:
                rec = records.decode(storage.read(f"{TURNS_DIR}/{task}/{n}"))
            except Exception:  # noqa: BLE001 - deleted or being written under us
                continue
            meta = rec.meta.get("checkpoint") if rec.kind is Kind.STATE else (
                (rec.meta.get("group") or {}).get("meta", {}).get("checkpoint"))
            gen = int((meta or {}).get("gen", -1))
            top = max(top, gen)
            if rec.kind is Kind.PARTIAL and newest is None:
                newest = (gen, rec)
        if newest is not None and newest[0] >= top:
            groups.append((f"{TURNS_DIR}/{task} gen {newest[0]}",
                           GroupData.from_record(newest[1])))
    for d in ("pending", "partial"):
        for n in storage.list(d):
            t = TaskName.try_parse(n.rsplit("/", 1)[-1])
            if t is None or t.resume < 0:
                continue
            try:
                rec = records.decode(storage.read(data_key(t.id, t.resume, "partial")))
            except Exception:  # noqa: BLE001 - moved on under us
                continue
            if rec.kind is Kind.PARTIAL:
                groups.append((f"{d}/{n}", GroupData.from_record(rec)))
    keys: dict[str, str] = {}
    for where, grp in groups:
        for tr in grp.meta.get("trajectories") or []:
            keys.update({e["key"]: where for e in Trajectory.from_dict(tr).tool_calls()})
    return keys


class PersistWatch:
    """Executions of each call at the first scan that found its result saved (and when, and
    in which record: ``<ledger>/persisted.jsonl``)."""

    def __init__(self, storage: Any, ledger: str) -> None:
        self.storage, self.ledger = storage, ledger
        self.at_persist: dict[str, int] = {}

    def scan(self) -> None:
        from strawq.demo.agentic_kv import counts

        found = saved_keys(self.storage)
        keys = set(found) - set(self.at_persist)
        if keys:
            now = counts(self.ledger, "exec")
            self.at_persist.update({k: now[k] for k in keys})
            with open(os.path.join(self.ledger, "persisted.jsonl"), "a",
                      encoding="utf-8") as f:
                for k in sorted(keys):
                    f.write(json.dumps({"t": time.time(), "key": k, "execs": now[k],
                                        "in": found[k]}) + "\n")


# -- the oracle ------------------------------------------------------------------------------

def oracle(lineage: list[dict[str, Any]], ledger: str,
           at_persist: dict[str, int]) -> dict[str, Any]:
    from strawq.demo.agentic_kv import counts, live_turn_tokens

    execs, effects = counts(ledger, "exec"), counts(ledger, "effect")
    agent_mismatch = sum(counts(ledger, "mismatch").values())
    world: list[str] = []  # trained samples disagreeing with the tool server's ledger
    trained_calls: list[str] = []
    trajectories = failed = gen_tokens = 0
    reasons: Counter[str] = Counter()
    for g in lineage:
        agentic = g.get("agentic") or {"samples": [], "failures": {}}
        for why in agentic["failures"].values():
            reasons[why.split(":", 1)[0][:80]] += 1
        for i, s in enumerate(agentic["samples"]):
            gen_tokens += int(s["gen_tokens"])
            if s["status"] == "failed":
                failed += 1
                continue
            trajectories += 1
            state: dict[str, int] = {}
            for key, args, result in s["tools"]:
                trained_calls.append(key)
                state[str(args["k"])] = int(args["v"])
                want = {"sum": sum(state.values()) % 97}
                eff = read_effect(ledger, key)
                if eff is None:
                    world.append(f"{g['id']}/{i}: call {key} has no effect in the ledger")
                elif eff["args"] != args or eff["result"] != result:
                    world.append(f"{g['id']}/{i}: call {key} recorded {args} -> {result}, "
                                 f"the ledger {eff['args']} -> {eff['result']}")
                elif result != want:
                    world.append(f"{g['id']}/{i}: call {key} answered {result}, the store "
                                 f"its calls describe gives {want}")
    twice = sorted(k for k, n in effects.items() if n > 1)
    reexec = sorted(k for k, n in at_persist.items() if execs[k] > n)
    trained = set(trained_calls)
    return {"restores": sum(counts(ledger, "restored").values()),
            # calls of a lease a newer holder took over, refused by the server unexecuted
            "fenced": sum(counts(ledger, "fenced").values()),
            # effects of episodes never trained: a trajectory begun again from its prompt
            # (nothing of it saved before a fault) calls its tools with new keys
            "effects_untrained": sum(1 for k in effects if k not in trained),
            "trajectories": trajectories, "failed_samples": failed,
            "failure_reasons": dict(reasons), "tool_calls_trained": len(trained_calls),
            "executions": sum(execs.values()), "persisted": len(at_persist),
            "effects_twice": twice, "persisted_reexecuted": reexec,
            "rerun_in_flight": sum(1 for k in trained if execs[k] > 1
                                   and k not in set(reexec)),
            "model_tokens_live": live_turn_tokens(ledger), "model_tokens_trained": gen_tokens,
            "agent_mismatches": agent_mismatch, "world_mismatches": world,
            "env_mismatches": agent_mismatch + len(world),
            "duplicate_trained_calls": len(trained_calls) - len(trained)}
