"""``strawq lab``'s report: the row of figures per mode, the length-bias figures and plot,
and the table (``strawq.demo.lab`` runs the modes; docs/lab.md explains every column)."""

from __future__ import annotations

import math
import os
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strawq.demo.assembly import CollectorLoop
    from strawq.demo.lab import LabConfig, LabResult


def _utilisation(samples: Any, t0: float, t1: float) -> float:
    """Time-weighted busy slots ÷ capacity over [t0, t1], all sim processes together."""
    busy = cap = 0.0
    for pts in samples.series.values():
        for (ta, b), (tb, _) in zip(pts, pts[1:], strict=False):
            lo, hi = max(ta, t0), min(tb, t1)
            if hi > lo:
                busy += b * (hi - lo)
                cap += hi - lo
    return busy / cap if cap else float("nan")


def _first_batch_at(res: Any) -> float:
    waits = [iv for iv in res.intervals if iv.what == "wait"]
    return float(waits[0].end if waits else res.started)


def _steady_wait(res: Any) -> float:
    span = res.ended - _first_batch_at(res)
    wait = sum(r.wait_s for r in res.records[1:])
    return wait / span if span > 0 else float("nan")


def _steady_tokens_per_s(res: Any, time_scale: float) -> float:
    span = (res.ended - _first_batch_at(res)) / time_scale
    tokens = sum(r.metrics.get("tokens", 0.0) for r in res.records)
    return tokens / span if span > 0 else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def row_of(cfg: LabConfig, mode: str, res: Any, samples: Any, stats: list[dict[str, Any]],
         cpu: dict[str, float], loop: CollectorLoop, collector: Any) -> dict[str, Any]:
    ts = cfg.time_scale
    recs = res.records
    wall = res.wall_s
    model = wall / ts
    tokens = sum(r.metrics.get("tokens", 0.0) for r in recs)
    samples_n = sum(len(r.staleness) for r in recs)
    stal = [s for r in recs for s in r.staleness]
    writes = [r.write_s for r in recs if r.write_s is not None]
    multi = sum(r.metrics.get("staleness/multi_version_frac", 0.0) * len(r.staleness)
                for r in recs)
    gen_tokens = sum(p.get("tokens_generated", 0) for p in stats)
    busy_traj_s = sum(p.get("slot_utilisation", 0.0) * p.get("slots", 0)
                      * p.get("group_size", 0) * p.get("wall_s", 0.0) for p in stats)
    # wall seconds a busy slot spends per generated token ≈ the decode step it saw
    seen_step = busy_traj_s / gen_tokens if gen_tokens else float("nan")
    util = _utilisation(samples, res.started, res.ended)
    steady = _steady_tokens_per_s(res, ts)
    ceiling = (tokens / (len(recs) * cfg.train_step_s) if recs and cfg.train_step_s > 0
               else float("nan"))
    return {
        "mode": mode,
        "steps": len(recs),
        "wall_s": round(wall, 2),
        "model_s": round(model, 2),
        "trained_tokens": int(tokens),
        "trained_samples": samples_n,
        "trained_tokens_per_s": tokens / model if model > 0 else float("nan"),
        "trainer_wait_ratio": res.trainer_wait_ratio(),
        # from the first batch's arrival on: the pipeline's fill (warm-up) left out
        "trainer_wait_ratio_steady": _steady_wait(res),
        "trained_tokens_per_s_steady": steady,
        # the trainer-bound throughput: this run's trained tokens per batch / the train step
        # (what no schedule can beat: the trainer never waits and updates cost nothing)
        "ceiling_tokens_per_s": ceiling,
        "ceiling_frac": _ratio(tokens / model if model > 0 else float("nan"), ceiling),
        "ceiling_frac_steady": _ratio(steady, ceiling),
        "engine_utilisation": util,
        "rollout_to_train_end_s": model / max(len(recs), 1),
        "step_s": {"wait": sum(r.wait_s for r in recs) / ts / max(len(recs), 1),
                   "train": sum(r.train_s for r in recs) / ts / max(len(recs), 1),
                   "update": sum(r.update_s for r in recs) / ts / max(len(recs), 1)},
        # per weight update, model seconds: the trainer's wait, and the engine-seconds the
        # fleet stood still (the bracket: every engine, the whole update; rolling: each
        # engine while it was out of rotation for its load)
        "update_wait_s": (sum(r.update_s for r in recs) / ts / len(recs)) if recs else 0.0,
        "fleet_pause_engine_s": (
            (sum(p.get("rolling_pause_ms", 0) for p in stats) / 1000.0 / ts / len(recs))
            if cfg.weight_update == "rolling" else
            cfg.engines * sum(r.update_s for r in recs) / ts / len(recs)) if recs else 0.0,
        "weight_update": cfg.weight_update,
        # the rolling update: per published version, the trainer's seconds to write the
        # weights once (its manifest's write_s), mean over the run (model seconds); nan:
        # the global bracket publishes none
        "weights_write_s": (sum(writes) / ts / len(writes)) if writes else float("nan"),
        # weight updates in the run (one per step): the per-update figures' divisor
        "updates": len(recs),
        "resumed_tokens": sum(p.get("resumed_tokens", 0) for p in stats),
        "resumed_tokens_prefilled": sum(p.get("resumed_tokens_prefilled", 0) for p in stats),
        "resumed_prefilled_share": _ratio(
            sum(p.get("resumed_tokens_prefilled", 0) for p in stats),
            sum(p.get("resumed_tokens", 0) for p in stats)),
        "resumed_other_version_tokens": sum(p.get("resumed_tokens_other_version", 0)
                                            for p in stats),
        "staleness_mean": sum(stal) / len(stal) if stal else float("nan"),
        "staleness_max": max(stal) if stal else 0,
        "multi_version_share": multi / samples_n if samples_n else float("nan"),
        "generated_tokens": gen_tokens,
        "generated_per_trained": gen_tokens / tokens if tokens else float("nan"),
        "requeued_stale": loop.requeued,
        "stale_trained": collector.stale_totals["trained"],
        "dropped_stale": loop.dropped_stale,
        "dropped": collector.dropped_by_reason(),
        "groups_yielded_partial": sum(p.get("groups_yielded", 0) for p in stats),
        "decode_stretch": seen_step / (cfg.model_step_s() * ts) if gen_tokens else float("nan"),
        "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "cpu_cores": round(sum(cpu.values()) / wall, 2) if wall > 0 else float("nan"),
        "producer_cpu_ms_per_request_token": (
            1000 * cpu["producers"] / gen_tokens if gen_tokens else float("nan")),
    }


def generated_lengths(cfg: LabConfig, n: int = 20000) -> list[int]:
    """Response lengths the sim engines' timing model generates (its distribution, drawn
    ``n`` times): the reference the trained lengths are compared against."""
    rng = random.Random(cfg.seed + 7)
    s = cfg.prompt_scale_sigma
    out = []
    for _ in range(n):
        if rng.random() < cfg.cap_prob:
            out.append(cfg.len_cap)
        else:
            z = cfg.len_sigma * rng.gauss(0, 1)
            if s > 0:  # the per-prompt scale (``prompt_scale``): lognormal of mean 1
                z += s * rng.gauss(0, 1) - s * s / 2
            x = round(math.exp(math.log(cfg.len_median) + z))
            out.append(max(1, min(cfg.len_cap, x)))
    return out


def length_buckets(cfg: LabConfig) -> list[tuple[int, int]]:
    """[lo, hi) response-length buckets: body quartiles of the model, then the cap."""
    m = cfg.len_median
    edges = sorted({1, max(2, int(m / 2)), int(m), int(2 * m), int(4 * m), cfg.len_cap})
    edges = [e for e in edges if e <= cfg.len_cap]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False)] + [
        (cfg.len_cap, cfg.len_cap + 1)]


def length_bias(cfg: LabConfig, records: list[Any]) -> dict[str, Any]:
    """Bias you can see: generated vs trained response lengths, staleness per length bucket
    and the age (staleness) distribution of trained samples. A schedule that drops or
    regenerates the tail trains a shorter distribution than the policy generates."""
    gen = generated_lengths(cfg)
    lens = [n for r in records for n in r.lengths]
    stal = [s for r in records for s in r.staleness]
    eta = cfg.max_staleness
    buckets = []
    for lo, hi in length_buckets(cfg):
        mine = [s for n, s in zip(lens, stal, strict=False) if lo <= n < hi]
        buckets.append({
            "bucket": f"{lo}-{hi - 1}" if hi - lo > 1 else f"{lo} (cap)",
            "generated_share": sum(1 for n in gen if lo <= n < hi) / len(gen),
            "trained_share": len(mine) / len(lens) if lens else float("nan"),
            "staleness_mean": sum(mine) / len(mine) if mine else float("nan"),
            "over_eta_share": (sum(1 for s in mine if s > eta) / len(mine)
                               if mine else float("nan")),
        })
    ages: dict[int, int] = {}
    for s in stal:
        ages[s] = ages.get(s, 0) + 1
    return {"buckets": buckets, "age_counts": {str(k): v for k, v in sorted(ages.items())},
            "generated_mean_len": sum(gen) / len(gen),
            "trained_mean_len": sum(lens) / len(lens) if lens else float("nan")}


def plot_bias(path: str, cfg: LabConfig, mode: str, bias: dict[str, Any]) -> str:
    """``<mode>/bias.png``: length shares generated vs trained, staleness and over-eta share
    per length bucket, and the age histogram of trained samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = bias["buckets"]
    names = [x["bucket"] for x in b]
    xs = range(len(b))
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    ax[0].bar([x - 0.2 for x in xs], [x["generated_share"] for x in b], 0.4, label="generated")
    ax[0].bar([x + 0.2 for x in xs], [x["trained_share"] for x in b], 0.4, label="trained")
    ax[0].set_yscale("log")
    ax[0].set_title(f"response length (mean {bias['generated_mean_len']:.0f} generated, "
                    f"{bias['trained_mean_len']:.0f} trained)", fontsize=9)
    ax[0].legend(fontsize=8)
    ax[1].bar(xs, [x["staleness_mean"] for x in b], 0.6, label="mean staleness")
    ax[1].plot(list(xs), [x["over_eta_share"] for x in b], "o-", color="C3",
               label=f"share over eta={cfg.max_staleness}")
    ax[1].set_title("staleness per length bucket", fontsize=9)
    ax[1].legend(fontsize=8)
    for a in ax[:2]:
        a.set_xticks(list(xs))
        a.set_xticklabels(names, fontsize=8)
        a.set_xlabel("response tokens")
    ages = bias["age_counts"]
    ax[2].bar([int(k) for k in ages], list(ages.values()))
    ax[2].set_title("age of trained samples (versions)", fontsize=9)
    ax[2].set_xlabel("staleness")
    fig.suptitle(f"strawq lab ({mode}): what is trained vs what is generated", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# -- the history case ------------------------------------------------------------------------
#: difficulty buckets of the trained mix: never solved, in between, always solved
BUCKETS = ("p=0", "0<p<1", "p=1")
#: the learnable rows (0 < p < 1) split by difficulty: the skip also leaves out a row whose
#: group agreed by chance (likelier near 0 and 1), which tilts what is learned from
LEARNABLE = ("p<0.25", "0.25-0.75", "p>0.75")


def _bucket(p: float) -> str:
    return BUCKETS[0] if p <= 0 else BUCKETS[2] if p >= 1 else BUCKETS[1]


def _learnable(p: float) -> str:
    return LEARNABLE[0] if p < 0.25 else LEARNABLE[2] if p > 0.75 else LEARNABLE[1]


def _shares(counts: dict[str, int]) -> dict[str, float]:
    n = sum(counts.values())
    return {k: v / n if n else float("nan") for k, v in counts.items()}


def _drift(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - b[k]) for k in a)


def history_figures(cfg: LabConfig, run_dir: str, p_solve: list[float],
                    model_s: float) -> dict[str, Any]:
    """What the run trained, from its per-prompt history (``strawq.data.history``, read after a
    final gc): useful tokens (of trained groups whose rewards differ: GRPO signal) per
    engine-second (E x the run's model seconds), zero-variance groups trained, rows the
    history skipped, and the trained mix per difficulty bucket against the dataset's.

    ``p_solve``: the dataset's rows' difficulty (row ``i`` of every pass: task index ``i``
    modulo the dataset's size, as the lab's dataset has no bad rows to skip)."""
    from strawq.data.history import load_history, rewards_agreed
    from strawq.storage import PosixStorage

    hist = load_history(PosixStorage(run_dir, writer_id="lab-history", fsync=False))
    n = len(p_solve)
    groups = zero = 0
    tokens = useful = 0
    mix = dict.fromkeys(BUCKETS, 0)
    learn = dict.fromkeys(LEARNABLE, 0)
    passes: dict[int, list[int]] = {}  # pass -> [groups, tokens, useful tokens]
    for stats in hist.prompts.values():
        for r in stats.last:
            if r.get("status") != "trained" or not isinstance(r.get("index"), int):
                continue
            index, t = int(r["index"]), int(r.get("tokens") or 0)
            agrees = rewards_agreed(r)
            groups += 1
            tokens += t
            zero += agrees
            useful += 0 if agrees else t
            p = p_solve[index % n]
            mix[_bucket(p)] += 1
            if 0 < p < 1:
                learn[_learnable(p)] += 1
            ps = passes.setdefault(index // n, [0, 0, 0])
            ps[0], ps[1], ps[2] = ps[0] + 1, ps[1] + t, ps[2] + (0 if agrees else t)
    data = dict.fromkeys(BUCKETS, 0)
    data_learn = dict.fromkeys(LEARNABLE, 0)
    for p in p_solve:
        data[_bucket(p)] += 1
        if 0 < p < 1:
            data_learn[_learnable(p)] += 1
    trained_share, data_share = _shares(mix), _shares(data)
    learn_share, data_learn_share = _shares(learn), _shares(data_learn)
    engine_s = cfg.engines * model_s
    totals = hist.totals()
    return {
        "trained_groups": groups,
        "trained_tokens": tokens,
        "useful_tokens": useful,
        "useful_share": useful / tokens if tokens else float("nan"),
        "zero_variance_groups": zero,
        "zero_variance_share": zero / groups if groups else float("nan"),
        "skipped": totals["skipped"],
        "skipped_by_reward": totals["skipped_by_reward"],
        "engine_s": engine_s,
        "useful_tokens_per_engine_s": useful / engine_s if engine_s > 0 else float("nan"),
        "trained_mix": trained_share,
        "dataset_mix": data_share,
        # the drift the skip puts on what is trained: the largest share gap of a bucket
        # (p=0 and p=1 are what the skip leaves out on purpose)
        "mix_drift": _drift(trained_share, data_share),
        # among the learnable rows only: the tilt of what is learned from
        "learnable_mix": learn_share,
        "dataset_learnable_mix": data_learn_share,
        "learnable_drift": _drift(learn_share, data_learn_share),
        "passes": [{"pass": e + 1, "groups": g, "useful_share": u / t if t else float("nan")}
                   for e, (g, t, u) in sorted(passes.items())],
        # the passes the history can act on (from the second): useful tokens / trained tokens
        "useful_share_later": (sum(u for e, (_, _, u) in passes.items() if e > 0)
                               / max(1, sum(t for e, (_, t, _) in passes.items() if e > 0))),
    }


def history_gain(result: LabResult) -> dict[str, float]:
    """The history case's figures: useful tokens per engine-second, history on / off
    (``x``), and the trained mix's drift from the dataset's in each row."""
    rows = {m.rpartition(" ")[2]: r.row.get("history", {}) for m, r in result.modes.items()}
    on, off = rows.get("on", {}), rows.get("off", {})
    nan = float("nan")
    # each rule alone (rows ``skip``, ``longest``), against the same ``off`` row
    alone = {f"x_{rule}": _ratio(h.get("useful_tokens_per_engine_s", nan),
                                 off.get("useful_tokens_per_engine_s", nan))
             for rule, h in rows.items() if rule not in ("on", "off")}
    return {**alone, "x": _ratio(on.get("useful_tokens_per_engine_s", nan),
                                 off.get("useful_tokens_per_engine_s", nan)),
            "useful_share_on": on.get("useful_share", nan),
            "useful_share_off": off.get("useful_share", nan),
            "useful_share_later_on": on.get("useful_share_later", nan),
            "useful_share_later_off": off.get("useful_share_later", nan),
            "drift_on": on.get("mix_drift", nan), "drift_off": off.get("mix_drift", nan),
            "learnable_drift_on": on.get("learnable_drift", nan),
            "learnable_drift_off": off.get("learnable_drift", nan),
            "zero_variance_groups_on": on.get("zero_variance_groups", nan),
            "zero_variance_groups_off": off.get("zero_variance_groups", nan)}


def format_history(result: LabResult) -> list[str]:
    """The history block of the table (rows with a ``history`` figure only)."""
    rows = [(m, r.row["history"]) for m, r in result.modes.items() if "history" in r.row]
    if not rows:
        return []
    width = max(len(m) for m, _ in rows)
    out = ["", f"history ({result.config.num_epochs} passes over "
               f"{result.config.dataset_rows or '?'} rows): useful = tokens of trained groups "
               "whose rewards differ; engine-s = E x model s; mix = trained groups at "
               f"{' / '.join(BUCKETS)} (dataset in brackets); learnable = the same among "
               f"0<p<1 at {' / '.join(LEARNABLE)}"]
    for m, h in rows:
        mix = " / ".join(f"{h['trained_mix'][b]:.2f} ({h['dataset_mix'][b]:.2f})"
                         for b in BUCKETS)
        out.append(f"  {m.rjust(width)}: useful tok/engine-s "
                   f"{h['useful_tokens_per_engine_s']:.1f}, useful share "
                   f"{h['useful_share']:.2f}, zero-variance groups trained "
                   f"{h['zero_variance_groups']} of {h['trained_groups']}, skipped "
                   f"{h['skipped']}; mix {mix}, drift {h['mix_drift']:.2f}; learnable "
                   + " / ".join(f"{h['learnable_mix'][b]:.2f} ({h['dataset_learnable_mix'][b]:.2f})"
                                for b in LEARNABLE)
                   + f", drift {h['learnable_drift']:.2f}")
    return out


def format_mixture(result: LabResult) -> list[str]:
    """The mixture block of the table (rows with a ``mixture`` figure only)."""
    out: list[str] = []
    for m, r in result.modes.items():
        mix = r.row.get("mixture")
        if not mix:
            continue
        if not out:
            out = ["", "mixture (whole run): per dataset, its weight, its share of the trained "
                       "groups and tokens, groups its filter dropped or dropped for staleness, "
                       "and whether the collector called it starved (why)"]
        out.append(f"  {m}: " + "; ".join(
            f"{s} weight {f['weight']:.2f}, groups {f['group_share']:.2f}, tokens "
            f"{f['token_share']:.2f}, filtered {f['filtered']}, stale {f['stale']}"
            + (f", STARVED ({f['starved']})" if f["starved"] else "")
            for s, f in mix.items()))
    return out


# -- the table -------------------------------------------------------------------------------
_COLUMNS = (
    ("trained tok/s", "trained_tokens_per_s", "{:.0f}"),
    ("x sync", "throughput_x", "{:.2f}"),
    ("of ceiling", "ceiling_frac", "{:.2f}"),
    ("steady", "ceiling_frac_steady", "{:.2f}"),
    ("wait ratio", "trainer_wait_ratio", "{:.3f}"),
    ("wait steady", "trainer_wait_ratio_steady", "{:.3f}"),
    ("engine util", "engine_utilisation", "{:.2f}"),
    ("r2t-end/step s", "rollout_to_train_end_s", "{:.2f}"),
    ("x sync", "rollout_to_train_end_x", "{:.2f}"),
    ("stale mean", "staleness_mean", "{:.2f}"),
    ("stale max", "staleness_max", "{}"),
    ("multi-ver", "multi_version_share", "{:.2f}"),
    ("over-eta trained", "stale_trained", "{}"),
    ("regen", "requeued_stale", "{}"),
    ("dropped", "dropped_stale", "{}"),
    ("stretch", "decode_stretch", "{:.2f}"),
)


def format_table(result: LabResult) -> str:
    cfg = result.config
    ratios = result.ratios()
    head = ["mode"] + [c[0] for c in _COLUMNS]
    rows = []
    for m, r in result.modes.items():
        vals = {**r.row, **ratios.get(m, {})}
        cells = [m]
        for _, key, fmt in _COLUMNS:
            v = vals.get(key, float("nan"))
            cells.append(fmt.format(v) if isinstance(v, (int, float)) else str(v))
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))

    out = [
        f"strawq lab: E={cfg.engines} engines x C={cfg.concurrency} = {cfg.slots} slots "
        f"(in {cfg.sim_processes} sim processes of {cfg.engines_per_process} engines), "
        f"G={cfg.group_size}, K={cfg.group_slots} group slots over {cfg.producers} producers, "
        f"B={cfg.batch_groups}, {cfg.steps} steps, train step {cfg.train_step_s:g} s, "
        f"eta={cfg.max_staleness}, oversample={cfg.oversample:g}",
        f"timing model: decode step {cfg.model_step_s() * 1000:.1f} ms at C, lengths "
        f"lognormal(median {cfg.len_median:g}, sigma {cfg.len_sigma:g}) capped at "
        f"{cfg.len_cap} with {cfg.cap_prob:.0%} at the cap (mean "
        f"{cfg.expected_response_len():.0f}); time_scale {cfg.time_scale:g} "
        "(all times below are model seconds)",
        "",
        line(head),
        line(["-" * w for w in widths]),
    ] + [line(c) for c in rows]
    cpu = ", ".join(f"{m}: {r.row['cpu_cores']:.2f} cores "
                    f"({', '.join(f'{k} {v}' for k, v in r.row['cpu_s'].items())} s)"
                    for m, r in result.modes.items())
    out += ["", f"CPU used by the lab (of {os.cpu_count()} cores): {cpu}",
            "stretch = measured wall per token of a busy slot / modelled decode step "
            "(1 = the box keeps up; above ~1.2 the CPU, not the schedule, is being measured)"]
    out.append("of ceiling: trained tok/s / (trained tokens per step / train step), over the "
               "whole run; steady: from the first batch on")
    out.append("wait steady: from the first batch on (the pipeline's fill left out); "
               "over-eta trained: groups over eta kept and trained (eta_mode train); regen / "
               "dropped: groups regenerated or dropped for staleness")
    out += format_history(result)
    out += format_mixture(result)
    for m, r in result.modes.items():
        if r.problems:
            out.append(f"AUDIT PROBLEMS in {m}: {r.problems[:5]}")
    return "\n".join(out)
