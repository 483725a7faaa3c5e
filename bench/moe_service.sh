#!/usr/bin/env bash
# Mixture-of-experts on one GPU, Qwen3-30B-A3B shape with dummy weights (bench/configs/qwen3-30b-a3b-config.json):
#   tests    the MoE/FP8 GPU tests (fused MoE vs reference, FP8 GEMM, FP8 KV attention, CUDA graphs with MoE)
#   kernels  bench/tune_moe.py: tunes the fused-MoE tiles (writes the table under workers/ominix_worker/ops/
#            moe_configs/, bf16 then FP8) and prints the MoE time per decode step against the bandwidth floor of
#            the active experts' weights
#   bf16     W1 (256 x 512 x 256) and batch-1 TPOT through engine + worker (bench/gpu_service.sh's service stage)
#   fp8      the same with --quantization fp8 (per-channel FP8 weights, W8A8)
#
#   bash bench/moe_service.sh                                  # every stage, from the repository root
#   MOE_STAGES="kernels" bash bench/moe_service.sh             # one stage
#
# Results and logs land in ${OUT:-/tmp/ominix_moe}/<stage>/. Every stage is bounded by a timeout.
set -u
OUT=${OUT:-/tmp/ominix_moe}
CONFIG=${CONFIG:-bench/configs/qwen3-30b-a3b-config.json}
MOE_STAGES=${MOE_STAGES:-"tests kernels bf16 fp8"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/workers${PYTHONPATH:+:$PYTHONPATH}
for stage in $MOE_STAGES; do
  echo "=== moe $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)
      timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_fused_moe.py \
        tests/gpu/test_fused_moe_expert_parallel.py \
        tests/gpu/test_fp8_gemm.py tests/gpu/test_fp8_kv_attention.py tests/gpu/test_decode_graphs.py 2>&1 | tail -8 ;;
    kernels)
      mkdir -p "$OUT/kernels"
      timeout ${TUNE_S:-280} python3 bench/tune_moe.py --config "$CONFIG" --quick --write 2>&1 | tee "$OUT/kernels/bf16.txt"
      timeout ${TUNE_S:-280} python3 bench/tune_moe.py --config "$CONFIG" --quick --write --fp8 2>&1 \
        | tee "$OUT/kernels/fp8.txt" ;;
    bf16)
      OUT=$OUT/bf16 MODEL=dummy:$CONFIG CONFIG_JSON=$CONFIG STAGES="env service" bash bench/gpu_service.sh ;;
    fp8)
      OUT=$OUT/fp8 MODEL=dummy:$CONFIG CONFIG_JSON=$CONFIG WORKER_ARGS="--quantization fp8" STAGES="service" \
        bash bench/gpu_service.sh ;;
  esac
done
