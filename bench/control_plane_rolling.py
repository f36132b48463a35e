"""A rolling weight update's control plane, counted at the metadata server (``bench/scale.py
--control-plane``; ``bench/control_plane.py`` has the counter and the run).

In the rolling mode (``WeightUpdateBracket(weight_update="rolling")``) an update parks no
group: the trainer publishes ``weights/manifest-<v>`` once and announces v, and each
producer loads its engines a wave slot at a time (``producers/rolling.py``). What reaches
the metadata server is the producers' own steps while they are behind, and each engine's
slot. Counted here with the project's own ``RollingPull`` (client B) against a manifest
published on client A, the wave held full at its real width (``weights/`` lists that many
slot names), each sampled producer with ``engines_per_node`` fake engines behind the
version (they are never loaded: a load is the engine's, not the metadata server's):

- **full step**: a producer's step reading everything (the newest manifest, the run's
  version and lag, ``control/``, the version's verdicts, a claim attempt for an engine
  behind, here finding the wave full); made when the producer sees the version (and once
  more at its first look at ``versions/``), every ``FULL_STEP_S`` while behind, and once
  its last load ended;
- **look**: one look for a free slot (``RollingPull.look_for_slots``, a listing of
  ``weights/``), after ``WAVE_RETRY_S`` while an engine waits, the wait doubling to
  ``WAVE_RETRY_MAX_S``, and when one of the producer's own loads ends;
- **claim and release a slot**: once per engine (with slots free);
- **read every slot (before)**: what a claim read before the names alone were used
  (``WeightStore.slots``: the listing and every held slot's record), which the step made at
  every ``control_poll_s`` (0.1 s) poll while the producer was behind.

Rates at one update (``rolling_counts``): ``engines = producers x engines_per_node``, the wave
``wave_width(wave, engines)``, the update lasting ``ceil(engines / wave) x load_s``; a
producer is behind for ``E / (E + 1)`` of it on average (its last engine's load ends
there). Not counted: the attestation verdicts (one record per load when the trainer
publishes fingerprints), the weights' own reads (the data plane) and a delta's build.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from control_plane import Counter, Run

from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.weights.publish import WAVES, WEIGHTS_DIR, WeightStore, wave_width

FULL = "rolling: full step (wave full)"
LOOK = "rolling: look for a slot (wave full)"
CLAIM = "rolling: claim and release a slot"
SLOTS = "rolling: read every slot (before)"


@dataclass(frozen=True)
class Rolling:
    """One rolling update at the run's size."""

    engines: int
    wave: int
    seconds: float
    behind_s: float


def shape(run: Run) -> Rolling:
    engines = run.producers * run.engines_per_node
    wave = wave_width(run.wave, engines)
    seconds = math.ceil(engines / wave) * run.load_s
    e = run.engines_per_node
    return Rolling(engines, wave, seconds, seconds * e / (e + 1))


def looks(seconds: float) -> int:
    """Looks for a slot a producer makes waiting ``seconds`` (the mean producer's spread,
    1x): after ``WAVE_RETRY_S``, the wait doubling after each to ``WAVE_RETRY_MAX_S``."""
    from strawq.producers.rolling import WAVE_RETRY_MAX_S, WAVE_RETRY_S

    n, t, wait = 0, 0.0, WAVE_RETRY_S
    while t + wait <= seconds:
        t += wait
        n += 1
        wait = min(2 * wait, WAVE_RETRY_MAX_S)
    return n


def rolling_counts(run: Run, *, before: bool = False) -> dict[str, float]:
    """Each operation's count at one rolling update (``before``: the step at every poll).
    Now, per producer: a full step when it sees the version, one more at its first look at
    ``versions/``, one every ``FULL_STEP_S`` while behind and one when its last load ends
    (a producer waiting 100 s on a wave held full made 5); a look at each of its loads' ends and
    on the doubling wait (``looks``); a slot per engine."""
    from strawq.producers.producer_config import TimingConfig
    from strawq.producers.rolling import FULL_STEP_S

    r = shape(run)
    if before:
        polls = run.producers * r.behind_s / TimingConfig().control_poll_s
        return {FULL: polls, SLOTS: polls, CLAIM: r.engines}
    full = run.producers * (3 + r.behind_s / FULL_STEP_S)
    look = run.producers * (run.engines_per_node + looks(r.behind_s))
    return {FULL: full, LOOK: look, CLAIM: r.engines}


class _Behind:
    """A producer's engines, all behind the published version (never loaded here)."""

    router_url = None

    def __init__(self, n: int, producer: int) -> None:
        self.worker_urls = [f"http://n{producer}-e{k}" for k in range(n)]

    async def weight_version(self, url: str) -> int:
        return 0

    async def push_weights(self, model_path: str, *, weight_version: int,
                           url: str | None = None) -> dict[str, Any]:
        raise AssertionError("the wave is full: nothing is loaded")


def measure_rolling(counter: Counter, run: Run, q_a: RunQueue, root_b: str,
                    pids: list[int]) -> Rolling:
    """Count each operation of a rolling update (module docstring); returns its shape."""
    from strawq.producers.engine_versions import VersionGuard
    from strawq.producers.meter import ProducerStats, StatsBook
    from strawq.producers.rolling import RollingPull
    from strawq.weights.engine_weights import EngineWeights

    r = shape(run)
    weights = tempfile.mkdtemp(prefix="cp-weights-")
    with open(os.path.join(weights, "model.safetensors"), "wb") as f:
        f.write(b"w" * 4096)
    store_a = WeightStore(q_a.storage)
    version = q_a.current_version() + 1
    m = store_a.publish(version, weights, wave=r.wave, max_lag=1)
    q_a.set_version(version)
    slot = records.encode(Kind.STATE, {"holder": "other", "url": "http://other", "at": 0.0})
    for k in range(r.wave):  # the wave held full, at its real width
        q_a.storage.publish(f"{WEIGHTS_DIR}/{WAVES.name(version, k)}", slot, sync_dir=False)
    print(f"  rolling: version {version} published, its wave of {r.wave:,} slots held full "
          f"({r.engines:,} engines, {run.engines_per_node} a producer)", flush=True)

    async def io(fn: Any) -> Any:
        return fn()

    pulls = {}
    for i in pids:
        q = RunQueue.open(PosixStorage(os.path.join(root_b, "run"), writer_id=f"p{i}"))
        client = _Behind(run.engines_per_node, i)
        book = StatsBook(ProducerStats())
        guard = VersionGuard(f"p{i}", client=lambda c=client: c,
                             current_version=q.current_version,
                             notes=EngineWeights(q.storage), io=io, pausing=lambda: False,
                             book=book)
        pulls[i] = RollingPull(f"p{i}", store=WeightStore(q.storage),
                               client=lambda c=client: c, guard=guard, io=io, book=book,
                               clock=lambda: 0.0, poll_s=0.0)

    def full(i: int) -> int:
        asyncio.run(pulls[i].step())
        if pulls[i].pulls or not pulls[i]._waiting:
            raise RuntimeError(f"producer p{i}: the wave was not found full")
        return 1

    counter.measure("update", FULL, full, pids)
    counter.measure("update", LOOK, lambda i: asyncio.run(pulls[i].look_for_slots(m)), pids)
    # every held slot's record read: one wave's worth a call, the same for every producer
    # (a few are enough; at 10,000 GPUs each call is 2,500 reads)
    counter.measure("update", SLOTS, lambda i: pulls[i].store.slots(version), pids[:8])
    for k in range(min(len(pids), r.wave)):  # slots free for the claims
        q_a.storage.delete(f"{WEIGHTS_DIR}/{WAVES.name(version, k)}")

    def claim(i: int) -> int:
        store = pulls[i].store
        k = store.claim_slot(m, f"p{i}", f"http://n{i}-e0", check_url=False)
        if k is None:
            raise RuntimeError(f"producer p{i} found no free slot")
        store.release_slot(version, k)
        return k

    counter.measure("update", CLAIM, claim, pids)
    return r
