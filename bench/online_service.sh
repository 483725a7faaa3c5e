#!/usr/bin/env bash
# Online serving, this project beside vLLM, in one GPU-machine call: a dummy model of one shape (default the
# Llama-3.1-8B shape) with a word-level tokenizer (bench/online.py model-dir), our service (`launch`) driven by
# bench/online.py, then `vllm serve` driven by `vllm bench serve`, each at the same Poisson request rates with the
# same prompt and output lengths, one after the other on the whole GPU; a table (and a PNG where matplotlib is
# installed) last. Every wait stops at once when the process waited on has died, printing its last log lines.
#
#   VLLM_SITE=/path/to/unpacked/vllm/wheels bash bench/online_service.sh      # from the repository root
#   STAGES=ours DEVICE=cpu CONFIG_JSON=tiny/config.json INPUT_LEN=32 OUTPUT_LEN=8 bash bench/online_service.sh
#
# VLLM_SITE: a folder on PYTHONPATH for the vLLM processes only (unset: vLLM from python3's own site-packages).
# Carried wheels (.whl/, when present) go to /tmp/site for our service. The few result files go to $RESULTS
# (default $OUT, else /tmp/ominix_online): online_ominix.json and online_vllm.json (a list of vllm-bench-style
# results, one per rate), online_table.md, online.png, logs_tail.txt; logs and raw files to $WORK.
# SAME_SCHEDULE=1: after `vllm bench serve`, bench/online.py also drives `vllm serve` (over /v1/completions) with
# the arrival schedule and prompts it gave our service: online_vllm_our_schedule.json and
# online_table_one_schedule.md (and online_one_schedule.png), a comparison the two benches' different random
# draws do not blur. VLLM_BENCH=0 leaves `vllm bench serve` out (a shorter call when only the one-schedule
# comparison is wanted). DETAILED=1 keeps each request's TTFT, ITLs and send time in the result JSONs (both
# benches' --save-detailed; the A/B's run files are then written gzipped, ab_r<first>.json.gz: ~24 MB a round of
# the issue's rates uncompressed, more than a device call brings back).
# Paired A/B (bench/online_ab.py), over several calls of one warm machine: stage ab-start starts `vllm serve`
# and one service of ours per AB_OURS entry (LABEL=LAUNCH-ARGS, ';'-separated; leading NAME=VALUE words of
# LAUNCH-ARGS are that service's environment, as in "fast=OMINIX_PIECEWISE_FASTEST_BUCKET=1"), all on the one
# GPU at once, each with AB_SHARE of its memory, and leaves them running (setsid); ab-run drives them in turn,
# AB_ROUNDS rounds from AB_FIRST_ROUND, into ab_r<first>.json; ab-stop stops them; ab-table compares every
# server with AB_BASELINE round by round (ab_table.md, and ab.png with matplotlib). Keep AB_SHARE x servers
# within the device and the rates low enough that no server runs out of KV. AB_VLLM=0 starts our services only
# (with AB_BASELINE one of their labels), to compare settings of ours at a larger share each.
set -u
RESULTS=${RESULTS:-${OUT:-/tmp/ominix_online}}
WORK=${WORK:-/tmp/ominix_online_work}
mkdir -p "$RESULTS" "$WORK"
STAGES=${STAGES:-"ours vllm table"}
DEVICE=${DEVICE:-cuda:0}
CONFIG_JSON=${CONFIG_JSON:-bench/configs/llama8b-config.json}
RATES=${RATES:-"4 8 16 32 inf"}
SECONDS_PER_RATE=${SECONDS_PER_RATE:-15}
INF_PROMPTS=${INF_PROMPTS:-256}
MIN_PROMPTS=${MIN_PROMPTS:-16}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-256}
WARMUP=${WARMUP:-16}
SEED=${SEED:-0}
SLO_TTFT_MS=${SLO_TTFT_MS:-500}
SLO_TPOT_MS=${SLO_TPOT_MS:-50}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
MAX_BATCH_TOKENS=${MAX_BATCH_TOKENS:-8192}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9}
READY_S=${READY_S:-300}          # our service: launch to health SERVING
VLLM_READY_S=${VLLM_READY_S:-400} # vllm serve: start to GET /health 200
RATE_S=${RATE_S:-150}            # one rate's run, either system
OURS_ARGS=${OURS_ARGS:-}
VLLM_ARGS=${VLLM_ARGS:-}
SERVER_LIFETIME_S=${SERVER_LIFETIME_S:-1200} # a server started here stops itself after this long
AB_OURS=${AB_OURS:-"ominix="}     # ab-start: our services, LABEL=LAUNCH-ARGS separated by ';'
AB_SHARE=${AB_SHARE:-0.3}         # ab-start: each server's share of the GPU's memory
# ab-start: every server's KV cache in bytes (--kv-cache-memory to vllm serve and ours), so all hold the same
# capacity whatever their start order; empty: each sizes its own from its share, and a server started later
# reads less (each one's use past its share comes off the next one's measure).
AB_KV_BYTES=${AB_KV_BYTES:-}
AB_ROUNDS=${AB_ROUNDS:-2}
AB_FIRST_ROUND=${AB_FIRST_ROUND:-0}
AB_BASELINE=${AB_BASELINE:-vllm}
AB_VLLM=${AB_VLLM:-1}             # ab-start: 0 leaves vllm serve out even where vllm imports
AB_STEPS=${AB_STEPS:-0}           # ab-start: 1 serves our metrics, and ab-run reads every server's step mix
SAME_SCHEDULE=${SAME_SCHEDULE:-0} # 1: also drive vllm serve with bench/online.py's schedule and prompts
VLLM_BENCH=${VLLM_BENCH:-1}       # 0: skip `vllm bench serve` (SAME_SCHEDULE=1: only our schedule drives it)
DETAILED=${DETAILED:-0}           # 1: per-request lists (TTFT, ITLs, start times) in every result JSON
DETAILED_ARG=$([ "$DETAILED" = 1 ] && echo --save-detailed)
export PYTHONUNBUFFERED=1
T0=$SECONDS
part() { echo "=== $1 (t=$((SECONDS - T0)) s, $(date -u +%T))"; }

. bench/carried_wheels.sh
VLLM_PATH=${VLLM_SITE:-}
ours_py() { PYTHONPATH="$OURS_PATH" python3 "$@"; }
vllm_py() { PYTHONPATH="$VLLM_PATH" python3 "$@"; }
# free_ports N: N distinct ports outside the ephemeral range (no other socket takes one first), one call for
# all the ports a start needs: separate calls may name the same port twice.
free_ports() { python3 bench/common.py free-port "$1"; }
rate_prompts() {
  ours_py bench/online.py num-prompts --rate "$1" --seconds "$SECONDS_PER_RATE" --inf-prompts "$INF_PROMPTS" \
    --min-prompts "$MIN_PROMPTS"
}

# Stop what setsid started: SIGTERM to its leader (timeout passes it on, the service stops its own children),
# SIGKILL to the whole group after 30 s; then (unless a second argument says no) wait until no process holds the
# GPU, so the next system starts on the whole device.
stop_group() {
  local pid=$1 wait_gpu=${2:-1}
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  [ "$wait_gpu" = 1 ] && wait_gpu_free
}

wait_gpu_free() {
  if command -v nvidia-smi >/dev/null; then
    for _ in $(seq 30); do
      [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break
      sleep 1
    done
  fi
}

# The load's shape for bench/online.py run and bench/online_ab.py run (their add_load_arguments).
LOAD_ARGS=(--rates "$(echo $RATES | tr ' ' ',')" --seconds "$SECONDS_PER_RATE" --inf-prompts "$INF_PROMPTS"
  --min-prompts "$MIN_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --warmup-requests "$WARMUP"
  --seed "$SEED" --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" --no-progress $DETAILED_ARG)

# bench/online.py's schedule and prompts at every rate against ADDRESS (the engine's gRPC, or http:// for an
# OpenAI-compatible server), labelled LABEL, results to OUT_JSON; further arguments go to `online.py run`.
# Bounded as a whole; a server that dies mid-run fails the open streams, which ends the run.
drive_rates() {
  local address=$1 label=$2 out=$3
  shift 3
  timeout $((RATE_S * $(echo $RATES | wc -w) + 60)) env PYTHONPATH="$OURS_PATH" python3 bench/online.py run \
    --address "$address" "${LOAD_ARGS[@]}" --label "$label" --out-json "$out" "$@"
}

MODEL_DIR=$WORK/model
part "model folder"
ours_py bench/online.py model-dir --config "$CONFIG_JSON" --out "$MODEL_DIR" || exit 1

# Our service as LABEL with GPU memory share UTIL and further launch arguments, log $WORK/LABEL.log; waits for
# health SERVING (stopping at once if it died). Sets STARTED_PID, STARTED_ADDR and STARTED_METRICS (its Prometheus
# endpoint with WITH_METRICS=1, else -); returns 1 if it never served. The metrics server stays off by default:
# with it on, the engine also fills its request histograms (an observation per output token).
start_ours() {
  local label=$1 util=$2 port wbase picked mport=0
  shift 2
  read -r port picked wbase <<<"$(free_ports 3)"  # the base last: workers take base + i
  [ "${WITH_METRICS:-0}" = 1 ] && mport=$picked
  part "$label: launch"
  # shellcheck disable=SC2086  # OURS_ENV: NAME=VALUE words, one per variable
  env ${OURS_ENV:-} PYTHONPATH="$OURS_PATH" setsid timeout "$SERVER_LIFETIME_S" python3 -m ominix_runtime launch \
    --model "dummy:$MODEL_DIR" --devices "$DEVICE" --port "$port" --metrics-port "$mport" --worker-base-port "$wbase" \
    --max-model-len "$MAX_MODEL_LEN" --max-running-requests "$MAX_NUM_SEQS" --max-batch-tokens "$MAX_BATCH_TOKENS" \
    --gpu-memory-utilization "$util" --log-level warning "$@" >"$WORK/$label.log" 2>&1 &
  STARTED_PID=$!
  STARTED_ADDR=127.0.0.1:$port
  STARTED_METRICS=-
  [ "$mport" = 0 ] || STARTED_METRICS=http://127.0.0.1:$mport/metrics
  timeout $((READY_S + 30)) env PYTHONPATH="$OURS_PATH" python3 bench/common.py wait-serving "$STARTED_ADDR" \
    --timeout "$READY_S" --watch "ominix-runtime launch ($label):$STARTED_PID:$WORK/$label.log"
}

run_ours() {
  if start_ours ominix "$GPU_MEMORY_UTILIZATION" $OURS_ARGS; then
    part "ours: rates $RATES"
    drive_rates "$STARTED_ADDR" ominix "$RESULTS/online_ominix.json" || echo "ours: the run failed or timed out (exit $?)"
    kill -0 "$STARTED_PID" 2>/dev/null || { echo "ours: the service died during the run:"; tail -20 "$WORK/ominix.log"; }
  else
    echo "ours: service never SERVING (see above)"
  fi
  part "ours: stop"
  stop_group "$STARTED_PID"
}

vllm_importable() {
  # The GPU machine has no network; the FlashInfer sampler stays off as in the peer's recipe.
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
  part "vllm: import check"
  if ! vllm_py -c "import vllm, vllm.benchmarks.serve; print('vllm', vllm.__version__)" 2>"$WORK/vllm_import.log"; then
    echo "vllm: cannot import vllm.benchmarks.serve (VLLM_SITE=${VLLM_SITE:-unset}); skipped:"
    tail -5 "$WORK/vllm_import.log"
    return 1
  fi
}

# `vllm serve` with GPU memory share UTIL, log $WORK/vllm.log; waits for GET /health 200 (stopping at once if it
# died). Sets STARTED_PID and STARTED_PORT; returns 1 if it never became healthy.
start_vllm() {
  local util=$1
  STARTED_PORT=$(free_ports 1)
  part "vllm: serve"
  PYTHONPATH="$VLLM_PATH" setsid timeout "$SERVER_LIFETIME_S" python3 -m vllm.entrypoints.cli.main serve "$MODEL_DIR" \
    --load-format dummy --dtype bfloat16 --max-model-len "$MAX_MODEL_LEN" --max-num-seqs "$MAX_NUM_SEQS" \
    --max-num-batched-tokens "$MAX_BATCH_TOKENS" --gpu-memory-utilization "$util" \
    --host 127.0.0.1 --port "$STARTED_PORT" --seed 0 --disable-uvicorn-access-log $VLLM_ARGS >"$WORK/vllm.log" 2>&1 &
  STARTED_PID=$!
  timeout $((VLLM_READY_S + 30)) python3 bench/common.py wait-serving "127.0.0.1:$STARTED_PORT" --http \
    --timeout "$VLLM_READY_S" --watch "vllm serve:$STARTED_PID:$WORK/vllm.log"
}

run_vllm() {
  local port pid i n rate files
  if [ "$VLLM_BENCH" != 1 ] && [ "$SAME_SCHEDULE" != 1 ]; then
    echo "vllm: VLLM_BENCH=0 and SAME_SCHEDULE=0 leave nothing to run; skipped"
    return
  fi
  if [ "$VLLM_BENCH" != 1 ] && [ -e "$RESULTS/online_vllm.json" ]; then
    echo "vllm: VLLM_BENCH=0: removing $RESULTS/online_vllm.json of an earlier run, so the table does not show it"
    rm -f "$RESULTS/online_vllm.json"
  fi
  vllm_importable || return
  start_vllm "$GPU_MEMORY_UTILIZATION"
  local healthy=$?
  pid=$STARTED_PID
  port=$STARTED_PORT
  if [ "$healthy" = 0 ]; then
    if [ "$VLLM_BENCH" = 1 ]; then
      local bench=(python3 -m vllm.entrypoints.cli.main bench serve --host 127.0.0.1 --port "$port"
        --model "$MODEL_DIR" --dataset-name random --random-input-len "$INPUT_LEN" --ignore-eos --temperature 0
        --disable-tqdm)
      part "vllm: warm-up ($WARMUP requests at once)"
      timeout "$RATE_S" env PYTHONPATH="$VLLM_PATH" "${bench[@]}" --random-output-len 16 --num-prompts "$WARMUP" \
        --request-rate inf --seed $((SEED + 10000)) >"$WORK/vllm_warmup.log" 2>&1 \
        || { echo "vllm: warm-up failed:"; tail -20 "$WORK/vllm_warmup.log"; }
      rm -rf "$WORK/vllm_results"; mkdir -p "$WORK/vllm_results"
      i=0
      for rate in $RATES; do
        n=$(rate_prompts "$rate")
        part "vllm: rate $rate ($n prompts)"
        timeout "$RATE_S" env PYTHONPATH="$VLLM_PATH" "${bench[@]}" --random-output-len "$OUTPUT_LEN" \
          --request-rate "$rate" --num-prompts "$n" --seed $((SEED + i)) --label vllm --save-result \
          --result-dir "$WORK/vllm_results" --result-filename "rate_$i.json" \
          --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 $DETAILED_ARG \
          --goodput "ttft:$SLO_TTFT_MS" "tpot:$SLO_TPOT_MS" >"$WORK/vllm_rate_$i.log" 2>&1 \
          || { echo "vllm: rate $rate failed (exit $?):"; tail -20 "$WORK/vllm_rate_$i.log"; }
        grep -E "^(Successful|Failed) requests|Request goodput|Output token throughput|(Median|P99) (TTFT|TPOT|ITL)" \
          "$WORK/vllm_rate_$i.log" | tr -s ' ' | paste -sd ';' -
        kill -0 "$pid" 2>/dev/null || { echo "vllm: the server died:"; tail -20 "$WORK/vllm.log"; break; }
        i=$((i + 1))
      done
      files=$(ls "$WORK"/vllm_results/rate_*.json 2>/dev/null | grep -v pytorch)
      if [ -n "$files" ]; then
        python3 -c "import json, sys; json.dump([json.load(open(f)) for f in sys.argv[2:]], open(sys.argv[1], 'w'), indent=1)" \
          "$RESULTS/online_vllm.json" $files && echo "vllm: $(echo $files | wc -w) results in $RESULTS/online_vllm.json"
      fi
    fi
    if [ "$SAME_SCHEDULE" = 1 ] && kill -0 "$pid" 2>/dev/null; then
      part "vllm: our schedule and prompts (bench/online.py over /v1/completions)"
      # After `vllm bench serve` the server is warm already: no second warm-up.
      drive_rates "http://127.0.0.1:$port" vllm-our-schedule "$RESULTS/online_vllm_our_schedule.json" \
        --model-config "$MODEL_DIR/config.json" $([ "$VLLM_BENCH" = 1 ] && echo --warmup-requests 0) \
        || echo "vllm: our schedule's run failed or timed out (exit $?)"
    fi
  else
    echo "vllm: server never healthy (see above)"
  fi
  part "vllm: stop"
  stop_group "$pid"
}

# ab-start: vllm serve (with AB_VLLM=1, when importable), then each AB_OURS service, one after another (each
# measures the memory the ones before it hold); the servers file lists LABEL PID ADDRESS LOG METRICS-URL (-
# without AB_STEPS=1), one server a line.
AB_SERVERS=$WORK/ab_servers
ab_start() {
  local n=0 entry label vllm_metrics words envs
  if [ -s "$AB_SERVERS" ]; then
    echo "ab-start: servers of an earlier ab-start still listed in $AB_SERVERS (run ab-stop first):"
    cat "$AB_SERVERS"; return 1
  fi
  IFS=';' read -ra entries <<<"$AB_OURS"
  for entry in "${entries[@]}"; do
    [[ $entry =~ ^[A-Za-z0-9_.-]+= ]] || { echo "ab-start: AB_OURS entry '$entry' is not LABEL=LAUNCH-ARGS"; return 1; }
  done
  if [ "$AB_VLLM" != 1 ] && [ "$AB_BASELINE" = vllm ]; then
    echo "ab-start: AB_VLLM=0 leaves vllm serve out; set AB_BASELINE to one of AB_OURS's labels"; return 1
  fi
  : >"$AB_SERVERS"
  local kv_args=() vllm_kv=
  if [ -n "$AB_KV_BYTES" ]; then
    # A plain count: the two servers read size suffixes differently (ours G = 10^9, vLLM's G = 2^30).
    [[ $AB_KV_BYTES =~ ^[0-9]+$ ]] || { echo "ab-start: AB_KV_BYTES must be a number of bytes, got '$AB_KV_BYTES'"; return 1; }
    kv_args=(--kv-cache-memory "$AB_KV_BYTES")
    vllm_kv="--kv-cache-memory-bytes $AB_KV_BYTES"
  fi
  if [ "$AB_VLLM" = 1 ] && vllm_importable; then
    if VLLM_ARGS="$VLLM_ARGS $vllm_kv" start_vllm "$AB_SHARE"; then
      vllm_metrics=-  # vLLM keeps its statistics in any case; AB_STEPS=1 reads them
      [ "$AB_STEPS" = 1 ] && vllm_metrics=http://127.0.0.1:$STARTED_PORT/metrics
      echo "vllm $STARTED_PID http://127.0.0.1:$STARTED_PORT $WORK/vllm.log $vllm_metrics" >>"$AB_SERVERS"
      n=1
    else
      echo "ab-start: vllm serve never healthy (see above)"; stop_group "$STARTED_PID" 0; ab_stop; return 1
    fi
  elif [ "$AB_BASELINE" = vllm ]; then
    echo "ab-start: AB_BASELINE=vllm, but vllm cannot be imported (see above)"; return 1
  fi
  for entry in "${entries[@]}"; do
    label=${entry%%=*}
    read -ra words <<<"${entry#*=}"
    # Leading NAME=VALUE words are that service's environment (a debug variable), the rest its launch args.
    envs=()
    while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} =~ ^[A-Z_][A-Z0-9_]*= ]]; do
      envs+=("${words[0]}")
      words=("${words[@]:1}")
    done
    n=$((n + 1))
    # Our share counts every byte in use on the device: the servers before it and this one.
    # shellcheck disable=SC2086  # OURS_ARGS: words
    if WITH_METRICS=$AB_STEPS OURS_ENV="${envs[*]}" start_ours "$label" "$(awk "BEGIN { print $AB_SHARE * $n }")" \
      $OURS_ARGS "${kv_args[@]}" "${words[@]}"; then
      echo "$label $STARTED_PID $STARTED_ADDR $WORK/$label.log $STARTED_METRICS" >>"$AB_SERVERS"
    else
      echo "ab-start: $label never SERVING (see above)"; stop_group "$STARTED_PID" 0; ab_stop; return 1
    fi
  done
  echo "ab-start: $(wc -l <"$AB_SERVERS") servers up:"; cat "$AB_SERVERS"
}

ab_run() {
  local label pid address log metrics servers=() watches=() count=0
  [ -s "$AB_SERVERS" ] || { echo "ab-run: no servers (run ab-start first)"; return 1; }
  while read -r label pid address log metrics; do
    servers+=(--server "$label=$address")
    [[ $metrics == http* ]] && servers+=(--steps "$label=$metrics")  # AB_STEPS=1 at ab-start
    watches+=(--watch "$label:$pid:$log")
    count=$((count + 1))
  done <"$AB_SERVERS"
  part "ab-run: rounds $AB_FIRST_ROUND.. ($AB_ROUNDS) at $RATES, $count servers"
  timeout $((RATE_S * $(echo $RATES | wc -w) * count * AB_ROUNDS + 120)) env PYTHONPATH="$OURS_PATH" \
    python3 bench/online_ab.py run "${servers[@]}" "${watches[@]}" --model-config "$MODEL_DIR/config.json" \
    "${LOAD_ARGS[@]}" --rounds "$AB_ROUNDS" --first-round "$AB_FIRST_ROUND" \
    --out-json "$RESULTS/ab_r$AB_FIRST_ROUND.json$([ "$DETAILED" = 1 ] && echo .gz)" \
    || echo "ab-run: failed or timed out (exit $?)"
}

ab_stop() {
  local label pid address log metrics
  [ -s "$AB_SERVERS" ] || return 0
  while read -r label pid address log metrics; do
    part "ab-stop: $label"
    stop_group "$pid" 0
  done <"$AB_SERVERS"
  wait_gpu_free
  rm -f "$AB_SERVERS"
}

for stage in $STAGES; do
  case $stage in
    ours) run_ours ;;
    vllm) run_vllm ;;
    table)
      part "table"
      series=()
      png=$(ours_py -c "import matplotlib" 2>/dev/null && echo yes)
      [ -s "$RESULTS/online_ominix.json" ] && series+=(--series "ominix=$RESULTS/online_ominix.json")
      [ -s "$RESULTS/online_vllm.json" ] && series+=(--series "vllm=$RESULTS/online_vllm.json")
      if [ ${#series[@]} -gt 0 ]; then
        ours_py bench/plot_online.py "${series[@]}" --table "$RESULTS/online_table.md" \
          --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" ${png:+--png "$RESULTS/online.png"}
      else
        echo "no results to tabulate"
      fi
      if [ -s "$RESULTS/online_ominix.json" ] && [ -s "$RESULTS/online_vllm_our_schedule.json" ]; then
        echo "--- one schedule for both (ours and vllm serve driven by bench/online.py)"
        ours_py bench/plot_online.py --series "ominix=$RESULTS/online_ominix.json" \
          --series "vllm=$RESULTS/online_vllm_our_schedule.json" --table "$RESULTS/online_table_one_schedule.md" \
          --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" ${png:+--png "$RESULTS/online_one_schedule.png"}
      fi ;;
    ab-start) ab_start ;;
    ab-run) ab_run ;;
    ab-stop) ab_stop ;;
    ab-table)
      part "ab-table"
      png=$(ours_py -c "import matplotlib" 2>/dev/null && echo yes)
      ours_py bench/online_ab.py table "$RESULTS"/ab_r*.json* --baseline "$AB_BASELINE" --out-md "$RESULTS/ab_table.md" \
        --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" ${png:+--png "$RESULTS/ab.png"} ;;
    *) echo "unknown stage $stage" ;;
  esac
done
for log in "$WORK"/*.log; do
  case $log in */vllm_rate_*|*/vllm_warmup.log|*/vllm_import.log) continue ;; esac
  [ -f "$log" ] && { echo "--- last lines of $log"; tail -15 "$log"; }
done >"$RESULTS/logs_tail.txt"
part "done"
