"""Fleet seconds lost per failure when the collector is killed with -9 and not yet reaped.

A collector process (``strawq collector``) holds a run; it is killed with ``kill -9`` and its
parent (this script, as a supervisor that has not called ``wait`` yet) leaves it a zombie: its
pid still answers ``kill(pid, 0)``. A restarted collector then takes over. Until it holds the
run, no batch is published: the trainer waits (the fleet loses that time). Three cases, each
measured in this run:

* **anchor** — the killed holder was reaped (its pid is gone): the same-host fast path takes
  over at once;
* **zombie, judged alive** — liveness as it was before zombies counted as dead
  (``strawq.liveness._zombie`` patched to say no): the takeover waits the whole
  ``takeover_timeout_s`` of heartbeat silence;
* **zombie, judged dead** — liveness now: ``/proc/<pid>/stat`` state ``Z`` is dead.

Printed as ``zombie_takeover: fleet seconds lost per failure = X (was Y)`` (the zombie case now),
with the before/after figures and their ratios to the anchor. ``--quick`` uses a 3 s
takeover timeout instead of the collector's default 30 s.

    python bench/zombie_takeover.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _holder(run: str, dataset: str, takeover_s: float) -> subprocess.Popen[bytes]:
    """A collector process that holds ``run`` (epoch record written) and keeps running."""
    from strawq.storage import open_storage
    from strawq.tasks.epochs import epochs, list_names

    storage = open_storage(run, writer_id="bench")
    before = epochs(list_names(storage))
    proc = subprocess.Popen(
        [sys.executable, "-m", "strawq", "collector", run, dataset, "--forever", "-q",
         "--set", f"takeover_timeout_s={takeover_s}", "--set", "poll_interval_s=0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while epochs(list_names(storage)) == before:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the holder collector did not take the run")
        time.sleep(0.02)
    return proc


def _zombie(proc: subprocess.Popen[bytes]) -> None:
    """Kill -9 and wait (without reaping) until the kernel shows it as a zombie."""
    proc.kill()
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[0] == b"Z":
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the killed collector never showed as a zombie")
        time.sleep(0.01)


def _takeover_s(run: str, dataset: str, takeover_s: float) -> float:
    """Seconds until a new collector holds the run."""
    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.data.dataset import Dataset

    start = time.monotonic()
    col = Collector.open(run, Dataset(dataset), CollectorConfig(takeover_timeout_s=takeover_s),
                         fsync=False, owner="bench-new")
    took = time.monotonic() - start
    col.close()
    return took


def measure(work: Path, takeover_s: float) -> dict[str, Any]:
    from strawq.config import QueueConfig
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    run, dataset = str(work / "run"), str(work / "d.jsonl")
    with open(dataset, "w", encoding="utf-8") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": [3 + i % 90, 5, 7]}) + "\n")
    RunQueue.create(open_storage(run, writer_id="bench"), QueueConfig(group_size=4))
    out: dict[str, Any] = {"takeover_timeout_s": takeover_s}
    for case in ("anchor", "zombie_alive", "zombie_dead"):
        proc = _holder(run, dataset, takeover_s)
        if case == "anchor":
            proc.kill()
            proc.wait()  # reaped: the pid is gone
            out[case] = _takeover_s(run, dataset, takeover_s)
            continue
        _zombie(proc)
        try:
            if case == "zombie_alive":
                with mock.patch("strawq.liveness._zombie", return_value=False):
                    out[case] = _takeover_s(run, dataset, takeover_s)
            else:
                out[case] = _takeover_s(run, dataset, takeover_s)
        finally:
            proc.wait()
    anchor = max(out["anchor"], 1e-3)
    out["ratio_before"] = out["zombie_alive"] / anchor
    out["ratio_after"] = out["zombie_dead"] / anchor
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 3 s takeover timeout (default 30)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    takeover_s = 3.0 if args.quick else 30.0
    with tempfile.TemporaryDirectory(prefix="strawq-zombie-") as tmp:
        r = measure(Path(tmp), takeover_s)
    if args.json:
        print(json.dumps(r, indent=2, sort_keys=True))
        return 0
    print(f"before (a zombie judged alive): {r['zombie_alive']:.2f} s = "
          f"{r['ratio_before']:.1f}x the anchor (a reaped holder, {r['anchor']:.2f} s); after: "
          f"{r['zombie_dead']:.2f} s = {r['ratio_after']:.1f}x; takeover_timeout_s "
          f"{takeover_s:.0f}")
    print(f"zombie_takeover: fleet seconds lost per failure = {r['zombie_dead']:.2f} "
          f"(was {r['zombie_alive']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
