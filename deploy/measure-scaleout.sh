#!/usr/bin/env bash
# Scale-out measurement of docs/scaling.md: 1 vs 2 active-active kvgate instances in front of
# one simulated fleet, same trace slice, cold caches for each run. Everything on 127.0.0.1.
#
#   deploy/measure-scaleout.sh [OUT_DIR]        (from the repository root, after make)
#
# Topology of each run:
#
#   replayer ──> splitter (kvgate round_robin, no index: an L7 balancer, like a Service)
#                  ├──> kvgate A (policy kv) ──┐
#                  └──> kvgate B (policy kv) ──┴──> sim replicas 0..3 (HTTP + KV events)
#
# The 1-instance run uses the same splitter with only A behind it, so both runs pay the
# same extra hop. Each kvgate instance subscribes to every replica's KV events.
# Knobs (environment): REPLICAS, SPEEDUP, CAPACITY, TRACE, TRACE_ARGS, DURATION.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
OUT=${1:-bench/results/scaleout-$(date +%Y%m%d-%H%M%S)}
REPLICAS=${REPLICAS:-4}
SPEEDUP=${SPEEDUP:-4}
CAPACITY=${CAPACITY:-4096}
TRACE=${TRACE:-../shared/traces/conversation_trace.jsonl}
TRACE_ARGS=${TRACE_ARGS:---max-requests 400 --token-scale 0.25}
DURATION=${DURATION:-120}
SIM_PORT=9301 EVENTS_PORT=5757 A_PORT=8301 B_PORT=8302 SPLIT_PORT=8300
mkdir -p "$OUT"

PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

wait_ok() {  # URL: poll until it answers 200 (60 s at most)
  for _ in $(seq 600); do
    if $BIN/python -c "import sys, httpx; sys.exit(httpx.get('$1', timeout=1).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  echo "no answer from $1" >&2; return 1
}

TOKENIZER=$($BIN/python -c "from backends.sim.tokenizer import tokenizer_dir; print(tokenizer_dir())")
WORKERS=()
for i in $(seq 0 $((REPLICAS - 1))); do
  ev=$((EVENTS_PORT + 2 * i))
  WORKERS+=(--worker "http://127.0.0.1:$((SIM_PORT + i)),models=kvgate-sim,events=tcp://127.0.0.1:$ev,replay=tcp://127.0.0.1:$((ev + 1))")
done

run() {  # LABEL INSTANCES...
  local label=$1; shift
  local dir="$OUT/$label"; mkdir -p "$dir"
  $BIN/kvgate sim --replicas "$REPLICAS" --port $SIM_PORT --events-port $EVENTS_PORT \
      --speedup "$SPEEDUP" --capacity-blocks "$CAPACITY" > "$dir/sim.log" 2>&1 &
  PIDS+=($!)
  for i in $(seq 0 $((REPLICAS - 1))); do wait_ok "http://127.0.0.1:$((SIM_PORT + i))/health"; done
  local upstream=()
  for port in "$@"; do
    $BIN/kvgate serve --port "$port" --policy kv --tokenizer "kvgate-sim=$TOKENIZER" \
        --log-level warning "${WORKERS[@]}" > "$dir/kvgate-$port.log" 2>&1 &
    PIDS+=($!)
    wait_ok "http://127.0.0.1:$port/ready"
    upstream+=(--worker "http://127.0.0.1:$port,engine=openai,models=kvgate-sim")
  done
  $BIN/kvgate serve --port $SPLIT_PORT --policy round_robin --no-kv-index \
      --log-level warning "${upstream[@]}" > "$dir/splitter.log" 2>&1 &
  PIDS+=($!)
  wait_ok "http://127.0.0.1:$SPLIT_PORT/ready"
  # shellcheck disable=SC2086
  $BIN/kvgate bench replay --trace "$TRACE" $TRACE_ARGS --speedup "$SPEEDUP" \
      --duration "$DURATION" --target "http://127.0.0.1:$SPLIT_PORT" --label "$label" \
      --replicas "$REPLICAS" --no-progress --out "$dir" | tee "$dir/replay.txt"
  for port in "$@"; do
    $BIN/python -c "import httpx; print(httpx.get('http://127.0.0.1:$port/metrics').text)" \
        > "$dir/metrics-$port.txt"
  done
  stop_all
}

run one-instance $A_PORT
run two-instances $A_PORT $B_PORT
echo "results in $OUT"
