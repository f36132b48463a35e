"""The chaos benchmark's slime workload (``chaos.py --workload slime``): slime's own rollout
path driving the queue, its trainer a victim of the nemesis.

A module of ``chaos.py`` (not a benchmark of its own). The producers, engines and collector
are the default workload's; the trainer (``chaos.py --role slime-trainer``) is the loop of
slime's ``train.py`` with strawq's mode 2 (docs/slime.md), on slime's real objects:

* at start, what slime's ``create_training_models`` does: the model checkpoint named by
  ``latest_checkpointed_iteration.txt`` (Megatron's tracker file) gives the last rollout c
  it holds, the loop starts at c + 1, and the data source (``StrawqBatchSource``, slime's
  ``DataSource``) is ``load(c)`` (``load(-1)`` on a fresh start);
* then ``update_weights()``, as ``train.py`` does before its loop: the weights are
  "written", slime's post-write hook runs (``begin_weight_update_hook``: the bracket opens,
  the producers pause), the engines load the new version (``/update_weights_from_disk`` on
  each sim engine, retried while an engine is restarting) — the bracket is closed by the next
  rollout;
* per rollout: slime's ``call_rollout_fn(generate_rollout, args, rollout_id, data_source)``
  (the bracket closed by what the engines hold, the batches of rollout − 1 acked, the next
  batch as slime ``Sample`` groups), slime's own ``_convert_samples_to_train_data`` (its
  reward post-processing through ``reward_post_process``), the optimizer step (a sleep),
  every ``--interval`` rollouts the model checkpoint (``iter_<c>.json``, then the tracker
  file, each atomic) and ``data_source.save(c)`` — slime's order —, then
  ``update_weights()``.

The model checkpoint holds the lineage (the groups trained, rollout by rollout), so the
default workload's total-queue check applies: every dataset row trained once in the final
checkpoint's lineage, or dropped with a reason. A restarted engine comes up on the newest
version the trainer pushed (``<work>/weights/latest``: an engine that loads the latest
weights from disk when it starts), so a bracket can be closed by what the engines hold.
The job's end (the ``done`` file and no batch): the last rollouts saved, then
``reader.commit()`` (``StrawqBatchSource.save`` commits the checkpoint before its own, so
that a model checkpoint written asynchronously is complete before its batches are freed:
the last one is committed when the job ends).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from chaos_fleet import write_atomic  # (bench/ is sys.path[0])

PY = sys.executable
CHAOS = str(Path(__file__).with_name("chaos.py"))
TRACKER = "latest_checkpointed_iteration.txt"


def final_model(ckpt_dir: str) -> dict[str, Any]:
    """The newest model checkpoint (by the tracker file): ``{"model", "steps", "rollout"}``;
    an empty lineage when none was written."""
    tracker = os.path.join(ckpt_dir, TRACKER)
    if not os.path.exists(tracker):
        return {"model": [], "steps": 0, "rollout": -1}
    with open(tracker, encoding="utf-8") as f:
        c = int(f.read().strip())
    with open(os.path.join(ckpt_dir, f"iter_{c:07d}.json"), encoding="utf-8") as f:
        saved: dict[str, Any] = json.load(f)
    return saved


def push_weights(engines: list[str], version: int, latest: str,
                 deadline_s: float = 60.0) -> None:
    """The engines load ``version`` (sim engines: ``/update_weights_from_disk``); the
    version is first recorded in ``latest`` for an engine that starts meanwhile."""
    write_atomic(latest, str(version))
    body = json.dumps({"model_path": "chaos", "weight_version": str(version),
                       "abort_all_requests": False, "flush_cache": True}).encode()
    for url in engines:
        end = time.time() + deadline_s
        while True:
            req = urllib.request.Request(f"{url}/update_weights_from_disk", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=10).read()
                break
            except (urllib.error.URLError, OSError):
                if time.time() > end:
                    raise
                time.sleep(0.1)  # restarting (it starts on ``latest``, or takes the push)
    time.sleep(0.2)  # a push takes a while: the producers stay paused meanwhile


def engine_argv(argv: list[str], latest: str) -> list[str]:
    """``argv`` started on the newest pushed version (``latest``; 0 before any push)."""
    return ["sh", "-c", 'exec "$@" --weight-version "$(cat "$0" 2>/dev/null || echo 0)"',
            latest, *argv]


def slime_trainer(run: str, ckpt_dir: str, events: str, interval: int, step_s: float,
                  done: str, engines: list[str], latest: str) -> int:
    from chaos_versions import runs  # (bench/ is sys.path[0])
    from slime.rollout.base_types import call_rollout_fn

    from strawq.collector.errors import BatchTimeout, RunFinished
    from strawq.collector.integrations import slime as adapter
    from strawq.collector.integrations.slime.adapter import _ReaderState
    from strawq.collector.integrations.slime.samples import META
    from strawq.testing.slime_train import RolloutManager, flatten
    from strawq.weights.control import read_state

    def log(**ev: Any) -> None:
        with open(events, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), **ev}) + "\n")

    os.makedirs(ckpt_dir, exist_ok=True)
    args = argparse_namespace(run, ckpt_dir)
    data_source = adapter.StrawqBatchSource(args)
    saved = final_model(ckpt_dir)
    model: list[dict[str, Any]] = saved["model"]
    steps: int = saved["steps"]
    start = int(saved["rollout"]) + 1
    data_source.load(start - 1)  # slime: rollout_manager.load(args.start_rollout_id - 1)
    reader = _ReaderState.reader(run)
    log(event="start", steps=steps, rollout=start)

    def update_weights() -> None:
        """slime's ``actor_model.update_weights()`` with disk transfer: the weights written,
        the post-write hook (the bracket opens), the engines load them."""
        adapter.begin_weight_update_hook(args, os.path.join(ckpt_dir, "weights"), engines)
        push_weights(engines, read_state(reader.queue.storage).pause_version, latest)

    def save(rollout_id: int) -> None:
        """slime's order: the model checkpoint (then its tracker file), then the data
        source's ``save``."""
        body = {"model": model, "steps": steps, "rollout": rollout_id}
        write_atomic(os.path.join(ckpt_dir, f"iter_{rollout_id:07d}.json"), json.dumps(body))
        write_atomic(os.path.join(ckpt_dir, TRACKER), str(rollout_id))
        data_source.save(rollout_id)
        log(event="ckpt", steps=steps, rollout=rollout_id)

    update_weights()  # train.py pushes the (restored) weights before its loop
    rollout_id, saved_at = start, start - 1
    while True:
        try:
            out = call_rollout_fn(adapter.generate_rollout, args, rollout_id, data_source,
                                  evaluation=False)
        except (BatchTimeout, RunFinished) as exc:
            # the run has finished (every batch acked): the collector waits for the last
            # commit before it exits, so commit it now rather than at `done`. The job ends:
            # its last rollouts saved and committed
            if isinstance(exc, RunFinished) or os.path.exists(done):
                if saved_at < rollout_id - 1:
                    save(rollout_id - 1)
                reader.commit()
                return 0
            continue
        RolloutManager(args)._convert_samples_to_train_data(flatten(out.samples))
        groups = []
        for g in out.samples:
            meta = g[0].metadata[META]
            if meta.get("padding"):
                continue
            groups.append({"id": meta["task_id"], "gen": -1,
                           "tokens": int(sum(s.response_length for s in g)),
                           # what slime trains, for the "invented" check
                           "samples": [{"t": list(s.tokens[len(s.tokens) - s.response_length:]),
                                        "v": runs(list(s.metadata[META]["versions"]))}
                                       for s in g]})
        seq = int(out.metrics["strawq/batch_seq"])
        time.sleep(step_s)  # the optimizer step
        model.append({"seq": seq, "rollout": rollout_id, "groups": groups})
        steps += 1
        log(event="batch", seq=seq, step=steps, rollout=rollout_id,
            ids=[g["id"] for g in groups])
        if (rollout_id + 1) % interval == 0:  # slime's should_run_periodic_action
            save(rollout_id)
            saved_at = rollout_id
        update_weights()
        rollout_id += 1


def argparse_namespace(run: str, ckpt_dir: str) -> Any:
    """The slime arguments this loop uses (slime's own parser needs Megatron)."""
    from types import SimpleNamespace

    from strawq.collector.integrations import slime as adapter
    return SimpleNamespace(
        strawq_run=run, save=ckpt_dir, load=ckpt_dir, rollout_batch_size=4,
        n_samples_per_prompt=4, custom_reward_post_process_path=adapter.REWARD_POST_PROCESS,
        advantage_estimator="grpo", strawq_ack_lag=1, strawq_batch_timeout_s=0.5,
        strawq_bracket_timeout_s=120.0, rollout_global_dataset=True)


def setup(ch: Any) -> None:
    """Point the chaos run's trainer at this loop and its engines at the pushed version."""
    ch.ckpt = str(ch.work / "slime-ckpt")
    latest = str(ch.work / "weights-latest")
    engines = [f"http://127.0.0.1:{port}" for port in ch.engine_ports]
    for i in range(2):
        proc = ch.procs[f"engine{i}"]
        proc.argv = engine_argv(proc.argv, latest)  # its restarts; its first start was at 0
    ch.procs["trainer"].argv = [
        PY, CHAOS, "--role", "slime-trainer", "--run", ch.path(1), "--ckpt", ch.ckpt,
        "--events", ch.events, "--interval", str(ch.interval), "--step-s", str(ch.step_s),
        "--done", ch.done, "--latest", latest, "--engines", ",".join(engines)]
