#!/usr/bin/env bash
# Mixture-of-experts on one GPU, Qwen3-30B-A3B shape with dummy weights (bench/configs/qwen3-30b-a3b-config.json):
#   tests    the MoE/FP8 GPU tests (fused MoE vs reference, FP8 GEMM, FP8 KV attention, CUDA graphs with MoE)
#   kernels  bench/tune_moe.py: tunes the fused-MoE tiles (writes the table under workers/ominix_worker/ops/
#            moe_configs/, bf16 then FP8) and prints the MoE time per decode step against the bandwidth floor of
#            the active experts' weights
#   bf16     W1 (256 x 512 x 256) and batch-1 TPOT through engine + worker (bench/gpu_service.sh's service stage)
#   fp8      the same with --quantization fp8 (per-channel FP8 weights, W8A8)
#   peer-bf16, peer-fp8
#            vLLM beside bf16 / fp8 (bench/peer_vllm.py: W1 cold and again, batch-1 TPOT; `quantization="fp8"` for
#            peer-fp8), on the same machine right after ours; needs vllm importable (shared/peers/vllm/README.md).
#            Its dummy model gets unit RMSNorm weights (--unit-norms): with vLLM's ±1e-3 norms every decode token
#            routes to the same few experts, a lighter step than real weights (or ours) give
#   peer-fp8-stock
#            peer-fp8 on vLLM's dummy weights as they load (that few-expert routing)
#   llama8b-fp8, peer-llama8b-fp8
#            the same pair for the Llama-3.1-8B shape (bench/configs/llama8b-config.json) with FP8 weights
#
#   bash bench/moe_service.sh                                  # the default stages, from the repository root
#   MOE_STAGES="kernels" bash bench/moe_service.sh             # one stage
#   MOE_STAGES="llama8b-fp8 peer-llama8b-fp8" bash bench/moe_service.sh   # Llama-3.1-8B FP8 beside vLLM fp8
#
# MOE_WORKER_ARGS: extra worker flags of every stage of ours (e.g. "--max-batch-tokens 16384" with the same
# SERVE_ARGS, the budget vLLM's offline engine takes on these cards). Results and logs land in
# ${OUT:-/tmp/ominix_moe}/<stage>/. Every stage is bounded by a timeout.
set -u
OUT=${OUT:-/tmp/ominix_moe}
CONFIG=${CONFIG:-bench/configs/qwen3-30b-a3b-config.json}
LLAMA8B=${LLAMA8B:-bench/configs/llama8b-config.json}
MOE_STAGES=${MOE_STAGES:-"tests kernels bf16 fp8"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/workers${PYTHONPATH:+:$PYTHONPATH}
# vLLM on the same GPU once ours has stopped: config, output folder, then bench/peer_vllm.py's own flags.
peer() {
  local config=$1 out=$2
  shift 2
  mkdir -p "$out"
  if python3 -c "import vllm" 2>/dev/null; then
    timeout ${PEER_S:-600} python3 bench/peer_vllm.py --config "$config" --json "$out/peer_vllm.json" "$@" 2>&1 \
      | grep -E "^vLLM|Error|error" | tail -8 | tee "$out/peer_vllm.txt"
  else
    echo "vllm is not importable here: see shared/peers/vllm/README.md to carry it"
  fi
}
for stage in $MOE_STAGES; do
  echo "=== moe $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)
      timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_fused_moe.py \
        tests/gpu/test_fused_moe_expert_parallel.py \
        tests/gpu/test_fp8_gemm.py tests/gpu/test_fp8_kv_attention.py tests/gpu/test_decode_graphs.py \
        tests/gpu/test_fp8_tensor_parallel_gpu.py 2>&1 | tail -8 ;;
    kernels)
      mkdir -p "$OUT/kernels"
      timeout ${TUNE_S:-280} python3 bench/tune_moe.py --config "$CONFIG" --quick --write 2>&1 | tee "$OUT/kernels/bf16.txt"
      timeout ${TUNE_S:-280} python3 bench/tune_moe.py --config "$CONFIG" --quick --write --fp8 2>&1 \
        | tee "$OUT/kernels/fp8.txt" ;;
    bf16)
      OUT=$OUT/bf16 MODEL=dummy:$CONFIG CONFIG_JSON=$CONFIG WORKER_ARGS="${MOE_WORKER_ARGS:-}" STAGES="env service" bash bench/gpu_service.sh ;;
    fp8)
      OUT=$OUT/fp8 MODEL=dummy:$CONFIG CONFIG_JSON=$CONFIG WORKER_ARGS="--quantization fp8 ${MOE_WORKER_ARGS:-}" STAGES="service" \
        bash bench/gpu_service.sh ;;
    peer-bf16)
      peer "$CONFIG" "$OUT/bf16" --vocab 150000 --unit-norms ;;
    peer-fp8)
      peer "$CONFIG" "$OUT/fp8" --vocab 150000 --quantization fp8 --unit-norms ;;
    peer-fp8-stock)
      peer "$CONFIG" "$OUT/fp8-stock" --vocab 150000 --quantization fp8 ;;
    llama8b-fp8)
      OUT=$OUT/llama8b-fp8 MODEL=dummy:$LLAMA8B CONFIG_JSON=$LLAMA8B \
        WORKER_ARGS="--quantization fp8 ${MOE_WORKER_ARGS:-}" STAGES="service" bash bench/gpu_service.sh ;;
    peer-llama8b-fp8)
      peer "$LLAMA8B" "$OUT/llama8b-fp8" --quantization fp8 ;;
    *)
      echo "unknown stage $stage" ;;
  esac
done
