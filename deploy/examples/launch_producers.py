"""Start one producer actor per eligible Ray node for a run, and keep them reconciled.

Run it on the Ray head (or any node of the cluster) once the run exists (``strawq init``)
and the engines and router are up:

    python deploy/examples/launch_producers.py deploy/examples/run.json

It connects to the running cluster (``ray.init(address="auto")``), builds the
``ProducerConfig`` and ``PlacementConfig`` sections of the run config, starts a producer on
every alive node with CPU (K = floor(C*E/G) group slots split over them), follows nodes
joining and leaving, prints the producers' stats every ``--stats-every`` seconds, and on
SIGINT/SIGTERM stops them cleanly: each parks its groups as partial tasks first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_config import load  # noqa: E402

log = logging.getLogger("launch_producers")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run config JSON (see deploy/examples/run.json)")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--stats-every", type=float, default=60.0, help="seconds between stats lines")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import ray

    from strawq.producers.placement import ProducerPlacement

    cfg = load(args.config)
    ray.init(address=args.address)
    placement = ProducerPlacement(cfg.producer, cfg.placement, group_size=cfg.group_size)
    rep = placement.reconcile()  # ConfigError with the numbers when C*E < W*G
    log.info("started %d producers; budget K=%d, slots %s", len(rep.started),
             rep.budget.total if rep.budget else 0, rep.slots)
    placement.start_background()

    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    while not stop.wait(args.stats_every):
        if placement.last_error is not None:
            log.error("last reconcile failed: %s", placement.last_error)
        for node, st in placement.stats().items():
            log.info("node %s: %s", node[:12], json.dumps(
                {k: st.get(k) for k in ("producer_id", "slots", "groups_completed",
                                        "groups_dropped", "groups_yielded", "leases_lost",
                                        "slot_utilisation", "paused")}))
    log.info("stopping producers (they park their groups as partial tasks)")
    placement.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
