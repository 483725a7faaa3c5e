#!/usr/bin/env bash
# Tensor and data parallelism on one multi-GPU machine, every stage bounded, a table last:
#   env       GPUs and versions
#   tests     tests/gpu/test_tensor_parallel_gpu.py (TP=2/4 logits vs TP=1 in bf16, graphs, kill -9 of a rank)
#   nccl      NCCL all-reduce bus bandwidth and the all-reduce time of one decode step of the model shape
#   handoff   the leader's step hand-off per step (bench/tp_handoff.py, 256-request decode steps)
#   tp        Llama-3.1-70B shape dummy bf16, one TP=$TP group behind serve: W1 256 x 512 x 256 and batch-1 TPOT
#   dp        Llama-8B shape: W1 on one TP=1 group, then on two TP=1 groups (cuda:0, cuda:1) with the same 256
#             requests and with 256 per group (DP_LOAD_ARGS): split over two groups each GPU decodes at half
#             the batch, which costs nearly as much per step, so scaling is measured at the one-group load per group
#   peer      vLLM 0.26.0 with the same tensor_parallel_size on the 70B shape (bench/peer_vllm.py; needs vllm
#             importable)
#
#   NCCL_NVLS_ENABLE=0 TP=4 bash bench/tp_service.sh          # on a 4-GPU machine, from the repository root
#   STAGES="tp peer" TP=2 bash bench/tp_service.sh             # TP=2 where the cards hold 70B in two shards
#   STAGES="tp dp" TP_DEVICES=cpu,cpu DP_DEVICES="cpu cpu" TP_CONFIG=tiny.json DP_CONFIG=tiny.json \
#     WORKER_ARGS="--kv-cache-memory 64MiB" W1_ARGS="--w1 --num-requests 8 --input-len 32 --output-len 16" \
#     bash bench/tp_service.sh                                 # the mechanics on a CPU
#
# Results and logs land in ${OUT:-/tmp/ominix_tp}.
set -u
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ominix_tp}
mkdir -p "$OUT"
TP=${TP:-4}
gpus() { seq -s, -f "cuda:%g" 0 $(($1 - 1)); }
TP_DEVICES=${TP_DEVICES:-$(gpus "$TP")}
DP_DEVICES=${DP_DEVICES:-"cuda:0 cuda:1"}
RUN_ARGS=""  # extra bench/offline.py flags of one run_service call (after W1_ARGS: the last value wins)
STAGES=${STAGES:-"env tests nccl handoff tp dp peer"}
DP_RUNS=${DP_RUNS:-"dp1 dp2 dp2load"}  # which runs of the dp stage
TP_CONFIG=${TP_CONFIG:-bench/configs/llama70b-config.json}
DP_CONFIG=${DP_CONFIG:-bench/configs/llama8b-config.json}
WORKER_ARGS=${WORKER_ARGS:-"--max-model-len 2048"}
SERVE_ARGS=${SERVE_ARGS:-""}  # extra `ominix-runtime serve` flags
FRONT_PROCS=${FRONT_PROCS:-}  # front processes per run; unset: one per group, as `launch` on GPUs
SERVICE_S=${SERVICE_S:-420}
W1_ARGS=${W1_ARGS:-"--w1 --batch1 --num-requests 256 --input-len 512 --output-len 256 --batch1-trials 3"}
PEER_DIR=${PEER_DIR:-../shared/peers/vllm}
. bench/carried_wheels.sh
export PYTHONPATH=$OURS_PATH

# free_ports N: N distinct ports outside the ephemeral range (no other socket takes one first), one call for
# all the ports a start needs: separate calls may name the same port twice.
free_ports() { python3 bench/common.py free-port "$1"; }

# run_service NAME MODEL CONFIG GROUPS...: each GROUP is a comma-separated device list, one TP group (its size
# the list's length); serve drives them all; W1 and batch-1 through bench/offline.py; every process stopped.
run_service() {
  local name=$1 model=$2 config=$3; shift 3
  local eport pids=() watches=() workers=() g=0 total=0 ports
  read -r -a ports <<<"$(free_ports $((1 + 2 * $#)))"  # the engine's, then a leader and a dist port per group
  eport=${ports[0]}
  for devices in "$@"; do
    local leader=${ports[1 + 2 * g]} dist=${ports[2 + 2 * g]} rank=0 size
    IFS=, read -r -a devs <<<"$devices"
    size=${#devs[@]}
    total=$((total + size))
    for dev in "${devs[@]}"; do
      local log="$OUT/$name.g$g.r$rank.log" tpflags=""
      [ "$size" -gt 1 ] && tpflags="--tp-size $size --tp-rank $rank --dist-init-addr 127.0.0.1:$dist"
      timeout $((SERVICE_S + 600)) python3 -m ominix_runtime worker --model "$model" --device "$dev" \
        --port "$leader" $tpflags $WORKER_ARGS >"$log" 2>&1 &
      pids+=($!); watches+=(--watch "g$g.r$rank:$!:$log")
      rank=$((rank + 1))
    done
    workers+=(--worker "127.0.0.1:$leader")
    g=$((g + 1))
  done
  timeout $((SERVICE_S + 600)) python3 -m ominix_runtime serve --model "$model" "${workers[@]}" --port "$eport" \
    --metrics-port 0 --log-level warning --worker-ready-timeout 900 --front-procs "${FRONT_PROCS:-$g}" $SERVE_ARGS \
    >"$OUT/$name.engine.log" 2>&1 &
  pids+=($!); watches+=(--watch "engine:$!:$OUT/$name.engine.log")
  local started=$SECONDS
  if timeout 960 python3 bench/common.py wait-serving "127.0.0.1:$eport" --timeout 900 "${watches[@]}"; then
    echo "$name: SERVING after $((SECONDS - started)) s"
    timeout "$SERVICE_S" python3 bench/offline.py --address "127.0.0.1:$eport" --no-progress --no-request-details \
      --model-config "$config" --gpus "$total" --out-json "$OUT/$name.json" $W1_ARGS $RUN_ARGS 2>&1 \
      | grep -v -E "^(ITL|E2EL|peak|request throughput|total throughput|input tokens)" | tail -30
  else
    echo "$name: never SERVING (see above)"
  fi
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 60); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
}

for stage in $STAGES; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    env)
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>/dev/null
      nvidia-smi topo -m 2>/dev/null | head -8
      python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" ;;
    tests)
      timeout ${TESTS_S:-900} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_tensor_parallel_gpu.py \
        tests/gpu/test_moe_tensor_parallel_gpu.py 2>&1 | tail -8 ;;
    nccl)
      timeout 300 python3 bench/nccl_bus.py --size "$TP" --json "$OUT/nccl.json" 2>&1 | grep -v Warning | tail -3 ;;
    handoff)
      for args in "--running 256" "--running 1" "--running 0 --new 8 --prompt-len 512"; do
        timeout 120 python3 bench/tp_handoff.py --size "$TP" $args --steps 300 --interval-ms 10 2>&1 | grep '^{'
      done | tee "$OUT/handoff.jsonl" ;;
    tp)
      run_service "tp$TP" "dummy:$TP_CONFIG" "$TP_CONFIG" "$TP_DEVICES" ;;
    dp)
      read -r -a dp <<<"$DP_DEVICES"
      case " $DP_RUNS " in *" dp1 "*) run_service dp1 "dummy:$DP_CONFIG" "$DP_CONFIG" "${dp[0]}" ;; esac
      case " $DP_RUNS " in *" dp2 "*) run_service dp2 "dummy:$DP_CONFIG" "$DP_CONFIG" "${dp[@]}" ;; esac
      case " $DP_RUNS " in *" dp2load "*)
        RUN_ARGS=${DP_LOAD_ARGS:-"--num-requests $((256 * ${#dp[@]}))"}
        run_service dp2load "dummy:$DP_CONFIG" "$DP_CONFIG" "${dp[@]}"
        RUN_ARGS="" ;;
      esac ;;
    peer)
      if python3 -c "import vllm" 2>/dev/null; then
        # bench/peer_vllm.py turns off vLLM's custom all-reduce and its all-reduce fusion pass at TP > 1: with
        # only the first off, vLLM 0.26 TP=4 failed in CUDA-graph capture on an H100 x 4 machine. Full log kept.
        timeout ${PEER_S:-900} python3 bench/peer_vllm.py --config "$TP_CONFIG" --tp "$TP" \
          --json "$OUT/peer.json" >"$OUT/peer.log" 2>&1
        grep -E "^vLLM|Error" "$OUT/peer.log" | tail -8 | tee "$OUT/peer.txt"
      else
        echo "vllm is not importable here: see $PEER_DIR/README.md to carry it"
      fi ;;
  esac
done
echo "=== summary $(date -u +%FT%TZ)"
python3 - "$OUT" "$TP" <<'EOF'
import json, sys
from pathlib import Path
out, tp = Path(sys.argv[1]), sys.argv[2]
def fig(name, key):
    try:
        return json.loads((out / f"{name}.json").read_text())["figures"].get(key)
    except (OSError, ValueError, KeyError):
        return None
rows = [
    (f"70B TP={tp} W1 out tok/s", fig(f"tp{tp}", "w1_cold_out_tok_s")),
    (f"70B TP={tp} batch-1 TPOT ms", fig(f"tp{tp}", "batch1_tpot_ms")),
    ("8B one TP=1 group W1 out tok/s", fig("dp1", "w1_cold_out_tok_s")),
    ("8B two TP=1 groups W1 out tok/s", fig("dp2", "w1_cold_out_tok_s")),
    ("8B two TP=1 groups, W1 load per group, out tok/s", fig("dp2load", "w1_cold_out_tok_s")),
]
one, two, loaded = rows[2][1], rows[3][1], rows[4][1]
if one and two:
    rows.append(("DP scaling, same requests (two groups / one)", two / one))
if one and loaded:
    rows.append(("DP scaling, W1 load per group (two / one)", loaded / one))
try:
    nccl = json.loads((out / "nccl.json").read_text())
    big = max(nccl["all_reduce"], key=lambda r: r["bytes"])
    rows.append((f"NCCL bus bandwidth ({big['bytes'] >> 20} MiB) GB/s", big["bus_GBps"]))
    for batch, ms in nccl["decode_step_all_reduce_ms"].items():
        rows.append((f"all-reduce per decode step, batch {batch}, ms", ms))
except (OSError, ValueError, KeyError):
    pass
for name, value in rows:
    print(f"{name:<50} {'-' if value is None else f'{value:,.2f}'}")
peer = out / "peer.txt"
if peer.exists():
    print(peer.read_text().strip())
EOF
