"""``strawq lab``: argument parsing only; the work is in ``strawq.demo.lab``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

LAB_HELP = """\
Compare the rollout schedules (sync, partial, async, stream, flow) side by side at the scale of a
64-GPU job, with every part of strawq running for real except the engines and the trainer:
the queue on disk, the collector, one producer process per emulated node, the weight-update
bracket and the reader API. Engines are the `sim` timing model (decode step =
step_base_ms + step_per_req_ms x batch, lognormal response lengths with a spike at the cap);
E engines of C slots are emulated by P sim processes (each serves k = E/P engines' slots,
with step_per_req_ms and prefill cost divided by k so one step still costs what one
engine's step costs). The trainer sleeps --train-step-s per step. --time-scale stretches or
compresses every simulated duration; the report is in model seconds.

Prints one table (trained tokens/s, trainer wait ratio, engine utilisation,
rollout-to-train-end per step, staleness, multi-version share, generated/trained tokens,
and the ratios against sync), and writes under --workdir: lab.json (every row and the
configuration that produced it), <mode>/timeline.png, <mode>/row.json, <mode>/run/ (the
queue, audited at the end: every released prompt trained once, dropped with a reason, or
still queued).

The "stretch" column is the CPU check: measured wall time per generated token of a busy
slot / the modelled decode step. Near 1 the box keeps up; well above 1 the lab measures
the CPU, not the schedule: lower --concurrency or raise --time-scale. See docs/lab.md.
"""

#: argparse dest -> LabConfig field (same names), with types and help
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("engines", int, "E: emulated rollout engines (default 48)"),
    ("concurrency", int, "C: concurrent requests per engine (default 16)"),
    ("sim_processes", int, "P: sim processes serving the E engines (default 2)"),
    ("producers", int, "W: producer processes = emulated nodes (default 2)"),
    ("group_size", int, "G: samples per prompt (default 16)"),
    ("batch_groups", int, "B: groups per training step (default 96)"),
    ("steps", int, "training steps per mode (default 8)"),
    ("train_step_s", float, "trainer step time, model seconds (default 4.0)"),
    ("max_staleness", int, "async/stream admission staleness bound eta (default 1)"),
    ("eta_mode", str, "hard (default: a batch waits for the groups due by its version) or "
     "train (soft: over-eta groups trained and counted)"),
    ("oversample", float, "partial: groups admitted per step / B (default 1.5)"),
    ("micro_batches", int, "stream: micro-batches per step (default 8)"),
    ("flow_micro_batches", int, "flow: micro-batches per step, acked as trained (default 8)"),
    ("admission_batches", float, "async/stream/flow: admission window in micro-batches "
     "(default: (eta + 1)·m micro-batches for every mode)"),
    ("step_base_ms", float, "decode step base cost, model ms (default 20)"),
    ("step_per_req_ms", float, "decode step cost per running request of one engine"),
    ("prefill_ms_per_token", float, "prefill cost per input token of one engine"),
    ("prompt_len", int, "prompt tokens"),
    ("len_median", float, "median response length, tokens"),
    ("len_sigma", float, "lognormal sigma of response lengths"),
    ("len_cap", int, "response cap (max_new_tokens)"),
    ("cap_prob", float, "share of responses that run to the cap (default 0.03)"),
    ("time_scale", float, "wall seconds per model second (default 1.3)"),
    ("seed", int, "seed of the dataset and of every sample"),
    ("reward", str, "count (count_task, default) or difficulty (difficulty_task: rows with a "
     "p_solve)"),
    ("never_solved_share", float, "difficulty: share of rows at p_solve 0 (default 0.2)"),
    ("always_solved_share", float, "difficulty: share of rows at p_solve 1 (default 0.2)"),
    ("prompt_scale_sigma", float, "per-prompt length scale of the sim engines, lognormal of "
     "mean 1 (default 0: off)"),
    ("dataset_rows", int, "dataset rows (default: enough for every step in one pass)"),
    ("num_epochs", int, "passes over the dataset (queue.num_epochs, default 1)"),
    ("zero_variance_revisit_epochs", int, "passes after a zero-variance group at which its "
     "row comes back (default 2)"),
    ("weight_update", str, "bracket (default: pause every producer, push every engine) or "
     "rolling (publish once, engines load it in waves, lag <= eta)"),
    ("rolling_wave", float, "rolling: engines that load at once, a count (>= 1) or a share "
     "of the fleet (default 0.25)"),
    ("publish_dir", str, "rolling: a directory every engine reads, where each version is "
     "copied whole or as a delta (default: none, the trainer's directory published full)"),
    ("max_delta_chain", int, "rolling with --publish-dir: deltas in a row before a full "
     "version (default 3; 0: always full)"),
)


def cmd_lab(args: argparse.Namespace) -> int:
    from strawq.argtypes import UsageError
    from strawq.config import read_json_object
    from strawq.errors import ConfigError

    from strawq.demo.lab import HISTORY_CASE, MIXTURE_CASE, LabConfig, format_table, \
        run_history_case, run_lab

    if not getattr(args, "verbose", False):
        logging.getLogger().setLevel(logging.WARNING)
    if args.history and args.mixture:
        raise UsageError("--history and --mixture are two cases: run one at a time")
    data: dict[str, Any] = dict(HISTORY_CASE) if args.history else \
        dict(MIXTURE_CASE) if args.mixture else {}
    if args.config:
        loaded = read_json_object(args.config, what="lab config")
        data.update(loaded.get("config", loaded))  # a lab.json, or a bare LabConfig
    names = {f.name for f in dataclasses.fields(LabConfig)}
    data.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    if args.modes:
        data["modes"] = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    elif args.history or args.mixture:
        data.setdefault("modes", ("stream",))
    try:
        cfg = LabConfig.from_dict(data)
    except ConfigError as exc:
        raise UsageError(f"{exc} (see strawq lab --help)") from exc
    result = run_history_case(cfg, cfg.modes[0]) if args.history else run_lab(cfg)
    print(format_table(result))
    print(f"\nwritten: {result.files['json']} and <mode>/timeline.png under {cfg.workdir}")
    if args.history:
        from strawq.demo.lab import history_gain

        print(f"useful tokens per engine-second, history on / off = "
              f"{history_gain(result)['x']:.2f}")
    return 1 if any(r.problems for r in result.modes.values()) else 0


def add_lab_parser(sub: Any) -> None:
    p = sub.add_parser("lab", help="the rollout schedules compared at scale (sim engines)",
                       description=LAB_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="output directory (default runs/lab)")
    p.add_argument("--modes",
                   help="comma-separated subset of sync,partial,async,stream,flow (default all)")
    p.add_argument("--config", help="start from this JSON (a lab.json's 'config', or a "
                   "LabConfig mapping); flags override it")
    for name, typ, text in _FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=typ, help=text)
    p.add_argument("--skip-zero-variance", dest="skip_zero_variance", action="store_true",
                   default=None, help="queue.skip_zero_variance (from the second pass on)")
    p.add_argument("--longest-first", dest="longest_first", action="store_true", default=None,
                   help="queue.longest_first (from the second pass on)")
    p.add_argument("--history", action="store_true",
                   help="the history case (HISTORY_CASE; flags override it): the first of "
                        "--modes (default stream) with the history's rules off, then on")
    p.add_argument("--mixture", action="store_true",
                   help="the mixture case (MIXTURE_CASE; flags override it): two datasets "
                        "in equal weights, the hard one filtered by the DAPO rule; each "
                        "dataset's trained share and whether it was starved, and why")
    p.add_argument("--no-fsync", dest="fsync", action="store_false", default=None,
                   help="skip fsync on queue writes")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.set_defaults(func=cmd_lab)
