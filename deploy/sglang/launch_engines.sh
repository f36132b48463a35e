#!/usr/bin/env bash
# Start N SGLang engine workers on this node's GPUs and register them with a router.
#
#   MODEL_PATH=/mnt/jfs/models/policy-v0 NUM_ENGINES=8 deploy/sglang/launch_engines.sh
#   ROUTER_URL=http://router-host:30000 MODEL_PATH=... deploy/sglang/launch_engines.sh
#
# Without ROUTER_URL it also starts sglang-router (0.3.x) on this node. Each worker is
# polled on /health_generate until it answers, then registered with POST {router}/workers
# (the router answers 202 and adds it in the background); the router's GET /workers then
# lists it. The router forwards /generate only: producers send the control calls (abort,
# pause, continue, update_weights_from_disk) to every worker URL that GET /workers lists
# (docs/engines.md). Workers start with --weight-version 0 because strawq weight versions
# are integers (SGLang's default, "default", is refused by the producers' client).
#
# Environment:
#   MODEL_PATH        required with the default ENGINE_CMD: the model directory (a path every
#                     node can read, e.g. on the shared mount, so weight updates from disk work)
#   NUM_ENGINES       workers on this node (default: GPUs reported by nvidia-smi / TP_SIZE)
#   TP_SIZE           GPUs per worker (default 1); worker i gets GPUs i*TP_SIZE ... +TP_SIZE-1
#   MAX_RUNNING_REQUESTS  C, concurrent requests per worker (default 256); it must match
#                     PlacementConfig.concurrency, the C of K = floor(C*E/G)
#   CONTEXT_LENGTH    optional --context-length (set the producer's engine.generation.context_length to the same)
#   HOST              address the servers bind (default 0.0.0.0)
#   ADVERTISE_HOST    address other nodes use to reach this one (default: hostname -f)
#   BASE_PORT         first worker port (default 30001; worker i listens on BASE_PORT+i)
#   ROUTER_URL        an existing router to register with; unset: start one here
#   ROUTER_PORT       port of the router started here (default 30000)
#   ENGINE_CMD        default "python -m sglang.launch_server"
#   ENGINE_ARGS       default "--model-path $MODEL_PATH --tp-size $TP_SIZE"
#   EXTRA_ENGINE_ARGS more worker flags (e.g. --mem-fraction-static 0.85)
#   ROUTER_CMD        default "python -m sglang_router.launch_router"
#   ROUTER_ARGS       default "--policy cache_aware"
#   LOG_DIR           logs, pid files and workers.txt (default ./sglang-logs)
#   READY_TIMEOUT     seconds to wait for each worker (default 1800: large models load slowly)
#   DETACH            1: return once everything is registered (processes keep running);
#                     default: stay in the foreground and stop every process on Ctrl-C
set -euo pipefail

prog=$(basename "$0")
die() { echo "$prog: error: $*" >&2; exit 1; }
note() { echo "$prog: $*" >&2; }

command -v curl >/dev/null 2>&1 || die "curl is needed to poll and register workers"

TP_SIZE=${TP_SIZE:-1}
MAX_RUNNING_REQUESTS=${MAX_RUNNING_REQUESTS:-256}
HOST=${HOST:-0.0.0.0}
ADVERTISE_HOST=${ADVERTISE_HOST:-$(hostname -f 2>/dev/null || hostname)}
BASE_PORT=${BASE_PORT:-30001}
ROUTER_PORT=${ROUTER_PORT:-30000}
ENGINE_CMD=${ENGINE_CMD:-python -m sglang.launch_server}
ROUTER_CMD=${ROUTER_CMD:-python -m sglang_router.launch_router}
if [[ -z "${ROUTER_ARGS+set}" ]]; then ROUTER_ARGS="--policy cache_aware"; fi
LOG_DIR=${LOG_DIR:-./sglang-logs}
READY_TIMEOUT=${READY_TIMEOUT:-1800}
DETACH=${DETACH:-0}

if [[ -z "${ENGINE_ARGS+set}" ]]; then
    [[ -n "${MODEL_PATH:-}" ]] || die "MODEL_PATH is not set (the model directory the workers load)"
    ENGINE_ARGS="--model-path $MODEL_PATH --tp-size $TP_SIZE"
fi
if [[ -z "${NUM_ENGINES:-}" ]]; then
    command -v nvidia-smi >/dev/null 2>&1 || die "NUM_ENGINES is not set and nvidia-smi is missing"
    gpus=$(nvidia-smi -L | grep -c '^GPU ')
    NUM_ENGINES=$((gpus / TP_SIZE))
fi
[[ "$NUM_ENGINES" =~ ^[1-9][0-9]*$ ]] || die "NUM_ENGINES=$NUM_ENGINES: expected a positive integer"

mkdir -p "$LOG_DIR"
pids=()
stop_all() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap 'note "stopping"; stop_all' INT TERM
trap '[[ $? -eq 0 ]] || stop_all' EXIT

# 1. workers
urls=()
for ((i = 0; i < NUM_ENGINES; i++)); do
    port=$((BASE_PORT + i))
    gpus=$(seq -s, $((i * TP_SIZE)) $((i * TP_SIZE + TP_SIZE - 1)))
    note "worker $i: GPUs $gpus, port $port (log $LOG_DIR/worker-$i.log)"
    # shellcheck disable=SC2086  # the command and argument strings are word-split on purpose
    CUDA_VISIBLE_DEVICES=$gpus $ENGINE_CMD $ENGINE_ARGS ${EXTRA_ENGINE_ARGS:-} \
        --host "$HOST" --port "$port" --weight-version 0 \
        --max-running-requests "$MAX_RUNNING_REQUESTS" >"$LOG_DIR/worker-$i.log" 2>&1 &
    pids+=($!)
    echo $! >"$LOG_DIR/worker-$i.pid"
    urls+=("http://$ADVERTISE_HOST:$port")
done

# 2. the router (unless one is given)
if [[ -z "${ROUTER_URL:-}" ]]; then
    ROUTER_URL="http://$ADVERTISE_HOST:$ROUTER_PORT"
    note "router on port $ROUTER_PORT (log $LOG_DIR/router.log)"
    # shellcheck disable=SC2086
    $ROUTER_CMD $ROUTER_ARGS --host "$HOST" --port "$ROUTER_PORT" >"$LOG_DIR/router.log" 2>&1 &
    pids+=($!)
    echo $! >"$LOG_DIR/router.pid"
fi
deadline=$((SECONDS + 120))
until curl -sf "$ROUTER_URL/workers" >/dev/null; do
    ((SECONDS < deadline)) || die "router $ROUTER_URL does not answer GET /workers"
    sleep 1
done

# 3. wait for each worker, then register it
for ((i = 0; i < NUM_ENGINES; i++)); do
    url=${urls[$i]}
    deadline=$((SECONDS + READY_TIMEOUT))
    until curl -sf -o /dev/null "$url/health_generate"; do
        kill -0 "${pids[$i]}" 2>/dev/null || die "worker $i exited; see $LOG_DIR/worker-$i.log"
        ((SECONDS < deadline)) || die "worker $i ($url) not healthy after ${READY_TIMEOUT}s"
        sleep 2
    done
    code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "$ROUTER_URL/workers" \
        -H 'Content-Type: application/json' -d "{\"url\": \"$url\"}")
    [[ "$code" == 202 || "$code" == 200 ]] || die "POST $ROUTER_URL/workers for $url answered $code"
    note "registered $url"
done

# 4. the router adds workers in the background: wait until it lists them all
deadline=$((SECONDS + 120))
for url in "${urls[@]}"; do
    until curl -sf "$ROUTER_URL/workers" | grep -q "\"$url\""; do
        ((SECONDS < deadline)) || die "router does not list $url after 120 s"
        sleep 1
    done
done
printf '%s\n' "${urls[@]}" >"$LOG_DIR/workers.txt"
note "router $ROUTER_URL lists ${#urls[@]} workers of this node (also in $LOG_DIR/workers.txt)"
echo "ROUTER_URL=$ROUTER_URL"

if [[ "$DETACH" == 1 ]]; then
    trap - EXIT INT TERM
    exit 0
fi
note "running; Ctrl-C stops the workers (and the router, if started here)"
wait
