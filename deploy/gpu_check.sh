#!/usr/bin/env bash
# The trainer side on a GPU, where one exists: the reference-equivalence check and the
# demo with its GRPO trainer on CUDA (the tiny engines stay on the CPU). Without a GPU the
# same steps run on the CPU (what CI runs, through tests/collector/test_reference_script.py).
#
#   deploy/gpu_check.sh [--quick] [--out DIR] [--steps N] [--bench-output FILE]
#
# 1. bench/trainer.py: every trainer path (reader shards on gloo ranks, world sizes 1-4;
#    Megatron micro-batches; the demo trainer; slime where offered) against the
#    single-process reference; the reference, Megatron and demo paths on the device.
#    Its framework-loops line (verl's fit_step chain with the shipped trainer, slime's loop
#    in both modes, the Megatron example loop; each killed and restarted) is echoed as a
#    check of its own.
#    --bench-output FILE: the output of that same command, run before on this machine
#    (the test suite runs it once), is checked and shown instead of running it again.
# 2. The reference-equivalence tests (tests/collector/test_reference.py, the Megatron
#    equivalence cases) on the CPU. --tests "PYTEST ARGS": another selection (the test
#    suite, which runs those tests itself, picks one).
# 3. strawq demo --trainer-device DEVICE for N steps (default 30; 8 with --quick).
# Ends with one line per check and "gpu_check: ok" (exit 0) or "gpu_check: FAILED" (exit 1).
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
QUICK=""
STEPS=30
OUT=""
BENCH_OUTPUT=""
TESTS='tests/collector/test_reference.py tests/collector/integrations/test_megatron.py -k "reference or example"'
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK="--quick"; STEPS=8 ;;
    --out) OUT="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --bench-output) BENCH_OUTPUT="$2"; shift ;;
    --tests) TESTS="$2"; shift ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (expected --quick, --out DIR, --steps N," \
            "--bench-output FILE, --tests ARGS)" >&2
       exit 2 ;;
  esac
  shift
done
OUT=${OUT:-$(mktemp -d -t strawq-gpu-check-XXXXXX)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  DEVICE=cuda
  "$PY" -c "import torch; print('gpu_check: device cuda,', torch.cuda.get_device_name(0))"
else
  DEVICE=cpu
  echo "gpu_check: no CUDA device visible to torch; the CPU path runs"
fi

status=0
if [ -n "$BENCH_OUTPUT" ]; then
  # an earlier run's output: it counts only if it ends on the benchmark's summary line
  cp "$BENCH_OUTPUT" "$OUT/bench_trainer.txt" 2> "$OUT/bench_trainer.err"
  tail -1 "$OUT/bench_trainer.txt" 2>/dev/null | grep -q '^trainer: max relative gradient error'
  rc_bench=$?
  [ $rc_bench -eq 0 ] || echo "gpu_check: $BENCH_OUTPUT does not end on the trainer summary line" \
    >> "$OUT/bench_trainer.err"
else
  "$PY" bench/trainer.py $QUICK --device "$DEVICE" > "$OUT/bench_trainer.txt" 2> "$OUT/bench_trainer.err"
  rc_bench=$?
fi
cat "$OUT/bench_trainer.txt"
[ $rc_bench -eq 0 ] || { status=1; tail -20 "$OUT/bench_trainer.err"; }
# each framework's own loop (verl's fit, slime's train.py, the Megatron example), killed and
# restarted: its line, or why it is missing
loops=$(grep '^trainer: framework loops' "$OUT/bench_trainer.txt" || true)
echo "gpu_check: ${loops:-framework loops: not run (verl, slime or megatron-core missing)}"

eval "\"\$PY\" -m pytest -q -p no:cacheprovider -m 'not slow' $TESTS" > "$OUT/pytest.txt" 2>&1
rc_tests=$?
tail -1 "$OUT/pytest.txt"
[ $rc_tests -eq 0 ] || { status=1; tail -30 "$OUT/pytest.txt"; }

"$PY" -m strawq demo --fresh --steps "$STEPS" --workdir "$OUT/demo" --no-progress \
  --trainer-device "$DEVICE" > "$OUT/demo.txt" 2>&1
rc_demo=$?
if [ $rc_demo -eq 0 ]; then
  "$PY" - "$OUT/demo/summary.json" "$DEVICE" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(f"gpu_check: demo on {sys.argv[2]}: {s.get('steps')} steps, reward "
      f"{s.get('reward/first')} -> {s.get('reward/last')}, {s.get('wall_s')} s")
PYEOF
else
  status=1
  tail -30 "$OUT/demo.txt"
fi

echo "gpu_check: bench rc=$rc_bench tests rc=$rc_tests demo rc=$rc_demo (outputs in $OUT)"
if [ $status -eq 0 ]; then echo "gpu_check: ok"; else echo "gpu_check: FAILED"; fi
exit $status
