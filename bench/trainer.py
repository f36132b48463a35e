"""Trainer benchmark: every path a user trains on against the single-process reference.

1. Writes a run with one published batch (``strawq.testing.reference.make_reference_run``:
   mixed response lengths, prompts of 1 to 8 tokens, loss-mask holes, three weight
   versions, per-sample temperature / top-p / top-k).
2. Computes the whole batch's loss and gradients of ``TinyPolicy`` in one process, straight
   from the group records (``reference_gradients``), for each objective.
3. Takes the same batch through each path and compares its gradient:
   * ``reader/gloo``: the reader's shards on real ``torch.distributed`` ranks (gloo, CPU,
     world sizes 1 to 4), DDP's mean of the gradients;
   * ``megatron``: ``MegatronBatcher`` micro-batches (THD, sequence-parallel tail, padding
     multiples, the CP split) summed per rank and averaged over DP × CP;
   * ``demo``: the demo trainer's ``GRPOTrainer.train_step`` (padded rows, clipped to norm 1);
   * ``slime``: the slime adapters, where the test harness's ``strawq.testing.slime_train``
     offers ``slime_path_gradients(run_dir, seq, model, *, objective) -> (loss, grads)``;
   * ``verl``: the batch as verl's ``DataProto``, trained by verl's own actor code
     (``strawq.testing.verl_train`` over ``strawq.collector.integrations.verl.reader``:
     its padding conversion, micro-batches, FSDP engine input/output preparation and
     ``ppo_loss`` in bypass / REINFORCE mode) on real gloo ranks (world sizes 1, 2, 4; 1-4
     in the full form), where verl is installed.
   The error of a path is max over parameters of max |g − g_ref| / max |g_ref|.
4. Runs each framework's own training loop end to end on a run whose batches hold a failed
   reward, a tool-failed sample, a group of one and a skipped (corrupt) group: verl's
   ``FullyAsyncTrainer`` ``fit_step``/``load_checkpoint``/``fit`` with the shipped trainer
   (``strawq.testing.verl_loop``), slime's loop in both modes (``strawq.testing.slime_loop``)
   and the shipped Megatron example loop (``strawq.testing.megatron_loop``), each killed once
   and restarted from its checkpoint; every step's gradient against the reference on that
   step's batch, and every sample id trained once. The line before the last:
   ``trainer: framework loops = verl F1, slime F2, megatron F3 steps; samples trained twice
   = T; max relative gradient error vs reference = E`` (a framework not installed is left
   out and said so).

    python bench/trainer.py [--quick] [--device cuda] [--dir DIR]

``--quick`` (a few seconds; CI runs it): a small batch, the three aggregation modes, four
Megatron layouts. ``--device cuda`` computes the reference, the Megatron and the demo paths
on the GPU (gloo ranks stay on the CPU). The last line:
``trainer: max relative gradient error vs reference = X over N paths (world sizes 1-4,
megatron[, slime][, verl])``; the exit status is 1 when X > 1e-5, when a framework loop's
error is, or when a loop trained a sample twice or never.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from strawq.collector.trainer.importance import LOSS_AGG_MODES  # noqa: E402
from strawq.testing.reference import (  # noqa: E402
    Grads,
    Objective,
    PaddedPolicy,
    TinyPolicy,
    distributed_gradients,
    gradients,
    make_reference_run,
    max_relative_error,
    megatron_gradients,
    reference_gradients,
)

TOLERANCE = 1e-5

#: (dp, tp, cp, sequence_parallel, pad_multiple, max_tokens_per_gpu)
LAYOUTS_QUICK = [(1, 1, 1, False, 1, 10_000), (2, 2, 1, True, 8, 64), (2, 1, 2, False, 1, 64),
                 (1, 2, 3, True, 16, 96)]
LAYOUTS_FULL = [(1, 1, 1, False, 1, 10_000), (2, 1, 1, False, 1, 48), (1, 2, 1, True, 1, 64),
                (2, 1, 1, False, 8, 64), (3, 1, 1, False, 128, 200), (1, 1, 2, False, 1, 40),
                (2, 2, 2, True, 1, 64), (2, 1, 2, False, 8, 64), (1, 1, 3, False, 16, 64),
                (4, 2, 3, True, 128, 300)]


def slime_hook() -> Callable[..., tuple[float, Grads]] | None:
    """The slime adapters' path, if the installed harness module offers it."""
    try:
        from strawq.testing import slime_train
    except ImportError:
        return None
    fn = getattr(slime_train, "slime_path_gradients", None)
    return fn if callable(fn) else None


def verl_hook() -> Callable[..., dict[tuple[int, Objective], tuple[float, Grads]]] | None:
    """The verl path on gloo ranks, if verl is installed."""
    try:
        import verl  # noqa: F401

        from strawq.testing.verl_train import verl_distributed_gradients
    except ImportError:
        return None
    return verl_distributed_gradients


def demo_gradients(run_dir: str, seq: int, objective: Objective, device: str,
                   workdir: str) -> tuple[float, Grads]:
    """The demo trainer's step on the whole batch (one rank, learning rate 0): its loss and
    its gradients (clipped to norm 1, as it clips)."""
    from strawq.collector.trainer.reader import BatchReader
    from strawq.delivery.batches import BatchStore
    from strawq.demo.trainer import GRPOTrainer
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue
    from strawq.testing.reference import batch_to

    q = RunQueue.open(open_storage(run_dir, writer_id="bench"))
    reader = BatchReader(q, checkpointed=False, watch=None, sleep=lambda _s: None)
    batch = batch_to(reader.load(BatchStore(q).read_manifest(seq)), device)
    reader.close()
    model = PaddedPolicy().to(device)
    trainer = GRPOTrainer(model=model, workdir=workdir, engine_urls=[],  # type: ignore[arg-type]
                          lr=0.0, loss_agg=objective.aggregation, is_mode=objective.is_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.train_step(batch)
    return out["loss"], {k.removeprefix("inner."): g for k, g in gradients(model).items()}


def rank_local_bias(run_dir: str, seq: int, world: int, objectives: list[Objective],
                    refs: dict[Objective, tuple[float, Grads]]) -> list[str]:
    """For information: the shard's own denominators (``aggregate_loss`` without totals)
    averaged over ``world`` ranks — each sample's weight relative to one process, and the
    gradient error against the reference."""
    from strawq.collector.trainer.reader import BatchReader
    from strawq.delivery.batches import BatchStore
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue
    from strawq.testing.reference import reader_loss

    q = RunQueue.open(open_storage(run_dir, writer_id="bench"))
    man = BatchStore(q).read_manifest(seq)
    shards = []
    for r in range(world):
        reader = BatchReader(q, rank=r, world_size=world, checkpointed=False, watch=None,
                             sleep=lambda _s: None)
        shards.append(reader.load(man))
        reader.close()
    lines = []
    for obj in objectives:
        acc: Grads = {}
        for b in shards:
            model = TinyPolicy()
            reader_loss(model, b, obj, scope="local").backward()  # type: ignore[no-untyped-call]
            for k, g in gradients(model).items():
                acc[k] = acc.get(k, torch.zeros_like(g)) + g / world
        if obj.aggregation == "token_mean":
            whole = sum(float(b.loss_mask.sum()) for b in shards)
            mine = [float(b.loss_mask.sum()) for b in shards if b.num_samples]
        else:
            whole = sum(b.num_samples for b in shards)
            mine = [float(b.num_samples) for b in shards if b.num_samples]
        factors = [whole / (world * m) for m in mine if m > 0]
        err = max_relative_error(acc, {k: v.cpu() for k, v in refs[obj][1].items()})
        lines.append(f"  {obj.aggregation:<20} sample weights {min(factors):.2f}x-"
                     f"{max(factors):.2f}x of one process (max/min "
                     f"{max(factors) / min(factors):.1f}); gradient error {err:.2e}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small batch, a few seconds")
    p.add_argument("--device", default="cpu", help="cpu or cuda (reference, megatron, demo)")
    p.add_argument("--dir", default=None, help="where the run is written (default: a temp dir)")
    p.add_argument("--spawn", action="store_true",
                   help="spawn the gloo ranks (as a launcher does) instead of forking them")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench/trainer.py: --device {args.device} but torch sees no CUDA device; "
              "run with --device cpu", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    logging.disable(logging.WARNING)  # the truncated-sampling warning, once per process
    quick = args.quick
    base = args.dir or tempfile.mkdtemp(prefix="strawq-bench-trainer-")
    t0 = time.perf_counter()
    try:
        run_dir, seq = make_reference_run(os.path.join(base, "ref"), groups=8 if quick else 24,
                                          group_size=4, seed=21,
                                          max_response=40 if quick else 160)
        objectives = [Objective(aggregation=m) for m in LOSS_AGG_MODES]
        if not quick:
            objectives += [Objective(aggregation=m, is_mode="icepop", truncated=True)
                           for m in LOSS_AGG_MODES]
        dev = args.device
        refs = {}
        for obj in objectives:
            refs[obj] = reference_gradients(run_dir, seq, TinyPolicy().to(dev), objective=obj)
        rows: list[tuple[str, str, float, float]] = []

        def add(path: str, obj: Objective, loss: float, grads: Grads,
                ref: Grads | None = None) -> None:
            ref_loss, ref_grads = refs[obj]
            err = max_relative_error(grads, ref if ref is not None else ref_grads)
            label = obj.aggregation + ("" if obj.is_mode == "tis" and not obj.truncated
                                       else f" {obj.is_mode}{' trunc' if obj.truncated else ''}")
            rows.append((path, label, err, abs(loss - ref_loss)))

        ddp = distributed_gradients(run_dir, seq, world_sizes=(1, 2, 3, 4),
                                    objectives=objectives,
                                    start_method="spawn" if args.spawn else "fork")
        for (w, obj), (loss, grads) in sorted(ddp.items(), key=lambda kv: kv[0][0]):
            add(f"reader/gloo world={w}", obj, loss, grads)
        megatron = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import megatron.core  # noqa: F401
        except ImportError:
            megatron = False
            print("megatron-core is not installed: the megatron path is left out "
                  "(pip install 'strawq[megatron]')", file=sys.stderr)
        if megatron:
            for dp, tp, cp, sp, pad, budget in (LAYOUTS_QUICK if quick else LAYOUTS_FULL):
                for obj in objectives:
                    loss, grads = megatron_gradients(
                        run_dir, seq, TinyPolicy().to(dev), dp_size=dp, tp_size=tp,
                        cp_size=cp, sequence_parallel=sp, pad_multiple=pad,
                        max_tokens_per_gpu=budget, objective=obj)
                    name = (f"megatron dp={dp} tp={tp}{' sp' if sp else ''} cp={cp} "
                            f"pad={pad} budget={budget}")
                    add(name, obj, loss, grads)
        for obj in objectives:
            if obj.truncated or obj.is_mode not in ("tis", "icepop", "icepop_mask"):
                continue  # the demo trainer scores at the temperature only, with an IS weight
            loss, grads = demo_gradients(run_dir, seq, obj, dev, os.path.join(base, "demo"))
            _, ref = refs[obj]
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values())))
            clipped = {k: g * min(1.0, 1.0 / (norm + 1e-6)) for k, g in ref.items()}
            add("demo GRPOTrainer (clipped)", obj, loss, grads, clipped)
        slime_fn = slime_hook()
        if slime_fn is not None:
            done = 0
            for obj in objectives:
                try:
                    loss, grads = slime_fn(run_dir, seq, TinyPolicy().to(dev), objective=obj)
                except ValueError as exc:  # an objective slime cannot express
                    print(f"slime path, {obj}: left out ({exc})", file=sys.stderr)
                    continue
                except ImportError as exc:  # slime itself is not installed
                    print(f"the slime path is left out: {exc}", file=sys.stderr)
                    break
                add("slime generate_rollout", obj, loss, grads)
                done += 1
            if not done:
                slime_fn = None
        else:
            print("the slime path is left out: strawq.testing.slime_train offers no "
                  "slime_path_gradients(run_dir, seq, model, *, objective)", file=sys.stderr)
        verl_fn = verl_hook()
        if verl_fn is not None:
            from strawq.collector.integrations.verl.reader import check_objective

            verl_objs = []
            for obj in objectives:
                try:
                    check_objective(obj)
                    verl_objs.append(obj)
                except ValueError as exc:  # an objective verl's loss code cannot express
                    print(f"verl path, {obj}: left out ({exc})", file=sys.stderr)
            got = verl_fn(run_dir, seq, world_sizes=(1, 2, 4) if quick else (1, 2, 3, 4),
                          objectives=verl_objs, max_token_len_per_gpu=64 if quick else 256,
                          start_method="spawn" if args.spawn else "fork")
            for (w, obj), (loss, grads) in sorted(got.items(), key=lambda kv: kv[0][0]):
                add(f"verl actor (bypass/reinforce) gloo world={w}", obj, loss,
                    {k: g.to(dev) for k, g in grads.items()})
            if not got:
                verl_fn = None
        else:
            print("the verl path is left out: verl is not installed (pip install "
                  "'verl==0.9.1', docs/verl.md)", file=sys.stderr)
        bias = rank_local_bias(run_dir, seq, 4, objectives[:3], refs)
        t_loops = time.perf_counter()
        loops = framework_loops(base)
        t_loops = time.perf_counter() - t_loops
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'objective':<28}  {'max rel grad err':>16}  {'|loss diff|':>11}")
    for path, label, err, dl in rows:
        print(f"{path:<{width}}  {label:<28}  {err:>16.2e}  {dl:>11.2e}")
    print("rank-local denominators (not a path; what batch_loss replaces) at world size 4:")
    print("\n".join(bias))
    worst = max(r[2] for r in rows)
    paths = len({r[0] for r in rows})
    kinds = "world sizes 1-4" + (", megatron" if megatron else "") + \
        (", slime" if slime_fn is not None else "") + (", verl" if verl_fn is not None else "")
    print(f"({len(rows)} comparisons, device {args.device}, "
          f"{time.perf_counter() - t0:.1f} s)")
    ok = worst <= TOLERANCE
    if loops is not None:
        print(f"(framework loops: {t_loops:.1f} s)")
        print(loops[0])
        ok = ok and loops[1] <= TOLERANCE and loops[2] == 0
    print(f"trainer: max relative gradient error vs reference = {worst:.2e} over {paths} "
          f"paths ({kinds})")
    return 0 if ok else 1


def framework_loops(base: str) -> tuple[str, float, int] | None:
    """Each framework's own loop (section 4 of the module's docstring): the line, the worst
    gradient error and the samples trained twice or never; None when none ran."""
    steps: dict[str, int] = {}
    worst, twice, missing = 0.0, 0, 0

    def take(name: str, res: dict[str, object]) -> None:
        nonlocal worst, twice, missing
        steps[name] = steps.get(name, 0) + int(res["steps"])  # type: ignore[call-overload]
        err = float(res["max_rel_grad_err"])  # type: ignore[arg-type]
        worst = max(worst, err) if err == err else worst  # NaN: no gradient checked
        twice += int(res["trained_twice"])  # type: ignore[call-overload]
        missing += int(res.get("missing", 0))  # type: ignore[call-overload]

    try:
        from strawq.testing.verl_loop import run_verl_loop
        take("verl", run_verl_loop(os.path.join(base, "verl-loop")))
    except ImportError as exc:
        print(f"the verl loop is left out: {exc}", file=sys.stderr)
    try:
        from strawq.testing.slime_loop import MODES, run_slime_loop
        for mode in MODES:
            take("slime", run_slime_loop(mode, os.path.join(base, f"slime-loop-{mode}")))
    except ImportError as exc:
        print(f"the slime loops are left out: {exc}", file=sys.stderr)
    try:
        from strawq.testing.megatron_loop import run_megatron_loop
        take("megatron", run_megatron_loop(os.path.join(base, "megatron-loop")))
    except ImportError as exc:
        print(f"the megatron loop is left out: {exc}", file=sys.stderr)
    if not steps:
        return None
    line = ("trainer: framework loops = " + ", ".join(f"{k} {v}" for k, v in steps.items())
            + f" steps; samples trained twice = {twice}; samples never trained = {missing}; "
            f"max relative gradient error vs reference = {worst:.2e}")
    return line, worst, twice + missing


if __name__ == "__main__":
    raise SystemExit(main())
