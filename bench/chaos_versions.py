"""The chaos benchmark's weight-version workloads (``chaos.py --workload stream|flow|
regenerate|old-weights``), and the "invented" check every workload runs.

A module of ``chaos.py`` (not a benchmark of its own). In these workloads the trainer
advances the weights: after every step it acknowledges the step's batches, runs a
weight-update bracket (``reader.bracket.weight_update``) that pushes the new version to both
sim engines (``/update_weights_from_disk`` through their proxies), then, every
``--interval`` steps, ``state_dict`` → save → ``commit`` (docs/api.md, the one order). A
restarted trainer loads its checkpoint and calls ``bracket.restore`` (pause → push the
restored weights as a new version → resume), so the engines never keep a version the model
no longer has. A push an engine does not take (it is dead or starting) is noted with
``bracket.mark_needing_weights``; the bracket's repair thread (``start_repairs``, every
second) pushes the run's version to every engine the producers or the trainer noted.

* ``stream`` / ``flow``: a step is ``m`` = 2 micro-batches of 2 groups (the collector runs
  ``strawq.demo.schedule.collector_config`` of that mode: one version per 2 batches); flow
  acknowledges each micro-batch as soon as it is trained, the checkpoint covers whole steps.
* ``regenerate``: ``async`` with ``eta_mode=regenerate`` and η = 1: a partial whose prefix
  is over η when claimed, and a ready group over η at batch time, is generated afresh; the
  regenerations of the trained groups are counted (their task names count them).
* ``old-weights``: ``async``; an engine the nemesis kills comes back on version 0 (the
  other workloads restart it on the run's current version, as a supervisor reloading the
  newest weights would). Producers take it out of rotation (``VersionGuard``), the trainer's
  repair pushes it the run's version.

The checks, beside the total-queue and storage checks of every workload:

* **invented** (every workload): the trainer records each trained sample's response tokens
  and their per-token weight versions; the proxies record every ``/generate`` answer's
  ``output_ids`` and per-token versions (``meta_info.weight_versions``) by task and sample.
  A trained sample is *invented* unless its response is a concatenation of answers for its
  task and sample (one answer, or several: a partial resumed across updates and leases);
* **versions wrong**: a sample whose tokens are such a concatenation, but no such
  concatenation also carries the per-token versions the group record states (a token
  trained as generated on a version it was not generated on).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chaos_fleet import write_json_atomic  # (bench/ is sys.path[0])

#: the workloads of this module
VERSIONED = ("stream", "flow", "regenerate", "old-weights")


@dataclass(frozen=True)
class Spec:
    #: the schedule (strawq.demo.schedule): async, stream or flow
    mode: str
    eta_mode: str = "train"
    max_staleness: int = 1
    #: micro-batches per step (stream, flow)
    micro: int = 1
    #: engines killed by the nemesis restart on version 0
    old_weights: bool = False
    #: the trainer's step time, s (old-weights: long enough that a restarted engine serves
    #: on version 0 before the next update's push reaches it)
    step_s: float = 0.1


SPECS = {"stream": Spec("stream", micro=2), "flow": Spec("flow", micro=2),
         "regenerate": Spec("async", eta_mode="regenerate", max_staleness=1),
         "old-weights": Spec("async", old_weights=True, step_s=1.0)}
#: groups per step (B)
BATCH_GROUPS = 4


def collector_sets(workload: str, slots: int = 8) -> list[str]:
    """The collector's ``--set`` arguments: ``collector_config`` of the workload's schedule,
    with its ``eta_mode``."""
    from strawq.collector.config import CollectorConfig
    from strawq.demo.schedule import ScheduleConfig, collector_config

    spec = SPECS[workload]
    cfg = collector_config(ScheduleConfig(mode=spec.mode, batch_groups=BATCH_GROUPS,
                                          micro_batches=spec.micro, slots=slots,
                                          max_staleness=spec.max_staleness))
    base = CollectorConfig()
    out: list[str] = []
    for name in ("batch_groups", "batches_per_version", "max_staleness", "admission_batches",
                 "max_running", "max_ready", "max_prefetch_batches"):
        value = getattr(cfg, name)
        if value != getattr(base, name) or name in ("batch_groups", "max_prefetch_batches"):
            out += ["--set", f"{name}={json.dumps(value)}"]
    return [*out, "--set", f"eta_mode={spec.eta_mode}"]


def engine_version(workload: str, run: str) -> int:
    """The version a restarted engine comes up on: 0 (old-weights) or the run's."""
    if SPECS[workload].old_weights:
        return 0
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    return RunQueue.open(open_storage(run, writer_id="chaos-engines")).current_version()


# -- the trainer role ------------------------------------------------------------------------

def runs(versions: Sequence[int]) -> list[list[int]]:
    """Per-token versions as ``[[version, count], ...]``."""
    out: list[list[int]] = []
    for v in versions:
        if out and out[-1][0] == int(v):
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def expand(spans: Iterable[Sequence[int]]) -> tuple[int, ...]:
    return tuple(v for v, n in spans for _ in range(n))


def trained_samples(grp: Any, *, masked: bool = False) -> list[dict[str, Any]]:
    """A group record's samples as the check reads them: response tokens (``t``) and their
    versions (``v``, runs). ``masked``: only the tokens the loss trains (the model's own in
    a trajectory with appended tool tokens)."""
    out = []
    for i in range(grp.num_samples):
        c = grp.sample(i)
        keep = c["loss_mask"] == 1 if masked else slice(None)
        out.append({"t": c["tokens"][keep].tolist(), "v": runs(c["versions"][keep].tolist())})
    return out


def trainer(run: str, ckpt: str, events: str, interval: int, step_s: float, done: str,
            engines: list[str], workload: str) -> int:
    from strawq.collector.errors import BatchTimeout, RunFinished
    from strawq.collector.trainer.reader import Batch, BatchReader
    from strawq.errors import StrawqError

    spec = SPECS[workload]

    def log(**ev: Any) -> None:
        with open(events, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), **ev}) + "\n")

    def push_to(urls: list[str], version: int, event: str = "push") -> list[str]:
        failed = []
        body = json.dumps({"model_path": f"chaos-v{version}", "weight_version": str(version),
                           "abort_all_requests": False, "flush_cache": True}).encode()
        for url in urls:
            req = urllib.request.Request(f"{url}/update_weights_from_disk", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    ok = json.load(r).get("success", True)
            except (OSError, ValueError):
                ok = False
            if not ok:
                failed.append(url)
        log(event=event, version=version, urls=urls, failed=failed)
        return failed

    missed: list[str] = []

    def push(version: int) -> None:
        missed[:] = push_to(engines, version)

    def noted() -> None:  # engines the push missed: the repair thread pushes them later
        if missed:
            reader.bracket.mark_needing_weights(list(missed), reason="push_failed")

    reader = BatchReader.open(run)
    reader.bracket.engine_urls = list(engines)
    model: list[dict[str, Any]] = []
    steps = 0
    state: dict[str, Any] = {"batch_seq": 0, "version": 0}
    if os.path.exists(ckpt):
        with open(ckpt, encoding="utf-8") as f:
            saved = json.load(f)
        model, steps, state = saved["model"], saved["steps"], saved["strawq"]
        reader.load_state_dict(state)
    log(event="start", pid=os.getpid(), steps=steps)
    if (os.path.exists(ckpt) or reader.queue.current_version() > 0
            or reader.bracket.is_open):
        # the engines may hold weights trained after the checkpoint (lost with the crash)
        rep = reader.bracket.restore(push, state, timeout=600)
        noted()
        log(event="restore", version=rep.version, checkpoint_version=state.get("version"))
    reader.bracket.start_repairs(lambda urls, v: push_to(urls, v, "repair"), interval_s=1.0)

    def checkpoint() -> None:
        st = reader.state_dict()
        write_json_atomic(ckpt, {"model": model, "steps": steps, "strawq": st})
        reader.commit(st)
        log(event="ckpt", steps=steps, seq=st["batch_seq"], version=st["version"])

    def update() -> None:
        while True:
            try:
                reader.bracket.weight_update(push, timeout=600)
                break
            except StrawqError as exc:  # e.g. a repair push in the way: try again
                log(event="update_failed", error=str(exc))
                time.sleep(0.2)
        noted()

    step_batches: list[Batch] = []
    while True:
        try:
            batch = reader.next_batch(timeout=0.5)
        except (BatchTimeout, RunFinished) as exc:
            # the run has finished (every batch acked): the collector waits for the last
            # commit before it exits, so commit it now rather than at `done`
            if isinstance(exc, RunFinished) or os.path.exists(done):
                if step_batches:  # the last, short step
                    for b in step_batches:
                        if spec.mode != "flow":
                            reader.ack(b)
                    steps += 1
                    update()
                checkpoint()
                return 0
            continue
        groups = []
        for name in batch.groups:
            grp = reader.queue.read_group(name.id, name.gen)
            groups.append({"id": name.id, "gen": name.gen, "regen": name.regenerations,
                           "tokens": int(sum(grp.sample_lens)),
                           "samples": trained_samples(grp)})
        time.sleep(step_s / spec.micro)  # the optimizer's share of the step
        model.append({"seq": batch.seq, "groups": groups})
        log(event="batch", seq=batch.seq, step=steps + 1, ids=[g["id"] for g in groups],
            version=batch.version)
        step_batches.append(batch)
        if spec.mode == "flow":  # acked as soon as trained; a commit covers it later
            reader.ack(batch)
        if len(step_batches) < spec.micro:
            continue
        for b in step_batches:
            if spec.mode != "flow":
                reader.ack(b)
        step_batches = []
        steps += 1
        update()
        if steps % interval == 0:
            checkpoint()


# -- the checks ------------------------------------------------------------------------------

#: (task, sample, gen, output ids, their versions, time) (chaos_proxy.Tally.outputs)
Output = tuple[str, int, int, tuple[int, ...], tuple[int, ...], float]


def _chains(resp: Sequence[Any], pieces: list[tuple[float, tuple[Any, ...]]]) -> bool:
    """Whether ``resp`` is a concatenation of ``pieces`` (time, tokens), in the order the
    engines returned them (a continuation is answered after the answer it continues)."""
    if not resp:
        return True
    by_first: dict[Any, list[tuple[float, tuple[Any, ...]]]] = defaultdict(list)
    for t, p in pieces:
        if p:
            by_first[p[0]].append((t, p))
    # per position: the earliest time a chain of answers reaching it ended (earliest is
    # best: every continuation a later chain can take, it can take too)
    inf = float("inf")
    reach = [inf] * (len(resp) + 1)
    reach[0] = -inf
    for pos in range(len(resp)):
        if reach[pos] == inf:
            continue
        for t, p in by_first.get(resp[pos], ()):
            end = pos + len(p)
            if end <= len(resp) and reach[pos] < t < reach[end] \
                    and tuple(resp[pos:end]) == p:
                reach[end] = t
    return reach[len(resp)] < inf


def invented(lineage: list[dict[str, Any]], outputs: list[Output]
             ) -> tuple[list[str], list[str], int]:
    """Trained samples that are no concatenation of their engines' answers (``invented``),
    those whose tokens are but whose per-token versions are not (``versions wrong``), and
    the samples checked."""
    answers: dict[tuple[str, int], list[tuple[float, tuple[int, ...], tuple[int, ...]]]] \
        = defaultdict(list)
    for task, i, _gen, ids, vers, t in outputs:
        answers[(task, i)].append((t, ids, vers))
    bad: list[str] = []
    wrong: list[str] = []
    checked = 0
    for g in lineage:
        for i, s in enumerate(g.get("samples") or []):
            checked += 1
            mine = answers.get((g["id"], i), [])
            resp = s["t"]
            if not _chains(resp, [(t, ids) for t, ids, _v in mine]):
                bad.append(f"{g['id']}.g{g['gen']}/{i}")
                continue
            both = list(zip(resp, expand(s["v"]), strict=True))
            if not _chains(both, [(t, tuple(zip(ids, v, strict=True))) for t, ids, v in mine]):
                wrong.append(f"{g['id']}.g{g['gen']}/{i}")
    return bad, wrong, checked


def report_lines(workload: str, ch: Any, res: dict[str, Any]) -> list[str]:
    """The workload's own figures, printed before its last line."""
    events = [json.loads(line) for line in open(ch.events, encoding="utf-8")]
    lineage = res["lineage"]
    versions = [e["version"] for e in events if e["event"] == "push"]
    pushes = [e for e in events if e["event"] == "push"]
    repairs = [e for e in events if e["event"] == "repair"]
    restores = sum(1 for e in events if e["event"] == "restore")
    multi = sum(1 for g in lineage for s in g["samples"] if len(s["v"]) > 1)
    lines = [f"{workload}: {res['steps']} steps, weights advanced to version "
             f"{max(versions, default=0)} ({len(pushes)} pushes, "
             f"{sum(len(e['failed']) for e in pushes)} engines missed, {restores} restores "
             f"from a checkpoint, {len(repairs)} repair pushes to "
             f"{sum(len(e['urls']) for e in repairs)} engines); {multi} trained samples span "
             f"several versions (resumed across an update); "
             f"{res['invented_checked']} samples checked, versions wrong = "
             f"{len(res['versions_wrong'])}"]
    if workload == "regenerate":
        tasks = [g for g in lineage if g.get("regen")]
        lines.append(f"regenerate: {len(tasks)} trained groups were regenerated past η "
                     f"({sum(g['regen'] for g in tasks)} regenerations)")
    if workload == "old-weights":
        restarts = sum(1 for f in ch.faults if f.victim.startswith("engine")
                       and f.kind == "kill9")
        first = min((e["t"] for e in pushes), default=float("inf"))
        with ch.tally.lock:
            old = sum(1 for o in ch.tally.outputs if o[5] > first + 1.0 and max(o[4]) == 0)
        lines.append(f"old-weights: {restarts} engine restarts on version 0, {old} answers "
                     f"on version 0 after the first update (discarded by the producers' "
                     f"version guard unless trained with those versions), "
                     f"{len(repairs)} repair pushes")
    return lines
