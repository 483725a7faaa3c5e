#!/usr/bin/env bash
# One device call for the service path: W1 cold and again (prefix cache), batch-1 TPOT and shared-prefix TTFT
# through the real engine + worker over gRPC, the worker wrapped by bench/step_probe.py (step log, GPU busy in
# steady decode), then HF static generate on the same machine, and a table last. Every stage is bounded.
#
#   bash bench/gpu_service.sh                       # on the GPU machine, from the repository root
#   STAGES="env overhead" bash bench/gpu_service.sh # engine overhead: three runs, GPU busy + next_ready each
#   STAGES="prefix" bash bench/gpu_service.sh       # warm shared-prefix TTFT by hop, --front-procs 1 and 0
#   STAGES="gaps" GAPS_VARIANTS="default=;late=|--no-early-results" bash bench/gpu_service.sh  # the ITL tail
#   DEVICE=cpu MODEL=dummy:/path/tiny.json OFFLINE_ARGS="--num-requests 8 ..." STAGES="service" bash bench/gpu_service.sh
#
# Carried wheels (.whl/, when present) go to /tmp/site; results and logs land in ${OUT:-/tmp/ominix_service}.
set -u
OUT=${OUT:-/tmp/ominix_service}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda:0}
MODEL=${MODEL:-dummy:bench/configs/llama8b-config.json}
CONFIG_JSON=${CONFIG_JSON:-bench/configs/llama8b-config.json}
STAGES=${STAGES:-"env tests roofline service peer"}
WORKER_ARGS=${WORKER_ARGS:-}
SERVE_ARGS=${SERVE_ARGS:-"--front-procs 1"}  # as `launch` on a GPU: one front process takes the client streams
OFFLINE_ARGS=${OFFLINE_ARGS:-}
SERVICE_S=${SERVICE_S:-330}
export PYTHONUNBUFFERED=1
export OMINIX_PROFILE_BATCHES=${OMINIX_PROFILE_BATCHES:-256,1}
export OMINIX_PROFILE_STEPS=${OMINIX_PROFILE_STEPS:-32}
# Also one window over prefill steps (>= this many tokens, not pure decode): the profile run's W1 takes prompts
# of another seed, so its cold half prefills for real.
export OMINIX_PROFILE_PREFILL_TOKENS=${OMINIX_PROFILE_PREFILL_TOKENS:-4096}
export OMINIX_PROFILE_OUT=$OUT/probe.json
export OMINIX_PROFILE_GATE=/tmp/ominix_profile_gate
rm -f "$OMINIX_PROFILE_GATE"
# Word-split on use: a quoted default inside ${...:-} would reach offline.py as one argument.
OVERHEAD_ARGS=${OVERHEAD_ARGS:-"--num-requests 256 --input-len 512 --output-len 160"}
# Set to "" for no profiled run after the timed one.
PROFILE_ARGS=${PROFILE_ARGS-"--w1 --batch1 --output-len 64 --batch1-trials 1 --warmup-requests 0 --seed 17"}
# What the timed service run measures (offline.py's modes), e.g. "--w1".
SERVICE_MODES=${SERVICE_MODES:-"--all"}

. bench/carried_wheels.sh
export PYTHONPATH=$OURS_PATH

# free_ports N: N distinct ports outside the ephemeral range (no other socket takes one first), one call for
# all the ports a start needs: separate calls may name the same port twice.
free_ports() { python3 bench/common.py free-port "$1"; }

# Starts the worker (through step_probe.py) and the engine on free ports; sets WPID, EPID, EPORT. Returns 1,
# with the last log lines printed, as soon as either process has died, e.g. at import.
start_service() {
  local wport
  read -r wport EPORT <<<"$(free_ports 2)"
  timeout $((SERVICE_S + 60)) python3 bench/step_probe.py --model "$MODEL" --device "$DEVICE" --port "$wport" \
    $WORKER_ARGS >"$OUT/worker.log" 2>&1 &
  WPID=$!
  timeout $((SERVICE_S + 60)) python3 -m ominix_runtime serve --model "$MODEL" --worker "127.0.0.1:$wport" \
    --port "$EPORT" --metrics-port 0 --log-level warning --worker-ready-timeout 600 $SERVE_ARGS \
    >"$OUT/engine.log" 2>&1 &
  EPID=$!
  local started=$SECONDS
  if timeout 660 python3 bench/common.py wait-serving "127.0.0.1:$EPORT" --timeout 600 \
    --watch "worker:$WPID:$OUT/worker.log" --watch "engine:$EPID:$OUT/engine.log"
  then
    echo "service SERVING after $((SECONDS - started)) s"
  else
    echo "service never SERVING (see above)"
    return 1
  fi
}

stop_service() {
  kill -TERM "$EPID" 2>/dev/null; sleep 1; kill -TERM "$WPID" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$WPID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$EPID" "$WPID" 2>/dev/null
  wait 2>/dev/null
  tail -5 "$OUT/worker.log"
}

run_service() {
  if start_service; then
    timeout "$SERVICE_S" python3 bench/offline.py --address "127.0.0.1:$EPORT" $SERVICE_MODES --no-progress \
      --no-request-details --model-config "$CONFIG_JSON" --out-json "$OUT/offline.json" $BW_ARGS $OFFLINE_ARGS \
      2>&1 | grep -v -E "^(ITL|E2EL|peak|request throughput|total throughput|input tokens)" | tail -60
    # Profiler windows (steady decode at batch 256 and 1, prefill) in a short untimed run after the timed one.
    if [ -n "$PROFILE_ARGS" ]; then
      touch "$OMINIX_PROFILE_GATE"
      timeout 120 python3 bench/offline.py --address "127.0.0.1:$EPORT" --no-progress --no-request-details \
        $PROFILE_ARGS $OFFLINE_ARGS >"$OUT/profile_run.txt" 2>&1 || echo "profile run failed: $(tail -3 "$OUT/profile_run.txt")"
    fi
  fi
  stop_service
}

# The stages below set the probe's variables and the service arguments for themselves: their bodies are
# subshells, so nothing they export reaches the next stage.

# Engine overhead at batch 256, three consecutive runs on one service after an unprofiled warm-up run: each run
# is W1-shaped (OVERHEAD_ARGS: 256 requests x 512 prompt tokens x 160 outputs, untimed) and gets its own profiler
# window (the gate file's label names the run); the summary prints GPU busy and the median next_ready of each run.
run_overhead() (
  local out=$OUT/overhead
  mkdir -p "$out"
  export OMINIX_PROFILE_OUT=$out/probe.json
  export OMINIX_PROFILE_PREFILL_TOKENS=0  # decode windows only: no profiler stop between prefill and decode
  if start_service; then
    # One untimed run first, with no profiler window: the service's first prompts of these shapes compile
    # Triton variants (a first run read 93.5% busy and a third of the later runs' throughput on an H200).
    timeout 200 python3 bench/offline.py --address "127.0.0.1:$EPORT" --w1 --warmup-requests 0 --no-progress \
      --no-request-details $OVERHEAD_ARGS >"$out/run0.txt" 2>&1 || echo "overhead warm-up run failed: $(tail -3 "$out/run0.txt")"
    grep -E "W1 cold \(" "$out/run0.txt" | head -1 | sed 's/^/warm-up: /'
    for run in 1 2 3; do
      echo "run$run" >"$OMINIX_PROFILE_GATE"
      timeout 200 python3 bench/offline.py --address "127.0.0.1:$EPORT" --w1 --warmup-requests 0 --no-progress \
        --no-request-details $OVERHEAD_ARGS \
        >"$out/run$run.txt" 2>&1 || echo "overhead run $run failed: $(tail -3 "$out/run$run.txt")"
      grep -E "W1 cold \(" "$out/run$run.txt" | head -1
    done
  fi
  stop_service
  rm -f "$OMINIX_PROFILE_GATE"
  python3 bench/service_summary.py "$out" | grep -E "^(overhead|between decode steps at batch 256|GPU busy)" \
    | tee "$out/summary.txt"
)

# Warm shared-prefix TTFT split by hop: for each front-process count in PREFIX_FRONTS, one service and
# PREFIX_TRIALS prefix pairs (plus batch-1 TPOT); the client's send / first-token times against the worker's step
# log (bench/service_summary.py prefix_hops).
run_prefix() (
  local fronts out
  for fronts in ${PREFIX_FRONTS:-1 0}; do
    out=$OUT/prefix_front$fronts
    mkdir -p "$out"
    export OMINIX_PROFILE_OUT=$out/probe.json
    SERVE_ARGS="--front-procs $fronts"
    if start_service; then
      timeout 200 python3 bench/offline.py --address "127.0.0.1:$EPORT" --shared-prefix --batch1 --no-progress \
        --no-request-details --prefix-trials "${PREFIX_TRIALS:-15}" --out-json "$out/offline.json" $OFFLINE_ARGS \
        >"$out/offline.txt" 2>&1 || echo "prefix run failed: $(tail -3 "$out/offline.txt")"
    fi
    stop_service >/dev/null
    echo "--front-procs $fronts: $(grep -E "TTFT warm|batch-1 TPOT" "$out/offline.txt" | tr -s ' ' | paste -sd';')"
    python3 bench/service_summary.py "$out" | grep -E "^warm shared-prefix" | tee "$out/summary.txt"
  done
)

# The ITL tail at a moderate rate, step by step: for each GAPS_VARIANTS entry (LABEL=SERVE-ARGS[|WORKER-ARGS],
# ';'-separated), one service (worker through the step probe, no profiler window) driven by bench/online.py at
# GAPS_RATE req/s with per-request lists; bench/step_gaps.py then matches the longest client gaps with the
# worker's steps. E.g. GAPS_VARIANTS="default=;late=|--no-early-results;ll0=--light-load-below-running 0".
run_gaps() (
  local saved_serve=$SERVE_ARGS saved_worker=$WORKER_ARGS out=$OUT/gaps entries entry label args
  mkdir -p "$out"
  # No profiler window, and the probe's log written only at exit: a periodic write stalls the device thread.
  export OMINIX_PROFILE_BATCHES="" OMINIX_PROFILE_PREFILL_TOKENS=0 OMINIX_PROFILE_WRITE_EVERY=0
  export OMINIX_PROFILE_ALLOCATOR=${OMINIX_PROFILE_ALLOCATOR:-1}  # the slowest steps with their allocator calls
  IFS=';' read -ra entries <<<"${GAPS_VARIANTS:-default=}"
  for entry in "${entries[@]}"; do
    if [[ ! $entry =~ ^[A-Za-z0-9_.-]+= ]]; then
      echo "gaps: GAPS_VARIANTS entry '$entry' is not LABEL=SERVE-ARGS[|WORKER-ARGS]; skipped"
      continue
    fi
    label=${entry%%=*}; args=${entry#*=}
    WORKER_ARGS=$saved_worker
    [[ $args == *"|"* ]] && { WORKER_ARGS="$saved_worker ${args#*|}"; args=${args%%|*}; }
    export OMINIX_PROFILE_OUT=$out/probe_$label.json
    rm -f "$out/probe_$label.json" "$out/online_$label.json"  # no earlier run's files to match by mistake
    SERVE_ARGS="$saved_serve $args"
    if start_service; then
      timeout 200 python3 bench/online.py run --address "127.0.0.1:$EPORT" --rates "${GAPS_RATE:-8}" \
        --seconds "${GAPS_SECONDS:-20}" --input-len "${GAPS_INPUT_LEN:-1024}" \
        --output-len "${GAPS_OUTPUT_LEN:-256}" --warmup-requests 16 --no-progress --save-detailed \
        --label "$label" --out-json "$out/online_$label.json" >"$out/online_$label.txt" 2>&1
      grep -E "^rate " "$out/online_$label.txt" | tail -1
    fi
    stop_service >/dev/null
    if [ -s "$out/online_$label.json" ] && [ -s "$out/probe_$label.json" ]; then
      python3 bench/step_gaps.py "$out/probe_$label.json" "$out/online_$label.json" 2>&1 | tail -40
      python3 -c "import json, sys; from bench.service_summary import slowest_steps; \
print('slowest worker steps:', slowest_steps(json.load(open(sys.argv[1]))['steps'], 6))" "$out/probe_$label.json"
    else
      echo "$label: no run to match; the last lines of the client and the worker:"
      tail -5 "$out/online_$label.txt" "$OUT/worker.log" 2>/dev/null
    fi
  done
)

BW_ARGS=""
for stage in $STAGES; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
      python3 -c "import torch, triton, transformers, google.protobuf as pb, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'protobuf', pb.__version__, 'grpc', grpc.__version__)"
      python3 -c "import aiohttp, tokenizers, jinja2, uvloop, prometheus_client; print('aiohttp tokenizers jinja2 uvloop prometheus_client: ok')" ;;
    tests)
      XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
      timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -o addopts="" $XDIST ${TESTS:-tests/gpu} 2>&1 | tail -8 ;;
    roofline)
      timeout 90 python3 bench/roofline.py --json "$OUT/roofline.json" 2>&1 | tail -10
      BW_ARGS=$(python3 -c "import json; r=json.load(open('$OUT/roofline.json')); print(f'--bandwidth {r[\"bandwidth\"]} --flops {r[\"flops\"]}')" 2>/dev/null) ;;
    service)
      run_service ;;
    overhead)
      run_overhead ;;
    prefix)
      run_prefix ;;
    gaps)
      run_gaps ;;
    peer)
      timeout ${PEER_S:-240} python3 bench/peer_hf.py --batch 128 --json "$OUT/peer_hf.json" 2>&1 \
        | grep -v -E "it/s\]|Loading" | tail -4 ;;
  esac
done
echo "=== summary $(date -u +%FT%TZ)"
python3 bench/service_summary.py "$OUT" | tee "$OUT/summary.txt"
