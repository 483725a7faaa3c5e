#!/usr/bin/env bash
# gpt-oss on one GPU, gpt-oss-20b shape with dummy bf16 weights (bench/configs/gpt-oss-20b-config.json):
#   tests    the gpt-oss GPU tests (Triton attention with sinks and windows vs the torch reference, the biased
#            experts vs the float64 reference, the tiny model vs transformers, decode graphs vs eager)
#   w1       W1 (256 x 512 x 256), batch-1 TPOT and shared prefix through engine + worker
#            (bench/gpu_service.sh's service stage)
#   long     the long-context workload: 64 requests x 8,192 prompt tokens x 256 out, all at once; the worker's
#            log states its KV pools (full-attention and 128-token window). LONG_ARGS go on to
#            `ominix-runtime launch` (e.g. "--max-batch-tokens 16384", vLLM's offline step budget)
#   long-probe
#            the long-context shape through engine + worker with the step probe (bench/gpu_service.sh's service
#            stage): its profile run's windows are a prefill step (16,384 tokens with LONG_ARGS="--max-batch-tokens
#            16384") and pure decode at batch 64 with ~8,200 tokens of context; kernels per step in summary.txt
#   peer-w1, peer-long
#            vLLM on the same workloads (bench/peer_vllm.py), on the same machine once ours has stopped. vLLM's
#            dummy weights are redrawn as ours are (--ours-init): with its own, even with unit norms, a decode
#            batch of 64 went to 4 of the 32 experts in every layer
#   routing  distinct experts a decode batch of 64 routes to per layer (bench/moe_routing.py), ours and, where it
#            is importable, vLLM's dummy model drawn as ours: a decode step reads every expert it hits
#   peer-long-profile
#            vLLM's kernels on the long-context shape (bench/peer_vllm_profile.py): one generate of 16 x 8,192
#            prompts (its prefill steps), then 64 cached prompts decoding 32 tokens (`--again`: decode steps)
#
#   bash bench/gpt_oss_service.sh                              # every stage, from the repository root
#   GPT_OSS_STAGES="long" bash bench/gpt_oss_service.sh        # one stage
#
# Results and logs land in ${OUT:-/tmp/ominix_gpt_oss}/<stage>/. Every stage is bounded by a timeout.
set -u
OUT=${OUT:-/tmp/ominix_gpt_oss}
CONFIG=${CONFIG:-bench/configs/gpt-oss-20b-config.json}
GPT_OSS_STAGES=${GPT_OSS_STAGES:-"tests w1 long peer-w1 peer-long"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/carried_wheels.sh  # also for the long stage's client (grpc_health)
export PYTHONPATH=$OURS_PATH
# vLLM once ours has stopped (on the machine's own packages, not the carried wheels): output folder, then
# bench/peer_vllm.py's own flags.
peer() {
  local out=$1
  shift
  mkdir -p "$out"
  if python3 -c "import vllm" 2>/dev/null; then
    PYTHONPATH=$PWD timeout ${PEER_S:-600} python3 bench/peer_vllm.py --config "$CONFIG" --vocab 199000 \
      --json "$out/peer_vllm.json" --ours-init "$@" >"$out/peer_vllm.log" 2>&1
    grep -E "^vLLM|Error" "$out/peer_vllm.log" | tail -8 | tee "$out/peer_vllm.txt"
  else
    echo "vllm is not importable here: see shared/peers/vllm/README.md to carry it"
  fi
}
for stage in $GPT_OSS_STAGES; do
  echo "=== gpt-oss $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)
      timeout ${TESTS_S:-500} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_triton_sinks.py \
        tests/gpu/test_biased_moe.py tests/gpu/test_gpt_oss_gpu.py 2>&1 | tail -8 ;;
    w1)
      OUT=$OUT/w1 MODEL=dummy:$CONFIG CONFIG_JSON=$CONFIG STAGES="env service" bash bench/gpu_service.sh ;;
    long)
      mkdir -p "$OUT/long"
      timeout ${LONG_S:-900} python3 bench/offline.py --launch --model "dummy:$CONFIG" --devices cuda:0 --w1 \
        --num-requests 64 --input-len 8192 --output-len 256 --no-progress --no-request-details \
        --ready-timeout 600 --out-json "$OUT/long/offline.json" ${LONG_ARGS:-} 2>&1 | tee "$OUT/long/offline.txt" \
        | tail -40 ;;
    long-probe)
      OUT=$OUT/long-probe MODEL=dummy:$CONFIG CONFIG_JSON=$CONFIG WORKER_ARGS="${LONG_ARGS:-}" \
        SERVE_ARGS="--front-procs 1 ${LONG_ARGS:-}" OMINIX_PROFILE_BATCHES=64 \
        OFFLINE_ARGS="--num-requests 64 --input-len 8192 --output-len 96" \
        PROFILE_ARGS="--w1 --warmup-requests 0 --seed 17" STAGES="service" bash bench/gpu_service.sh ;;
    routing)
      mkdir -p "$OUT/routing"
      for engine in ours vllm; do
        if [ $engine = vllm ] && ! python3 -c "import vllm" 2>/dev/null; then continue; fi
        PYTHONPATH=$PWD timeout ${PEER_S:-600} python3 bench/moe_routing.py --engine $engine --config "$CONFIG" \
          --vocab 199000 --num-requests 64 $([ $engine = vllm ] && echo --ours-init) \
          >"$OUT/routing/$engine.log" 2>&1
        grep -E '^\{' "$OUT/routing/$engine.log" | tail -1 | tee "$OUT/routing/$engine.json" | cut -c1-400
      done ;;
    peer-w1)
      peer "$OUT/w1" ;;
    peer-long)
      peer "$OUT/long" --num-requests 64 --input-len 8192 --output-len 256 --max-model-len 8448 --no-again \
        --no-batch1 --no-shared-prefix ;;
    peer-long-profile)
      mkdir -p "$OUT/long-probe"
      for run in "prefill --num-requests 16 --output-len 8" "decode --num-requests 64 --output-len 32 --again"; do
        set -- $run
        PYTHONPATH=$PWD timeout ${PEER_S:-600} python3 bench/peer_vllm_profile.py --config "$CONFIG" --vocab 199000 \
          --ours-init --input-len 8192 --max-model-len 8448 --top 25 "${@:2}" >"$OUT/long-probe/peer_$1.log" 2>&1
        grep -E '^\{' "$OUT/long-probe/peer_$1.log" | tee "$OUT/long-probe/peer_$1.json" | cut -c1-600
      done ;;
  esac
done
